"""Vision Transformer model package: config, model, builders, resampling, conversion, I/O."""
from .attention import attention_maps
from .build import build_model, build_vit, make_config
from .convert import convert_state_dict
from .io import load_model, save_config, save_model
from .resample import resample_patch_embed, resample_pos_embed
from .vit import VisionTransformer
from .vit_config import PRESETS, ViTConfig

__all__ = [
    "ViTConfig",
    "VisionTransformer",
    "PRESETS",
    "build_model",
    "build_vit",
    "make_config",
    "resample_pos_embed",
    "resample_patch_embed",
    "convert_state_dict",
    "attention_maps",
    "save_model",
    "save_config",
    "load_model",
]

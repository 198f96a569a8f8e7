"""Vision Transformer model package: config, model, builders, resampling, conversion, I/O.

The names below are imported on first use (PEP 562): checking params needs :mod:`.vit_config` alone,
and a process that only checks them (the shard stage) then does not load torch (~1.5 s on 2 cores).
"""
from __future__ import annotations

from pipeline.utils import lazy_exports

_EXPORTS = {"ViTConfig": "vit_config", "PRESETS": "vit_config", "make_config": "vit_config",
            "VisionTransformer": "vit", "build_model": "build", "build_vit": "build",
            "resample_pos_embed": "resample", "resample_patch_embed": "resample",
            "convert_state_dict": "convert", "attention_maps": "attention",
            "save_model": "io", "save_config": "io", "load_model": "io"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)

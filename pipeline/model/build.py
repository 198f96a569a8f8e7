"""Build a model from a named preset plus the few knobs a training config sets."""
from __future__ import annotations

from .vit import VisionTransformer
from .vit_config import ModelSection, make_config, section_config

__all__ = ["build_model", "build_vit"]


def build_vit(preset: str, *, weight_init: str = "timm", **kwargs) -> VisionTransformer:
    """``build_vit("tiny", patch_size=16, image_size=224, num_classes=1000)``: a model from
    :func:`make_config`'s arguments (see there), its weights drawn as ``weight_init`` says.

    Raises ValueError for an unknown preset or override, listing the valid names.
    """
    return VisionTransformer(make_config(preset, **kwargs), weight_init=weight_init)


def build_model(model: ModelSection, *, image_size, num_classes: int, patch_size=None) -> VisionTransformer:
    """The network of :func:`section_config`, its weights drawn as ``model.weight_init`` says."""
    return VisionTransformer(section_config(model, image_size=image_size, num_classes=num_classes,
                                            patch_size=patch_size), weight_init=model.weight_init)

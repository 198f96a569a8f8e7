"""Build a model from a named preset plus the few knobs a training config sets."""
from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from .vit import VisionTransformer
from .vit_config import PRESETS, ViTConfig

__all__ = ["build_model", "build_vit", "make_config", "section_config"]


class ModelSection(Protocol):
    """What the model package reads of params.yaml's ``model`` section (``pipeline.config.ModelConfig``),
    named here so that the model package depends on nothing above it."""

    preset: str
    patch_size: int
    pool: str
    drop_path_rate: float
    weight_init: str

    def overrides(self) -> dict[str, Any]: ...


def make_config(
    preset: str,
    *,
    patch_size,
    image_size,
    num_classes: int,
    **overrides,
) -> ViTConfig:
    """Preset widths + explicit geometry + ``overrides`` (ViTConfig field names)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {sorted(PRESETS)}")
    valid = {f.name for f in dataclasses.fields(ViTConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"unknown override(s) {unknown}; valid ViTConfig fields: {sorted(valid)}")
    fields = dict(PRESETS[preset])
    fields.update(patch_size=patch_size, image_size=image_size, num_classes=num_classes, **overrides)
    return ViTConfig(**fields)


def build_vit(preset: str, *, weight_init: str = "timm", **kwargs) -> VisionTransformer:
    """``build_vit("tiny", patch_size=16, image_size=224, num_classes=1000)``: a model from
    :func:`make_config`'s arguments (see there), its weights drawn as ``weight_init`` says.

    Raises ValueError for an unknown preset or override, listing the valid names.
    """
    return VisionTransformer(make_config(preset, **kwargs), weight_init=weight_init)


def section_config(model: ModelSection, *, image_size, num_classes: int, patch_size=None) -> ViTConfig:
    """params.yaml's ``model`` section at one geometry (``patch_size``: ``model.patch_size`` if None).

    The one place the section becomes a :class:`ViTConfig` (the stages and benchmarks build from it,
    ``pipeline.config.validate`` checks with it), so a new ``model.*`` key is wired once.
    """
    return make_config(model.preset, patch_size=patch_size or model.patch_size, image_size=image_size,
                       num_classes=num_classes, pool=model.pool, drop_path_rate=model.drop_path_rate,
                       **model.overrides())


def build_model(model: ModelSection, *, image_size, num_classes: int, patch_size=None) -> VisionTransformer:
    """The network of :func:`section_config`, its weights drawn as ``model.weight_init`` says."""
    return VisionTransformer(section_config(model, image_size=image_size, num_classes=num_classes,
                                            patch_size=patch_size), weight_init=model.weight_init)

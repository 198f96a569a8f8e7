"""torchvision.transforms.v2 pipelines built from the ``augment`` dict of params.yaml.

Validation lives here so a typo in ``augment`` fails when the loader is built, not mid-epoch.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms import v2

AUGMENT_DEFAULTS: dict[str, Any] = {
    "mean": [0.5, 0.5, 0.5],
    "std": [0.5, 0.5, 0.5],
    "random_resized_crop": None,
    "hflip": 0.0,
    "auto_augment": None,
    "random_erasing": 0.0,
    "interpolation": "bicubic",
}
AUTO_AUGMENTS = (None, "randaugment", "trivialaugment")
INTERPOLATIONS = {
    "nearest": InterpolationMode.NEAREST,
    "bilinear": InterpolationMode.BILINEAR,
    "bicubic": InterpolationMode.BICUBIC,
    "area": InterpolationMode.BOX,  # PIL's BOX filter is area averaging
}


def resolve_augment(augment: Optional[dict]) -> dict[str, Any]:
    """Merge ``augment`` over the defaults; unknown keys or bad values raise ValueError."""
    augment = dict(augment or {})
    unknown = sorted(set(augment) - set(AUGMENT_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown augment key(s) {unknown}; valid keys: {sorted(AUGMENT_DEFAULTS)}")
    cfg = {**AUGMENT_DEFAULTS, **{k: v for k, v in augment.items() if v is not None}}
    for key in ("mean", "std"):
        if len(cfg[key]) != 3:
            raise ValueError(f"augment.{key} must have 3 values (RGB), got {cfg[key]!r}")
    if any(s <= 0 for s in cfg["std"]):
        raise ValueError(f"augment.std must be > 0, got {cfg['std']!r}")
    rrc = cfg["random_resized_crop"]
    if rrc is not None and (len(rrc) != 2 or not 0 < rrc[0] <= rrc[1] <= 1):
        raise ValueError(f"augment.random_resized_crop must be null or [min_scale, max_scale] "
                         f"with 0 < min <= max <= 1, got {rrc!r}")
    for key in ("hflip", "random_erasing"):
        if not 0.0 <= float(cfg[key]) <= 1.0:
            raise ValueError(f"augment.{key} is a probability in [0, 1], got {cfg[key]!r}")
    if cfg["auto_augment"] not in AUTO_AUGMENTS:
        raise ValueError(f"augment.auto_augment={cfg['auto_augment']!r}; valid: {list(AUTO_AUGMENTS)}")
    if cfg["interpolation"] not in INTERPOLATIONS:
        raise ValueError(f"augment.interpolation={cfg['interpolation']!r}; valid: {sorted(INTERPOLATIONS)}")
    return cfg


def _tail(cfg: dict) -> list:
    """PIL image -> normalised float32 CHW tensor."""
    return [v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(mean=list(cfg["mean"]), std=list(cfg["std"]))]


def eval_transform(image_size: int, augment: Optional[dict] = None) -> v2.Compose:
    """Resize (short side) + centre crop + normalise: deterministic, so eval is comparable."""
    cfg = resolve_augment(augment)
    interp = INTERPOLATIONS[cfg["interpolation"]]
    return v2.Compose([v2.Resize(image_size, interpolation=interp, antialias=True),
                       v2.CenterCrop(image_size), *_tail(cfg)])


def train_transform(image_size: int, augment: Optional[dict] = None) -> v2.Compose:
    """Geometric + colour augmentation on the PIL image (cheap at small sizes), then normalise."""
    cfg = resolve_augment(augment)
    interp = INTERPOLATIONS[cfg["interpolation"]]
    if cfg["random_resized_crop"] is None:
        ops = [v2.Resize(image_size, interpolation=interp, antialias=True), v2.CenterCrop(image_size)]
    else:
        ops = [v2.RandomResizedCrop(image_size, scale=tuple(cfg["random_resized_crop"]),
                                    interpolation=interp, antialias=True)]
    if cfg["hflip"] > 0:
        ops.append(v2.RandomHorizontalFlip(p=float(cfg["hflip"])))
    aa_interp = InterpolationMode.BILINEAR if interp == InterpolationMode.BOX else interp
    if cfg["auto_augment"] == "randaugment":
        ops.append(v2.RandAugment(interpolation=aa_interp))
    elif cfg["auto_augment"] == "trivialaugment":
        ops.append(v2.TrivialAugmentWide(interpolation=aa_interp))
    ops += _tail(cfg)
    if cfg["random_erasing"] > 0:
        ops.append(v2.RandomErasing(p=float(cfg["random_erasing"])))
    return v2.Compose(ops)

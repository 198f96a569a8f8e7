"""The ``augment`` section of params.yaml: its keys, defaults and choices, and their checks.

Without torch or torchvision: params are checked (``pipeline.config``) by processes that never load an image,
such as the shard stage and a training stage's driver. :mod:`.transforms` builds the pipelines from these.
"""
from __future__ import annotations

import math
from typing import Any, Optional

AUGMENT_DEFAULTS: dict[str, Any] = {
    "mean": [0.5, 0.5, 0.5],
    "std": [0.5, 0.5, 0.5],
    "random_resized_crop": None,
    "random_crop": None,
    "hflip": 0.0,
    "auto_augment": None,
    "random_erasing": 0.0,
    "interpolation": "bicubic",
    "decode": "loader",
}
DECODES = ("loader", "device")  # augment.decode: where train JPEGs are decoded, cropped and flipped
AUTOAUGMENT_CIFAR10 = "autoaugment-cifar10"  # torchvision's AutoAugment with its CIFAR-10 policy
# augment.auto_augment: torchvision's RandAugment, TrivialAugmentWide, AutoAugment with its CIFAR-10 policy
AUTO_AUGMENTS = (None, "randaugment", "trivialaugment", AUTOAUGMENT_CIFAR10)
INTERPOLATION_CHOICES = ("nearest", "bilinear", "bicubic")  # what torchvision resizes uint8 tensors with


DATASET = "dataset"  # augment.mean / augment.std: the train split's pixel stats from dataset.json


def with_dataset_stats(augment: Optional[dict], info: dict) -> dict:
    """``augment`` with ``mean`` / ``std`` given as ``"dataset"`` replaced by dataset.json's
    ``pixel_stats`` (per-channel, train split, computed at shard time)."""
    augment = dict(augment or {})
    wanted = [k for k in ("mean", "std") if augment.get(k) == DATASET]
    if wanted and "pixel_stats" not in info:
        raise ValueError(f"augment.{wanted[0]}: 'dataset' needs pixel_stats in dataset.json, which shards "
                         f"written before this feature lack; re-run the shard stage")
    return {**augment, **{k: list(info["pixel_stats"][k]) for k in wanted}}


def _is_number(value: Any) -> bool:
    """A finite int or float (not a bool, a string or a list): what an augment number must be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_numbers(value: Any, n: int) -> bool:
    """A list of ``n`` numbers (:func:`_is_number`)."""
    return isinstance(value, (list, tuple)) and len(value) == n and all(map(_is_number, value))


def resolve_augment(augment: Optional[dict], *, allow_dataset: bool = False) -> dict[str, Any]:
    """Merge ``augment`` over the defaults; unknown keys or bad values raise ValueError.

    ``mean`` / ``std`` may be ``"dataset"`` only with ``allow_dataset`` (checking params before the
    shards exist); loaders need numbers, see :func:`with_dataset_stats`.
    """
    augment = dict(augment or {})
    unknown = sorted(map(str, set(augment) - set(AUGMENT_DEFAULTS)))
    if unknown:
        raise ValueError(f"unknown augment key(s) {unknown}; valid keys: {sorted(AUGMENT_DEFAULTS)}")
    cfg = {**AUGMENT_DEFAULTS, **{k: v for k, v in augment.items() if v is not None}}
    for key in ("mean", "std"):
        if cfg[key] == DATASET and allow_dataset:
            continue
        if not _is_numbers(cfg[key], 3):
            raise ValueError(f"augment.{key} must be 3 numbers (RGB) or 'dataset', got {cfg[key]!r}")
    if cfg["std"] != DATASET and any(s <= 0 for s in cfg["std"]):
        raise ValueError(f"augment.std must be > 0, got {cfg['std']!r}")
    rrc = cfg["random_resized_crop"]
    if rrc is not None and (not _is_numbers(rrc, 2) or not 0 < rrc[0] <= rrc[1] <= 1):
        raise ValueError(f"augment.random_resized_crop must be null or [min_scale, max_scale] "
                         f"with 0 < min <= max <= 1, got {rrc!r}")
    pad = cfg["random_crop"]
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
        raise ValueError(f"augment.random_crop must be null or the padding in pixels (an int >= 0), got {pad!r}")
    if pad is not None and rrc is not None:
        raise ValueError(f"augment.random_crop={pad!r} and random_resized_crop={rrc!r}: choose one crop "
                         f"(set the other to null)")
    for key in ("hflip", "random_erasing"):
        if not _is_number(cfg[key]) or not 0.0 <= cfg[key] <= 1.0:
            raise ValueError(f"augment.{key} must be a probability, a number in [0, 1], got {cfg[key]!r}")
    if cfg["auto_augment"] not in AUTO_AUGMENTS:
        raise ValueError(f"augment.auto_augment={cfg['auto_augment']!r}; valid: {list(AUTO_AUGMENTS)}")
    if not isinstance(cfg["interpolation"], str) or cfg["interpolation"] not in INTERPOLATION_CHOICES:
        raise ValueError(f"augment.interpolation={cfg['interpolation']!r}; valid: {sorted(INTERPOLATION_CHOICES)}")
    if not isinstance(cfg["decode"], str) or cfg["decode"] not in DECODES:
        raise ValueError(f"augment.decode={cfg['decode']!r}; valid: {list(DECODES)}")
    if cfg["decode"] == "device" and cfg["auto_augment"] is not None:
        raise ValueError(f"augment.decode=device and auto_augment={cfg['auto_augment']!r}: auto-augment runs in "
                         f"the loader workers, on decoded pixels; set auto_augment to null or decode to loader")
    return cfg


def eval_augment(meta: dict) -> dict:
    """The eval preprocessing a model's config.json records: its mean / std and the resize its training and
    validation used (models saved before ``interpolation`` was recorded: the default)."""
    augment = dict(meta["normalize"])
    if "interpolation" in meta:
        augment["interpolation"] = meta["interpolation"]
    return augment

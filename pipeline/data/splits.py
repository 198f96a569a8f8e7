"""Seeded, stratified train/val/test carve-out shared by every source.

Splits are decided from labels alone (before any image is read), so sharding can stream.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import numpy as np

from pipeline.utils import shown

SPLITS = ("train", "val", "test")


@dataclass
class Record:
    """One image to write: ``load()`` returns encoded bytes (kept as-is) or a uint8 array (PNG-encoded)."""

    split: str
    label: int
    source_path: str
    load: Callable[[], Union[bytes, np.ndarray]]


@dataclass
class SourceListing:
    """What a source will write: class names, record count and a lazy record stream."""

    classes: list[str]
    total: int
    records: Any  # Iterable[Record], consumed once
    given_splits: list[str]


def _can_stratify(labels: np.ndarray, n_take: int) -> bool:
    counts = np.bincount(labels)
    counts = counts[counts > 0]
    return counts.size > 0 and counts.min() >= 2 and counts.size <= n_take <= labels.size - counts.size


def take_fraction(idx: np.ndarray, labels: np.ndarray, frac: float, seed: int,
                  key: str = "fraction") -> tuple[np.ndarray, np.ndarray]:
    """Split ``idx`` into (rest, taken) with ``frac`` taken, stratified when every class allows it; ``key``
    (the params key behind ``frac``) is named when it would take every image."""
    if frac <= 0 or idx.size == 0:
        return idx, idx[:0]
    n_take = math.ceil(frac * idx.size - 1e-9)  # 0.15 * 100 is 15.000000000000002 in floating point: 15, not 16
    if n_take >= idx.size:
        raise ValueError(f"{key} takes {n_take} of the {idx.size} image(s) left to it, leaving none to train "
                         f"on: add images, or lower {key}")
    from sklearn.model_selection import train_test_split  # 2-3 s to import: only sharding pays it, not every stage

    y = labels[idx]
    strat = y if _can_stratify(y, n_take) else None
    rest, taken = train_test_split(idx, test_size=n_take, random_state=seed, shuffle=True, stratify=strat)
    return np.asarray(rest), np.asarray(taken)


def carve_splits(labels: np.ndarray, seed: int, val_fraction: float, test_fraction: float,
                 given: Optional[dict[str, np.ndarray]] = None) -> dict[str, np.ndarray]:
    """Indices per split, each in a seeded shuffled order (so shards mix classes).

    ``given`` maps split -> indices for sources with their own splits; a missing ``val`` is then
    carved from ``train`` (``val_fraction`` of it) and a missing ``test`` is left empty.
    """
    labels = np.asarray(labels, dtype=np.int64)
    if given is None:
        rest, test = take_fraction(np.arange(labels.size), labels, test_fraction, seed, "test_fraction")
        val_frac = val_fraction / (1.0 - test_fraction) if test_fraction < 1 else 0.0
        train, val = take_fraction(rest, labels, val_frac, seed + 1, "val_fraction")
        out = {"train": train, "val": val, "test": test}
    else:
        out = {s: np.asarray(given.get(s, np.zeros(0, np.int64)), dtype=np.int64) for s in SPLITS}
        if "val" not in given:
            out["train"], out["val"] = take_fraction(out["train"], labels, val_fraction, seed + 1,
                                                     "val_fraction")
    for k, split in enumerate(SPLITS):
        ordered = np.sort(out[split])
        out[split] = ordered[np.random.default_rng([seed, k]).permutation(ordered.size)]
    return out


def check_fraction(key: str, value: float) -> None:
    """A fraction of the images (val, test, allowed undecodable) is in [0, 1): at 1 nothing is left to train on.

    The one definition of that range: the params check and the shard stage both call this.
    """
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{key}: {shown(value)} must be in [0, 1)")


EMPTY_SPLIT_EFFECT = {"val": "training's val_loss / val_top1 (and keep: best) have nothing to measure",
                      "test": "the evaluate and export stages have no test images"}


def lacks_given_test(info: dict, split: str) -> bool:
    """``split`` is a test split left empty by a source with splits of its own but no test one: no
    fraction fills it (a missing val is carved from train; a missing test is not)."""
    return split == "test" and bool(info["given_splits"]) and "test" not in info["given_splits"]


def why_empty(info: dict, split: str) -> str:
    """Why ``dataset.json`` (``info``) counts no ``split`` samples."""
    if lacks_given_test(info, split):
        return "the source has no test split; test_fraction applies only to sources without splits of their own"
    return f"{split}_fraction is {info['params'][f'{split}_fraction']}"


def check_fractions(val_fraction: float, test_fraction: float) -> None:
    """Reject fractions that would leave no training data."""
    check_fraction("val_fraction", val_fraction)
    check_fraction("test_fraction", test_fraction)
    if val_fraction + test_fraction >= 1.0:
        raise ValueError(f"val_fraction + test_fraction = {val_fraction + test_fraction} must be < 1")


def split_of_index(splits: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Per-sample split id (index into SPLITS) for sources that must be read in their own order."""
    out = np.full(n, -1, dtype=np.int8)
    for k, split in enumerate(SPLITS):
        out[splits[split]] = k
    return out

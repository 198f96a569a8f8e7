"""Sources: each turns its input into a :class:`Plan` (class names + lazy, split-assigned records).

Listing is cheap (paths/labels only); pixels are read by the writer, so memory stays bounded.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .splits import SPLITS, Plan, Record, carve_splits


def resolve_classes(class_names: Optional[Sequence[str]], default: Sequence[str], where: str) -> list[str]:
    """``class_names`` overrides the source's names but must match their number."""
    if class_names is None:
        return [str(c) for c in default]
    names = [str(c) for c in class_names]
    if len(names) != len(default):
        raise ValueError(f"class_names has {len(names)} names but {where} has {len(default)} classes")
    if len(set(names)) != len(names):
        raise ValueError(f"class_names contains duplicates: {names}")
    return names


def check_labels(labels: np.ndarray, classes: Sequence[str], where: str) -> None:
    """Every label must name a class and every class must have at least one sample."""
    labels = np.asarray(labels)
    bad = labels[(labels < 0) | (labels >= len(classes))]
    if bad.size:
        raise ValueError(f"{where}: label {int(bad[0])} is unknown; valid labels are 0..{len(classes) - 1} "
                         f"({len(classes)} classes)")
    counts = np.bincount(labels.astype(np.int64), minlength=len(classes))
    empty = [classes[i] for i in np.flatnonzero(counts == 0)]
    if empty:
        raise ValueError(f"{where}: class(es) {empty} have no samples; every class needs at least one")


def records_from_splits(splits: dict[str, np.ndarray], labels: np.ndarray, path_of, load_of):
    """Lazy record stream in split order then shuffled index order."""
    for split in SPLITS:
        for i in splits[split]:
            i = int(i)
            yield Record(split, int(labels[i]), path_of(i), load_of(i))


def digits_plan(*, seed, val_fraction, test_fraction, class_names, **_) -> Plan:
    """scikit-learn's bundled 8x8 digits: values 0..16 scaled to uint8 grayscale, written as PNG."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.clip(np.round(d.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    labels = d.target.astype(np.int64)
    classes = resolve_classes(class_names, [str(i) for i in range(10)], "digits")
    splits = carve_splits(labels, seed, val_fraction, test_fraction)
    records = records_from_splits(splits, labels, lambda i: f"sklearn:load_digits#{i}",
                                  lambda i: (lambda: images[i]))
    return Plan(classes, int(labels.size), records, [])


def build_plan(source: str, **kw) -> Plan:
    """Dispatch to the source's planner (imported lazily: each pulls different dependencies)."""
    if source == "digits":
        return digits_plan(**kw)
    if source == "imagefolder":
        from .folder import imagefolder_plan
        return imagefolder_plan(**kw)
    if source == "parquet":
        from .parquet_source import parquet_plan
        return parquet_plan(**kw)
    if source == "cifar":
        from .cifar import cifar_plan
        return cifar_plan(**kw)
    if source == "fractals":
        from .fractals import fractals_plan
        return fractals_plan(**kw)
    raise ValueError(f"unknown source {source!r}; valid: {list(SOURCES)}")


SOURCES = ("digits", "fractals", "imagefolder", "parquet", "cifar")

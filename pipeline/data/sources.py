"""Sources: each turns its input into a :class:`Plan` (class names + lazy, split-assigned records).

Listing is cheap (paths/labels only); pixels are read by the writer, so memory stays bounded.
"""
from __future__ import annotations

import numpy as np

from .records import records_from_splits, resolve_classes
from .splits import Plan, carve_splits


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

"""Sources: each turns its input into a :class:`SourceListing` (class names + lazy, split-assigned records).

Listing is cheap (paths/labels only); pixels are read by the writer, so memory stays bounded.
"""
from __future__ import annotations

import numpy as np

from .records import records_from_splits, resolve_classes
from .splits import SourceListing, carve_splits


def digits_listing(*, seed, val_fraction, test_fraction, class_names, **_) -> SourceListing:
    """scikit-learn's bundled 8x8 digits: values 0..16 scaled to uint8 grayscale, written as PNG."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.clip(np.round(d.images * (255.0 / 16.0)), 0, 255).astype(np.uint8)
    labels = d.target.astype(np.int64)
    classes = resolve_classes(class_names, [str(i) for i in range(10)], "digits")
    splits = carve_splits(labels, seed, val_fraction, test_fraction)
    records = records_from_splits(splits, labels, lambda i: f"sklearn:load_digits#{i}",
                                  lambda i: (lambda: images[i]))
    return SourceListing(classes, int(labels.size), records, [])


def list_source(source: str, **kw) -> SourceListing:
    """Dispatch to the source's lister (imported lazily: each pulls different dependencies)."""
    if source == "digits":
        return digits_listing(**kw)
    if source == "imagefolder":
        from .folder import imagefolder_listing
        return imagefolder_listing(**kw)
    if source == "parquet":
        from .parquet_source import parquet_listing
        return parquet_listing(**kw)
    if source == "cifar":
        from .cifar_source import cifar_listing
        return cifar_listing(**kw)
    if source == "fractals":
        from .fractals import fractals_listing
        return fractals_listing(**kw)
    raise ValueError(f"unknown source {source!r}; valid: {list(SOURCES)}")


SOURCES = ("digits", "fractals", "imagefolder", "parquet", "cifar")
ROOTED = ("imagefolder", "parquet", "cifar")  # the sources that read ``root``; the others are built in

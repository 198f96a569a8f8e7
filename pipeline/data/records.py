"""Helpers every source uses to turn its listing into labelled, split-assigned records.

They sit below the sources (and below ``sources.py``, which dispatches to them), so no source imports
back from the module that imports it.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import numpy as np

from pipeline.utils import shown

from .splits import SPLITS, Record

# Directory names a source may give its splits in, and the split each stands for.
SPLIT_DIRS = {"train": "train", "val": "val", "valid": "val", "validation": "val", "dev": "val", "test": "test"}


def check_split_names(names: list[str], splits: list, where: str) -> None:
    """Beside a ``train`` directory or file, every other must name a split too: else one unknown name
    (``holdout/``) would turn the split directories into classes, or pool the given splits and carve
    them anew. And split names without a train one (``val/`` + ``test/``) are refused, not read as classes."""
    if "train" in splits and not all(splits):
        other = [n for n, s in zip(names, splits) if not s]
        raise ValueError(f"{where}: {other} beside the split(s) {sorted({s for s in splits if s})} name no split "
                         f"(split names: {', '.join(SPLIT_DIRS)}); rename or move them")
    if any(splits) and "train" not in splits:  # read as classes (or pooled), every label would be its split
        named = [n for n, s in zip(names, splits) if s]
        raise ValueError(f"{where}: {named} name a split but none is the train split (split names: "
                         f"{', '.join(SPLIT_DIRS)}); add the train one beside them, or rename them if they are "
                         "classes")


def resolve_classes(class_names: Optional[Sequence[str]], default: Sequence[str], where: str) -> list[str]:
    """``class_names`` overrides the source's names but must match their number."""
    if class_names is None:
        return [str(c) for c in default]
    names = [str(c) for c in class_names]
    if len(names) != len(default):
        raise ValueError(f"class_names has {len(names)} names but {where} has {len(default)} classes")
    return names


def check_unique(names: Sequence[str], key: str) -> None:
    """Two classes under one name would merge: refused, naming the repeated ones."""
    repeated = sorted(n for n, count in Counter(names).items() if count > 1)
    if repeated:
        raise ValueError(f"{key} names {shown(repeated)} more than once: {shown(list(names))}")


def check_labels(labels: np.ndarray, classes: Sequence[str], where: str) -> None:
    """At least two classes (one trains to a perfect, meaningless score); every label must name a class
    and every class must have at least one sample."""
    if len(classes) < 2:
        raise ValueError(f"{where}: {len(classes)} class(es) {list(classes)}; a classifier needs at least 2")
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

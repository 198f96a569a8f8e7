"""``imagefolder`` source: ``root/<class>/<image>`` or ``root/{train,val,test}/<class>/<image>``.

Original JPEG/PNG bytes are kept (no re-encode, so no generation loss); the writer only checks
that each file decodes, and turns a photo whose EXIF orientation says it is stored sideways.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from .pixels import IMAGE_EXTS
from .records import SPLIT_DIRS, check_labels, check_split_names, records_from_splits
from .splits import SourceListing, carve_splits

LAYOUT = "root/<class>/<image> or root/{train,val,test}/<class>/<image>"


def _images_under(d: Path) -> list[str]:
    """Image files below ``d`` (recursive and through links, like torchvision's ImageFolder; a folder
    reached twice is read once), sorted, hidden skipped."""
    found, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(d, followlinks=True):
        seen.add(os.path.realpath(dirpath))
        dirnames[:] = sorted(n for n in dirnames if not n.startswith(".")
                             and os.path.realpath(os.path.join(dirpath, n)) not in seen)
        found += [os.path.join(dirpath, f) for f in filenames
                  if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTS]
    return sorted(found)


def _classes_in(d: Path) -> dict[str, list[str]]:
    """``{class: [files]}`` of the class directories in ``d``; an empty one is an error naming it."""
    classes = {c: _images_under(d / c) for c in _subdirs(d)}
    for c, files in classes.items():
        if not files:
            raise ValueError(f"class directory {d / c} is empty; expected image files with extensions "
                             f"{sorted(IMAGE_EXTS)}")
    return classes


def as_text(path: str) -> str:
    """A file name as valid UTF-8 for the manifest: bytes that are not (an old zip's Latin-1) as \\xNN."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _below(path: str, under: str, root: Path) -> str:
    """``Path(path).relative_to(root).as_posix()`` for a path listed under ``root`` (``under``: root with a
    trailing separator), by slicing: the driver names every record, and pathlib costs ~20 us a path."""
    if path.startswith(under) and os.sep == "/":
        return path[len(under):]
    return Path(path).relative_to(root).as_posix()


def _read_file(path: str) -> bytes:
    """A record's bytes; a module function, so a record sent to a shard task pickles as its path alone
    (a closure would carry the whole listing's paths with every chunk)."""
    with open(path, "rb") as f:
        return f.read()


def _subdirs(d: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(d) if e.is_dir() and not e.name.startswith("."))


def _check_no_loose_images(d: Path, holder: str) -> None:
    """Images directly in ``d`` (the root, or a split directory) have no class: say so rather than drop them."""
    loose = [e.name for e in os.scandir(d) if e.is_file() and not e.name.startswith(".")
             and os.path.splitext(e.name)[1].lower() in IMAGE_EXTS]
    if loose:
        raise ValueError(f"{d} holds {len(loose)} image(s) directly (e.g. {sorted(loose)[0]}), outside any class "
                         f"directory; {holder} must hold <class>/<image> ({LAYOUT}): move them into their class "
                         "directories, or out of the root if they are unlabelled")


def list_imagefolder(root: Path) -> dict[str, dict[str, list[str]]]:
    """{split or "": {class: [files]}}; split dirs are used only if every top-level dir is one."""
    if not root.exists():
        raise FileNotFoundError(f"imagefolder root {root} does not exist; expected {LAYOUT}")
    if not root.is_dir():
        raise ValueError(f"imagefolder root {root} is a file, not a directory; expected {LAYOUT}")
    top = _subdirs(root)
    if not top:
        raise ValueError(f"imagefolder root {root} has no class directories; expected {LAYOUT}")
    as_splits = [SPLIT_DIRS.get(d.lower()) for d in top]
    check_split_names(top, as_splits, f"imagefolder root {root}")
    _check_no_loose_images(root, "the root")
    if "train" in as_splits:
        if len(set(as_splits)) != len(as_splits):
            raise ValueError(f"{root} has two directories for the same split: {top}")
        for d in top:
            _check_no_loose_images(root / d, "a split directory")
        return {s: _classes_in(root / d) for s, d in zip(as_splits, top)}
    if len(top) == 1 and _subdirs(root / top[0]):  # an archive unpacked one level deeper than the classes
        raise ValueError(f"imagefolder root {root} holds one directory, {top[0]}/, and it holds directories: "
                         f"one class (a classifier needs at least 2); did you mean root: {root / top[0]}?")
    return {"": _classes_in(root)}


def imagefolder_listing(*, root, seed, val_fraction, test_fraction, class_names, **_) -> SourceListing:
    """List files and labels, carve missing splits, and stream the files' bytes lazily."""
    if root is None:
        raise ValueError(f"source 'imagefolder' needs root: a directory laid out as {LAYOUT}")
    root = Path(root)
    layout = list_imagefolder(root)
    found = sorted({c for per_class in layout.values() for c in per_class})
    if not found:  # split directories with no class directories in them
        raise ValueError(f"imagefolder root {root}: no class directories under {sorted(layout)} "
                         f"(its split directories); expected {LAYOUT}")
    if class_names is not None:
        classes = [str(c) for c in class_names]
        unknown = sorted(set(found) - set(classes))
        if unknown:
            raise ValueError(f"class directories {unknown} under {root} are not in class_names {classes}")
    else:
        classes = found
    index = {c: i for i, c in enumerate(classes)}
    paths, labels, given = [], [], {}
    for split, per_class in layout.items():
        start = len(paths)
        for c in sorted(per_class):
            paths += per_class[c]
            labels += [index[c]] * len(per_class[c])
        if split:
            given[split] = np.arange(start, len(paths))
    labels = np.asarray(labels, dtype=np.int64)
    check_labels(labels, classes, f"imagefolder {root}")
    splits = carve_splits(labels, seed, val_fraction, test_fraction, given=given or None)
    under = os.path.join(str(root), "")  # each path is this + its part below root (as os.walk joined them)
    records = records_from_splits(
        splits, labels, lambda i: as_text(_below(paths[i], under, root)),
        lambda i: functools.partial(_read_file, paths[i]))
    return SourceListing(classes, int(labels.size), records, sorted(given))

"""``cifar`` source: the python-pickle releases ``cifar-10-batches-py`` / ``cifar-100-python``.

Batches are unpickled one file at a time (labels pass, then pixels pass) and written in file
order (the release is already shuffled), as lossless PNG. The format is pickle, which can call any
function it names: the unpickler here admits only what numpy's arrays pickle with, so a batch that
names anything else (a planted one that would run a command) is refused, naming the file.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from .records import check_labels, resolve_classes
from .splits import SPLITS, Record, SourceListing, carve_splits, split_of_index

LAYOUTS = {
    "cifar-10-batches-py": dict(train=[f"data_batch_{i}" for i in range(1, 6)], test=["test_batch"],
                                meta="batches.meta", names=b"label_names", labels=b"labels"),
    "cifar-100-python": dict(train=["train"], test=["test"], meta="meta",
                             names=b"fine_label_names", labels=b"fine_labels"),
}
EXPECTED = "cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta} or cifar-100-python/{train,test,meta}"


def _array_globals() -> dict:
    """What numpy pickles an array with (``ndarray.__reduce__``, and the buffer form of protocol 5), under
    the module names of numpy 1 (the release's own) and numpy 2."""
    rebuild, frombuffer = np.zeros(1).__reduce__()[0], np.zeros(1).__reduce_ex__(5)[0]
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for core in ("numpy.core", "numpy._core"):
        allowed[(f"{core}.multiarray", "_reconstruct")] = rebuild
        allowed[(f"{core}.numeric", "_frombuffer")] = frombuffer
    return allowed


class _BatchUnpickler(pickle.Unpickler):
    """A CIFAR batch holds dicts, lists, bytes, numbers and numpy arrays: any other global is refused, not
    looked up (nor called)."""

    ALLOWED = _array_globals()

    def find_class(self, module: str, name: str):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR batch does not hold; "
                                         "refused, not run") from None


def _unpickle(path: Path, *keys: bytes) -> dict:
    """A CIFAR python batch holding ``keys``; one cut short by an interrupted download or extraction,
    another file under the name, or a pickle that names more than numpy's arrays (:class:`_BatchUnpickler`)
    is a ValueError naming it."""
    redo = "extract the CIFAR archive again"
    with open(path, "rb") as f:
        try:
            batch = _BatchUnpickler(f, encoding="bytes").load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError) as exc:
            raise ValueError(f"{path}: not a readable CIFAR python batch ({type(exc).__name__}: {exc}); {redo}") from None
    missing = [k.decode() for k in keys if not isinstance(batch, dict) or k not in batch]
    if missing:
        raise ValueError(f"{path}: not a CIFAR python batch (no {', '.join(missing)}); {redo}")
    return batch


def _images(data, path: Path, count: int) -> np.ndarray:
    """A batch's ``data``, one row of 3 x 32 x 32 pixels (channel-major) per label, as HWC images."""
    rows = np.asarray(data, dtype=np.uint8)
    if rows.shape != (count, 3 * 32 * 32):
        raise ValueError(f"{path}: its data is {rows.shape}, not one row of 3 x 32 x 32 pixels for each of its "
                         f"{count} labels; extract the CIFAR archive again")
    return rows.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)


def find_layout(root: Path) -> tuple[Path, dict]:
    """``root`` may be the batches dir itself or its parent."""
    if not root.exists():
        raise FileNotFoundError(f"cifar root {root} does not exist; expected {EXPECTED}")
    if not root.is_dir():
        raise ValueError(f"cifar root {root} is a file; extract it first. Expected {EXPECTED}")
    for d in (root, *(root / name for name in LAYOUTS)):
        for layout in LAYOUTS.values():
            if all((d / f).is_file() for f in layout["train"] + layout["test"] + [layout["meta"]]):
                return d, layout
    raise FileNotFoundError(f"{root} holds no CIFAR python batches; expected {EXPECTED}")


def cifar_listing(*, root, seed, val_fraction, test_fraction, class_names, **_) -> SourceListing:
    """Given train/test splits; val is carved from train."""
    if root is None:
        raise ValueError(f"source 'cifar' needs root: a directory with {EXPECTED}")
    d, layout = find_layout(Path(root))
    names = [n.decode() for n in _unpickle(d / layout["meta"], layout["names"])[layout["names"]]]
    classes = resolve_classes(class_names, names, f"cifar {d}")
    files = [(s, d / f) for s in ("train", "test") for f in layout[s]]
    labels, given, offset = [], {"train": [], "test": []}, 0
    for split, f in files:
        y = np.asarray(_unpickle(f, layout["labels"])[layout["labels"]], dtype=np.int64)
        labels.append(y)
        given[split].append(np.arange(offset, offset + y.size))
        offset += y.size
    labels_per_file, labels = labels, np.concatenate(labels)
    check_labels(labels, classes, f"cifar {d}")
    splits = carve_splits(labels, seed, val_fraction, test_fraction,
                          given={s: np.concatenate(v) for s, v in given.items()})
    split_of = split_of_index(splits, labels.size)

    def records():
        i = 0
        for (_, f), y in zip(files, labels_per_file):
            batch = _unpickle(f, b"data")
            data = _images(batch[b"data"], f, y.size)
            fnames = batch.get(b"filenames") or [b""] * len(data)
            for j in range(len(data)):
                img = np.ascontiguousarray(data[j])
                yield Record(SPLITS[split_of[i]], int(labels[i]), f"{f.name}#{j}:{fnames[j].decode()}",
                             lambda img=img: img)
                i += 1

    return SourceListing(classes, int(labels.size), records(), ["test", "train"])

"""``parquet`` source: Hugging Face-style files with an image column and an integer label column.

The columns are the ones ``image_column`` / ``label_column`` name, else the ones the ``huggingface``
schema metadata types ``Image`` / ``ClassLabel`` (``img``, ``labels``, ``fine_label`` …), else ``image``
and ``label``.

Read with ``iter_batches`` twice: labels first, to carve splits; then images, which are written in
each split's seeded shuffled order, not the files' (Hugging Face's ``imagefolder`` builder stores a
set class by class: in file order each shard would hold a class or two, and each batch a few). To
get that order with bounded memory the images pass once through spool files in ``$TMPDIR``, bucketed
by their place in it (about ``SPOOL_BYTES`` each), and each bucket is read back and sorted.
"""
from __future__ import annotations

import errno
import json
import math
import pickle
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .records import SPLIT_DIRS, check_labels, check_split_names
from .splits import SPLITS, Record, SourceListing, carve_splits, split_of_index

BATCH_ROWS = 256
SPOOL_BYTES = 256 * 2**20  # image bytes a spool bucket holds, about: what ordering holds in memory at once
MAX_SPOOLS = 256           # spool files open at once (a set of ~64 GB or more has larger buckets)


def _files(root: Path) -> list[Path]:
    if not root.exists():
        raise FileNotFoundError(f"parquet root {root} does not exist; expected a .parquet file or a "
                                "directory of them")
    files = [root] if root.is_file() else sorted(root.rglob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"no *.parquet files under {root}")
    return files


def _split_of_file(path: Path, root: Path) -> Optional[str]:
    """HF layouts: ``train-00000-of-00001.parquet`` or ``train/…parquet`` or ``data/test-….parquet``."""
    parts = path.relative_to(root).parts if path != root else (path.name,)
    for part in parts:
        head = part.split("-")[0].split("_")[0].split(".")[0].lower()
        if head in SPLIT_DIRS:
            return SPLIT_DIRS[head]
    return None


class SpoolFull(OSError):
    """``$TMPDIR`` filled up while the rows were spooled (not the shards' device)."""


def hf_features(schema: pa.Schema, path: Path) -> dict:
    """The ``huggingface`` schema metadata's features (``{}`` without it)."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return {}
    try:
        doc = json.loads(meta)
        features = doc.get("info", doc).get("features", {})
    except (ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: its 'huggingface' schema metadata is not the JSON Hugging Face writes "
                         f"({exc})") from None
    return features if isinstance(features, dict) else {}


def pick_columns(schema: pa.Schema, path: Path, features: dict, image_column: Optional[str] = None,
                 label_column: Optional[str] = None) -> tuple[str, str]:
    """The image and label columns (see the module docstring; ``features``: :func:`hf_features`), checked."""
    def pick(given: Optional[str], key: str, hf_type: str, default: str) -> str:
        typed = [n for n, f in features.items() if isinstance(f, dict) and f.get("_type") == hf_type]
        name = given or (typed[0] if len(typed) == 1 else default)
        if name not in schema.names:
            hint = f"its metadata types {typed} as {hf_type}: name one" if len(typed) > 1 else "name the column"
            raise ValueError(f"{path} has no {name!r} column ({key}: {hint}); columns are {schema.names}")
        return name

    image = pick(image_column, "image_column", "Image", "image")
    label = pick(label_column, "label_column", "ClassLabel", "label")
    t = schema.field(image).type
    if not (pa.types.is_binary(t) or pa.types.is_large_binary(t)
            or (pa.types.is_struct(t) and t.get_field_index("bytes") >= 0)):
        raise ValueError(f"{path}: image column {image!r} has type {t}; expected binary or struct<bytes, path>")
    if not pa.types.is_integer(schema.field(label).type):
        raise ValueError(f"{path}: label column {label!r} has type {schema.field(label).type}; expected an integer")
    return image, label


def hf_class_names(features: dict, label: str) -> Optional[list[str]]:
    """Class names from the ``huggingface`` features (:func:`hf_features`; the label feature's ``names``)."""
    feature = features.get(label)
    names = feature.get("names") if isinstance(feature, dict) else None
    return [str(n) for n in names] if names else None


@contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A damaged file (a bad page, a truncated footer) is an error naming it."""
    try:
        yield
    except (pa.ArrowException, OSError) as exn:
        raise ValueError(f"{path} is not a readable parquet file: {exn}") from exn


def _payload(value, path: Path, row: int) -> tuple[bytes | Path, str]:
    """The image's bytes stored inline, or its file (a path relative to the parquet file) when bytes are
    null; and the name the manifest gives it."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return value["bytes"], value.get("path") or f"{path.name}#{row}"
        if value.get("path"):
            p = Path(value["path"])
            p = p if p.is_absolute() else path.parent / p
            if not p.is_file():
                raise FileNotFoundError(f"{path} row {row}: image path {value['path']} not found (looked at {p})")
            return p, str(value["path"])
        raise ValueError(f"{path} row {row}: image has neither bytes nor path")
    if value is None:
        raise ValueError(f"{path} row {row}: image is null")
    return value, f"{path.name}#{row}"


def _load(payload: bytes | Path):
    return payload.read_bytes if isinstance(payload, Path) else (lambda: payload)


def _rows(files: list[Path], columns: list[str]) -> Iterator[tuple[bytes | Path, str, int]]:
    """Every row of the files, in file order: (image payload, its name, label)."""
    for f in files:
        row = 0
        for batch in _batches(f, columns, BATCH_ROWS):
            for img, lab in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                yield (*_payload(img, f, row), int(lab))
                row += 1


def _batches(f: Path, columns: list[str], rows: int) -> Iterator[pa.RecordBatch]:
    """``columns`` of ``f`` in record batches; reading errors name the file (a row's own do not pass here)."""
    with _reading(f):
        batches = pq.ParquetFile(f).iter_batches(batch_size=rows, columns=columns)
    while True:
        with _reading(f):
            batch = next(batches, None)
        if batch is None:
            return
        yield batch


def _read_spool(path: Path) -> list[tuple]:
    entries = []
    with open(path, "rb") as f:
        while True:
            try:
                entries.append(pickle.load(f))
            except EOFError:
                return entries


def ordered_records(files: list[Path], columns: list[str], order: np.ndarray, split_of: np.ndarray,
                    total_bytes: int) -> Iterator[Record]:
    """The rows ``order`` lists (indices in file order, each split's together), in that order, with
    about ``SPOOL_BYTES`` of images in memory (see the module docstring)."""
    if not order.size:
        return
    place = np.full(split_of.size, -1, np.int64)
    place[order] = np.arange(order.size)
    buckets = min(MAX_SPOOLS, max(1, math.ceil(total_bytes / SPOOL_BYTES)))
    with tempfile.TemporaryDirectory(prefix="vit-parquet-order-") as tmp:
        paths = [Path(tmp) / f"{b:04d}.pkl" for b in range(buckets)]
        spools = [open(p, "wb") for p in paths]
        try:
            for i, (payload, name, label) in enumerate(_rows(files, columns)):
                if place[i] >= 0:
                    at = int(place[i])
                    _spool((at, payload, name, label), spools[at * buckets // order.size], total_bytes)
        finally:
            for spool in spools:
                spool.close()
        for path in paths:
            entries = sorted(_read_spool(path), key=lambda e: e[0])
            path.unlink()
            for at, payload, name, label in entries:
                yield Record(SPLITS[split_of[order[at]]], label, name, _load(payload))


def _spool(entry: tuple, spool, total_bytes: int) -> None:
    try:
        pickle.dump(entry, spool, protocol=5)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise SpoolFull(exc.errno, f"no space left in {Path(spool.name).parent.parent} ($TMPDIR), where the parquet "
                        f"rows wait in their shuffled order (it needs about the images' size, {total_bytes / 1e9:.1f} "
                        f"GB): free space there, or point TMPDIR at a larger disk, and re-run") from exc


def parquet_listing(*, root, seed, val_fraction, test_fraction, class_names, image_column=None, label_column=None,
                    **_) -> SourceListing:
    """Labels first (cheap), then a lazy stream of rows routed to their split."""
    if root is None:
        raise ValueError("source 'parquet' needs root: a .parquet file or a directory of them")
    root = Path(root)
    files = _files(root)
    labels, given, names, total_bytes = [], {}, None, 0
    file_splits = [_split_of_file(f, root) for f in files]
    check_split_names([str(f.relative_to(root)) if f != root else f.name for f in files], file_splits,
                      f"parquet root {root}")
    use_given = "train" in file_splits
    offset, columns = 0, None
    for f, split in zip(files, file_splits):
        with _reading(f):
            pf = pq.ParquetFile(f)
        features = hf_features(pf.schema_arrow, f)
        picked = list(pick_columns(pf.schema_arrow, f, features, image_column, label_column))
        if columns and picked != columns:
            raise ValueError(f"{f}: its image and label columns are {picked}, {files[0]}'s {columns}: name them "
                             "with image_column / label_column")
        columns = picked
        names = names or hf_class_names(features, columns[1])
        for batch in _batches(f, columns[1:], 65536):
            col = batch.column(0)
            if col.null_count:
                raise ValueError(f"{f}: label column {columns[1]!r} has null values")
            labels.append(col.to_numpy())
        n = pf.metadata.num_rows
        total_bytes += sum(pf.metadata.row_group(g).total_byte_size for g in range(pf.metadata.num_row_groups))
        if use_given:
            given.setdefault(split, []).append(np.arange(offset, offset + n))
        offset += n
    labels = np.concatenate(labels).astype(np.int64) if labels else np.zeros(0, np.int64)
    if class_names is not None:
        classes = [str(c) for c in class_names]
    elif names is not None:
        classes = names
    else:
        classes = [str(i) for i in range(int(labels.max()) + 1 if labels.size else 0)]
    check_labels(labels, classes, f"parquet {root}")
    given_idx = {s: np.concatenate(v) for s, v in given.items()} or None
    splits = carve_splits(labels, seed, val_fraction, test_fraction, given=given_idx)
    split_of = split_of_index(splits, labels.size)
    order = np.concatenate([splits[s] for s in SPLITS])  # each split in carve_splits' seeded shuffled order
    records = ordered_records(files, columns, order, split_of, total_bytes)
    return SourceListing(classes, int(labels.size), records, sorted(given))

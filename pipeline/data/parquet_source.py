"""``parquet`` source: Hugging Face-style files with an ``image`` and an integer ``label`` column.

Read with ``iter_batches`` twice: labels first, to carve splits; then images, which are written in
each split's seeded shuffled order, not the files' (Hugging Face's ``imagefolder`` builder stores a
set class by class: in file order each shard would hold a class or two, and each batch a few). To
get that order with bounded memory the images pass once through spool files in ``$TMPDIR``, bucketed
by their place in it (about ``SPOOL_BYTES`` each), and each bucket is read back and sorted.
"""
from __future__ import annotations

import json
import math
import pickle
import tempfile
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .records import SPLIT_DIRS, check_labels, check_split_names
from .splits import SPLITS, SourceListing, Record, carve_splits, split_of_index

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


def hf_class_names(schema: pa.Schema) -> Optional[list[str]]:
    """Class names from the ``huggingface`` schema metadata (features.label.names), if present."""
    meta = (schema.metadata or {}).get(b"huggingface")
    if not meta:
        return None
    doc = json.loads(meta)
    features = doc.get("info", doc).get("features", {})
    names = features.get("label", {}).get("names")
    return [str(n) for n in names] if names else None


def _check_schema(schema: pa.Schema, path: Path) -> None:
    for col in ("image", "label"):
        if col not in schema.names:
            raise ValueError(f"{path} has no {col!r} column; columns are {schema.names}")
    t = schema.field("image").type
    ok = pa.types.is_binary(t) or pa.types.is_large_binary(t) or (
        pa.types.is_struct(t) and t.get_field_index("bytes") >= 0)
    if not ok:
        raise ValueError(f"{path}: 'image' column has type {t}; expected binary or struct<bytes, path>")
    if not pa.types.is_integer(schema.field("label").type):
        raise ValueError(f"{path}: 'label' column has type {schema.field('label').type}; expected an integer")


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


def _rows(files: list[Path]) -> Iterator[tuple[bytes | Path, str, int]]:
    """Every row of the files, in file order: (image payload, its name, label)."""
    for f in files:
        row = 0
        for batch in pq.ParquetFile(f).iter_batches(batch_size=BATCH_ROWS, columns=["image", "label"]):
            for img, lab in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
                yield (*_payload(img, f, row), int(lab))
                row += 1


def _read_spool(path: Path) -> list[tuple]:
    entries = []
    with open(path, "rb") as f:
        while True:
            try:
                entries.append(pickle.load(f))
            except EOFError:
                return entries


def ordered_records(files: list[Path], order: np.ndarray, split_of: np.ndarray, total_bytes: int) -> Iterator[Record]:
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
            for i, (payload, name, label) in enumerate(_rows(files)):
                if place[i] >= 0:
                    at = int(place[i])
                    pickle.dump((at, payload, name, label), spools[at * buckets // order.size], protocol=5)
        finally:
            for spool in spools:
                spool.close()
        for path in paths:
            entries = sorted(_read_spool(path), key=lambda e: e[0])
            path.unlink()
            for at, payload, name, label in entries:
                yield Record(SPLITS[split_of[order[at]]], label, name, _load(payload))


def parquet_listing(*, root, seed, val_fraction, test_fraction, class_names, **_) -> SourceListing:
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
    offset = 0
    for f, split in zip(files, file_splits):
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowInvalid, OSError) as exn:
            raise ValueError(f"{f} is not a readable parquet file: {exn}") from exn
        _check_schema(pf.schema_arrow, f)
        names = names or hf_class_names(pf.schema_arrow)
        for batch in pf.iter_batches(batch_size=65536, columns=["label"]):
            col = batch.column(0)
            if col.null_count:
                raise ValueError(f"{f}: 'label' column has null values")
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
    records = ordered_records(files, order, split_of, total_bytes)
    return SourceListing(classes, int(labels.size), records, sorted(given))

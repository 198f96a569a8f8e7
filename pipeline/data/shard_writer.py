"""Shard stage: source -> webdataset tars + manifest.parquet + dataset.json, atomically.

Tars are byte-reproducible (fixed order, mtime/uid/names) so DVC hashes only change with data or
params. Everything is written into a temp dir beside ``out_dir`` and renamed into place at the end.
"""
from __future__ import annotations

import dataclasses
import errno
import json
from pathlib import Path
from typing import Optional

import numpy as np

from pipeline.config import RUN_ONLY, DataConfig, RayConfig, check_data
from pipeline.outputs import StagedOutputs
from pipeline.utils import BAD_FILES, DATASET_INFO, apply_umask

from .parquet_source import SpoolFull
from .record_encode import STATS_SPLIT
from .shard_tasks import prepare_staging, write_all
from .sources import list_source
from .splits import EMPTY_SPLIT_EFFECT, SPLITS, why_empty

FORMAT_VERSION = 1
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # OSError numbers reported as "no space left"


def stats_from_histogram(hist: np.ndarray) -> dict:
    """Per-channel mean and std (values scaled to [0, 1]) from :func:`pixel_histogram` counts."""
    values = np.arange(256, dtype=np.float64) / 255.0
    n = hist.sum(1)
    mean = (hist * values).sum(1) / n
    std = np.sqrt(np.maximum((hist * values**2).sum(1) / n - mean**2, 0.0))
    return {"split": STATS_SPLIT, "mean": [round(float(v), 6) for v in mean], "std": [round(float(v), 6) for v in std]}


def shard_warnings(info: dict, out_dir) -> list[str]:
    """What a finished shard run holds that a user would otherwise miss: skipped images, empty splits,
    classes without train images (the model cannot learn them)."""
    notes = []
    bad = info["bad_files"]
    if bad:
        per_split = ", ".join(f"{s} {sum(b['split'] == s for b in bad)}" for s in SPLITS)
        notes.append(f"skipped {len(bad)} undecodable image(s) ({per_split}); the list is in "
                     f"{Path(out_dir) / BAD_FILES}")
    for split, effect in EMPTY_SPLIT_EFFECT.items():
        if info["counts"][split] == 0:
            notes.append(f"the {split} split is empty ({why_empty(info, split)}): {effect}")
    for i, name in enumerate(info["classes"]):
        if info["class_counts"]["train"][i] == 0:
            elsewhere = ", ".join(f"{s} {info['class_counts'][s][i]}" for s in SPLITS if s != "train")
            notes.append(f"class {name!r} has no train images ({elsewhere}): the model cannot learn it")
    return notes


def _check_replaceable(out: Path) -> None:
    """Only an empty dir or a previous shard output may be replaced (never someone's data)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise FileExistsError(f"out_dir {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / DATASET_INFO).exists():
        raise FileExistsError(f"out_dir {out} is a non-empty directory without {DATASET_INFO}; "
                              "refusing to replace it")


def shard_dataset(out_dir, spec: DataConfig, ray_cfg: Optional[RayConfig] = None) -> dict:
    """Write ``spec.source`` as train/val/test webdataset shards in ``out_dir``; return dataset.json's content.

    ``spec`` is one ``data.<name>`` section of params.yaml; its fields that shape the data are recorded in
    dataset.json. ``spec.shard_tasks`` Ray tasks run on the cluster ``ray_cfg`` names (see
    :func:`.shard_tasks.runner`); the output is the same for any number.
    """
    params = {k: v for k, v in dataclasses.asdict(spec).items() if k not in RUN_ONLY}
    params.update(root=None if spec.root is None else str(spec.root),
                  class_names=None if spec.class_names is None else list(spec.class_names))
    check_data(spec)
    out = Path(out_dir)
    # written beside it, swapped in at the end; what a killed run left is resumed from if made the same way
    staged = StagedOutputs([out], resumable=True)
    _check_replaceable(out)
    tmp = staged[out]
    try:
        prepare_staging(tmp, {"format_version": FORMAT_VERSION, "params": params})
        apply_umask(tmp)
        listing = list_source(spec.source, root=spec.root, seed=spec.seed, val_fraction=spec.val_fraction,
                          test_fraction=spec.test_fraction, class_names=spec.class_names,
                          image_column=spec.image_column, label_column=spec.label_column,
                          num_classes=spec.num_classes, samples_per_class=spec.samples_per_class,
                          image_size=spec.image_size)
        written = write_all(tmp, listing, maxcount=spec.maxcount, maxsize=spec.maxsize, max_side=spec.max_side,
                            max_bad_fraction=spec.max_bad_fraction, encoding=spec.encoding, tasks=spec.shard_tasks,
                            ray_cfg=ray_cfg)
        shards = written["shards"]
        info = {
            "format_version": FORMAT_VERSION,
            "source": spec.source,
            "classes": listing.classes,
            "num_classes": len(listing.classes),
            "counts": {s: sum(sh["count"] for sh in shards[s]) for s in SPLITS},
            "class_counts": written["class_counts"],
            "pixel_stats": stats_from_histogram(written["hist"]),
            "shards": shards,
            "given_splits": listing.given_splits,
            "key_format": "{split}_{index:07d}",
            "bad_files": written["bad_files"],
            "params": params,
        }
        (tmp / BAD_FILES).write_text(json.dumps(written["bad_files"], indent=2) + "\n")
        (tmp / DATASET_INFO).write_text(json.dumps(info, indent=2) + "\n")
        _check_replaceable(out)
        staged.publish()
    except OSError as exc:
        if exc.errno in DISK_FULL and not isinstance(exc, SpoolFull):  # the spool's says where it is
            raise OSError(exc.errno, f"no space left on the device of {out.parent} while writing the shards "
                          f"({exc.strerror}); the partial output was removed and {out} is as before: free "
                          f"space and re-run") from exc
        raise
    finally:
        staged.discard()
    return info

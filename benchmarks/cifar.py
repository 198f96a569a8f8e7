"""CIFAR-10 shards for the benchmarks, built once from the ImageFolder tarball (``../shared/data``)."""
from __future__ import annotations

import dataclasses
import tarfile
from pathlib import Path

from pipeline.config import DataConfig
from pipeline.data import shard_dataset

CIFAR_TGZ = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpg.tar.gz"


def cifar_shards(out: Path, data: DataConfig, tarball: Path = CIFAR_TGZ) -> Path:
    """CIFAR-10 train+test from ``tarball``, extracted beside ``out`` (as ``<out>-jpg``) and sharded into
    ``out`` as ``data`` (the recipe's ``data.<stage>``, its ``root`` replaced by the extracted copy) says;
    nothing to do when ``out`` already holds them."""
    if not (out / "dataset.json").exists():
        print(f"sharding CIFAR-10 from {tarball} into {out} (once)", flush=True)
        raw = out.parent / (out.name + "-jpg")
        if not (raw / "train").is_dir():
            if not Path(tarball).is_file():
                raise FileNotFoundError(f"{tarball}: no such CIFAR-10 tarball (ImageFolder JPEGs, train/ and test/)")
            with tarfile.open(tarball) as tf:
                tf.extractall(raw, filter="data")
        shard_dataset(out, dataclasses.replace(data, source="imagefolder", root=str(raw)))
    return out

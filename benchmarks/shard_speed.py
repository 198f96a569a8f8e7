"""Shard-stage throughput (images/s) and peak RSS on the CIFAR-10 train set (50k JPEGs).

Peak RSS is reported next to the RSS after imports: torch (pulled in by webdataset) dominates it,
and the difference is what sharding itself holds.

    python benchmarks/shard_speed.py [--source imagefolder|fractals] [--out /tmp/c10-shard-bench]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cifar import add_extract_options, extract_cifar
from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.config import DataConfig
from pipeline.data import shard_dataset
from pipeline.utils import positive_int


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_extract_options(ap)
    ap.add_argument("--out", type=Path, default=Path("/tmp/cifar10-shard-bench"))
    ap.add_argument("--source", default="imagefolder", choices=["imagefolder", "fractals"])
    ap.add_argument("--maxcount", type=positive_int, default=5000)
    add_record_option(ap)
    args = ap.parse_args()
    if args.source == "imagefolder":
        extract_cifar(args.data, args.cifar_tarball)
    base = rss_mb()
    c0, t0 = os.times(), time.perf_counter()
    if args.source == "imagefolder":
        data = DataConfig(source="imagefolder", root=args.data / "train", maxcount=args.maxcount)
        info = shard_dataset(args.out, data)
    else:
        info = shard_dataset(args.out, DataConfig(source="fractals", num_classes=100, samples_per_class=50,
                                                  image_size=32, maxcount=args.maxcount))
    wall = time.perf_counter() - t0
    c1 = os.times()
    n = sum(info["counts"].values())
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    size = sum(p.stat().st_size for p in args.out.glob("*.tar")) / 1e6
    print(f"{args.source}: {n} images -> {sum(len(v) for v in info['shards'].values())} shards ({size:.0f} MB) "
          f"in {wall:.1f} s = {n / wall:.0f} img/s wall, {n / cpu:.0f} img/cpu-s "
          f"(load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus)")
    print(f"peak RSS {rss_mb():.0f} MB (after imports {base:.0f} MB; sharding adds {rss_mb() - base:.0f} MB)")
    print("target: >= 2000 img/s")
    if args.record:
        record_and_say("shard_speed", {"images": n, "img_s": round(n / wall), "img_per_cpu_s": round(n / cpu),
                                       "peak_rss_mb": round(rss_mb()), "rss_after_imports_mb": round(base)},
                       command=command_line(__file__), case=args.source)


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError) as exc:  # no or a damaged CIFAR-10 tarball, --data in the way: one line
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

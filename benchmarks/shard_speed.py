"""Shard-stage throughput on Ray: 1 task and N tasks side by side, re-encoding to a max side and copying through.

Each case shards the same images with ``shard_tasks: 1`` and ``shard_tasks: N`` (Ray tasks on a local
instance) and checks the two outputs are byte-identical. An ImageFolder (``--data``, used as it is; by
default CIFAR-10's train/ from ../shared/data) is sharded twice: ``reencode`` (``max_side``) and
``copy`` (the source's bytes kept, decode-verified); ``--image-size S`` first re-encodes the inputs as
S x 3S/4 JPEGs (quality 90; e.g. 400 for ImageNet-like ~400x300 photos, untimed). ``--source fractals``
times rendering FractalDB-style JPEGs at ``--image-size`` instead. Per core: images per CPU-second of the
encode tasks (decode, verify, re-encode, spool; the slower of the two runs); scaling: the wall times', Ray
started and its workers warm before either.

    python benchmarks/shard_speed.py --image-size 400 --limit 2000 --max-side 256 --tasks 2 --json
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cifar import add_tarball_option, extract_cifar
from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.config import DataConfig
from pipeline.data import shard_dataset, shard_tasks
from pipeline.utils import PARTIAL, positive_int

TARGETS = {"reencode": 150, "copy": 1500}  # img/s per core (issue targets), and 1 -> 2 tasks >= 1.8x
SCALING_TARGET = 1.8
DEFAULT_DATA = Path("/tmp/cifar10")


def _digest(out: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(out.iterdir()):
        h.update(p.name.encode() + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def _prepared_input(src: Path, dest: Path, image_size: int | None, limit: int | None) -> Path:
    """``src`` as it is, or (``--limit``/``--image-size``) the first ``limit`` images of each class
    evenly, each re-encoded at ``image_size`` x 3/4 of it, in ``dest`` (built once, beside the output)."""
    if image_size is None and limit is None:
        return src
    marker = dest / ".complete"
    if marker.exists():
        return dest
    from PIL import Image

    from pipeline.data.folder import list_imagefolder

    files = [(split, c, f) for split, per_class in list_imagefolder(src).items()
             for c, fs in per_class.items() for f in fs]
    files.sort(key=lambda t: (Path(t[2]).name, t[1]))  # interleave the classes, so a limit takes them all
    files = files[:limit] if limit else files

    def one(item):
        split, c, f = item
        out = dest / split / c / Path(f).name
        out.parent.mkdir(parents=True, exist_ok=True)
        if image_size is None:
            shutil.copyfile(f, out)
            return
        with Image.open(f) as img:
            big = img.convert("RGB").resize((image_size, image_size * 3 // 4), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        big.save(buf, "JPEG", quality=90)
        out.with_suffix(".jpg").write_bytes(buf.getvalue())

    shutil.rmtree(dest, ignore_errors=True)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(one, files))
    marker.touch()
    return dest


def _warm_up(tasks: int) -> None:
    """Ray started and ``tasks`` workers with the shard code imported, before anything is timed."""
    import ray

    shard_tasks.runner(tasks, 0)
    ray.get([ray.remote(num_cpus=1)(_import_shard_code).remote() for _ in range(tasks)])


def _import_shard_code() -> None:
    import pipeline.data.shard_writer  # noqa: F401


def _run(out: Path, spec: DataConfig) -> dict:
    for old in (out, out.parent / f"{PARTIAL}{out.name}"):  # from scratch: a killed run's chunks would be resumed
        shutil.rmtree(old, ignore_errors=True)
    t0 = time.perf_counter()
    info = shard_dataset(out, spec)
    wall = time.perf_counter() - t0
    n = sum(info["counts"].values())
    return {"images": n, "wall_s": wall, "img_s": n / wall, "digest": _digest(out),
            "encode_img_per_cpu_s": n / max(shard_tasks.LAST_RUN["encode_cpu_s"], 1e-9),
            "peak_task_rss_mb": shard_tasks.LAST_RUN["peak_task_rss_mb"], "shards": sum(map(len, info["shards"].values()))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=None,
                    help=f"an ImageFolder, used as it is (new or empty: CIFAR-10 is extracted into it and its train/ "
                         f"used; default {DEFAULT_DATA})")
    add_tarball_option(ap)
    ap.add_argument("--out", type=Path, default=Path("/tmp/shard-bench"))
    ap.add_argument("--source", default="imagefolder", choices=["imagefolder", "fractals"])
    ap.add_argument("--image-size", type=positive_int, default=None,
                    help="re-encode the inputs as S x 3S/4 JPEGs first (fractals: the render size, default 384)")
    ap.add_argument("--limit", type=positive_int, default=None, help="use this many images (fractals: default 2000)")
    ap.add_argument("--max-side", type=positive_int, default=256, help="the re-encode case's max_side")
    ap.add_argument("--tasks", type=positive_int, default=2, help="Ray tasks compared against 1 (default 2)")
    ap.add_argument("--maxcount", type=positive_int, default=1000)
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    add_record_option(ap)
    args = ap.parse_args()
    if args.tasks < 2:
        ap.error("--tasks: give 2 or more (1 task is always measured)")
    if args.source == "fractals":
        size, per = args.image_size or 384, args.limit or 2000
        base = DataConfig(source="fractals", num_classes=10, samples_per_class=-(-per // 10), image_size=size,
                          encoding="jpeg", maxcount=args.maxcount)
        cases = {"render": base}
        label = f"fractals-{size}px"
    else:
        data = args.data or DEFAULT_DATA
        if args.data is None or not data.is_dir() or not any(data.iterdir()):
            data = extract_cifar(data, args.cifar_tarball) / "train"
        root = _prepared_input(data, args.out / f"input-{args.image_size}-{args.limit}", args.image_size, args.limit)
        base = DataConfig(source="imagefolder", root=str(root), maxcount=args.maxcount)
        cases = {"reencode": dataclasses.replace(base, max_side=args.max_side), "copy": base}
        label = f"imagefolder-{args.image_size or 'as-is'}px"
    figures: dict = {"tasks": args.tasks, "img_per_s_per_core": {}, f"scaling_1_to_{args.tasks}": {}, "identical": True}
    _warm_up(args.tasks)
    load = [os.getloadavg()[0]]
    for name, spec in cases.items():
        runs = {}
        for tasks in (1, args.tasks):
            runs[tasks] = r = _run(args.out / f"{name}-{tasks}", dataclasses.replace(spec, shard_tasks=tasks))
            print(f"{name}, {tasks} task(s): {r['images']} images -> {r['shards']} shards in {r['wall_s']:.1f} s = "
                  f"{r['img_s']:.0f} img/s wall ({r['encode_img_per_cpu_s']:.0f} per CPU-second of the encode tasks), "
                  f"peak task RSS "
                  f"{r['peak_task_rss_mb']:.0f} MB", flush=True)
            load.append(os.getloadavg()[0])
        figures["images"] = runs[1]["images"]
        figures["img_per_s_per_core"][name] = round(min(r["encode_img_per_cpu_s"] for r in runs.values()), 1)
        figures.setdefault("img_per_s_wall_1_task", {})[name] = round(runs[1]["img_s"], 1)
        figures[f"scaling_1_to_{args.tasks}"][name] = round(runs[args.tasks]["img_s"] / runs[1]["img_s"], 2)
        figures["identical"] &= runs[1]["digest"] == runs[args.tasks]["digest"]
        figures.setdefault("peak_task_rss_mb", {})[name] = round(max(r["peak_task_rss_mb"] for r in runs.values()))
    figures["load_avg_max"] = round(max(load), 1)
    print(f"targets: img/s per core {TARGETS} (fractals: none), 1 -> 2 tasks >= {SCALING_TARGET}x; "
          f"outputs identical across task counts: {figures['identical']}; load average up to "
          f"{figures['load_avg_max']} on {os.cpu_count()} cpus")
    if args.record:
        record_and_say("shard_speed", figures, command=command_line(__file__), case=label)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError) as exc:  # no or a damaged CIFAR-10 tarball, --data in the way: one line
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

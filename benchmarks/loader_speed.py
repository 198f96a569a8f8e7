"""Images/s of pipeline.data's webdataset train loader vs torchvision ImageFolder + DataLoader.

All get the same images (JPEG), the same augmentations, batch size and worker count; runs are
interleaved in one process so machine load hits all alike. Two baselines:
``imagefolder``: the textbook ImageFolder (PIL loader) + one v2.Compose per sample;
``imagefolder-fast``: ImageFolder given this package's decode (torchvision.io) and transform
split (uint8 per-sample ops, normalise per batch), isolating what the tar format itself buys.
``webdataset-raw``: the same loader on shards written with ``encoding: raw`` (decoded pixels, no
JPEG decode when loading; the same batches). ``--max-side N`` adds ``webdataset-max-side``: the same
loader on shards the shard stage re-encoded at ``max_side: N`` (as fast 224 px ImageNet loaders such
as FFCV store it), against ImageFolder on the original images; its figures go in a record of their
own, named so, beside the same-bytes one. Each rate is given with the loaders' start-up and, after
``--warmup`` batches, without it (``ratio_vs_imagefolder_steady``): both sides pay ~0.5 s to start here,
a large share of a short timed epoch but not of a real one.

The images: ``--data``, an ImageFolder (class folders, or a train/ of them) used as it is, else
CIFAR-10 extracted there; ``--upscale 400x300 --limit 2000`` first writes that many of them, upscaled
and re-encoded as quality-90 JPEGs, to /tmp (a realistic 224 px workload from CIFAR-10). At 32 px the
crop is RandomResizedCrop(0.5-1, bicubic); above it torchvision's RandomResizedCrop defaults (the
ImageNet recipe's). ``--json``: the last line is one JSON object of the figures.

    python benchmarks/loader_speed.py [--workers 2] [--batches 60] [--rounds 3]
    python benchmarks/loader_speed.py --upscale 400x300 --limit 2000 --image-size 224 --batch-size 64 \
        --batches 20 --json
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
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

from benchmarks.cifar import add_extract_options, extract_cifar
from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.config import DataConfig
from pipeline.data import make_train_loader, read_dataset_info, shard_dataset
from pipeline.data.augment import AUGMENT_DEFAULTS, DECODES
from pipeline.data.loader import _collate
from pipeline.data.transforms import BatchFinish, SampleTransform, train_transform
from pipeline.utils import DATASET_INFO, positive_int

AUGMENT = {"random_resized_crop": [0.5, 1.0], "hflip": 0.5}
MAX_SIDE = "webdataset-max-side"  # --max-side's loader
IMAGENET_AUGMENT = {"random_resized_crop": [0.08, 1.0], "hflip": 0.5, "interpolation": "bilinear"}


def image_folder(data: Path, tarball: Path) -> Path:
    """``--data`` as an ImageFolder: its train/ if it has one, itself if it holds class folders, else
    the train/ of CIFAR-10 extracted into it."""
    if (data / "train").is_dir():
        return data / "train"
    if data.is_dir() and any(p.is_dir() for p in data.iterdir()):
        return data
    return extract_cifar(data, tarball) / "train"


def _tmp_name(folder: Path) -> str:
    """A /tmp name per image folder: what the benchmark builds from it once."""
    return "loader-speed-" + hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:12]


def upscaled(folder: Path, size: tuple[int, int], limit: int, under: Path = Path("/tmp")) -> Path:
    """``limit`` images of ``folder`` (as many per class as fit, in name order) resized to ``size``
    (width, height) and saved as quality-90 JPEGs in an ImageFolder in ``under``, once."""
    from PIL import Image

    from pipeline.outputs import staged_outputs
    out = under / f"{_tmp_name(folder)}-{size[0]}x{size[1]}-{limit}"
    if out.is_dir():
        return out
    classes = sorted(p for p in folder.iterdir() if p.is_dir())
    per_class = -(-limit // len(classes))
    print(f"writing {limit} images of {folder} at {size[0]}x{size[1]} to {out} (once)", flush=True)
    with staged_outputs(out) as staged:
        n = 0
        for c in classes:
            (staged[out] / c.name).mkdir(parents=True)
            for f in sorted(p for p in c.iterdir() if p.is_file())[:min(per_class, limit - n)]:
                img = Image.open(f).convert("RGB").resize(size, Image.Resampling.BICUBIC)
                img.save(staged[out] / c.name / (f.stem + ".jpg"), "JPEG", quality=90)
                n += 1
    return out


def ensure_shards(folder: Path, shard_dir: Path, encoding: str = "source", max_side: int | None = None) -> None:
    """Shard ``folder`` (JPEGs copied through, or ``raw`` pixels; re-encoded at ``max_side``) into ``shard_dir`` once."""
    if not (shard_dir / DATASET_INFO).exists():
        shard_dataset(shard_dir, DataConfig(source="imagefolder", root=folder, val_fraction=0.0, test_fraction=0.0,
                                            maxcount=2000, encoding=encoding, max_side=max_side))


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give WIDTHxHEIGHT, e.g. 400x300") from None
    if w < 1 or h < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: width and height must be >= 1")
    return w, h


def _tv_load(path: str) -> torch.Tensor:
    return decode_image(path, mode=ImageReadMode.RGB)


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(loader, batches: int, warmup: int) -> tuple[float, float, float]:
    """(images per wall second, images per CPU second of this process + its workers, images per wall
    second after the first ``warmup`` batches).

    The first two include start-up (workers forked, first reads), which each of the short timed epochs
    here pays but an epoch of a real set (thousands of batches) barely feels; the third leaves it out.
    CPU seconds count joined workers, so they are the load-robust figure on a shared machine; wall img/s
    moves with whatever else runs.
    """
    c0, t0, n = _cpu(), time.perf_counter(), 0
    it = iter(loader)
    for i in range(batches):
        if i == warmup:
            t_warm, n_warm = time.perf_counter(), n
        x, _y = next(it)
        n += x.shape[0]
    if x.is_cuda:  # the last batch's decode and augmentation done, not only queued
        torch.cuda.synchronize(x.device)
    end = time.perf_counter()
    del it  # shuts down and joins the workers, so their CPU time is counted
    gc.collect()
    return n / (end - t0), n / (_cpu() - c0), (n - n_warm) / (end - t_warm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_extract_options(ap)
    ap.add_argument("--upscale", type=_size, metavar="WxH", help="benchmark on the images resized to this, as "
                    "quality-90 JPEGs (written to /tmp once)")
    ap.add_argument("--limit", type=positive_int, default=2000, help="with --upscale: this many images")
    ap.add_argument("--shards", type=Path, help="where the images are sharded (once); default: under /tmp, "
                    "named after the image folder")
    ap.add_argument("--workers", type=positive_int, default=2)
    ap.add_argument("--batch-size", type=positive_int, default=256)
    ap.add_argument("--image-size", type=positive_int, default=32)
    ap.add_argument("--batches", type=positive_int, default=60)
    ap.add_argument("--warmup", type=positive_int, default=10, help="batches each loader gets before the "
                    "steady-state clock starts (start-up left out)")
    ap.add_argument("--rounds", type=positive_int, default=3)
    ap.add_argument("--device", default="cpu", help="where this loader's batches end (cuda: a GPU run's input path)")
    ap.add_argument("--decode", choices=DECODES, default=AUGMENT_DEFAULTS["decode"],
                    help="this loader's augment.decode (device: JPEGs decoded on --device)")
    ap.add_argument("--max-side", type=positive_int, help="also time this loader on shards re-encoded at this "
                    "max_side, against ImageFolder on the original images (a record of its own)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object, the last line")
    add_record_option(ap)
    args = ap.parse_args()
    if args.warmup >= args.batches:
        ap.error(f"--warmup {args.warmup} leaves no batch to time: give fewer than --batches {args.batches}")
    train = image_folder(args.data, args.cifar_tarball)
    if args.upscale:
        train = upscaled(train, args.upscale, args.limit)
    shards = args.shards or Path("/tmp") / _tmp_name(train)
    raw_shards = shards.with_name(shards.name + "-raw")
    ensure_shards(train, shards)
    ensure_shards(train, raw_shards, encoding="raw")
    small_shards = shards.with_name(f"{shards.name}-max-side-{args.max_side}") if args.max_side else None
    if small_shards:
        ensure_shards(train, small_shards, max_side=args.max_side)
    n_train = read_dataset_info(shards)["counts"]["train"]
    augment = AUGMENT if args.image_size <= 32 else IMAGENET_AUGMENT
    ours = {**augment, "decode": args.decode}
    total = args.batches
    folder = ImageFolder(str(train), transform=train_transform(args.image_size, augment))
    fast = ImageFolder(str(train), loader=_tv_load, transform=SampleTransform(args.image_size, augment, True))
    finish = BatchFinish(augment)

    def fast_collate(samples):  # the loader's split: uint8 per sample, normalise once per batch
        x, y = _collate(samples)
        return finish(x), y
    def epochs(dataset):  # shuffled, as many epochs as --batches takes (as the train loader's streams cycle)
        return torch.utils.data.RandomSampler(dataset, num_samples=args.batches * args.batch_size)
    rates = {"webdataset": [], "webdataset-raw": [], "imagefolder": [], "imagefolder-fast": []}
    ours_on = {"webdataset": shards, "webdataset-raw": raw_shards}
    if small_shards:
        rates[MAX_SIDE] = []
        ours_on[MAX_SIDE] = small_shards
    for r in range(args.rounds):
        for name, shard_dir in ours_on.items():
            wds_loader = make_train_loader(shard_dir, batch_size=args.batch_size, image_size=args.image_size,
                                           steps_per_epoch=total, rank=0, world_size=1, epoch=r, seed=0,
                                           augment=augment if name == "webdataset-raw" else ours,
                                           num_workers=args.workers, device=args.device)
            rates[name].append(timed(wds_loader, args.batches, args.warmup))
        dl = torch.utils.data.DataLoader(folder, batch_size=args.batch_size, sampler=epochs(folder),
                                         num_workers=args.workers, drop_last=True,
                                         persistent_workers=False)
        rates["imagefolder"].append(timed(dl, args.batches, args.warmup))
        dl = torch.utils.data.DataLoader(fast, batch_size=args.batch_size, sampler=epochs(fast),
                                         collate_fn=fast_collate, num_workers=args.workers, drop_last=True)
        rates["imagefolder-fast"].append(timed(dl, args.batches, args.warmup))
        print(f"round {r}: " + "   ".join(f"{k} {v[-1][0]:5.0f} img/s ({v[-1][1]:5.0f}/cpu-s)"
                                         for k, v in rates.items()), flush=True)
    wall = {k: statistics.median(r[0] for r in v) for k, v in rates.items()}
    cpu = {k: statistics.median(r[1] for r in v) for k, v in rates.items()}
    print(f"\n{train} ({n_train} images, e.g. {_image_size(folder.imgs[0][0])}), {args.image_size} px, batch {args.batch_size}, "
          f"{args.workers} workers, {args.batches} batches x {args.rounds} rounds, "
          f"load avg {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    for k in rates:
        print(f"median {k:17s}: {wall[k]:7.0f} img/s wall   {cpu[k]:7.0f} img/cpu-s")
    print(f"speed-up vs imagefolder, median of the rounds' ratios: {paired(rates, 0):.2f}x wall   "
          f"{paired(rates, 1):.2f}x cpu   {paired(rates, 2):.2f}x wall after {args.warmup} batches")
    if small_shards:
        print(f"on shards re-encoded at max_side {args.max_side} vs imagefolder on the originals: "
              f"{paired(rates, 0, MAX_SIDE):.2f}x wall   {paired(rates, 1, MAX_SIDE):.2f}x cpu   "
              f"{paired(rates, 2, MAX_SIDE):.2f}x wall after {args.warmup} batches")
    for base in ("imagefolder", "imagefolder-fast"):
        print(f"speed-up vs {base:17s}: {wall['webdataset'] / wall[base]:.2f}x wall   "
              f"{cpu['webdataset'] / cpu[base]:.2f}x cpu  (target >= 2x vs imagefolder)")
    print(f"encoding: raw vs source  : {wall['webdataset-raw'] / wall['webdataset']:.2f}x wall   "
          f"{cpu['webdataset-raw'] / cpu['webdataset']:.2f}x cpu")
    same_bytes = [k for k in wall if k != MAX_SIDE]
    figures = {**{f"{k.replace('-', '_')}_img_s": round(wall[k]) for k in same_bytes},
               **{f"{k.replace('-', '_')}_img_per_cpu_s": round(cpu[k]) for k in same_bytes},
               "ratio_vs_imagefolder": round(paired(rates, 0), 2),
               "ratio_vs_imagefolder_cpu": round(paired(rates, 1), 2),
               "ratio_vs_imagefolder_steady": round(paired(rates, 2), 2), "warmup_batches": args.warmup,
               "load_avg": round(os.getloadavg()[0], 2)}
    case = f"{args.image_size} px, batch {args.batch_size}, {args.workers} workers, decode {args.decode} on {args.device}"
    if small_shards:
        smaller = {"max_side": args.max_side, "webdataset_max_side_img_s": round(wall[MAX_SIDE]),
                   "webdataset_max_side_img_per_cpu_s": round(cpu[MAX_SIDE]), "imagefolder_img_s": figures["imagefolder_img_s"],
                   "ratio_vs_imagefolder": round(paired(rates, 0, MAX_SIDE), 2),
                   "ratio_vs_imagefolder_cpu": round(paired(rates, 1, MAX_SIDE), 2),
                   "ratio_vs_imagefolder_steady": round(paired(rates, 2, MAX_SIDE), 2), "warmup_batches": args.warmup,
                   "load_avg": figures["load_avg"]}
    if args.record:
        record_and_say("loader_speed", figures, command=command_line(__file__), case=case)
        if small_shards:
            record_and_say("loader_speed", smaller, command=command_line(__file__),
                           case=f"{case}; this loader on shards re-encoded at max_side {args.max_side}, "
                                f"ImageFolder on the original images")
    if args.json:
        print(json.dumps({**figures, "max_side": smaller} if small_shards else figures), flush=True)


def paired(rates: dict[str, list[tuple[float, float, float]]], k: int, ours: str = "webdataset") -> float:
    """The median over rounds of this loader's rate (``k``: 0 wall, 1 CPU, 2 wall after the warm-up; on ``ours``' shards) over
    ImageFolder's in the same round: on a shared machine, load that drifts between rounds moves both
    sides of each ratio alike."""
    return statistics.median(a[k] / b[k] for a, b in zip(rates[ours], rates["imagefolder"]))


def _image_size(path: str) -> str:
    from PIL import Image
    with Image.open(path) as img:
        return f"{img.size[0]}x{img.size[1]}"


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError) as exc:  # no CIFAR-10 tarball, --shards in the way of the data: one line
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

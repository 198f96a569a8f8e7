"""CPU ms per image of the loader's JPEG decode + crop: reduced-size (draft) decode where it fits vs full.

Images of ``--data`` (any ImageFolder, or CIFAR-10 extracted there) resized to each ``--sizes`` entry
and re-encoded at quality 90, then per image: the full path (torchvision.io decode, crop, resize) and
the loader's (:meth:`SampleTransform.apply_encoded`, falling back to the full path where no
scale-down fits), for the train crop (torchvision's RandomResizedCrop defaults + flip) and the eval
crop, one thread, best of ``--repeats``. ``draft_share``: the images the reduced decode served.

    python benchmarks/decode_speed.py [--image-size 224] [--sizes 400x300,1000x750,2000x1500] [--json]
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cifar import add_extract_options
from benchmarks.loader_speed import IMAGENET_AUGMENT, _size, image_folder
from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.data.codec import decode
from pipeline.data.transforms import SampleTransform
from pipeline.utils import positive_int


def _jpegs(folder: Path, size: tuple[int, int], n: int) -> list[bytes]:
    from PIL import Image
    files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    files = files[::max(1, len(files) // n)][:n]  # spread over the classes
    out = []
    for f in files:
        buf = io.BytesIO()
        Image.open(f).convert("RGB").resize(size, Image.Resampling.BICUBIC).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def _best_ms(fn, n: int, repeats: int) -> float:
    fn()
    best = min(_cpu_s(fn) for _ in range(repeats))
    return best / n * 1e3


def _cpu_s(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def measure(datas: list[bytes], t: SampleTransform, repeats: int) -> dict:
    def full():
        for k, d in enumerate(datas):
            t.apply(decode("jpg", d), k)

    def ours():
        for k, d in enumerate(datas):
            if t.apply_encoded(d, k) is None:
                t.apply(decode("jpg", d), k)
    drafted = sum(t.apply_encoded(d, k) is not None for k, d in enumerate(datas))
    f, o = _best_ms(full, len(datas), repeats), _best_ms(ours, len(datas), repeats)
    return {"full_ms": round(f, 2), "loader_ms": round(o, 2), "speedup": round(f / o, 2),
            "draft_share": round(drafted / len(datas), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_extract_options(ap)
    ap.add_argument("--image-size", type=positive_int, default=224)
    ap.add_argument("--sizes", default="400x300,1000x750,2000x1500", help="WxH,... the images are resized to")
    ap.add_argument("--images", type=positive_int, default=24)
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object, the last line")
    add_record_option(ap)
    args = ap.parse_args()
    try:
        sizes = [_size(s) for s in args.sizes.split(",")]
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"--sizes: {exc}") from None
    torch.set_num_threads(1)  # a loader worker's setting
    folder = image_folder(args.data, args.cifar_tarball)
    crops = {"train": SampleTransform(args.image_size, IMAGENET_AUGMENT, train=True),
             "eval": SampleTransform(args.image_size, {"interpolation": "bilinear"}, train=False)}
    figures = {}
    for w, h in sizes:
        datas = _jpegs(folder, (w, h), args.images)
        for name, t in crops.items():
            got = measure(datas, t, args.repeats)
            print(f"{w}x{h} {name:5s}: full {got['full_ms']:6.2f} ms/img   loader {got['loader_ms']:6.2f} ms/img   "
                  f"{got['speedup']:.2f}x   reduced decode for {got['draft_share']:.0%}", flush=True)
            figures.update({f"{name}_{w}x{h}_{k}": v for k, v in got.items()})
    if args.record:
        record_and_say("decode_speed", figures, command=command_line(__file__),
                       case=f"{args.image_size} px, {len(datas)} images per size")
    if args.json:
        print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)

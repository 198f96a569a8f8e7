"""Classify image files with the exported model.

    python -m pipeline.predict path/to/img.png some/dir [--model exports] [--format onnx|torchscript|safetensors]

Prints ``path<TAB>class<TAB>probability`` per image. A missing or non-image file gets an
``error:`` line on stderr and the others still run; the exit code is 1 if any file failed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from pipeline.data.transforms import eval_transform

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm"}


def expand(paths: list[str]) -> list[Path]:
    """Files as given; directories expanded (recursively) to their image files, sorted."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
        else:
            out.append(p)
    return out


class Predictor:
    """Loads one exported format and the preprocessing recorded in its config.json."""

    def __init__(self, model_dir: str | Path = "exports", fmt: str = "onnx"):
        model_dir = Path(model_dir)
        meta = json.loads((model_dir / "config.json").read_text())
        self.classes = meta["classes"]
        self.transform = eval_transform(meta["image_size"], meta["normalize"])
        if fmt == "onnx":
            import onnxruntime as ort
            sess = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
            self._run = lambda x: sess.run(None, {"images": x.numpy()})[0]
        elif fmt == "torchscript":
            from pipeline.export import load_torchscript
            module = load_torchscript(model_dir / "model.torchscript.pt")
            self._run = lambda x: module(x).detach().numpy()
        elif fmt == "safetensors":
            from pipeline.model import load_model
            model = load_model(model_dir)[0].eval()
            self._run = lambda x: model(x).detach().numpy()
        else:
            raise ValueError(f"--format {fmt!r}: choose onnx, torchscript or safetensors")

    def preprocess(self, path: Path) -> torch.Tensor:
        with Image.open(path) as img:
            return self.transform(img.convert("RGB"))

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        logits = torch.as_tensor(self._run(images))
        probs = logits.softmax(-1)
        conf, idx = probs.max(-1)
        return idx.numpy(), conf.numpy()


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.predict") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="image files or directories")
    ap.add_argument("--model", default="exports", help="export directory: its config.json and model.<format> "
                    "(default: exports, written by the export stage)")
    ap.add_argument("--format", default="onnx", choices=["onnx", "torchscript", "safetensors"])
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args(argv)
    try:
        predictor = Predictor(args.model, args.format)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        print(f"error: cannot load the exported model from {args.model}: {exc}", file=sys.stderr)
        return 2
    failed = 0
    files = expand(args.paths)
    for start in range(0, len(files), args.batch_size):
        good, tensors = [], []
        for path in files[start:start + args.batch_size]:
            try:
                tensors.append(predictor.preprocess(path))
                good.append(path)
            except FileNotFoundError:
                print(f"error: {path}: no such file", file=sys.stderr)
                failed += 1
            except (UnidentifiedImageError, OSError, ValueError) as exc:
                print(f"error: {path}: not a readable image ({type(exc).__name__}: {exc})", file=sys.stderr)
                failed += 1
        if tensors:
            idx, conf = predictor(torch.stack(tensors))
            for path, i, c in zip(good, idx, conf):
                print(f"{path}\t{predictor.classes[i]}\t{c:.4f}", flush=True)
    if failed:
        print(f"{failed} of {len(files)} file(s) failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

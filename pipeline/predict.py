"""Classify image files with the exported model.

    python -m pipeline.predict path/to/img.png some/dir [--model exports] [--format onnx|torchscript|safetensors]

``--model`` is an export directory, or a registered version (``models:/vit-pipeline@champion``,
``models:/vit-pipeline/3``) whose export files are fetched from its MLflow run ($MLFLOW_TRACKING_URI).

Prints ``path<TAB>class<TAB>probability`` per image; a path or class name with a tab, a line break or
another control character, or that starts with ``"``, is printed as a JSON string (``"a\\nb.jpg"``), so
each line is one image. ``--json``: one JSON object per line instead (``file``, ``class``, ``index``,
``score``). A photo is turned as its EXIF orientation says, as the shard stage stores it for training.
A missing or non-image file, an image too large to decode safely (over Pillow's decompression-bomb
limit, 179 Mpx), or a directory with no image files, gets an ``error:`` line on stderr and the others
still run.

Trust: ``onnx`` (the default) and ``safetensors`` files are data, read without running anything of
theirs. A ``torchscript`` file is a program, and so is an MLflow pyfunc model (what the export stage
registers, loaded with ``mlflow.pyfunc.load_model``): loading or running one runs whatever code it
holds. Use those only from sources you trust.

Exit codes:
  0  every input was classified
  1  some input failed (missing, not a readable image, too large, a directory without image files)
  2  a bad argument (e.g. ``--batch-size 0``), or an export that cannot be loaded or run (a missing
     or corrupt ``config.json`` or model file, or the two disagree; the message names the file), or a
     registered version that cannot be fetched
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from pipeline.data.augment import eval_augment
from pipeline.data.pixels import IMAGE_EXTS, eight_bit, upright
from pipeline.data.transforms import eval_transform
from pipeline.metrics import predicted_class
from pipeline.model.io import ModelFileError, load_model, read_model_file
from pipeline.registry import MODEL_URI, download_export  # imports MLflow only when it downloads
from pipeline.utils import CONFIG_NAME, EXPORTS, error_summary, positive_int, shown

MODEL_FILES = {"onnx": "model.onnx", "torchscript": "model.torchscript.pt", "safetensors": "model.safetensors"}
CONFIG_KEYS = ("classes", "image_size", "normalize")  # what predict reads from the export's config.json
REEXPORT = "re-run the export stage (`dvc repro export`) or point --model at an export directory"


def image_files(path: Path) -> list[Path]:
    """A file as given; a directory expanded (recursively) to its image files, sorted (not a directory
    named like one, e.g. ``sub.png/``: its images are listed, it is not an unreadable image)."""
    if path.is_dir():
        return sorted(f for f in path.rglob("*") if f.suffix.lower() in IMAGE_EXTS and not f.is_dir())
    return [path]


def load_file(path: Path, loader: Callable[[Path], Any]) -> Any:
    """``loader(path)``; a missing, unreadable or corrupt file becomes a :class:`ModelFileError` naming it."""
    if not path.is_file():
        raise ModelFileError(f"{path}: not found; {REEXPORT}")
    return read_model_file(path, loader, REEXPORT)


def read_config(path: Path) -> dict:
    """The export's config.json, checked for the entries predict needs."""
    meta = load_file(path, lambda p: json.loads(p.read_text()))
    missing = [k for k in CONFIG_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ModelFileError(f"{path}: has no {', '.join(map(repr, missing))} entry; not an export's "
                             f"config.json; {REEXPORT}")
    classes, size = meta["classes"], meta["image_size"]
    if not (isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)):
        raise ModelFileError(f"{path}: classes is {shown(classes)}, not a list of class names; {REEXPORT}")
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ModelFileError(f"{path}: image_size is {shown(size)}, not a positive whole number of pixels; {REEXPORT}")
    return meta


def _onnx_runner(path: Path):
    import onnxruntime as ort
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: sess.run(None, {"images": x.numpy()})[0]


def load_torchscript(path: Path) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "torch.jit is deprecated": the format is asked for
        return torch.jit.load(str(path))


def _torchscript_runner(path: Path):
    module = load_torchscript(path)
    return lambda x: module(x).detach().numpy()


def _safetensors_runner(path: Path):
    model = load_model(path.parent, redo=REEXPORT)[0].eval()
    return lambda x: model(x).detach().numpy()


RUNNERS = {"onnx": _onnx_runner, "torchscript": _torchscript_runner, "safetensors": _safetensors_runner}


def model_file_name(fmt: str) -> str:
    """The export's file of format ``fmt``; an unknown format is a ValueError naming the choices."""
    if fmt not in RUNNERS:
        raise ValueError(f"--format {fmt!r}: choose one of {', '.join(RUNNERS)}")
    return MODEL_FILES[fmt]


def load_predictor(model: str, fmt: str) -> "Predictor":
    """``--model`` as an export directory, or a registered version whose config.json and model file are
    fetched into a temporary folder (the predictor holds them in memory)."""
    if not model.startswith(MODEL_URI):
        return Predictor(model, fmt)
    name = model_file_name(fmt)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # the line below says it instead
    with tempfile.TemporaryDirectory(prefix="vit-predict-") as tmp:
        folder, version = download_export(model, [CONFIG_NAME, name], Path(tmp))
        print(f"[predict] {model}: version {version.version} (export run {version.run_id}), "
              f"fetched {CONFIG_NAME} and {name}", file=sys.stderr, flush=True)
        return Predictor(folder, fmt)


class Predictor:
    """Loads one exported format and the preprocessing recorded in its config.json."""

    def __init__(self, model_dir: str | Path = EXPORTS, fmt: str = "onnx"):
        name = model_file_name(fmt)
        model_dir = Path(model_dir)
        self.config_file = model_dir / CONFIG_NAME
        meta = read_config(self.config_file)
        self.classes = meta["classes"]
        try:
            self.transform = eval_transform(meta["image_size"], eval_augment(meta))
        except (TypeError, ValueError) as exc:
            raise ModelFileError(f"{self.config_file}: bad image_size or normalize ({error_summary(exc)}); "
                                 f"{REEXPORT}") from None
        self.model_file = model_dir / name
        if not self.model_file.is_file():  # config.json is there: this export left the format out
            raise ModelFileError(f"{self.model_file}: not found; the export stage writes it when export.formats "
                                 f"lists {fmt}; {REEXPORT}, or choose another --format")
        self._run = load_file(self.model_file, RUNNERS[fmt])

    def preprocess(self, path: Path) -> torch.Tensor:
        """The image as the model takes it, as the shard stage stores it for training: turned as its EXIF
        orientation says, a 16-bit one by its high byte (PIL's RGB conversion would clip it at 255).
        Pillow's warning for an image of 89-179 Mpx is silenced (it is resized like any other); a larger
        one raises Image.DecompressionBombError, a failed input."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                return self.transform(eight_bit(upright(img)).convert("RGB"))

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        try:
            logits = torch.as_tensor(self._run(images))
        except Exception as exc:  # e.g. config.json's image_size is not the size the model was exported at
            raise ModelFileError(f"{self.model_file}: fails on {tuple(images.shape)} inputs made as its config.json "
                                 f"says ({error_summary(exc)}); {REEXPORT}") from None
        if logits.shape[-1] != len(self.classes):  # else a class index past the list, or a wrong name
            raise ModelFileError(f"{self.config_file}: names {len(self.classes)} classes, {self.model_file} "
                                 f"scores {logits.shape[-1]}; {REEXPORT}")
        idx = predicted_class(logits)  # evaluate's rule: softmax can tie logits that differ
        conf = logits.softmax(-1).gather(-1, idx[:, None])[:, 0]
        return idx.numpy(), conf.numpy()


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                 epilog=__doc__[__doc__.index("Prints "):],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="image files or directories")
    ap.add_argument("--model", default=str(EXPORTS), help="export directory: its config.json and model.<format> "
                    "(default: exports, written by the export stage), or a registered version: "
                    "models:/<name>@<alias> or models:/<name>/<version>")
    ap.add_argument("--format", default="onnx", choices=list(RUNNERS),
                    help="onnx (default) or safetensors: data; torchscript runs the file's code (see Trust below)")
    ap.add_argument("--json", action="store_true", help="one JSON object per image and line: file, class, index, "
                    "score")
    ap.add_argument("--batch-size", type=positive_int, default=64, help="images per forward pass (default: 64)")
    return ap.parse_args(argv)


def field(text: object) -> str:
    """``text`` for one field of a plain output or error line: as it is, or as a JSON string where it would
    break the line (a tab, a line break, another control character), could not be printed (a file name's
    undecodable bytes) or would read as one (a leading ``"``)."""
    text = str(text)
    if text.startswith('"') or any(c < " " or c == "\x7f" or "\udc80" <= c <= "\udcff" for c in text):
        return json.dumps(text)
    return text


def result_line(path: Path, name: str, index: int, score: float, as_json: bool) -> str:
    if as_json:
        return json.dumps({"file": str(path), "class": name, "index": index, "score": round(score, 6)})
    return f"{field(path)}\t{field(name)}\t{score:.4f}"


def gather(paths: list[str]) -> tuple[list[Path], int]:
    """Image files of every input, and how many inputs were directories without any (each reported)."""
    files, empty = [], 0
    for path in map(Path, paths):
        found = image_files(path)
        if not found:
            print(f"error: {field(path)}: no image files in this directory (looked for "
                  f"{', '.join(sorted(IMAGE_EXTS))})", file=sys.stderr)
            empty += 1
        files += found
    return files, empty


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.predict") -> int:
    args = parse_args(argv, prog)
    try:
        predictor = load_predictor(args.model, args.format)
    except ModelFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    files, failed = gather(args.paths)
    for start in range(0, len(files), args.batch_size):
        good, tensors = [], []
        for path in files[start:start + args.batch_size]:
            try:
                tensors.append(predictor.preprocess(path))
                good.append(path)
            except FileNotFoundError:
                print(f"error: {field(path)}: no such file", file=sys.stderr)
                failed += 1
            except Image.DecompressionBombError as exc:
                print(f"error: {field(path)}: too large to decode ({exc})", file=sys.stderr)
                failed += 1
            except (UnidentifiedImageError, OSError, ValueError) as exc:
                print(f"error: {field(path)}: not a readable image ({error_summary(exc)})", file=sys.stderr)
                failed += 1
        if tensors:
            try:
                idx, conf = predictor(torch.stack(tensors))
            except ModelFileError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            for path, i, c in zip(good, idx, conf):
                print(result_line(path, predictor.classes[i], int(i), float(c), args.json), flush=True)
    if failed:
        print(f"{failed} input(s) failed; {len(files)} image file(s) found", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

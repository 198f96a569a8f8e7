"""`python -m pipeline.predict` on bad exports and bad inputs: one clear line and a documented exit code."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import predict
from pipeline.model import build_vit, save_model
from pipeline.predict import MODEL_FILES

ROOT = Path(__file__).resolve().parents[1]
CLASSES = ["ant", "bee", "cow"]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> Path:
    """A tiny export as the export stage writes it (config.json, safetensors, TorchScript; no ONNX:
    its exporter alone takes seconds, and the corrupt-file cases need none)."""
    from pipeline.exporter import export_torchscript

    out = tmp_path_factory.mktemp("exports")
    torch.manual_seed(0)
    model = build_vit("nano", patch_size=4, image_size=8, num_classes=3, depth=1, embed_dim=16, num_heads=2).eval()
    save_model(model, out, extra={"classes": CLASSES, "image_size": 8,
                                  "normalize": {"mean": [0.5] * 3, "std": [0.25] * 3}})
    export_torchscript(model, torch.randn(2, 3, 8, 8), out / "model.torchscript.pt")
    return out


@pytest.fixture
def images(tmp_path) -> Path:
    d = tmp_path / "imgs"
    d.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(d / f"{i}.png")
    return d


def _damaged_copy(export_dir: Path, dst: Path, name: str, data: bytes | None) -> Path:
    """The export with ``name`` overwritten by ``data`` (None: removed)."""
    shutil.copytree(export_dir, dst)
    if data is None:
        (dst / name).unlink(missing_ok=True)
    else:
        (dst / name).write_bytes(data)
    return dst


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("fmt", ["torchscript", "safetensors"])
def test_classifies_each_image(export_dir, images, capsys, fmt):
    assert predict.main([str(images), "--model", str(export_dir), "--format", fmt, "--batch-size", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == [str(images / f"{i}.png") for i in range(3)]
    assert all(line.split("\t")[1] in CLASSES for line in lines)


@pytest.mark.parametrize("fmt, name, data, needle", [
    ("onnx", "model.onnx", b"\x08\x07garbage, not a protobuf", "corrupt or incomplete"),
    ("torchscript", "model.torchscript.pt", b"PK\x03\x04truncated zip", "corrupt or incomplete"),
    ("safetensors", "model.safetensors", b"\xff" * 16, "corrupt or incomplete"),
    ("onnx", "model.onnx", None, "not found"),
    ("torchscript", "config.json", b'{"classes": ["a"], "image_si', "corrupt or incomplete"),
    ("torchscript", "config.json", b'{"classes": ["a"]}', "has no 'image_size', 'normalize' entry"),
    ("safetensors", "config.json", None, "not found"),
], ids=["corrupt-onnx", "corrupt-torchscript", "corrupt-safetensors", "missing-onnx", "truncated-config",
        "config-without-keys", "missing-config"])
def test_unusable_export_names_the_file(export_dir, images, tmp_path, capsys, fmt, name, data, needle):
    model = _damaged_copy(export_dir, tmp_path / "exports", name, data)
    assert predict.main([str(images), "--model", str(model), "--format", fmt]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert line.startswith(f"error: {model / name}: ") and needle in line and "re-run the export stage" in line, line
    assert captured.out == ""


def test_export_that_disagrees_with_its_config(export_dir, images, tmp_path, capsys):
    meta = json.loads((export_dir / "config.json").read_text())
    model = _damaged_copy(export_dir, tmp_path / "exports", "config.json",
                          json.dumps({**meta, "image_size": 12}).encode())  # traced at 8x8
    assert predict.main([str(images), "--model", str(model), "--format", "torchscript"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith(f"error: {model / 'model.torchscript.pt'}: fails on (3, 3, 12, 12) inputs"), line


@pytest.mark.parametrize("value", ["0", "-5", "two"])
def test_batch_size_must_be_positive(export_dir, images, capsys, value):
    with pytest.raises(SystemExit) as exit_:
        predict.main([str(images), "--model", str(export_dir), "--batch-size", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --batch-size: {value!r} is not valid: must be an integer >= 1" in err, err


def test_directories_without_images_fail(export_dir, images, tmp_path, capsys):
    empty, notes = tmp_path / "empty", tmp_path / "notes"
    empty.mkdir()
    notes.mkdir()
    (notes / "readme.txt").write_text("no images here")
    assert predict.main([str(empty), "--model", str(export_dir), "--format", "torchscript"]) == 1
    assert f"error: {empty}: no image files in this directory" in capsys.readouterr().err
    rc = predict.main([str(notes), str(images / "0.png"), "--model", str(export_dir), "--format", "torchscript"])
    captured = capsys.readouterr()
    assert rc == 1 and len(captured.out.splitlines()) == 1
    assert f"error: {notes}: no image files in this directory" in captured.err


@pytest.mark.slow
def test_cli_corrupt_onnx(export_dir, images, tmp_path):
    """The real command line: one error line naming the file, no traceback, exit 2."""
    model = _damaged_copy(export_dir, tmp_path / "exports", "model.onnx", b"not an onnx model")
    proc = subprocess.run([sys.executable, "-m", "pipeline.predict", str(images), "--model", str(model)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"error: {model / 'model.onnx'}: cannot be loaded" in _one_error_line(proc.stderr)


def test_image_too_large_is_a_failed_input(export_dir, images, tmp_path, capsys, monkeypatch):
    """Over Pillow's decompression-bomb limit (2 x MAX_IMAGE_PIXELS): one error line, the others still
    classified, exit 1; between 1x and 2x (Pillow's warning) classified without the warning."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 60)  # the 10x12 images: 120 pixels, warned of, not refused
    big = tmp_path / "big.png"
    Image.new("RGB", (20, 20)).save(big)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = predict.main([str(big), str(images), "--model", str(export_dir), "--format", "torchscript"])
    captured = capsys.readouterr()
    assert rc == 1 and len(captured.out.splitlines()) == 3, captured
    assert captured.err.splitlines()[0].startswith(f"error: {big}: too large to decode (Image size (400 pixels)")
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]


@pytest.mark.parametrize("key, value, needle", [
    ("image_size", 0, "image_size is 0, not a positive whole number"),
    ("image_size", "8", "image_size is '8', not a positive whole number"),
    ("classes", "abc", "classes is 'abc', not a list of class names"),  # as long as the model's 3 classes
    ("classes", [0, 1, 2], "classes is [0, 1, 2], not a list of class names"),
], ids=["size-0", "size-str", "classes-str", "classes-ints"])
def test_config_values_no_export_writes_name_the_file(export_dir, images, tmp_path, capsys, key, value, needle):
    """A hand-edited config.json: one line naming it and the value (exit 2), not a resize traceback or a
    class named by one letter of a string."""
    meta = json.loads((export_dir / "config.json").read_text())
    model = _damaged_copy(export_dir, tmp_path / "exports", "config.json", json.dumps({**meta, key: value}).encode())
    assert predict.main([str(images), "--model", str(model), "--format", "safetensors"]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    assert line.startswith(f"error: {model / 'config.json'}: {needle}") and "re-run the export stage" in line, line
    assert captured.out == ""


@pytest.mark.parametrize("fmt", ["torchscript", "safetensors"])
def test_classes_that_do_not_fit_the_model(export_dir, images, tmp_path, capsys, fmt):
    """config.json naming 2 classes for a 3-class model: the export cannot be used (exit 2), no IndexError."""
    meta = json.loads((export_dir / "config.json").read_text())
    model = _damaged_copy(export_dir, tmp_path / "exports", "config.json",
                          json.dumps({**meta, "classes": ["ant", "bee"]}).encode())
    assert predict.main([str(images), "--model", str(model), "--format", fmt]) == 2
    captured = capsys.readouterr()
    line = _one_error_line(captured.err)
    file = model / MODEL_FILES[fmt]
    assert line.startswith(f"error: {model / 'config.json'}: names 2 classes, {file} scores 3"), line
    assert captured.out == ""


def test_directory_named_like_an_image_is_not_an_image(export_dir, images, capsys):
    """``sub.png/`` in a listed directory is searched, not reported as an unreadable image; the image
    files listed are those the imagefolder source shards (a PGM among them)."""
    (images / "sub.png").mkdir()
    (images / "empty.jpg").mkdir()
    shutil.copy(images / "0.png", images / "sub.png" / "3.png")
    Image.open(images / "1.png").convert("L").save(images / "gray.pgm")
    assert predict.main([str(images), "--model", str(export_dir), "--format", "torchscript"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and len(captured.out.splitlines()) == 5, captured
    assert str(images / "gray.pgm") in captured.out


def test_deep_images_are_the_pixels_training_decodes(export_dir, tmp_path, capsys):
    """A 16-bit grayscale PNG is read by its high byte, as the loader decodes it for training and
    evaluation (PIL's RGB conversion clipped every value above 255 to white); float pixels have no
    8-bit scale: a failed input, as the shard stage skips them."""
    from pipeline.data.codec import decode

    deep = tmp_path / "deep.png"
    Image.fromarray(np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000).save(deep)  # 0..63000, mode I;16
    assert Image.open(deep).mode == "I;16"
    predictor = predict.Predictor(export_dir, "torchscript")
    trained_on = predictor.transform(decode("png", deep.read_bytes()))
    assert torch.equal(predictor.preprocess(deep), trained_on)
    floats = tmp_path / "float.tif"
    Image.fromarray(np.ones((8, 8), dtype=np.float32)).save(floats)
    rc = predict.main([str(deep), str(floats), "--model", str(export_dir), "--format", "torchscript"])
    captured = capsys.readouterr()
    assert rc == 1 and captured.out.startswith(f"{deep}\t"), captured
    assert captured.err.splitlines()[0] == (f"error: {floats}: not a readable image (BadImage: 32-bit float pixels "
                                            f"(PIL mode F) have no 8-bit scale; store the image as 8- or 16-bit)")


def test_the_class_named_is_evaluate_s_argmax_of_the_logits(export_dir):
    """Two logits that differ can have the same float32 softmax; predict took the first largest probability,
    evaluate (and docs/export.md's rule) the argmax of the logits: the same image got two classes."""
    from pipeline.metrics import predicted_class
    from pipeline.predict import Predictor

    predictor = Predictor(export_dir, "safetensors")
    n = len(predictor.classes)
    logits = torch.full((1, n), -1.0)
    logits[0, :2] = torch.tensor([0.01, 0.0100000007])
    assert logits.softmax(-1)[0, 0] == logits.softmax(-1)[0, 1]  # tied in probability, not in logits
    predictor._run = lambda images: logits
    idx, conf = predictor(torch.zeros(1))
    assert idx.tolist() == predicted_class(logits).tolist() == [1]
    assert conf[0] == pytest.approx(logits.softmax(-1)[0, 1].item())


def test_file_names_that_would_break_a_line_are_json_strings(export_dir, images, capsys):
    """One line per image whatever its name: a line break or tab in a name printed raw read as two records."""
    odd = [images / "two\nlines.png", images / "a\ttab.png", images / '"quoted".png']
    for path in odd:
        shutil.copy(images / "0.png", path)
    assert predict.main([str(images), "--model", str(export_dir), "--format", "torchscript"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and all(line.count("\t") == 2 for line in lines), lines
    names = [line.split("\t")[0] for line in lines]
    shown = {json.loads(n) if n.startswith('"') else n for n in names}
    assert shown == {str(p) for p in sorted(images.iterdir())}
    assert str(images / "0.png") in names  # a plain name is printed as it is


def test_json_lines_name_file_class_index_and_score(export_dir, images, capsys):
    shutil.copy(images / "0.png", images / "two\nlines.png")
    assert predict.main([str(images), "--model", str(export_dir), "--format", "safetensors", "--json"]) == 0
    out = capsys.readouterr().out
    plain = predict.main([str(images), "--model", str(export_dir), "--format", "safetensors"])
    classes = {line.split("\t")[0]: line.split("\t")[1] for line in capsys.readouterr().out.splitlines()}
    rows = [json.loads(line) for line in out.splitlines()]
    assert plain == 0 and [r["file"] for r in rows] == [str(p) for p in sorted(images.iterdir())]
    for row in rows:
        assert set(row) == {"file", "class", "index", "score"} and CLASSES[row["index"]] == row["class"]
        assert 1 / len(CLASSES) <= row["score"] <= 1
        assert classes[predict.field(row["file"])] == row["class"]


def test_exif_orientation_is_applied_as_the_shard_stage_does(export_dir, tmp_path):
    """A phone's portrait photo (stored sideways, tagged to be turned) is classified upright, as the shard
    stage stores it for training."""
    from tests.data_helpers import sideways_photo

    predictor = predict.Predictor(export_dir, "safetensors")
    upright = sideways_photo(tmp_path / "phone.png", "PNG")
    Image.fromarray(upright).save(tmp_path / "upright.png")
    Image.fromarray(np.rot90(upright).copy()).save(tmp_path / "sideways.png")
    assert torch.equal(predictor.preprocess(tmp_path / "phone.png"), predictor.preprocess(tmp_path / "upright.png"))
    assert not torch.equal(predictor.preprocess(tmp_path / "sideways.png"),
                           predictor.preprocess(tmp_path / "upright.png"))


def test_help_says_which_formats_run_code(capsys):
    with pytest.raises(SystemExit):
        predict.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "``onnx`` (the default) and ``safetensors`` files are data" in text
    assert "Use those only from sources you trust." in text and predict.parse_args(["x"], "p").format == "onnx"

"""The export stage's files for a subset of `export.formats`: predict works from each such export; its
parity check fails an export that differs from the model; predict names the model's own class."""
from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import predict
from pipeline.data.augment import eval_augment
from pipeline.data.codec import decode
from pipeline.data.transforms import eval_transform
from pipeline.exporter import compare_export, export_formats, parity_failure
from pipeline.model import build_vit

EXTRA = {"classes": ["ant", "bee", "cow"], "image_size": 8, "normalize": {"mean": [0.5] * 3, "std": [0.25] * 3}}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_export_without_safetensors_has_config(tmp_path, capsys, fmt):
    """config.json is written whatever the formats (only safetensors wrote it): predict reads it."""
    torch.manual_seed(0)
    model = build_vit("nano", patch_size=4, image_size=8, num_classes=3, depth=1, embed_dim=16, num_heads=2).eval()
    images = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        reference = model(images)
    out = tmp_path / "exports"
    out.mkdir()
    results = export_formats(model, images, reference, out, [fmt], opset=18, extra=EXTRA)
    assert list(results) == [fmt] and results[fmt]["top1_agreement"] == 1.0
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", predict.MODEL_FILES[fmt]])
    assert json.loads((out / "config.json").read_text()) == {"model": model.config.to_dict(), **EXTRA}

    img = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(img)
    assert predict.main([str(img), "--model", str(out), "--format", fmt]) == 0
    assert capsys.readouterr().out.split("\t")[1] in EXTRA["classes"]
    # a format the export left out: named, with what writes it
    assert predict.main([str(img), "--model", str(out), "--format", "safetensors"]) == 2
    assert "the export stage writes it when export.formats lists safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("diff, agreement, passes", [(5e-5, 1.0, True), (1e-4, 1.0, True), (2.6e-4, 1.0, False),
                                                     (5e-5, 0.98, False), (float("nan"), 1.0, False)])
def test_parity_limits_refuse_a_nan_difference(diff, agreement, passes):
    """export.max_abs_diff / min_top1_agreement: a format whose logits hold NaN fails the check (``nan >
    limit`` is False: it passed whenever its top-1 still agreed)."""
    from pipeline.exporter import within_limits

    assert within_limits({"max_abs_diff": diff, "top1_agreement": agreement}, _export_params()) is passes


def _export_params():
    from pipeline.config import load_params
    from tests.conftest import ROOT

    return load_params(ROOT / "params.yaml").export


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> SimpleNamespace:
    """A tiny model fitted to 6 PNG files (labelled 0, 1, 2, 0, 1, 2), so that its argmax differs between
    them by a wide margin, and its export in every format. ``x``: the PNGs as evaluation preprocesses them
    (the loader's decode, then the eval transform of config.json), independently of predict."""
    root = tmp_path_factory.mktemp("fitted")
    (root / "imgs").mkdir()
    rng = np.random.default_rng(0)
    files, pixels = [], []
    for i in range(6):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(buf, format="png")
        files.append(root / "imgs" / f"{i}.png")
        files[-1].write_bytes(buf.getvalue())
        pixels.append(eval_transform(EXTRA["image_size"], eval_augment(EXTRA))(decode("png", buf.getvalue())))
    x, y = torch.stack(pixels), torch.arange(6) % 3
    torch.manual_seed(0)
    model = build_vit("nano", patch_size=4, image_size=8, num_classes=3, depth=1, embed_dim=16, num_heads=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        reference = model(x)
    top2 = reference.topk(2).values
    assert reference.argmax(1).tolist() == y.tolist() and (top2[:, 0] - top2[:, 1]).min() > 0.1  # no near-ties
    out = root / "exports"
    out.mkdir()
    results = export_formats(model, x, reference, out, list(predict.MODEL_FILES), opset=18, extra=EXTRA)
    return SimpleNamespace(model=model, x=x, reference=reference, files=files, out=out, results=results)


@pytest.mark.parametrize("fmt", list(predict.MODEL_FILES))
def test_parity_check_fails_an_export_that_differs_from_the_model(fitted, fmt):
    """One weight of the model changed after its export: the reloaded export's logits are compared with
    the changed model's, and the check fails naming the format (it passed a check that compared the
    reference logits with themselves)."""
    cfg = _export_params()
    path = fitted.out / predict.MODEL_FILES[fmt]
    assert parity_failure({fmt: fitted.results[fmt]}, cfg) is None
    assert parity_failure({fmt: compare_export(fmt, path, fitted.x, fitted.reference)}, cfg) is None
    changed = copy.deepcopy(fitted.model)
    with torch.no_grad():
        changed.head.bias[0] += 1e-3  # ten times export.max_abs_diff, every argmax kept
        reference = changed(fitted.x)
    result = compare_export(fmt, path, fitted.x, reference)
    assert result["max_abs_diff"] == pytest.approx(1e-3, rel=0.01) and result["top1_agreement"] == 1.0
    assert parity_failure({fmt: result}, cfg) == (f"export parity check failed: {fmt}: max |diff| 1.00e-03 "
                                                  f"(limit {cfg.max_abs_diff:g}), top-1 agreement 1.000 "
                                                  f"(limit {cfg.min_top1_agreement:g})")


def _predicted_classes(out: str) -> dict[Path, str]:
    """predict's output: each image's path and the class it names (``path<TAB>class<TAB>probability``)."""
    rows = [line.rsplit("\t", 2) for line in out.splitlines()]
    return {Path(path): name for path, name, _ in rows}


@pytest.mark.parametrize("fmt", list(predict.MODEL_FILES))
def test_predict_names_the_class_of_the_model_s_argmax(fitted, capsys, fmt):
    """Each image's class from each format is the PyTorch model's argmax on the image as evaluation
    preprocesses it; the images' argmaxes differ, so a wrong class, index or order shows."""
    assert predict.main([str(fitted.files[0].parent), "--model", str(fitted.out), "--format", fmt,
                         "--batch-size", "4"]) == 0
    expected = {f: EXTRA["classes"][i] for f, i in zip(fitted.files, fitted.reference.argmax(1).tolist())}
    assert len(set(expected.values())) == 3
    assert _predicted_classes(capsys.readouterr().out) == expected

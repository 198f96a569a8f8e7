"""The export stage's files for a subset of `export.formats`: predict works from each such export."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from pipeline import predict
from pipeline.export import export_formats
from pipeline.model import build_vit

EXTRA = {"classes": ["ant", "bee", "cow"], "image_size": 8, "normalize": {"mean": [0.5] * 3, "std": [0.25] * 3}}


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
    from pipeline.config import load_params
    from pipeline.export import within_limits
    from tests.conftest import ROOT

    cfg = load_params(ROOT / "params.yaml").export
    assert within_limits({"max_abs_diff": diff, "top1_agreement": agreement}, cfg) is passes

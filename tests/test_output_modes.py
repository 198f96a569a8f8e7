"""Outputs renamed into place from mkstemp/mkdtemp get the modes the user's umask gives (issue 14, item 7)."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pipeline.config import DataConfig
from pipeline.data import shard_dataset
from pipeline.model import build_vit, save_model
from pipeline.utils import atomic_write_json, current_umask
from tests.data_helpers import make_imagefolder


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_current_umask_reads_without_changing(umask):
    assert current_umask() == umask
    assert current_umask() == umask


def test_outputs_follow_umask(tmp_path, umask):
    file_mode, dir_mode = 0o666 & ~umask, 0o777 & ~umask
    atomic_write_json(tmp_path / "metrics" / "m.json", {"a": 1})
    assert _mode(tmp_path / "metrics" / "m.json") == file_mode

    model = build_vit("nano", patch_size=4, image_size=8, num_classes=3, depth=1, embed_dim=16, num_heads=2)
    out = save_model(model, tmp_path / "model", extra={"classes": ["a", "b", "c"]})
    assert {p.name: _mode(p) for p in out.iterdir()} == {"model.safetensors": file_mode, "config.json": file_mode}

    shards = tmp_path / "shards"
    shard_dataset(shards, DataConfig(source="imagefolder", root=make_imagefolder(tmp_path / "src", per_class=4)))
    assert _mode(shards) == dir_mode
    assert {_mode(p) for p in shards.iterdir()} == {file_mode}

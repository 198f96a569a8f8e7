"""configs/imagenet-vit-s16.yaml end to end at a tiny size: its data section shards a fractal set and its
pretrain section (224-px DeiT-S schedule, made CPU-sized with --set) trains through the stages."""
from __future__ import annotations

import json

import pytest

from pipeline.config import apply_override
from pipeline.data import read_dataset_info
from pipeline.recipes import recipe_overrides
from tests.repo_copy import ROOT, make_repo, pretrain_runs, run

RECIPE = "configs/imagenet-vit-s16.yaml"
TINY = ["data.pretrain.source=fractals", "data.pretrain.root=null", "data.pretrain.num_classes=3",
        "data.pretrain.samples_per_class=8", "data.pretrain.image_size=64", "data.pretrain.encoding=jpeg",
        "model.preset=tiny", "model.depth=1", "pretrain.image_size=48", "pretrain.epochs=1",
        "pretrain.global_batch_size=8", "pretrain.compile=false",
        "ray.backend=local", "ray.use_gpu=false", "ray.num_workers=1", "ray.loader_workers=0"]


@pytest.mark.slow
def test_imagenet_recipe_trains_end_to_end_on_fractals(tmp_path):
    def recipe(raw: dict) -> dict:  # what `vit-pipeline recipe ... --set ... | xargs dvc exp run` applies
        for key, value in recipe_overrides(str(ROOT / RECIPE), TINY).items():
            apply_override(raw, key, value)
        return raw

    repo = make_repo(tmp_path / "repo", edit=recipe)
    shard = run(["python", "-m", "stages.shard", "pretrain"], repo, timeout=120)
    assert shard.returncode == 0, shard.stderr[-3000:]
    info = read_dataset_info(repo / "data/shards/pretrain")
    assert info["params"]["max_side"] == 320 and info["params"]["maxcount"] == 2000  # the recipe's data section
    assert len(info["classes"]) == 3
    proc = run(["python", "-m", "stages.pretrain"], repo, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[pretrain] epoch 1/1 " in proc.stdout
    assert "[pretrain] MFU not logged: no bf16 peak known for" in proc.stdout  # a CPU
    config = json.loads((repo / "models/pretrain/config.json").read_text())
    assert config["model"]["patch_size"] == [16, 16] and config["model"]["drop_path_rate"] == 0.1
    assert config["normalize"]["mean"] == [0.485, 0.456, 0.406] and config["interpolation"] == "bicubic"
    _, (stage_run,) = pretrain_runs(repo)
    logged = stage_run.data.metrics
    assert logged["images_per_s"] > 0 and 0 <= logged["input_wait_share"] < 1 and "mfu" not in logged
    params = stage_run.data.params
    assert params["pretrain.lr"] == "0.001" and params["pretrain.mixup_alpha"] == "0.8", params

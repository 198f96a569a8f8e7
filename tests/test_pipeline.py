"""End to end: a real `dvc repro` of all stages (real Ray workers, tars, MLflow sqlite) in a temp repo copy."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
REPO_FILES = ["pipeline", "stages", "dvc.yaml", "params.yaml", ".dvcignore", ".dvc/config", ".gitignore"]
STAGES = ("pretrain", "finetune", "evaluate", "export")

pytestmark = pytest.mark.slow


def tiny_params(raw: dict) -> dict:
    """Same structure as params.yaml, scaled down so the whole pipeline takes about two minutes."""
    raw["model"].update(depth=2)
    raw["pretrain"].update(epochs=2, warmup_epochs=0)
    raw["finetune"].update(epochs=1, warmup_epochs=0)
    raw["evaluate"]["resolutions"] = [24, 32]
    raw["export"]["num_images"] = 16
    return raw


def make_repo(dst: Path, edit=tiny_params) -> Path:
    for name in REPO_FILES:
        src = ROOT / name
        target = dst / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, target)
    raw = yaml.safe_load((dst / "params.yaml").read_text())
    (dst / "params.yaml").write_text(yaml.safe_dump(edit(raw), sort_keys=False))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=dst, check=True)
    return dst


def run(cmd: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "VIT_PARAMS")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def repro(tmp_path_factory):
    repo = make_repo(tmp_path_factory.mktemp("repo"))
    proc = run(["dvc", "repro"], repo)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return repo, proc


def test_shards_hold_every_sample_once(repro):
    repo, _ = repro
    for name in ("pretrain", "finetune"):
        d = repo / "data/shards" / name
        info = json.loads((d / "dataset.json").read_text())
        manifest = pq.read_table(d / "manifest.parquet").to_pylist()
        keys = []
        for tar in sorted(d.glob("*.tar")):
            with tarfile.open(tar) as tf:
                keys += sorted({m.name.split(".")[0] for m in tf.getmembers()})
        assert len(keys) == len(set(keys)) == len(manifest) == sum(info["counts"].values()) == 1797
        assert sorted(keys) == sorted(r["key"] for r in manifest)


def test_outputs_and_metrics(repro):
    repo, proc = repro
    ev = json.loads((repo / "metrics/evaluate.json").read_text())
    info = json.loads((repo / "data/shards/finetune/dataset.json").read_text())
    assert ev["num_samples"] == info["counts"]["test"]
    assert 0.0 <= ev["top1"] <= ev["top5"] <= 1.0
    assert set(ev["resolution_sweep"]) == {"24", "32"}
    assert ev["resolution_sweep"]["32"] == pytest.approx(ev["top1"], abs=1e-6)  # training resolution
    exp = json.loads((repo / "metrics/export.json").read_text())
    assert exp["passed"] and set(exp["formats"]) == {"safetensors", "torchscript", "onnx"}
    for name in ("model.safetensors", "model.onnx", "model.torchscript.pt", "config.json"):
        assert (repo / "exports" / name).is_file()
    cfg = json.loads((repo / "models/finetune/config.json").read_text())
    assert cfg["model"]["image_size"] == [32, 32] and cfg["image_size"] == 32
    history = (repo / "plots/pretrain_history.csv").read_text().splitlines()
    assert len(history) == 1 + 2  # header + 2 epochs
    assert "epoch 2/2" in proc.stdout and "img/s" in proc.stdout and "ETA" in proc.stdout


def test_mlflow_runs(repro):
    from mlflow.tracking import MlflowClient

    repo, _ = repro
    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    exp = client.get_experiment_by_name("vit-pipeline")
    runs = client.search_runs([exp.experiment_id], "tags.kind = 'stage'")
    by_stage = {}
    for r in runs:
        by_stage.setdefault(r.data.tags["stage"], []).append(r)
    assert {s: len(v) for s, v in by_stage.items()} == {s: 1 for s in STAGES}
    pre, ft = by_stage["pretrain"][0], by_stage["finetune"][0]
    assert pre.data.params["model.preset"] == "nano" and pre.data.params["model.patch_size"] == "4"
    assert pre.data.params["image_size"] == "16" and ft.data.params["image_size"] == "32"
    assert ft.data.params["finetune.interpolation.mode"] == "bicubic"
    assert ft.data.params["interpolation.antialias"] == "True"
    assert len(client.get_metric_history(pre.info.run_id, "train_loss")) == 2
    assert "val_top1" in ft.data.metrics and pre.data.tags["git.commit"] != "unknown"
    parents = {r.data.tags["mlflow.parentRunId"] for v in by_stage.values() for r in v}
    assert len(parents) == 1  # one pipeline invocation → one parent run
    assert all(r.info.status == "FINISHED" for v in by_stage.values() for r in v)


def test_second_repro_is_a_noop(repro):
    repo, _ = repro
    proc = run(["dvc", "repro"], repo, timeout=120)
    assert proc.returncode == 0
    assert "Running stage" not in proc.stdout
    assert "up to date" in proc.stdout.lower()

"""End to end: a real `dvc repro` of all stages (real Ray workers, tars, MLflow sqlite) in a temp repo copy."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.repo_copy import make_repo, run

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("pretrain", "finetune", "evaluate", "export")

pytestmark = pytest.mark.slow


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
        expected = 1797 if name == "finetune" else 10 * 30  # digits; fractals: classes x samples
        assert len(keys) == len(set(keys)) == len(manifest) == sum(info["counts"].values()) == expected
        assert sorted(keys) == sorted(r["key"] for r in manifest)
        assert info["source"] == ("digits" if name == "finetune" else "fractals")


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
    for png in ("confusion.png", "curves.png", "attention.png", "pretrain_curves.png", "finetune_curves.png"):
        assert (repo / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    per_class = (repo / "plots/per_class.csv").read_text().splitlines()
    assert per_class[0] == "class,precision,recall,f1,support" and len(per_class) == 1 + 10
    assert sum(int(line.split(",")[-1]) for line in per_class[1:]) == ev["num_samples"]
    assert 0.0 <= ev["macro_f1"] <= 1.0
    confusion = (repo / "plots/confusion.csv").read_text().splitlines()
    assert len(confusion) == 1 + ev["num_samples"]
    top1 = sum(a == p for a, p in (line.split(",") for line in confusion[1:])) / ev["num_samples"]
    assert top1 == pytest.approx(ev["top1"], abs=1e-6)
    assert exp["registered_model"]["uri"] == "models:/vit-pipeline/1"
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


def _test_images(repo: Path, n: int, out: Path) -> list[Path]:
    """The first ``n`` real test images, extracted from the finetune test shards."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for tar in sorted((repo / "data/shards/finetune").glob("test-*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                if m.name.endswith((".png", ".jpg")) and len(paths) < n:
                    paths.append(out / m.name)
                    paths[-1].write_bytes(tf.extractfile(m).read())
    return paths


def test_predict_cli_good_and_bad_files(repro, tmp_path):
    repo, _ = repro
    good = _test_images(repo, 3, tmp_path / "imgs")
    (tmp_path / "notes.txt").write_text("not an image")
    bad, missing = tmp_path / "notes.txt", tmp_path / "missing.png"
    proc = run([sys.executable, "-m", "pipeline.predict", str(good[0]), str(bad), str(missing),
                str(tmp_path / "imgs")], repo)
    assert proc.returncode == 1
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 + 3  # the first image twice (as a file and within the directory)
    for line in lines:
        path, cls, prob = line.split("\t")
        assert cls in [str(i) for i in range(10)] and 0.0 < float(prob) <= 1.0
    assert f"error: {bad}: not a readable image" in proc.stderr
    assert f"error: {missing}: no such file" in proc.stderr


def test_registered_model_serves(repro, port_factory):
    """`mlflow models serve -m models:/vit-pipeline/1` answers with the fine-tuned model's logits."""
    import time
    import urllib.request

    import numpy as np
    import torch

    from pipeline.data import make_eval_loader
    from pipeline.model import load_model

    repo, _ = repro
    model, meta = load_model(repo / "models/finetune")
    images, _ = next(iter(make_eval_loader(repo / "data/shards/finetune", "test", batch_size=4,
                                           image_size=meta["image_size"], rank=0, world_size=1,
                                           augment=meta["normalize"])))
    with torch.no_grad():
        expected = model.eval()(images).numpy()
    port = port_factory()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{repo}/mlflow.db",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    server = subprocess.Popen(["mlflow", "models", "serve", "-m", "models:/vit-pipeline/1", "--env-manager", "local",
                               "--host", "127.0.0.1", "-p", str(port)], cwd=repo, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2)
                break
            except OSError:
                assert server.poll() is None, "mlflow models serve exited"
                time.sleep(1)
        body = json.dumps({"inputs": images.numpy().tolist()}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
        got = np.array(json.loads(urllib.request.urlopen(req, timeout=60).read())["predictions"])
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() < 1e-4
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=30)


def _would_run(repo: Path, **edits) -> set[str]:
    """Stages `dvc repro` would run after ``edits``: those whose declared deps/params changed
    (`dvc status`) plus everything downstream of them in `dvc dag`."""
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    original = (repo / "params.yaml").read_text()
    for dotted, value in edits.items():
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    try:
        status = run(["dvc", "status", "--json"], repo, timeout=120)
        assert status.returncode == 0, status.stderr
        changed = set(json.loads(status.stdout))
    finally:
        (repo / "params.yaml").write_text(original)
    dag = run(["dvc", "dag", "--dot"], repo, timeout=120).stdout
    edges = re.findall(r'"([^"]+)" -> "([^"]+)"', dag)
    todo, seen = list(changed), set(changed)
    while todo:
        stage = todo.pop()
        for a, b in edges:
            if a == stage and b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


def test_dvc_reruns_only_what_a_param_change_touches(repro):
    repo, _ = repro
    assert _would_run(repo) == set()
    assert _would_run(repo, **{"finetune.lr": 0.0031}) == {"finetune", "evaluate", "export"}
    assert _would_run(repo, **{"evaluate.resolutions": [32]}) == {"evaluate"}
    assert _would_run(repo, **{"export.opset": 19}) == {"export"}
    assert _would_run(repo, **{"pretrain.epochs": 3}) == {"pretrain", "finetune", "evaluate", "export"}
    assert _would_run(repo, **{"data.finetune.seed": 1}) == {"shard@finetune", "finetune", "evaluate", "export"}


def test_dvc_exp_run_patch_and_resolution(repro):
    """The README's experiment: new patch size and fine-tune resolution, seen by dvc exp show and MLflow;
    normalisation from the fine-tune set's pixel stats reaches the exported model's config."""
    from mlflow.tracking import MlflowClient

    repo, _ = repro
    proc = run(["dvc", "exp", "run", "-n", "p8-r48", "-S", "model.patch_size=8", "-S", "finetune.image_size=48",
                "-S", "++finetune.augment.mean=dataset", "-S", "++finetune.augment.std=dataset"], repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    show = run(["dvc", "exp", "show", "--json"], repo, timeout=120)
    assert show.returncode == 0
    exps = json.loads(show.stdout)
    names = [e.get("name") for base in exps for e in (base.get("experiments") or []) for e in (e.get("revs") or [])]
    assert "p8-r48" in names, show.stdout[:2000]
    metrics = json.loads((repo / "metrics/evaluate.json").read_text())
    assert set(metrics["resolution_sweep"]) == {"24", "32"} and 0 <= metrics["top1"] <= 1
    stats = json.loads((repo / "data/shards/finetune/dataset.json").read_text())["pixel_stats"]
    normalize = json.loads((repo / "exports/config.json").read_text())["normalize"]
    assert normalize == {"mean": stats["mean"], "std": stats["std"]} and normalize["mean"] != [0.5] * 3
    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    exp = client.get_experiment_by_name("vit-pipeline")
    ft = client.search_runs([exp.experiment_id], "tags.stage = 'finetune' and params.`model.patch_size` = '8'")
    assert len(ft) == 1 and ft[0].data.params["image_size"] == "48"

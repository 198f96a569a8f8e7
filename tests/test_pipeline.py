"""End to end: a real `dvc repro` of all stages (real Ray workers, tars, MLflow sqlite) in a temp repo copy."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pipeline import environment
from tests.conftest import clean_env
from tests.repo_copy import copy_repo_files, make_repo, pretrain_runs, run

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
    assert "\x1b[" not in proc.stdout + proc.stderr  # no colour codes in a log (Ray's worker prefix)
    assert " INFO mlflow" not in proc.stdout + proc.stderr  # MLflow's start/stop chatter stays out
    assert "[pretrain] epoch 2/2" in proc.stdout and "[finetune] epoch 10/10" in proc.stdout  # rank 0's lines
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
    assert f"[export] MLflow runs: mlflow ui --backend-store-uri sqlite:///{repo}/mlflow.db" in proc.stdout
    assert "registered models:/vit-pipeline/1" in proc.stdout  # the stage's line, without MLflow's two:
    assert "Successfully registered model" not in proc.stderr and "Created version" not in proc.stderr


def test_the_pipeline_learns_well_above_chance(repro):
    """The short pipeline's model has learnt digits: test top-1 well above chance (1 in 10). Its 10 fine-tune
    epochs reached 44 % (at chance until epoch 4); a bound, not the figure, as another CPU's rounding
    moves when the fine-tune leaves chance."""
    repo, _ = repro
    ev = json.loads((repo / "metrics/evaluate.json").read_text())
    classes = json.loads((repo / "data/shards/finetune/dataset.json").read_text())["classes"]
    assert len(classes) == 10
    assert ev["top1"] >= 0.25, f"test top-1 {ev['top1']:.4f}: chance is {1 / len(classes):.2f}"


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
    assert ft.data.params["finetune.interpolation.antialias"] == "True"
    assert ft.data.tags["pretrain.run_id"] == pre.info.run_id  # the run of the weights it started from
    evaluate, export = by_stage["evaluate"][0], by_stage["export"][0]
    # its resolution sweep resizes the position grid this way
    assert (evaluate.data.params["finetune.interpolation.mode"],
            evaluate.data.params["finetune.interpolation.antialias"]) == ("bicubic", "True")
    # one name for a param or a number, whichever run shows it: the stage's own, or the pipeline run
    (parent,) = client.search_runs([exp.experiment_id], "tags.kind = 'pipeline'")
    for stage_run in (pre, ft, evaluate, export):
        shared = set(stage_run.data.params) & set(parent.data.params)
        assert {k: stage_run.data.params[k] for k in shared} == {k: parent.data.params[k] for k in shared}, \
            stage_run.data.tags["stage"]
    assert {"finetune.init", "data.finetune.source", "data.finetune.seed"} <= set(ft.data.params)
    assert "data.finetune.samples_per_class" not in parent.data.params  # fractals only: not digits'
    assert "data.pretrain.samples_per_class" in pre.data.params and "data.pretrain.seed" in pre.data.params
    for stage_run in (evaluate, export):  # the pipeline run has each of their results, by the same name
        results = set(stage_run.data.metrics) - {"epoch"}
        assert results <= set(parent.data.metrics), results - set(parent.data.metrics)
        assert {k: stage_run.data.metrics[k] for k in results} == pytest.approx(
            {k: parent.data.metrics[k] for k in results})
    assert {"test_top1", "test_loss", "macro_f1", "top1_at_32px"} <= set(evaluate.data.metrics)
    assert {"export.passed", "export.onnx.max_abs_diff", "export.torchscript.top1_agreement"} <= set(export.data.metrics)
    assert len(client.get_metric_history(pre.info.run_id, "train_loss")) == 2
    assert [m.value for m in client.get_metric_history(pre.info.run_id, "epoch")] == [1.0, 2.0]  # an x-axis
    assert "val_top1" in ft.data.metrics and pre.data.tags["git.commit"] != "unknown"
    parents = {r.data.tags["mlflow.parentRunId"] for v in by_stage.values() for r in v}
    assert len(parents) == 1  # one pipeline invocation → one parent run
    assert all(r.info.status == "FINISHED" for v in by_stage.values() for r in v)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # opens on training runs


def test_pipeline_run_is_what_you_compare(repro):
    """The parent run carries the pipeline's params, outcome, tags, datasets and spans its stages."""
    from mlflow.tracking import MlflowClient

    repo, _ = repro
    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    exp = client.get_experiment_by_name("vit-pipeline")
    (parent,) = client.search_runs([exp.experiment_id], "tags.kind = 'pipeline'")
    children = {r.data.tags["stage"]: r for r in client.search_runs(
        [exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")}
    assert set(children) == set(STAGES)
    p, m, t = parent.data.params, parent.data.metrics, parent.data.tags
    assert {k: p[k] for k in ("model.preset", "model.patch_size", "pretrain.image_size", "finetune.image_size",
                              "finetune.interpolation.mode", "finetune.interpolation.antialias", "finetune.init",
                              "world_size", "data.pretrain.source", "data.finetune.source")} == {
        "model.preset": "nano", "model.patch_size": "4", "pretrain.image_size": "16", "finetune.image_size": "32",
        "finetune.interpolation.mode": "bicubic", "finetune.interpolation.antialias": "True",
        "finetune.init": "models/pretrain", "world_size": "2", "data.pretrain.source": "fractals",
        "data.finetune.source": "digits"}
    ev = json.loads((repo / "metrics/evaluate.json").read_text())
    assert m["test_top1"] == pytest.approx(ev["top1"]) and m["test_top5"] == pytest.approx(ev["top5"])
    assert m["test_ece"] == pytest.approx(ev["ece"]) and 0 <= ev["ece"] <= 1
    assert m["macro_f1"] == pytest.approx(ev["macro_f1"])
    assert {k: m[f"top1_at_{k}px"] for k in ("24", "32")} == pytest.approx(ev["resolution_sweep"])
    assert m["export.passed"] == 1.0 and m["export.onnx.top1_agreement"] == 1.0
    ft = json.loads((repo / "metrics/finetune.json").read_text())
    assert m["finetune.val_top1"] == pytest.approx(ft["val_top1"]) and "pretrain.val_top1" in m
    assert m["finetune.wall_time_s"] == pytest.approx(ft["wall_time_s"])  # every number, time to accuracy too
    assert {f"finetune.{k}" for k, v in ft.items() if type(v) in (int, float)} <= set(m)
    for stage, child in children.items():  # each stage's wall time: its process, so at least its MLflow run
        assert m[f"{stage}.wall_s"] >= (child.info.end_time - child.info.start_time) / 1000 - 0.01
        assert t[f"{stage}.run_id"] == child.info.run_id and t[f"{stage}.status"] == "FINISHED"
        # where it computed (pretrain / finetune: as rank 0, a Ray worker, saw it): this machine and venv
        assert t[f"{stage}.device"] == child.data.tags["env.device"] == environment.describe()["env.device"]
        assert child.data.tags["env.packages"] == environment.describe()["env.packages"]
    # a real duration: from the first stage's start to the last stage's end
    assert parent.info.status == "FINISHED"
    assert parent.info.start_time <= min(r.info.start_time for r in children.values())
    assert parent.info.end_time >= max(r.info.end_time for r in children.values())
    assert (parent.info.end_time - parent.info.start_time) / 1000 >= sum(m[f"{s}.wall_s"] for s in STAGES) - 1
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    assert t["git.commit"] == commit and len(t["dvc.lock"]) == 16 and "dvc.exp_name" not in t
    # the registered version and the pipeline run name each other; dvc repro runs evaluate before export
    # (dvc.yaml's order), so the version has the test top-1 of the model it holds
    version = client.get_model_version("vit-pipeline", "1")
    assert t["registered_model"] == "models:/vit-pipeline/1" and version.run_id == children["export"].info.run_id
    assert version.tags["pipeline.run_id"] == parent.info.run_id and version.tags["git.commit"] == commit
    assert version.tags["finetune.run_id"] == children["finetune"].info.run_id \
        == children["evaluate"].data.tags["finetune.run_id"]
    assert version.tags["trained_on"] == children["finetune"].data.tags["env.device"]  # as rank 0 saw it
    assert version.tags["test_top1"] == f"{ev['top1']:.4f}" and f"{ev['top1']:.2%}" in version.description
    assert version.tags["test_ece"] == f"{ev['ece']:.4f}"
    # the shards as dataset inputs: name, digest from the manifest, source, counts, context
    manifests = {n: hashlib.sha256((repo / f"data/shards/{n}/manifest.parquet").read_bytes()).hexdigest()[:10]
                 for n in ("pretrain", "finetune")}
    got = {}
    for d in parent.inputs.dataset_inputs:
        profile = json.loads(d.dataset.profile)
        got[d.dataset.name, d.tags[0].value] = (d.dataset.digest, json.loads(d.dataset.source)["uri"],
                                                profile["num_samples"])
    info = {n: json.loads((repo / f"data/shards/{n}/dataset.json").read_text())["counts"] for n in manifests}
    assert got == {(f"{n}-{src}-{split}", split): (f"{manifests[n]}-{split}", str(repo / f"data/shards/{n}"),
                                                   info[n][split])
                   for n, src, splits in (("pretrain", "fractals", ("train", "val")),
                                          ("finetune", "digits", ("train", "val", "test")))
                   for split in splits}
    ft_inputs = {(d.dataset.name, d.tags[0].value) for d in children["finetune"].inputs.dataset_inputs}
    assert ft_inputs == {("finetune-digits-train", "train"), ("finetune-digits-val", "val")}
    ev_inputs = {(d.dataset.name, d.tags[0].value) for d in children["evaluate"].inputs.dataset_inputs}
    assert ev_inputs == {("finetune-digits-test", "test")}


def _queue_start(repo: Path) -> None:
    with open(repo / "queue-start.log", "a") as log:  # its worker keeps inherited pipes open: a file
        start = subprocess.run(["dvc", "queue", "start"], cwd=repo, env=clean_env(), stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=120)
    assert start.returncode == 0, (repo / "queue-start.log").read_text()


def _queue_settled(repo: Path, names: list[str], timeout: float = 900, stall: float = 90) -> tuple[str, int]:
    """Poll `dvc queue status` until none of ``names`` is queued or running; returns the last status and
    how often the queue had to be started again. DVC's worker can stop with experiments still queued
    (treeverse/dvc#10562: CI saw it leave one of two); as docs/experiments.md says, `dvc queue start` again then."""
    import time

    deadline, stalled_since, restarts = time.time() + timeout, None, 0
    while True:
        status = run(["dvc", "queue", "status"], repo, timeout=120).stdout
        rows = [line for line in status.splitlines() if any(n in line.split() for n in names)]
        queued, running = (any(word in line for line in rows) for word in ("Queued", "Running"))
        if len(rows) == len(names) and not (queued or running):
            return status, restarts
        assert time.time() < deadline, status
        if running or not queued:
            stalled_since = None
        elif stalled_since is None:
            stalled_since = time.time()
        elif time.time() - stalled_since > stall:  # queued, nothing running for `stall` s: no worker
            _queue_start(repo)
            stalled_since, restarts = None, restarts + 1
        time.sleep(10)


QUEUED = {"interp-nearest": "nearest"}  # experiment name -> interpolation; the workspace's is bicubic


@pytest.fixture(scope="module")
def queued(repro, tmp_path_factory):
    """docs/experiments.md's queue: a grid point from a recipe file through its recipe pipe, which queues
    with `dvc exp run --queue -S …` (and a bad recipe, which queues nothing); then `dvc queue start` until
    it settled. One point: the workspace's own run is the other point of the grid. Returns `dvc queue
    status`'s last output and how often the worker was restarted."""
    repo, _ = repro
    tmp_path = tmp_path_factory.mktemp("recipes")
    names = QUEUED
    (tmp_path / "nearest.yaml").write_text("finetune:\n  interpolation: {mode: nearest}\n")
    # target evaluate: export (not needed to compare accuracy) stays out, a minute less per experiment
    pipe = "python -m pipeline recipe {} | xargs -r dvc exp run --queue -n {} evaluate"
    for command in (["bash", "-c", pipe.format(tmp_path / "nearest.yaml", "interp-nearest")],
                    ["bash", "-c", pipe.format(tmp_path / "missing.yaml", "from-bad-recipe")]):
        proc = run(command, repo, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr  # a pipe's status is xargs'
    assert proc.stderr == f"error: {tmp_path / 'missing.yaml'}: cannot read it (No such file or directory)\n"
    assert "from-bad-recipe" not in run(["dvc", "queue", "status"], repo, timeout=120).stdout
    try:
        _queue_start(repo)
        return _queue_settled(repo, list(names))
    finally:
        run(["dvc", "queue", "stop"], repo, timeout=120)


def _grid_runs(repo: Path) -> dict:
    """The grid's pipeline runs: the workspace's (the fixture's `dvc repro`, the first without an experiment
    name) and each queued experiment's, by name."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    exp = client.get_experiment_by_name("vit-pipeline")
    pipelines = client.search_runs([exp.experiment_id], "tags.kind = 'pipeline'", order_by=["attributes.start_time ASC"])
    runs = {"workspace": next(r for r in pipelines if "dvc.exp_name" not in r.data.tags)}
    for name in QUEUED:
        found = [r for r in pipelines if r.data.tags.get("dvc.exp_name") == name]
        assert len(found) == 1, name
        runs[name] = found[0]
    return runs


def test_dvc_queue_grid_one_pipeline_run_per_experiment(repro, queued):
    """`dvc exp run --queue` + `dvc queue start`: the queued experiment is its own MLflow pipeline run, tagged
    with its name, differing from the workspace's exactly in the swept param; pretrain is reused.
    docs/experiments.md's comparison commands (`dvc exp show`, `dvc metrics diff`, `dvc plots diff $(dvc exp list
    --name-only)`) show it beside the workspace."""
    from mlflow.tracking import MlflowClient

    repo, _ = repro
    names = QUEUED
    status, restarts = queued
    assert status.count("Success") >= len(names) and restarts <= len(names), status
    show = json.loads(run(["dvc", "exp", "show", "--json"], repo, timeout=120).stdout)
    shown = [e.get("name") for base in show for e in (base.get("experiments") or []) for e in (e.get("revs") or [])]
    assert set(names) <= set(shown)
    metrics = run(["dvc", "metrics", "diff", "--all", "--json", *names], repo, timeout=120)
    assert metrics.returncode == 0, metrics.stderr[-2000:]
    top1 = json.loads(metrics.stdout)["metrics/evaluate.json"]["top1"]
    assert 0 < top1["old"] <= 1 and 0 < top1["new"] <= 1, top1
    # docs/experiments.md's form: every experiment's plots side by side
    diff = run(["bash", "-c", "dvc plots diff --json $(dvc exp list --name-only)"], repo, timeout=300)
    assert diff.returncode == 0 and all(n in diff.stdout for n in names), diff.stderr[-2000:]
    drawn = json.loads(diff.stdout)["data"]
    assert {"Training curves (loss)", "Training curves (top-1)", "plots/confusion.csv", "plots/per_class.csv"} <= set(drawn)
    assert "Confusion matrix" not in drawn  # drawn once, titled so (it was drawn twice)
    for plot, axes in (("plots/pretrain_history.csv", {"epoch", "val_top1"}),  # DVC drew step vs wall_time_s
                       ("plots/confusion.csv", {"actual", "predicted"})):      # and step vs predicted
        fields = set(re.findall(r'"field": "(\w+)"', json.dumps(drawn[plot][0]["content"])))
        assert axes <= fields and not {"step", "wall_time_s"} & fields, (plot, fields)

    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    exp = client.get_experiment_by_name("vit-pipeline")
    runs = _grid_runs(repo)
    a, b = runs.pop("workspace"), runs["interp-nearest"]
    assert b.info.run_name == "interp-nearest" and a.info.status == b.info.status == "FINISHED"
    differ = {k for k in a.data.params.keys() | b.data.params.keys() if a.data.params.get(k) != b.data.params.get(k)}
    assert differ == {"finetune.interpolation.mode"}
    assert (a.data.params["finetune.interpolation.mode"], b.data.params["finetune.interpolation.mode"]) == \
        ("bicubic", "nearest")
    for name, r in runs.items():
        children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{r.info.run_id}'")
        assert {c.data.tags["stage"] for c in children} == {"finetune", "evaluate"}  # pretrain: unchanged, not
        assert all(c.data.tags["dvc.exp_name"] == name for c in children)            # re-run; export: not a target
        assert r.data.tags["pretrain.reused"] == "true"  # from the run that trained models/pretrain
        first = client.get_run(client.get_run(r.data.tags["pretrain.run_id"]).data.tags["mlflow.parentRunId"])
        assert r.data.metrics["pretrain.wall_s"] == first.data.metrics["pretrain.wall_s"] > 0
        assert r.data.metrics["pretrain.val_top1"] == first.data.metrics["pretrain.val_top1"]
        assert {"test_top1", "macro_f1", "top1_at_24px", "top1_at_32px", "finetune.val_top1"} <= set(r.data.metrics)


def test_compare_two_real_pipeline_runs_in_the_ui(repro, queued):
    """Headless Chromium on a real MLflow server over the fixture's store: the experiment opens on its
    training runs; the workspace's and the queued experiment's pipeline runs, compared, show the swept param.
    The picture is the README's (VIT_UPDATE_SCREENSHOTS=1 refreshes it)."""
    from mlflow.tracking import MlflowClient

    from tests.browser import CHROMIUM, CHROMIUM_ARGS, compact_screenshot, ensure_chromium, param_row
    from tests.conftest import serve_mlflow

    ensure_chromium()
    from playwright.sync_api import sync_playwright

    repo, _ = repro
    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    exp = client.get_experiment_by_name("vit-pipeline")
    runs = list(_grid_runs(repo).values())
    screenshot = repo / "mlflow-compare.png"
    with serve_mlflow(repo / "mlflow.db", repo / "mlartifacts", repo / "mlflow-server.log") as (url, _):
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                # MLflow 3.17's UI picks its GenAI or model-training navigation from its own switch (or
                # ?workflowType=), not from the experiment's kind tag: docs/experiments.md's two ways in, each in
                # a fresh browser profile.
                link = browser.new_page()
                link.goto(f"{url}/#/experiments/{exp.experiment_id}?workflowType=machine_learning")
                link.get_by_text("interp-nearest").first.wait_for(timeout=30_000)
                assert f"/experiments/{exp.experiment_id}/runs" in link.url, link.url
                link.context.close()
                page = browser.new_page(viewport={"width": 1200, "height": 1100})
                page.set_default_timeout(30_000)
                page.goto(f"{url}/#/experiments")
                page.get_by_text("Model training", exact=True).first.click()  # remembered by the browser
                page.get_by_role("link", name="vit-pipeline").first.click()
                page.get_by_text("interp-nearest").first.wait_for()
                assert f"/experiments/{exp.experiment_id}/runs" in page.url, page.url
                assert page.get_by_text("finetune-digits-train").count() >= 1  # the Dataset column
                if page.get_by_role("button", name="Close").count():  # the assistant side panel
                    page.get_by_role("button", name="Close").first.click()
                for r in runs:
                    index = page.locator("[role=row]").filter(has_text=r.info.run_name).first.get_attribute(
                        "row-index")
                    page.locator(f'[role=row][row-index="{index}"] input[type=checkbox]').first.check()
                page.get_by_role("button", name="Compare").click()
                page.get_by_text("Comparing 2 Runs").wait_for()
                assert all(r.info.run_id in page.url for r in runs), page.url
                cells = [c.strip() for c in param_row(page, "finetune.interpolation.mode").locator("td")
                         .all_inner_texts()]
                assert sorted(cells) == ["bicubic", "nearest"], cells
                # (the metrics table renders only the rows in its box, export's first: the values it shows are
                # checked on runs of known metrics in tests/test_mlflow_ui.py)
                compact_screenshot(page, screenshot, hidden="model.preset", kept="finetune.interpolation.mode")
                # the registered version's page says where it came from and how it tested (pipeline/registry.py)
                version = client.get_model_version("vit-pipeline", "1")
                page.goto(f"{url}/#/models/vit-pipeline/versions/1")
                page.get_by_text(version.description).first.wait_for()
                for tag in ("test_top1", "pipeline.run_id"):
                    row = page.get_by_role("row").filter(has=page.get_by_text(tag, exact=True))
                    assert row.first.inner_text().split() == [tag, version.tags[tag]]
            finally:
                browser.close()
    assert screenshot.stat().st_size > 20_000
    if os.environ.get("VIT_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(screenshot, ROOT / "docs/mlflow-compare.png")


def test_pipeline_sh_again_runs_nothing_and_its_commands_show_the_results(repro, tmp_path):
    """The README's `bash scripts/pipeline.sh` (and `… finetune`: a target for `dvc repro`) in the fixture's
    copy, this test environment as its .venv: every stage is up to date, nothing is installed; then the
    commands it prints for the results, `dvc metrics show` and `dvc plots show`. Bytecode that Python
    wrote beside the code the stages depend on (where PYTHONDONTWRITEBYTECODE is not set, each stage
    writes some) changes no stage's code: still up to date."""
    repo, _ = repro
    venv = Path(sys.executable).parent.parent
    if not (venv / ".installed").is_file():  # scripts/env.sh would install into this environment
        pytest.skip("runs in the environment scripts/env.sh built (bash scripts/test.sh)")
    files = ["scripts", "requirements.lock", "requirements-test.lock", "pyproject.toml"]
    copy_repo_files(repo, files)
    written = [repo / "pipeline" / package / "__pycache__" / "written.cpython-311.pyc" for package in ("data", "train")]
    for pyc in written:
        pyc.parent.mkdir(exist_ok=True)
        pyc.write_bytes(b"\xa7\r\r\n")
    try:
        for target in ([], ["finetune"]):
            proc = subprocess.run(["bash", "scripts/pipeline.sh", *target], cwd=repo, capture_output=True,
                                  text=True, timeout=300, env=clean_env(VIT_VENV=str(venv)))
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
            assert "Running stage" not in proc.stdout and "up to date" in proc.stdout.lower(), proc.stdout
            assert "pipeline finished in" in proc.stdout and "[env]" not in proc.stderr, proc.stderr
    finally:
        for name in files:
            shutil.rmtree(repo / name) if (repo / name).is_dir() else (repo / name).unlink()
        for pyc in written:
            pyc.unlink()
    shown = run(["dvc", "metrics", "show", "--json"], repo, timeout=120)
    assert shown.returncode == 0, shown.stderr
    (current,) = json.loads(shown.stdout).values()  # one revision, named "workspace" or by its commit
    evaluated = current["data"]["metrics/evaluate.json"]["data"]
    assert evaluated == json.loads((repo / "metrics/evaluate.json").read_text())
    drawn = run(["dvc", "plots", "show", "-o", str(tmp_path / "plots")], repo, timeout=300)
    assert drawn.returncode == 0, drawn.stderr[-2000:]
    page = (tmp_path / "plots/index.html").read_text()
    assert all(name in page for name in ("Training curves (top-1)", "Confusion matrix", "plots/curves.png"))


def test_a_forced_pretrain_repeats_its_output_and_re_runs_nothing_after_it(repro):
    """`dvc repro -f pretrain`, same code and params: the finished run is published again under a new MLflow
    run, and config.json still names the run that trained the weights, so models/pretrain hashes as before
    and DVC re-runs nothing that reads it (config.json named the new run: finetune, evaluate and export were
    out of date)."""
    repo, _ = repro

    def md5() -> str:
        outs = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]["pretrain"]["outs"]
        return next(o["md5"] for o in outs if o["path"] == "models/pretrain")

    before, config = md5(), (repo / "models/pretrain/config.json").read_text()
    proc = run(["dvc", "repro", "-f", "pretrain"], repo, timeout=300)
    assert proc.returncode == 0 and "run already finished, nothing to train" in proc.stdout, proc.stderr[-2000:]
    assert (repo / "models/pretrain/config.json").read_text() == config and md5() == before
    status = json.loads(run(["dvc", "status", "--json"], repo, timeout=120).stdout)
    assert not {"finetune", "evaluate", "export"} & set(status), status


def test_evaluate_names_damaged_inputs_before_ray(repro):
    """The evaluate stage reads its inputs before it starts Ray: a shard missing from what dataset.json
    lists, a model file cut short or a damaged MLflow store is one line naming it; the outputs are kept."""
    repo, _ = repro
    shard, weights = repo / "data/shards/finetune/test-000001.tar", repo / "models/finetune/model.safetensors"
    metrics, whole = (repo / "metrics/evaluate.json").read_text(), weights.read_bytes()
    hidden = shard.rename(shard.with_suffix(".hidden"))
    try:
        no_shard = run(["python", "-m", "stages.evaluate"], repo, timeout=120)
    finally:
        hidden.rename(shard)
    try:
        weights.write_bytes(whole[:1000])
        cut_weights = run(["python", "-m", "stages.evaluate"], repo, timeout=120)
    finally:
        weights.write_bytes(whole)
    store = repo / "mlflow.db"
    runs = store.read_bytes()
    try:
        store.write_bytes(runs[:len(runs) // 2])
        cut_store = run(["python", "-m", "stages.evaluate"], repo, timeout=120)
    finally:
        store.write_bytes(runs)
    assert cut_store.returncode == 1 and cut_store.stderr.strip().splitlines() == [
        f"error: TrackingStoreDamaged: {store}: the MLflow store is damaged (database disk image is malformed); "
        "move it aside and run again (a new store starts empty; `sqlite3 mlflow.db .recover` can save its runs), "
        "or set MLFLOW_TRACKING_URI"], cut_store.stderr[-2000:]
    assert no_shard.returncode == cut_weights.returncode == 1, no_shard.stderr[-2000:] + cut_weights.stderr[-2000:]
    assert no_shard.stderr.strip().splitlines() == [
        "error: data/shards/finetune/test-000001.tar: shard missing (listed in data/shards/finetune/dataset.json); "
        "run the shard stage again (dvc repro, or python -m stages.shard finetune)"]
    [line] = cut_weights.stderr.strip().splitlines()
    assert line.startswith("error: ModelFileError: models/finetune/model.safetensors: cannot be loaded, the file "
                           "is corrupt or incomplete (SafetensorError: ") and line.endswith(
        "; write it again (a stage's output: dvc repro re-runs the stage that wrote it)"), line
    assert (repo / "metrics/evaluate.json").read_text() == metrics


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
    """docs/export.md's promotion: an alias on version 1, then `mlflow models serve -m models:/vit-pipeline@champion`
    answers with the fine-tuned model's logits. Its requirements are the named pins, not MLflow's guesses."""
    import time
    import urllib.request
    from importlib.metadata import version

    import mlflow
    import numpy as np
    import torch
    from mlflow.tracking import MlflowClient

    from pipeline.data import make_eval_loader
    from pipeline.exporter import SERVING_PACKAGES
    from pipeline.model import load_model

    repo, _ = repro
    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    client.set_registered_model_alias("vit-pipeline", "champion", 1)
    logged = client.get_logged_model(client.get_model_version("vit-pipeline", "1").source.removeprefix("models:/"))
    requirements = mlflow.artifacts.download_artifacts(f"{logged.artifact_location}/requirements.txt")
    assert sorted(Path(requirements).read_text().split()) == \
        sorted(f"{p}=={version(p)}" for p in ("mlflow",) + SERVING_PACKAGES)
    model, meta = load_model(repo / "models/finetune")
    images, _ = next(iter(make_eval_loader(repo / "data/shards/finetune", "test", batch_size=4,
                                           image_size=meta["image_size"], rank=0, world_size=1,
                                           augment=meta["normalize"])))
    with torch.no_grad():
        expected = model.eval()(images).numpy()
    port = port_factory()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{repo}/mlflow.db",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    server = subprocess.Popen(["mlflow", "models", "serve", "-m", "models:/vit-pipeline@champion", "--env-manager",
                               "local", "--host", "127.0.0.1", "-p", str(port)], cwd=repo, env=env,
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


def test_predict_a_registered_version(repro, tmp_path):
    """The README's `vit-pipeline predict --model models:/vit-pipeline@champion`: the version's export files,
    fetched from its MLflow run, classify as the export directory does, by alias and by number."""
    from mlflow.tracking import MlflowClient

    repo, _ = repro
    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    client.set_registered_model_alias("vit-pipeline", "champion", 1)
    run_id = client.get_model_version("vit-pipeline", "1").run_id
    _test_images(repo, 5, tmp_path / "imgs")
    for model, fmt, file in (("models:/vit-pipeline@champion", "onnx", "model.onnx"),
                             ("models:/vit-pipeline/1", "torchscript", "model.torchscript.pt")):
        local = run([sys.executable, "-m", "pipeline", "predict", str(tmp_path / "imgs"), "--format", fmt], repo)
        fetched = run([sys.executable, "-m", "pipeline", "predict", str(tmp_path / "imgs"), "--format", fmt,
                       "--model", model], repo)
        assert local.returncode == fetched.returncode == 0, fetched.stderr[-2000:]
        assert fetched.stdout == local.stdout and len(fetched.stdout.splitlines()) == 5
        assert fetched.stderr == f"[predict] {model}: version 1 (export run {run_id}), fetched config.json and {file}\n"


def _would_run(repo: Path, **edits) -> set[str]:
    """Stages `dvc repro --dry --force-downstream` would run after ``edits`` to params.yaml: the changed
    ones and everything after them (a dry run cannot know a retrained output is unchanged)."""
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
        dry = run(["dvc", "repro", "--dry", "--force-downstream"], repo, timeout=120)
    finally:
        (repo / "params.yaml").write_text(original)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    return set(re.findall(r"^Running stage '([^']+)':", dry.stdout, re.M))


def test_dvc_reruns_only_what_a_param_change_touches(repro):
    repo, _ = repro
    assert _would_run(repo) == set()
    assert _would_run(repo, **{"finetune.lr": 0.0031}) == {"finetune", "evaluate", "export"}
    assert _would_run(repo, **{"evaluate.resolutions": [32]}) == {"evaluate"}
    assert _would_run(repo, **{"evaluate.tta": "hflip"}) == {"evaluate"}
    assert _would_run(repo, **{"export.opset": 19}) == {"export"}
    assert _would_run(repo, **{"pretrain.epochs": 3}) == {"pretrain", "finetune", "evaluate", "export"}
    assert _would_run(repo, **{"data.finetune.seed": 1}) == {"shard@finetune", "finetune", "evaluate", "export"}


def test_dvc_sees_the_code_each_stage_runs(repro):
    """A default in pipeline/config.py (every key params.yaml leaves out) changes every stage's inputs;
    model code changes evaluate's and export's own, not only through a retrained model (a stage that
    retrains bit for bit leaves models/finetune as it was, and evaluate's attention maps were stale)."""
    repo, _ = repro

    def changed_by(path: str) -> set[str]:
        original = (repo / path).read_text()
        (repo / path).write_text(original + "\n# an edit\n")
        try:
            status = run(["dvc", "status", "--json"], repo, timeout=120)
            assert status.returncode == 0, status.stderr
            return set(json.loads(status.stdout))
        finally:
            (repo / path).write_text(original)

    assert changed_by("pipeline/config.py") == {"shard@pretrain", "shard@finetune", "pretrain", "finetune",
                                                 "evaluate", "export"}
    assert {"evaluate", "export"} <= changed_by("pipeline/model/attention.py")
    # what writes the outputs' bytes (CSV, JSON, the curves) and picks evaluate's device
    assert changed_by("pipeline/utils.py") == {"pretrain", "finetune", "evaluate", "export"}
    assert changed_by("pipeline/plots.py") == {"pretrain", "finetune", "evaluate"}
    assert changed_by("pipeline/train/context.py") == {"pretrain", "finetune", "evaluate"}


def test_dvc_exp_run_patch_and_resolution(repro):
    """The README's experiment: fine-tune the patch-4 pretrained model at patch 8 and 48 px (kernel
    PI-resized, position embeddings resampled), seen by dvc exp show and MLflow; pretrain is reused,
    the exported model is patch 8 at 48 px; normalisation from the fine-tune set's pixel stats
    reaches the exported model's config."""
    repo, _ = repro
    proc = run(["dvc", "exp", "run", "-n", "p8-r48", "-S", "finetune.patch_size=8", "-S", "finetune.image_size=48",
                "-S", "++finetune.augment.mean=dataset", "-S", "++finetune.augment.std=dataset"], repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Stage 'pretrain' didn't change, skipping" in proc.stdout + proc.stderr
    show = run(["dvc", "exp", "show", "--json"], repo, timeout=120)
    assert show.returncode == 0
    exps = json.loads(show.stdout)
    names = [e.get("name") for base in exps for e in (base.get("experiments") or []) for e in (e.get("revs") or [])]
    assert "p8-r48" in names, show.stdout[:2000]
    metrics = json.loads((repo / "metrics/evaluate.json").read_text())
    assert set(metrics["resolution_sweep"]) == {"24", "32"} and 0 <= metrics["top1"] <= 1
    exported = json.loads((repo / "exports/config.json").read_text())
    assert exported["model"]["patch_size"] == [8, 8] and exported["image_size"] == 48
    stats = json.loads((repo / "data/shards/finetune/dataset.json").read_text())["pixel_stats"]
    assert exported["normalize"] == {"mean": stats["mean"], "std": stats["std"]}
    assert exported["normalize"]["mean"] != [0.5] * 3
    client, pretrain = pretrain_runs(repo)
    trained = [r for r in pretrain if "ray.previous_mlflow_run" not in r.data.tags]  # not a forced re-run's
    assert len(trained) == 1  # the fixture's: no experiment retrained it
    exp = client.get_experiment_by_name("vit-pipeline")
    ft = client.search_runs([exp.experiment_id], "tags.stage = 'finetune' and params.`finetune.patch_size` = '8'")
    assert len(ft) == 1 and ft[0].data.params["image_size"] == "48" and ft[0].data.params["patch_size"] == "8"
    assert ft[0].data.params["model.patch_size"] == "4"  # pretrained at patch 4


def test_dvc_exp_run_tta_re_runs_evaluate_only(repro):
    """`-S evaluate.tta=hflip-shift`: only evaluate runs again, over its Ray tasks; its top-1 is the mean
    of 10 views' logits of each test image, and `top1_single_view`, the image alone, is the plain
    evaluation's top-1 of the same weights. The pipeline run in MLflow carries both and the param."""
    repo, _ = repro
    plain = json.loads((repo / "metrics/evaluate.json").read_text())  # the workspace's model, tta: none
    assert "top1_single_view" not in plain
    proc = run(["dvc", "exp", "run", "-n", "tta", "-S", "evaluate.tta=hflip-shift"], repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "Running stage 'evaluate'" in out and "Stage 'finetune' didn't change, skipping" in out
    assert "Running stage 'export'" not in out  # export does not depend on evaluate.*
    flipped = json.loads((repo / "metrics/evaluate.json").read_text())
    assert flipped["top1_single_view"] == pytest.approx(plain["top1"], abs=1e-9)
    assert flipped["num_samples"] == plain["num_samples"] and flipped["loss"] != pytest.approx(plain["loss"])
    assert f"(tta hflip-shift; the image alone {flipped['top1_single_view']:.4f})" in out
    client, _ = pretrain_runs(repo)
    exp = client.get_experiment_by_name("vit-pipeline")
    [parent] = client.search_runs([exp.experiment_id], "tags.kind = 'pipeline' and tags.`dvc.exp_name` = 'tta'")
    assert parent.data.params["evaluate.tta"] == "hflip-shift"
    assert parent.data.metrics["test_top1"] == pytest.approx(flipped["top1"])
    assert parent.data.metrics["test_top1_single_view"] == pytest.approx(plain["top1"])


def test_a_stage_that_fails_under_dvc_gets_its_outputs_back_from_dvc_checkout(repro):
    """`dvc repro` deletes a stage's outputs before it starts the stage's command, so a stage that fails
    there leaves none (run by itself it leaves the previous ones); as docs/experiments.md says, `dvc checkout
    <stage>` brings its cached outputs back byte for byte (dvc.lock still names them), and the metrics file,
    which git keeps, comes back from git."""
    repo, _ = repro
    exports = {p.relative_to(repo): p.read_bytes() for p in (repo / "exports").rglob("*") if p.is_file()}
    metrics = (repo / "metrics/export.json").read_bytes()
    original = (repo / "params.yaml").read_text()
    raw = yaml.safe_load(original)
    raw["export"]["max_abs_diff"] = -1.0  # refused by the stage (exit 2), after DVC removed its outputs
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    try:
        proc = run(["dvc", "repro", "export"], repo, timeout=300)
        assert proc.returncode != 0 and "export.max_abs_diff" in proc.stdout + proc.stderr, proc.stderr[-2000:]
        assert not (repo / "exports").exists() and not (repo / "metrics/export.json").exists()
    finally:
        (repo / "params.yaml").write_text(original)
        (repo / "metrics/export.json").write_bytes(metrics)  # what `git checkout metrics/` does in a real checkout
    assert run(["dvc", "checkout", "export"], repo, timeout=300).returncode == 0
    assert {p.relative_to(repo): p.read_bytes() for p in (repo / "exports").rglob("*") if p.is_file()} == exports
    assert run(["dvc", "status"], repo, timeout=120).stdout.strip() == "Data and pipelines are up to date."


def test_dvc_remote_push_then_a_fresh_clone_pulls_and_is_up_to_date(repro, s3_server, tmp_path):
    """docs/experiments.md's DVC remote on the local S3 server: push every out, clone the repo fresh, `dvc pull`,
    and `dvc repro` there has nothing to do; the pulled model is byte-identical. Runs last: it commits."""
    repo, _ = repro
    env = clean_env(**s3_server.env)  # credentials from the usual AWS variables

    def dvc(*args: str, cwd: Path = repo) -> str:
        proc = subprocess.run(["dvc", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"dvc {' '.join(args)}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        return proc.stdout

    dvc("remote", "add", "-d", "storage", f"s3://{s3_server.bucket}/dvc")
    dvc("remote", "modify", "storage", "endpointurl", s3_server.endpoint)
    dvc("push")
    assert s3_server.keys("dvc/files/md5/")  # the content-addressed cache went up
    for cmd in (["git", "add", "-A"], ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "run"]):
        subprocess.run(cmd, cwd=repo, check=True)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    assert not (clone / "models/finetune").exists()
    dvc("pull", cwd=clone)
    for out in ("models/finetune/model.safetensors", "exports/model.onnx", "data/shards/finetune/manifest.parquet"):
        assert (clone / out).read_bytes() == (repo / out).read_bytes(), out
    assert "up to date" in dvc("repro", cwd=clone)
    assert dvc("status", cwd=clone).strip() == "Data and pipelines are up to date."

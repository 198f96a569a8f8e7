"""Training that survives failures: real Ray Train runs (2 workers) with injected faults, resume, MLflow."""
from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from pipeline.train.context import STATE_FILE, checkpoint_name, latest_checkpoint, list_checkpoints
from pipeline.train.optim import accumulation, param_groups
from tests.faults import inject_fault
from tests.repo_copy import pretrain_runs, run, set_params, sharded_short_run, short_run

pytestmark = pytest.mark.slow
STEPS_PER_EPOCH = 1257 // 64  # digits train split / global batch


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return sharded_short_run(tmp_path_factory.mktemp("train-repo"))


def final_state(repo):
    history = (repo / "plots/pretrain_history.csv").read_text().splitlines()
    header = history[0].split(",")
    rows = [dict(zip(header, line.split(","))) for line in history[1:]]
    return rows, json.loads((repo / "metrics/pretrain.json").read_text())


def test_stopped_run_resumes_failure_recovers_and_new_params_start_fresh(repo, tmp_path, monkeypatch):
    # 1. A run that dies at step 12 with no retries left: the stage fails, MLflow marks the run FAILED.
    inject_fault(monkeypatch, f"raise@12:{tmp_path / 'fault-a'}")
    proc = run(["python", "-m", "stages.pretrain"], repo)
    assert proc.returncode != 0 and (tmp_path / "fault-a").exists()
    client, runs = pretrain_runs(repo)
    assert len(runs) == 1 and runs[0].info.status == "FAILED"
    first_id = runs[0].info.run_id

    # 2. Re-running the stage (as an interrupted `dvc repro` re-run would) continues the same Ray run
    #    from the newest complete checkpoint on disk (step 10; planted beside it, as kills leave them: a
    #    newer one cut short, an old orphan) and logs into the same MLflow run. With a retry allowed
    #    (ray.max_failures is not part of the run), a rank SIGKILLed at step 17 makes Ray Train restart
    #    the worker group from the step-15 checkpoint.
    run_dir = _plant_checkpoints(repo)
    set_params(repo, **{"ray.max_failures": 1})
    inject_fault(monkeypatch, f"kill@17:{tmp_path / 'fault-b'}")
    proc = run(["python", "-m", "stages.pretrain"], repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "fault-b").exists()
    assert "resumed from checkpoint: epoch 0, batch 10, step 10" in proc.stdout
    assert "resumed from checkpoint: epoch 0, batch 15, step 15" in proc.stdout
    left = sorted(d.name for d in run_dir.iterdir() if d.is_dir() and "checkpoint_" in d.name)
    assert left == list_checkpoints(str(run_dir)) and len(left) == 2  # ray.checkpoints_to_keep, across attempts
    client, runs = pretrain_runs(repo)
    assert [r.info.run_id for r in runs] == [first_id] and runs[0].info.status == "FINISHED"
    recovered_rows, summary = final_state(repo)
    assert [int(r["epoch"]) for r in recovered_rows] == [1, 2]
    assert summary["step"] == 2 * STEPS_PER_EPOCH  # same total optimizer steps as an uninterrupted run
    steps_logged = [m.step for m in client.get_metric_history(first_id, "train_loss")]
    assert steps_logged == [STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH]
    recovered = (repo / "models/pretrain/model.safetensors").read_bytes()

    # 3. Changed params (how often it logs: nothing it computes) → a new Ray run and a new MLflow run,
    #    trained from scratch with no failure. Reproducible to the byte: it gives exactly the weights of
    #    the run that failed, resumed and lost a rank (data order, augmentation and every rank's RNG
    #    state come back with the checkpoint), and the same epoch metrics (the checkpoint holds the
    #    epoch's sums so far; summed in another order: to 1e-12).
    set_params(repo, **{"pretrain.log_every_steps": 1})
    proc = run(["python", "-m", "stages.pretrain"], repo)  # fault-b's marker exists: no failure now
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()  # rank 0's lines as it printed them: no "(RayTrainWorker pid=…)"
    assert "resumed" not in proc.stdout and any(line.startswith("[pretrain] epoch 2/2 ") for line in lines)
    assert (repo / "models/pretrain/model.safetensors").read_bytes() == recovered
    rows, summary = final_state(repo)
    assert summary["step"] == 2 * STEPS_PER_EPOCH and len(rows) == 2
    for key in ("train_loss", "train_top1", "val_loss"):
        assert [float(r[key]) for r in rows] == pytest.approx([float(r[key]) for r in recovered_rows], rel=1e-12)
    client, runs = pretrain_runs(repo)
    assert len(runs) == 2 and all(r.info.status == "FINISHED" for r in runs)
    new = next(r for r in runs if r.info.run_id != first_id)
    assert new.data.params["pretrain.log_every_steps"] == "1"
    assert len({r.data.tags["ray.run_name"] for r in runs}) == 2
    # MLflow contents of a run: params, per-epoch and per-step metrics, tags, system metrics
    p, m, t = new.data.params, new.data.metrics, new.data.tags
    for key in ("model.preset", "model.patch_size", "image_size", "world_size", "global_batch_size",
                "pretrain.label_smoothing"):
        assert key in p, key
    assert p["world_size"] == "2" and p["global_batch_size"] == "64"
    for key in ("train_loss", "train_top1", "val_top1", "lr", "images_per_s", "epoch_time_s", "input_wait_s",
                "train_loss_step"):
        assert key in m, key
    for key in ("stage", "git.commit", "git.dirty", "dvc.lock", "dataset.manifest", "pipeline.id"):
        assert key in t, key
    assert any(k.startswith("system/") for k in m)
    artifacts = {a.path for a in client.list_artifacts(new.info.run_id)}
    assert {"pretrain.json", "pretrain_history.csv", "pretrain_curves.png", "config.json"} <= artifacts
    steps = [s.step for s in client.get_metric_history(new.info.run_id, "train_loss_step")]
    assert steps == list(range(1, 2 * STEPS_PER_EPOCH + 1))  # every step: log_every_steps 1


def _plant_checkpoints(repo) -> Path:
    """Beside the step-10 checkpoint Ray recorded: a newer copy cut short and an old orphan copy."""
    (run_dir,) = [d for d in (repo / ".ray_results").iterdir() if d.name.startswith("pretrain-")]
    recorded = latest_checkpoint(str(run_dir))
    cut = run_dir / checkpoint_name()
    shutil.copytree(recorded, cut)
    (cut / STATE_FILE).write_bytes((cut / STATE_FILE).read_bytes()[:1000])
    shutil.copytree(recorded, run_dir / "checkpoint_2000-01-01_00-00-00.000000")
    return run_dir


@pytest.mark.parametrize("uri, needle", [
    ("http://127.0.0.1:9", "MLFLOW_TRACKING_URI=http://127.0.0.1:9 is not reachable"),
    ("{tmp}/mlruns", "MLFLOW_TRACKING_URI={tmp}/mlruns: MLflow cannot use it (The filesystem tracking backend"),
], ids=["server-down", "file-store"])
def test_unusable_tracking_uri_fails_fast(repo, tmp_path, uri, needle):
    """Before Ray starts: one line naming the URI and what to use instead, exit 2 (for MLflow 3's refused
    file store this used to be a 38-line MlflowException traceback)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "MLFLOW_TRACKING_URI": uri.format(tmp=tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "stages.pretrain"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {needle.format(tmp=tmp_path)}"), proc.stderr
    assert ("mlflow server" in proc.stderr or "sqlite:///mlflow.db" in proc.stderr) and "Ray Train" not in proc.stdout


def test_tracking_uri_mlflow_refuses_is_named(tmp_path, monkeypatch):
    """A scheme MLflow does not know, or a database driver that is not installed, fails the check with
    the URI; MLflow's file store passes once the user opts in (MLFLOW_ALLOW_FILE_STORE)."""
    from pipeline.config import ConfigError
    from pipeline.tracking import check_tracking_uri

    with pytest.raises(ConfigError, match=r"^MLFLOW_TRACKING_URI=bogus://x: MLflow cannot use it \(.*unsupported URI"):
        check_tracking_uri("bogus://x")
    with pytest.raises(ConfigError, match=r"^MLFLOW_TRACKING_URI=mysql://u@127.0.0.1:9/db: MLflow cannot use it "
                                          r"\(ModuleNotFoundError: No module named "):
        check_tracking_uri("mysql://u@127.0.0.1:9/db")
    with pytest.raises(ConfigError, match="filesystem tracking backend"):
        check_tracking_uri(str(tmp_path / "mlruns"))
    with pytest.raises(ConfigError, match=r"^MLFLOW_TRACKING_URI=sqlite://mlflow.db: a sqlite store is "
                                          r"sqlite:///<path>, three slashes .*\(sqlite:///mlflow.db\)"):
        check_tracking_uri("sqlite://mlflow.db")  # was SQLAlchemy's traceback
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_tracking_uri(str(tmp_path / "mlruns"))


@pytest.mark.parametrize("status, passes", [(401, True), (403, True), (502, False)])
def test_tracking_server_behind_an_auth_proxy_is_reachable(status, passes):
    """A proxy that asks for credentials answers: the server is there, and MLflow's client sends them
    (MLFLOW_TRACKING_TOKEN, username / password); it stopped every stage as "not reachable". A 502 (the
    server down behind its proxy) still stops it, naming the status."""
    from pipeline.tracking import TrackingUnreachable, check_tracking_uri

    with _http_server(lambda path: (status, b"")) as host:
        uri = f"http://{host}"
        if passes:
            check_tracking_uri(uri)
        else:
            with pytest.raises(TrackingUnreachable, match=rf"^MLFLOW_TRACKING_URI={uri} answers HTTP 502 \(Bad Gateway\)"):
                check_tracking_uri(uri)


@contextmanager
def _http_server(answer):
    """A loopback HTTP server whose GETs ``answer(path)`` gives as (status, body); yields its host:port."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = answer(self.path)
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_tracking_server_that_refuses_the_host_name_is_one_line():
    """MLflow's server answers /health whatever the Host header, but refuses API calls from a name it was not
    told (403 "Invalid Host header", as in a Kubernetes Service without MLFLOW_ALLOWED_HOSTS): the check took it
    for an auth proxy and the stage died later in a traceback. Now it names the host and the setting."""
    from pipeline.config import ConfigError
    from pipeline.tracking import check_tracking_uri

    def guarded(path: str):  # as MLflow's server: /health for anyone, the API for the names it was given
        if path.startswith("/api/"):
            return 403, b"Invalid Host header - possible DNS rebinding attack detected"
        return 200, b"OK"

    with _http_server(guarded) as host:
        with pytest.raises(ConfigError, match=rf"^MLFLOW_TRACKING_URI=http://{host}: the server refuses the name "
                                              rf"'{host}' \(Invalid Host header\); start it with "
                                              rf"MLFLOW_ALLOWED_HOSTS listing {host}"):
            check_tracking_uri(f"http://{host}")


def test_damaged_sqlite_store_is_named(tmp_path):
    """A sqlite tracking store that is not a readable database fails the check with its path; a healthy
    one, a missing one (MLflow creates it) and one locked by a writer pass."""
    import sqlite3

    from pipeline.tracking import TrackingStoreDamaged, check_tracking_uri

    store = tmp_path / "my runs.db"
    check_tracking_uri(f"sqlite:///{store}")
    with sqlite3.connect(store) as db:
        db.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, name TEXT)")
        db.executemany("INSERT INTO runs (name) VALUES (?)", [("x" * 500,)] * 200)
    check_tracking_uri(f"sqlite:///{store}")
    writer = sqlite3.connect(store, isolation_level=None)
    writer.execute("BEGIN EXCLUSIVE")
    try:
        check_tracking_uri(f"sqlite:///{store}")
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    whole = store.read_bytes()
    for damaged in (whole[:len(whole) // 2], b"not a database" * 100):
        store.write_bytes(damaged)
        with pytest.raises(TrackingStoreDamaged, match=f"^{store}: the MLflow store is damaged"):
            check_tracking_uri(f"sqlite:///{store}")


def test_rank_zero_logger_writes_everything_before_close_returns_and_names_a_failed_write(tmp_path):
    """The loop's MLflow writes are asynchronous (they never hold up a step): after ``close`` every
    metric is in the store, in order, with its tags; a write that failed is raised by ``close``."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import RunLogger

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("logger")).info.run_id
    logger = RunLogger(uri, run_id)
    logger.set_tags({"env.host": "rank-0-node"})
    for step in range(1, 51):
        logger.log_metrics({"train_loss_step": 1 / step, "lr_step": torch.tensor(0.5)}, step=step)
    logger.close()
    history = client.get_metric_history(run_id, "train_loss_step")
    assert [(m.step, m.value) for m in history] == [(s, 1 / s) for s in range(1, 51)]
    assert len(client.get_metric_history(run_id, "lr_step")) == 50
    assert client.get_run(run_id).data.tags["env.host"] == "rank-0-node"

    missing = RunLogger(uri, "f" * 32)  # no such run: the write fails in MLflow's logging thread
    missing.log_metrics({"train_loss_step": 1.0}, step=1)
    with pytest.raises(MlflowException, match="f" * 32):
        missing.close()


def test_step_hooks_that_do_not_import_stop_the_stage_before_any_rank(monkeypatch):
    """A $VIT_STEP_HOOKS name that does not import is one line before Ray starts (it failed on every rank of
    every attempt); one that does is passed on."""
    from pipeline.config import ConfigError
    from pipeline.train.driver import step_hooks_from_env

    monkeypatch.setenv("VIT_STEP_HOOKS", "tests.faults:fail_once, nosuchmod:fn=3")
    with pytest.raises(ConfigError, match=r"^\$VIT_STEP_HOOKS: step hook 'nosuchmod:fn=3': cannot import "
                                          r"'nosuchmod:fn' \(want module:function\[=argument\]\): No module named"):
        step_hooks_from_env()
    monkeypatch.setenv("VIT_STEP_HOOKS", "tests.faults:fail_once=raise@3")
    assert step_hooks_from_env() == ("tests.faults:fail_once=raise@3",)


def test_accumulation_arithmetic():
    assert accumulation(32, None) == (32, 1)
    assert accumulation(32, 32) == (32, 1)
    assert accumulation(32, 16) == (16, 2)
    assert accumulation(32, 10) == (8, 4)  # smallest accumulation whose micro batch fits and divides
    assert accumulation(30, 7) == (6, 5)
    with pytest.raises(ValueError):
        from pipeline.train.driver import worker_batch
        worker_batch(100, 3)


def test_param_groups_exclude_norms_biases_embeddings_and_layer_decay():
    from pipeline.model import build_vit

    model = build_vit("nano", patch_size=4, image_size=16, num_classes=10, depth=2)
    groups = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for g in groups if g["weight_decay"] == 0 for p in g["params"]}
    assert {"pos_embed", "cls_token", "norm.weight", "head.bias"} <= no_decay
    assert "head.weight" not in no_decay and "blocks.0.attn.qkv.weight" not in no_decay
    ld = param_groups(model, 0.05, layer_decay=0.5)
    scale = {names[id(p)]: g["lr_scale"] for g in ld for p in g["params"]}
    block1 = [v for k, v in scale.items() if k.startswith("blocks.1.")]
    assert scale["head.weight"] == 1.0 and block1 and all(v == 0.5 for v in block1)
    assert scale["patch_embed.proj.weight"] == pytest.approx(0.125)
    assert sum(len(g["params"]) for g in ld) == len(list(model.parameters()))
    assert torch.isfinite(torch.tensor([g["lr_scale"] for g in ld])).all()


def test_optimizer_is_fused_adamw_and_steps_like_the_reference():
    """build_optimizer takes torch's fused AdamW kernel on CPU; its updates match the per-tensor
    AdamW with the same groups (weight decay only where param_groups puts it)."""
    import copy

    import torch.nn.functional as F

    from pipeline.model import build_vit
    from pipeline.train.optim import build_optimizer

    torch.manual_seed(0)  # no qkv bias: the key bias has a ~0 gradient, which Adam turns into noise
    model = build_vit("nano", patch_size=4, image_size=16, num_classes=10, depth=2, qkv_bias=False)
    ref_model = copy.deepcopy(model)
    kw = dict(lr=1e-2, weight_decay=0.05, min_lr=1e-4, warmup_steps=1, total_steps=5)
    opt, _ = build_optimizer(model, **kw)
    assert all(g["fused"] for g in opt.param_groups)
    ref = torch.optim.AdamW(param_groups(ref_model, 0.05), lr=1e-2, foreach=False)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    for m, o in ((model, opt), (ref_model, ref)):
        for _ in range(3):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=n)


def test_one_and_two_workers_give_the_same_first_step_loss(tmp_path_factory):
    """World-size invariance: same global batch and seed → same samples and augmentations per global
    step, so the first-step loss (mean over the global batch) matches on 1 and 2 workers (the latter
    Ray Train ranks with a DataLoader worker each, and activation checkpointing under DDP; the former
    in-process, ``ray.backend: local``)."""
    from mlflow.tracking import MlflowClient

    losses, grad_norms = {}, {}
    for workers in (1, 2):
        def edit(raw, workers=workers):
            raw = short_run(raw)
            raw["pretrain"].update(epochs=1, checkpoint_every_steps=None, log_every_steps=1,
                                   grad_checkpointing=workers == 2)  # recomputation changes nothing
            raw["ray"].update(num_workers=workers, loader_workers=workers - 1,  # 2 ranks x 1 DataLoader worker
                              backend="local" if workers == 1 else "ray")
            return raw

        repo = sharded_short_run(tmp_path_factory.mktemp(f"w{workers}"), edit=edit)
        proc = run(["python", "-m", "stages.pretrain"], repo)
        assert proc.returncode == 0, proc.stderr[-3000:]
        client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
        exp = client.get_experiment_by_name("vit-pipeline")
        (r,) = client.search_runs([exp.experiment_id], "tags.stage = 'pretrain'")
        assert r.data.params["world_size"] == str(workers)
        assert r.data.params["pretrain.grad_checkpointing"] == str(workers == 2)
        history = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "train_loss_step")}
        losses[workers] = history
        grad_norms[workers] = {m.step: m.value for m in client.get_metric_history(r.info.run_id, "grad_norm_step")}
    assert losses[1][1] == pytest.approx(losses[2][1], rel=1e-5, abs=1e-6)
    assert losses[1][2] == pytest.approx(losses[2][2], rel=1e-3)  # after one identical update
    # the gradient of the same global batch, whole on one rank or all-reduced over two (before clipping)
    assert grad_norms[1][1] == pytest.approx(grad_norms[2][1], rel=1e-4) and grad_norms[1][1] > 0


def test_local_runner_and_one_ray_worker_resume_each_other(tmp_path, monkeypatch):
    """``ray.backend: local`` runs the same loop in-process: one run, launched by turns, continues from
    whichever runner's checkpoint is newest (local, Ray, local), all into one MLflow run; then Ray, launched
    on the run the local runner finished, finds nothing to train and saves the same model."""
    from mlflow.tracking import MlflowClient

    def edit(raw):
        raw = short_run(raw)
        raw["pretrain"].update(epochs=1, log_every_steps=1)
        raw["ray"].update(num_workers=1, backend="local")
        return raw

    repo = sharded_short_run(tmp_path / "repo", edit=edit)
    launches = [("local", "raise@7", None), ("ray", "raise@12", "epoch 0, batch 5, step 5"),
                ("local", None, "epoch 0, batch 10, step 10")]
    for backend, fault, resumed in launches:
        set_params(repo, **{"ray.backend": backend})
        if fault:
            inject_fault(monkeypatch, f"{fault}:{tmp_path / fault}")
        proc = run(["python", "-m", "stages.pretrain"], repo)
        assert ("in-process: 1 worker(s)" if backend == "local" else "Ray Train: 1 worker(s)") in proc.stdout
        if resumed:
            assert f"resumed from checkpoint: {resumed}" in proc.stdout, proc.stdout[-2000:]
        if fault:
            assert proc.returncode != 0 and (tmp_path / fault).exists(), proc.stdout[-2000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, summary = final_state(repo)
    assert summary["step"] == STEPS_PER_EPOCH and [int(r["epoch"]) for r in rows] == [1]
    model = (repo / "models/pretrain/model.safetensors").read_bytes()
    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    (r,) = client.search_runs([client.get_experiment_by_name("vit-pipeline").experiment_id],
                              "tags.stage = 'pretrain'")  # every launch logged into one MLflow run
    history = {m.step for m in client.get_metric_history(r.info.run_id, "train_loss_step")}
    assert history == set(range(1, STEPS_PER_EPOCH + 1))
    # Ray's result holds no checkpoint of a run the local runner finished, which once read as a diverged run
    set_params(repo, **{"ray.backend": "ray"})
    proc = run(["python", "-m", "stages.pretrain"], repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    finished = f"run already finished, nothing to train: epoch 1, batch 0, step {STEPS_PER_EPOCH}"
    assert finished in proc.stdout, proc.stdout[-2000:]
    assert final_state(repo)[1]["step"] == STEPS_PER_EPOCH
    assert (repo / "models/pretrain/model.safetensors").read_bytes() == model


def test_keep_best_of_raw_and_ema_and_stop_early(tmp_path):
    """EMA on, ``keep: best``, ``early_stop_patience: 1``: the run stops at the first evaluation
    without a new best, the saved model is the best epoch's better weight set (its val top-1 is the
    one recorded), and metrics/pretrain.json and MLflow say the same."""
    from pipeline.data import make_eval_loader
    from pipeline.model import load_model
    from pipeline.train.selection import candidate

    EPOCHS = 40

    def edit(raw):
        raw = short_run(raw)
        # enough epochs that the val curve surely stalls once before the end (it climbed for 8 in a row
        # once); the run stops there, so the epochs it does not need cost nothing
        raw["pretrain"].update(epochs=EPOCHS, lr=0.01, ema_decay=0.99, keep="best", early_stop_patience=1,
                               checkpoint_every_steps=None)
        raw["ray"]["backend"] = "local"
        return raw

    repo = sharded_short_run(tmp_path / "repo", edit=edit)
    proc = run(["python", "-m", "stages.pretrain"], repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, summary = final_state(repo)
    scores = [candidate({k: float(v) for k, v in r.items() if k.startswith("val_top1")}) for r in rows]
    best_so_far = [max(s for _, s in scores[:i]) for i in range(1, len(scores) + 1)]
    stop = next(i for i in range(1, len(scores)) if scores[i][1] <= best_so_far[i - 1]) + 1
    assert summary["stopped_epoch"] == stop == len(rows) < EPOCHS and "early stop after epoch" in proc.stdout
    kept = max(range(len(scores)), key=lambda i: (scores[i][1], -i))
    assert summary["kept_epoch"] == kept + 1 and summary["kept_source"] == scores[kept][0]
    model, meta = load_model(repo / "models/pretrain")
    model.eval()
    correct = n = 0
    with torch.no_grad():
        for x, y in make_eval_loader(repo / "data/shards/pretrain", "val", batch_size=64, image_size=meta["image_size"],
                                     rank=0, world_size=1, augment=meta["normalize"]):
            correct += (model(x).argmax(-1) == y).sum().item()
            n += len(y)
    assert correct / n == pytest.approx(summary["kept_val_top1"], abs=1.5 / n)
    client, (r,) = pretrain_runs(repo)
    assert r.data.tags["kept_weights"] == summary["kept_source"] and "keep: best" in r.data.tags["kept_reason"]
    for key in ("kept_epoch", "kept_val_top1", "stopped_epoch", "wall_time_s"):
        assert r.data.metrics[key] == pytest.approx(summary[key]), key


def test_a_diverging_run_stops_on_every_rank_and_saves_nothing(tmp_path):
    """An LR that blows the weights up (NaN by the third step): both Ray ranks stop at the first step
    whose loss and weights are not finite, without checkpointing it and without Ray retrying the run
    (``max_failures: 2``); the stage fails in one line naming the last good checkpoint, writes no
    outputs and marks its MLflow run FAILED."""
    import re

    def edit(raw):
        raw = short_run(raw)
        raw["pretrain"].update(lr=1e4, checkpoint_every_steps=1)
        raw["ray"].update(max_failures=2)
        return raw

    repo = sharded_short_run(tmp_path / "repo", edit=edit)
    proc = run(["python", "-m", "stages.pretrain"], repo)
    assert proc.returncode == 1, proc.stderr[-3000:]
    diverged = re.findall(r"\[pretrain\] diverged: the training loss is (\S+) at step (\d+) \(epoch 1\)", proc.stdout)
    assert len(diverged) == 1, proc.stdout[-3000:]  # rank 0 only, and no second attempt
    (loss, step), = diverged
    assert loss in ("nan", "inf", "-inf") and int(step) > 1
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: TrainingDiverged: pretrain run pretrain-\w+ diverged after its last checkpoint "
                        rf"\(step {int(step) - 1}, epoch 1\): .* lower pretrain\.lr, .*", last), last
    assert not (repo / "models/pretrain").exists() and not (repo / "metrics/pretrain.json").exists()
    _, (r,) = pretrain_runs(repo)
    assert r.info.status == "FAILED"


def test_a_time_budget_run_is_the_run_of_the_epochs_it_planned(tmp_path, monkeypatch):
    """A budget spent before the 3-epoch warm-up ends: after it both Ray ranks plan 4 epochs (one more,
    at most 7), it is printed, logged and in metrics/pretrain.json; a rank lost in epoch 4 (Ray restarts
    the worker group) resumes with the plan; and the run is the one ``epochs: 4`` without a budget trains,
    epoch by epoch."""
    import re

    def edit(raw):
        raw = short_run(raw)
        raw["pretrain"].update(epochs=7, warmup_epochs=3, time_budget_minutes=0.001)
        raw["ray"].update(max_failures=1)
        return raw

    repo = sharded_short_run(tmp_path / "repo", edit=edit)
    inject_fault(monkeypatch, f"raise@{3 * STEPS_PER_EPOCH + 8}:{tmp_path / 'failed'}")
    proc = run(["python", "-m", "stages.pretrain"], repo)
    assert proc.returncode == 0 and (tmp_path / "failed").exists(), proc.stderr[-3000:]
    planned = re.findall(r"\[pretrain\] time budget 0.001 min: [\d.]+ s spent, [\d.]+ s per epoch -> 4 epochs "
                         r"\(at most 7\)", proc.stdout)
    assert len(planned) == 1, proc.stdout[-3000:]  # planned once: the restarted ranks restore the plan
    assert f"resumed from checkpoint: epoch 3, batch 8, step {3 * STEPS_PER_EPOCH + 8}" in proc.stdout
    budget_rows, summary = final_state(repo)
    assert len(budget_rows) == summary["epoch"] == summary["planned_epochs"] == 4
    client, (r,) = pretrain_runs(repo)
    assert r.data.metrics["planned_epochs"] == 4
    walls = client.get_metric_history(r.info.run_id, "wall_time_s")  # once per epoch, over both attempts
    assert min(m.step for m in walls) > 0  # none at step 0, where a chart over steps would start at the end
    assert len({m.step for m in walls}) == len(walls) == 4  # the summary does not log the last one again

    set_params(repo, **{"pretrain.epochs": 4, "pretrain.time_budget_minutes": None})
    proc = run(["python", "-m", "stages.pretrain"], repo)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows, _ = final_state(repo)
    for key in ("lr", "train_loss", "train_top1", "val_loss", "val_top1"):
        assert [float(r[key]) for r in rows] == pytest.approx([float(r[key]) for r in budget_rows], rel=1e-6), key

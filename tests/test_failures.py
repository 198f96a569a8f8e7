"""When things go wrong: sizes that cannot work, a second run of a running stage, SIGTERM, outputs
that cannot be written, checkpoints left by interrupted runs. Real stages in a temp repo copy."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from pipeline.outputs import PARTIAL, staged_outputs
from pipeline.train.context import (
    STAGING_PREFIX,
    STAGING_SUFFIX,
    STATE_FILE,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
)
from tests.conftest import clean_env, tracebacks
from tests.repo_copy import pretrain_runs, run, set_params, sharded_short_run, short_run


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return sharded_short_run(tmp_path_factory.mktemp("fail-repo"))


@pytest.mark.parametrize("updates, needles", [
    ({"pretrain.global_batch_size": 100000, "ray.num_workers": 1},
     ["pretrain.global_batch_size: 100000 is larger than the train split", "valid: 1..1257"]),
    ({"ray.num_workers": 64}, ["ray.num_workers: 64 ranks", f"{os.cpu_count()} CPUs", "ray.address"]),
    ({"ray.use_gpu": True}, [f"needs 2 GPU (this machine has {torch.cuda.device_count()})", "ray.use_gpu: false"]),
    pytest.param({"ray.use_gpu": True, "ray.backend": "local"},
                 ["ray.use_gpu: true with ray.backend: local needs a CUDA device and torch sees none"],
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")),
])
def test_infeasible_sizes_fail_fast_with_a_message(repo, updates, needles, monkeypatch, capsys):
    """The pretrain stage's own entry point, in this process (the checks come before Ray and MLflow)."""
    from pipeline.cli import run_stage
    from pipeline.train.stage import pretrain

    set_params(repo, **updates)
    monkeypatch.chdir(repo)
    for var in ("RAY_ADDRESS", "VIT_PARAMS", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as stop:
            run_stage(pretrain)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        set_params(repo, **{"pretrain.global_batch_size": 64, "ray.num_workers": 2, "ray.use_gpu": False,
                            "ray.backend": "ray"})
    err = capsys.readouterr().err
    assert stop.value.code == 2, err
    for n in needles:
        assert n in err, (n, err)
    assert not (repo / "models/pretrain").exists()


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("argv, line", [
    (["-m", "stages.evaluate", "extra"], "error: stage evaluate takes no arguments, got: extra"),
    (["-m", "pipeline", "stage", "export", "--force"], "error: stage export takes no arguments, got: --force"),
    (["-m", "stages.shard", "pretrain", "finetune"],
     "error: stage shard-pretrain-finetune takes at most 1 argument(s), got: pretrain finetune"),
])
def test_stray_stage_arguments_are_refused(tmp_path, argv, line):
    """A stage given arguments it does not take stops in one line, exit 2, before reading params.yaml or
    taking its lock (before: evaluate and the others ignored them and ran)."""
    out = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert (out.returncode, out.stdout, out.stderr) == (2, "", line + "\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig, group", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["sigterm", "ctrl-c"])
def test_second_instance_is_refused_and_a_stop_is_clean(repo, sig, group):
    """A second identical stage fails fast (exit 3); SIGTERM, or Ctrl-C (SIGINT to the terminal's whole
    process group), ends the first with one line, exit 128 + the signal, its MLflow run KILLED, no Ray left
    behind, no outputs written and no half-written checkpoint kept. Ctrl-C used to reach Ray Train's own
    handler: it aborted the run and exited 1 in silence, or trained on to the end and wrote nothing."""
    set_params(repo, **{"pretrain.epochs": 50})
    shutil.rmtree(repo / ".ray_results", ignore_errors=True)  # the other case's checkpoints: wait for this run's
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "VIT_PARAMS")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    first = subprocess.Popen([sys.executable, "-m", "stages.pretrain"], cwd=repo, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _wait_for(lambda: (repo / ".ray_results").is_dir() and any((repo / ".ray_results").rglob("checkpoint_*")),
                  400, "the first run's first checkpoint")  # ~45 s on an idle 2-core machine
        second = run(["python", "-m", "stages.pretrain"], repo, timeout=240)
        assert second.returncode == 3, second.stderr[-2000:]
        assert f"stage 'pretrain' is already running in {repo} (pid {first.pid}" in second.stderr
        run_dir = next((repo / ".ray_results").rglob("checkpoint_*")).parent
        (run_dir / f"{STAGING_PREFIX}planted{STAGING_SUFFIX}").mkdir()  # as a rank killed mid-save leaves one
        own_ray = _ray_servers_of(first.pid)  # this stage's (the other test process may be running Ray too)
        assert own_ray, "no raylet / gcs_server under the running stage"
        os.killpg(first.pid, sig) if group else first.send_signal(sig)
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
        set_params(repo, **{"pretrain.epochs": 2})
    assert first.returncode == 128 + sig, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"error: stopped by {sig.name}") and not tracebacks(err), err[-3000:]
    assert "SIGTERM received" not in err  # Ray's abort handler did not run
    _, runs = pretrain_runs(repo)
    assert [r.info.status for r in runs] == ["KILLED"]
    assert not (repo / "models/pretrain").exists() and not list(repo.rglob(f"{PARTIAL}*"))
    assert not list(run_dir.glob(f"{STAGING_PREFIX}*")), sorted(os.listdir(run_dir))
    _wait_for(lambda: not any(_alive(p) for p in own_ray), 30, "the stopped stage's Ray to shut down")


def _ray_servers_of(pid: int) -> list:
    """The Ray instance a stage started: its raylet and GCS server, children of the stage's process."""
    import psutil
    servers = []
    for proc in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # a worker that ended meanwhile
            if proc.name() in ("raylet", "gcs_server"):
                servers.append(proc)
    return servers


def _alive(proc) -> bool:
    import psutil
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_only_ray_trains_overload_warning_is_not_counted_as_a_traceback():
    """The tests' check for tracebacks lets through the one Ray Train logs on an overloaded machine
    (a WARNING it calls safe to ignore), with or without Ray's "(Actor pid=N)" prefix, and no other."""
    warning = ("(TrainController pid=7) 2026-12-03 WARNING autoscaling_coordinator_client.py:71 -- Failed to send "
               "resource request for train-0a1b. If this only happens transiently during network partition or CPU "
               "being overloaded, it's safe to ignore this error.\n"
               "(TrainController pid=7) Traceback (most recent call last):\n"
               '(TrainController pid=7)   File "client.py", line 58, in send_resource_request\n'
               "(TrainController pid=7) ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready.\n")
    real = "error: stopped by SIGTERM\nTraceback (most recent call last):\n  File \"stage.py\"\nValueError: bad\n"
    assert tracebacks(warning) == [] and tracebacks(warning.replace("(TrainController pid=7) ", "")) == []
    assert len(tracebacks(warning + real)) == 1 and tracebacks(real)[0].endswith("ValueError: bad")


# In a Ray task of a local instance: Ray Train's controller's request to the autoscaling coordinator, then
# the named actors of the cluster (the coordinator would be one, created by the request).
_COORDINATOR_PROBE = """
import time
import ray
from pipeline.cluster import COORDINATOR_CLIENT, init_ray
from pipeline.config import RayConfig

@ray.remote
def request_then_named_actors():
    import importlib, time
    from ray.train import ScalingConfig
    client = importlib.import_module(COORDINATOR_CLIENT).TrainAutoscalingCoordinatorClient("train-probe")
    started = time.monotonic()
    client.send_resource_request(ScalingConfig(num_workers=1), 1)
    client.cancel_resource_request()
    return time.monotonic() - started, ray.util.list_named_actors(all_namespaces=True)

def idle_workers() -> int:
    import psutil
    time.sleep(1)  # the time Ray's worker starts would take to show
    return sum(p.cmdline()[:1] == ["ray::IDLE"] for p in psutil.Process().children(recursive=True))

for verbose in (False, True):
    init_ray(RayConfig(num_workers=1, verbose=verbose))
    idle = idle_workers()
    took, actors = ray.get(request_then_named_actors.remote())
    print(verbose, took < 0.1, actors, idle, flush=True)
    ray.shutdown()
"""


def test_a_local_ray_train_run_leaves_out_the_placement_group_cleaner_and_any_run_the_datasets_actor():
    """The cleaner frees a run's reservation should its controller die, and reads Ray's state API (served by
    the dashboard): on the stage's own instance, which ends with the stage and starts no dashboard, it is
    left out; on a joined cluster, which outlives the run, it stays. The stages pass no Ray Datasets, so no
    run starts the actor that would serve them."""
    from ray.train import ScalingConfig

    from pipeline.cluster import torch_trainer
    from pipeline.config import RayConfig

    def callbacks(**ray_cfg) -> set[str]:
        trainer = torch_trainer(RayConfig(**ray_cfg), lambda config: None, scaling_config=ScalingConfig(num_workers=1))
        return {type(c).__name__ for c in trainer._create_default_callbacks()}

    assert "PlacementGroupCleanerCallback" not in callbacks(num_workers=1)
    assert "PlacementGroupCleanerCallback" in callbacks(num_workers=1, address="auto")
    assert "DatasetsCallback" not in callbacks(num_workers=1) | callbacks(num_workers=1, address="auto")


@pytest.mark.slow
def test_a_local_ray_sends_no_autoscaler_requests():
    """Ray Train's controller asked an autoscaling coordinator (an actor it starts) for the run's resources and
    waited up to 5 s for it: on a busy machine it timed out with a 20-line traceback in the middle of a stage's
    lines. A stage's own Ray instance has no autoscaler: its processes send nothing and start no such actor. Nor
    does it start workers before anything asks for one."""
    proc = subprocess.run([sys.executable, "-c", _COORDINATOR_PROBE], cwd=Path(__file__).parents[1],
                          env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["False True [] 0", "True True [] 0"]


@pytest.mark.slow
def test_unwritable_output_fails_before_the_work(repo, tmp_path):
    """An output location that cannot be written stops the stage before it trains, with the path."""
    (repo / "plots").mkdir(exist_ok=True)
    (repo / "plots/pretrain_history.csv").write_text("old\n")
    shutil.rmtree(repo / "metrics", ignore_errors=True)
    (repo / "metrics").write_text("a file where the metrics directory should be")
    try:
        proc = run(["python", "-m", "stages.pretrain"], repo, timeout=120)
    finally:
        (repo / "metrics").unlink()
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "cannot write stage outputs into metrics/" in proc.stderr and "Traceback" not in proc.stderr
    assert "a file is in the way on this path: move it aside" in proc.stderr  # not "fix its permissions"
    assert "Ray Train" not in proc.stdout
    assert (repo / "plots/pretrain_history.csv").read_text() == "old\n"
    assert not list(repo.rglob(f"{PARTIAL}*"))


@pytest.mark.slow
def test_no_test_images_stops_evaluate_and_export_with_the_fix(repo):
    """Shards with an empty test split (the shard stage warns of it) stop evaluate and export before
    their work, with one line saying why the split is empty and what gives it images."""
    from pipeline.model import build_vit, save_model

    # export reads the model first (a missing one is the first thing to say): untrained, it is never used
    save_model(build_vit("nano", patch_size=4, image_size=32, num_classes=10, depth=1), repo / "models/finetune",
               {"image_size": 32, "normalize": {"mean": [0.5] * 3, "std": [0.5] * 3}})
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    raw["data"]["finetune"]["test_fraction"] = 0.0
    (repo / "params.no-test.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = clean_env(VIT_PARAMS="params.no-test.yaml")
    try:
        shard = subprocess.run([sys.executable, "-m", "stages.shard", "finetune"], cwd=repo, env=env,
                               capture_output=True, text=True, timeout=300)
        assert shard.returncode == 0, shard.stderr[-2000:]
        assert "the test split is empty (test_fraction is 0.0)" in shard.stdout + shard.stderr
        for stage in ("evaluate", "export"):
            proc = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=repo, env=env, capture_output=True,
                                  text=True, timeout=120)
            assert proc.returncode == 1, proc.stderr[-2000:]
            assert proc.stderr.strip().splitlines() == [
                "error: ValueError: data/shards/finetune holds no test images (test_fraction is 0.0): the evaluate "
                "and export stages have no test images; give the source a test/ folder or set "
                "data.finetune.test_fraction above 0, then run the shard stage again (dvc repro, or python -m "
                "stages.shard finetune)"], stage
    finally:
        for out in ("data/shards/finetune", "models/finetune"):
            shutil.rmtree(repo / out, ignore_errors=True)
        (repo / "params.no-test.yaml").unlink()


@pytest.mark.slow
def test_a_model_of_other_classes_stops_evaluate_and_export(repo):
    """Shards re-made from another dataset after the fine-tune: evaluate scored the new images under the
    model's class names and export registered the model, both exiting 0. Now one line naming both lists."""
    from pipeline.model import build_vit, save_model

    other = [f"c{i}" for i in range(10)]
    save_model(build_vit("nano", patch_size=4, image_size=32, num_classes=10, depth=1), repo / "models/finetune",
               {"image_size": 32, "classes": other, "normalize": {"mean": [0.5] * 3, "std": [0.5] * 3}})
    env = clean_env()
    try:
        shard = subprocess.run([sys.executable, "-m", "stages.shard", "finetune"], cwd=repo, env=env,
                               capture_output=True, text=True, timeout=300)
        assert shard.returncode == 0, shard.stderr[-2000:]
        for stage in ("evaluate", "export"):
            proc = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=repo, env=env, capture_output=True,
                                  text=True, timeout=120)
            assert proc.returncode == 1, proc.stderr[-2000:]
            assert proc.stderr.strip().splitlines() == [
                f"error: ValueError: models/finetune was trained on the classes {other} but data/shards/finetune "
                f"holds {[str(i) for i in range(10)]}; train it on these shards (dvc repro finetune)"], stage
    finally:
        for out in ("data/shards/finetune", "models/finetune"):
            shutil.rmtree(repo / out, ignore_errors=True)


@pytest.mark.slow
def test_cut_short_shard_stops_the_stage_before_ray(repo):
    """A shard shorter than dataset.json says (an interrupted copy) ends the stage with one line naming
    it, both sizes and what to do, before Ray or MLflow start."""
    shard = repo / "data/shards/pretrain/train-000001.tar"
    whole = shard.read_bytes()
    _, runs_before = pretrain_runs(repo)
    try:
        shard.write_bytes(whole[:30000])
        proc = run(["python", "-m", "stages.pretrain"], repo, timeout=120)
    finally:
        shard.write_bytes(whole)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: TarFormatError: data/shards/pretrain/train-000001.tar: 30,000 bytes, but the shard stage wrote "
        f"{len(whole):,} (data/shards/pretrain/dataset.json): cut short or changed since; run the shard stage "
        f"again (dvc repro, or python -m stages.shard pretrain)"]
    assert "Ray Train" not in proc.stdout
    assert len(pretrain_runs(repo)[1]) == len(runs_before)


@pytest.mark.slow
def test_shard_damaged_inside_fails_on_the_ray_worker_and_ends_in_one_line(tmp_path):
    """Damage that keeps the size (a corrupt tar header) is met by a Ray Train rank, which hashes the
    shard as it opens it: the stage's last line is the rank's error, naming the shard's sha256 against
    dataset.json's and what to do, not Ray's wrapper with the remote traceback in it."""
    import hashlib

    repo = sharded_short_run(tmp_path / "repo")
    shard = repo / "data/shards/pretrain/train-000000.tar"
    whole = shard.read_bytes()
    damaged = whole[:148] + b"0000001\0" + whole[156:]  # the first header's checksum field
    shard.write_bytes(damaged)
    got, wrote = hashlib.sha256(damaged).hexdigest(), hashlib.sha256(whole).hexdigest()
    proc = run(["python", "-m", "stages.pretrain"], repo, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: TarFormatError: {shard}: sha256 {got[:12]}…, but the shard stage wrote {wrote[:12]}… "
        f"({shard.parent / 'dataset.json'}): changed since; run the shard stage again (dvc repro, or python -m "
        f"stages.shard pretrain)")


@pytest.mark.slow
def test_a_shard_cut_short_mid_run_fails_every_attempt_in_one_line(tmp_path, monkeypatch):
    """A shard cut while the run trains (at the first step of epoch 2, after the epoch-1 checkpoint; at a
    512-byte block, which a tar index takes for the end of the archive): the rank that reads past the cut
    fails, Ray restarts the ranks from the checkpoint (``max_failures: 1``), the restarted ranks find the
    shard cut as they open it (not a shorter shard to train on), and the stage exits 1 with one line
    naming the shard and what to do, having saved no model."""
    from tests.faults import hook_env

    def edit(raw):
        raw = short_run(raw)
        raw["ray"].update(max_failures=1)
        return raw

    repo = sharded_short_run(tmp_path / "repo", edit=edit)
    shard = repo / "data/shards/pretrain/train-000001.tar"
    whole = shard.stat().st_size
    for key, value in hook_env(f"truncate_shard={1257 // 64}:{58 * 512}:{shard}").items():
        monkeypatch.setenv(key, value)
    proc = run(["python", "-m", "stages.pretrain"], repo, timeout=300)
    assert proc.returncode == 1 and shard.stat().st_size == 58 * 512, proc.stderr[-3000:]
    line = (f"error: TarFormatError: {shard}: 29,696 bytes, but the shard stage wrote {whole:,} "
            f"({shard.parent / 'dataset.json'}): cut short or changed since; run the shard stage again (dvc repro, "
            f"or python -m stages.shard pretrain)")
    assert proc.stderr.strip().splitlines()[-1] == line
    assert "resumed from checkpoint: epoch 1" in proc.stdout  # the second attempt met it again
    assert not (repo / "models/pretrain").exists()


@pytest.mark.parametrize("wrap", ["task", "train"])
def test_errors_raised_on_ray_workers_are_reported_as_their_own(wrap):
    """A Ray task's error (evaluate) and a Ray Train rank's (training) come out of Ray's wrapper before
    the stage reports them; an unknown one stays a traceback."""
    from ray.exceptions import RayTaskError
    from ray.train import WorkerGroupError

    from pipeline.cli import _known_failure, _raised_on_ray_worker
    from pipeline.data.tario import TarFormatError

    def wrapped(exc):
        if wrap == "task":
            return RayTaskError("predict_rank", "Traceback (most recent call last): ...", exc).as_instanceof_cause()
        return WorkerGroupError("rank 0: Traceback ...", {1: RuntimeError("rank 1 saw rank 0 go"), 0: exc})

    bad_shard = wrapped(TarFormatError("/data/test-000001.tar: truncated tar archive (a 304-byte header)"))
    assert _known_failure(_raised_on_ray_worker(bad_shard)) == (
        "error: TarFormatError: /data/test-000001.tar: truncated tar archive (a 304-byte header)", 1)
    assert _known_failure(_raised_on_ray_worker(wrapped(KeyError("a bug")))) is None


def test_out_of_memory_is_one_line_naming_the_params_that_shrink_a_step():
    """torch's account of what it could not allocate (not its allocator's statistics), then the stage's
    params that make a step hold less; on a Ray rank as in-process; on the CPU as on a GPU."""
    from ray.train import WorkerGroupError

    from pipeline.cli import _known_failure, _raised_on_ray_worker
    from tests.faults import OOM

    gpu = ("error: out of memory: CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a total capacity of "
           "79.19 GiB of which 3.06 GiB is free.")
    on_rank = WorkerGroupError("rank 1: Traceback ...", {1: torch.OutOfMemoryError(OOM)})
    assert _known_failure(_raised_on_ray_worker(on_rank), "finetune") == (
        f"{gpu} A rank's finetune step holds finetune.global_batch_size / ray.num_workers images: lower "
        "finetune.global_batch_size, or keep it and set finetune.max_worker_batch (the step accumulates gradients "
        "over micro-batches that size) or finetune.grad_checkpointing: true (activations recomputed in the "
        "backward)", 1)
    assert _known_failure(torch.OutOfMemoryError(OOM), "evaluate") == (f"{gpu} Lower evaluate.batch_size", 1)
    with pytest.raises(RuntimeError) as cpu:
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: refused at once, whatever the machine
    line, code = _known_failure(cpu.value, "pretrain")
    assert line.startswith("error: out of memory: [enforce fail") and "pretrain.max_worker_batch" in line and code == 1
    assert _known_failure(RuntimeError("a bug"), "pretrain") is None


@pytest.mark.slow
def test_out_of_memory_on_a_ray_rank_ends_the_stage_in_one_line(tmp_path, monkeypatch):
    """A rank that runs out of memory (torch's error, raised where a step would) ends the stage with
    exit 1 and the one line, after Ray's own report of the rank's traceback."""
    from tests.faults import inject_fault

    repo = sharded_short_run(tmp_path / "repo")
    inject_fault(monkeypatch, f"oom@2:{tmp_path / 'oom'}")
    proc = run(["python", "-m", "stages.pretrain"], repo, timeout=300)
    assert proc.returncode == 1 and (tmp_path / "oom").exists(), proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: out of memory: CUDA out of memory. Tried to allocate 12.00 GiB.") and (
        last.endswith("pretrain.grad_checkpointing: true (activations recomputed in the backward)")), last
    assert not (repo / "models/pretrain").exists()


def test_staged_outputs_publish_together_or_not_at_all(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("models/m").mkdir(parents=True)
    Path("models/m/old.bin").write_text("old")
    Path("metrics").mkdir()
    Path("metrics/m.json").write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with staged_outputs("models/m", "metrics/m.json") as out:
            out["models/m"].mkdir()
            (out["models/m"] / "new.bin").write_text("new")
            raise RuntimeError("boom")
    assert Path("metrics/m.json").read_text() == "old" and sorted(os.listdir("models/m")) == ["old.bin"]
    assert not list(tmp_path.rglob(f"{PARTIAL}*"))
    with staged_outputs("models/m", "metrics/m.json", "plots/p.png") as out:
        out["models/m"].mkdir()
        (out["models/m"] / "new.bin").write_text("new")
        out["metrics/m.json"].write_text("new")
        assert out["plots/p.png"].suffix == ".png"  # writers that go by the suffix keep working
        out["plots/p.png"].write_bytes(b"png")
    assert sorted(os.listdir("models/m")) == ["new.bin"] and Path("metrics/m.json").read_text() == "new"
    assert not list(tmp_path.rglob(f"{PARTIAL}*"))
    with pytest.raises(RuntimeError, match="plots/p.png was not written"):
        with staged_outputs("metrics/m.json", "plots/p.png") as out:
            out["metrics/m.json"].write_text("newer")
    assert Path("metrics/m.json").read_text() == "new"


def test_checkpoints_newest_complete_first_and_pruned(tmp_path):
    run_dir = tmp_path / "run"
    for i, name in enumerate(["checkpoint_2026-01-01_00-00-00.000001", "checkpoint_2026-01-02_00-00-00.000001",
                              "checkpoint_2026-01-03_00-00-00.000001_local", "checkpoint_2026-01-04_00-00-00.000001"]):
        (run_dir / name).mkdir(parents=True)
        torch.save({"step": i}, run_dir / name / STATE_FILE)
    newest = run_dir / "checkpoint_2026-01-04_00-00-00.000001" / STATE_FILE
    newest.write_bytes(newest.read_bytes()[:-30])  # killed while being written
    (run_dir / ".checkpoint_2026-01-05_00-00-00.000001_local.tmp").mkdir()  # killed while being copied
    assert Path(latest_checkpoint(str(run_dir))).name == "checkpoint_2026-01-03_00-00-00.000001_local"
    removed = prune_checkpoints(str(run_dir), keep=2)
    assert list_checkpoints(str(run_dir)) == ["checkpoint_2026-01-02_00-00-00.000001",
                                              "checkpoint_2026-01-03_00-00-00.000001_local"]
    assert sorted(os.listdir(run_dir)) == list_checkpoints(str(run_dir)) and len(removed) == 3


def test_a_restarted_ray_worker_group_resumes_from_the_newest_complete_checkpoint_on_disk(tmp_path, monkeypatch):
    """After a lost rank, Ray restarts the worker group from the checkpoint it recorded last; one written
    just before the loss is newer and on disk: the ranks take it (Ray's is taken when it is the newest, and
    always where checkpoints are in object storage)."""
    import ray.train

    from pipeline.train.context import RayContext

    run_dir = tmp_path / "run"
    recorded, written, cut = (run_dir / f"checkpoint_2026-01-0{d}_00-00-00.000001" for d in (1, 2, 3))
    for folder in (recorded, written, cut):
        folder.mkdir(parents=True)
        torch.save({"step": 1}, folder / STATE_FILE)
    (cut / STATE_FILE).write_bytes((cut / STATE_FILE).read_bytes()[:-30])  # killed while being written
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: ray.train.Checkpoint.from_directory(str(recorded)))
    ctx = RayContext.__new__(RayContext)  # its __init__ asks Ray Train for the worker's rank and device

    def resumed_from(run_dir) -> Path:
        ctx.run_dir = run_dir and str(run_dir)
        with ctx.resume_dir() as d:
            return Path(d)

    assert resumed_from(run_dir) == written
    assert resumed_from(None) == recorded  # object storage: nothing on this disk to compare
    shutil.rmtree(written)
    assert resumed_from(run_dir) == recorded


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs: a disk that fills for real (a run's checkpoint is over 1 MB). Mounting needs root."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command to make a small disk with")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a small tmpfs (needs root): {proc.stderr.strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def _refused_before_training(repo) -> str:
    """The stage's one stderr line, after it stopped before training."""
    proc = run(["python", "-m", "stages.pretrain"], repo, timeout=300)
    assert proc.returncode == 1 and "in-process: 1 worker(s)" not in proc.stdout, proc.stdout + proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    return line


@pytest.mark.slow
def test_a_full_disk_and_a_planted_or_foreign_checkpoint_end_in_one_line(tmp_path, small_disk):
    """In-process: a checkpoint that does not fit on the disk of ray.storage_path names the file and the
    cause; then a state.pt planted there (a pickle that would run a command) or one torch cannot read
    stops the next launch before it trains, naming the file, and nothing in it runs."""
    import zipfile

    from pipeline.train.context import checkpoint_name
    from tests.faults import RunsCode

    repo = sharded_short_run(tmp_path / "repo")
    set_params(repo, **{"ray.backend": "local", "ray.storage_path": str(small_disk)})
    proc = run(["python", "-m", "stages.pretrain"], repo, timeout=300)
    assert proc.returncode == 1 and not tracebacks(proc.stderr), proc.stderr[-3000:]
    (run_dir,) = small_disk.iterdir()
    line = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: {re.escape(str(run_dir))}/\.checkpoint_[^/]+\.tmp/state\.pt: cannot write a "
                        r"checkpoint: No space left on device", line), line
    assert sorted(p.name for p in run_dir.iterdir()) == []  # the half-written checkpoint is gone

    planted, marker = run_dir / checkpoint_name(), tmp_path / "marker"
    planted.mkdir()
    torch.save({"model": RunsCode(marker)}, planted / STATE_FILE)
    assert _refused_before_training(repo) == (
        f"error: CheckpointError: {planted / STATE_FILE}: not a checkpoint this pipeline wrote: it holds objects "
        f"other than tensors (posix.system); refusing to unpickle it; remove {planted} to resume from the "
        f"checkpoint before it")
    assert not marker.exists()
    with zipfile.ZipFile(planted / STATE_FILE, "w") as z:
        z.writestr("notes.txt", "a zip, as torch.save writes, of something else")
    assert _refused_before_training(repo).startswith(
        f"error: CheckpointError: {planted / STATE_FILE}: not a checkpoint: torch cannot read it (")


@pytest.mark.slow
def test_a_full_disk_on_a_ray_rank_ends_the_stage_in_one_line(tmp_path, small_disk):
    """Ray Train: rank 0's checkpoint that does not fit ends the stage with the rank's one line (the path
    and the cause), after Ray's own report of the rank's traceback."""
    repo = sharded_short_run(tmp_path / "repo")
    set_params(repo, **{"ray.storage_path": str(small_disk)})
    proc = run(["python", "-m", "stages.pretrain"], repo, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: {re.escape(str(small_disk))}/pretrain-\w+/\.checkpoint_[^/]+\.tmp/state\.pt: "
                        r"cannot write a checkpoint: No space left on device", last), last
    assert not (repo / "models/pretrain").exists()

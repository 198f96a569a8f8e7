"""Cluster path: a real Ray head (token auth, loopback dashboard) started by infra/ray-head.sh, a real
job submitted by infra/submit.sh that runs every training stage (pretrain on 2 Ray Train workers,
finetune, evaluate, export with its model registered) with inputs and outputs in a workspace outside
the uploaded working dir, logging to a real MLflow server, as infra/README.md's "One machine, as a
cluster" shows; plus a fast check of the cluster / KubeRay / Docker configs."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import tracebacks
from tests.repo_copy import copy_repo_files

ROOT = Path(__file__).resolve().parents[1]

REPO_FILES = ["pipeline", "stages", "infra", "params.yaml", "dvc.yaml", ".gitignore", "pyproject.toml",
              "requirements.txt"]


def _copy_repo(dst: Path) -> Path:
    return copy_repo_files(dst, REPO_FILES)


def _tiny_overlay(repo: Path, experiment: str) -> str:
    """An overlay on params.yaml (as infra/params.cluster.yaml is), scaled down to a 1-epoch CPU run."""
    overlay = {"model": {"depth": 2}, "pretrain": {"epochs": 1, "warmup_epochs": 0},
               "finetune": {"epochs": 1, "warmup_epochs": 0}, "evaluate": {"resolutions": [32]},
               "export": {"num_images": 16, "registered_model_name": f"{experiment}-model"},
               "ray": {"address": "auto", "num_workers": 2, "max_failures": 0},
               "mlflow": {"experiment": experiment}}
    (repo / "params.test-cluster.yaml").write_text(yaml.safe_dump(overlay, sort_keys=False))
    return "params.test-cluster.yaml"


def _http_status(url: str, token: str | None = None) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        return urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as exc:
        return exc.code


def _listening_addresses(port: int) -> set[str]:
    """Local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            if len(addr) == 8:
                found.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr)[::-1]))
            else:  # four little-endian 32-bit words
                raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, 32, 8))
                found.add(socket.inet_ntop(socket.AF_INET6, raw))
    return found


def _port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# --------------------------------------------------------------------------------------------- head

@pytest.fixture(scope="module")
def ray_head(port_factory, env_factory):
    # Short path: Ray's unix sockets live under the temp dir (108-byte limit).
    state = Path(tempfile.mkdtemp(prefix="vray-", dir="/tmp"))
    ports = {name: port_factory() for name in ("RAY_PORT", "DASHBOARD_PORT", "RAY_CLIENT_PORT", "RAY_AGENT_PORT")}
    env = env_factory(RAY_HEAD_DIR=str(state), RAY_NUM_CPUS="2", RAY_AUTH_TOKEN_PATH=str(state / "token"),
                    RAY_STOP_GRACE="5", **{k: str(v) for k, v in ports.items()})
    script = str(ROOT / "infra/ray-head.sh")
    try:
        proc = subprocess.run(["bash", script, "start"], env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        yield {"state": state, "env": env, "ports": ports, "token": (state / "token").read_text().strip(),
               "api": f"http://127.0.0.1:{ports['DASHBOARD_PORT']}", "start_output": proc.stdout}
    finally:
        stop = subprocess.run(["bash", script, "stop"], env=env, capture_output=True, text=True, timeout=120)
        print(stop.stdout, stop.stderr)
        shutil.rmtree(state, ignore_errors=True)


@pytest.mark.slow
def test_head_requires_token_and_binds_dashboard_to_loopback(ray_head):
    token, api = ray_head["token"], ray_head["api"]
    assert re.fullmatch(r"[0-9a-f]{64}", token), "ray get-auth-token --generate writes 64 hex chars"
    assert (ray_head["state"] / "token").stat().st_mode & 0o077 == 0, "token file readable by others"
    assert _http_status(f"{api}/api/jobs/") == 401            # no token
    assert _http_status(f"{api}/api/jobs/", "0" * 64) == 403   # wrong token
    assert _http_status(f"{api}/api/jobs/", token) == 200
    assert _listening_addresses(ray_head["ports"]["DASHBOARD_PORT"]) == {"127.0.0.1"}
    env_file = (ray_head["state"] / "env").read_text()
    assert f"RAY_API_SERVER_ADDRESS={api}" in env_file and "RAY_AUTH_MODE=token" in env_file
    script = str(ROOT / "infra/ray-head.sh")
    shown, status = (subprocess.run(["bash", script, cmd], env=ray_head["env"], capture_output=True, text=True,
                                    timeout=120) for cmd in ("token", "status"))
    assert shown.returncode == 0 and shown.stdout.strip() == token, shown.stderr  # for a colleague (infra/README)
    assert status.returncode == 0 and re.search(r"[\d.]+/2\.0 CPU", status.stdout), status.stdout + status.stderr


@pytest.mark.slow
def test_submitted_job_trains_into_workspace_and_logs_to_mlflow(ray_head, mlflow_server, env_factory, tmp_path):
    from mlflow.tracking import MlflowClient
    from ray.job_submission import JobStatus, JobSubmissionClient

    from pipeline.model import load_model

    repo = _copy_repo(tmp_path / "repo")
    params = _tiny_overlay(repo, experiment="cluster-job")
    # Ignored files must stay on the submitter: these would be uploaded if the boundary leaked.
    for leak in ("data/shards/pretrain/LEAK", "models/pretrain/LEAK"):
        (repo / leak).parent.mkdir(parents=True)
        (repo / leak).write_text("must not be uploaded")
    # a fine-tune sweep of two grid points, each trial on 2 Ray Train ranks, submitted as a second job
    # (infra/README.md) after the first
    (repo / "sweep-tiny.yaml").write_text("stage: finetune\nnum_samples: 1\nscheduler: {name: none}\n"
                                          "resources: {workers: 2}\nspace:\n  finetune.lr: {grid: [0.001, 0.002]}\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)  # .git must not be uploaded either
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code"], cwd=repo, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    ws = tmp_path / "workspace"  # the "shared" path: same absolute path for submitter and cluster
    env = env_factory(**{k: v for k, v in ray_head["env"].items() if k.startswith("RAY_AUTH")},
                    RAY_API_SERVER_ADDRESS=ray_head["api"], VIT_WORKSPACE=str(ws), VIT_PARAMS_OVERLAY=params,
                    MLFLOW_TRACKING_URI=mlflow_server.url,
                    # a Ray Train setting the stages also default: Ray refuses a ray.init that sets it again
                    VIT_JOB_ENV="RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS=0")

    # 1. Shard on the submitter, straight into the workspace (same script the job runs).
    shard = subprocess.run(["bash", "infra/job.sh", "shard-pretrain", "shard-finetune"], cwd=repo, env=env,
                           capture_output=True, text=True, timeout=300)
    assert shard.returncode == 0, shard.stdout + shard.stderr
    assert (ws / "data/shards/pretrain/dataset.json").is_file()

    # 2. Submit the stages as one Ray job, as infra/README.md does (submit.sh's default entrypoint:
    #    pretrain finetune evaluate export), and wait for it (submit.sh exits 1 if the job fails).
    job_id = f"vit-test-{tmp_path.name[-8:].replace('_', '-')}"
    sub = subprocess.run(["bash", "infra/submit.sh", "--submission-id", job_id],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    logs = sub.stdout + sub.stderr
    assert sub.returncode == 0, logs[-6000:]
    assert "[pretrain] epoch 1/1" in logs and "[job] done: pretrain finetune evaluate export" in logs, logs[-4000:]

    client = JobSubmissionClient(ray_head["api"], headers={"Authorization": f"Bearer {ray_head['token']}"})
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED
    info = client.get_job_info(job_id)
    assert info.runtime_env["working_dir"].startswith("gcs://"), info.runtime_env  # code went up as a package
    assert info.runtime_env["env_vars"]["VIT_WORKSPACE"] == str(ws)
    assert info.runtime_env["env_vars"]["VIT_PARAMS_OVERLAY"] == params
    assert info.runtime_env["env_vars"]["RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS"] == "0"
    assert "[pretrain] done" in client.get_job_logs(job_id)

    # 3. The upload carried the code, not the ignored data; the job wrote to the workspace only.
    unpacked = {d.resolve() for d in (ray_head["state"] / "ray").glob("session_*/runtime_resources/working_dir_files/*")
                if (d / "pipeline").is_dir()}  # session_latest links to the session
    assert len(unpacked) == 1, f"expected one unpacked working dir on the head: {unpacked}"
    pkg = unpacked.pop()
    assert (pkg / "pipeline/train/driver.py").is_file() and (pkg / "infra/job.sh").is_file()
    assert (pkg / params).is_file()
    assert not list(pkg.rglob("LEAK")), "gitignored data/models were uploaded"
    assert not (pkg / ".git").exists(), ".git was uploaded"
    assert not (pkg / "models/pretrain/model.safetensors").exists()
    assert not (repo / "models/pretrain/model.safetensors").exists()
    model_dir = ws / "models/pretrain"
    assert (model_dir / "model.safetensors").stat().st_size > 10_000
    model, meta = load_model(model_dir)
    assert meta["stage"] == "pretrain" and model.config.depth == 2
    assert json.loads((ws / "metrics/pretrain.json").read_text())["val_top1"] > 0  # written by the job
    assert list((ws / ".ray_results").glob(f"{meta['ray_run']}/checkpoint_*/state.pt"))

    # 4. The run is on the tracking server, with the pipeline's params and the workers' metrics.
    ml = MlflowClient(mlflow_server.url)
    exp = ml.get_experiment_by_name("cluster-job")
    runs = ml.search_runs([exp.experiment_id], "tags.stage = 'pretrain'")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.run_id == meta["mlflow_run_id"] and run.info.status == "FINISHED"
    # the submitter's commit, though the job's code came without .git (submit.sh passes it)
    assert (run.data.tags["git.commit"], run.data.tags["git.dirty"]) == (commit, "false")
    assert run.data.params["world_size"] == "2" and run.data.params["model.depth"] == "2"
    assert 0.0 < run.data.metrics["val_top1"] <= 1.0
    summary = json.loads((ws / "metrics/pretrain.json").read_text())
    history = ml.get_metric_history(run.info.run_id, "train_loss")  # one point per epoch, at its last step
    assert [m.step for m in history] == [summary["step"]]
    assert "config.json" in [a.path for a in ml.list_artifacts(run.info.run_id)]

    # 5. The rest of the pipeline ran in the job too: evaluation, exports, a registered model version.
    test_images = json.loads((ws / "data/shards/finetune/dataset.json").read_text())["counts"]["test"]
    assert json.loads((ws / "metrics/evaluate.json").read_text())["num_samples"] == test_images > 0
    export = json.loads((ws / "metrics/export.json").read_text())
    assert export["passed"] and {"model.onnx", "model.safetensors", "model.torchscript.pt"} <= \
        {p.name for p in (ws / "exports").iterdir()}
    (version,) = ml.search_model_versions("name = 'cluster-job-model'")
    assert int(version.version) == export["registered_model"]["version"] and version.status == "READY"
    assert {r.data.tags["stage"] for r in ml.search_runs([exp.experiment_id], "tags.kind = 'stage'")} == \
        {"pretrain", "finetune", "evaluate", "export"}
    (export_run,) = ml.search_runs([exp.experiment_id], "tags.stage = 'export'")  # its report beside its files
    assert {"export.json", "exports"} <= {a.path for a in ml.list_artifacts(export_run.info.run_id)}
    top1 = json.loads((ws / "metrics/evaluate.json").read_text())["top1"]
    assert version.tags["test_top1"] == f"{top1:.4f}"  # the job evaluated before it exported

    # 6. A colleague classifies with that version through the server (its export run's artifacts, fetched
    #    over HTTP), as the workspace's own exports/ do.
    image = tmp_path / "digit.png"
    with tarfile.open(next((ws / "data/shards/finetune").glob("test-*.tar"))) as tf:
        image.write_bytes(tf.extractfile(next(m for m in tf.getmembers() if m.name.endswith(".png"))).read())
    by_uri, by_dir = (subprocess.run([sys.executable, "-m", "pipeline", "predict", "--model", model, str(image)],
                                     cwd=repo, env=env, capture_output=True, text=True, timeout=300)
                      for model in (f"models:/cluster-job-model/{version.version}", str(ws / "exports")))
    assert by_uri.returncode == by_dir.returncode == 0, by_uri.stderr[-2000:]
    assert by_uri.stdout == by_dir.stdout and by_uri.stdout.startswith(f"{image}\t")

    # 7. A sweep is a job too (infra/README.md): its trials fine-tune the workspace's pretrained model on the
    #    cluster, each on 2 Ray Train ranks reporting its epochs to Tune, log under one sweep run on the
    #    server, and sweeps/ lands in the workspace.
    sweep = subprocess.run(["bash", "infra/submit.sh", "--", "bash", "infra/job.sh", "sweep:sweep-tiny.yaml"],
                           cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    logs = sweep.stdout + sweep.stderr
    assert sweep.returncode == 0 and "[job] done: sweep:sweep-tiny.yaml" in logs, logs[-4000:]
    best = yaml.safe_load((ws / "sweeps/sweep-tiny/best.yaml").read_text())
    assert best["finetune"]["lr"] in (0.001, 0.002) and "dvc exp run -S" in logs
    (parent,) = ml.search_runs([exp.experiment_id], "tags.kind = 'sweep'")
    trials = ml.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(t.data.params["finetune.lr"] for t in trials) == ["0.001", "0.002"]
    assert all(t.info.status == "FINISHED" and t.data.metrics["val_top1"] >= 0 for t in trials)
    assert {(t.data.params["world_size"], t.data.tags["sweep.status"]) for t in trials} == {("2", "finished")}


@pytest.mark.slow
def test_submit_exits_nonzero_when_the_job_is_stopped(ray_head, env_factory, tmp_path):
    """`ray job submit` exits 0 when `ray job stop` stops the job it waits on; a script that chains
    submit.sh must not take a stopped job for a finished one."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    repo = _copy_repo(tmp_path / "repo")
    env = env_factory(**{k: v for k, v in ray_head["env"].items() if k.startswith("RAY_AUTH")},
                      VIT_WORKSPACE=str(tmp_path / "workspace"))
    env.pop("RAY_API_SERVER_ADDRESS", None)  # the head named by --address is the one asked how the job ended
    job_id = f"vit-stop-{tmp_path.name[-8:].replace('_', '-')}"
    sub = subprocess.Popen(["bash", "infra/submit.sh", "--submission-id", job_id, f"--address={ray_head['api']}",
                            "--", "sleep", "600"], cwd=repo,
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    client = JobSubmissionClient(ray_head["api"], headers={"Authorization": f"Bearer {ray_head['token']}"})
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and sub.poll() is None:
            try:
                if client.get_job_status(job_id) == JobStatus.RUNNING:
                    break
            except RuntimeError:  # not submitted yet
                pass
            time.sleep(1)
        assert client.get_job_status(job_id) == JobStatus.RUNNING
        assert client.stop_job(job_id)
        out, _ = sub.communicate(timeout=120)
    finally:
        sub.kill()
    assert client.get_job_status(job_id) == JobStatus.STOPPED
    assert sub.returncode == 1, out[-3000:]
    assert f"submit: job {job_id} ended STOPPED, not SUCCEEDED" in out, out[-3000:]


@pytest.mark.slow
def test_stage_on_a_too_small_cluster_waits_then_names_what_is_missing(ray_head, env_factory, tmp_path):
    """Joined to the 2-CPU head, 2 ranks x 2 CPUs cannot start: the stage says what it waits for,
    waits ray.resource_wait_s, then exits 2 naming what is missing (Ray alone would wait forever)."""
    repo = _copy_repo(tmp_path / "repo")
    overlay = {"data": {"pretrain": {"num_classes": 4, "samples_per_class": 20}}, "model": {"depth": 2},
               "pretrain": {"global_batch_size": 16},
               "ray": {"num_workers": 2, "cpus_per_worker": 2, "resource_wait_s": 3}}
    (repo / "params.small.yaml").write_text(yaml.safe_dump(overlay))
    env = env_factory(**{k: v for k, v in ray_head["env"].items() if k.startswith("RAY_AUTH")}, RAY_AUTH_MODE="token",
                      RAY_ADDRESS=f"127.0.0.1:{ray_head['ports']['RAY_PORT']}", VIT_WORKSPACE=str(tmp_path / "ws"),
                      VIT_PARAMS_OVERLAY="params.small.yaml")
    proc = subprocess.run(["bash", "infra/job.sh", "shard-pretrain", "pretrain"], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[ray] waiting up to 3 s for the cluster to offer 4 CPU (cluster has 2)" in proc.stdout, proc.stdout[-2000:]
    assert "needs 4 CPU (cluster has 2) after 3 s (ray.resource_wait_s)" in proc.stderr, proc.stderr[-2000:]
    assert not tracebacks(proc.stderr) and not (tmp_path / "ws/models/pretrain").exists()


_OWN_RAY_PROBE = """
import sys, ray
from pipeline.cluster import init_ray
from pipeline.config import RayConfig
init_ray(RayConfig(num_workers=1))
gcs = ray.get(ray.remote(lambda: ray.get_runtime_context().gcs_address).options(num_cpus=0).remote())
print("joined the head:", gcs.endswith(":" + sys.argv[1]))
"""


@pytest.mark.slow
def test_local_stage_beside_another_ray_starts_its_own(ray_head, env_factory, tmp_path):
    """``ray.address: null`` with another Ray on the machine (this head, its address left where a plain
    `ray start --head` leaves it): the stage starts its own Ray instead of joining that one, and its tasks
    run there, without a traceback (Ray Train's placement-group cleaner, which a local instance leaves
    out, died on such a machine with "Found multiple active Ray instances")."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))  # short: Ray's unix sockets live under it
    (ray_tmp / "ray").mkdir()
    head_port = str(ray_head["ports"]["RAY_PORT"])
    (ray_tmp / "ray/ray_current_cluster").write_text(f"127.0.0.1:{head_port}")
    try:
        proc = subprocess.run([sys.executable, "-c", _OWN_RAY_PROBE, head_port], cwd=ROOT,
                              env=env_factory(RAY_TMPDIR=str(ray_tmp)), capture_output=True, text=True, timeout=180)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0 and "joined the head: False" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert not tracebacks(proc.stderr)


_STAGE_RAY = """
import json, os, time, psutil, ray
from pipeline.cluster import init_ray
from pipeline.config import RayConfig
init_ray(RayConfig(num_workers=2))
ray.get([ray.remote(lambda: os.getpid()).options(num_cpus=1).remote() for _ in range(2)])  # the workers too
procs = [psutil.Process()] + psutil.Process().children(recursive=True)
listening = set()
for p in procs:
    listening |= {(p.name(), c.laddr.ip, c.laddr.port) for c in p.net_connections("inet")
                  if c.status == psutil.CONN_LISTEN}
print(json.dumps({"listening": sorted(listening), "pids": [p.pid for p in procs[1:]]}), flush=True)
time.sleep(300)
"""


@pytest.mark.slow
def test_stage_ray_listens_on_loopback_only_and_ends_with_a_killed_stage(env_factory):
    """A stage's own Ray (2 workers): every process of it listens on 127.0.0.1 only (its GCS, raylet and
    workers listened on every interface); after the stage is killed with SIGKILL, none of them is left
    (its dashboard and runtime-env agents stayed, orphaned, ignoring SIGTERM)."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", _STAGE_RAY], cwd=ROOT, env=env_factory(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:] if proc.poll() is not None else "no report"
        report = json.loads(line)
        names = {name for name, _, _ in report["listening"]}
        assert {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names, report
        public = [s for s in report["listening"] if s[1] not in ("127.0.0.1", "::ffff:127.0.0.1")]
        assert not public, public
        ray_procs = [psutil.Process(pid) for pid in report["pids"] if psutil.pid_exists(pid)]
    finally:
        proc.kill()
        proc.wait()
    gone, alive = psutil.wait_procs(ray_procs, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]


@pytest.mark.slow
def test_stop_frees_the_head_ports(ray_head):
    """Runs last in this module: stop the head explicitly, check that its ports are released. In a
    narrow terminal too (ps cut its command lines at $COLUMNS, and stop found no head to stop)."""
    env = {**ray_head["env"], "COLUMNS": "80"}
    out = subprocess.run(["bash", str(ROOT / "infra/ray-head.sh"), "stop"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "stopped" in out.stdout, out.stdout + out.stderr
    for name in ("RAY_PORT", "DASHBOARD_PORT"):
        assert not _port_in_use(ray_head["ports"][name]), f"{name} still served after stop"
    again = subprocess.run(["bash", str(ROOT / "infra/ray-head.sh"), "stop"], env=env, capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0 and "no head running" in again.stdout


# ------------------------------------------------------------------------------ configs (fast)

def _load(name: str):
    return yaml.safe_load((ROOT / "infra" / name).read_text())


def _module_exists(module: str) -> bool:
    return (ROOT / (module.replace(".", "/") + ".py")).is_file() or \
        importlib.util.find_spec(module) is not None


def _entrypoint_ok(cmd: str) -> None:
    """Every `python -m X` names a module of this repo, every `bash F` a file of it, stages are valid."""
    cmd = cmd.replace("/app/", "")  # infra/Dockerfile puts the repo at /app
    mods = re.findall(r"python -m ([\w.]+)", cmd)
    scripts = re.findall(r"bash (\S+\.sh)", cmd)
    assert mods or scripts, cmd
    for m in mods:
        assert _module_exists(m), f"{m} in {cmd!r} does not exist"
    for s in scripts:
        assert (ROOT / s).is_file(), f"{s} in {cmd!r} does not exist"
        for stage in re.findall(rf"{re.escape(s)}((?: [\w-]+)*)", cmd)[0].split():
            assert _module_exists(f"stages.{stage.split('-')[0]}"), stage


def test_ray_cluster_yaml():
    cfg = _load("ray-cluster.yaml")
    for key in ("cluster_name", "max_workers", "provider", "auth", "available_node_types", "head_node_type",
                "setup_commands", "head_start_ray_commands", "worker_start_ray_commands", "file_mounts"):
        assert key in cfg, key
    assert cfg["provider"]["type"] == "aws" and cfg["provider"]["region"]
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and "InstanceType" in head["node_config"]
    gpu_workers = [t for n, t in types.items() if n != cfg["head_node_type"] and t["resources"].get("GPU", 0) > 0]
    assert gpu_workers and all(t["max_workers"] >= t.get("min_workers", 0) for t in gpu_workers)
    assert sum(t["max_workers"] for t in gpu_workers) <= cfg["max_workers"]
    setup = " ".join(cfg["setup_commands"])
    assert "pip install -q --no-deps --require-hashes -r ~/vit-pipeline/requirements.lock" in setup  # pip too
    start = " ".join(cfg["head_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in start and "ray start --head" in start
    assert "RAY_AUTH_MODE=token" in " ".join(cfg["worker_start_ray_commands"])
    assert any("auth_token" in str(k) or "auth_token" in str(v) for k, v in cfg["file_mounts"].items())


def test_rayjob_yaml():
    job = _load("rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    spec = job["spec"]
    _entrypoint_ok(spec["entrypoint"])
    renv = yaml.safe_load(spec["runtimeEnvYAML"])
    assert renv["env_vars"]["VIT_WORKSPACE"] and renv["env_vars"]["MLFLOW_TRACKING_URI"].startswith("http")
    cluster = spec["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] and any(e["name"] == "RAY_AUTH_MODE" for e in head.get("env", [])) or \
        cluster.get("authOptions", {}).get("mode") == "token"
    workers = cluster["workerGroupSpecs"]
    assert any(int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) > 0
               for w in workers for c in w["template"]["spec"]["containers"])
    assert spec.get("shutdownAfterJobFinishes") is True


def test_cluster_params_overlay(tmp_path, capsys):
    from pipeline.config import flatten, load_params

    spec = importlib.util.spec_from_file_location("params_overlay", ROOT / "infra/params_overlay.py")
    overlay_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overlay_tool)
    out = tmp_path / "merged.yaml"
    assert overlay_tool.main([str(ROOT / "params.yaml"), str(ROOT / "infra/params.cluster.yaml"), str(out)]) == 0
    p, base = load_params(out), load_params(ROOT / "params.yaml")
    assert p.ray.address == "auto" and p.ray.use_gpu and p.ray.gpus_per_worker >= 1
    differ = {k for k, v in flatten(p).items() if flatten(base)[k] != v}
    assert differ and all(k.startswith("ray.") for k in differ), differ  # only the Ray section changes
    bad = tmp_path / "bad.yaml"
    bad.write_text("ray:\n  num_workers: 3\n")  # 64 is not divisible by 3
    assert overlay_tool.main([str(ROOT / "params.yaml"), str(bad), str(tmp_path / "bad-merged.yaml")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad} over {ROOT / 'params.yaml'}: pretrain.global_batch_size: 64 "
                                           "is not divisible by ray.num_workers=3")
    (tmp_path / "broken.yaml").write_text("ray:\n  num_workers: [\n")
    for name, needle in (("missing.yaml", "cannot read it (No such file or directory)"),
                         ("broken.yaml", "not valid YAML")):
        assert overlay_tool.main([str(ROOT / "params.yaml"), str(tmp_path / name), str(tmp_path / "bad-merged.yaml")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {tmp_path / name}: {needle}") and err.count("\n") == 1, err
    assert not (tmp_path / "bad-merged.yaml").exists()  # nothing written for a bad overlay
    job = _load("rayjob.yaml")
    env = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env["VIT_PARAMS_OVERLAY"] == "infra/params.cluster.yaml" and (ROOT / env["VIT_PARAMS"]).is_file()
    gpu_group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert gpu_group["replicas"] >= p.ray.num_workers  # one Ray Train worker per GPU pod


@pytest.mark.slow
def test_dockerfile_image_holds_what_it_runs(tmp_path):
    """Without Docker (no registry here): the files the Dockerfile COPYs, laid out as in the image,
    pass the image's own import check and install as the package; the lock is what it installs."""
    lines = re.sub(r"\\\n", " ", (ROOT / "infra/Dockerfile").read_text()).splitlines()
    base = next(line.split()[1] for line in lines if line.startswith("FROM "))
    assert re.search(r"python:3\.1[123]\b", base), base  # a supported Python (pyproject's requires-python)
    app = tmp_path / "app"
    copied = [src for line in lines if line.startswith("COPY ") for src in line.split()[1:-1]]
    copy_repo_files(app, copied)
    runs = [cmd.strip() for line in lines if line.startswith("RUN ") for cmd in line[4:].split(" && ")]
    assert any(re.search(r"pip install --no-deps --require-hashes -r requirements.lock$", r) for r in runs), runs
    check = next(r for r in runs if r.startswith("python -c"))
    where = 'python -c "import pipeline, stages; print(pipeline.__file__, *stages.__path__)"'
    proc = subprocess.run(["bash", "-c", f"{check} && {where}"], cwd=app, capture_output=True, text=True,
                          timeout=120, env={"PATH": os.environ["PATH"], "PYTHONPATH": str(app)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(p.startswith(str(app)) for p in proc.stdout.split()), proc.stdout  # not this checkout's
    install = next(r for r in runs if "pip install" in r and " ." in r)
    assert "--no-deps" in install, install  # dependencies come from the lock, not re-resolved


def test_infra_scripts_parse_and_name_real_stages():
    for script in ("ray-head.sh", "submit.sh", "job.sh", "mlflow-server.sh"):
        path = ROOT / "infra" / script
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0, script
        assert path.read_text().startswith("#!/usr/bin/env bash")
    default = re.search(r"entry=\((bash infra/job.sh[^)]*)\)", (ROOT / "infra/submit.sh").read_text()).group(1)
    _entrypoint_ok(default)

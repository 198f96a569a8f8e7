"""Fast checks of infra/ (no Ray cluster, no MLflow server): the scripts run against a stub `ray`, the
cluster YAML's shell lines run as Ray runs them, pipeline.cluster against a fake `ray` module."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from tests.conftest import clean_env

ROOT = Path(__file__).resolve().parents[1]

STUB_RAY = r"""#!/usr/bin/env bash
# stub: records its arguments; `get-auth-token --generate` writes $HOME/.ray/auth_token (as Ray does,
# under the caller's umask) and records the mode it was created with
printf '%s\n' "$@" >> "$STUB_LOG"
if [[ ${1:-} == get-auth-token && ${2:-} == --generate ]]; then
  mkdir -p "$HOME/.ray" && echo 0123456789abcdef > "$HOME/.ray/auth_token"
  stat -c %a "$HOME/.ray/auth_token" >> "$STUB_LOG.modes"
fi
exit 0
"""


@pytest.fixture
def stub_ray(tmp_path):
    """A directory with a stub `ray` to put first on PATH, and the file it logs its arguments to."""
    bin_dir = tmp_path / "stub-bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(STUB_RAY)
    (bin_dir / "ray").chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    log = tmp_path / "ray-calls.log"

    def env(**extra: str) -> dict[str, str]:
        e = clean_env(STUB_LOG=str(log), HOME=str(home), OMP_NUM_THREADS="1", **extra)
        e["PATH"] = f"{bin_dir}:{e['PATH']}"
        return e

    return types.SimpleNamespace(env=env, log=log)


JOB_API_TOKEN = "0123456789abcdef"


@pytest.fixture
def job_api():
    """What submit.sh asks of a head's job API before it uploads (``GET /api/version`` with the token), on a
    free port: 200 for :data:`JOB_API_TOKEN`, 403 for another (a real head answers so: tests/test_cluster.py)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.headers.get("Authorization") == f"Bearer {JOB_API_TOKEN}"
            self.send_response(200 if ok and self.path == "/api/version" else 403 if not ok else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {"RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{server.server_port}", "RAY_AUTH_TOKEN": JOB_API_TOKEN}
    server.shutdown()
    server.server_close()


# -------------------------------------------------------------------------------------------- submit.sh

def test_submit_help_works_from_another_directory():
    """`bash main/infra/submit.sh --help` from the checkout's parent: the script cd's to the repo
    first, so a relative $0 no longer names it (sed: can't read …, empty help)."""
    rel = Path(ROOT.name) / "infra/submit.sh"
    proc = subprocess.run(["bash", str(rel), "--help"], cwd=ROOT.parent, capture_output=True, text=True,
                          timeout=30, env=clean_env())
    assert proc.returncode == 0 and "can't read" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("Submit the training stages to a Ray cluster"), proc.stdout[:200]


def test_submit_rejects_a_relative_workspace_before_submitting(stub_ray):
    """job.sh would cd to a relative VIT_WORKSPACE inside the job's uploaded working dir: outputs lost."""
    proc = subprocess.run(["bash", "infra/submit.sh"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=stub_ray.env(VIT_WORKSPACE="vit-workspace"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "VIT_WORKSPACE=vit-workspace must be an absolute path" in proc.stderr
    assert not stub_ray.log.exists(), "ray job submit ran"


def test_submit_passes_an_absolute_workspace_with_spaces(stub_ray, job_api, tmp_path):
    ws = str(tmp_path / "my workspace")
    proc = subprocess.run(["bash", "infra/submit.sh", "--submission-id", "vit-test", "--no-wait"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=stub_ray.env(VIT_WORKSPACE=ws, **job_api))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = stub_ray.log.read_text().splitlines()
    assert args[:2] == ["job", "submit"] and args[args.index("--submission-id") + 1] == "vit-test"
    assert args.count("--submission-id") == 1
    runtime_env = json.loads(args[args.index("--runtime-env-json") + 1])
    assert runtime_env["env_vars"]["VIT_WORKSPACE"] == ws
    assert args[args.index("--") + 1:] == ["bash", "infra/job.sh", "pretrain", "finetune", "evaluate", "export"]


def test_submit_names_the_job_it_will_ask_about(stub_ray, job_api, tmp_path):
    """Without --submission-id, submit.sh names the job itself: it asks the job API how that job ended
    (`ray job submit` exits 0 for a stopped job; tests/test_cluster.py stops a real one)."""
    proc = subprocess.run(["bash", "infra/submit.sh", "--no-wait"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=stub_ray.env(VIT_WORKSPACE=str(tmp_path / "ws"), **job_api))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = stub_ray.log.read_text().splitlines()
    assert re.fullmatch(r"vit-\d{8}-\d{6}-\d+", args[args.index("--submission-id") + 1]), args


@pytest.mark.slow
@pytest.mark.parametrize("env, argv, needle", [
    ({"RAY_AUTH_TOKEN": ""}, [], "submit: no Ray token: set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH"),
    ({"RAY_AUTH_TOKEN": "wrong"}, [], "refused the token from RAY_AUTH_TOKEN (HTTP 403)"),
    ({"RAY_API_SERVER_ADDRESS": "http://127.0.0.1:{closed}"}, [], "submit: no Ray job API at http://127.0.0.1:{closed} ("),
    ({"VIT_WORKSPACE": "s3://bucket/ws"}, [], "job: with an object-store workspace set MLFLOW_TRACKING_URI"),
    ({}, ["--", "bash", "infra/job.sh", "pretrian"], "job: unknown stage 'pretrian' (valid: shard-pretrain"),
    ({"VIT_PARAMS": "tests/conftest.py"}, [], "VIT_PARAMS=tests/conftest.py is under tests/, which the upload leaves out"),
    ({"VIT_PARAMS": "{outside}"}, [], "VIT_PARAMS={outside} is outside the repository"),
    ({"VIT_PARAMS": "dvc.yaml"}, [], "job: VIT_PARAMS: "),
    ({"VIT_JOB_ENV": "FOO=1 =bar"}, [], "VIT_JOB_ENV: '=bar' is not NAME=VALUE"),
    ({"VIT_JOB_ENV": "VIT_WORKSPACE=ws"}, [], "VIT_JOB_ENV: VIT_WORKSPACE is checked and passed by submit.sh"),
    ({}, ["--submission-id", "--no-wait"], "submit: --submission-id needs a value (got '--no-wait')"),
    ({}, ["--no-wait", "--submission-id"], "submit: --submission-id needs a value (got '')"),  # Ray took the id's flag as the id
    ({}, ["--address"], "submit: --address needs a value (got '')"),
], ids=["no-token", "wrong-token", "no-head", "s3-without-mlflow", "stage-typo", "excluded-params",
        "params-outside", "not-params", "job-env-pair", "job-env-override", "submission-id", "submission-id-last",
        "address-last"])
def test_submit_refuses_a_job_that_can_only_fail_before_uploading(stub_ray, job_api, tmp_path, env, argv, needle):
    """Each in one line, exit 2, `ray job submit` never run: Ray's client printed a traceback for the first
    three, and the rest failed on the cluster after the upload (or not at all: the overriding VIT_JOB_ENV)."""
    from tests.conftest import free_port

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    names = {"closed": str(free_port()), "outside": os.path.relpath(tmp_path / "params.yaml", ROOT)}
    env = {k: v.format(**names) for k, v in env.items()}
    proc = subprocess.run(["bash", "infra/submit.sh", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=stub_ray.env(**{"VIT_WORKSPACE": str(tmp_path / "ws"), **job_api, **env}))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stdout + proc.stderr
    assert needle.format(**names) in proc.stderr, proc.stderr
    assert not stub_ray.log.exists(), "ray job submit ran"


# ------------------------------------------------------------------------------------------ ray-head.sh

def test_ray_head_env_file_sources_with_a_token_path_holding_spaces(stub_ray, tmp_path):
    """`source $RAY_HEAD_DIR/env` (the submit recipe `start` prints) with RAY_AUTH_TOKEN_PATH=…/my tokens/…:
    unquoted, the export split at the space ("not a valid identifier", the path cut short)."""
    head_dir, token = tmp_path / "head", tmp_path / "my tokens" / "auth_token"
    env = stub_ray.env(RAY_HEAD_DIR=str(head_dir), RAY_AUTH_TOKEN_PATH=str(token))
    script = str(ROOT / "infra/ray-head.sh")
    start = subprocess.run(["bash", script, "start"], env=env, capture_output=True, text=True, timeout=60)
    try:
        assert start.returncode == 0, start.stdout + start.stderr
        assert token.read_text().strip() == "0123456789abcdef" and token.stat().st_mode & 0o077 == 0
        sourced = subprocess.run(["bash", "-c", 'source "$1" && printf %s "$RAY_AUTH_TOKEN_PATH"', "_",
                                  str(head_dir / "env")], capture_output=True, text=True, timeout=30,
                                 env=clean_env(HOME=env["HOME"]))
        assert sourced.returncode == 0 and sourced.stderr == "", sourced.stderr
        assert sourced.stdout == str(token)
    finally:  # the stub `ray start` left no process behind: stop finds nothing to kill
        subprocess.run(["bash", script, "stop"], env=env, capture_output=True, text=True, timeout=60)


def test_ray_head_token_in_home_is_private_from_its_creation(stub_ray, tmp_path):
    """Without RAY_AUTH_TOKEN(_PATH) `start` has Ray generate ~/.ray/auth_token. Made under the shell's
    umask (022) and chmod-ed after, it was readable by every user for a moment; now it is created 600."""
    env = stub_ray.env(RAY_HEAD_DIR=str(tmp_path / "head"))
    token = Path(env["HOME"]) / ".ray" / "auth_token"
    script = str(ROOT / "infra/ray-head.sh")
    try:
        start = subprocess.run(["bash", "-c", 'umask 022 && exec bash "$0" start', script], env=env,
                               capture_output=True, text=True, timeout=60)
        assert start.returncode == 0, start.stdout + start.stderr
        assert Path(f"{stub_ray.log}.modes").read_text().split() == ["600"], "token readable by others at first"
        assert token.stat().st_mode & 0o777 == 0o600
    finally:
        subprocess.run(["bash", script, "stop"], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("argv, env, code, line", [
    (["bogus"], {}, 2, "ray-head: unknown command 'bogus' (valid: start, stop, status, token, env; --help)"),
    (["status"], {}, 1, "ray-head: no head running from {dir} (bash infra/ray-head.sh start)"),
    (["env"], {}, 1, "ray-head: no head started from {dir} (bash infra/ray-head.sh start)"),
    (["start"], {"RAY_PORT": "63_79"}, 2, "ray-head: RAY_PORT=63_79 is not a whole number"),
    (["stop"], {"RAY_STOP_GRACE": "ten"}, 2, "ray-head: RAY_STOP_GRACE=ten is not a whole number"),
    (["token"], {"RAY_AUTH_TOKEN_PATH": "{tmp}"}, 1, "ray-head: RAY_AUTH_TOKEN_PATH={tmp} is a folder: name the token's file"),
    (["stop", "--force"], {}, 2, "ray-head: stop takes no options (got: --force); only start passes them to ray"),
], ids=["unknown", "status", "env", "port", "grace", "token-folder", "stop-option"])
def test_ray_head_bad_input_is_one_line(stub_ray, tmp_path, argv, env, code, line):
    """`status` without a head waited 40 s for a GCS and printed a traceback; an unknown command printed the
    23-line usage without naming it; a grace that is not a number killed at once ("unbound variable")."""
    names = {"dir": str(tmp_path / "head"), "tmp": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "infra/ray-head.sh"), *argv], capture_output=True, text=True, timeout=60,
                          env=stub_ray.env(RAY_HEAD_DIR=names["dir"], **{k: v.format(**names) for k, v in env.items()}))
    assert (proc.returncode, proc.stderr) == (code, line.format(**names) + "\n"), proc.stdout + proc.stderr
    assert not stub_ray.log.exists(), "ray ran"


# --------------------------------------------------------------------------------- job.sh, mlflow-server.sh

def test_job_check_names_each_problem_and_creates_nothing(tmp_path):
    """`job.sh --check` (what submit.sh runs before an upload): the stages, the workspace and the params, each
    problem one line and exit 2; a good job is one line and creates nothing, not even the workspace."""
    ws = tmp_path / "ws"
    cases = [({}, [], "job: set VIT_WORKSPACE (a shared path or s3:// prefix)"),
             ({"VIT_WORKSPACE": str(ws), "VIT_PARAMS": "nope.yaml"}, [], f"job: VIT_PARAMS: {ROOT}/nope.yaml: file not found"),
             ({"VIT_WORKSPACE": str(ws), "VIT_PARAMS_OVERLAY": "dvc.yaml"}, [], "error: "),
             ({"VIT_WORKSPACE": str(ws)}, ["evaluate", "export", "train"], "job: unknown stage 'train'"),
             ({"VIT_WORKSPACE": str(ws)}, ["sweep:configs/nope.yaml"],
              f"job: sweep:configs/nope.yaml: no sweep file {ROOT}/configs/nope.yaml (give it relative to the")]
    for env, stages, start in cases:
        proc = subprocess.run(["bash", "infra/job.sh", "--check", *stages], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env=clean_env(**env))
        assert proc.returncode == 2 and proc.stderr.startswith(start) and proc.stderr.count("\n") == 1, proc.stderr
    proc = subprocess.run(["bash", "infra/job.sh", "--check", "evaluate", "sweep:configs/sweep-finetune.yaml"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env=clean_env(VIT_WORKSPACE=str(ws), VIT_PARAMS_OVERLAY="infra/params.cluster.yaml"))
    assert proc.returncode == 0 and proc.stdout == (f"[job] checked: workspace {ws}, params {ROOT}/params.yaml + overlay "
                                                    "infra/params.cluster.yaml, stages: evaluate "
                                                    "sweep:configs/sweep-finetune.yaml\n"), proc.stderr
    assert not ws.exists()


def test_mlflow_server_refuses_a_taken_port_and_bad_values_before_creating_its_store(tmp_path):
    """`mlflow server` created the store, then exited 0 when its port was taken (uvicorn only logs it): the
    stages logged to whatever held the port. Now each is one line, before anything is created."""
    import socket

    store = tmp_path / "store"
    base = {"MLFLOW_BACKEND_STORE_URI": f"sqlite:///{store}/mlflow.db", "MLFLOW_ARTIFACTS_DESTINATION": str(store / "art")}
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        for env, code, line in (
                ({"MLFLOW_PORT": str(taken)}, 1, f"mlflow-server: port {taken} (MLFLOW_PORT) on 127.0.0.1 is already "
                                                 "in use: stop what holds it, or set MLFLOW_PORT to a free port"),
                ({"MLFLOW_PORT": "5OOO"}, 2, "mlflow-server: MLFLOW_PORT=5OOO is not a port number"),
                ({"MLFLOW_WORKERS": "two"}, 2, "mlflow-server: MLFLOW_WORKERS=two is not a whole number above 0")):
            proc = subprocess.run(["bash", str(ROOT / "infra/mlflow-server.sh")], capture_output=True, text=True,
                                  timeout=60, env=clean_env(**base, **env))
            assert (proc.returncode, proc.stderr) == (code, line + "\n"), proc.stderr[-2000:]
    assert not store.exists()


# ------------------------------------------------------------------------------------- ray-cluster.yaml

def test_cluster_yaml_starts_mlflow_unless_a_server_runs():
    """The head's MLflow line is guarded by `pgrep -f PATTERN`. Ray runs it as
    `bash --login -c -i 'source ~/.bashrc; … && (THE LINE)'`, so that shell's own command line holds the
    line: a PATTERN that matches the line itself always finds "a server" and none is ever started."""
    cfg = yaml.safe_load((ROOT / "infra/ray-cluster.yaml").read_text())
    line = next(c for c in cfg["head_start_ray_commands"] if "mlflow-server.sh" in c)
    m = re.search(r"""pgrep -f ("[^"]+"|'[^']+'|\S+)""", line)
    assert m, line
    pattern = shlex.split(m.group(1))[0]
    # As Ray's SSH command runner wraps it (autoscaler/_private/command_runner.py: _with_interactive).
    wrapped = shlex.quote(f"source ~/.bashrc; export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore && ({line})")
    # A new session holding only this shell (whose argv is the wrapped line) and pgrep: any MLflow
    # server elsewhere on this machine stays out of it (-s 0: pgrep's own session).
    probe = f"(pgrep -s 0 -f {shlex.quote(pattern)} >/dev/null && echo running || echo absent) # {wrapped}"
    proc = subprocess.run(["setsid", "-w", "bash", "-c", probe], capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "absent", f"pgrep -f {pattern!r} matches the shell running the line"
    # ... and it does find a real server: mlflow-server.sh execs `mlflow server …`
    server_argv = "/home/ubuntu/venv/bin/python /home/ubuntu/venv/bin/mlflow server --backend-store-uri x"
    assert re.search(pattern, server_argv), pattern


# ------------------------------------------------------------------------------------ pipeline.cluster

def _fake_ray(monkeypatch, resources: dict[str, float]):
    """A `ray` module with what pipeline.cluster calls, recording init() and request_resources()."""
    calls = types.SimpleNamespace(init=[], requests=[])
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: False
    ray.init = lambda **kw: calls.init.append(kw)
    ray.cluster_resources = lambda: dict(resources)
    autoscaler, sdk = types.ModuleType("ray.autoscaler"), types.ModuleType("ray.autoscaler.sdk")
    sdk.request_resources = lambda **kw: calls.requests.append(kw)
    ray.autoscaler, autoscaler.sdk = autoscaler, sdk
    for name, mod in (("ray", ray), ("ray.autoscaler", autoscaler), ("ray.autoscaler.sdk", sdk)):
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


def test_wait_for_resources_withdraws_its_autoscaler_request(monkeypatch):
    """request_resources() "is persistent until another call" (Ray): left in place, the autoscaler never
    scales the GPU nodes down after the job, and after a timeout it goes on launching them."""
    from pipeline.cluster import wait_for_resources
    from pipeline.config import ConfigError, RayConfig

    cfg = RayConfig(address="auto", num_workers=2, use_gpu=True, cpus_per_worker=4, gpus_per_worker=1)
    calls = _fake_ray(monkeypatch, {"CPU": 16.0, "GPU": 2.0})
    wait_for_resources(cfg)
    assert calls.requests == [{"bundles": [{"CPU": 4.0, "GPU": 1.0}] * 2}, {"bundles": []}]

    calls = _fake_ray(monkeypatch, {"CPU": 16.0, "GPU": 1.0})  # one GPU short, no time to wait
    cfg.resource_wait_s = 0
    with pytest.raises(ConfigError, match=r"needs 2 GPU \(cluster has 1\)"):
        wait_for_resources(cfg)
    assert calls.requests[-1] == {"bundles": []}


@pytest.fixture
def own_environ():
    """``init_ray`` sets its defaults in ``os.environ`` (``setdefault``): put the environment back after the
    test, so they do not reach the later tests' children in the same test process."""
    saved = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_init_ray_passes_the_users_ray_train_settings_to_the_ranks(own_environ, monkeypatch):
    """Its "0"s are defaults: RAY_TRAIN_ENABLE_PRINT_PATCH=1 set by the user reached the driver but the
    ranks got "0" (the runtime env's value), unlike RAY_TRAIN_ENABLE_PREEMPTION_WATCHER."""
    import pipeline.cluster as cluster
    from pipeline.config import RayConfig

    for var in ("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "RAY_DISABLE_WORKER_LOG_PREFIX", cluster.REPORT_POLL_VAR,
                "RAY_COLOR_PREFIX", "RAY_ADDRESS", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PRINT_PATCH", "1")
    monkeypatch.setattr(cluster, "raise_on_signals", lambda: None)
    calls = _fake_ray(monkeypatch, {"CPU": 8.0})
    cluster.init_ray(RayConfig(address="auto", num_workers=2))
    (kwargs,) = calls.init
    assert kwargs["address"] == "auto"
    assert kwargs["runtime_env"]["env_vars"] == {"RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
                                                 "RAY_TRAIN_ENABLE_PRINT_PATCH": "1"}


@pytest.mark.slow
def test_mlflow_server_keeps_the_store_uri_off_its_command_line(mlflow_server):
    """The store's URI (a postgresql://user:password@… one on a team server) reaches `mlflow server` by the
    environment: on the command line every user of the machine read it with ps for as long as it ran."""
    import urllib.request

    pids = [mlflow_server.proc.pid] + [int(p) for p in Path(f"/proc/{mlflow_server.proc.pid}/task").iterdir()
                                       for p in (Path(f"/proc/{mlflow_server.proc.pid}/task/{p.name}/children")
                                                 .read_text().split())]
    lines = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in pids
             if Path(f"/proc/{pid}/cmdline").exists()]
    assert any("mlflow server" in line or "mlflow" in line for line in lines), lines
    assert not any("sqlite:" in line or str(mlflow_server.data) + "/mlflow.db" in line for line in lines), lines
    with urllib.request.urlopen(mlflow_server.url + "/api/2.0/mlflow/experiments/search?max_results=1") as r:
        assert r.status == 200  # and the server does use the store


# -------------------------------------------------------------------------------------------- scripts/env.sh


def test_sourcing_env_sh_leaves_the_shell_s_options_and_activates():
    """`source scripts/env.sh` (the README's way in) left `set -euo pipefail` in the caller's shell: the next
    failing grep or unset variable closed it. This checkout's environment is current, so nothing installs."""
    proc = subprocess.run(["bash", "-c", "set +euo pipefail; source scripts/env.sh test && echo \"opts=$- "
                           "venv=$VIRTUAL_ENV\"; false; echo still-here $UNSET_VARIABLE"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    opts, venv = re.search(r"opts=(\S*) venv=(\S+)", proc.stdout).groups()
    assert "e" not in opts and "u" not in opts and venv == str(ROOT / ".venv")
    assert "still-here" in proc.stdout
    kept = subprocess.run(["bash", "-c", "set -o pipefail; source scripts/env.sh test; [[ -o pipefail ]] && echo kept"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert kept.stdout.strip() == "kept"  # and an option the caller had stays on


def _lock_entry(name: str) -> str:
    """``name``'s entry in requirements-test.lock: its ``name==version`` line and its hashes."""
    text = (ROOT / "requirements-test.lock").read_text()
    entry = re.search(rf"^{name}==.*?(?=^\S|\Z)", text, flags=re.M | re.S).group(0)
    return "\n".join(line for line in entry.splitlines() if not line.lstrip().startswith("#")) + "\n"


def test_env_sh_rebuilds_a_venv_cut_short_and_stamps_only_what_installed(tmp_path):
    """A venv left without uv (its creation stopped) is made again, not reused forever; a failed install
    returns 1 to the caller (`source … && …` no longer goes on) and writes no stamp, so the next run retries."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("scripts/env.sh", "pyproject.toml"):
        shutil.copy(ROOT / name, repo / name)
    fake = "no-such-package-for-this-test==0.0.1 \\\n    --hash=sha256:" + "0" * 64 + "\n"
    (repo / "requirements.lock").write_text("# a lock\n" + _lock_entry("uv") + fake)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    proc = subprocess.run(["bash", "-c", "source scripts/env.sh && echo READY"], cwd=repo, capture_output=True,
                          text=True, timeout=600, env=clean_env(VIT_VENV=str(venv), PYTHON=sys.executable))
    assert proc.returncode == 1 and "READY" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert f"[env] creating {venv}" in proc.stderr and "no-such-package-for-this-test" in proc.stderr
    assert subprocess.run([str(venv / "bin/uv"), "--version"], capture_output=True).returncode == 0
    assert not (venv / ".installed").exists()


def test_the_lock_refuses_a_tampered_hash(tmp_path):
    """scripts/env.sh syncs with --require-hashes: an artifact whose hash is not the lock's is refused
    (the wheel is uv's cached copy of a locked package, so the refusal is the hash's, not the index's)."""
    entry = _lock_entry("zipp")
    good, bad = tmp_path / "good.lock", tmp_path / "bad.lock"
    good.write_text(entry)
    bad.write_text(re.sub(r"sha256:(\w)", lambda m: "sha256:" + ("1" if m.group(1) == "0" else "0"), entry))
    uv = Path(sys.executable).parent / "uv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, tmp_path / "venv"], check=True, timeout=120)

    def sync(lock: Path) -> subprocess.CompletedProcess:
        return subprocess.run([uv, "pip", "sync", "--python", tmp_path / "venv/bin/python", "--require-hashes", lock],
                              capture_output=True, text=True, timeout=300, env=clean_env())

    refused = sync(bad)
    assert refused.returncode != 0 and "hash mismatch" in refused.stderr.lower(), refused.stderr
    accepted = sync(good)
    assert accepted.returncode == 0, accepted.stderr


def test_ray_head_refuses_a_taken_port_before_starting(stub_ray, tmp_path):
    """`ray start` exits 0 when another program holds the job API's port (it only logs it): the head said
    "up", and submitters reached whatever held the port. Now a taken port is one line and exit 1."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        proc = subprocess.run(["bash", str(ROOT / "infra/ray-head.sh"), "start"], capture_output=True, text=True,
                              env=stub_ray.env(DASHBOARD_PORT=str(taken), RAY_HEAD_DIR=str(tmp_path / "head")),
                              timeout=60)
    assert proc.returncode == 1 and proc.stderr == (f"ray-head: port {taken} (job-API, DASHBOARD_PORT) on 127.0.0.1 "
                                                    "is already in use: stop what holds it, or set DASHBOARD_PORT "
                                                    "to a free port\n"), proc.stderr
    assert not stub_ray.log.exists() or "--head" not in stub_ray.log.read_text()


def test_init_ray_in_a_job_leaves_the_job_s_own_variables_to_it(own_environ, monkeypatch):
    """Inside a Ray job whose runtime env sets RAY_TRAIN_ENABLE_PRINT_PATCH (infra/submit.sh with
    VIT_JOB_ENV=RAY_TRAIN_ENABLE_PRINT_PATCH=1), ray.init must not set it again: Ray refuses to merge the
    two runtime envs, and every stage of the job stopped with a traceback printing the job's variables."""
    import pipeline.cluster as cluster
    from pipeline.config import RayConfig

    for var in ("RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS", "RAY_TRAIN_ENABLE_PRINT_PATCH", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(
        {"runtime_env": {"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "1", "AWS_PROFILE": "x"}}, "metadata": {}}))
    monkeypatch.setattr(cluster, "raise_on_signals", lambda: None)
    calls = _fake_ray(monkeypatch, {"CPU": 8.0})
    cluster.init_ray(RayConfig(address="auto", num_workers=2))
    (kwargs,) = calls.init
    assert kwargs["runtime_env"]["env_vars"] == {"RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0"}

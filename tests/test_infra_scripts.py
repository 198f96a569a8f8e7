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


def test_submit_passes_an_absolute_workspace_with_spaces(stub_ray, tmp_path):
    ws = str(tmp_path / "my workspace")
    proc = subprocess.run(["bash", "infra/submit.sh", "--submission-id", "vit-test", "--no-wait"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=stub_ray.env(VIT_WORKSPACE=ws))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = stub_ray.log.read_text().splitlines()
    assert args[:2] == ["job", "submit"] and args[args.index("--submission-id") + 1] == "vit-test"
    assert args.count("--submission-id") == 1
    runtime_env = json.loads(args[args.index("--runtime-env-json") + 1])
    assert runtime_env["env_vars"]["VIT_WORKSPACE"] == ws
    assert args[args.index("--") + 1:] == ["bash", "infra/job.sh", "pretrain", "finetune", "evaluate", "export"]


def test_submit_names_the_job_it_will_ask_about(stub_ray, tmp_path):
    """Without --submission-id, submit.sh names the job itself: it asks the job API how that job ended
    (`ray job submit` exits 0 for a stopped job; tests/test_cluster.py stops a real one)."""
    proc = subprocess.run(["bash", "infra/submit.sh", "--no-wait"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=stub_ray.env(VIT_WORKSPACE=str(tmp_path / "ws")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = stub_ray.log.read_text().splitlines()
    assert re.fullmatch(r"vit-\d{8}-\d{6}-\d+", args[args.index("--submission-id") + 1]), args


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


def test_env_sh_rebuilds_a_venv_cut_short_and_stamps_only_what_installed(tmp_path):
    """A venv left without pip (its creation stopped) is made again, not reused forever; a failed install
    returns 1 to the caller (`source … && …` no longer goes on) and writes no stamp, so the next run retries."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("scripts/env.sh", "constraints.txt", "pyproject.toml"):
        shutil.copy(ROOT / name, repo / name)
    (repo / "requirements.txt").write_text("no-such-package-for-this-test==0.0.1\n")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    proc = subprocess.run(["bash", "-c", "source scripts/env.sh && echo READY"], cwd=repo, capture_output=True,
                          text=True, timeout=600, env=clean_env(VIT_VENV=str(venv), PYTHON=sys.executable))
    assert proc.returncode == 1 and "READY" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert f"[env] creating {venv}" in proc.stderr and "no-such-package-for-this-test" in proc.stderr
    assert subprocess.run([str(venv / "bin/python"), "-m", "pip", "--version"], capture_output=True).returncode == 0
    assert not (venv / ".installed").exists()


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

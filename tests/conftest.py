"""Shared fixtures for the infra tests: free loopback ports, a real MLflow server, process-group teardown."""
from __future__ import annotations

import importlib.metadata
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# Variables that would point a child at the developer's own servers / params instead of the test's.
_LEAKY = ("MLFLOW_TRACKING_URI", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "VIT_PARAMS", "VIT_WORKSPACE",
          "VIT_SHARDS_URL", "AWS_ENDPOINT_URL", "AWS_PROFILE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


# Benchmarks that tests run record their figures in a temporary folder, never in benchmarks/results/.
_RESULTS = tempfile.TemporaryDirectory(prefix="vit-results-")
os.environ["VIT_RESULTS_DIR"] = _RESULTS.name


# The files that take minutes (Ray / DVC end to end), longest first. scripts/test.sh runs the suite
# on two pytest-xdist processes, whole files each, in collection order (--no-loadscope-reorder): the
# long files start at once and the short ones fill in behind them. xdist's own order (most tests
# first) started test_training.py's ~10 minutes late and left one process idle at the end.
LONGEST_FIRST = ("test_pipeline.py", "test_training.py", "test_cluster.py", "test_storage.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file kept


_HANDED_OUT: set[int] = set()


RAY_CLI_WORKER_PORTS = (10002, 19999)  # what `ray start` gives its workers (a head on this machine)


def free_port() -> int:
    """A free loopback TCP port, below the kernel's ephemeral range and not handed out before in this
    session, so two calls in a row (say, for a Ray head's client and agent ports) cannot return the same
    number. A port that ``bind(0)`` hands out is one the kernel also gives outgoing connections as their
    source port, and Ray opens many while it starts: one such port was taken before a server bound it."""
    first_ephemeral = ephemeral_ports()[0]
    candidates = [p for p in range(RAY_CLI_WORKER_PORTS[1] + 1, first_ephemeral) if p not in _HANDED_OUT]
    for port in random.sample(candidates, min(len(candidates), 100)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use: try another
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # no port free below the range: any free one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of source ports for outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def clean_env(**extra: str) -> dict[str, str]:
    """The current environment without the variables above, the venv first on PATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _LEAKY}
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    env.update(extra)
    return env


# Ray Train's controller logs this WARNING with a traceback when its 5 s call to the autoscaling
# coordinator times out, which it does on an overloaded machine (two test processes on two cores);
# Ray's own words: "safe to ignore" when transient. A stage's own Ray instance sends no such call
# (pipeline/cluster.py); a stage that joins a cluster (a head, a job) may still log it.
COORDINATOR_TIMEOUTS = ("Failed to send resource request for train-", "Failed to cancel resource request for train-")
_RAY_OVERLOAD_WARNING = re.compile("|".join(map(re.escape, COORDINATOR_TIMEOUTS)))
_RAY_PREFIX = re.compile(r"^\(\S+ pid=\d+(, ip=\S+)?\) ")  # "(TrainController pid=123) ", where Ray adds it


def tracebacks(stderr: str) -> list[str]:
    """The tracebacks in ``stderr``, less those of Ray Train's overload warning (above)."""
    found, lines = [], [_RAY_PREFIX.sub("", line) for line in stderr.splitlines()]
    for i, line in enumerate(lines):
        if line.startswith("Traceback") and not (i and _RAY_OVERLOAD_WARNING.search(_warning_of(lines, i))):
            found.append("\n".join(lines[i:i + 30]))
    return found


def _warning_of(lines: list[str], i: int) -> str:
    """The log line a traceback at ``lines[i]`` belongs to (before any chained one's "During handling")."""
    while i and (lines[i - 1].startswith(("Traceback", " ", "During handling", "The above exception"))
                 or not lines[i - 1].strip() or re.match(r"[\w.]+(Error|Exception)\b", lines[i - 1])):
        i -= 1
    return lines[i - 1] if i else ""


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group that ``proc`` leads (started with start_new_session), then SIGKILL."""
    if proc.poll() is None or _group_alive(proc.pid):
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.time() + grace
        while time.time() < deadline:
            proc.poll()  # reap the leader: a zombie still counts as a group member
            if not _group_alive(proc.pid):
                break
            time.sleep(0.2)
        if _group_alive(proc.pid):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: "
                               f"{log.read_text()[-3000:] if log else ''}")
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s: {log.read_text()[-3000:] if log else ''}")


# What the GPU-box commands (docs/gpu.md: benchmarks/train_throughput.py, time_to_accuracy.py)
# may import of requirements.txt; docs/gpu.md lists the same. setuptools: torch.compile on a CPU (inductor
# builds C++ through torch.utils.cpp_extension).
GPU_BOX_REQUIREMENTS = ("torch", "torchvision", "webdataset", "pyyaml", "pillow", "pyarrow", "safetensors",
                        "scikit-learn", "matplotlib", "setuptools")


def normalized_name(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503): ``Scikit_Learn`` -> ``scikit-learn``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_requirements(*files: str) -> dict[str, str]:
    """``{name: version}`` pinned (``name==version``) in the given requirements files of the repository."""
    pins = {}
    for f in files:
        for line in (ROOT / f).read_text().splitlines():
            m = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==([^\s#]+)", line)
            if m:
                pins[m.group(1).lower()] = m.group(3)
    return pins


def locked_versions(lock: str) -> dict[str, set[str]]:
    """``{name: {versions}}`` of a lock the repository holds (``requirements*.lock``, scripts/lock.sh): a
    package may be locked at one version per platform or Python (each entry then carries its markers)."""
    locked: dict[str, set[str]] = {}
    for m in re.finditer(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==(\S+)", (ROOT / lock).read_text(), flags=re.M):
        locked.setdefault(normalized_name(m.group(1)), set()).add(m.group(2))
    return locked


def gpu_box_blocked_imports() -> list[str]:
    """Import names of every requirement in requirements.txt that is not on :data:`GPU_BOX_REQUIREMENTS`
    (Ray, MLflow, DVC, ONNX, S3, ...): what a plain GPU box may lack."""
    required = {normalized_name(name) for name in pinned_requirements("requirements.txt")}
    box = {normalized_name(name) for name in GPU_BOX_REQUIREMENTS}
    assert box <= required, f"not in requirements.txt: {sorted(box - required)}"
    dists = importlib.metadata.packages_distributions()
    return sorted(name for name, of in dists.items()
                  if {normalized_name(d) for d in of} & (required - box) and not {normalized_name(d) for d in of} & box)


def run_as_on_gpu_box(script: str, *args: object, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python script args`` in the repository root with every import blocked that a GPU box with only
    :data:`GPU_BOX_REQUIREMENTS` would lack (the lent GPU machine has no Ray, MLflow or DVC)."""
    blocked = (f"import runpy, sys\nfor m in {gpu_box_blocked_imports()!r}: sys.modules[m] = None\n"
               "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')")
    return subprocess.run([sys.executable, "-c", blocked, script, *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


# Runs each argv of a JSON list through the script's main() in this one process (a Python and torch start-up
# each is most of a bad-input case's time), its file descriptors 1 and 2 caught in files per case.
_CASES_RUNNER = """
import json, os, runpy, sys, tempfile
for m in json.loads(sys.argv[1]): sys.modules[m] = None
main = runpy.run_path(sys.argv[2], run_name="gpu_box_cases")["main"]
results = []
for argv in json.loads(sys.argv[3]):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        results.append([code] + [(f.seek(0), f.read().decode())[1] for f in (out, err)])
print(json.dumps(results))
"""


def run_cases_as_on_gpu_box(script: str, *cases: list[object], timeout: float = 300) -> list[subprocess.CompletedProcess]:
    """:func:`run_as_on_gpu_box` for many argument lists at once: one process calls the script's ``main(argv)``
    for each in turn. Only for cases that end in ``main``'s return (its bad-input checks)."""
    argvs = [[str(a) for a in case] for case in cases]
    proc = subprocess.run([sys.executable, "-c", _CASES_RUNNER, json.dumps(gpu_box_blocked_imports()), script,
                           json.dumps(argvs)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [subprocess.CompletedProcess([script, *argv], code, out, err)
            for argv, (code, out, err) in zip(argvs, json.loads(proc.stdout.splitlines()[-1]))]


@pytest.fixture(scope="session")
def port_factory():
    """``port_factory()`` -> a free loopback TCP port."""
    return free_port


@pytest.fixture(scope="session")
def env_factory():
    """``env_factory(**extra)`` -> a clean child environment (see :func:`clean_env`)."""
    return clean_env


class MlflowServer:
    def __init__(self, url: str, data: Path, proc: subprocess.Popen, log: Path):
        self.url, self.data, self.proc, self.log = url, data, proc, log


@contextmanager
def serve_mlflow(store: Path, artifacts: Path, log: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``infra/mlflow-server.sh`` on a free loopback port over the sqlite file ``store``; yields its
    URL and process, stops it on exit."""
    port = free_port()
    env = clean_env(MLFLOW_PORT=str(port), MLFLOW_HOST="127.0.0.1", MLFLOW_WORKERS="1",
                    MLFLOW_BACKEND_STORE_URI=f"sqlite:///{store}", MLFLOW_ARTIFACTS_DESTINATION=str(artifacts))
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", str(ROOT / "infra/mlflow-server.sh")], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", timeout=120, proc=proc, log=log)
        yield url, proc
    finally:
        stop_group(proc)


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow server (sqlite + local artifacts in a temp dir) for the session."""
    data = tmp_path_factory.mktemp("mlflow-server")
    log = data / "server.log"
    with serve_mlflow(data / "mlflow.db", data / "artifacts", log) as (url, proc):
        yield MlflowServer(url, data, proc, log)


class S3Server:
    def __init__(self, endpoint: str, env: dict[str, str], bucket: str):
        self.endpoint, self.env, self.bucket = endpoint, env, bucket

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A real S3 API server (moto in server mode, its own process) on a free loopback port, one bucket.

    ``.env`` holds the AWS variables a client needs (endpoint via AWS_ENDPOINT_URL); they are also set
    in this process for the module's duration, so fsspec / pyarrow here talk to the same server.
    """
    moto = shutil.which("moto_server", path=str(VENV_BIN))
    if moto is None:
        pytest.fail("moto_server not installed: pip install -r requirements-test.txt")
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], env=clean_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    try:
        wait_http(endpoint + "/moto-api/", timeout=60, proc=proc, log=log)
        os.environ.update(env)
        server = S3Server(endpoint, env, "vit-test")
        server.client().create_bucket(Bucket=server.bucket)
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        stop_group(proc)


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> Path:
    """Digits sharded into real tars (200 samples per shard); one per test process, read-only."""
    from pipeline.config import DataConfig
    from pipeline.data import shard_dataset
    out = tmp_path_factory.mktemp("digits") / "shards"
    shard_dataset(out, DataConfig(source="digits", maxcount=200))
    return out


@pytest.fixture(scope="session")
def photo_shards(tmp_path_factory) -> Path:
    """48 photo-like 1600 x 1200 JPEGs, copied through into shards of 5 (train 36, test 12): a 224 px crop
    of them decodes at reduced size where it spans 896 px (the eval crop, some train crops); read-only."""
    from pipeline.config import DataConfig
    from pipeline.data import shard_dataset
    from tests.data_helpers import make_photo_folder
    root = make_photo_folder(tmp_path_factory.mktemp("photos") / "folder", size=(1600, 1200))
    out = root.parent / "shards"
    shard_dataset(out, DataConfig(source="imagefolder", root=str(root), maxcount=5, val_fraction=0.0,
                                  test_fraction=0.25))
    return out


@pytest.fixture
def stage_signals():
    """SIGTERM/SIGINT raise StageInterrupted, as in a stage; the test process's handlers come back after."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    from pipeline.signals import raise_on_signals

    raise_on_signals()
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)

"""The Ray cluster the stages run on: how many ranks, what each needs, and starting (or joining) it."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Iterator

from pipeline.config import ConfigError, RayConfig
from pipeline.reaper import watch
from pipeline.signals import raise_on_signals

WAIT_REPORT_S = 30  # how often a wait for cluster resources says so
# Ray Train V2's controller takes a rank's report only when it polls the ranks, every
# $RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray's default 2 s), and a rank's next report waits until the
# last one was taken: a loop reporting every 1.6 s (an epoch of the default pipeline, or of CIFAR-10
# on one H100) waited ~0.4 s per report. Ray passes the variable on to its controller and ranks.
REPORT_POLL_VAR, REPORT_POLL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25"
# Ray Train's controller tells an autoscaling coordinator (a detached actor it starts) what the run needs,
# and waits up to 5 s for each answer: a busy machine timed out there, a 20-line traceback each time. A Ray
# instance of the stage's own has no autoscaler to tell, so its processes send nothing (:func:`no_autoscaler`).
COORDINATOR_CLIENT = "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client"
# Ray gives a node this machine's network address, and then its processes (GCS, raylet, workers, agents)
# listen on every interface. With this variable off, Ray's setting on macOS and Windows, a node takes
# 127.0.0.1 and they all listen there only. Ray reads it as it is imported, into ENABLE_RAY_CLUSTER.
LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# Ray starts one idle worker per CPU as the driver connects, and more while tasks queue, ahead of need. A
# stage's own instance runs a known few actors and tasks, each started as it is asked for: the idle ones were
# a CPU-second each of every run's start, on the cores its ranks were starting on.
NO_PRESTART = {"prestart_worker_first_driver": False, "enable_worker_prestart": False}


def worker_resources(ray_cfg: RayConfig) -> dict[str, float]:
    """What one rank (a Ray Train worker or an evaluation task) reserves."""
    res = {"CPU": float(ray_cfg.cpus_per_worker)}
    if ray_cfg.use_gpu:
        res["GPU"] = float(ray_cfg.gpus_per_worker or 1)
    return res


def _job_env_vars() -> set[str]:
    """The variables of the Ray job this process runs as (``ray job submit --runtime-env-json``, e.g. what
    infra/submit.sh passes from ``VIT_JOB_ENV``): Ray sets them for the job's tasks and actors itself."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    if not raw:
        return set()
    try:
        runtime_env = json.loads(raw).get("runtime_env") or {}
        return set(runtime_env.get("env_vars") or {})
    except (ValueError, AttributeError):  # not the JSON Ray writes: nothing to leave out
        return set()


def init_ray(ray_cfg: RayConfig) -> None:
    """Join the cluster named by ``ray.address`` / ``RAY_ADDRESS``, or start a quiet local one; either
    way make sure it can hold ``ray.num_workers`` ranks before anything is submitted."""
    if not ray_cfg.verbose:  # rank 0's epoch lines without "(RayTrainWorker pid=…)"; read as Ray is imported
        os.environ.setdefault("RAY_DISABLE_WORKER_LOG_PREFIX", "1")
    import ray

    if ray.is_initialized():
        return
    # Defaults only: a value set in the environment goes to the ranks as it is (not overridden by "0").
    quiet = {k: os.environ.setdefault(k, v)
             for k, v in {"RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}.items()}
    os.environ.setdefault(REPORT_POLL_VAR, REPORT_POLL_S)
    if not sys.stdout.isatty():  # a log file or CI: a prefix (ray.verbose) without colour codes
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    address = cluster_address(ray_cfg)
    if not address:  # one machine, no preemptible nodes: Ray Train's preemption watcher only adds a log line
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        quiet["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"]
    for name in _job_env_vars():  # a job's own variables reach the ranks already; Ray refuses them twice
        quiet.pop(name, None)
    kwargs = dict(logging_level=logging.INFO if ray_cfg.verbose else logging.WARNING,
                  log_to_driver=True, runtime_env={"env_vars": quiet})
    if address:
        ray.init(address=address, **kwargs)
    else:
        _start_local(ray_cfg, kwargs)
    raise_on_signals()  # ray.init replaced the SIGTERM handler with one that aborts
    if address:
        wait_for_resources(ray_cfg)


def _start_local(ray_cfg: RayConfig, kwargs: dict) -> None:
    """A Ray instance for this stage alone. No dashboard: it backs Ray's state API, which only Ray Train's
    placement-group cleaner reads, and a local run leaves that out (:func:`is_local`); its start-up
    processes were a few CPU-seconds of every run's. No idle workers started ahead (:data:`NO_PRESTART`)."""
    import ray

    check_local_capacity(ray_cfg)
    if not ray_cfg.verbose:  # "token auth enabled by default": moot for a 127.0.0.1-only cluster
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    # cpus_per_worker may exceed the cores (a cluster recipe tried on a laptop): Ray is told it has them.
    # address="local": a new instance even where `ray start --head` left its address for ray.init() to join.
    cpus = max(ray_cfg.num_workers * ray_cfg.cpus_per_worker, os.cpu_count() or 1)
    kwargs["runtime_env"]["worker_process_setup_hook"] = no_autoscaler
    before = _descendants()
    with _loopback_only():
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, _system_config=NO_PRESTART, **kwargs)
    # Ray's agents outlive a `kill -9` of the stage: whatever it started is ended once the stage is gone
    watch(sorted(_descendants() - before))


def _descendants() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


@contextmanager
def _loopback_only() -> Iterator[None]:
    """While a local instance starts: its node on 127.0.0.1 (:data:`LOOPBACK_VAR`), in this process and in
    the processes it starts, which inherit the environment. Put back after: a later ray.init in this
    process may join a cluster, which needs the machine's address."""
    from ray._private import ray_constants

    before = os.environ.get(LOOPBACK_VAR), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_VAR], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before[1]
        if before[0] is None:
            os.environ.pop(LOOPBACK_VAR, None)
        else:
            os.environ[LOOPBACK_VAR] = before[0]


def no_autoscaler() -> None:
    """Run by Ray in each process of a local instance as it starts (``worker_process_setup_hook``): Ray
    Train's controller sends no resource requests (:data:`COORDINATOR_CLIENT`), so it neither starts the
    coordinator's actor nor waits on it; on a busy 2-core machine that was up to 5 s of every run's start."""
    import importlib

    client = importlib.import_module(COORDINATOR_CLIENT).TrainAutoscalingCoordinatorClient
    client.send_resource_request = client.cancel_resource_request = lambda *args, **kwargs: None


@contextmanager
def ray_cluster(ray_cfg: RayConfig) -> Iterator[None]:
    """:func:`init_ray`, and on a signal or an error inside, leave Ray before the stage prints its last line:
    Ray's own exit hook would print after it the forwarded logs of actors dying with the run (a failed rank's
    traceback, arriving late on a busy machine, ended a stage's output after its one-line error)."""
    init_ray(ray_cfg)
    try:
        yield
    except BaseException:
        import ray

        ray.shutdown()
        raise


def torch_trainer(ray_cfg: RayConfig, *args, **kwargs):
    """Ray Train's ``TorchTrainer(*args, **kwargs)`` as the stages run it (on the cluster of ``ray_cfg``)."""
    from ray.train.torch import TorchTrainer

    class StageTrainer(TorchTrainer):
        def _register_sigint_handler(self, controller) -> None:
            """Ray Train's own Ctrl-C handler left out (it aborted the run and exited 1 in silence): the
            stage's (:mod:`pipeline.signals`) stops it as it stops a SIGTERM, KILLED and resumable."""

        def _create_default_callbacks(self) -> list:
            """Without the Ray Datasets callback, whose actor (~2 CPU-s to start) serves the ranks Ray Data
            shards: the stages read webdataset tars and pass no datasets. On the stage's own Ray instance,
            without the placement-group cleaner too: an actor that frees the run's reservation should the
            controller die, which matters on a cluster that outlives the run, and reads Ray's state API,
            which needs the dashboard that a local instance leaves out."""
            left_out = {"DatasetsCallback"} if not self.datasets else set()
            if is_local(ray_cfg):
                left_out.add("PlacementGroupCleanerCallback")
            return [c for c in super()._create_default_callbacks() if type(c).__name__ not in left_out]

    return StageTrainer(*args, **kwargs)


def is_local(ray_cfg: RayConfig) -> bool:
    """Whether the stage runs on a Ray instance of its own (which ends with it), not a joined cluster."""
    return not cluster_address(ray_cfg)


def cluster_address(ray_cfg: RayConfig) -> str | None:
    """The cluster to join: ``ray.address``, else ``$RAY_ADDRESS`` (set for a Ray job's driver); None: one machine."""
    return ray_cfg.address or os.environ.get("RAY_ADDRESS") or None


def check_local_capacity(ray_cfg: RayConfig) -> None:
    """On one machine (no cluster to join), the ranks must fit it: one process per rank, the GPUs
    asked for present. Checked before any work; Ray itself would wait forever."""
    if ray_cfg.backend == "local":
        if ray_cfg.use_gpu:
            from pipeline.train.context import local_device
            try:
                local_device(True)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        return
    if cluster_address(ray_cfg):
        return
    cpus = os.cpu_count() or 1
    if ray_cfg.num_workers > cpus:
        raise ConfigError(f"ray.num_workers: {ray_cfg.num_workers} ranks need {ray_cfg.num_workers} processes, "
                          f"and this machine has {cpus} CPUs (valid here: 1..{cpus}; or join a cluster with "
                          "ray.address)")
    if ray_cfg.use_gpu:
        import torch
        per_worker = worker_resources(ray_cfg)["GPU"]
        need, have = ray_cfg.num_workers * per_worker, torch.cuda.device_count()
        if need > have:
            raise ConfigError(f"ray.use_gpu: ray.num_workers={ray_cfg.num_workers} x {per_worker:g} GPU "
                              f"needs {need:g} GPU (this machine has {have}); set ray.use_gpu: false, lower "
                              f"ray.num_workers / gpus_per_worker, or join a cluster with ray.address")


def wait_for_resources(ray_cfg: RayConfig) -> None:
    """A joined cluster must offer ``num_workers`` x :func:`worker_resources`, or Ray waits forever
    without a word. It may be autoscaling: ask for the ranks, wait up to ``ray.resource_wait_s``
    saying so every 30 s, then fail with what is missing."""
    from ray.autoscaler.sdk import request_resources

    need = {k: v * ray_cfg.num_workers for k, v in worker_resources(ray_cfg).items()}
    request_resources(bundles=[worker_resources(ray_cfg)] * ray_cfg.num_workers)
    try:
        _wait_for(need, ray_cfg)
    finally:
        # The request outlives this driver ("persistent until another call", Ray's docs): left in place, it
        # would keep the autoscaler from ever scaling the GPU nodes down (or go on launching them after a
        # timeout). Once they are there, Ray Train's placement group holds them; idle ones time out again.
        request_resources(bundles=[])


def _wait_for(need: dict[str, float], ray_cfg: RayConfig) -> None:
    import ray

    have = ray.cluster_resources()
    start = next_report = time.monotonic()  # from the cluster's first answer: a slow first call is no wait
    while True:
        short = {k: (v, have.get(k, 0.0)) for k, v in need.items() if have.get(k, 0.0) < v}
        if not short:
            return
        waited = time.monotonic() - start
        what = ", ".join(f"{v:g} {k} (cluster has {h:g})" for k, (v, h) in short.items())
        if waited >= ray_cfg.resource_wait_s:
            raise ConfigError(f"ray.num_workers={ray_cfg.num_workers} x {worker_resources(ray_cfg)} per worker "
                              f"needs {what} after {ray_cfg.resource_wait_s:g} s (ray.resource_wait_s); lower "
                              f"ray.num_workers / cpus_per_worker / gpus_per_worker, set ray.use_gpu: false, "
                              f"or add nodes")
        if time.monotonic() >= next_report:
            next_report += WAIT_REPORT_S
            print(f"[ray] waiting up to {ray_cfg.resource_wait_s - waited:.0f} s for the cluster to offer {what}",
                  flush=True)
        time.sleep(1)
        have = ray.cluster_resources()

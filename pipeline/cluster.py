"""The Ray cluster the stages run on: how many ranks, and starting (or joining) it."""
from __future__ import annotations

import logging
import os

from pipeline.config import RayConfig


def world_size(cfg: RayConfig) -> int:
    """Ranks of a training run: ``ray.num_workers``, or 1 in-process with ``ray.backend: local``."""
    return 1 if cfg.backend == "local" else cfg.num_workers


def init_ray(cfg: RayConfig) -> None:
    """Join the cluster named by ``ray.address`` / ``RAY_ADDRESS``, or start a quiet local one."""
    import ray

    if ray.is_initialized():
        return
    quiet = {"RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    for k, v in quiet.items():
        os.environ.setdefault(k, v)
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if not address:  # one machine, no preemptible nodes: Ray Train's preemption watcher only adds a log line
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        quiet["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"]
    kwargs = dict(logging_level=logging.INFO if cfg.verbose else logging.WARNING,
                  log_to_driver=True, runtime_env={"env_vars": quiet})
    if address:
        ray.init(address=address, **kwargs)
    else:
        if not cfg.verbose:  # "token auth enabled by default": moot for a 127.0.0.1-only cluster
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        # The dashboard backs Ray's state API, which Ray Train's placement-group cleaner polls.
        need = cfg.num_workers * cfg.cpus_per_worker
        ray.init(num_cpus=max(need, os.cpu_count() or 1), include_dashboard=True,
                 dashboard_host="127.0.0.1", **kwargs)

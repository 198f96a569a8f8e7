"""Driver side of a training stage: plan the run, start (or join) Ray, run ``TorchTrainer``.

The Ray run name is a hash of everything that defines the run (stage params, model config, data,
initial weights, world size), so re-running an interrupted stage continues the same Ray run from
its last checkpoint (Ray Train V2 restores a run launched again with the same name and storage
path), while changed params start a fresh one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline import storage
from pipeline.config import Params, TrainConfig
from pipeline.data import read_dataset_info
from pipeline.model import VisionTransformer
from pipeline.utils import atomic_write_text


@dataclass
class TrainPlan:
    stage: str
    run_name: str
    loop_cfg: dict
    init_state: dict[str, torch.Tensor]


@dataclass
class TrainResult:
    model: VisionTransformer
    history: list[dict]
    run_name: str
    checkpoint_path: str


def worker_batch(global_batch: int, world: int) -> int:
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} is not divisible by {world} workers")
    return global_batch // world


def _state_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def plan_training(stage: str, params: Params, cfg: TrainConfig, model: VisionTransformer,
                  shard_dir: str) -> TrainPlan:
    """Everything the workers need, and the run name that identifies this exact run."""
    info = read_dataset_info(shard_dir)
    world = params.ray.num_workers
    per_worker = worker_batch(cfg.global_batch_size, world)
    steps = max(1, info["counts"]["train"] // cfg.global_batch_size)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    loop_cfg = {
        "stage": stage, "model": model.config.to_dict(), "shard_dir": storage.worker_path(shard_dir),
        "image_size": cfg.image_size, "epochs": cfg.epochs, "steps_per_epoch": steps,
        "per_worker_batch": per_worker, "max_worker_batch": cfg.max_worker_batch, "lr": cfg.lr,
        "min_lr": cfg.min_lr, "weight_decay": cfg.weight_decay, "layer_decay": cfg.layer_decay,
        "warmup_steps": int(round(cfg.warmup_epochs * steps)), "label_smoothing": cfg.label_smoothing,
        "grad_clip": cfg.grad_clip, "seed": cfg.seed, "eval_every": cfg.eval_every,
        "augment": dict(cfg.augment), "mixup_alpha": cfg.mixup_alpha, "cutmix_alpha": cfg.cutmix_alpha,
        "ema_decay": cfg.ema_decay, "amp": cfg.amp, "checkpoint_every_steps": cfg.checkpoint_every_steps,
        "log_every_steps": cfg.log_every_steps,
    }
    identity = {**loop_cfg, "world": world, "use_gpu": params.ray.use_gpu, "data": info.get("shards"),
                "init": _state_digest(state)}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    loop_cfg["verbose"] = params.ray.verbose
    return TrainPlan(stage=stage, run_name=f"{stage}-{digest[:12]}", loop_cfg=loop_cfg, init_state=state)


def init_ray(params: Params) -> None:
    """Join the cluster named by ``ray.address`` / ``RAY_ADDRESS``, or start a quiet local one."""
    import ray

    if ray.is_initialized():
        return
    quiet = {"RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    for k, v in quiet.items():
        os.environ.setdefault(k, v)
    address = params.ray.address or os.environ.get("RAY_ADDRESS")
    if not address:  # one machine, no preemptible nodes: Ray Train's preemption watcher only adds a log line
        os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
        quiet["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"]
    kwargs = dict(logging_level=logging.INFO if params.ray.verbose else logging.WARNING,
                  log_to_driver=True, runtime_env={"env_vars": quiet})
    if address:
        ray.init(address=address, **kwargs)
    else:
        if not params.ray.verbose:  # "token auth enabled by default": moot for a 127.0.0.1-only cluster
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        # The dashboard backs Ray's state API, which Ray Train's placement-group cleaner polls.
        need = params.ray.num_workers * params.ray.cpus_per_worker
        ray.init(num_cpus=max(need, os.cpu_count() or 1), include_dashboard=True,
                 dashboard_host="127.0.0.1", **kwargs)


def _fault_from_env() -> dict | None:
    """``VIT_FAULT=kill@12:/tmp/marker`` (or ``raise@…``): fail once at step 12 (tests only)."""
    spec = os.environ.get("VIT_FAULT")
    if not spec:
        return None
    mode, rest = spec.split("@", 1)
    step, marker = rest.split(":", 1)
    return {"mode": mode, "step": int(step), "marker": marker}


def fit(plan: TrainPlan, params: Params, model: VisionTransformer, *, run_id: str | None = None) -> TrainResult:
    """Run (or continue) the planned Ray Train run; load its final weights into ``model``."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipeline.tracking import resolve_tracking_uri
    from pipeline.train.checkpoint import load_state
    from pipeline.train.worker import train_loop_per_worker

    init_ray(params)
    storage_path, storage_fs = storage.ray_storage(params.ray.storage_path)
    cfg = plan.loop_cfg
    loop_cfg = {**cfg, "init_ref": ray.put(plan.init_state), "run_id": run_id, "fault": _fault_from_env(),
                "tracking_uri": resolve_tracking_uri(params.tracking_uri)}
    world = params.ray.num_workers
    print(f"[{plan.stage}] Ray Train: {world} worker(s), global batch {cfg['per_worker_batch'] * world} "
          f"({cfg['per_worker_batch']}/worker), {cfg['steps_per_epoch']} steps/epoch x {cfg['epochs']} epochs, "
          f"run {plan.run_name}", flush=True)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_cfg,
        scaling_config=ScalingConfig(num_workers=world, use_gpu=params.ray.use_gpu,
                                     resources_per_worker=_resources(params)),
        run_config=RunConfig(
            name=plan.run_name, storage_path=storage_path, storage_filesystem=storage_fs,
            checkpoint_config=CheckpointConfig(num_to_keep=params.ray.checkpoints_to_keep),
            failure_config=FailureConfig(max_failures=params.ray.max_failures),
            logging_config=LoggingConfig(log_level="INFO" if params.ray.verbose else "WARNING")),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"[{plan.stage}] Ray run {plan.run_name} finished without a checkpoint")
    final = load_state(result.checkpoint)
    weights = final["model"]
    if final.get("ema"):  # the EMA weights are the ones to keep when EMA is on
        weights = {k[len("module."):]: v for k, v in final["ema"].items() if k.startswith("module.")}
    model.load_state_dict(weights)
    return TrainResult(model=model, history=final["history"], run_name=plan.run_name,
                       checkpoint_path=str(result.checkpoint.path))


def _resources(params: Params) -> dict[str, float]:
    res = {"CPU": float(params.ray.cpus_per_worker)}
    if params.ray.use_gpu:
        res["GPU"] = float(params.ray.gpus_per_worker or 1)
    return res


def write_history(history: list[dict], csv_path: str | Path) -> None:
    """Per-epoch metrics as CSV (a DVC plot), written atomically."""
    keys = sorted({k for row in history for k in row}, key=lambda k: (k != "epoch", k))
    lines = [",".join(keys)] + [",".join(str(row.get(k, "")) for k in keys) for row in history]
    atomic_write_text(csv_path, "\n".join(lines) + "\n")

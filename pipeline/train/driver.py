"""Driver side of a training stage: start (or join) Ray, run ``TorchTrainer``, collect the result.

The Ray run name is a hash of everything that defines the run (stage params, model config, data,
initial weights), so re-running an interrupted stage continues the same run from its last
checkpoint while changed params start a fresh one.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.config import Params, TrainConfig
from pipeline.data import read_dataset_info
from pipeline.model import VisionTransformer
from pipeline.utils import atomic_write_text

log = logging.getLogger(__name__)


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


def _run_name(stage: str, payload: dict) -> str:
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()
    return f"{stage}-{digest[:12]}"


def _state_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def init_ray(params: Params) -> None:
    """Join the cluster named by ``ray.address`` / ``RAY_ADDRESS``, or start a quiet local one."""
    import ray

    if ray.is_initialized():
        return
    quiet = {"RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    for k, v in quiet.items():
        os.environ.setdefault(k, v)
    address = params.ray.address or os.environ.get("RAY_ADDRESS")
    kwargs = dict(logging_level=logging.INFO if params.ray.verbose else logging.WARNING,
                  log_to_driver=True, runtime_env={"env_vars": quiet})
    if address:
        ray.init(address=address, **kwargs)
    else:
        # The dashboard backs Ray's state API, which Ray Train's placement-group cleaner polls.
        need = params.ray.num_workers * params.ray.cpus_per_worker
        ray.init(num_cpus=max(need, os.cpu_count() or 1), include_dashboard=True,
                 dashboard_host="127.0.0.1", **kwargs)


def run_training(stage: str, params: Params, cfg: TrainConfig, model: VisionTransformer, shard_dir: str,
                 *, run_id: str | None = None) -> TrainResult:
    """Train ``model`` (its current weights are the starting point) on the ``train`` split."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from pipeline.tracking import resolve_tracking_uri
    from pipeline.train.worker import STATE_FILE, train_loop_per_worker

    info = read_dataset_info(shard_dir)
    world = params.ray.num_workers
    per_worker = worker_batch(cfg.global_batch_size, world)
    steps = max(1, info["counts"]["train"] // cfg.global_batch_size)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    loop_cfg = {
        "stage": stage, "model": model.config.to_dict(), "shard_dir": str(Path(shard_dir).resolve()),
        "image_size": cfg.image_size, "epochs": cfg.epochs, "steps_per_epoch": steps,
        "per_worker_batch": per_worker, "lr": cfg.lr, "min_lr": cfg.min_lr,
        "weight_decay": cfg.weight_decay, "warmup_steps": int(round(cfg.warmup_epochs * steps)),
        "label_smoothing": cfg.label_smoothing, "grad_clip": cfg.grad_clip, "seed": cfg.seed,
        "eval_every": cfg.eval_every, "augment": dict(cfg.augment), "verbose": params.ray.verbose,
    }
    run_name = _run_name(stage, {**loop_cfg, "world": world, "data": info.get("shards"),
                                 "init": _state_digest(state)})
    init_ray(params)
    loop_cfg.update(init_ref=ray.put(state), run_id=run_id,
                    tracking_uri=resolve_tracking_uri(params.tracking_uri))
    storage = str(Path(params.ray.storage_path or ".ray_results").resolve()) \
        if "://" not in (params.ray.storage_path or "") else params.ray.storage_path
    print(f"[{stage}] Ray Train: {world} worker(s), global batch {cfg.global_batch_size} "
          f"({per_worker}/worker), {steps} steps/epoch x {cfg.epochs} epochs, run {run_name}", flush=True)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_cfg,
        scaling_config=ScalingConfig(num_workers=world, use_gpu=params.ray.use_gpu,
                                     resources_per_worker=_resources(params)),
        run_config=RunConfig(
            name=run_name, storage_path=storage,
            checkpoint_config=CheckpointConfig(num_to_keep=params.ray.checkpoints_to_keep),
            failure_config=FailureConfig(max_failures=params.ray.max_failures),
            logging_config=LoggingConfig(log_level="INFO" if params.ray.verbose else "WARNING")),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"[{stage}] Ray run {run_name} finished without a checkpoint")
    with result.checkpoint.as_directory() as d:
        final = torch.load(Path(d) / STATE_FILE, map_location="cpu", weights_only=False)
    model.load_state_dict(final["model"])
    return TrainResult(model=model, history=final["history"], run_name=run_name,
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


"""Driver side of a training stage: prepare the run, then run it with Ray Train's ``TorchTrainer`` or
in this process (``ray.backend: local``).

The Ray run name is a hash of everything that defines the run (stage params, model config, data,
initial weights, world size, the training code), so re-running an interrupted stage continues the same Ray run from
its last checkpoint (Ray Train V2 restores a run launched again with the same name and storage
path), while changed params start a fresh one.
"""
from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pipeline import storage
from pipeline.cluster import check_local_capacity, worker_resources
from pipeline.config import ConfigError, RayConfig, TrainConfig
from pipeline.data import check_shard_files, read_dataset_info
from pipeline.model import VisionTransformer
from pipeline.train.budget import plan_epoch, unplanned
from pipeline.train.checkpoint import load_state
from pipeline.train.context import latest_checkpoint, newer_on_disk, node_staging_dir, prune_checkpoints, remove_staging
from pipeline.train.loop_config import LoopConfig, LoopRun
from pipeline.train.selection import Selection
from pipeline.utils import atomic_write_text, csv_text


@dataclass
class RunSpec:
    """One training run as :func:`prepare_run` defines it: the Ray run name (a hash of everything that
    defines the run), the ranks' loop config and the initial weights."""

    stage: str
    run_name: str
    loop: LoopConfig
    init_state: dict[str, torch.Tensor]


@dataclass
class TrainResult:
    model: VisionTransformer
    history: list[dict]
    run_name: str
    checkpoint_path: str
    selection: Selection
    planned_epochs: int | None = None  # a time budget's plan: the run is the run of ``epochs: planned_epochs``


def worker_batch(global_batch: int, world: int) -> int:
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} is not divisible by {world} workers")
    return global_batch // world


# The code that decides a run's weights beside its params, data and initial weights (each a dep of both
# training stages in dvc.yaml): edited, it makes another run, so `dvc repro` trains again instead of
# republishing the finished run of the code before. Logging, plotting and publishing code is left out, so
# an edit there still continues an interrupted run.
WEIGHTS_CODE = ("pipeline/model", "pipeline/train", "pipeline/data", "pipeline/config.py")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def code_digest(root: Path = PACKAGE_ROOT) -> str:
    """The sha256 of :data:`WEIGHTS_CODE`'s Python files under ``root``: their names and what their code
    does (the syntax tree less docstrings; comments never reach it), so a documentation edit continues a
    run and a code edit starts another."""
    h = hashlib.sha256()
    for entry in WEIGHTS_CODE:
        path = root / entry
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + _code_of(f) + b"\0")
    return h.hexdigest()[:16]


def _code_of(path: Path) -> bytes:
    """The module's syntax tree without docstrings, as text (line numbers left out)."""
    tree = ast.parse(path.read_bytes(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree).encode()


def _state_digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(state):
        h.update(k.encode())
        h.update(state[k].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def loader_workers(ray_cfg: RayConfig) -> int:
    """``ray.loader_workers``, or by default every CPU a rank has but the one that drives the GPU."""
    if ray_cfg.loader_workers is not None:
        return ray_cfg.loader_workers
    return max(0, ray_cfg.cpus_per_worker - 1)


def _graph_note(loop: LoopConfig, ray_cfg: RayConfig) -> str:
    """What ``cuda_graph: true`` does on this run (nothing to capture without a GPU)."""
    if not loop.cuda_graph:
        return ""
    return ", whole step as one CUDA graph" if ray_cfg.use_gpu else ", cuda_graph: no GPU, the graph-safe step runs eagerly"


def check_batch_fits(stage: str, global_batch: int, train_images: int, shard_dir: str) -> None:
    """An epoch is the full batches of the train split: at least one must fit (before any memory is asked for)."""
    if global_batch > train_images:
        raise ConfigError(f"{stage}.global_batch_size: {global_batch} is larger than the train split "
                          f"({train_images} images in {shard_dir}); valid: 1..{train_images}")


def check_budget_plans(stage: str, recipe: TrainConfig, warmup_steps: int, steps_per_epoch: int) -> None:
    """A time budget's plan is made at the warm-up's last whole epoch in steps, which can round past
    the whole epochs the config checked (2.9999 epochs of 3 steps: 9 steps, epoch 3)."""
    if recipe.time_budget_minutes is None:
        return
    problem = unplanned(stage, recipe.epochs, recipe.warmup_epochs, plan_epoch(warmup_steps, steps_per_epoch),
                        f": {warmup_steps} steps of {steps_per_epoch} an epoch")
    if problem:
        raise ConfigError(problem)


def warmup_note(stage: str, recipe: TrainConfig, warmup_steps: int, steps_per_epoch: int) -> str | None:
    """A warm-up as long as the run (easy to get by shortening a run for a try) leaves no cosine decay: the
    kept weights come from the highest learning rates. Allowed (a smoke test), but said."""
    if recipe.time_budget_minutes is not None or warmup_steps < recipe.epochs * steps_per_epoch:
        return None  # a time budget refuses it in the params check
    return (f"{stage}.warmup_epochs={recipe.warmup_epochs:g} covers all of {stage}.epochs={recipe.epochs}: the "
            f"learning rate rises to the end and never decays; lower {stage}.warmup_epochs for a real run")


def check_stage(stage: str, ray_cfg: RayConfig, recipe: TrainConfig, shard_dir: str | Path,
                info: dict) -> tuple[int, int]:
    """What a stage's run needs of its shards and of this machine, none of which needs a model: its shard
    files, the local runner's cores, one full batch, a time budget's plan. Returns the steps of an epoch
    and of the warm-up. (A command that runs two stages checks the second one's before the first trains.)"""
    check_shard_files(shard_dir, info)
    check_local_capacity(ray_cfg)
    check_batch_fits(stage, recipe.global_batch_size, info["counts"]["train"], shard_dir)
    steps = info["counts"]["train"] // recipe.global_batch_size
    warmup_steps = int(round(recipe.warmup_epochs * steps))
    check_budget_plans(stage, recipe, warmup_steps, steps)
    return steps, warmup_steps


def prepare_run(stage: str, ray_cfg: RayConfig, recipe: TrainConfig, model: VisionTransformer,
                shard_dir: str, logged: dict[str, str] | None = None) -> RunSpec:
    """Everything the ranks need, and the run name that identifies this exact run (and the params
    ``logged`` for it, which its tracking run cannot change once they are recorded)."""
    info = read_dataset_info(shard_dir)
    steps, warmup_steps = check_stage(stage, ray_cfg, recipe, shard_dir, info)
    world = ray_cfg.world_size
    note = warmup_note(stage, recipe, warmup_steps, steps)
    if note:
        print(f"[{stage}] warning: {note}", file=sys.stderr, flush=True)
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    loop = LoopConfig.from_train(
        recipe, stage=stage, model=model.config.to_dict(), shard_dir=storage.worker_path(shard_dir),
        steps_per_epoch=steps, per_worker_batch=worker_batch(recipe.global_batch_size, world),
        warmup_steps=warmup_steps, loader_workers=loader_workers(ray_cfg), verbose=ray_cfg.verbose)
    # the backend is not part of the identity: a local run and a 1-worker Ray run continue each other
    identity = {**loop.identity(), "world": world, "use_gpu": ray_cfg.use_gpu, "data": info.get("shards"),
                "init": _state_digest(state), "code": code_digest(), "logged": logged or {}}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    return RunSpec(stage=stage, run_name=f"{stage}-{digest[:12]}", loop=loop, init_state=state)


def step_hooks_from_env() -> tuple[str, ...]:
    """``$VIT_STEP_HOOKS``: comma-separated ``module:function[=argument]`` names that every rank calls
    before each optimizer step (see :func:`pipeline.train.worker.load_step_hooks`). A seam for
    debugging and for the fault-tolerance tests (``tests/faults.py``); unset in normal runs. Each is
    imported here first, so a name that does not import stops the stage before any rank starts."""
    names = tuple(s.strip() for s in os.environ.get("VIT_STEP_HOOKS", "").split(",") if s.strip())
    if not names:
        return names
    from pipeline.train.worker import load_step_hooks  # the loop's module: torchvision (see :func:`_rank_main`)

    try:
        load_step_hooks(names)
    except ValueError as exc:
        raise ConfigError(f"$VIT_STEP_HOOKS: {exc}") from None
    return names


def fit(spec: RunSpec, ray_cfg: RayConfig, model: VisionTransformer, *, run_id: str | None = None,
        step_hooks: tuple[str, ...] = (), on_epoch: Callable[[dict], None] | None = None,
        train_callbacks: tuple = ()) -> TrainResult:
    """Run (or continue) the planned run on the configured backend; load its final weights into ``model``.
    ``step_hooks`` (``module:function[=argument]``) are called with ``$VIT_STEP_HOOKS``'s. A sweep trial
    passes what takes each epoch's metrics: ``on_epoch`` in-process, ``train_callbacks`` (Ray Train's) on Ray."""
    from pipeline.tracking import configured_uri

    storage.check_ray_storage(ray_cfg.storage_path)
    storage_path, storage_fs = storage.ray_storage(ray_cfg.storage_path)
    remote = storage_fs is not None or storage.is_url(storage_path)
    run_dir = None if remote else str(Path(storage_path) / spec.run_name)
    if run_dir and (resume_from := latest_checkpoint(run_dir)):
        load_state(resume_from, mmap=True)  # one the ranks would refuse, refused once here and not on each retry
    run = LoopRun(init_state=spec.init_state, run_id=run_id, tracking_uri=configured_uri(), run_dir=run_dir,
                  step_hooks=step_hooks_from_env() + tuple(step_hooks))
    loop, world = spec.loop, ray_cfg.world_size
    print(f"[{spec.stage}] {'in-process' if ray_cfg.backend == 'local' else 'Ray Train'}: {world} worker(s), "
          f"global batch {loop.per_worker_batch * world} ({loop.per_worker_batch}/worker), "
          f"{loop.steps_per_epoch} steps/epoch x {_length(loop)}, {loop.loader_workers} loader worker(s) "
          f"per rank{_graph_note(loop, ray_cfg)}, run {spec.run_name}", flush=True)
    try:
        if ray_cfg.backend == "local":
            final, checkpoint = _fit_local(spec, run, ray_cfg, on_epoch)
        else:
            final, checkpoint = _fit_ray(spec, run, ray_cfg, storage_path, storage_fs, train_callbacks)
    except BaseException:  # failed or interrupted: a rank killed while writing a checkpoint left it half-written
        if run_dir:
            remove_staging(run_dir)
        raise
    finally:  # object storage: the staging folder on this node (rank 0's, on one machine) holds nothing to keep
        if not run_dir:
            shutil.rmtree(node_staging_dir(spec.run_name), ignore_errors=True)
    if run_dir:
        prune_checkpoints(run_dir, ray_cfg.checkpoints_to_keep)
    check_finished(spec, final)
    selection = Selection()
    selection.load_state_dict(final["selection"])
    model.load_state_dict(selection.weights)  # the raw or EMA weights that keep: last|best chose
    selection.weights = None
    return TrainResult(model=model, history=final["history"], run_name=spec.run_name,
                       checkpoint_path=str(checkpoint), selection=selection, planned_epochs=final["planned_epochs"])


def _length(loop: LoopConfig) -> str:
    if loop.time_budget_minutes is None:
        return f"{loop.epochs} epochs"
    return f"as many epochs as fit in {loop.time_budget_minutes:g} min (at most {loop.epochs})"


class TrainingDiverged(ValueError):
    """The run's loss and weights stopped being finite: it stopped and the stage saves nothing (exit 1)."""


def check_finished(spec: RunSpec, final: dict | None) -> None:
    """A run ends at its last epoch or by early stopping. Short of both (or with no checkpoint at all),
    its ranks stopped because it diverged; they printed the step and the loss."""
    if final is not None:
        epochs = final["planned_epochs"] or spec.loop.epochs  # a time budget's plan, once made
        if final["epoch"] >= epochs or final["selection"]["stopped_epoch"] is not None:
            return
    s = spec.stage
    where = ("before its first checkpoint" if final is None else  # epochs count from 1, as the epoch lines do
             f"after its last checkpoint (step {final['step']}, "
             f"epoch {final['epoch'] + bool(final['batch_in_epoch'])})")
    raise TrainingDiverged(
        f"{s} run {spec.run_name} diverged {where}: the loss and the weights are no longer finite, and nothing "
        f"was saved; lower {s}.lr, lengthen {s}.warmup_epochs, set {s}.grad_clip, or use {s}.amp: bf16 rather "
        f"than fp16, then run again (changed params start a new run)")


def _fit_local(spec: RunSpec, run: LoopRun, ray_cfg: RayConfig,
               on_epoch: Callable[[dict], None] | None = None) -> tuple[dict | None, str | None]:
    """The final checkpoint's state and where it is (None, None without one)."""
    from pipeline.train.context import LocalContext
    from pipeline.train.worker import run_loop

    ctx = LocalContext(run.run_dir, use_gpu=ray_cfg.use_gpu, keep=ray_cfg.checkpoints_to_keep,
                       resume_from=latest_checkpoint(run.run_dir), on_epoch=on_epoch)
    run_loop(spec.loop, run, ctx)
    checkpoint = latest_checkpoint(run.run_dir)
    return (load_state(checkpoint), checkpoint) if checkpoint else (None, None)


def _fit_ray(spec: RunSpec, run: LoopRun, ray_cfg: RayConfig, storage_path: str,
             storage_fs, callbacks: tuple = ()) -> tuple[dict | None, str | None]:
    """The final checkpoint's state and where it is (None, None without one)."""
    from pipeline.cluster import ray_cluster

    with ray_cluster(ray_cfg):
        result = _ray_trainer(spec, run, ray_cfg, storage_path, storage_fs, callbacks).fit()
    # a run that had already finished on disk (by the local runner, or just before Ray recorded its last
    # checkpoint) reports nothing this launch: its newest checkpoint is the one the ranks resumed from
    on_disk = latest_checkpoint(run.run_dir) if run.run_dir else None
    if newer_on_disk(on_disk, result.checkpoint and result.checkpoint.path):
        return load_state(on_disk), on_disk
    if result.checkpoint is None:
        return None, None
    with result.checkpoint.as_directory() as d:  # a temporary local copy when the storage is remote
        return load_state(d), str(result.checkpoint.path)


def _ray_trainer(spec: RunSpec, run: LoopRun, ray_cfg: RayConfig, storage_path: str, storage_fs,
                 callbacks: tuple = ()):
    """A TorchTrainer running the loop on ``ray.num_workers`` ranks, checkpointing into ``storage_path``."""
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig

    from pipeline.cluster import torch_trainer

    return torch_trainer(
        ray_cfg, _rank_main,
        train_loop_config={"cfg": spec.loop, "run": dataclasses.replace(run, init_state=ray.put(run.init_state))},
        scaling_config=ScalingConfig(num_workers=ray_cfg.num_workers, use_gpu=ray_cfg.use_gpu,
                                     resources_per_worker=worker_resources(ray_cfg)),
        run_config=RunConfig(
            name=spec.run_name, storage_path=storage_path, storage_filesystem=storage_fs,
            checkpoint_config=CheckpointConfig(num_to_keep=ray_cfg.checkpoints_to_keep),
            failure_config=FailureConfig(max_failures=ray_cfg.max_failures),
            logging_config=LoggingConfig(log_level="INFO" if ray_cfg.verbose else "WARNING"),
            callbacks=list(callbacks)),
    )


def _rank_main(args: dict) -> None:
    """What each Ray Train rank runs (:func:`pipeline.train.worker.train_loop_per_worker`), named by this module:
    the driver and Ray's controller, which unpickle the name, then never import the loop's, whose data loading
    brings torchvision (~2 CPU-s of each process on a 2-core machine)."""
    from pipeline.train.worker import train_loop_per_worker

    train_loop_per_worker(args)


def write_history(history: list[dict], csv_path: str | Path) -> None:
    """Per-epoch metrics as CSV (a DVC plot), written atomically."""
    keys = sorted({k for row in history for k in row}, key=lambda k: (k != "epoch", k))
    atomic_write_text(csv_path, csv_text(keys, ([row.get(k, "") for k in keys] for row in history)))

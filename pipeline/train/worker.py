"""The per-rank training loop, run by Ray Train (one process per rank) or in-process (local runner).

Rank 0 prints one line per epoch, logs metrics into the stage's MLflow run (created by the
driver) and attaches full-state checkpoints to each report; every rank restores from the run's
latest checkpoint after a worker failure or when an interrupted run is launched again. The loop
only talks to a :class:`~pipeline.train.context.TrainContext`.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
import random
import time
from contextlib import contextmanager
from itertools import islice
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.data import make_eval_loader, make_train_loader
from pipeline.environment import device_name
from pipeline.model import VisionTransformer, ViTConfig
from pipeline.train.budget import plan_epoch, planned_epochs
from pipeline.train.checkpoint import Progress, restore, save_and_report, unwrap
from pipeline.train.context import TrainContext
from pipeline.train.flops import device_peak, flops_per_image
from pipeline.train.graphs import graph_free
from pipeline.train.loop_config import LoopConfig, LoopRun
from pipeline.train.optim import accumulation, set_total_steps
from pipeline.train.profiling import StepProfiler
from pipeline.train.selection import Selection
from pipeline.train.step import Stepper
from pipeline.train.techniques import amp_dtype, autocast

if TYPE_CHECKING:
    from pipeline.tracking import RunLogger


def _all_reduce(values: list[float | torch.Tensor], device: torch.device) -> list[float]:
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in values])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate_split(net: torch.nn.Module, loader, *, amp: str, device: torch.device,
                   split: str = "val", suffix: str = "") -> dict[str, float]:
    """Loss and top-1 over every sample of the split exactly once across ranks (sums all-reduced)."""
    was_training = net.training
    net.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = 0
    for images, labels in loader:
        with autocast(device, amp_dtype(amp, device)):
            logits = net(images).float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum")
        correct += (logits.argmax(-1) == labels).sum()
        count += labels.numel()
    loss_sum, correct, count = _all_reduce([loss_sum, correct, count], device)
    net.train(was_training)
    return {f"{split}_loss{suffix}": loss_sum / max(count, 1), f"{split}_top1{suffix}": correct / max(count, 1)}


@torch.no_grad()
def check_val_batch(net: torch.nn.Module, loader, *, amp: str, device: torch.device) -> None:
    """One val batch through ``net`` before training (Lightning's sanity check): a val split that cannot
    be read fails the run before its first step, not ``eval_every`` epochs later. The val path's one-off
    costs (its workers' start, the eager model's first calls) then fall in the first epoch, which a time
    budget's plan leaves out, instead of in the first evaluation, which the plan would take for pace."""
    was_training = net.training
    net.eval()
    for images, _ in loader:  # none on a rank without val samples
        with autocast(device, amp_dtype(amp, device)):
            net(images)
        break
    net.train(was_training)


def _select(selection: Selection, metrics: dict, stepper: Stepper, keep_weights: bool, last: bool) -> None:
    """After an evaluation: let the selection see it, and copy the weights it now keeps (rank 0)."""
    if selection.update(metrics, images=metrics["images_seen"], last=last) and keep_weights:
        net = stepper.ema.module if selection.kept["source"] == "ema" else unwrap(stepper.model)
        selection.weights = {k: v.detach().to("cpu", copy=True) for k, v in net.state_dict().items()}


def _fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


StepHook = Callable[[int, TrainContext], None]


def load_step_hooks(names: Sequence[str]) -> list[StepHook]:
    """``"module:function[=argument]"`` -> ``hook(step, ctx)``, which calls ``function(step, ctx, argument)``
    (``argument`` "" when absent) on every rank before each optimizer step (``step``: steps done so far).

    Imported here, in the rank's own process, so a hook works on Ray workers as in-process.
    """
    hooks = []
    for name in names:
        target, _, argument = name.partition("=")
        module, _, function = target.partition(":")
        try:
            fn = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError, ValueError) as exc:
            raise ValueError(f"step hook {name!r}: cannot import {target!r} (want module:function[=argument]): "
                             f"{exc}") from None
        hooks.append(functools.partial(_call_hook, fn, argument))
    return hooks


def _call_hook(fn, argument: str, step: int, ctx: TrainContext) -> None:
    fn(step, ctx, argument)


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _loaders(cfg: LoopConfig, ctx: TrainContext, progress: Progress):
    """The run's train batches from where it stands (one DataLoader for all epochs) and the val loader."""
    common = dict(image_size=cfg.image_size, rank=ctx.rank, world_size=ctx.world_size, augment=cfg.augment,
                  num_workers=cfg.loader_workers, device=ctx.device)
    train = make_train_loader(cfg.shard_dir, batch_size=cfg.per_worker_batch, steps_per_epoch=cfg.steps_per_epoch,
                              epoch=progress.epoch, last_epoch=_epochs(cfg, progress) - 1,  # a plan's, once made
                              start_batch=progress.batch_in_epoch, seed=cfg.seed, **common)
    micro, _ = accumulation(cfg.per_worker_batch, cfg.max_worker_batch)  # what fits fits a forward alone too
    val = make_eval_loader(cfg.shard_dir, "val", batch_size=micro, **common)
    return iter(train), val


def train_loop_per_worker(args: dict) -> None:
    """Ray Train's entry point: ``{"cfg": LoopConfig, "run": LoopRun}`` with a Ray ref as init_state."""
    import ray

    from pipeline.train.context import RayContext

    run: LoopRun = args["run"]
    run = dataclasses.replace(run, init_state=ray.get(run.init_state))
    run_loop(args["cfg"], run, RayContext(run.run_dir))


def run_loop(cfg: LoopConfig, run: LoopRun, ctx: TrainContext) -> None:
    hooks = load_step_hooks(run.step_hooks)  # first: a wrong name fails before any work
    if not cfg.verbose:
        logging.getLogger().setLevel(logging.WARNING)  # Ray Train's per-report INFO lines
    _seed(cfg.seed * 1000 + ctx.rank)
    stepper = Stepper(_model(cfg, run, ctx), cfg, ctx.device)
    selection = Selection(keep=cfg.keep, patience=cfg.early_stop_patience)
    objects = {**stepper.objects(), "selection": selection}
    progress = _resume(cfg, ctx, stepper, objects)
    if progress is None:
        return
    extra = {"config": cfg.model, "train_config": dataclasses.asdict(cfg)}
    batches, val_loader = _loaders(cfg, ctx, progress)
    profiler = StepProfiler(cfg, run, progress.step) if cfg.profile_steps and ctx.rank == 0 else None
    hooks = hooks + [profiler] if profiler else hooks
    pace = _Pace(progress.step)
    mfu = _mfu_rate(cfg, ctx)
    clock = pace.start  # wall_time_s counts from here: every epoch, evaluation and checkpoint but the last
    check_val_batch(unwrap(stepper.model), val_loader, amp=cfg.amp, device=ctx.device)

    def checkpoint(metrics: dict) -> None:
        nonlocal clock
        if progress.batch_in_epoch:  # mid-epoch: the time so far goes into the checkpoint, as an epoch's end does
            now = time.time()
            selection.wall_time_s, clock = selection.wall_time_s + now - clock, now
        save_and_report(metrics, ctx=ctx, objects=objects, progress=progress, extra=extra)

    with _run_logger(run, ctx) as logger:
        while progress.epoch < _epochs(cfg, progress):
            _plan(cfg, ctx, stepper, progress, logger)
            epoch, t0 = progress.epoch, time.time()
            totals = _train_epoch(cfg, ctx, stepper, batches, progress, logger, hooks, checkpoint, pace)
            if totals is None:  # diverged, on every rank alike: the driver finds the run short of its end
                return
            metrics = _epoch_metrics(stepper, totals, epoch, progress.step, time.time() - t0, ctx.world_size)
            if mfu:
                metrics["mfu"] = metrics["images_per_s"] * mfu
            last = epoch + 1 == _epochs(cfg, progress)
            if (epoch + 1) % cfg.eval_every == 0 or last:
                metrics.update(_evaluate(cfg, ctx, stepper, val_loader))
            now = time.time()
            selection.wall_time_s, clock = selection.wall_time_s + now - clock, now
            metrics.update(wall_time_s=selection.wall_time_s,
                           images_seen=progress.step * cfg.per_worker_batch * ctx.world_size)
            if "val_top1" in metrics:
                _select(selection, metrics, stepper, keep_weights=ctx.rank == 0, last=last)
            progress.history.append(metrics)
            progress.epoch, progress.batch_in_epoch, progress.epoch_sums = epoch + 1, 0, None
            if ctx.rank == 0:
                eta = pace.line(progress.step, _steps(cfg, progress))
                _print_epoch(cfg, metrics, _epochs(cfg, progress), eta=eta)
                _log_epoch(logger, metrics, progress.step)
            if (epoch + 1) % cfg.checkpoint_every_epochs == 0 or last or selection.stopped \
                    or _step_checkpoint_due(cfg, progress.step):
                checkpoint(metrics)
            if ctx.rank == 0:
                ctx.epoch_done(metrics)
            if selection.stopped:
                if ctx.rank == 0:
                    print(f"[{cfg.stage}] early stop after epoch {epoch + 1}: no better val top-1 than "
                          f"{selection.best:.4f} for {cfg.early_stop_patience} evaluation(s)", flush=True)
                break
        if profiler:  # a run shorter than the recording: what it recorded
            profiler.close(ctx)


def _resume(cfg: LoopConfig, ctx: TrainContext, stepper: Stepper, objects: dict) -> Progress | None:
    """Where the run stands: restored from its latest checkpoint (a time budget's plan included), or
    a fresh start; None when it has nothing left to train."""
    progress = restore(objects, ctx=ctx) or Progress()
    if stepper.captured is None:  # a plain step may continue a cuda_graph run's checkpoint
        graph_free(stepper.optimizer)
    if progress.epochs:
        set_total_steps(stepper.scheduler, _steps(cfg, progress))
    finished = progress.epoch >= _epochs(cfg, progress) or objects["selection"].stopped
    if progress.step and not finished:
        progress.launches.append(progress.epoch)  # the epoch this launch starts in holds its start-up costs
    if progress.step and ctx.rank == 0:
        state = "run already finished, nothing to train" if finished else "resumed from checkpoint"
        print(f"[{cfg.stage}] {state}: epoch {progress.epoch}, batch {progress.batch_in_epoch}, "
              f"step {progress.step}", flush=True)
    return None if finished else progress


def _mfu_rate(cfg: LoopConfig, ctx: TrainContext) -> float | None:
    """MFU per global image/s: the model's training FLOPs per image over the ranks' summed bf16 peak; None
    on a device without a known peak (rank 0 says so once)."""
    peak = device_peak(ctx.device)
    flops = flops_per_image(cfg.model, cfg.image_size)
    if ctx.rank == 0:
        state = f"logged against {peak / 1e12:.0f} TFLOP/s bf16 per rank" if peak else \
            f"not logged: no bf16 peak known for {device_name(ctx.device)} (pipeline/train/flops.py)"
        print(f"[{cfg.stage}] MFU {state}; {flops / 1e9:.3g} GFLOP per image (forward + backward)", flush=True)
    return flops / (peak * ctx.world_size) if peak else None


def _epochs(cfg: LoopConfig, progress: Progress) -> int:
    """The run's length: ``epochs``, or what a time budget planned."""
    return progress.epochs or cfg.epochs


def _steps(cfg: LoopConfig, progress: Progress) -> int:
    return _epochs(cfg, progress) * cfg.steps_per_epoch


def _plan(cfg: LoopConfig, ctx: TrainContext, stepper: Stepper, progress: Progress, logger) -> None:
    """With a time budget, once, at the end of the warm-up: fix the run's length (:mod:`.budget`) by the
    pace of the epochs that began no launch (the first holds the compiles and first calls, and so does
    the first of a resumed launch), evaluations and checkpoints included; the mean over ranks, so every
    rank plans alike."""
    due = progress.epoch == plan_epoch(cfg.warmup_steps, cfg.steps_per_epoch)
    if not cfg.time_budget_minutes or progress.epochs is not None or not due:
        return
    walls = [h["wall_time_s"] for h in progress.history]
    laps = [(epoch, b - a) for epoch, (a, b) in enumerate(zip(walls, walls[1:]), start=1)]
    paced = [lap for epoch, lap in laps if epoch not in progress.launches] or [lap for _, lap in laps]
    spent, epoch_s = (v / ctx.world_size for v in _all_reduce([walls[-1], sum(paced) / len(paced)], ctx.device))
    progress.epochs = planned_epochs(cfg.time_budget_minutes * 60, spent, epoch_s, progress.epoch, cfg.epochs)
    set_total_steps(stepper.scheduler, _steps(cfg, progress))
    if ctx.rank == 0:
        print(f"[{cfg.stage}] time budget {cfg.time_budget_minutes:g} min: {spent:.1f} s spent, "
              f"{epoch_s:.1f} s per epoch -> {progress.epochs} epochs (at most {cfg.epochs})", flush=True)
    if logger:
        logger.log_metrics({"planned_epochs": progress.epochs}, step=progress.step)


def _model(cfg: LoopConfig, run: LoopRun, ctx: TrainContext) -> torch.nn.Module:
    """The run's initial weights (the same on every rank), wrapped by the runner (DDP, device)."""
    model = VisionTransformer(ViTConfig.from_dict(cfg.model))
    model.load_state_dict(run.init_state)
    return ctx.prepare_model(model)


@contextmanager
def _run_logger(run: LoopRun, ctx: TrainContext) -> Iterator[RunLogger | None]:
    """Rank 0 logs into the stage's MLflow run by id (the driver owns the run), replaces the driver's
    ``env.*`` tags with its own, and has every write in the store before the loop returns."""
    if ctx.rank != 0 or not run.run_id:
        yield None
        return
    from pipeline.environment import describe
    from pipeline.tracking import RunLogger
    logger = RunLogger(run.tracking_uri, run.run_id)
    logger.set_tags(describe(ctx.device))  # where the training computes, which may not be the driver's node
    try:
        yield logger
    except BaseException:
        logger.close(check=False)  # the loop's own error is the one to report
        raise
    logger.close()


def _log_epoch(logger, metrics: dict, step: int) -> None:
    """At the global step, with ``epoch`` as a metric too: the MLflow UI's x-axis can then be the epoch, which
    lines up runs of other batch sizes or datasets where the step does not."""
    if logger:
        logger.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=step)


PROGRESS_EVERY_S = 60.0  # an epoch longer than this also gets lines within it, at most this often


class _Pace:
    """Rank 0's console clock: the run's ETA from its pace since this launch began, and whether a line
    within the epoch is due (none for ``PROGRESS_EVERY_S`` since the last line)."""

    def __init__(self, step: int):
        self.start = self.printed = time.time()
        self.start_step = step

    def line(self, step: int, total_steps: int) -> float:
        """A line is printed now, after ``step`` of the run's ``total_steps``: the ETA it shows."""
        self.printed = time.time()
        return (self.printed - self.start) / max(1, step - self.start_step) * (total_steps - step)

    def due(self) -> bool:
        return time.time() - self.printed >= PROGRESS_EVERY_S


class _Waited:
    """An iterator's items, and ``seconds``: how long the caller waited for them (timm's ``data_time``). The
    host queues a step's device work and moves on, so a loop bound by its input waits here, and one bound
    by the device waits elsewhere (at the next host sync, or when the launch queue is full)."""

    def __init__(self, items: Iterator):
        self.items, self.seconds = items, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        try:
            return next(self.items)
        finally:
            self.seconds += time.perf_counter() - start


def _step_checkpoint_due(cfg: LoopConfig, step: int) -> bool:
    return bool(cfg.checkpoint_every_steps) and step % cfg.checkpoint_every_steps == 0


def _train_epoch(cfg: LoopConfig, ctx: TrainContext, stepper: Stepper, batches, progress: Progress,
                 logger, hooks: list[StepHook], checkpoint, pace: _Pace) -> list | None:
    """The rest of the current epoch's steps; returns [loss sum, correct, samples, seconds waited for input,
    samples this launch] summed over all ranks (an epoch resumed mid-way counts its steps before the
    checkpoint, ``progress.epoch_sums``, in the first three), or None when the training diverged (checked
    wherever the global loss is on the host, and before a checkpoint). In a long epoch rank 0 prints a
    line at a logged step when one is due."""
    before = progress.epoch_sums if progress.epoch_sums and ctx.rank == 0 else [0.0, 0, 0]
    loss_sum = torch.tensor(before[0], dtype=torch.float64, device=ctx.device)
    correct = torch.tensor(before[1], dtype=torch.int64, device=ctx.device)
    seen, start, epoch = 0, time.time(), progress.epoch
    stepper.model.train()
    steps = _Waited(islice(batches, cfg.steps_per_epoch - progress.batch_in_epoch))
    for b, (images, labels) in enumerate(steps, start=progress.batch_in_epoch):
        for hook in hooks:
            hook(progress.step, ctx)
        step_loss, step_correct = stepper(images, labels)
        loss_sum += step_loss
        correct += step_correct
        seen += labels.numel()
        progress.step, progress.batch_in_epoch = progress.step + 1, b + 1
        logged = global_loss = _log_step(cfg, ctx, logger, progress.step, step_loss, labels.numel(), stepper)
        # one due at the epoch's last step is the epoch's own, with its metrics
        save = _step_checkpoint_due(cfg, progress.step) and progress.batch_in_epoch < cfg.steps_per_epoch
        if save:  # the epoch's sums so far go into the checkpoint
            step_sum, *progress.epoch_sums = _all_reduce([step_loss, loss_sum, correct, before[2] + seen], ctx.device)
            global_loss = step_sum if global_loss is None else global_loss
        if global_loss is not None and _diverged(cfg, ctx, stepper, global_loss, progress.step, epoch):
            return None
        if logged is not None and ctx.rank == 0 and pace.due():
            elapsed = time.time() - start
            _print_within(cfg, progress, logged, seen * ctx.world_size / elapsed, steps.seconds / elapsed,
                          eta=pace.line(progress.step, _steps(cfg, progress)))
        if save:
            checkpoint({"step": progress.step, "epoch": epoch})
    totals = _all_reduce([loss_sum, correct, before[2] + seen, steps.seconds, seen], ctx.device)
    return None if _diverged(cfg, ctx, stepper, totals[0], progress.step, epoch) else totals


def _diverged(cfg: LoopConfig, ctx: TrainContext, stepper: Stepper, loss: float, step: int, epoch: int) -> bool:
    """The global ``loss`` (the same on every rank) is not finite and neither are the weights, which nothing
    brings back: stop rather than spend the budget on NaNs and checkpoint them. (A lone overflowed fp16
    step is not divergence: the grad scaler skips it and the weights stay finite.)"""
    if math.isfinite(loss) or all(bool(torch.isfinite(p).all()) for p in stepper.model.parameters()):
        return False
    if ctx.rank == 0:
        print(f"[{cfg.stage}] diverged: the training loss is {loss} at step {step} (epoch {epoch + 1}) and the "
              f"weights are no longer finite; stopping without a checkpoint", flush=True)
    return True


def _epoch_metrics(stepper: Stepper, totals: list, epoch: int, step: int, elapsed: float, ranks: int) -> dict:
    loss_sum, correct, seen, waited, timed = totals
    return {"epoch": epoch + 1, "step": step, "train_loss": loss_sum / max(seen, 1),
            "train_top1": correct / max(seen, 1), "lr": stepper.lr(),
            "images_per_s": timed / max(elapsed, 1e-9), "epoch_time_s": elapsed, "input_wait_s": waited / ranks,
            "input_wait_share": waited / ranks / max(elapsed, 1e-9)}


def _evaluate(cfg: LoopConfig, ctx: TrainContext, stepper: Stepper, val_loader) -> dict:
    """Val loss and top-1 of the raw weights and, with EMA on, of the EMA weights (``*_ema``)."""
    metrics = evaluate_split(unwrap(stepper.model), val_loader, amp=cfg.amp, device=ctx.device)
    if stepper.ema is not None:
        metrics.update(evaluate_split(stepper.ema.module, val_loader, amp=cfg.amp, device=ctx.device, suffix="_ema"))
    return metrics


def _log_step(cfg: LoopConfig, ctx: TrainContext, logger, step: int, loss_sum: torch.Tensor, samples: int,
              stepper: Stepper) -> float | None:
    """Every ``log_every_steps``: the step's mean loss over the global batch (all ranks join the
    all-reduce, rank 0 logs), returned; None on other steps. The only host sync inside an epoch
    (besides a mid-epoch checkpoint's), and no device work on the other steps."""
    if step % cfg.log_every_steps and step != 1:
        return None
    global_loss = _all_reduce([loss_sum], ctx.device)[0] / (samples * ctx.world_size)
    if logger:
        metrics = {"train_loss_step": global_loss, "lr_step": stepper.lr()}
        if stepper.grad_norm is not None:  # after DDP's all-reduce: the same on every rank
            metrics["grad_norm_step"] = stepper.grad_norm.item()
        logger.log_metrics(metrics, step=step)
    return global_loss


def _print_within(cfg: LoopConfig, progress: Progress, loss: float, images_per_s: float, wait_share: float,
                  eta: float) -> None:
    print(f"[{cfg.stage}] epoch {progress.epoch + 1}/{_epochs(cfg, progress)} "
          f"step {progress.batch_in_epoch}/{cfg.steps_per_epoch} loss {loss:.4f} | "
          f"{images_per_s:.0f} img/s | input wait {wait_share:.0%} | ETA {_fmt_time(eta)}", flush=True)


def _print_epoch(cfg: LoopConfig, metrics: dict, epochs: int, eta: float) -> None:
    val = "".join(f" {k} {metrics[k]:.4f}" for k in ("val_loss", "val_top1", "val_top1_ema") if k in metrics)
    wait = metrics["input_wait_share"]
    print(f"[{cfg.stage}] epoch {metrics['epoch']}/{epochs} step {metrics['step']} "
          f"loss {metrics['train_loss']:.4f} top1 {metrics['train_top1']:.4f}{val} | "
          f"{metrics['images_per_s']:.0f} img/s | input wait {wait:.0%} | "
          f"{metrics['epoch_time_s']:.1f}s/epoch | ETA {_fmt_time(eta)}",
          flush=True)

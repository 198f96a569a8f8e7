"""The per-worker training loop run by Ray Train's ``TorchTrainer`` (one process per rank).

Rank 0 prints one line per epoch, logs metrics into the stage's MLflow run (created by the
driver) and attaches full-state checkpoints to ``ray.train.report``; every rank restores from
``ray.train.get_checkpoint()`` after a worker failure or when an interrupted run is re-launched.
"""
from __future__ import annotations

import itertools
import logging
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipeline.data import make_eval_loader, make_train_loader
from pipeline.model import ViTConfig, VisionTransformer
from pipeline.train.checkpoint import Progress, restore, save_and_report, unwrap
from pipeline.train.optim import accumulation, build_optimizer
from pipeline.train.recipe import amp_dtype, autocast, batch_mixer, make_ema, soft_cross_entropy


def _all_reduce(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate_split(net: torch.nn.Module, cfg: dict, split: str, *, rank: int, world: int,
                   device: torch.device, prefix: str = "") -> dict[str, float]:
    """Loss and top-1 over every sample of ``split`` exactly once across ranks (sums all-reduced)."""
    was_training = net.training
    net.eval()
    loss_sum = correct = count = 0.0
    for images, labels in make_eval_loader(cfg["shard_dir"], split, batch_size=cfg["per_worker_batch"],
                                           image_size=cfg["image_size"], rank=rank, world_size=world,
                                           augment=cfg["augment"]):
        images, labels = images.to(device), labels.to(device)
        with autocast(device, amp_dtype(cfg["amp"], device)):
            logits = net(images).float()
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(-1) == labels).sum().item()
        count += labels.numel()
    loss_sum, correct, count = _all_reduce([loss_sum, correct, count], device)
    net.train(was_training)
    return {f"{split}_loss{prefix}": loss_sum / max(count, 1), f"{split}_top1{prefix}": correct / max(count, 1)}


def _fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _maybe_fail(cfg: dict, step: int, rank: int, world: int) -> None:
    """Failure injection for the fault-tolerance tests: once per marker file, on the last rank."""
    fault = cfg.get("fault")
    if not fault or step != fault["step"] or rank != world - 1 or Path(fault["marker"]).exists():
        return
    Path(fault["marker"]).write_text(f"failed at step {step}\n")
    time.sleep(5)  # let Ray Train's controller collect the last report (it polls every 2 s)
    if fault.get("mode") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected failure at step {step}")


def _seed(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def train_loop_per_worker(cfg: dict) -> None:
    if not cfg.get("verbose"):
        logging.getLogger().setLevel(logging.WARNING)  # Ray Train's per-report INFO lines
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    _seed(cfg["seed"] * 1000 + rank)

    model = VisionTransformer(ViTConfig.from_dict(cfg["model"]))
    model.load_state_dict(ray.get(cfg["init_ref"]))
    model = ray.train.torch.prepare_model(model)
    steps, epochs = cfg["steps_per_epoch"], cfg["epochs"]
    micro, accum = accumulation(cfg["per_worker_batch"], cfg.get("max_worker_batch"))
    optimizer, scheduler = build_optimizer(
        model, lr=cfg["lr"], weight_decay=cfg["weight_decay"], min_lr=cfg["min_lr"],
        warmup_steps=cfg["warmup_steps"], total_steps=steps * epochs, layer_decay=cfg.get("layer_decay"))
    dtype = amp_dtype(cfg["amp"], device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ema = make_ema(unwrap(model), cfg.get("ema_decay"))
    mixer = batch_mixer(cfg["mixup_alpha"], cfg["cutmix_alpha"], cfg["model"]["num_classes"])
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "ema": ema}

    progress = restore(objects, rank=rank) or Progress()
    if progress.step and rank == 0:
        print(f"[{cfg['stage']}] resumed from checkpoint: epoch {progress.epoch}, "
              f"batch {progress.batch_in_epoch}, step {progress.step}", flush=True)
    logger = None
    if rank == 0 and cfg.get("run_id"):
        from pipeline.tracking import RunLogger
        logger = RunLogger(cfg["tracking_uri"], cfg["run_id"])
    extra = {"config": cfg["model"], "train_config": {k: v for k, v in cfg.items() if k != "init_ref"}}

    run_start, start_step = time.time(), progress.step
    for epoch in range(progress.epoch, epochs):
        model.train()
        t0 = time.time()
        loss_sum = correct = seen = 0.0
        loader = make_train_loader(cfg["shard_dir"], batch_size=cfg["per_worker_batch"],
                                   image_size=cfg["image_size"], steps_per_epoch=steps, rank=rank,
                                   world_size=world, epoch=epoch, seed=cfg["seed"], augment=cfg["augment"])
        batches = itertools.islice(loader, progress.batch_in_epoch, None)  # mid-epoch resume
        for b, (images, labels) in enumerate(batches, start=progress.batch_in_epoch):
            _maybe_fail(cfg, progress.step, rank, world)
            images, labels = images.to(device), labels.to(device)
            targets = labels
            if mixer is not None:
                images, targets = mixer(images, labels)
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for i in range(accum):
                sl = slice(i * micro, (i + 1) * micro)
                sync = model.no_sync() if (accum > 1 and i < accum - 1 and hasattr(model, "no_sync")) \
                    else torch.enable_grad()
                with sync, autocast(device, dtype):
                    logits = model(images[sl]).float()
                    loss = soft_cross_entropy(logits, targets[sl], cfg["label_smoothing"])
                scaler.scale(loss / accum).backward()
                step_loss += loss.item() / accum
                loss_sum += loss.item() * logits.shape[0]
                correct += (logits.argmax(-1) == labels[sl]).sum().item()
            if cfg["grad_clip"]:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            if ema is not None:
                ema.update_parameters(unwrap(model))
            seen += labels.numel()
            progress.step += 1
            progress.batch_in_epoch = b + 1
            if progress.step % cfg["log_every_steps"] == 0 or progress.step == 1:
                # mean over the global batch: every rank joins the all-reduce, rank 0 logs it
                global_loss = _all_reduce([step_loss], device)[0] / world
                if logger:
                    logger.log_metrics({"train_loss_step": global_loss, "lr_step": scheduler.get_last_lr()[0]},
                                       step=progress.step)
            every = cfg.get("checkpoint_every_steps")
            if every and progress.step % every == 0 and progress.batch_in_epoch < steps:
                save_and_report({"step": progress.step, "epoch": epoch}, rank=rank, objects=objects,
                                progress=progress, extra=extra)

        loss_sum, correct, seen = _all_reduce([loss_sum, correct, seen], device)
        elapsed = time.time() - t0
        metrics = {"epoch": epoch + 1, "step": progress.step, "train_loss": loss_sum / max(seen, 1),
                   "train_top1": correct / max(seen, 1), "lr": scheduler.get_last_lr()[0],
                   "images_per_s": seen / max(elapsed, 1e-9), "epoch_time_s": elapsed}
        if (epoch + 1) % cfg["eval_every"] == 0 or epoch + 1 == epochs:
            metrics.update(evaluate_split(unwrap(model), cfg, "val", rank=rank, world=world, device=device))
            if ema is not None:
                metrics.update(evaluate_split(ema.module, cfg, "val", rank=rank, world=world, device=device,
                                              prefix="_ema"))
        progress.history.append(metrics)
        progress.epoch, progress.batch_in_epoch = epoch + 1, 0
        if rank == 0:
            done_steps = max(1, progress.step - start_step)
            eta = (time.time() - run_start) / done_steps * (epochs * steps - progress.step)
            val = "".join(f" {k} {metrics[k]:.4f}" for k in ("val_loss", "val_top1", "val_top1_ema") if k in metrics)
            print(f"[{cfg['stage']}] epoch {epoch + 1}/{epochs} step {progress.step} loss {metrics['train_loss']:.4f} "
                  f"top1 {metrics['train_top1']:.4f}{val} | {metrics['images_per_s']:.0f} img/s "
                  f"| {elapsed:.1f}s/epoch | ETA {_fmt_time(eta)}", flush=True)
            if logger:
                logger.log_metrics({k: v for k, v in metrics.items() if k not in ("epoch", "step")},
                                   step=progress.step)
        save_and_report(metrics, rank=rank, objects=objects, progress=progress, extra=extra)

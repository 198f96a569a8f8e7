"""The per-worker training loop run by Ray Train's ``TorchTrainer`` (one process per rank).

Rank 0 prints one line per epoch, logs metrics to the stage's MLflow run and reports full-state
checkpoints; every rank restores from ``ray.train.get_checkpoint()`` after a failure or restart.
"""
from __future__ import annotations

import logging
import os
import random
import tempfile
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
from pipeline.train.optim import build_optimizer

STATE_FILE = "state.pt"


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def _all_reduce(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def evaluate_split(model, shard_dir: str, split: str, *, cfg: dict, rank: int, world: int,
                   device: torch.device) -> dict[str, float]:
    """Loss and top-1 over every sample of ``split`` exactly once across ranks."""
    net = _unwrap(model)
    was_training = net.training
    net.eval()
    loss_sum = correct = count = 0.0
    loader = make_eval_loader(shard_dir, split, batch_size=cfg["per_worker_batch"], image_size=cfg["image_size"],
                              rank=rank, world_size=world, augment=cfg["augment"])
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        logits = net(images)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(-1) == labels).sum().item()
        count += labels.numel()
    loss_sum, correct, count = _all_reduce([loss_sum, correct, count], device)
    net.train(was_training)
    return {f"{split}_loss": loss_sum / max(count, 1), f"{split}_top1": correct / max(count, 1)}


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _fmt_time(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train_loop_per_worker(cfg: dict) -> None:
    if not cfg.get("verbose"):
        logging.getLogger().setLevel(logging.WARNING)  # Ray Train's per-report INFO lines
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    torch.manual_seed(cfg["seed"] + rank)
    np.random.seed(cfg["seed"] + rank)
    random.seed(cfg["seed"] + rank)

    model = VisionTransformer(ViTConfig.from_dict(cfg["model"]))
    model.load_state_dict(ray.get(cfg["init_ref"]))
    model = ray.train.torch.prepare_model(model)
    steps, epochs = cfg["steps_per_epoch"], cfg["epochs"]
    optimizer, scheduler = build_optimizer(
        model, lr=cfg["lr"], weight_decay=cfg["weight_decay"], min_lr=cfg["min_lr"],
        warmup_steps=cfg["warmup_steps"], total_steps=steps * epochs)

    start_epoch, step, history = 0, 0, []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / STATE_FILE, map_location="cpu", weights_only=False)
        _unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, step, history = state["epoch"], state["step"], state["history"]
        _set_rng_state(state["rng"][rank] if rank < len(state["rng"]) else state["rng"][0])
        if rank == 0:
            print(f"[{cfg['stage']}] resumed from checkpoint at epoch {start_epoch}, step {step}", flush=True)

    logger = None
    if rank == 0 and cfg.get("run_id"):
        from pipeline.tracking import RunLogger
        logger = RunLogger(cfg["tracking_uri"], cfg["run_id"])

    fail_at = int(os.environ.get("VIT_FAIL_AT_STEP", "-1"))  # failure injection for the resume tests
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg["label_smoothing"])
    run_start = time.time()
    for epoch in range(start_epoch, epochs):
        model.train()
        t0 = time.time()
        loss_sum = correct = seen = 0.0
        loader = make_train_loader(cfg["shard_dir"], batch_size=cfg["per_worker_batch"],
                                   image_size=cfg["image_size"], steps_per_epoch=steps, rank=rank,
                                   world_size=world, epoch=epoch, seed=cfg["seed"], augment=cfg["augment"])
        for images, labels in loader:
            if step == fail_at and rank == world - 1 and not checkpoint:
                raise RuntimeError(f"injected failure at step {step} (VIT_FAIL_AT_STEP)")
            images, labels = images.to(device), labels.to(device)
            logits = model(images)
            loss = criterion(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if cfg["grad_clip"]:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            optimizer.step()
            scheduler.step()
            step += 1
            loss_sum += loss.item() * labels.numel()
            correct += (logits.argmax(-1) == labels).sum().item()
            seen += labels.numel()
        loss_sum, correct, seen = _all_reduce([loss_sum, correct, seen], device)
        elapsed = time.time() - t0
        metrics = {"epoch": epoch + 1, "step": step, "train_loss": loss_sum / max(seen, 1),
                   "train_top1": correct / max(seen, 1), "lr": scheduler.get_last_lr()[0],
                   "images_per_s": seen / max(elapsed, 1e-9), "epoch_time_s": elapsed}
        if (epoch + 1) % cfg["eval_every"] == 0 or epoch + 1 == epochs:
            metrics.update(evaluate_split(model, cfg["shard_dir"], "val", cfg=cfg, rank=rank, world=world,
                                          device=device))
        history.append(metrics)
        rngs = [None] * world
        if dist.is_available() and dist.is_initialized():
            dist.all_gather_object(rngs, _rng_state())
        else:
            rngs = [_rng_state()]
        if rank == 0:
            done = epoch + 1 - start_epoch
            eta = (time.time() - run_start) / done * (epochs - epoch - 1)
            val = f" val_loss {metrics['val_loss']:.4f} val_top1 {metrics['val_top1']:.4f}" if "val_top1" in metrics else ""
            print(f"[{cfg['stage']}] epoch {epoch + 1}/{epochs} loss {metrics['train_loss']:.4f} "
                  f"top1 {metrics['train_top1']:.4f}{val} | {metrics['images_per_s']:.0f} img/s "
                  f"| {elapsed:.1f}s/epoch | ETA {_fmt_time(eta)}", flush=True)
            if logger:
                logger.log_metrics({k: v for k, v in metrics.items() if k != "epoch"}, step=epoch + 1)
            state = {"model": _unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "epoch": epoch + 1, "step": step,
                     "history": history, "rng": rngs, "config": cfg["model"], "train_config":
                     {k: v for k, v in cfg.items() if k != "init_ref"}}
            with tempfile.TemporaryDirectory() as tmp:
                torch.save(state, Path(tmp) / STATE_FILE)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        else:
            ray.train.report(metrics, checkpoint=None)

"""Optimiser and schedule: AdamW without decay on norms/biases/embeddings, warmup + cosine per step,
optional layer-wise learning-rate decay (fine-tuning: early blocks move less than the head)."""
from __future__ import annotations

import functools
import math
import re

import torch
from torch import nn

NO_DECAY_NAMES = ("pos_embed", "cls_token")


def layer_id(name: str, depth: int) -> int:
    """0 for the embeddings, i + 1 for block i, depth + 1 for the final norm and head."""
    if name.startswith(("cls_token", "pos_embed", "patch_embed")):
        return 0
    m = re.match(r"blocks\.(\d+)\.", name)
    return int(m.group(1)) + 1 if m else depth + 1


def param_groups(model: nn.Module, weight_decay: float, layer_decay: float | None = None) -> list[dict]:
    """Matrices decay; 1-d params (norms, biases), pos-embed and [CLS] do not.

    With ``layer_decay`` each group also carries ``lr_scale = layer_decay ** (depth + 1 - layer)``.
    """
    depth = len(getattr(model, "blocks", []))
    groups: dict[tuple[bool, int], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        no_decay = p.ndim <= 1 or any(n in name for n in NO_DECAY_NAMES)
        layer = layer_id(name, depth) if layer_decay else 0
        scale = layer_decay ** (depth + 1 - layer) if layer_decay else 1.0
        g = groups.setdefault((no_decay, layer), {"params": [], "weight_decay": 0.0 if no_decay else weight_decay,
                                                   "lr_scale": scale})
        g["params"].append(p)
    return list(groups.values())


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, base_lr: float, min_lr: float) -> float:
    """Learning-rate multiplier at ``step`` (LambdaLR convention: returns lr / base_lr)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    floor = min_lr / base_lr
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def fused_ok(groups: list[dict]) -> bool:
    """Whether torch's fused AdamW kernel applies: one pass over all parameters instead of ~10
    ops per tensor (a ViT-Ti optimizer step drops from ~33 to ~11 ms on one CPU core)."""
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, min_lr: float,
                    warmup_steps: int, total_steps: int, layer_decay: float | None = None):
    groups = param_groups(model, weight_decay, layer_decay)
    for g in groups:
        g["lr"] = lr * g["lr_scale"]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), fused=fused_ok(groups) or None)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, functools.partial(warmup_cosine, warmup_steps=warmup_steps, total_steps=total_steps,
                               base_lr=lr, min_lr=min_lr))
    return opt, sched


def set_total_steps(scheduler: torch.optim.lr_scheduler.LambdaLR, total_steps: int) -> None:
    """Give :func:`build_optimizer`'s schedule another length (a time budget's plan), the learning
    rate of the next step included."""
    scheduler.lr_lambdas = [functools.partial(f.func, *f.args, **{**f.keywords, "total_steps": total_steps})
                            for f in scheduler.lr_lambdas]
    scheduler.last_epoch -= 1  # step() counts it again: the next step's rates, by the new length
    scheduler.step()


def accumulation(per_worker_batch: int, max_worker_batch: int | None) -> tuple[int, int]:
    """(micro batch, accumulation steps): the smallest accumulation whose micro batch fits."""
    if not max_worker_batch or per_worker_batch <= max_worker_batch:
        return per_worker_batch, 1
    for steps in range(math.ceil(per_worker_batch / max_worker_batch), per_worker_batch + 1):
        if per_worker_batch % steps == 0:
            return per_worker_batch // steps, steps
    raise AssertionError("unreachable: steps == per_worker_batch always divides")

"""Optimiser and schedule: AdamW without decay on norms/biases/embeddings, warmup + cosine per step."""
from __future__ import annotations

import math

import torch
from torch import nn

NO_DECAY_NAMES = ("pos_embed", "cls_token")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: matrices decay; 1-d params (norms, biases), pos-embed and [CLS] do not."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or any(n in name for n in NO_DECAY_NAMES):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, base_lr: float, min_lr: float) -> float:
    """Learning-rate multiplier at ``step`` (LambdaLR convention: returns lr / base_lr)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, progress))
    floor = min_lr / base_lr
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, min_lr: float,
                    warmup_steps: int, total_steps: int):
    opt = torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, warmup_steps=warmup_steps, total_steps=total_steps,
                                     base_lr=lr, min_lr=min_lr))
    return opt, sched

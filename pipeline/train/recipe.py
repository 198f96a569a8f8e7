"""Pieces of the training recipe that wrap the plain loop: batch mixing, EMA, mixed precision."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchvision.transforms import v2


def batch_mixer(mixup_alpha: float, cutmix_alpha: float, num_classes: int):
    """torchvision's MixUp / CutMix (one of them per batch when both are on); None when off.

    The mixer turns integer labels into soft targets, so the loss takes probabilities.
    """
    ops = []
    if mixup_alpha > 0:
        ops.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
    if cutmix_alpha > 0:
        ops.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
    if not ops:
        return None
    return ops[0] if len(ops) == 1 else v2.RandomChoice(ops)


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Cross-entropy for integer or soft (mixed) targets, with label smoothing in both cases."""
    if target.ndim == 1:
        return F.cross_entropy(logits, target, label_smoothing=label_smoothing)
    n = logits.shape[-1]
    target = target * (1.0 - label_smoothing) + label_smoothing / n
    return torch.sum(-target * F.log_softmax(logits, dim=-1), dim=-1).mean()


def make_ema(model: nn.Module, decay: float | None) -> AveragedModel | None:
    """Exponential moving average of the weights (kept on the training device), or None."""
    if not decay:
        return None
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """``auto``: bf16 on GPU, full precision on CPU (bf16 matmuls are slow on most CPUs)."""
    if amp == "off" or (amp == "auto" and device.type != "cuda"):
        return None
    return torch.float16 if amp == "fp16" else torch.bfloat16


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)

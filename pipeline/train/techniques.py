"""Training techniques that wrap the plain loop: batch mixing (MixUp / CutMix), EMA of the weights,
mixed precision. (Named apart from ``pipeline/recipes.py``, which expands recipe files.)"""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.transforms import v2


def batch_mixer(mixup_alpha: float, cutmix_alpha: float, num_classes: int, prob: float = 1.0):
    """torchvision's MixUp / CutMix (one of them per batch when both are on) on a ``prob`` share of
    the batches (timm's ``mixup_prob``); None when off.

    The mixer turns integer labels into soft targets, so the loss takes probabilities; a batch left
    unmixed gets one-hot targets, so every step sees the same shapes (a CUDA graph needs that).
    """
    ops = []
    if mixup_alpha > 0:
        ops.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
    if cutmix_alpha > 0:
        ops.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
    if not ops:
        return None
    mix = ops[0] if len(ops) == 1 else v2.RandomChoice(ops)
    return mix if prob >= 1.0 else _SomeBatches(mix, prob, num_classes)


class _SomeBatches:
    """``mix`` on a ``prob`` share of the batches (drawn on the host: no device sync), one-hot otherwise."""

    def __init__(self, mix, prob: float, num_classes: int):
        self.mix, self.prob, self.num_classes = mix, prob, num_classes

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.rand(()).item() < self.prob:
            return self.mix(images, labels)
        return images, F.one_hot(labels, self.num_classes).float()


EMA_WARMUP_POWER = 2 / 3  # timm ModelEmaV3's default: decay 0.9 after ~30 updates, 0.99 after ~1,000


def ema_decay_at(updates: int, decay: float, warmup: bool) -> float:
    """The decay of update number ``updates`` (0-based): with ``warmup``, timm ModelEmaV3's
    ``1 - (1 + t) ** -power`` capped at ``decay``, so the average forgets its random start within
    the first few hundred steps instead of the ~1 / (1 - decay) steps a fixed decay needs."""
    if not warmup:
        return decay
    return min(decay, 1.0 - (1.0 + updates) ** -EMA_WARMUP_POWER)


class EMA(nn.Module):
    """Exponential moving average of a model's weights, kept on the training device.

    The update count is a Python int (saved as the module's extra state), so an update never
    waits for the GPU, unlike ``torch.optim.swa_utils.AveragedModel``'s device counter.
    :meth:`update` is :meth:`advance` (host: the count, this update's weight) then :meth:`average`
    (device); a captured step (:mod:`.graphs`) runs the two apart, reading the weight from a tensor.
    """

    def __init__(self, model: nn.Module, decay: float, warmup: bool = True):
        super().__init__()
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.warmup, self.updates = decay, warmup, 0

    def advance(self) -> float:
        """Count one update; its weight ``1 - decay``."""
        weight = 1.0 - ema_decay_at(self.updates, self.decay, self.warmup)
        self.updates += 1
        return weight

    @torch.no_grad()
    def average(self, model: nn.Module, weight: float | torch.Tensor) -> None:
        """Move the average ``weight`` of the way to ``model``'s weights. A 0-dim tensor ``weight`` is
        read on the device when the lerps run (one per tensor: foreach lerp takes a number only)."""
        mine, theirs = list(self.module.parameters()), list(model.parameters())
        if isinstance(weight, torch.Tensor):
            for a, b in zip(mine, theirs):
                a.lerp_(b, weight)
        else:
            torch._foreach_lerp_(mine, theirs, weight)
        for a, b in zip(self.module.buffers(), model.buffers()):
            a.copy_(b)

    def update(self, model: nn.Module) -> None:
        self.average(model, self.advance())

    def get_extra_state(self) -> dict:
        return {"updates": self.updates}

    def set_extra_state(self, state: dict) -> None:
        self.updates = state["updates"]


def make_ema(model: nn.Module, decay: float | None, warmup: bool = True) -> EMA | None:
    """EMA of ``model``'s weights, or None when ``decay`` is unset."""
    return EMA(model, decay, warmup) if decay else None


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """``auto``: bf16 on GPU, full precision on CPU (bf16 matmuls are slow on most CPUs)."""
    if amp == "off" or (amp == "auto" and device.type != "cuda"):
        return None
    return torch.float16 if amp == "fp16" else torch.bfloat16


def autocast(device: torch.device, dtype: torch.dtype | None, cache: bool = True):
    """``cache=False`` for a step captured as a CUDA graph (cast weights must not outlive the capture)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype, cache_enabled=cache)

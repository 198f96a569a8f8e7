"""One optimizer step on a batch, as every caller of the training step runs it: the stages' loop
(:mod:`.worker`), the benchmarks and the tests."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.config import CUDAGRAPH_MODES
from pipeline.train.checkpoint import unwrap
from pipeline.train.graphs import CapturedStep
from pipeline.train.loop_config import LoopConfig
from pipeline.train.optim import accumulation, build_optimizer
from pipeline.train.techniques import amp_dtype, autocast, batch_mixer, make_ema


class Stepper:
    """One optimizer step on a batch: mixing, gradient accumulation, AMP scaler, clipping, EMA (and the
    recipe's activation checkpointing, switched on the model here so every caller of the step gets it).
    With ``cuda_graph`` the step's device work replays as one CUDA graph (:mod:`.graphs`).

    Returns the batch's loss and correct counts as device tensors (no host sync per step)."""

    def __init__(self, model: torch.nn.Module, cfg: LoopConfig, device: torch.device):
        self.model, self.cfg, self.device = model, cfg, device
        unwrap(model).set_grad_checkpointing(cfg.grad_checkpointing)
        self.forward = torch.compile(model, mode=cfg.compile_mode) if cfg.compile else model
        # CUDA graphs replay into the same output buffers: each step must say where it begins
        self.graphed = cfg.compile and cfg.compile_mode in CUDAGRAPH_MODES and device.type == "cuda"
        self.micro, self.accum = accumulation(cfg.per_worker_batch, cfg.max_worker_batch)
        self.optimizer, self.scheduler = build_optimizer(  # the bare model: DDP's names lose "blocks.N."
            unwrap(model), lr=cfg.lr, weight_decay=cfg.weight_decay, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps,
            total_steps=cfg.steps_per_epoch * cfg.epochs, layer_decay=cfg.layer_decay)
        self.dtype = amp_dtype(cfg.amp, device)
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)
        self.ema = make_ema(unwrap(model), cfg.ema_decay, cfg.ema_warmup)
        self.mixer = batch_mixer(cfg.mixup_alpha, cfg.cutmix_alpha, cfg.model["num_classes"], cfg.mix_prob)
        self.captured = CapturedStep(self._compute, self.optimizer, device) if cfg.cuda_graph else None
        self.grad_norm: torch.Tensor | None = None  # the last step's, before clipping (with grad_clip set)

    def objects(self) -> dict:
        """Everything a checkpoint must hold to continue exactly."""
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "scaler": self.scaler, "ema": self.ema}

    def lr(self) -> float:
        """The learning rate of the next step, the schedule's own: a group's at ``lr_scale`` 1 (with
        ``layer_decay`` the head's; the first group, the embeddings', runs at ``layer_decay ** (depth + 1)``
        of it). A tensor in a graph-safe step."""
        groups = self.optimizer.param_groups
        base = next(i for i, g in enumerate(groups) if g.get("lr_scale", 1.0) == 1.0)
        return float(self.scheduler.get_last_lr()[base])

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The host's part (the mixer's draws, the EMA's count, the schedule) around the device's."""
        targets = labels
        if self.mixer is not None:
            images, targets = self.mixer(images, labels)
        ema_weight = self.ema.advance() if self.ema is not None else None
        if self.captured is not None:
            out = self.captured(images, targets, labels, ema_weight=ema_weight)
        else:
            out = self._compute(images, targets, labels, ema_weight)
        self.scheduler.step()
        return out

    def _compute(self, images: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor,
                 ema_weight: float | torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward, clipping, optimizer and EMA: device work only (a CUDA graph can hold it)."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        if self.graphed:  # one replay path per optimizer step, micro batches included (marking each micro
            torch.compiler.cudagraph_mark_step_begin()  # batch failed on an H100: see the CUDA test)
        for i in range(self.accum):
            sl = slice(i * self.micro, (i + 1) * self.micro)
            last = i == self.accum - 1
            sync = self.model.no_sync() if (not last and hasattr(self.model, "no_sync")) else torch.enable_grad()
            with sync, autocast(self.device, self.dtype, cache=self.captured is None):
                logits = self.forward(images[sl]).float()
                # integer or soft (mixed) targets, label smoothing applied to both alike
                loss = F.cross_entropy(logits, targets[sl], label_smoothing=self.cfg.label_smoothing)
            self.scaler.scale(loss / self.accum).backward()
            loss_sum += loss.detach() * logits.shape[0]
            correct += (logits.detach().argmax(-1) == labels[sl]).sum()
        if self.cfg.grad_clip:
            self.scaler.unscale_(self.optimizer)
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.ema is not None:
            self.ema.average(unwrap(self.model), ema_weight)
        return loss_sum, correct

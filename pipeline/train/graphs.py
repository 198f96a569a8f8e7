"""The whole train step as one CUDA graph (``cuda_graph: true``): forward, backward, clipping, the
optimizer and the EMA replay as one launch, so the host's part of a step is a copy of the batch
and one replay, whatever the number of kernels.

Why: a small model's step is bound by the host's kernel launches. ``compile_mode: reduce-overhead``
graphs the model's forward and backward only; the loss, clipping, AdamW and the EMA still launch
one by one, with Python around each. This captures all of it, the pattern of PyTorch's "whole
network capture" (CUDA semantics notes): a few eager warm-up steps on a side stream, one capture
into static input buffers, then a copy and a replay per step.

What a captured step needs, and what this module sets up on the first call (after any checkpoint
was restored): every value that changes from step to step lives in a device tensor the graph reads
(each group's learning rate, which the scheduler fills in place; the EMA's weight). The optimizer's
groups become ``capturable`` at the capture (torch's fused AdamW keeps its state on the device
anyway). Host-side choices (MixUp / CutMix, the EMA's count, the schedule) stay outside the graph.
On a CPU there is nothing to capture: the same graph-safe step runs eagerly, which is how the tests
check that it computes what the plain step computes.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

WARMUP_STEPS = 3  # eager steps before the capture (PyTorch's example uses 3): lazy inits, compiles, autotuning


def graph_safe(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Each group's ``lr`` as a 0-dim tensor on ``device``: the scheduler fills it in place, so a
    captured optimizer step reads the current value."""
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)


def graph_free(optimizer: torch.optim.Optimizer) -> None:
    """Undo :func:`graph_safe` (and the capture's ``capturable``) on groups restored from a
    ``cuda_graph`` run's checkpoint: a plain step continues it with float learning rates, as a plain
    run starts, rather than a tensor restored on the CPU beside the device's parameters."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"] = float(group["lr"])
        if group.get("capturable"):
            group["capturable"] = False


class CapturedStep:
    """Calls ``compute(*inputs, ema_weight)`` (the step's device work, no host sync inside) through
    one CUDA graph: :data:`WARMUP_STEPS` eager calls, then a capture, then a replay per call. Returns
    ``compute``'s tensors (static: each replay overwrites them, so read them before the next call).
    On a CPU, or before the first capture, ``compute`` runs eagerly with the same tensors."""

    def __init__(self, compute: Callable, optimizer: torch.optim.Optimizer, device: torch.device):
        self.compute, self.optimizer, self.device = compute, optimizer, device
        self.calls = 0
        self.weight: Optional[torch.Tensor] = None  # the EMA's weight of this step, read on the device
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.outputs = None

    def __call__(self, *inputs: torch.Tensor, ema_weight: Optional[float]):
        if self.weight is None:  # first call: after restore, which may replace the optimizer's groups
            graph_safe(self.optimizer, self.device)
            self.weight = torch.zeros((), dtype=torch.float32, device=self.device)
        if ema_weight is not None:
            self.weight.fill_(ema_weight)
        weight = self.weight if ema_weight is not None else None
        self.calls += 1
        if self.device.type != "cuda":
            return self.compute(*inputs, weight)
        if self.graph is None and self.calls <= WARMUP_STEPS:
            return self._on_side_stream(inputs, weight)
        if self.graph is None:
            self._capture(inputs, weight)
        for static, x in zip(self.inputs, inputs):
            static.copy_(x, non_blocking=True)
        self.graph.replay()
        return self.outputs

    def _on_side_stream(self, inputs, weight):
        """An eager warm-up step on a side stream, as the capture will run (PyTorch's recipe)."""
        side, current = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            outputs = self.compute(*inputs, weight)
        current.wait_stream(side)
        for t in outputs:
            t.record_stream(current)
        return outputs

    def _capture(self, inputs, weight) -> None:
        """Record one step into static buffers (nothing runs: the replay that follows does the step).
        Gradients start unset, so the captured backward allocates them in the graph's pool and every
        replay writes them afresh. ``thread_local``: the DataLoader's pin-memory thread keeps working."""
        self.inputs = tuple(x.clone() for x in inputs)
        self.graph = torch.cuda.CUDAGraph()
        self.optimizer.zero_grad(set_to_none=True)
        for group in self.optimizer.param_groups:  # step() refuses a capture otherwise; set only now, as
            group["capturable"] = True             # torch warns when a capturable step runs uncaptured
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.outputs = self.compute(*self.inputs, weight)

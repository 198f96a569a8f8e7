"""Full-state training checkpoints, reported to the runner and restored after a failure or restart.

A checkpoint holds everything needed to continue bit-for-bit where the run stopped: weights
(without DDP's ``module.`` prefix), optimizer, scheduler, grad scaler, EMA, position in the run
(epoch, batch within the epoch, optimizer step, the epoch's sums so far, a time budget's plan, the
epochs that resumed launches started in), per-rank RNG states, history and configs: tensors and plain
values only, which ``torch.load(weights_only=True)`` reads without running any code from the file.
"""
from __future__ import annotations

import pickle
import random
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from pipeline.train.context import STAGING_PREFIX, STAGING_SUFFIX, STATE_FILE, TrainContext


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def rng_state(device: torch.device) -> dict:
    """The rank's RNG states; on a GPU also the device's generator (dropout and drop-path draw from it)."""
    name, key, *rest = np.random.get_state()  # its key, an ndarray, as a tensor: weights_only loads no ndarray
    state = {"torch": torch.get_rng_state(), "numpy": (name, torch.from_numpy(key.astype(np.int64)), *rest),
             "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    name, key, *rest = state["numpy"]
    np.random.set_state((name, key.numpy().astype(np.uint32), *rest))
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:  # absent when the run was checkpointed on a CPU
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_rng_states(device: torch.device) -> list[dict]:
    """Every rank's RNG state, gathered so rank 0 can store them all."""
    if not (dist.is_available() and dist.is_initialized()):
        return [rng_state(device)]
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state(device))
    return states


@dataclass
class Progress:
    epoch: int = 0            # completed epochs
    batch_in_epoch: int = 0   # batches done in the current (incomplete) epoch
    step: int = 0             # optimizer steps done
    history: list = field(default_factory=list)
    epochs: Optional[int] = None  # the run's length once a time budget planned it (``.budget``)
    epoch_sums: Optional[list] = None  # the current epoch's loss sum, correct, samples so far (all ranks)
    launches: list = field(default_factory=list)  # the epochs (0-based) in which a resumed launch started


def save_and_report(metrics: dict, *, ctx: TrainContext, objects: dict, progress: Progress, extra: dict) -> None:
    """All ranks call this (Ray Train wants a report from each); rank 0 attaches the checkpoint."""
    rngs = gather_rng_states(ctx.device)
    if ctx.rank != 0:
        ctx.report(metrics, None)
        return
    state = {name: obj.state_dict() for name, obj in objects.items() if obj is not None}
    state["model"] = unwrap(objects["model"]).state_dict()
    state.update(epoch=progress.epoch, batch_in_epoch=progress.batch_in_epoch, step=progress.step,
                 history=progress.history, planned_epochs=progress.epochs, epoch_sums=progress.epoch_sums,
                 launches=progress.launches, rng=rngs, **extra)
    tmp = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, suffix=STAGING_SUFFIX, dir=ctx.staging_dir))
    try:
        write_state(state, tmp / STATE_FILE)
        ctx.report(metrics, str(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the runner moved it


# what restoring a run reads from a checkpoint (save_and_report writes them)
REQUIRED = ("model", "rng", "selection", "epoch", "batch_in_epoch", "step", "history", "planned_epochs", "epoch_sums")


class CheckpointError(ValueError):
    """A run's state.pt that is not a checkpoint this pipeline wrote (see :func:`load_state`)."""


def refused_global(exc: pickle.UnpicklingError) -> str | None:
    """The global a ``weights_only`` load refused (torch names it in both of its wordings: a global not
    allowed, and one of a blocked module such as ``posix``); None for a pickle that is only damaged."""
    found = re.search(r"GLOBAL (\S+)", str(exc))
    return found[1] if found else None


def write_state(state: dict, path: Path) -> None:
    """torch.save through a Python file: a failed write (a full disk, a read-only mount) is then the OSError
    with its errno, naming ``path``, not torch's own ``basic_ios::clear: iostream error`` (torch may raise
    its own error on closing the archive after the write failed: the OSError is that one's context)."""
    try:
        with open(path, "wb") as f:
            torch.save(state, f)
    except (OSError, RuntimeError) as exc:
        cause = exc
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        raise OSError(cause.errno, f"cannot write a checkpoint: {cause.strerror}", str(path)) from None


def load_state(checkpoint_dir: str | Path, *, mmap: bool = False) -> dict:
    """A checkpoint's state, read with ``weights_only=True`` (``mmap``: tensors mapped, not read, to check
    a file cheaply). Anyone who can write to ``ray.storage_path`` could plant a state.pt whose pickle
    runs code; one that holds anything but tensors and plain values, or that torch cannot read, or
    without a checkpoint's entries, is a :class:`CheckpointError` naming it, and the run stops there:
    it does not fall back on its own to the checkpoint before it, since a file the run did not write is
    for its owner to look at; the message says how to fall back (remove the checkpoint's folder)."""
    path = Path(checkpoint_dir) / STATE_FILE
    fix = f"remove {path.parent} to resume from the checkpoint before it"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        found = refused_global(exc)
        if found:
            raise CheckpointError(f"{path}: not a checkpoint this pipeline wrote: it holds objects other than "
                                  f"tensors ({found}); refusing to unpickle it; {fix}") from None
        raise CheckpointError(f"{path}: not a checkpoint: its pickle is damaged; {fix}") from None
    except (RuntimeError, EOFError, ValueError) as exc:
        if isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc):
            raise  # a good checkpoint too big for this machine's memory: not the file's fault
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a checkpoint: torch cannot read it ({detail}); {fix}") from None
    missing = [k for k in REQUIRED if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a checkpoint of a training run (no {', '.join(missing)}); {fix}")
    return state


def restore(objects: dict, *, ctx: TrainContext) -> Progress | None:
    """Load the run's latest checkpoint into ``objects``; None when the run starts fresh."""
    with ctx.resume_dir() as checkpoint_dir:
        if checkpoint_dir is None:
            return None
        state = load_state(checkpoint_dir)
    unwrap(objects["model"]).load_state_dict(state["model"])
    for name, obj in objects.items():
        if name != "model" and obj is not None and name in state:
            obj.load_state_dict(state[name])
    rngs = state["rng"]
    set_rng_state(rngs[ctx.rank] if ctx.rank < len(rngs) else rngs[0], ctx.device)
    return Progress(state["epoch"], state["batch_in_epoch"], state["step"], state["history"],
                    state["planned_epochs"], state["epoch_sums"], state.get("launches", []))

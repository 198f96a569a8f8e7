"""Where the training loop runs: the few things it asks of its runner.

The loop (:mod:`pipeline.train.worker`) sees a :class:`TrainContext`: its rank, the world size,
its device, a way to wrap the model for data parallelism, to report metrics with a checkpoint
directory, and the checkpoint to resume from. :class:`RayContext` is Ray Train (one process per
rank, DDP); :class:`LocalContext` runs the same loop in the current process as the only rank
(``ray.backend: local``): for debugging, and for a GPU box without Ray. Both write checkpoints
named ``checkpoint_<date>`` into the run's directory, so either can resume the other's run.
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import zipfile
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

import torch

CHECKPOINT_PREFIX = "checkpoint_"
LOCAL_SUFFIX = "_local"  # checkpoints the local runner wrote (and may prune)
STATE_FILE = "state.pt"
STAGING_PREFIX, STAGING_SUFFIX = "." + CHECKPOINT_PREFIX, ".tmp"  # a checkpoint rank 0 is writing, before report()
NODE_STAGING = "vit-pipeline-staging"  # in the node's temp dir: staging when checkpoints go to object storage
RAY_RECORD = "checkpoint_manager_snapshot.json"  # Ray Train's list of a run's checkpoints, in the run's folder


class TrainContext:
    """What the per-rank loop needs from its runner (see the module docstring)."""

    rank: int
    world_size: int
    device: torch.device
    staging_dir: str  # where rank 0 writes a checkpoint before report() (both runners set it)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        raise NotImplementedError

    def report(self, metrics: dict, checkpoint_dir: Optional[str]) -> None:
        """Every rank calls this; rank 0's ``checkpoint_dir`` (a directory in ``staging_dir`` holding
        state.pt) is kept: copied, or moved when the runner stores checkpoints on the same disk."""
        raise NotImplementedError

    def resume_dir(self) -> contextlib.AbstractContextManager[Optional[Path]]:
        """The latest checkpoint directory of this run, or None for a fresh start."""
        raise NotImplementedError

    def epoch_done(self, metrics: dict) -> None:
        """Rank 0, after each epoch (and its checkpoint, if due): the runner's own use of the epoch's
        metrics, such as a sweep trial's report to Tune; nothing by default."""


def newer_on_disk(resume_from: Optional[str], ray_checkpoint: Optional[str]) -> bool:
    """Whether the run's newest checkpoint on disk is newer than the one Ray recorded (its record lags
    behind a checkpoint written just before a kill, and misses those the local runner wrote)."""
    return bool(resume_from) and (ray_checkpoint is None or Path(resume_from).name > Path(ray_checkpoint).name)


def _fallback(resume_from: Optional[str]) -> contextlib.AbstractContextManager[Optional[Path]]:
    return contextlib.nullcontext(Path(resume_from) if resume_from else None)


class RayContext(TrainContext):
    """Ray Train's worker context. ``run_dir``: the run's folder when checkpoints are on a local disk,
    where rank 0 writes them and where a newer one than Ray's (written by the local runner, or just before
    a kill) is found; without it (object storage), rank 0 stages them in the run's folder in its temp dir."""

    def __init__(self, run_dir: Optional[str] = None):
        import ray.train
        import ray.train.torch

        ctx = ray.train.get_context()
        self.rank, self.world_size = ctx.get_world_rank(), ctx.get_world_size()
        self.device = ray.train.torch.get_device()
        self.run_dir = run_dir
        self.staging_dir = run_dir or node_staging_dir(ctx.get_experiment_name())
        if self.rank == 0:
            prepare_staging(self.staging_dir)

    def prepare_model(self, model):
        import ray.train.torch
        return ray.train.torch.prepare_model(model)

    def report(self, metrics, checkpoint_dir):
        import ray.train
        checkpoint = ray.train.Checkpoint.from_directory(checkpoint_dir) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=checkpoint,
                         checkpoint_dir_name=checkpoint_name() if checkpoint else None)

    def resume_dir(self):
        """Ray's checkpoint of the run, unless a newer complete one is on disk now: Ray restores from the
        state it recorded last, which lags behind a checkpoint written just before a kill, also when a
        lost rank restarts the worker group mid-run (a check at the stage's start misses that one)."""
        import ray.train
        checkpoint = ray.train.get_checkpoint()
        on_disk = latest_checkpoint(self.run_dir) if self.run_dir else None
        if checkpoint is None or newer_on_disk(on_disk, checkpoint.path):
            return _fallback(on_disk)
        return checkpoint.as_directory()


class LocalContext(TrainContext):
    """The only rank, in this process. Checkpoints are written in ``run_dir`` (a local directory)
    and renamed into place, never copied; it keeps the newest ``keep`` of the ones it wrote."""

    def __init__(self, run_dir: str, *, use_gpu: bool, keep: int, resume_from: Optional[str] = None,
                 on_epoch: Optional[Callable[[dict], None]] = None):
        self.rank, self.world_size = 0, 1
        self.on_epoch = on_epoch
        self.device = local_device(use_gpu)
        self.run_dir, self.keep, self.resume_from = run_dir, keep, resume_from
        self.staging_dir = run_dir
        prepare_staging(run_dir)
        # Ray's record of a run it began goes stale here, and the prune at the end may delete checkpoints it
        # names, which makes Ray refuse the folder; without it a Ray launch resumes from the newest on disk
        (Path(run_dir) / RAY_RECORD).unlink(missing_ok=True)

    def prepare_model(self, model):
        return model.to(self.device)

    def report(self, metrics, checkpoint_dir):
        if checkpoint_dir:
            Path(checkpoint_dir).rename(Path(self.run_dir) / (checkpoint_name() + LOCAL_SUFFIX))  # complete or absent
            for old in [c for c in list_checkpoints(self.run_dir) if c.endswith(LOCAL_SUFFIX)][:-self.keep]:
                shutil.rmtree(Path(self.run_dir) / old)

    def resume_dir(self):
        return _fallback(self.resume_from)

    def epoch_done(self, metrics):
        if self.on_epoch:
            self.on_epoch(metrics)


def local_device(use_gpu: bool) -> torch.device:
    """Where the local runner trains: ``cuda`` for ``ray.use_gpu``, which then must have a device."""
    if use_gpu and not torch.cuda.is_available():
        raise ValueError("ray.use_gpu: true with ray.backend: local needs a CUDA device and torch sees none "
                         "(set ray.use_gpu: false to train on the CPU)")
    return torch.device("cuda" if use_gpu else "cpu")


def node_staging_dir(run_name: str) -> str:
    """This node's staging folder for a run whose checkpoints go to object storage."""
    return str(Path(tempfile.gettempdir()) / NODE_STAGING / run_name)


def prepare_staging(staging_dir: str) -> None:
    """Rank 0, before the run's first checkpoint: the folder exists, and checkpoints that an earlier
    attempt of this run was writing here when it was killed are gone (one attempt runs at a time)."""
    Path(staging_dir).mkdir(parents=True, exist_ok=True)
    remove_staging(staging_dir)


def checkpoint_name() -> str:
    """Ray Train's own directory format, so names sort by time across both runners."""
    return CHECKPOINT_PREFIX + datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")


def is_complete(checkpoint_dir: Path) -> bool:
    """Its state.pt was written to the end (torch.save's zip ends with its directory)."""
    return zipfile.is_zipfile(checkpoint_dir / STATE_FILE)


def list_checkpoints(run_dir: str) -> list[str]:
    """Names of the complete checkpoints in a local ``run_dir``, oldest first."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if p.name.startswith(CHECKPOINT_PREFIX) and is_complete(p))


def prune_checkpoints(run_dir: str, keep: int) -> list[str]:
    """Keep the newest ``keep`` complete checkpoints of a finished run; remove older ones and any
    partial ones that interrupted attempts left behind (Ray prunes only those it tracked)."""
    kept = set(list_checkpoints(run_dir)[-keep:])
    return _remove_dirs(run_dir, lambda name: name not in kept and name.lstrip(".").startswith(CHECKPOINT_PREFIX))


def remove_staging(run_dir: str) -> list[str]:
    """Remove the checkpoints that were being written when their rank was killed (never reported)."""
    return _remove_dirs(run_dir, lambda name: name.startswith(STAGING_PREFIX) and name.endswith(STAGING_SUFFIX))


def _remove_dirs(run_dir: str, doomed: Callable[[str], bool]) -> list[str]:
    """Remove the folders of ``run_dir`` whose names ``doomed`` picks; their names, sorted."""
    root = Path(run_dir)
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and doomed(p.name)) if root.is_dir() else []
    for name in names:
        shutil.rmtree(root / name, ignore_errors=True)
    return names


def latest_checkpoint(run_dir: str) -> Optional[str]:
    """The newest checkpoint of the run, whichever runner wrote it."""
    names = list_checkpoints(run_dir)
    return str(Path(run_dir) / names[-1]) if names else None

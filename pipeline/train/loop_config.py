"""What the per-rank training loop is given: the run's recipe (hashed into the run name) and the
inputs of one launch (weights, MLflow run, where to resume), kept apart so the name stays stable."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

# Fields that do not change what is computed: a run launched again with other values continues.
# ``shard_dir`` is where the shards are, not what they hold (their sha256s are part of the run's name):
# the same shards pulled to another scratch folder, or streamed from a bucket, continue the run.
NOT_IDENTITY = ("verbose", "loader_workers", "cuda_graph", "shard_dir", "profile_steps")


@dataclass(frozen=True)
class LoopConfig:
    """A training stage's recipe (``TrainConfig``, whose fields of the same name fill these: see
    :meth:`from_train`) plus what the driver derives for the ranks. No defaults here: they live in
    ``TrainConfig`` alone."""

    stage: str
    model: dict[str, Any]            # ViTConfig.to_dict()
    shard_dir: str                   # absolute path or URL every rank can open
    steps_per_epoch: int
    per_worker_batch: int
    warmup_steps: int
    loader_workers: int
    verbose: bool
    image_size: int
    epochs: int
    lr: float
    min_lr: float
    weight_decay: float
    label_smoothing: float
    seed: int
    eval_every: int
    augment: dict[str, Any]
    max_worker_batch: Optional[int]
    layer_decay: Optional[float]
    grad_clip: Optional[float]
    mixup_alpha: float
    cutmix_alpha: float
    mix_prob: float
    ema_decay: Optional[float]
    ema_warmup: bool
    keep: str
    early_stop_patience: Optional[int]
    time_budget_minutes: Optional[float]
    amp: str
    compile: bool
    compile_mode: str
    cuda_graph: bool
    grad_checkpointing: bool
    checkpoint_every_steps: Optional[int]
    checkpoint_every_epochs: int
    log_every_steps: int
    profile_steps: Optional[int]

    @classmethod
    def from_train(cls, train: Any, **derived: Any) -> "LoopConfig":
        """The recipe fields from ``train`` (a ``TrainConfig``), the others from ``derived``."""
        shared = {f.name: getattr(train, f.name) for f in dataclasses.fields(cls) if hasattr(train, f.name)}
        return cls(**{**shared, "augment": dict(train.augment), **derived})

    def identity(self) -> dict[str, Any]:
        """The fields that define the computation (see :data:`NOT_IDENTITY`)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in NOT_IDENTITY}


@dataclass
class LoopRun:
    """One launch of a run: initial weights (a state dict, or a Ray object ref to one), the MLflow
    run rank 0 logs into, the run's folder (whose newest complete checkpoint either runner resumes
    from), and the step hooks (see :func:`pipeline.train.worker.load_step_hooks`).

    Hooks travel as importable names, not functions, because Ray ranks are other processes."""

    init_state: Any
    run_id: Optional[str] = None
    tracking_uri: Optional[str] = None
    run_dir: Optional[str] = None  # the run's folder on a local disk (checkpoints go there); None: object storage
    step_hooks: tuple[str, ...] = ()

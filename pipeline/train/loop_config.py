"""What the per-rank training loop is given: the run's recipe (hashed into the run name) and the
inputs of one launch (weights, MLflow run, where to resume), kept apart so the name stays stable."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

# Fields that do not change what is computed: a run launched again with other values continues.
NOT_IDENTITY = ("verbose", "loader_workers")


@dataclass(frozen=True)
class LoopConfig:
    stage: str
    model: dict[str, Any]            # ViTConfig.to_dict()
    shard_dir: str                   # absolute path or URL every rank can open
    image_size: int
    epochs: int
    steps_per_epoch: int
    per_worker_batch: int
    lr: float
    min_lr: float
    weight_decay: float
    warmup_steps: int
    label_smoothing: float
    seed: int
    eval_every: int
    augment: dict[str, Any] = field(default_factory=dict)
    max_worker_batch: Optional[int] = None
    layer_decay: Optional[float] = None
    grad_clip: Optional[float] = None
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    ema_decay: Optional[float] = None
    ema_warmup: bool = True
    keep: str = "last"
    early_stop_patience: Optional[int] = None
    amp: str = "auto"
    compile: bool = False
    checkpoint_every_steps: Optional[int] = None
    log_every_steps: int = 10
    loader_workers: int = 0
    verbose: bool = False

    def identity(self) -> dict[str, Any]:
        """The fields that define the computation (see :data:`NOT_IDENTITY`)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in NOT_IDENTITY}


@dataclass
class LoopRun:
    """One launch of a run: initial weights (a state dict, or a Ray object ref to one), the MLflow
    run rank 0 logs into, a checkpoint of this run to resume from when the runner has none of its
    own (written by the other runner), and the fault-injection spec of the tests."""

    init_state: Any
    run_id: Optional[str] = None
    tracking_uri: Optional[str] = None
    resume_from: Optional[str] = None
    fault: Optional[dict] = None

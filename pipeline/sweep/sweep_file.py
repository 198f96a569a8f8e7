"""A sweep file: which stage to tune, over which params.yaml keys, toward which metric, with which scheduler
and resources. Read and checked here, against params.yaml's own schema, before Ray starts: every value a
trial could be given is loaded as an override of params.yaml, so a typo or an impossible value is one
:class:`ConfigError` line naming the sweep file and the key."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import TRAINING_STAGES, ConfigError, _build, _read_yaml, flatten, load_params
from pipeline.utils import shown

# How each kind of range is written (``key: {kind: [...]}``) and what it takes.
DISTRIBUTIONS = {"choice": "a non-empty list of values", "grid": "a non-empty list of values (every one is tried)",
                 "uniform": "[low, high], low < high", "loguniform": "[low, high], 0 < low < high"}
SCHEDULERS = ("asha", "none")
# What the training loop reports each epoch that a sweep can rank trials by (``*_ema`` with ``ema_decay`` set).
METRICS = ("val_top1", "val_loss", "train_top1", "train_loss")
EMA_METRICS = ("val_top1_ema", "val_loss_ema")
MODES = ("max", "min")


@dataclass
class Scheduler:
    name: str = "asha"
    grace_period: int = 1       # epochs every trial runs before ASHA may stop it
    reduction_factor: int = 2   # ASHA keeps the best 1/reduction_factor at each rung


@dataclass
class Resources:
    """Per trial: ``workers`` ranks (1: the stage's in-process loop in the trial; more: Ray Train), each
    with ``cpus`` CPUs and ``gpus`` GPUs."""

    cpus: int = 1
    gpus: float = 0.0
    workers: int = 1


@dataclass
class Sweep:
    stage: str = ""
    space: dict[str, Any] = field(default_factory=dict)
    metric: str = "val_top1"
    mode: str | None = None         # null: max, or min for a loss
    num_samples: int = 1            # draws from the space; a grid is tried whole for each draw
    max_concurrent: int | None = None  # null: as many trials at once as the resources allow
    seed: int = 0                   # of the draws from the space: the same file draws the same trials
    scheduler: Scheduler = field(default_factory=Scheduler)
    resources: Resources = field(default_factory=Resources)
    # set by load_sweep, not read from the file: the sweep file and the params file it is checked against
    path = ""
    params_path = "params.yaml"

    @property
    def name(self) -> str:
        return Path(self.path).stem

    @property
    def total_trials(self) -> int:
        """``num_samples`` draws, each of every grid point."""
        return self.num_samples * math.prod(len(values) for spec in self.space.values()
                                            for kind, values in spec.items() if kind == "grid")

    @property
    def best_mode(self) -> str:
        return self.mode or ("min" if self.metric.endswith(("loss", "loss_ema")) else "max")

    def ray_overrides(self) -> dict[str, Any]:
        """The ray.* a trial runs with: its ranks in the trial (1: in-process), each with the resources asked."""
        r = self.resources
        return {"ray.backend": "local" if r.workers == 1 else "ray", "ray.num_workers": r.workers,
                "ray.cpus_per_worker": r.cpus, "ray.gpus_per_worker": r.gpus, "ray.use_gpu": r.gpus > 0}

    def trial_overrides(self, config: dict[str, Any]) -> dict[str, Any]:
        return {**self.ray_overrides(), **config}

    def best_overrides(self, config: dict[str, Any]) -> dict[str, Any]:
        """What reproduces a trial as a stage run: its values, and the ray.* keys that decide what it computes
        (the world size, the device) where params.yaml says otherwise."""
        base = load_params(self.params_path).ray
        ray = self.ray_overrides()
        world = 1 if ray["ray.backend"] == "local" else ray["ray.num_workers"]
        shown_ray = {}
        if world != base.world_size:
            shown_ray["ray.num_workers"] = world
        if ray["ray.use_gpu"] != base.use_gpu:
            shown_ray["ray.use_gpu"] = ray["ray.use_gpu"]
        return {**config, **shown_ray}


def allowed_key(stage: str, key: str) -> bool:
    """A fine-tune starts from the pretrained network, whose architecture is fixed: of ``model``, only
    ``drop_path_rate`` (a training setting) can change there."""
    return key.startswith(f"{stage}.") or (key.startswith("model.") and (stage == "pretrain"
                                                                        or key == "model.drop_path_rate"))


def load_sweep(path: str, params_path: str = "params.yaml") -> Sweep:
    """The sweep file, every key and value checked; a :class:`ConfigError` names ``path``."""
    try:
        raw = _read_yaml(path, missing="file not found")
        if not isinstance(raw, dict):
            raise ConfigError(f"expected a mapping (stage, space, metric, ...), got {type(raw).__name__}")
        sweep = _build(Sweep, raw, "")
        sweep.path, sweep.params_path = str(path), str(params_path)
        _check(sweep)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {str(exc).removeprefix(f'{path}: ')}") from None
    return sweep


def _check(sweep: Sweep) -> None:
    if sweep.stage not in TRAINING_STAGES:
        raise ConfigError(f"stage: {shown(sweep.stage or None)} is not valid (choose one of: "
                          f"{', '.join(TRAINING_STAGES)})")
    if sweep.scheduler.name not in SCHEDULERS:
        raise ConfigError(f"scheduler.name: {shown(sweep.scheduler.name)} is not valid (choose one of: "
                          f"{', '.join(SCHEDULERS)})")
    for key in ("num_samples", "max_concurrent", "scheduler.grace_period", "resources.cpus", "resources.workers"):
        value = _get(sweep, key)
        if value is not None and value < 1:
            raise ConfigError(f"{key}: {shown(value)} is not valid (an integer >= 1)")
    if sweep.scheduler.reduction_factor < 2:
        raise ConfigError(f"scheduler.reduction_factor: {shown(sweep.scheduler.reduction_factor)} is not valid "
                          "(an integer >= 2)")
    if sweep.resources.gpus < 0:
        raise ConfigError(f"resources.gpus: {shown(sweep.resources.gpus)} is not valid (a number >= 0)")
    if sweep.mode is not None and sweep.mode not in MODES:
        raise ConfigError(f"mode: {shown(sweep.mode)} is not valid (choose one of: {', '.join(MODES)})")
    if not sweep.space:
        raise ConfigError(f"space: is empty; name at least one {sweep.stage}.* key to tune, e.g. "
                          f"{sweep.stage}.lr: {{loguniform: [0.0001, 0.01]}}")
    params = _checked_params(sweep, {}, "resources")
    reported = METRICS + (EMA_METRICS if getattr(params, sweep.stage).ema_decay is not None else ())
    if sweep.metric not in reported:
        raise ConfigError(f"metric: {shown(sweep.metric)} is not a metric the {sweep.stage} stage reports each "
                          f"epoch (valid: {', '.join(reported)}; *_ema ones with {sweep.stage}.ema_decay set)")
    for key, spec in sweep.space.items():
        if not allowed_key(sweep.stage, key):
            raise ConfigError(f"space: {key}: not a key the {sweep.stage} stage trains with (valid: "
                              f"{sweep.stage}.*" + (", model.*" if sweep.stage == "pretrain" else
                                                    ", model.drop_path_rate") + ")")
        for value in candidates(key, spec):
            try:
                _checked_params(sweep, {key: value}, f"space: {key}")
            except ConfigError as exc:
                floats = "expected int" in str(exc) and next(iter(spec)) in ("uniform", "loguniform")
                raise ConfigError(f"{exc}; uniform and loguniform draw floats: use choice or grid for an "
                                  "integer key" if floats else str(exc)) from None


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _checked_params(sweep: Sweep, config: dict, where: str):
    """params.yaml as a trial with ``config`` would run it; its problem as one line saying ``where``."""
    try:
        return load_params(sweep.params_path, overrides=sweep.trial_overrides(config))
    except ConfigError as exc:
        problem = str(exc).removeprefix(f"{sweep.params_path}: ")
        raise ConfigError(f"{where}: {problem.removeprefix(f'{next(iter(config), None)}: ')}") from None


def candidates(key: str, spec: Any) -> list[Any]:
    """The values of one range a trial can be given: a list's items, or a range's ends and middle (a float
    there, so an integer key refuses a continuous range)."""
    kinds = ", ".join(f"{k}: {what}" for k, what in DISTRIBUTIONS.items())
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in DISTRIBUTIONS:
        raise ConfigError(f"space: {key}: {shown(spec)} is not a range; write {key}: {{KIND: VALUES}} ({kinds})")
    (kind, values), = spec.items()
    if kind in ("choice", "grid"):
        if not isinstance(values, list) or not values:
            raise ConfigError(f"space: {key}: {kind}: {shown(values)} is not valid ({DISTRIBUTIONS[kind]})")
        return values
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)] \
        if isinstance(values, list) else []
    low, high = (numbers + [math.nan, math.nan])[:2]
    if len(numbers) != 2 or len(values) != 2 or not low < high or (kind == "loguniform" and low <= 0):
        raise ConfigError(f"space: {key}: {kind}: {shown(values)} is not valid ({DISTRIBUTIONS[kind]})")
    middle = math.sqrt(low * high) if kind == "loguniform" else (low + high) / 2
    return [float(low), float(middle), float(high)]


def search_space(sweep: Sweep) -> dict[str, Any]:
    """The space as Tune's sampling objects, keyed by the params.yaml key."""
    from ray import tune

    build = {"choice": tune.choice, "grid": tune.grid_search,
             "uniform": lambda v: tune.uniform(*v), "loguniform": lambda v: tune.loguniform(*v)}
    return {key: build[kind](values) for key, spec in sweep.space.items() for kind, values in spec.items()}


def sweep_settings(sweep: Sweep) -> dict[str, Any]:
    """What the sweep's MLflow parent run logs as params: the file's settings, and each range as written."""
    flat = flatten({k: v for k, v in dataclasses.asdict(sweep).items() if k != "space"}, "sweep")
    flat["sweep.mode"] = sweep.best_mode
    return {**flat, **{f"space.{k}": f"{kind}{values}" for k, spec in sweep.space.items()
                       for kind, values in spec.items()}}

"""Typed view of ``params.yaml``.

Every stage loads its params through :func:`load_params`, which checks the whole file before any
work starts: an unknown key, a wrong type or an inconsistent size stops the stage with a
:class:`ConfigError` naming the key, the value and what would be valid.

The dataclass defaults below are the values in the repository's ``params.yaml``, so a key left out
of a params file means what the shipped file says (``tests/test_config.py`` fails if they drift).
Keys that ``params.yaml`` does not list (``ema_decay``, ``amp``, ...) have their only default here.
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from pipeline.utils import shown

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
EXPORT_FORMATS = ("safetensors", "torchscript", "onnx")
# export.opset: 17 or newer; 25 is the newest at which onnxruntime 1.31.1 (requirements.txt) loads the exported ViT
# (at 26 the export completes, then onnxruntime refuses it: INVALID_GRAPH on its Attention node). Re-check on a new pin.
ONNX_OPSETS = range(17, 26)
AMP_MODES = ("auto", "bf16", "fp16", "off")
# {pretrain,finetune}.compile_mode: torch.compile's modes; the two that CUDA-graph the step cut its launch cost on a GPU
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes above that replay the step as CUDA graphs
BACKENDS = ("ray", "local")
TRAINING_STAGES = ("pretrain", "finetune")  # also the names of their data sections (data.<stage>)
HEADS = ("auto", "new")  # finetune.head: keep the pretrained head when the classes are its own, or always new
# data.<name>.encoding: the source's bytes, decoded pixels (binary PPM), or JPEGs (the source's kept)
ENCODINGS = ("source", "raw", "jpeg")


class ConfigError(ValueError):
    """A params.yaml problem; the message names the key, the value and what is valid."""


class _NotFinite(ConfigError):
    """A float key set to nan or inf: no other type of a union would take it either, so it is the message."""


@dataclass
class DataConfig:
    """One dataset to shard (see ``pipeline.data.shard_dataset`` for the meaning of each key).

    Defaults: ``params.yaml``'s ``data.pretrain``; :data:`FRACTALS_ONLY` are read by the ``fractals``
    source only.
    """

    source: str = "fractals"
    root: Optional[str] = None
    seed: int = 0
    val_fraction: float = 0.1
    test_fraction: float = 0.2
    maxcount: int = 256
    maxsize: int = 64_000_000
    max_side: Optional[int] = None
    max_bad_fraction: float = 0.0
    encoding: str = "source"
    class_names: Optional[list[str]] = None
    image_column: Optional[str] = None  # parquet only: null reads the huggingface metadata, else "image" / "label"
    label_column: Optional[str] = None
    num_classes: int = 50
    samples_per_class: int = 60
    image_size: int = 32
    shard_tasks: Optional[int] = None

    def in_use(self) -> dict[str, Any]:
        """Its settings less those its source ignores and those that do not change the data: what runs
        log, so that two runs differ in the data params only where their data can."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if (self.source == "fractals" or k not in FRACTALS_ONLY) and k not in RUN_ONLY}


FRACTALS_ONLY = ("num_classes", "samples_per_class", "image_size")  # the generator's: DataConfig.in_use
RUN_ONLY = ("shard_tasks",)  # how the shard stage runs, not what it writes: not in dataset.json


@dataclass
class DataSection:
    pretrain: DataConfig = field(default_factory=DataConfig)
    finetune: DataConfig = field(default_factory=lambda: DataConfig(source="digits"))


@dataclass
class ModelConfig:
    """Architecture: a size preset, optionally overridden field by field (null = preset value)."""

    preset: str = "nano"
    patch_size: int = 4
    pool: str = "cls"
    drop_path_rate: float = 0.0
    weight_init: str = "timm"
    embed_dim: Optional[int] = None
    depth: Optional[int] = None
    num_heads: Optional[int] = None
    mlp_ratio: Optional[float] = None

    def overrides(self) -> dict[str, Any]:
        keys = ("embed_dim", "depth", "num_heads", "mlp_ratio")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass
class Interpolation:
    """How position embeddings (and patch kernels) are resampled to a new grid."""

    mode: str = "bicubic"
    antialias: bool = True


@dataclass
class TrainConfig:
    """Recipe of one training stage; the global batch is split evenly over Ray workers.

    Defaults: ``params.yaml``'s ``pretrain`` section.
    """

    image_size: int = 16
    epochs: int = 20
    global_batch_size: int = 64
    lr: float = 0.002
    min_lr: float = 1e-5
    weight_decay: float = 0.05
    warmup_epochs: float = 2.0
    label_smoothing: float = 0.1
    grad_clip: Optional[float] = 1.0
    seed: int = 0
    eval_every: int = 1
    augment: dict[str, Any] = field(default_factory=lambda: {"random_resized_crop": [0.8, 1.0], "hflip": 0.0})
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_prob: float = 1.0
    ema_decay: Optional[float] = None
    ema_warmup: bool = True
    keep: str = "last"
    early_stop_patience: Optional[int] = None
    time_budget_minutes: Optional[float] = None
    amp: str = "auto"
    layer_decay: Optional[float] = None
    max_worker_batch: Optional[int] = None
    checkpoint_every_steps: Optional[int] = None
    profile_steps: Optional[int] = None  # rank 0 records this many steps with torch.profiler (null: none)
    checkpoint_every_epochs: int = 1
    log_every_steps: int = 10
    compile: bool = False
    compile_mode: str = "default"
    cuda_graph: bool = False
    grad_checkpointing: bool = False


@dataclass
class FinetuneConfig(TrainConfig):
    """Fine-tuning adds the move to a new resolution / patch size and the starting weights.

    Defaults: ``params.yaml``'s ``finetune`` section (it differs from ``pretrain`` in the first three).
    """

    image_size: int = 32
    epochs: int = 40
    warmup_epochs: float = 1.0
    patch_size: Optional[int] = None
    interpolation: Interpolation = field(default_factory=Interpolation)
    init: Optional[str] = None
    init_source: str = "pipeline"
    head: str = "auto"


@dataclass
class EvaluateConfig:
    batch_size: int = 256
    resolutions: list[int] = field(default_factory=lambda: [24, 32, 40, 48])
    tta: str = "none"


@dataclass
class ExportConfig:
    formats: list[str] = field(default_factory=lambda: list(EXPORT_FORMATS))
    opset: int = 18
    num_images: int = 64
    max_abs_diff: float = 1e-4
    min_top1_agreement: float = 1.0
    registered_model_name: str = "vit-pipeline"


@dataclass
class RayConfig:
    backend: str = "ray"
    address: Optional[str] = None
    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: int = 1
    gpus_per_worker: float = 0.0
    max_failures: int = 2
    checkpoints_to_keep: int = 2
    storage_path: Optional[str] = None
    loader_workers: Optional[int] = None
    resource_wait_s: float = 600.0
    verbose: bool = False

    @property
    def world_size(self) -> int:
        """Ranks of a training run: ``num_workers``, or 1 in-process with ``backend: local``."""
        return 1 if self.backend == "local" else self.num_workers


@dataclass
class MlflowConfig:
    experiment: str = "vit-pipeline"


@dataclass
class Params:
    data: DataSection = field(default_factory=DataSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: TrainConfig = field(default_factory=TrainConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    @property
    def finetune_patch_size(self) -> int:
        """``finetune.patch_size``, or ``model.patch_size`` when it is null (0 is an error, not null)."""
        return self.model.patch_size if self.finetune.patch_size is None else self.finetune.patch_size


def tracking_uri() -> str:
    """Where runs and models go: ``$MLFLOW_TRACKING_URI``, else the repository's sqlite store."""
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


# --------------------------------------------------------------------------- generic parsing


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; ints are accepted where floats are."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except _NotFinite:
                raise
            except ConfigError:
                continue
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _build(tp, value, key)
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(tp)
            return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            return dict(value)
    elif tp is float:
        number = _float(value)
        if number is not None:
            if not math.isfinite(number):  # nan would pass every range check below (`nan <= 0` is False)
                raise _NotFinite(f"{key}: {shown(value)} is not a finite number (nan and inf are not valid values)")
            return number
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {shown(value)} ({type(value).__name__})")


def _float(value: Any) -> float | None:
    """``value`` as a float: a number (not a bool), or a string YAML 1.1 left unread ("1e-4"); else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
        try:
            return float(value)
        except ValueError:
            pass
    return None


def _build(cls: type, raw: dict, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise ConfigError(f"{path}: unknown key (valid keys in {prefix or 'the top level'}: {', '.join(names)})")
        kwargs[key] = _coerce(value, hints[key], path)
    return cls(**kwargs)


def _choice(key: str, value: Any, valid: tuple) -> None:
    if value not in valid:
        raise ConfigError(f"{key}: {shown(value)} is not valid (choose one of: {', '.join(map(str, valid))})")


def _positive(key: str, value: float, nullable: bool = False) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: {shown(value)} must be > 0{' or null' if nullable else ''}")


# What the generators take: the split (scikit-learn) seeds with data.<name>.seed + 1, below 2**32; the ranks
# seed torch with seed * 1000 + rank, below 2**64.
DATA_SEEDS, TRAINING_SEEDS = (2**32 - 1, "2**32 - 1"), (2**53, "2**53")


def _seed(key: str, value: int, bound: tuple[int, str]) -> None:
    if not 0 <= value < bound[0]:
        raise ConfigError(f"{key}: {shown(value)} must be in [0, {bound[1]})")


def _not_blank(key: str, value: Optional[str], null_means: str) -> None:
    """``''`` in a path key read as the current folder (``finetune.init: ''`` loaded ./config.json)."""
    if value is not None and not value.strip():
        raise ConfigError(f"{key}: {shown(value)} names nothing; use null ({null_means}) or a path")


def _non_negative(key: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{key}: {shown(value)} must be >= 0")


def _name(key: str, value: str, forbidden: str = "") -> None:
    """An MLflow name: not blank, none of ``forbidden`` (MLflow refuses them late, with a traceback)."""
    if not value.strip() or any(c in value for c in forbidden):
        rule = f", without {' or '.join(map(repr, forbidden))}" if forbidden else ""
        raise ConfigError(f"{key}: {shown(value)} is not a valid name (a non-empty name{rule})")


def _model_check(check, *args) -> None:
    """Run one of ``ViTConfig``'s own checks (``pipeline.model.vit_config``) with params keys as names."""
    try:
        check(*args)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def validate(p: Params) -> Params:
    """Cross-field checks that a type check alone cannot catch (local imports: config stays
    importable without torch)."""
    for name in TRAINING_STAGES:
        check_data(getattr(p.data, name), f"data.{name}")
    _check_model(p)
    _positive("ray.num_workers", p.ray.num_workers)
    for stage in TRAINING_STAGES:
        _check_training(stage, getattr(p, stage), p.ray.world_size)
        _check_cuda_graph(stage, getattr(p, stage), p.ray.world_size)
    _check_export_and_ray(p)
    return p


def check_data(d: DataConfig, key: str = "data.<name>") -> None:
    """One ``data.<name>`` section; also the shard stage's own check of a spec built in code."""
    from pipeline.data.records import check_unique
    from pipeline.data.sources import ROOTED, SOURCES
    from pipeline.data.splits import check_fraction, check_fractions

    _choice(f"{key}.source", d.source, SOURCES)
    _choice(f"{key}.encoding", d.encoding, ENCODINGS)
    if d.source in ROOTED and not d.root:
        raise ConfigError(f"{key}.root: required for source {d.source!r} (a path to the dataset)")
    if d.source not in ROOTED and d.root:
        raise ConfigError(f"{key}.root: {shown(d.root)} would be ignored: source {d.source!r} is built in; set root: "
                          f"null, or a source that reads it ({', '.join(ROOTED)})")
    try:  # the shard stage's own checks, its messages under the section's keys
        check_fractions(d.val_fraction, d.test_fraction)
        check_fraction("max_bad_fraction", d.max_bad_fraction)
        if d.class_names is not None:
            check_unique([str(c) for c in d.class_names], "class_names")
    except ValueError as exc:
        raise ConfigError(f"{key}.{exc}") from None
    for k in ("maxcount", "maxsize", "samples_per_class", "image_size"):
        _positive(f"{key}.{k}", getattr(d, k))
    _seed(f"{key}.seed", d.seed, DATA_SEEDS)
    if d.num_classes < 2:
        raise ConfigError(f"{key}.num_classes: {shown(d.num_classes)} must be >= 2 (a classifier needs two classes)")
    if d.max_side is not None:
        _positive(f"{key}.max_side", d.max_side, nullable=True)
    if d.shard_tasks is not None and d.shard_tasks < 0:
        raise ConfigError(f"{key}.shard_tasks: {shown(d.shard_tasks)} must be >= 0 (0: in the stage's own process) "
                          "or null (the Ray cluster's CPUs for a large set)")
    for k in ("image_column", "label_column"):
        if getattr(d, k) is not None and d.source != "parquet":
            raise ConfigError(f"{key}.{k}: {shown(getattr(d, k))} would be ignored: only source 'parquet' reads it; "
                              "set it to null")


def _check_model(p: Params) -> None:
    """The architecture, and every resolution the model will see divisible by its patch size."""
    from pipeline.model.vit_config import (
        LAYOUTS,
        POOLS,
        PRESETS,
        RESAMPLE_MODES,
        WEIGHT_INITS,
        check_divisible,
        check_heads,
        section_config,
    )

    _choice("model.preset", p.model.preset, tuple(PRESETS))
    _choice("model.pool", p.model.pool, POOLS)
    _choice("model.weight_init", p.model.weight_init, WEIGHT_INITS)
    _positive("model.patch_size", p.model.patch_size)
    arch = {**PRESETS[p.model.preset], **p.model.overrides()}
    for k in ("embed_dim", "depth", "num_heads"):
        _positive(f"model.{k}", arch[k])
    _model_check(check_heads, arch["embed_dim"], arch["num_heads"], "model.num_heads", "model.embed_dim")
    if not p.evaluate.resolutions:
        raise ConfigError("evaluate.resolutions: [] sweeps nothing (list one or more image sizes, e.g. "
                          f"[{p.finetune.image_size}])")
    ft_patch_key = "model.patch_size" if p.finetune.patch_size is None else "finetune.patch_size"
    _positive(ft_patch_key, p.finetune_patch_size)
    sizes = {"pretrain.image_size": (p.pretrain.image_size, p.model.patch_size, "model.patch_size"),
             "finetune.image_size": (p.finetune.image_size, p.finetune_patch_size, ft_patch_key),
             **{f"evaluate.resolutions[{i}]": (r, p.finetune_patch_size, ft_patch_key)
                for i, r in enumerate(p.evaluate.resolutions)}}
    for key, (size, patch, patch_key) in sizes.items():  # 0 divides by any patch size: positive first
        _positive(key, size)
        _model_check(check_divisible, size, patch, key, patch_key)
    try:  # the rest of the model's own checks (drop_path_rate, mlp_ratio, ...), named as params keys
        section_config(p.model, image_size=p.pretrain.image_size, num_classes=0)
    except ValueError as exc:
        raise ConfigError(f"model.{exc}") from None
    _choice("finetune.interpolation.mode", p.finetune.interpolation.mode, RESAMPLE_MODES)
    _choice("finetune.init_source", p.finetune.init_source, LAYOUTS)
    _choice("finetune.head", p.finetune.head, HEADS)


def _check_training(stage: str, t: TrainConfig, ranks: int) -> None:
    from pipeline.data.augment import resolve_augment
    from pipeline.train.selection import KEEP_CHOICES

    for k in ("epochs", "global_batch_size", "lr", "eval_every", "checkpoint_every_epochs"):
        _positive(f"{stage}.{k}", getattr(t, k))
    _seed(f"{stage}.seed", t.seed, TRAINING_SEEDS)
    for k in ("min_lr", "weight_decay", "warmup_epochs"):  # a negative LR multiplier or decay trains backwards
        _non_negative(f"{stage}.{k}", getattr(t, k))
    if t.min_lr > t.lr:  # the cosine would climb from lr to min_lr
        raise ConfigError(f"{stage}.min_lr: {t.min_lr!r} is above {stage}.lr ({t.lr!r}): the schedule would raise "
                          f"the learning rate as it decays; set {stage}.min_lr at most {stage}.lr")
    if t.grad_clip is not None:  # clip_grad_norm_ with a negative max flips every gradient
        _positive(f"{stage}.grad_clip", t.grad_clip, nullable=True)
    if not 0.0 <= t.label_smoothing < 1.0:
        raise ConfigError(f"{stage}.label_smoothing: {shown(t.label_smoothing)} must be in [0, 1)")
    _choice(f"{stage}.amp", t.amp, AMP_MODES)
    _choice(f"{stage}.compile_mode", t.compile_mode, COMPILE_MODES)
    _choice(f"{stage}.keep", t.keep, KEEP_CHOICES)
    if t.early_stop_patience is not None:
        _positive(f"{stage}.early_stop_patience", t.early_stop_patience)
    _check_time_budget(stage, t)
    for k in ("ema_decay", "layer_decay"):
        v = getattr(t, k)
        if v is not None and not 0.0 < v <= 1.0:
            raise ConfigError(f"{stage}.{k}: {shown(v)} must be in (0, 1] or null")
    for k in ("max_worker_batch", "checkpoint_every_steps", "log_every_steps", "profile_steps"):
        if getattr(t, k) is not None:
            _positive(f"{stage}.{k}", getattr(t, k))
    try:
        resolve_augment(t.augment, allow_dataset=True)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{stage}.{exc}" if str(exc).startswith("augment") else f"{stage}.augment: {exc}") from None
    if t.mixup_alpha < 0 or t.cutmix_alpha < 0:
        raise ConfigError(f"{stage}.mixup_alpha / cutmix_alpha must be >= 0 (0 turns them off)")
    if not 0.0 < t.mix_prob <= 1.0:
        raise ConfigError(f"{stage}.mix_prob: {shown(t.mix_prob)} must be in (0, 1] (the share of batches mixed)")
    if t.global_batch_size % ranks:  # ray.num_workers ranks; 1 with backend local
        raise ConfigError(f"{stage}.global_batch_size: {t.global_batch_size} is not divisible by "
                          f"ray.num_workers={ranks} (each worker gets an equal share)")


def _check_time_budget(stage: str, t: TrainConfig) -> None:
    from pipeline.train.budget import PLAN_AFTER_EPOCHS, unplanned

    if t.time_budget_minutes is None:
        return
    _positive(f"{stage}.time_budget_minutes", t.time_budget_minutes)
    if t.warmup_epochs < PLAN_AFTER_EPOCHS:
        raise ConfigError(f"{stage}.time_budget_minutes needs {stage}.warmup_epochs >= {PLAN_AFTER_EPOCHS}, "
                          f"got {shown(t.warmup_epochs)}: the run's length is fixed at the end of the warm-up, by "
                          f"the pace of its epochs after the first")
    problem = unplanned(stage, t.epochs, t.warmup_epochs, int(t.warmup_epochs))  # the driver checks it exactly
    if problem:
        raise ConfigError(problem)


def _check_cuda_graph(stage: str, t: TrainConfig, ranks: int) -> None:
    """What a step captured as one CUDA graph (``cuda_graph: true``) cannot hold."""
    if not t.cuda_graph:
        return
    clash = ("amp: fp16 (its grad scaler reads the overflow flag on the host every step)" if t.amp == "fp16" else
             "grad_checkpointing: true (the recomputation saves and restores the RNG state)" if t.grad_checkpointing
             else f"compile_mode: {t.compile_mode} (it captures CUDA graphs itself; use default)"
             if t.compile and t.compile_mode in CUDAGRAPH_MODES else
             f"{ranks} ranks (ray.num_workers; one rank only, or ray.backend: local)" if ranks > 1 else None)
    if clash:
        raise ConfigError(f"{stage}.cuda_graph: true does not go with {clash}")


def _check_export_and_ray(p: Params) -> None:
    _not_blank("finetune.init", p.finetune.init, "the pretrain stage's model")
    _not_blank("ray.address", p.ray.address, "$RAY_ADDRESS or a local Ray")
    _not_blank("ray.storage_path", p.ray.storage_path, ".ray_results")
    if not p.export.formats:
        raise ConfigError(f"export.formats: [] exports nothing (list one or more of: {', '.join(EXPORT_FORMATS)})")
    for i, f in enumerate(p.export.formats):
        _choice(f"export.formats[{i}]", f, EXPORT_FORMATS)
    if p.export.opset not in ONNX_OPSETS:
        raise ConfigError(f"export.opset: {p.export.opset} is not valid (valid: {ONNX_OPSETS[0]} to {ONNX_OPSETS[-1]}, "
                          f"the opsets the pinned onnxruntime loads)")
    _name("export.registered_model_name", p.export.registered_model_name, forbidden="/:@")  # models:/NAME@ALIAS
    _name("mlflow.experiment", p.mlflow.experiment)
    _positive("ray.cpus_per_worker", p.ray.cpus_per_worker)
    _choice("ray.backend", p.ray.backend, BACKENDS)
    from pipeline.storage import check_location, is_url

    if p.ray.storage_path:
        try:
            check_location(p.ray.storage_path, "ray.storage_path:")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if p.ray.backend == "local" and p.ray.storage_path and is_url(p.ray.storage_path):
        raise ConfigError(f"ray.storage_path: {shown(p.ray.storage_path)} with ray.backend: local: the local runner "
                          f"writes checkpoints to a local directory (null: .ray_results); object storage needs "
                          f"backend: ray")
    if p.ray.loader_workers is not None and p.ray.loader_workers < 0:
        raise ConfigError(f"ray.loader_workers: {shown(p.ray.loader_workers)} must be >= 0 (0: load in the training "
                          f"process) or null (ray.cpus_per_worker - 1)")
    _positive("evaluate.batch_size", p.evaluate.batch_size)
    from pipeline.tta import TTA_VIEWS

    _choice("evaluate.tta", p.evaluate.tta, tuple(TTA_VIEWS))
    _positive("ray.checkpoints_to_keep", p.ray.checkpoints_to_keep)
    _positive("export.num_images", p.export.num_images)
    _non_negative("export.max_abs_diff", p.export.max_abs_diff)  # else no export ever passes its check
    if not 0.0 <= p.export.min_top1_agreement <= 1.0:
        raise ConfigError(f"export.min_top1_agreement: {shown(p.export.min_top1_agreement)} must be in [0, 1] "
                          f"(the share of images whose top-1 class the format keeps)")
    for k in ("gpus_per_worker", "max_failures", "resource_wait_s"):
        _non_negative(f"ray.{k}", getattr(p.ray, k))


def yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error in one line: what is wrong and where (its message spans several)."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{getattr(exc, 'problem', None) or str(exc).splitlines()[0]}{where}"


def _read_yaml(path: str | os.PathLike, missing: str | None = None) -> Any:
    """The YAML document in ``path``. A file that is missing (``missing``: what to say then), unreadable, not
    UTF-8, not YAML, too large once its aliases are expanded, or that sets a key twice is a
    :class:`ConfigError` naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                          f"save it as UTF-8") from None
    except OSError as exc:
        why = missing if missing and isinstance(exc, FileNotFoundError) else f"cannot read it ({exc.strerror})"
        raise ConfigError(f"{path}: {why}") from None
    try:
        return safe_yaml(text, str(path))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({yaml_problem(exc)})") from None


# What aliases may add to a params file (which has a few hundred values): anchors whose lists repeat other
# aliases (an "alias bomb") expand a few lines to billions, and every walk or message of the value would.
MAX_ALIAS_VALUES = 100_000


def safe_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load(text)``, refusing what it would read silently or without bound: a key set twice,
    aliases that expand the document by more than :data:`MAX_ALIAS_VALUES` values, or nesting too deep
    (a :class:`ConfigError` starting with ``where``). Invalid YAML raises ``yaml.YAMLError``."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        sizes: dict[int, float] = {}
        if _expanded_size(node, sizes) - len(sizes) > MAX_ALIAS_VALUES:
            raise ConfigError(f"{where}: its aliases (*name) expand it by more than {MAX_ALIAS_VALUES:,} values; "
                              f"write the values out, or repeat fewer aliases")
        _check_unique_keys(node, "", where, set())
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply (lists or mappings hundreds of levels within each "
                          f"other); params nest a few levels") from None
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, float]) -> float:
    """The values in ``node`` with each alias counted as a copy of its anchor's, as a walk of the loaded
    value meets them, in one visit of each node: ``sizes`` holds the nodes counted (-1 while counting one:
    an alias within its own anchor repeats it endlessly)."""
    if id(node) in sizes:
        return sizes[id(node)] if sizes[id(node)] >= 0 else math.inf
    sizes[id(node)] = -1
    children: list = []
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    sizes[id(node)] = 1 + sum(_expanded_size(child, sizes) for child in children)
    return sizes[id(node)]


def _check_unique_keys(node: yaml.Node, key: str, path: str, seen: set[int]) -> None:
    """PyYAML keeps the last of a key set twice in one mapping without a word: the other setting would
    be silently ignored. ``seen``: nodes already walked (an alias repeats its anchor's node)."""
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[tuple[str, str], int] = {}
        for k, v in node.value:
            child = f"{key}.{k.value}" if key else str(k.value)
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                if (k.tag, k.value) in lines:
                    raise ConfigError(f"{path}: {child} is set twice (lines {lines[k.tag, k.value]} and "
                                      f"{k.start_mark.line + 1}); YAML would keep only the last: remove one")
                lines[k.tag, k.value] = k.start_mark.line + 1
            _check_unique_keys(v, child, path, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, f"{key}[{i}]", path, seen)


def apply_override(raw: dict, dotted: str, value: Any) -> None:
    """Set ``dotted`` (``pretrain.lr``) in ``raw``, adding missing sections; a part that is a value in
    ``raw`` cannot hold a key."""
    node = raw
    *parents, leaf = dotted.split(".")
    for i, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            parent = ".".join(parents[:i + 1])
            raise ConfigError(f"{dotted}: {parent} is a value, not a section: set {parent} itself")
    node[leaf] = value


PARAMS_ENV = "VIT_PARAMS"  # a params file other than ./params.yaml (a cluster job's, infra/job.sh)


def params_file() -> str:
    """The params file the stages read: ``$VIT_PARAMS``, else ``params.yaml`` in the working directory."""
    return os.environ.get(PARAMS_ENV, "params.yaml")


def load_stage_params() -> Params:
    """:func:`load_params` of :func:`params_file`; a problem with ``$VIT_PARAMS``'s file names the variable."""
    try:
        return load_params(params_file())
    except ConfigError as exc:
        raise ConfigError(f"${PARAMS_ENV}: {exc}" if PARAMS_ENV in os.environ else str(exc)) from None


def load_params(path: str | os.PathLike = "params.yaml", overrides: dict | None = None) -> Params:
    """Read, type-check and validate ``params.yaml``; raise :class:`ConfigError` on any problem."""
    path = Path(path)
    # the hint for the stages' own params.yaml, read from the working directory; a path the user named
    # (an absolute one, --params other.yaml) is simply not there
    hint = " (run from the repository root)" if path == Path("params.yaml") else ""
    raw = _read_yaml(path, missing="file not found" + hint)
    if raw is None:  # an empty file would otherwise run every stage on defaults without a word
        sections = ", ".join(f.name for f in dataclasses.fields(Params))
        raise ConfigError(f"{path}: is empty (or only comments); expected the sections {sections} "
                          f"(start from the repository's params.yaml)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections, got {type(raw).__name__}")
    for dotted, value in (overrides or {}).items():
        apply_override(raw, dotted, value)
    return params_from_dict(raw, str(path))


def params_from_dict(raw: dict, source: str) -> Params:
    """Type-check and validate params already read; a :class:`ConfigError` starts with ``source``."""
    try:
        return validate(_build(Params, raw, ""))
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def read_partial_params(path: str | os.PathLike) -> dict:
    """The sections of a partial params.yaml (a recipe, a cluster overlay); a file that cannot be read,
    is not YAML or is not a mapping of sections is a :class:`ConfigError` naming it."""
    raw = _read_yaml(path) or {}
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ConfigError(f"{path}: expected a partial params.yaml, a mapping of sections (data, model, "
                          f"pretrain, ...) each a mapping of keys")
    return raw


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """``{"pretrain.lr": 0.001, ...}`` for MLflow params and run hashes."""
    if dataclasses.is_dataclass(obj):
        obj = dataclasses.asdict(obj)
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = obj
    return out

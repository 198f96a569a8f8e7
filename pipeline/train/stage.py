"""The pretrain and finetune stages: params in, model directory + metrics + curves out.

Beside ``pipeline/evaluation.py`` and ``pipeline/exporter.py``; the machinery it drives is the rest of
``pipeline/train/``.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from pipeline import storage
from pipeline.config import Params, TrainConfig
from pipeline.data import read_dataset_info
from pipeline.data.augment import resolve_augment, with_dataset_stats
from pipeline.model import VisionTransformer, ViTConfig, build_model, convert_state_dict, load_model, save_model
from pipeline.model.io import ModelFileError, read_model_file
from pipeline.model.vit_config import LAYOUTS, section_config
from pipeline.outputs import staged_outputs
from pipeline.pipeline_run import finetune_init, trainer_of
from pipeline.plots import plot_history
from pipeline.tracking import stage_params, stage_run
from pipeline.train.checkpoint import refused_global
from pipeline.train.driver import RunSpec, TrainResult, fit, prepare_run, write_history
from pipeline.train.selection import summary as selection_summary
from pipeline.utils import (
    CONFIG_NAME,
    MODELS,
    PLOTS,
    PRETRAINED,
    atomic_write_json,
    history_path,
    metrics_path,
    trained_by,
)


def _extra_params(params: Params, recipe: TrainConfig, model: VisionTransformer, info: dict) -> dict:
    c = model.config
    return {"model_size": params.model.preset, "patch_size": c.patch_size[0], "image_size": recipe.image_size,
            "num_params": sum(p.numel() for p in model.parameters()), "world_size": params.ray.world_size,
            "global_batch_size": recipe.global_batch_size, "dataset": info.get("source"),
            "num_classes": len(info["classes"])}


def run_params(stage: str, params: Params, recipe: TrainConfig, model: VisionTransformer, info: dict) -> dict:
    """What a training stage's MLflow run logs beside the model and stage sections."""
    extra = _extra_params(params, recipe, model, info)
    return {**extra, **finetune_extra_params(params)} if stage == "finetune" else extra


def plan_stage(stage: str, params: Params, recipe: TrainConfig, model: VisionTransformer, shard_dir: str | Path,
               info: dict) -> tuple[TrainConfig, RunSpec]:
    """The stage's recipe with the dataset's mean/std filled in ("dataset" -> numbers) and its run, whose
    name covers every param its MLflow run logs: a resumed MLflow run cannot change a param, so a value
    that changes nothing computed (``finetune.init_source`` with ``init: null``) is still another run."""
    logged = stage_params(stage, params, run_params(stage, params, recipe, model, info))
    recipe = dataclasses.replace(recipe, augment=with_dataset_stats(recipe.augment, info))
    return recipe, prepare_run(stage, params.ray, recipe, model, str(shard_dir), logged=logged)


def _train_and_save(stage: str, params: Params, recipe: TrainConfig, model: VisionTransformer,
                    shard_dir: str | Path, info: dict) -> dict:
    import mlflow  # here, not at the top: benchmarks/time_to_accuracy.py imports this module without MLflow

    tags = {"dataset.manifest": storage.manifest_digest(shard_dir),
            "dataset.source": info["source"]}
    if stage == "finetune" and not params.finetune.init and (pretrained_by := trained_by(PRETRAINED)):
        tags["pretrain.run_id"] = pretrained_by  # lineage as a tag: params name the run (a resumed one keeps them)
    extra = run_params(stage, params, recipe, model, info)
    recipe, spec = plan_stage(stage, params, recipe, model, shard_dir, info)
    model_dir, metrics_file = MODELS / stage, metrics_path(stage)
    history_csv, curves_png = history_path(stage), PLOTS / f"{stage}_curves.png"
    with staged_outputs(model_dir, metrics_file, history_csv, curves_png) as out, \
            stage_run(stage, params, extra_params=extra,
                      tags=tags, resume_key=spec.run_name, system_metrics=True) as run:
        result = fit(spec, params.ray, model, run_id=run.info.run_id)
        summary = stage_summary(result)
        kept = result.selection.kept
        numbers = {k: v for k, v in selection_summary(result.selection).items()  # the loop logged wall_time_s
                   if isinstance(v, (int, float)) and k != "wall_time_s"}
        mlflow.log_metrics(numbers, step=summary["step"])  # at the last step, after the per-epoch points
        mlflow.set_tags({"kept_weights": kept["source"], "kept_reason": kept["reason"]})
        # the run that trained the weights: a re-run of a finished Ray run names that run's, so the same
        # weights publish the same config.json and DVC re-runs nothing that reads them
        meta = {**model_meta(stage, recipe, info, result.run_name), "mlflow_run_id": trainer_of(run)}
        save_model(result.model, out[model_dir], extra=meta)
        atomic_write_json(out[metrics_file], summary)
        write_history(result.history, out[history_csv])
        plot_history({stage: result.history}, out[curves_png])
        out.publish()
        for path in (metrics_file, history_csv, curves_png, model_dir / CONFIG_NAME):
            mlflow.log_artifact(str(path))
    print(f"[{stage}] done: kept epoch {summary['kept_epoch']} ({summary['kept_source']} weights, val top-1 "
          f"{summary['kept_val_top1']:.4f}) -> {model_dir}/", flush=True)
    return summary


def model_meta(stage: str, recipe: TrainConfig, info: dict, run_name: str) -> dict:
    """What config.json keeps beside the weights: what evaluate, export and predict need to feed the model."""
    aug = resolve_augment(recipe.augment)
    return {"classes": info["classes"], "image_size": recipe.image_size,
            "normalize": {k: aug[k] for k in ("mean", "std")}, "interpolation": aug["interpolation"],
            "stage": stage, "ray_run": run_name}


def stage_summary(result: TrainResult) -> dict:
    """metrics/<stage>.json: the last epoch's numbers, which weights were kept and, with a time budget,
    the length it planned (to repeat the run without one)."""
    final = result.history[-1]
    summary = {k: final[k] for k in ("epoch", "train_loss", "train_top1", "val_loss", "val_top1", "val_top1_ema",
                                     "step", "images_seen") if k in final}
    if result.planned_epochs is not None:
        summary["planned_epochs"] = result.planned_epochs
    return {**summary, **selection_summary(result.selection)}


def pretrain(params: Params) -> dict:
    """Train a ViT from scratch on the pretrain shards."""
    return _train_and_save("pretrain", params, *stage_start("pretrain", params))


def stage_start(stage: str, params: Params) -> tuple[TrainConfig, VisionTransformer, str | Path, dict]:
    """A training stage's recipe, initial model, shards and their dataset info (what a sweep trial
    starts from too)."""
    shard_dir = storage.shard_dir(stage)
    info = read_dataset_info(shard_dir)
    if stage == "pretrain":
        return params.pretrain, pretrain_start(params, len(info["classes"])), shard_dir, info
    return params.finetune, load_finetune_start(params, info["classes"]), shard_dir, info


def pretrain_start(params: Params, num_classes: int) -> VisionTransformer:
    """A fresh model from ``pretrain.seed``: the same weights, so the same run hash, on every launch."""
    torch.manual_seed(params.pretrain.seed)
    return build_model(params.model, image_size=params.pretrain.image_size, num_classes=num_classes)


def load_finetune_start(params: Params, classes: list[str],
                        pretrained: Path = PRETRAINED) -> VisionTransformer:
    """Pretrained weights (``pretrained``: the pretrain stage's model directory, unless ``finetune.init``
    names an external file or ``scratch``) moved to the fine-tune resolution/patch, with a new head for
    ``classes`` unless ``finetune.head: auto`` and they are the pretrained model's own (a fine-tune at a
    new resolution on the same data keeps what its head learnt)."""
    ft = params.finetune
    pretrained_classes = None
    if ft.init is None:
        model, meta = load_model(pretrained)
        model = as_configured(params, model, pretrained)
        pretrained_classes = meta.get("classes")
    elif ft.init == "scratch":  # ablation: the same fine-tune without pretraining, a fresh model at its geometry
        torch.manual_seed(ft.seed)
        model = build_model(params.model, image_size=ft.image_size, patch_size=params.finetune_patch_size,
                            num_classes=len(classes))
    else:
        model = _load_external(params, Path(ft.init))
    torch.manual_seed(ft.seed)
    if ft.head == "new" or pretrained_classes != list(classes):
        model.reset_classifier(len(classes))
    else:
        print(f"[finetune] keeps the pretrained head: the data has its {len(classes)} classes (finetune.head: auto)",
              flush=True)
    model.set_input_size(image_size=ft.image_size, patch_size=params.finetune_patch_size,
                         mode=ft.interpolation.mode, antialias=ft.interpolation.antialias)
    return model


# What model.* must say of a model directory a fine-tune starts from: every ViTConfig field but the geometry
# the fine-tune moves it to, the head it replaces, and drop_path_rate, a training setting with no weights.
ARCHITECTURE = tuple(f.name for f in dataclasses.fields(ViTConfig)
                     if f.name not in ("image_size", "patch_size", "num_classes", "dynamic_img_size", "drop_path_rate"))


def as_configured(params: Params, model: VisionTransformer, source: Path) -> VisionTransformer:
    """A model directory's network as params.yaml's ``model`` section describes it, which the run logs and
    hashes: its architecture must be the section's (else one line naming both), and ``drop_path_rate``, a
    training setting with no weights, is the section's."""
    c = model.config
    want = section_config(params.model, image_size=c.image_size, patch_size=c.patch_size,
                          num_classes=c.num_classes)
    differ = [k for k in ARCHITECTURE if getattr(c, k) != getattr(want, k)]
    if differ:
        raise ValueError(f"finetune.init: {source} is a model with "
                         f"{', '.join(f'{k}={getattr(c, k)!r}' for k in differ)}, but params.yaml's model section "
                         f"gives {', '.join(f'{k}={getattr(want, k)!r}' for k in differ)}: set model.* to match it "
                         "(or, for models/pretrain, run the pretrain stage again: dvc repro)")
    if c.drop_path_rate == want.drop_path_rate:
        return model
    moved = VisionTransformer(dataclasses.replace(c, drop_path_rate=want.drop_path_rate))
    moved.load_state_dict(model.state_dict())
    return moved


INIT_KINDS = "a model directory, .safetensors or .pt file"


def check_finetune_init(params: Params) -> None:
    """``finetune.init``, when it names a file, names one that is there."""
    init = params.finetune.init
    if init not in (None, "scratch") and not Path(init).exists():
        raise FileNotFoundError(f"finetune.init: {init} does not exist ({INIT_KINDS})")


def _load_external(params: Params, path: Path) -> VisionTransformer:
    """Weights from a file (ours, timm's or torchvision's key layout), built at their own patch size and
    grid; the caller then moves the model to the fine-tune resolution with the configured interpolation.

    A weights file records neither its grid's shape nor the head count: the grid is taken as square (a
    non-square one needs a model directory, whose config.json has it) and heads come from ``model.*``.
    """
    check_finetune_init(params)
    redo = f"finetune.init must name {INIT_KINDS}"
    if path.is_dir():
        return as_configured(params, load_model(path, redo=redo)[0], path)
    state = _read_weights(params, path, redo)
    model = _model_for_weights(params, path, state)
    model.load_state_dict(state)
    return model


def _layout_hint(params: Params) -> str:
    return f"is finetune.init_source={params.finetune.init_source!r} right? valid: {', '.join(LAYOUTS)}"


def _read_weights(params: Params, path: Path, redo: str) -> dict[str, torch.Tensor]:
    """A weights file's state dict in this package's key layout, without its head."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = read_model_file(path, lambda p: load_file(str(p)), redo)
    else:
        state = read_model_file(path, lambda p: _load_pt(p, redo), redo)
    state = _state_dict_of(state, path, redo)
    try:
        if params.finetune.init_source != "pipeline":
            state = convert_state_dict(state, params.finetune.init_source, drop_head=True)
    except KeyError as exc:
        raise ValueError(f"finetune.init: {path} has no {exc} ({_layout_hint(params)})") from None
    except ValueError as exc:  # keys the named layout does not have
        raise ValueError(f"finetune.init: {path}: {exc} ({_layout_hint(params)})") from None
    return {k: v for k, v in state.items() if not k.startswith("head.")}


def _model_for_weights(params: Params, path: Path, state: dict[str, torch.Tensor]) -> VisionTransformer:
    """``model.*`` at the weights' patch size and (square) grid, checked to fit them, weights not loaded."""
    layout = _layout_hint(params)
    try:
        width, _, ph, pw = state["patch_embed.proj.weight"].shape
        tokens = state["pos_embed"].shape[1] - 1
    except KeyError as exc:
        raise ValueError(f"finetune.init: {path} has no {exc} ({layout})") from None
    side = math.isqrt(tokens)
    if ph != pw or side * side != tokens:
        raise ValueError(f"finetune.init: {path} has {ph}x{pw} patches and {tokens} grid positions, but a weights "
                         "file alone is read as square patches on a square grid: give a model directory (with its "
                         f"config.json) instead ({layout})")
    model = build_model(params.model, patch_size=ph, image_size=side * ph, num_classes=0)
    if model.config.embed_dim != width:
        raise ValueError(f"finetune.init: {path} is {width} wide but model.preset={params.model.preset!r} is "
                         f"{model.config.embed_dim} wide (set model.preset / model.embed_dim to match, and num_heads: "
                         "a weights file does not record it)")
    own = model.state_dict()
    wrong = [f"{k} {list(v.shape)} vs {list(own[k].shape)}" for k, v in state.items()
             if k in own and v.shape != own[k].shape]
    missing, unexpected = sorted(own.keys() - state.keys()), sorted(state.keys() - own.keys())
    if wrong or missing or unexpected:
        found = "; ".join(f"{what} {keys[:5]}" for what, keys in
                          (("shapes (file vs model)", wrong), ("missing", missing), ("unexpected", unexpected)) if keys)
        raise ValueError(f"finetune.init: {path} does not fit model.preset={params.model.preset!r} ({found}); "
                         "set model.preset / embed_dim / depth / num_heads / mlp_ratio to match (a weights "
                         "file does not record num_heads)")
    return model


def _load_pt(path: Path, redo: str) -> object:
    """A .pt file loaded safely (tensors and containers only); a training checkpoint is not one."""
    import pickle

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if refused_global(exc) is None:  # not a pickle of other objects: bytes torch.save never wrote
            raise ModelFileError(f"{path}: cannot be loaded, the file is corrupt, incomplete or not written by "
                                 f"torch.save; {redo}") from None
        raise ModelFileError(f"{path} holds more than weights (a training checkpoint, such as a run's state.pt?), "
                             f"which is not loaded: {redo}, e.g. the stage's model directory") from None


def _state_dict_of(obj: object, path: Path, redo: str) -> dict:
    """The weights in what a file holds: a state dict, or one under ``state_dict`` / ``model`` (timm's and
    DeiT's checkpoints)."""
    for key in ("state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"finetune.init: {path} holds a {type(obj).__name__}, not a state dict of tensors; {redo}")
    return obj


def finetune(params: Params) -> dict:
    """Fine-tune the pretrained model on the finetune shards at the fine-tune resolution."""
    return _train_and_save("finetune", params, *stage_start("finetune", params))


def finetune_extra_params(params: Params) -> dict:
    """What the finetune run logs beyond its params section: the resolution it moved from, and the weights
    it started from (``finetune.init`` resolved)."""
    return {"pretrain_image_size": params.pretrain.image_size, "finetune.init": finetune_init(params)}

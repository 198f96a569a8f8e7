"""The evaluate stage: test metrics over Ray workers (each sample exactly once), per-class scores,
confusion matrix, a resolution sweep, and the pictures: curves, confusion matrix, attention maps."""
from __future__ import annotations

import copy
import csv
from pathlib import Path

import mlflow
import numpy as np
import torch

from pipeline import pipeline_run, storage
from pipeline.cluster import check_local_capacity, worker_resources
from pipeline.config import TRAINING_STAGES, Params, flatten
from pipeline.data import check_shard_files, make_eval_loader, read_dataset_info, require_classes, require_split
from pipeline.data.augment import eval_augment
from pipeline.environment import device_name
from pipeline.inference import Predictions, predict_rank, predict_split, scored_metrics, views_note
from pipeline.metrics import attention_rollout, confusion_matrix, macro_scores, per_class, predicted_class
from pipeline.model import VisionTransformer, attention_maps, load_model
from pipeline.outputs import staged_outputs
from pipeline.plots import plot_attention, plot_confusion, plot_history
from pipeline.registry import model_run_tag
from pipeline.tracking import stage_run
from pipeline.train.context import local_device
from pipeline.utils import MODELS, PLOTS, atomic_write_json, atomic_write_text, csv_text, history_path, metrics_path


def distributed_predict(model: VisionTransformer, shard_dir, split: str, params: Params, *, image_size: int,
                        normalize: dict) -> tuple[Predictions, str]:
    """:func:`predict_split` (``evaluate.tta``'s views) of ``split`` over
    ``ray.num_workers`` Ray tasks (the eval loader's exact-once split), each on its GPU with
    ``ray.use_gpu``; in this process with ``ray.backend: local``. Also what computed them: the
    device's name (the tasks' names, joined, should they differ)."""
    kwargs = {"image_size": image_size, "batch_size": params.evaluate.batch_size, "normalize": normalize,
              "tta": params.evaluate.tta}
    if params.ray.backend == "local":
        device = local_device(params.ray.use_gpu)  # a copy there: the caller's model stays on the CPU
        return predict_split(model if device.type == "cpu" else copy.deepcopy(model).to(device), shard_dir, split,
                             **kwargs), device_name(device)
    import ray

    from pipeline.cluster import ray_cluster

    world = params.ray.num_workers
    with ray_cluster(params.ray):
        state = ray.put({k: v.detach().cpu() for k, v in model.state_dict().items()})
        res = worker_resources(params.ray)
        task = ray.remote(predict_rank).options(num_cpus=res["CPU"], num_gpus=res.get("GPU", 0))
        parts = ray.get([task.remote(state, model.config.to_dict(), storage.worker_path(shard_dir), split, kwargs,
                                     rank, world) for rank in range(world)])
    return Predictions.cat([p for p, _ in parts]), ", ".join(sorted({device for _, device in parts}))


def check_exactly_once(labels: torch.Tensor, info: dict, split: str) -> None:
    """The evaluated labels must match dataset.json's per-class counts of the split."""
    expected = info.get("class_counts", {}).get(split)
    got = np.bincount(labels.numpy(), minlength=len(info["classes"])).tolist()
    if labels.numel() != info["counts"][split] or (expected is not None and got != list(expected)):
        raise RuntimeError(f"evaluated {labels.numel()} {split} samples (per class {got}); dataset.json says "
                           f"{info['counts'][split]} (per class {expected})")


def resolution_sweep(model: VisionTransformer, shard_dir, params: Params, normalize: dict) -> dict[str, float]:
    """Top-1 at each ``evaluate.resolutions`` entry (``evaluate.tta``'s views), position embeddings
    resampled as configured."""
    interp = params.finetune.interpolation
    out = {}
    for res in params.evaluate.resolutions:
        m = copy.deepcopy(model)
        m.set_input_size(image_size=res, mode=interp.mode, antialias=interp.antialias)
        scored, _ = distributed_predict(m, shard_dir, "test", params, image_size=res, normalize=normalize)
        out[str(res)] = (predicted_class(scored.logits) == scored.labels).float().mean().item()
    return out


def _read_history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def write_class_tables(confusion_csv: Path, per_class_csv: Path, classes: list[str], labels: torch.Tensor,
                       preds: torch.Tensor, scores: list[dict]) -> None:
    """Each test image's actual and predicted class, and :func:`per_class`'s scores ("nan" for a class
    neither tested nor predicted: DVC's bars skip it)."""
    pairs = zip(labels.tolist(), preds.tolist())
    atomic_write_text(confusion_csv, csv_text(["actual", "predicted"], ([classes[a], classes[p]] for a, p in pairs)))
    columns = ("precision", "recall", "f1")
    atomic_write_text(per_class_csv, csv_text(["class", *columns, "support"], (
        [s["class"], *(f"{s[k]:.6f}" for k in columns), s["support"]] for s in scores)))


def attention_figure(model: VisionTransformer, shard_dir, meta: dict, path: Path, n: int = 8) -> None:
    """Attention rollout of the first ``n`` test images, overlaid on the images."""
    normalize = eval_augment(meta)
    images, labels = next(iter(make_eval_loader(shard_dir, "test", batch_size=n, image_size=meta["image_size"],
                                                rank=0, world_size=1, augment=normalize)))
    model.eval()
    with torch.no_grad():
        preds = predicted_class(model(images))
        relevance = attention_rollout(attention_maps(model, images))
    gh, gw = model.config.grid_size
    maps = relevance.reshape(-1, gh, gw)
    low, high = maps.amin((1, 2), keepdim=True), maps.amax((1, 2), keepdim=True)
    maps = (maps - low) / (high - low + 1e-8)
    mean, std = torch.tensor(normalize["mean"])[:, None, None], torch.tensor(normalize["std"])[:, None, None]
    pics = (images * std + mean).clamp(0, 1).permute(0, 2, 3, 1).numpy()
    classes = meta["classes"]
    titles = [f"{classes[y]}→{classes[p]}" for y, p in zip(labels.tolist(), preds.tolist())]
    plot_attention(pics, maps.numpy(), titles, path)


OUTPUTS = [PLOTS / n for n in ("confusion.csv", "per_class.csv", "confusion.png", "curves.png", "attention.png")] \
    + [metrics_path("evaluate")]


def evaluate(params: Params) -> dict:
    shard_dir = storage.shard_dir("finetune")
    check_local_capacity(params.ray)
    info = read_dataset_info(shard_dir)
    require_split(shard_dir, info, "test")
    check_shard_files(shard_dir, info)
    model, meta = load_model(MODELS / "finetune")
    require_classes(shard_dir, info, MODELS / "finetune", meta["classes"])
    size, normalize, classes = meta["image_size"], eval_augment(meta), meta["classes"]
    with staged_outputs(*OUTPUTS) as out, \
            stage_run("evaluate", params, extra_params={"model_size": params.model.preset, "image_size": size,
                                                        "patch_size": model.config.patch_size[0],
                                                        "world_size": params.ray.world_size,
                                                        # the resolution sweep resizes the position grid so
                                                        **flatten(params.finetune.interpolation,
                                                                  "finetune.interpolation")},
                      tags=model_run_tag(meta)):
        scored, device = distributed_predict(model, shard_dir, "test", params, image_size=size, normalize=normalize)
        mlflow.set_tag("env.device", device)  # the test numbers' device, not this process's CPU (stage_run's)
        logits, labels = scored.logits, scored.labels
        check_exactly_once(labels, info, "test")
        metrics = scored_metrics(scored, params.evaluate.tta)
        preds = predicted_class(logits)
        matrix = confusion_matrix(preds, labels, len(classes))
        scores = per_class(matrix, classes)
        metrics.update(macro_scores(scores))
        metrics["resolution_sweep"] = resolution_sweep(model, shard_dir, params, normalize)

        write_class_tables(out[PLOTS / "confusion.csv"], out[PLOTS / "per_class.csv"], classes, labels, preds, scores)
        plot_confusion(matrix, classes, out[PLOTS / "confusion.png"])
        histories = {s: _read_history(history_path(s)) for s in TRAINING_STAGES}
        plot_history({s: h for s, h in histories.items() if h}, out[PLOTS / "curves.png"])
        attention_figure(model, shard_dir, meta, out[PLOTS / "attention.png"])
        atomic_write_json(out[metrics_path("evaluate")], metrics)
        out.publish()

        mlflow.log_metrics(pipeline_run.result_metrics("evaluate", metrics))  # the pipeline run's names
        for path in OUTPUTS:
            mlflow.log_artifact(str(path))
    tta = views_note(params.evaluate.tta, metrics.get("top1_single_view"))
    print(f"[evaluate] test top-1 {metrics['top1']:.4f}{tta}, top-5 {metrics['top5']:.4f}, loss {metrics['loss']:.4f}, "
          f"ECE {metrics['ece']:.4f} "
          f"on {metrics['num_samples']} images ({params.ray.world_size} workers); top-1 by resolution "
          f"{', '.join(f'{r} px {v:.4f}' for r, v in metrics['resolution_sweep'].items())}; pictures in {PLOTS}/",
          flush=True)
    return metrics

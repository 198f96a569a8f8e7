"""The evaluate stage: test-split metrics, confusion matrix and a resolution sweep."""
from __future__ import annotations

import copy

import mlflow
import torch
import torch.nn.functional as F

from pipeline.config import Params
from pipeline.data import make_eval_loader, read_dataset_info
from pipeline.model import VisionTransformer, load_model
from pipeline.tracking import stage_run
from pipeline.utils import METRICS, MODELS, PLOTS, SHARDS, atomic_write_json, atomic_write_text


@torch.no_grad()
def predict_split(model: VisionTransformer, shard_dir, split: str, *, image_size: int, batch_size: int,
                  normalize: dict, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels for every sample of ``split`` this rank is responsible for."""
    model.eval()
    logits, labels = [], []
    for images, y in make_eval_loader(shard_dir, split, batch_size=batch_size, image_size=image_size,
                                      rank=rank, world_size=world_size, augment=normalize):
        logits.append(model(images))
        labels.append(y)
    if not logits:
        return torch.empty(0, model.config.num_classes), torch.empty(0, dtype=torch.long)
    return torch.cat(logits), torch.cat(labels)


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    k = min(5, logits.shape[1])
    topk = logits.topk(k, dim=1).indices
    return {"top1": (topk[:, 0] == labels).float().mean().item(),
            "top5": (topk == labels[:, None]).any(1).float().mean().item(),
            "loss": F.cross_entropy(logits, labels).item(), "num_samples": int(labels.numel())}


def resolution_sweep(model: VisionTransformer, shard_dir, resolutions: list[int], *, mode: str,
                     antialias: bool, batch_size: int, normalize: dict) -> dict[str, float]:
    """Top-1 at each resolution, position embeddings resampled with the configured interpolation."""
    out = {}
    for res in resolutions:
        m = copy.deepcopy(model)
        m.set_input_size(image_size=res, mode=mode, antialias=antialias)
        logits, labels = predict_split(m, shard_dir, "test", image_size=res, batch_size=batch_size,
                                       normalize=normalize)
        out[str(res)] = (logits.argmax(1) == labels).float().mean().item()
    return out


def evaluate(params: Params) -> dict:
    shard_dir = SHARDS / "finetune"
    info = read_dataset_info(shard_dir)
    model, meta = load_model(MODELS / "finetune")
    size, normalize = meta["image_size"], meta["normalize"]
    classes = meta["classes"]
    with stage_run("evaluate", params, extra_params={"model_size": params.model.preset,
                                                     "patch_size": model.config.patch_size[0],
                                                     "image_size": size}):
        logits, labels = predict_split(model, shard_dir, "test", image_size=size,
                                       batch_size=params.evaluate.batch_size, normalize=normalize)
        metrics = classification_metrics(logits, labels)
        interp = params.finetune.interpolation
        sweep = resolution_sweep(model, shard_dir, params.evaluate.resolutions, mode=interp.mode,
                                 antialias=interp.antialias, batch_size=params.evaluate.batch_size,
                                 normalize=normalize)
        metrics["resolution_sweep"] = sweep
        preds = logits.argmax(1)
        rows = ["actual,predicted"] + [f"{classes[a]},{classes[p]}" for a, p in zip(labels.tolist(), preds.tolist())]
        atomic_write_text(PLOTS / "confusion.csv", "\n".join(rows) + "\n")
        atomic_write_json(METRICS / "evaluate.json", metrics)
        mlflow.log_metrics({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        mlflow.log_metrics({f"top1_at_{r}px": v for r, v in sweep.items()})
        mlflow.log_artifact(str(METRICS / "evaluate.json"))
        mlflow.log_artifact(str(PLOTS / "confusion.csv"))
    expected = info["counts"]["test"]
    if metrics["num_samples"] != expected:
        raise RuntimeError(f"evaluated {metrics['num_samples']} test samples, dataset.json says {expected}")
    print(f"[evaluate] test top-1 {metrics['top1']:.4f} top-5 {metrics.get('top5', float('nan')):.4f} "
          f"loss {metrics['loss']:.4f} on {metrics['num_samples']} images; sweep {sweep}", flush=True)
    return metrics

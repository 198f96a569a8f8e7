"""One rank's share of an evaluation: what the evaluate stage's Ray tasks run.

Apart from :mod:`pipeline.evaluation` so that a task's fresh process imports torch, the model and the
eval loader only, not MLflow and matplotlib (about 3 s of every process on a 2-core machine).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pipeline.data import make_eval_loader
from pipeline.data.augment import resolve_augment
from pipeline.environment import device_name
from pipeline.metrics import classification_metrics, predicted_class
from pipeline.model import VisionTransformer, ViTConfig
from pipeline.tta import TTA_VIEWS, View


def apply_view(x: torch.Tensor, view: View, black: torch.Tensor) -> torch.Tensor:
    """``view`` of a normalised batch ``x`` [B, 3, H, W]; ``black`` [1, 3, 1, 1]: a black pixel, normalised."""
    if view.dy or view.dx:
        (h, w), r = x.shape[-2:], max(abs(view.dy), abs(view.dx))
        x = F.pad(x - black, (r,) * 4)[..., r - view.dy:r - view.dy + h, r - view.dx:r - view.dx + w] + black
    return x.flip(-1) if view.mirror else x


def normalised_black(normalize: dict | None, device: torch.device) -> torch.Tensor:
    """What a black pixel is after ``normalize``'s mean / std: [1, 3, 1, 1] on ``device``."""
    cfg = resolve_augment(normalize)
    mean, std = torch.tensor(cfg["mean"], device=device), torch.tensor(cfg["std"], device=device)
    return (-mean / std).view(1, 3, 1, 1)


class Predictions(NamedTuple):
    """:func:`predict_split`'s answer, on the CPU: per sample the mean of its views' logits [N, C], its
    label [N] and the class its first view, the image alone, predicts [N] (all that is kept of the
    other views: V logits a sample would be V times the memory, at ImageNet's 50,000 x 1,000)."""
    logits: torch.Tensor
    labels: torch.Tensor
    single: torch.Tensor

    @classmethod
    def cat(cls, parts: list["Predictions"]) -> "Predictions":
        return cls(*(torch.cat(column) for column in zip(*parts)))


@torch.no_grad()
def predict_split(model: VisionTransformer, shard_dir, split: str, *, image_size: int, batch_size: int,
                  normalize: dict, tta: str = "none", rank: int = 0, world_size: int = 1) -> Predictions:
    """The samples of ``split`` that ``rank`` is responsible for, each scored by the mean of its
    ``TTA_VIEWS[tta]`` views' logits; the model runs where its weights are, in float32."""
    views, device = TTA_VIEWS[tta], next(model.parameters()).device
    black = normalised_black(normalize, device)
    model.eval()
    parts = []
    for images, y in make_eval_loader(shard_dir, split, batch_size=batch_size, image_size=image_size,
                                      rank=rank, world_size=world_size, augment=normalize, device=device):
        first = model(images).float()  # views[0]: the image itself
        mean = (first + sum(model(apply_view(images, v, black)).float() for v in views[1:])) / len(views)
        parts.append(Predictions(mean.cpu(), y.cpu(), predicted_class(first).cpu()))
    if not parts:
        return Predictions(torch.empty(0, model.config.num_classes), torch.empty(0, dtype=torch.long),
                           torch.empty(0, dtype=torch.long))
    return Predictions.cat(parts)


def scored_metrics(predictions: Predictions, tta: str) -> dict[str, float]:
    """:func:`classification_metrics` of the views' mean; with test-time views also
    ``top1_single_view``, what the image alone scores, to compare with runs without them."""
    metrics = classification_metrics(predictions.logits, predictions.labels)
    if len(TTA_VIEWS[tta]) > 1:
        metrics["top1_single_view"] = (predictions.single == predictions.labels).float().mean().item()
    return metrics


def views_note(tta: str, top1_single_view: float | None) -> str:
    """What a printed test top-1 is, beside it: nothing without a single-view figure (no test-time
    views), else the views and the image alone."""
    return "" if top1_single_view is None else f" (tta {tta}; the image alone {top1_single_view:.4f})"


def task_device() -> torch.device:
    """A Ray task's device: the GPU Ray assigned it (``num_gpus``; Ray hides the others), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def predict_rank(state: dict, config: dict, shard_dir: str, split: str, kwargs: dict, rank: int,
                 world: int) -> tuple[Predictions, str]:
    """:func:`predict_split` for ``rank`` of ``world``, the model rebuilt from its config and weights, and
    the name of the device it ran on (the task's node may not be the stage's)."""
    model = VisionTransformer(ViTConfig.from_dict(config))
    model.load_state_dict(state)
    device = task_device()
    return (predict_split(model.to(device), shard_dir, split, rank=rank, world_size=world, **kwargs),
            device_name(device))

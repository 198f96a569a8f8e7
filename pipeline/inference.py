"""One rank's share of an evaluation: what the evaluate stage's Ray tasks run.

Apart from :mod:`pipeline.evaluate` so that a task's fresh process imports torch, the model and the
eval loader only, not MLflow and matplotlib (about 3 s of every process on a 2-core machine).
"""
from __future__ import annotations

import torch

from pipeline.data import make_eval_loader
from pipeline.model import ViTConfig, VisionTransformer


@torch.no_grad()
def predict_split(model: VisionTransformer, shard_dir, split: str, *, image_size: int, batch_size: int,
                  normalize: dict, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels for the samples of ``split`` that ``rank`` is responsible for."""
    model.eval()
    logits, labels = [], []
    for images, y in make_eval_loader(shard_dir, split, batch_size=batch_size, image_size=image_size,
                                      rank=rank, world_size=world_size, augment=normalize):
        logits.append(model(images))
        labels.append(y)
    if not logits:
        return torch.empty(0, model.config.num_classes), torch.empty(0, dtype=torch.long)
    return torch.cat(logits), torch.cat(labels)


def predict_rank(state: dict, config: dict, shard_dir: str, split: str, kwargs: dict, rank: int, world: int):
    """:func:`predict_split` for ``rank`` of ``world``, the model rebuilt from its config and weights."""
    model = VisionTransformer(ViTConfig.from_dict(config))
    model.load_state_dict(state)
    return predict_split(model, shard_dir, split, rank=rank, world_size=world, **kwargs)

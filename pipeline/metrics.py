"""Pure functions from logits/labels (or attention weights) to the numbers and maps the stages report."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def predicted_class(logits: torch.Tensor) -> torch.Tensor:
    """The class each row of logits predicts: argmax, the first of tied maxima. The one rule for top-1,
    the confusion matrix, per-class scores, ECE and the resolution sweep; ``topk`` orders ties
    differently (all of a zero-initialised head's logits are tied), so it must not decide top-1."""
    return logits.argmax(-1)


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Top-1, top-5 (top-k for fewer classes), mean cross-entropy, calibration error, sample count.
    A top-1 hit is always a top-5 hit, whatever order ``topk`` gives tied logits."""
    top1 = predicted_class(logits) == labels
    topk = logits.topk(min(5, logits.shape[1]), dim=1).indices
    return {"top1": top1.float().mean().item(),
            "top5": (top1 | (topk == labels[:, None]).any(1)).float().mean().item(),
            "loss": F.cross_entropy(logits, labels).item(), "ece": expected_calibration_error(logits, labels),
            "num_samples": int(labels.numel())}


def expected_calibration_error(logits: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> float:
    """Top-label ECE (Guo et al., 2017): the predictions binned by confidence (``bins`` equal widths
    over (0, 1]), |accuracy - mean confidence| per bin, weighted by the bin's share of samples.
    0 is perfectly calibrated; label smoothing, mixup and EMA all move it, which top-1 does not show."""
    confidence = logits.float().softmax(1).amax(1)
    correct = (predicted_class(logits) == labels).float()
    which = (confidence * bins).ceil().clamp(1, bins).long() - 1  # bin b holds (b/bins, (b+1)/bins]
    count = torch.bincount(which, minlength=bins).float()
    gap = (torch.bincount(which, correct, minlength=bins) - torch.bincount(which, confidence, minlength=bins)).abs()
    return (gap.sum() / count.sum()).item()


def confusion_matrix(preds: torch.Tensor, labels: torch.Tensor, num_classes: int) -> np.ndarray:
    """``m[actual, predicted]`` counts."""
    idx = labels.long() * num_classes + preds.long()
    return torch.bincount(idx, minlength=num_classes ** 2).reshape(num_classes, num_classes).numpy()


def per_class(matrix: np.ndarray, classes: list[str]) -> list[dict]:
    """Precision, recall, F1 and support per class from a confusion matrix; 0 where a ratio is
    undefined (sklearn's zero_division=0), but NaN for all three of a class neither in the test split
    nor predicted: nothing was scored (a small split may miss classes), which a 0 would count as failed."""
    tp = np.diag(matrix).astype(float)
    predicted, actual = matrix.sum(0).astype(float), matrix.sum(1).astype(float)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, actual, out=np.zeros_like(tp), where=actual > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    unscored = (predicted == 0) & (actual == 0)
    for score in (precision, recall, f1):
        score[unscored] = np.nan
    return [{"class": c, "precision": float(p), "recall": float(r), "f1": float(f), "support": int(s)}
            for c, p, r, f, s in zip(classes, precision, recall, f1, actual)]


def macro_scores(scores: list[dict]) -> dict[str, float]:
    """``macro_precision`` / ``_recall`` / ``_f1``: :func:`per_class`'s means over the classes tested or
    predicted (as sklearn's macro average), so a class the test split lacks does not lower them."""
    return {f"macro_{k}": float(np.nanmean([s[k] for s in scores])) for k in ("precision", "recall", "f1")}


def attention_rollout(attentions: list[torch.Tensor], num_prefix_tokens: int = 1) -> torch.Tensor:
    """Abnar & Zuidema's rollout: [CLS] → patch relevance [B, N] through all layers.

    Heads are averaged, the residual path is added as identity, rows renormalised, and the
    per-layer matrices multiplied from the first layer to the last.
    """
    rollout = None
    for attn in attentions:
        a = attn.float().mean(1)
        a = a + torch.eye(a.shape[-1], device=a.device)
        a = a / a.sum(-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout
    return rollout[:, 0, num_prefix_tokens:]

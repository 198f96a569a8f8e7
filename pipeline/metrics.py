"""Pure functions from logits/labels (or attention weights) to the numbers and maps the stages report."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def classification_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Top-1, top-5 (top-k for fewer classes), mean cross-entropy, calibration error, sample count."""
    k = min(5, logits.shape[1])
    topk = logits.topk(k, dim=1).indices
    return {"top1": (topk[:, 0] == labels).float().mean().item(),
            "top5": (topk == labels[:, None]).any(1).float().mean().item(),
            "loss": F.cross_entropy(logits, labels).item(), "ece": expected_calibration_error(logits, labels),
            "num_samples": int(labels.numel())}


def expected_calibration_error(logits: torch.Tensor, labels: torch.Tensor, bins: int = 15) -> float:
    """Top-label ECE (Guo et al., 2017): the predictions binned by confidence (``bins`` equal widths
    over (0, 1]), |accuracy - mean confidence| per bin, weighted by the bin's share of samples.
    0 is perfectly calibrated; label smoothing, mixup and EMA all move it, which top-1 does not show."""
    confidence, predicted = logits.float().softmax(1).max(1)
    correct = (predicted == labels).float()
    which = (confidence * bins).ceil().clamp(1, bins).long() - 1  # bin b holds (b/bins, (b+1)/bins]
    count = torch.bincount(which, minlength=bins).float()
    gap = (torch.bincount(which, correct, minlength=bins) - torch.bincount(which, confidence, minlength=bins)).abs()
    return (gap.sum() / count.sum()).item()


def confusion_matrix(preds: torch.Tensor, labels: torch.Tensor, num_classes: int) -> np.ndarray:
    """``m[actual, predicted]`` counts."""
    idx = labels.long() * num_classes + preds.long()
    return torch.bincount(idx, minlength=num_classes ** 2).reshape(num_classes, num_classes).numpy()


def per_class(matrix: np.ndarray, classes: list[str]) -> list[dict]:
    """Precision, recall, F1 and support per class from a confusion matrix (0 where undefined)."""
    tp = np.diag(matrix).astype(float)
    predicted, actual = matrix.sum(0).astype(float), matrix.sum(1).astype(float)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, actual, out=np.zeros_like(tp), where=actual > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    return [{"class": c, "precision": float(p), "recall": float(r), "f1": float(f), "support": int(s)}
            for c, p, r, f, s in zip(classes, precision, recall, f1, actual)]


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

"""The evaluate stage's metric functions (pipeline.metrics) against direct definitions."""
from __future__ import annotations

import pytest
import torch

from pipeline.metrics import classification_metrics, expected_calibration_error


def _ece_by_definition(logits: torch.Tensor, labels: torch.Tensor, bins: int) -> float:
    probs = logits.double().softmax(1)
    conf, pred = probs.max(1)
    total = 0.0
    for b in range(bins):
        lo, hi = b / bins, (b + 1) / bins
        inside = [i for i in range(len(labels)) if lo < conf[i] <= hi]
        if inside:
            acc = sum(float(pred[i] == labels[i]) for i in inside) / len(inside)
            mean_conf = sum(float(conf[i]) for i in inside) / len(inside)
            total += len(inside) / len(labels) * abs(acc - mean_conf)
    return total


@pytest.mark.parametrize("bins", [1, 10, 15])
def test_ece_matches_its_definition(bins):
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(500, 10, generator=g) * 3, torch.randint(0, 10, (500,), generator=g)
    assert expected_calibration_error(logits, labels, bins) == pytest.approx(_ece_by_definition(logits, labels, bins),
                                                                             abs=1e-6)


def test_ece_of_certain_predictions_is_their_error_rate():
    """Confidence ~1: ECE is the share of wrong answers; all right, it is ~0."""
    labels = torch.arange(10) % 5
    logits = torch.full((10, 5), -50.0)
    logits[torch.arange(10), labels] = 50.0
    assert expected_calibration_error(logits, labels) == pytest.approx(0.0, abs=1e-6)
    logits[:3] = logits[:3].roll(1, dims=1)  # three confidently wrong
    assert expected_calibration_error(logits, labels) == pytest.approx(0.3, abs=1e-6)
    assert classification_metrics(logits, labels)["ece"] == pytest.approx(0.3, abs=1e-6)
    assert classification_metrics(logits, labels)["top1"] == pytest.approx(0.7)

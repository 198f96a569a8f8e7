"""The evaluate stage's numbers (pipeline.metrics) against direct definitions, and the files it writes."""
from __future__ import annotations

import csv
import json
import math
import shutil

import numpy as np
import pytest
import torch
from sklearn.metrics import precision_recall_fscore_support

from pipeline import plots
from pipeline.metrics import (
    classification_metrics,
    confusion_matrix,
    expected_calibration_error,
    macro_scores,
    per_class,
)
from tests.conftest import ROOT


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


def test_top1_is_the_argmax_of_tied_logits():
    """A zero-initialised head ties every logit: top-1 is argmax's class (the first), as the confusion
    matrix counts it, whatever ``topk`` puts first; a top-1 hit is a top-5 hit."""
    for classes in (3, 10, 100):
        logits, labels = torch.zeros(50, classes), torch.zeros(50, dtype=torch.long)
        m = classification_metrics(logits, labels)
        assert m["top1"] == m["top5"] == 1.0, classes
    logits = torch.tensor([[1.0, 1.0, 0, 0, 0, 0]] * 4)  # tied between classes 0 and 1
    m = classification_metrics(logits, torch.tensor([0, 0, 1, 1]))
    assert m["top1"] == 0.5 and m["top5"] == 1.0
    logits = torch.zeros(6, 10)
    assert expected_calibration_error(logits, torch.zeros(6, dtype=torch.long)) == pytest.approx(0.9, abs=1e-6)


def test_macro_scores_are_sklearns_over_the_classes_tested_or_predicted():
    """A class the test split lacks and nothing predicts has no scores (NaN) and is left out of the
    macro means; one only predicted counts, with precision 0."""
    classes = [str(i) for i in range(10)]
    labels = torch.arange(9).repeat(5)  # class 9 not in the test split
    scores = per_class(confusion_matrix(labels, labels, 10), classes)
    assert all(math.isnan(scores[9][k]) for k in ("precision", "recall", "f1")) and scores[9]["support"] == 0
    assert macro_scores(scores) == {"macro_precision": 1.0, "macro_recall": 1.0, "macro_f1": 1.0}
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        labels, preds = torch.randint(0, 7, (60,), generator=g), torch.randint(1, 8, (60,), generator=g)
        expected = precision_recall_fscore_support(labels, preds, average="macro", zero_division=0)[:3]
        got = macro_scores(per_class(confusion_matrix(preds, labels, 10), classes))
        assert [got[f"macro_{k}"] for k in ("precision", "recall", "f1")] == pytest.approx(expected)


def test_confusion_x_labels_do_not_overlap(monkeypatch):
    """Upright column labels fit their column; slanted ones end under it and are a line apart."""
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig))
    for classes in (["cat", "dog", "eel"], [f"digit {i}, handwritten" for i in range(3)], [f"d{i}" for i in range(12)],
                    ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse"]):
        plots.plot_confusion(np.eye(len(classes), dtype=int), classes, "unused.png")
        fig = figures.pop()
        ax = fig.axes[0]
        fig.canvas.draw()
        column = abs(ax.transData.transform((1, 0))[0] - ax.transData.transform((0, 0))[0])
        for label in ax.get_xticklabels():
            angle = math.radians(label.get_rotation())
            if angle:
                assert label.get_rotation_mode() == "anchor" and label.get_ha() == "right"
                assert column * math.sin(angle) > label.get_fontsize() * fig.dpi / 72, classes
            else:
                assert label.get_window_extent().width < column, classes
        plots.plt.close(fig)


@pytest.mark.slow
def test_evaluate_agrees_with_its_csv_files(digits_dir, tmp_path, monkeypatch):
    """A zero-initialised head (all logits tied), class names with commas (as Hugging Face's) and a class
    the test split lacks: evaluate.json's top-1 is confusion.csv's accuracy, both CSVs read back
    with their class names, and the missing class has no scores ("nan"), outside the macro means."""
    from pipeline.config import load_params
    from pipeline.evaluation import evaluate
    from pipeline.model import VisionTransformer, ViTConfig
    from pipeline.model.io import save_model

    for var in ("MLFLOW_TRACKING_URI", "VIT_SHARDS_URL", "DVC_EXP_NAME", "DVC_ROOT", "VIT_PARAMS"):
        monkeypatch.delenv(var, raising=False)
    shutil.copytree(digits_dir, tmp_path / "data/shards/finetune")
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    classes = [f"digit {i}, handwritten" for i in range(10)] + ["not in the test split"]
    info_file = tmp_path / "data/shards/finetune/dataset.json"  # the shards of those classes (evaluate checks)
    info = json.loads(info_file.read_text())
    info.update(classes=classes, num_classes=len(classes),
                class_counts={split: [*counts, 0] for split, counts in info["class_counts"].items()})
    info_file.write_text(json.dumps(info))
    model = VisionTransformer(ViTConfig(16, 4, embed_dim=32, depth=1, num_heads=2, num_classes=len(classes)))
    model.reset_classifier(len(classes))
    save_model(model, tmp_path / "models/finetune", {"image_size": 16, "classes": classes,
                                                     "normalize": {"mean": [0.5] * 3, "std": [0.5] * 3}})
    # the run says where its numbers were computed (a GPU's name with use_gpu), not the stage process's CPU
    monkeypatch.setattr("pipeline.evaluation.device_name", lambda device: f"the eval device ({device.type})")
    metrics = evaluate(load_params("params.yaml", {"ray.backend": "local", "evaluate.resolutions": [16]}))

    with open("plots/confusion.csv", newline="") as f:
        confusion = list(csv.DictReader(f))
    assert len(confusion) == metrics["num_samples"] and {r["predicted"] for r in confusion} == {classes[0]}
    assert metrics["top1"] == pytest.approx(sum(r["actual"] == r["predicted"] for r in confusion) / len(confusion))
    assert metrics["top1"] == pytest.approx(metrics["resolution_sweep"]["16"])
    with open("plots/per_class.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["class"] for r in rows] == classes and sum(int(r["support"]) for r in rows) == metrics["num_samples"]
    assert rows[-1] == {"class": classes[-1], "precision": "nan", "recall": "nan", "f1": "nan", "support": "0"}
    assert metrics["macro_recall"] == pytest.approx(0.1)  # class 0's recall 1, nine others 0: over 10, not 11
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("vit-pipeline").experiment_id], "tags.stage = 'evaluate'")
    assert run.data.tags["env.device"] == "the eval device (cpu)"
    assert client.get_run(run.data.tags["mlflow.parentRunId"]).data.tags["evaluate.device"] == "the eval device (cpu)"


def test_curves_without_a_history_draw_no_legend_and_warn_nothing(tmp_path, monkeypatch):
    """The evaluate stage of a model trained elsewhere has no history CSVs: an empty curves.png, no
    matplotlib warning about a legend without labels on the console."""
    import warnings

    saved = plots._save
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figures.append(fig), saved(fig, path)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plots.plot_history({}, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert figures and all(ax.get_legend() is None for ax in figures[0].axes)

"""The evaluate stage's prediction (``pipeline.inference``) on real shards: test-time augmentation's
views, their mean, and the same logits from the model wherever its weights are."""
from __future__ import annotations

import pytest
import torch

from pipeline.data import make_eval_loader, read_dataset_info
from pipeline.data.transforms import BatchFinish
from pipeline.inference import apply_view, normalised_black, predict_split, scored_metrics, views_note
from pipeline.metrics import classification_metrics
from pipeline.model import build_vit
from pipeline.tta import TTA_VIEWS, View

SIZE = 16  # the digits' default pretrain size
NORMALIZE = {"mean": [0.4, 0.5, 0.6], "std": [0.2, 0.25, 0.3]}


def digits_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_vit("nano", patch_size=4, image_size=SIZE, num_classes=10, depth=1).eval()


def predict(model, shard_dir, tta: str):
    return predict_split(model, shard_dir, "test", image_size=SIZE, batch_size=64, normalize=NORMALIZE, tta=tta)


def test_a_moved_view_is_the_image_moved_over_black_pixels():
    """On a normalised batch, as if the uint8 image had been moved over zeros (the train crops' padding)
    and then normalised; the mirror after the move."""
    pixels = torch.randint(1, 256, (2, 3, 5, 6), dtype=torch.uint8)
    finish, black = BatchFinish(NORMALIZE), normalised_black(NORMALIZE, torch.device("cpu"))
    moved = torch.zeros_like(pixels)
    moved[..., 1:, :-2] = pixels[..., :-1, 2:]  # down 1, left 2
    torch.testing.assert_close(apply_view(finish(pixels), View(1, -2), black), finish(moved))
    torch.testing.assert_close(apply_view(finish(pixels), View(1, -2, mirror=True), black), finish(moved.flip(-1)))
    assert torch.equal(apply_view(finish(pixels), View(), black), finish(pixels))


@pytest.mark.slow
def test_views_are_predicted_as_listed_and_averaged(digits_dir):
    model = digits_model()
    alone = predict(model, digits_dir, "none")
    n = read_dataset_info(digits_dir)["counts"]["test"]
    assert alone.logits.shape == (n, 10) and alone.labels.shape == alone.single.shape == (n,)
    assert torch.equal(alone.single, alone.logits.argmax(1)) and TTA_VIEWS["none"] == (View(),)
    plain = classification_metrics(alone.logits, alone.labels)
    assert scored_metrics(alone, "none") == plain  # no views beside the image: nothing to add
    black = normalised_black(NORMALIZE, torch.device("cpu"))
    batches = list(make_eval_loader(digits_dir, "test", batch_size=64, image_size=SIZE, rank=0, world_size=1,
                                    augment=NORMALIZE))
    assert set(TTA_VIEWS) == {"none", "hflip", "shift", "hflip-shift"}
    for tta in ("hflip", "shift", "hflip-shift"):
        views = TTA_VIEWS[tta]
        assert views[0] == View() and len(set(views)) == len(views)  # the image itself first
        scored = predict(model, digits_dir, tta)
        assert torch.equal(scored.labels, alone.labels) and torch.equal(scored.single, alone.single)
        with torch.no_grad():
            each = torch.stack([torch.cat([model(apply_view(x, v, black)) for x, _ in batches]) for v in views])
        torch.testing.assert_close(scored.logits, each.mean(0))
        for k in range(1, len(views)):  # digits are neither mirrored nor moved alike
            assert not torch.allclose(each[k], each[0])
        assert scored_metrics(scored, tta) == {**classification_metrics(scored.logits, scored.labels),
                                             "top1_single_view": plain["top1"]}
    assert views_note("none", None) == "" and views_note("hflip", 0.25) == " (tta hflip; the image alone 0.2500)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prediction_matches_cpu(digits_dir):
    """A GPU evaluation task (ray.use_gpu) predicts on its GPU; the logits come back on the CPU."""
    cpu = predict(digits_model(), digits_dir, "hflip-shift")
    cuda = predict(digits_model().cuda(), digits_dir, "hflip-shift")
    assert all(t.device.type == "cpu" for t in cuda) and torch.equal(cpu.labels, cuda.labels)
    torch.testing.assert_close(cuda.logits, cpu.logits, rtol=1e-3, atol=1e-3)

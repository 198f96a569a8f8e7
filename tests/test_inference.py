"""The evaluate stage's prediction (``pipeline.inference``) on real shards: test-time augmentation's
views, their mean, and the same logits from the model wherever its weights are."""
from __future__ import annotations

import pytest
import torch

from pipeline.data import make_eval_loader, read_dataset_info
from pipeline.inference import mean_of_views, predict_split, views_note
from pipeline.metrics import classification_metrics
from pipeline.model import build_vit

SIZE = 16  # the digits' default pretrain size


def digits_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_vit("nano", patch_size=4, image_size=SIZE, num_classes=10, depth=1).eval()


def predict(model, shard_dir, tta: str):
    return predict_split(model, shard_dir, "test", image_size=SIZE, batch_size=64, normalize=None, tta=tta)


def test_hflip_views_are_each_image_and_its_mirror(digits_dir):
    model = digits_model()
    one, labels = predict(model, digits_dir, "none")
    two, labels2 = predict(model, digits_dir, "hflip")
    n = read_dataset_info(digits_dir)["counts"]["test"]
    assert one.shape == (n, 1, 10) and two.shape == (n, 2, 10) and torch.equal(labels, labels2)
    with torch.no_grad():
        batches = list(make_eval_loader(digits_dir, "test", batch_size=64, image_size=SIZE, rank=0, world_size=1,
                                        augment=None))
        mirrored = torch.cat([model(x.flip(-1)) for x, _ in batches])
    assert not torch.allclose(two[:, 0], two[:, 1])  # digits are not mirror-symmetric
    torch.testing.assert_close(two[:, 0], one[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(two[:, 1], mirrored, rtol=0, atol=0)

    logits, single = mean_of_views(two, labels)
    torch.testing.assert_close(logits, (two[:, 0] + two[:, 1]) / 2)
    assert single == {"top1_single_view": classification_metrics(one[:, 0], labels)["top1"]}
    alone, nothing = mean_of_views(one, labels)  # no views beside the image: nothing to add
    assert torch.equal(alone, one[:, 0]) and nothing == {}
    assert views_note("none", None) == "" and views_note("hflip", 0.25) == " (tta hflip; the image alone 0.2500)"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_prediction_matches_cpu(digits_dir):
    """A GPU evaluation task (ray.use_gpu) predicts on its GPU; the logits come back on the CPU."""
    cpu, labels = predict(digits_model(), digits_dir, "hflip")
    cuda, cuda_labels = predict(digits_model().cuda(), digits_dir, "hflip")
    assert cuda.device.type == "cpu" and torch.equal(labels, cuda_labels)
    torch.testing.assert_close(cuda, cpu, rtol=1e-3, atol=1e-3)

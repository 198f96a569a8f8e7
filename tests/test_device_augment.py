"""DeviceAugment: the batched train augmentation (auto-augment in the loader worker, the rest on the
device) against torchvision's per-image ops."""
from __future__ import annotations

import math

import pytest
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import AutoAugment, RandAugment, TrivialAugmentWide, functional as F

from pipeline.data.augment import AUTO_AUGMENTS, AUTOAUGMENT_CIFAR10, resolve_augment
from pipeline.data.device_augment import (
    AUTOAUGMENT_BINS,
    BINS,
    GEOMETRIC,
    OPS,
    RANDAUGMENT_BIN,
    SAMPLED,
    SIGNED,
    DeviceAugment,
    cifar10_policy,
    magnitude_table,
)

H = W = 32
RA = {"auto_augment": "randaugment", "random_erasing": 0.5}
TA = {"auto_augment": "trivialaugment", "random_erasing": 0.5}
AA = {"auto_augment": AUTOAUGMENT_CIFAR10, "random_erasing": 0.5}


def _images(n: int, seed: int = 0) -> torch.Tensor:
    """Half noise, half smooth (upsampled) images, one with a flat channel: the edge cases of
    the ops (flat regions, edges, a channel autocontrast must leave alone) all occur."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (n - n // 2, 3, H, W), dtype=torch.uint8, generator=gen)
    coarse = torch.rand(n // 2, 3, 6, 6, generator=gen) * 255
    smooth = torch.nn.functional.interpolate(coarse, size=(H, W), mode="bilinear").round().to(torch.uint8)
    out = torch.cat([noise, smooth])
    out[-1, 1] = 77
    return out


def _normalised(augment, x):
    """The loader's normalisation before this module existed, written out: the default pipeline's
    pixels must not change."""
    cfg = resolve_augment(augment)
    mean = torch.tensor(cfg["mean"], dtype=torch.float32).view(1, 3, 1, 1) * 255.0
    std = torch.tensor(cfg["std"], dtype=torch.float32).view(1, 3, 1, 1) * 255.0
    return x.to(torch.float32).sub_(mean).div_(std)


@pytest.mark.parametrize("augment", [None, {"mean": [0.49, 0.48, 0.45], "std": [0.25, 0.24, 0.26]}])
def test_off_is_bit_equal_to_plain_normalisation(augment):
    aug, x = DeviceAugment(augment), _images(16)
    assert not aug.active and aug.draw(range(16), H, W) == {}
    want = _normalised(augment, x)
    for _ in range(2):  # the second call uses the cached constants
        assert torch.equal(aug(x, {}), want)


def test_magnitude_table_is_torchvisions():
    kinds = (("randaugment", RandAugment, BINS), ("trivialaugment", TrivialAugmentWide, BINS),
             (AUTOAUGMENT_CIFAR10, AutoAugment, AUTOAUGMENT_BINS))
    assert [k for k, _, _ in kinds] == [k for k in AUTO_AUGMENTS if k]
    for kind, tv, bins in kinds:
        space = tv._AUGMENTATION_SPACE
        assert tuple(space) == (OPS[:SAMPLED] if tv is not AutoAugment else OPS[1:])  # AutoAugment: no Identity
        assert {op for op, (_, signed) in space.items() if signed} == SIGNED
        for h, w in ((32, 32), (24, 40)):
            for op, mine in zip(OPS, magnitude_table(kind, h, w)):
                if op not in space:
                    continue
                theirs = space[op][0](bins, h, w)
                assert (mine is None) == (theirs is None), op
                if theirs is not None:
                    assert list(mine) == [float(v) for v in theirs], (kind, op)


@pytest.mark.parametrize("augment", [RA, TA, AA])
def test_deterministic_and_per_sample(augment):
    aug, x, seeds = DeviceAugment(augment), _images(32), list(range(1000, 1032))
    params, before = aug.draw(seeds, H, W), x.clone()
    out = aug(x, params)
    assert torch.equal(x, before)  # the caller's batch is not written to
    assert torch.equal(out, aug(x, aug.draw(seeds, H, W)))
    assert not torch.equal(out, aug(x, aug.draw([s + 1 for s in seeds], H, W)))
    perm = torch.randperm(32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(aug(x[perm], aug.draw([seeds[i] for i in perm], H, W)), out[perm])
    assert torch.equal(aug(x[5:9], aug.draw(seeds[5:9], H, W)), out[5:9])
    alone = [aug(x[k:k + 1], aug.draw(seeds[k:k + 1], H, W)) for k in range(32)]  # each op's group of one
    assert torch.equal(torch.cat(alone), out)


@pytest.mark.parametrize("augment", [RA, TA, AA, {"auto_augment": "randaugment"}, {"random_erasing": 0.5}, None])
def test_worker_part_then_device_part_is_the_whole(augment):
    """The loader worker runs ``on_host`` (the auto-augment ops, uint8) and the device the rest: together
    the same pixels as the whole augmentation in one place, with only erasing's draws left to ship."""
    aug, x = DeviceAugment(augment), _images(32)
    params = aug.draw(range(32), H, W)
    images, rest = aug.on_host(x, params)
    assert set(rest) == {"erase"} & set(params) and images.dtype == torch.uint8
    assert torch.equal(aug(images, rest), aug(x, params))
    assert torch.equal(images, x) == ("op" not in params)


def _torchvision_op(name: str, img: torch.Tensor, m: float, interp) -> torch.Tensor:
    """What torchvision's auto-augment does for op ``name`` at magnitude ``m`` (fill None)."""
    geo = dict(interpolation=interp, fill=None)
    if name in ("ShearX", "ShearY"):
        shear = [math.degrees(math.atan(m)), 0.0][:: 1 if name == "ShearX" else -1]
        return F.affine(img, angle=0.0, translate=[0, 0], scale=1.0, shear=shear, center=[0, 0], **geo)
    if name in ("TranslateX", "TranslateY"):
        shift = [int(m), 0][:: 1 if name == "TranslateX" else -1]
        return F.affine(img, angle=0.0, translate=shift, scale=1.0, shear=[0.0, 0.0], **geo)
    if name == "Rotate":
        return F.rotate(img, angle=m, **geo)
    factor = {"Brightness": F.adjust_brightness, "Color": F.adjust_saturation,
              "Contrast": F.adjust_contrast, "Sharpness": F.adjust_sharpness}
    if name in factor:
        return factor[name](img, 1.0 + m)
    if name == "Posterize":
        return F.posterize(img, int(m))
    if name == "Solarize":
        return F.solarize(img, 255.0 * m)
    return {"Identity": lambda i: i, "AutoContrast": F.autocontrast, "Equalize": F.equalize,
            "Invert": F.invert}[name](img)


@pytest.mark.parametrize("name, interpolation", [(op, "bilinear") for op in OPS] + [(op, "nearest") for op in GEOMETRIC])
def test_op_matches_torchvision(name, interpolation):
    """Every magnitude either auto-augment can draw (both signs), one per sample of one batch.

    Measured on CPU (torch 2.14.1, torchvision 0.29.1): bit-exact for every op and magnitude.
    Allowed: 1 level on at most 1 % of pixels, for builds whose kernels fuse a multiply-add where
    torchvision's does not (that alone gives ~0.1 %); a wrong rounding or range gives far more.
    """
    k = OPS.index(name)
    values = {0.0}
    for kind in AUTO_AUGMENTS[1:]:
        values |= set(magnitude_table(kind, H, W)[k] or ())
    values = sorted(values | {-v for v in values} if name in SIGNED else values)
    imgs = _images(4, seed=k)
    x = imgs.repeat_interleave(len(values), 0)
    mag = torch.tensor(values, dtype=torch.float32).repeat(len(imgs))
    aug = DeviceAugment({"auto_augment": "randaugment", "interpolation": interpolation})
    out = aug.auto_augment_batch(x, torch.full((len(x), 1), k), mag[:, None])
    interp = InterpolationMode.NEAREST if interpolation == "nearest" else InterpolationMode.BILINEAR
    want = torch.stack([_torchvision_op(name, img, float(m), interp) for img, m in zip(x, mag)])
    diff = (out.int() - want.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() <= 0.01, (diff.max(), (diff > 0).float().mean())
    assert torch.equal(aug.auto_augment_batch(x, torch.zeros(len(x), 1, dtype=torch.int64), mag[:, None]), x)


def test_op_choice_magnitude_and_sign_distribution():
    n = 3000
    for augment, slots in ((RA, 2), (TA, 1)):
        aug = DeviceAugment({**augment, "random_erasing": 0.0})
        p = aug.draw(range(n), H, W)
        assert set(p) == {"op", "magnitude"} and p["op"].shape == p["magnitude"].shape == (n, slots)
        assert p["op"].dtype == torch.int64 and p["magnitude"].dtype == torch.float32
        counts = torch.bincount(p["op"].flatten(), minlength=len(OPS)).float()
        assert counts[SAMPLED:].sum() == 0  # Invert is AutoAugment's only
        assert (counts[:SAMPLED] / (n * slots / SAMPLED)).sub(1).abs().max() < 0.25, counts  # ~5 sd
        table = magnitude_table(augment["auto_augment"], H, W)
        for k, name in enumerate(OPS[:SAMPLED]):
            m = p["magnitude"][p["op"] == k]
            if table[k] is None:
                assert (m == 0).all()
                continue
            allowed = torch.tensor(table[k] if slots == 1 else [table[k][RANDAUGMENT_BIN]])
            assert torch.isin(m.abs(), allowed).all(), name
            if name in SIGNED:
                assert 0.35 < (m < 0).float().mean() < 0.65, name
            if slots == 1:  # TrivialAugmentWide: the bin is uniform over all BINS (~7 draws each)
                assert len(torch.unique(m.abs())) >= len(set(table[k])) - 3, name


def test_autoaugment_draws_its_sub_policies():
    """Each sample takes one of the 25 CIFAR-10 sub-policies (uniformly) and applies each of its two ops
    with the op's probability at the op's bin (Identity where it is not applied), as torchvision's
    AutoAugment does: the frequency of every op in each slot is the policy's, within ~5 sd."""
    n, policy = 20000, cifar10_policy()
    assert len(policy) == 25
    aug = DeviceAugment({"auto_augment": AUTOAUGMENT_CIFAR10})
    p = aug.draw(range(n), H, W)
    assert p["op"].shape == p["magnitude"].shape == (n, 2)
    table = magnitude_table(AUTOAUGMENT_CIFAR10, H, W)
    for slot in (0, 1):
        want = torch.zeros(len(OPS), dtype=torch.float64)
        allowed: dict[int, set] = {0: {0.0}}
        for sub in policy:
            name, prob, b = sub[slot]
            k = OPS.index(name)
            want[k] += prob / len(policy)
            want[0] += (1 - prob) / len(policy)
            allowed.setdefault(k, set()).add(0.0 if b is None else table[k][b])
        got = torch.bincount(p["op"][:, slot], minlength=len(OPS)).double() / n
        sd = (want * (1 - want) / n).sqrt()
        assert ((got - want).abs() <= 5 * sd + 1e-12).all(), (slot, got, want)
        for k, values in allowed.items():
            m = p["magnitude"][p["op"][:, slot] == k, slot]
            assert torch.isin(m.abs(), torch.tensor(sorted(values))).all(), OPS[k]
            if OPS[k] in SIGNED and (m != 0).any():
                assert 0.4 < (m[m != 0] < 0).float().mean() < 0.6, OPS[k]


def test_erasing_boxes_and_pixels():
    n, p = 2000, 0.3
    aug = DeviceAugment({"random_erasing": p})
    box = aug.draw(range(n), H, W)["erase"]
    assert box.shape == (n, 4) and box.dtype == torch.int64
    top, left, h, w = box.unbind(1)
    erased = h > 0
    assert abs(erased.float().mean() - p) < 0.05
    assert ((h == 0) == (w == 0)).all() and (h < H).all() and (w < W).all()
    assert (top + h <= H).all() and (left + w <= W).all() and (top >= 0).all() and (left >= 0).all()
    h, w = h[erased].double(), w[erased].double()  # h, w are rounded sides of a box of area in scale
    assert ((h - 0.5) * (w - 0.5) <= 0.33 * H * W).all() and ((h + 0.5) * (w + 0.5) >= 0.02 * H * W).all()

    x = _images(64)
    out, plain = aug(x, {"erase": box[:64]}), DeviceAugment(None)(x, {})
    assert erased[:64].any() and not erased[:64].all()
    assert (plain != 0).all()  # mean 0.5 never normalises a uint8 pixel to exactly 0
    for k in range(64):
        top, left, hh, ww = box[k].tolist()
        mask = torch.zeros(H, W, dtype=torch.bool)
        mask[top:top + hh, left:left + ww] = True
        assert torch.equal(out[k] == 0, mask.expand(3, H, W))
        assert torch.equal(out[k][:, ~mask], plain[k][:, ~mask])
    assert DeviceAugment({"random_erasing": 0.0}).draw(range(10), H, W) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu_without_host_sync():
    for augment in (RA, TA, AA):
        aug, x = DeviceAugment(augment), _images(256)
        params = aug.draw(range(256), H, W)
        cpu = aug(x, params)
        xc, pc = x.cuda(), {k: v.pin_memory() for k, v in params.items()}  # as the loader ships them
        aug(xc, pc)  # first call per device copies the constants over
        torch.cuda.set_sync_debug_mode("error")
        try:
            gpu = aug(xc, pc)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        diff = (gpu.cpu() - cpu).abs()
        assert (diff > 0).float().mean() < 0.01 and diff.mean() < 0.01, (diff.max(), diff.mean())

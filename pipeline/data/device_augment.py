"""The random part of the train augmentation, batched: RandAugment / TrivialAugmentWide / AutoAugment
(CIFAR-10 policy) on the loader worker's CPU, normalisation and random erasing on the training device.

Loader workers crop and flip each sample, draw this module's per-sample choices and run the
auto-augment ops on the whole uint8 batch (:meth:`DeviceAugment.on_host`); the device then
normalises and erases. The ops copy torchvision v2's uint8 kernels (same ranges, rounding and
clamping), applied per sample: each sample's result depends on its own seed only, not on the batch
around it, and the ops give the same pixels on a CPU and a GPU (tests). Each op runs on the samples
that drew it only, grouped from the draws, so a batch does one op's work per sample and slot.

Why the auto-augment runs on the CPU (measured on one H100 with 16 cores): on the GPU
its many small launches per batch (38 ``index_select`` calls alone, profiled) cost ~12 ms of host
time whatever the batch size, more than a whole compiled step at batch 128, and the loop fed
6,400-6,700 img/s against 16,000-17,000 for the CUDA-graphed model alone. On one CPU core the
batched ops take ~6 ms per 128 images (a 2-core Intel Xeon with AVX-512), and the loader workers
share that out.
"""
from __future__ import annotations

import functools
import math
import random
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as nnf
from torchvision.transforms import AutoAugmentPolicy
from torchvision.transforms.v2 import AutoAugment, functional as F

from .augment import AUTOAUGMENT_CIFAR10, resolve_augment
from .transforms import BatchFinish

OPS = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color",
       "Contrast", "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize", "Invert")
SAMPLED = len(OPS) - 1  # RandAugment and TrivialAugmentWide draw among all but Invert (AutoAugment's only)
GEOMETRIC = OPS[1:6]
SIGNED = frozenset(OPS[1:10])  # torchvision flips these ops' magnitude with probability 1/2
BINS, RANDAUGMENT_OPS, RANDAUGMENT_BIN = 31, 2, 9  # torchvision's RandAugment defaults
AUTOAUGMENT_BINS = 10  # torchvision's AutoAugment: its policies name one of 10 bins
SLOTS = {None: 0, "randaugment": RANDAUGMENT_OPS, "trivialaugment": 1, AUTOAUGMENT_CIFAR10: 2}  # ops per sample
ERASE_SCALE, ERASE_RATIO = (0.02, 0.33), (0.3, 3.3)  # torchvision's RandomErasing defaults


@functools.cache
def cifar10_policy() -> tuple:
    """torchvision's AutoAugment CIFAR-10 policy: 25 sub-policies of two (op, probability, bin or None)."""
    return tuple(AutoAugment(AutoAugmentPolicy.CIFAR10)._policies)


@functools.lru_cache(maxsize=64)
def magnitude_table(kind: str, height: int, width: int) -> tuple[Optional[tuple[float, ...]], ...]:
    """Per op (in ``OPS`` order) its magnitudes (``BINS``; ``AUTOAUGMENT_BINS`` for AutoAugment), or None
    for ops without one: the values of torchvision's ``_AUGMENTATION_SPACE`` (float32, as it computes
    them) for "randaugment", "trivialaugment" (the wide ranges) or AutoAugment (RandAugment's ranges)."""
    ra = kind != "trivialaugment"
    bins = AUTOAUGMENT_BINS if kind == AUTOAUGMENT_CIFAR10 else BINS

    def span(ra_max: float, ta_max: float) -> tuple[float, ...]:
        return tuple(torch.linspace(0.0, ra_max if ra else ta_max, bins).tolist())

    bits = (8 - (torch.arange(bins) / ((bins - 1) / (4 if ra else 6)))).round().int()
    table = {"ShearX": span(0.3, 0.99), "ShearY": span(0.3, 0.99),
             "TranslateX": span(150.0 / 331.0 * width, 32.0), "TranslateY": span(150.0 / 331.0 * height, 32.0),
             "Rotate": span(30.0, 135.0), "Brightness": span(0.9, 0.99), "Color": span(0.9, 0.99),
             "Contrast": span(0.9, 0.99), "Sharpness": span(0.9, 0.99),
             "Posterize": tuple(float(b) for b in bits.tolist()),
             "Solarize": tuple(torch.linspace(1.0, 0.0, bins).tolist())}
    return tuple(table.get(op) for op in OPS)


def _draw_erase(rng: random.Random, p: float, height: int, width: int) -> list[int]:
    """``RandomErasing.make_params`` from a Python Random: [top, left, h, w], all 0 for no erase."""
    if rng.random() >= p:
        return [0, 0, 0, 0]
    area, log_ratio = height * width, (math.log(ERASE_RATIO[0]), math.log(ERASE_RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(*ERASE_SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        h, w = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if h < height and w < width:
            return [rng.randint(0, height - h), rng.randint(0, width - w), h, w]
    return [0, 0, 0, 0]  # torchvision gives up after 10 tries and leaves the image as is


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without stalling the host: pinned, then copied asynchronously."""
    if t.device == device:
        return t
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _col(v: torch.Tensor) -> torch.Tensor:
    """Per-sample values [n] -> [n, 1, 1, 1], to broadcast over an image batch."""
    return v.view(-1, 1, 1, 1)


def _gray(x: torch.Tensor) -> torch.Tensor:
    r, g, b = x.unbind(1)  # torchvision's _rgb_to_grayscale_image, floored as for uint8
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).floor_().unsqueeze(1)


def _blend(x: torch.Tensor, other: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """torchvision's ``_blend(x, other, ratio=1 + m)`` per sample (1 - ratio == -m exactly);
    addcmul rounds like its ``add_(alpha=)`` (a separate multiply can be 1 level off)."""
    return torch.addcmul(x.mul(_col(1 + m)), other, _col(-m)).clamp_(0, 255).to(torch.uint8)


def _sharpness(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``adjust_sharpness(1 + m)``: its 3x3 blur (1s around a 5, / 13, rounded) as exact integer
    sums, so no conv2d precision mode (TF32 on CUDA) can change a pixel; borders stay."""
    f = x.to(torch.float32)
    inner = f[..., 1:-1, 1:-1]
    blur = nnf.avg_pool2d(f, 3, stride=1, divisor_override=1).add_(inner, alpha=4).div_(13).round_()
    f[..., 1:-1, 1:-1] = torch.addcmul(inner, blur - inner, _col(-m))
    return f.clamp_(0, 255).to(torch.uint8)


def _posterize(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    bits = m.to(torch.int32).clamp(0, 8)
    return x & _col(256 - torch.pow(2, 8 - bits)).to(torch.uint8)


def _autocontrast(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``F.autocontrast`` without its boolean-mask assignment (a host sync on CUDA)."""
    f = x.to(torch.float32)
    lo, hi = f.amin((-2, -1), keepdim=True), f.amax((-2, -1), keepdim=True)
    flat = hi == lo
    scale = torch.where(flat, 1.0, (hi - lo).mul_(1.0 / 255))
    return f.sub_(torch.where(flat, 0.0, lo)).div_(scale).clamp_(0, 255).to(torch.uint8)


COLOUR_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Brightness": lambda x, m: x.mul(_col(1 + m)).clamp_(0, 255).to(torch.uint8),
    "Color": lambda x, m: _blend(x, _gray(x), m),
    "Contrast": lambda x, m: _blend(x, _gray(x).mean((1, 2, 3), keepdim=True), m),
    "Sharpness": _sharpness,
    "Posterize": _posterize,
    "Solarize": lambda x, m: torch.where(x >= _col(m * 255), 255 - x, x),
    "AutoContrast": _autocontrast,
    "Equalize": lambda x, m: F.equalize(x),
    "Invert": lambda x, m: 255 - x,
}


def _inverse_affine(op: torch.Tensor, m: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Per-sample [n, 2, 3] matrices of torchvision's ``_get_inverse_affine_matrix`` (in float64
    like its Python floats) for the geometric ops as its auto-augment calls them; identity else."""
    m = m.double()
    zero = torch.zeros_like(m)

    def only(name: str, v: torch.Tensor) -> torch.Tensor:
        return torch.where(op == OPS.index(name), v, zero)

    rot = only("Rotate", torch.deg2rad(-torch.remainder(m, 360.0)))  # F.rotate: affine by -(angle % 360)
    sx, sy = only("ShearX", torch.atan(m)), only("ShearY", torch.atan(m))  # shear angle atan(m)
    tx, ty = only("TranslateX", m.trunc()), only("TranslateY", m.trunc())  # int(magnitude) pixels
    corner = (op == OPS.index("ShearX")) | (op == OPS.index("ShearY"))  # shears use center=[0, 0]
    cx, cy = torch.where(corner, -width / 2.0, zero), torch.where(corner, -height / 2.0, zero)
    a = torch.cos(rot - sy) / torch.cos(sy)
    b = -(a * torch.tan(sx) + torch.sin(rot))
    c = torch.sin(rot - sy) / torch.cos(sy)
    d = torch.cos(rot) - c * torch.tan(sx)
    e = cx - d * (cx + tx) + b * (cy + ty)
    f = cy + c * (cx + tx) - a * (cy + ty)
    return torch.stack([d, -b, e, -c, a, f], 1).view(-1, 2, 3).float()


def _warp(x: torch.Tensor, theta: torch.Tensor, mode: str) -> torch.Tensor:
    """torchvision's affine_image for a batch of matrices: its ``_affine_grid`` (as broadcast
    products: no TF32 matmul) + ``grid_sample``, zeros outside, rounded back to uint8."""
    h, w = x.shape[-2:]
    xs = torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, w, device=x.device).view(1, 1, w)
    ys = torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, h, device=x.device).view(1, h, 1)
    half = torch.full((2, 1), 0.5 * w, device=x.device)  # filled on the device: no host copy
    half[1] = 0.5 * h
    t = (theta / half).unsqueeze(-1).unsqueeze(-1)
    grid = torch.stack([xs * t[:, i, 0] + ys * t[:, i, 1] + t[:, i, 2] for i in (0, 1)], -1)
    out = nnf.grid_sample(x.to(torch.float32), grid, mode=mode, padding_mode="zeros", align_corners=False)
    return out.round_().to(torch.uint8)


class DeviceAugment:
    """Auto-augment + normalisation + random erasing of a train batch, batched.

    :meth:`draw` (CPU, loader worker) makes every random choice, per sample from its own seed;
    :meth:`on_host` (the same worker) applies the auto-augment ops, ``__call__`` (device) the rest,
    with no Python loop over samples. With neither auto-augment nor erasing it is exactly
    ``BatchFinish``'s normalisation.
    """

    def __init__(self, augment: Optional[dict]):
        cfg = resolve_augment(augment)
        self.auto_augment, self.erase_p = cfg["auto_augment"], float(cfg["random_erasing"])
        self.mode = "nearest" if cfg["interpolation"] == "nearest" else "bilinear"  # as transforms._auto_augment
        self.slots = SLOTS[self.auto_augment]
        self.active = self.slots > 0 or self.erase_p > 0
        self.normalize = BatchFinish(cfg)

    def draw(self, seeds: Sequence[int], height: int, width: int) -> dict[str, torch.Tensor]:
        """Sample k's choices from ``random.Random(seeds[k])``: ``op`` int64 [B, S] (index into
        ``OPS``), ``magnitude`` float32 [B, S] (signed), ``erase`` int64 [B, 4] (top, left, h, w;
        zeros: none). Keys only for what is configured; S = ``SLOTS[auto_augment]``."""
        if not self.active:
            return {}
        ops, mags, boxes = [], [], []
        table = magnitude_table(self.auto_augment, height, width) if self.slots else None
        for seed in seeds:
            rng = random.Random(seed)
            for k, b in self._choices(rng, table):
                m = 0.0 if b is None else table[k][b]
                if b is not None and OPS[k] in SIGNED and rng.random() < 0.5:
                    m = -m
                ops.append(k)
                mags.append(m)
            if self.erase_p > 0:
                boxes.append(_draw_erase(rng, self.erase_p, height, width))
        out = {}
        if self.slots:
            out["op"] = torch.tensor(ops, dtype=torch.int64).view(len(seeds), self.slots)
            out["magnitude"] = torch.tensor(mags, dtype=torch.float32).view(len(seeds), self.slots)
        if self.erase_p > 0:
            out["erase"] = torch.tensor(boxes, dtype=torch.int64).view(len(seeds), 4)
        return out

    def _choices(self, rng: random.Random, table) -> Iterator[tuple[int, Optional[int]]]:
        """One sample's (op, magnitude bin or None) per slot, as torchvision's transform draws them:
        RandAugment any op at bin 9, TrivialAugmentWide any op at any bin, AutoAugment one of its
        policy's sub-policies, each op applied with its probability (Identity where it is not)."""
        if self.auto_augment == AUTOAUGMENT_CIFAR10:
            for name, p, b in rng.choice(cifar10_policy()):
                yield (OPS.index(name), b) if rng.random() <= p else (0, None)
            return
        for _ in range(self.slots):
            k = rng.randrange(SAMPLED)
            if table[k] is None:
                yield k, None
            else:
                yield k, RANDAUGMENT_BIN if self.auto_augment == "randaugment" else rng.randrange(BINS)

    def on_host(self, images: torch.Tensor, params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """The loader worker's part: the auto-augment ops on its uint8 CPU batch. Returns the batch and
        the draws left for ``__call__`` on the device (erasing)."""
        if "op" not in params:
            return images, params
        rest = {k: v for k, v in params.items() if k not in ("op", "magnitude")}
        return self.auto_augment_batch(images, params["op"], params["magnitude"]), rest

    def __call__(self, images: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """uint8 [B, 3, H, W] and :meth:`draw`'s params (what :meth:`on_host` left, or all of them), on
        the host (pinned where the loader pins them; copied here) -> float32, normalised."""
        images, params = self.on_host(images, params)  # nothing left to do when the loader worker did it
        x = self.normalize(images)
        if "erase" in params:
            top, left, h, w = (_col(v) for v in _to_device(params["erase"], x.device).unbind(1))
            rows = torch.arange(x.shape[-2], device=x.device).view(1, 1, -1, 1)
            cols = torch.arange(x.shape[-1], device=x.device).view(1, 1, 1, -1)
            x.masked_fill_((rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w), 0.0)
        return x

    def auto_augment_batch(self, x: torch.Tensor, op: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
        """uint8 -> uint8: per slot, one warp for the samples that drew a geometric op, then each colour
        op on the samples that drew it. ``op`` [B, S] is read on the host: sorted there, it gives each
        op's samples as a slice of one index tensor, whose bounds the host knows."""
        if x.dtype != torch.uint8:
            raise TypeError(f"auto-augment works on uint8 images (as torchvision's), got {x.dtype}")
        op = op.cpu().T.contiguous()  # [S, B], on the host (as drawn, it is there already)
        order = _to_device(op.argsort(dim=1, stable=True), x.device)  # per slot: the samples grouped by op
        op_on, magnitude = _to_device(op, x.device), _to_device(magnitude.T.contiguous(), x.device)
        x = x.clone()  # written in place: the caller's batch stays
        first_geo, last_geo = OPS.index(GEOMETRIC[0]), OPS.index(GEOMETRIC[-1])
        for s in range(len(op)):
            ends = torch.bincount(op[s], minlength=len(OPS)).cumsum(0).tolist()

            def samples(first: int, last: int) -> torch.Tensor:
                """The samples whose op in this slot is one of OPS[first..last]."""
                return order[s, ends[first - 1] if first else 0:ends[last]]

            idx = samples(first_geo, last_geo)
            if len(idx):
                theta = _inverse_affine(op_on[s].index_select(0, idx), magnitude[s].index_select(0, idx), *x.shape[-2:])
                x.index_copy_(0, idx, _warp(x.index_select(0, idx), theta, self.mode))
            for name, fn in COLOUR_OPS.items():
                idx = samples(OPS.index(name), OPS.index(name))
                if len(idx):
                    x.index_copy_(0, idx, fn(x.index_select(0, idx), magnitude[s].index_select(0, idx)))
        return x

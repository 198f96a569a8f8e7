"""torchvision.transforms.v2 pipelines built from the ``augment`` dict of params.yaml (its keys, choices and
checks: :mod:`.augment`)."""
from __future__ import annotations

import functools
import math
import random
from typing import Callable, Optional, Sequence

import torch
from torchvision.transforms import AutoAugmentPolicy, InterpolationMode, v2
from torchvision.transforms.v2 import functional as F

from .augment import AUTOAUGMENT_CIFAR10, INTERPOLATION_CHOICES, resolve_augment
from .draft import MIN_SIZE as DRAFT_MIN_SIZE, decode_reduced, draft_scale, jpeg_size, open_jpeg
from .hostmem import empty_huge, one_thread

AUTO_AUGMENT_TRANSFORMS: dict[str, Callable[..., v2.Transform]] = {  # each choice: torchvision's (interpolation=)
    "randaugment": v2.RandAugment,
    "trivialaugment": v2.TrivialAugmentWide,
    AUTOAUGMENT_CIFAR10: functools.partial(v2.AutoAugment, AutoAugmentPolicy.CIFAR10),
}
INTERPOLATIONS = {name: InterpolationMode(name) for name in INTERPOLATION_CHOICES}


def _tail(cfg: dict) -> list:
    """uint8 image -> normalised float32 CHW tensor."""
    return [v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean=list(cfg["mean"]), std=list(cfg["std"]))]


def eval_transform(image_size: int, augment: Optional[dict] = None) -> v2.Compose:
    """Reference per-sample eval pipeline (PIL or tensor in): resize short side, centre crop, normalise."""
    cfg = resolve_augment(augment)
    interp = INTERPOLATIONS[cfg["interpolation"]]
    return v2.Compose([v2.ToImage(), v2.Resize(image_size, interpolation=interp, antialias=True),
                       v2.CenterCrop(image_size), *_tail(cfg)])


def train_transform(image_size: int, augment: Optional[dict] = None) -> v2.Compose:
    """Reference per-sample train pipeline as one v2.Compose (what a torchvision Dataset would use).

    The loader runs the same ops through :class:`SampleTransform` + :class:`BatchFinish`, which
    give the same distribution with less per-sample overhead.
    """
    cfg = resolve_augment(augment)
    interp = INTERPOLATIONS[cfg["interpolation"]]
    ops = [v2.ToImage()]
    if cfg["random_resized_crop"] is None:
        ops += [v2.Resize(image_size, interpolation=interp, antialias=True), v2.CenterCrop(image_size)]
        if cfg["random_crop"] is not None:
            ops.append(v2.RandomCrop(image_size, padding=cfg["random_crop"]))
    else:
        ops.append(v2.RandomResizedCrop(image_size, scale=tuple(cfg["random_resized_crop"]),
                                        interpolation=interp, antialias=True))
    if cfg["hflip"] > 0:
        ops.append(v2.RandomHorizontalFlip(p=float(cfg["hflip"])))
    ops += _auto_augment(cfg)
    ops += _tail(cfg)
    if cfg["random_erasing"] > 0:
        ops.append(v2.RandomErasing(p=float(cfg["random_erasing"])))
    return v2.Compose(ops)


def _auto_augment(cfg: dict) -> list:
    # tensor affine ops only do nearest/bilinear
    nearest = cfg["interpolation"] == "nearest"
    interp = InterpolationMode.NEAREST if nearest else InterpolationMode.BILINEAR
    make = AUTO_AUGMENT_TRANSFORMS.get(cfg["auto_augment"])
    return [make(interpolation=interp)] if make else []


def _interpolate(img: torch.Tensor, size: int, interp: InterpolationMode) -> torch.Tensor:
    nearest = interp == InterpolationMode.NEAREST
    return torch.nn.functional.interpolate(img[None], size=(size, size), mode=interp.value,
                                           align_corners=None if nearest else False,
                                           antialias=not nearest)[0]


@functools.cache  # one check per mode and process, not one per loader built
def _direct_resize_matches(interp: InterpolationMode) -> bool:
    """Whether torch's uint8 kernel, called directly, gives ``F.resize_image``'s exact pixels here
    (it does where torchvision itself uses it: CPU builds with native uint8 resize); skipping
    torchvision's Python wrapper halves the cost of a 32 px resize."""
    img = torch.randint(0, 256, (3, 23, 29), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    try:
        direct = _interpolate(img, 32, interp)
    except RuntimeError:  # no uint8 kernel for this mode
        return False
    return direct.dtype == torch.uint8 and torch.equal(
        direct, F.resize_image(img, [32, 32], interpolation=interp, antialias=True))


def crop_params(rng: random.Random, height: int, width: int, scale: Sequence[float],
                ratio: Sequence[float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """``RandomResizedCrop.get_params`` (same algorithm and distribution) drawing from a Python
    ``Random``: ~2 us against ~20 us for torch's tensor RNG calls at 32 px."""
    area, log_ratio = height * width, (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height  # fallback: centre crop at the nearest allowed aspect ratio
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def centre_box(height: int, width: int, size: int) -> tuple[float, float, float, float]:
    """The region (left, top, right, bottom) of a ``height`` x ``width`` image that ``F.resize(size)`` (short
    side to ``size``, the long side truncated as it does) then ``F.center_crop(size)`` keep."""
    new_h, new_w = (int(size * height / width), size) if width <= height else (size, int(size * width / height))
    top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
    fy, fx = height / new_h, width / new_w
    return left * fx, top * fy, (left + size) * fx, (top + size) * fy


class SampleTransform:
    """Per-sample CPU part on a uint8 CHW tensor: crop/resize (random-resized, or resized then a random
    crop of the zero-padded image, CIFAR's classic) and flip; stays uint8.

    Calls torchvision's image kernels directly: at 32 px the v2 module dispatch costs more than
    the pixel work. Auto-augment, normalisation and erasing run batched on the training device
    (:class:`.device_augment.DeviceAugment`), eval normalisation once per batch (:class:`BatchFinish`).
    Crop and flip draw from a ``random.Random`` seeded per image; :meth:`apply` and
    :meth:`apply_encoded` take the seed, so the result does not depend on the process or the batch
    order. Called directly, the seed comes from torch's global RNG.
    """

    def __init__(self, image_size: int, augment: Optional[dict], train: bool):
        cfg = resolve_augment(augment)
        self.size, self.train = image_size, train
        self.interp = INTERPOLATIONS[cfg["interpolation"]]
        self.rrc = cfg["random_resized_crop"] if train else None
        self.pad = cfg["random_crop"] if train else None
        self.hflip = float(cfg["hflip"]) if train else 0.0
        self.random = self.rrc is not None or self.pad is not None or self.hflip > 0
        self.direct = _direct_resize_matches(self.interp)

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        return self.apply(img, int(torch.randint(1 << 62, ())) if self.random else 0)

    def resize(self, img: torch.Tensor) -> torch.Tensor:
        """uint8 ``[3, h, w]`` -> ``[3, size, size]``, torchvision's pixels (antialiased)."""
        if self.direct and img.dtype == torch.uint8 and img.device.type == "cpu":
            return _interpolate(img, self.size, self.interp)
        return F.resize_image(img, [self.size, self.size], interpolation=self.interp, antialias=True)

    def apply_encoded(self, data: bytes, seed: int) -> Optional[torch.Tensor]:
        """:meth:`apply` on a JPEG's bytes, decoded at reduced size (:mod:`.draft`): the same crop region
        and flip for the same seed, pixels within the DCT scaling's error of a full decode's. None where
        no scale-down fits (the crop under 4 times the output, a padded crop, not a JPEG): decode
        in full and call :meth:`apply`."""
        size = None if self.pad is not None or self.size < DRAFT_MIN_SIZE else jpeg_size(data)
        if size is None or draft_scale(*size, self.size) == 1:  # no crop is larger than the image
            return None
        width, height = size
        rng = random.Random(seed)
        if self.rrc is not None:
            i, j, h, w = crop_params(rng, height, width, self.rrc)
            box: tuple[float, float, float, float] = (j, i, j + w, i + h)
        else:
            box = centre_box(height, width, self.size)
            h, w = box[3] - box[1], box[2] - box[0]
        scale = draft_scale(h, w, self.size)
        img = open_jpeg(data) if scale > 1 else None
        if img is None or img.size != size:
            return None
        reduced, f = decode_reduced(img, scale)
        left, top, right, bottom = (round(v * f) for v in box)
        out = self.resize(reduced[:, top:bottom, left:right])
        if self.hflip and rng.random() < self.hflip:
            out = out.flip(-1)
        return out

    def apply(self, img: torch.Tensor, seed: int) -> torch.Tensor:
        rng = random.Random(seed)
        if self.rrc is not None:
            i, j, h, w = crop_params(rng, img.shape[-2], img.shape[-1], self.rrc)
            img = self.resize(img[:, i:i + h, j:j + w])
        else:
            if min(img.shape[-2:]) != self.size:
                img = F.resize(img, self.size, interpolation=self.interp, antialias=True)
            if tuple(img.shape[-2:]) != (self.size, self.size):
                img = F.center_crop(img, [self.size, self.size])
            if self.pad:  # RandomCrop(size, padding=pad): offsets uniform in [0, 2 * pad], zeros outside
                i, j = rng.randint(0, 2 * self.pad), rng.randint(0, 2 * self.pad)
                img = torch.nn.functional.pad(img, [self.pad] * 4)[:, i:i + self.size, j:j + self.size]
        if self.hflip and rng.random() < self.hflip:
            img = img.flip(-1)
        return img


class BatchFinish:
    """uint8 batch [B,3,H,W] -> normalised float32 (== ToDtype(scale) + Normalize), on the batch's
    device; the constants are cached per device."""

    def __init__(self, augment: Optional[dict]):
        cfg = resolve_augment(augment)
        self.shift = torch.tensor(cfg["mean"], dtype=torch.float32).view(1, 3, 1, 1) * 255.0
        self.scale = torch.tensor(cfg["std"], dtype=torch.float32).view(1, 3, 1, 1) * 255.0
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        if batch.device not in self._on:
            self._on[batch.device] = (self.shift.to(batch.device), self.scale.to(batch.device))
        shift, scale = self._on[batch.device]
        if batch.device.type != "cpu":
            return batch.to(torch.float32).sub_(shift).div_(scale)
        with one_thread():  # a fresh batch-sized float32 tensor, in huge pages (:mod:`.hostmem`)
            return empty_huge(batch.shape).copy_(batch).sub_(shift).div_(scale)

"""JPEG decode at reduced size where the crop allows it (libjpeg's DCT scaling, through Pillow's ``draft``).

A 224 px crop of a 500 x 375 photo needs at most a quarter of its pixels: libjpeg can decode at 1/2,
1/4 or 1/8 scale for a fraction of a full decode's work, before any resize. :func:`draft_scale` picks
the largest scale that still leaves the crop region at least the output size on both sides, so the
resize that follows still only shrinks; the crop box (chosen on the full image's size, so the same
region for the same seed) is mapped to the reduced image in sub-pixel coordinates, and Pillow's
antialiased resize (the filter torchvision's ``antialias=True`` copies) makes the output. The result
differs from a full decode's by the DCT scaling's own averaging only (tests bound it).
"""
from __future__ import annotations

import io
from typing import Optional

import numpy as np
import torch
from PIL import Image

JPEG_EXTS = ("jpg", "jpeg")
MIN_SIZE = 64  # output sizes below it decode in full: small images decode fast, and 8 x 8 DCT blocks are coarse there
SCALES = (8, 4, 2)  # libjpeg's scale-downs (1/8, 1/4, 1/2), largest first
_RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
             "bicubic": Image.Resampling.BICUBIC}


def draft_scale(crop_h: float, crop_w: float, size: int) -> int:
    """The largest libjpeg scale-down leaving a ``crop_h`` x ``crop_w`` region at >= ``size`` on both
    sides; 1 (a full decode) when none does, or when ``size`` is below :data:`MIN_SIZE`."""
    if size < MIN_SIZE:
        return 1
    return next((s for s in SCALES if min(crop_h, crop_w) >= size * s), 1)


def open_jpeg(data: bytes) -> Optional[Image.Image]:
    """The JPEG's header parsed (no pixels decoded yet), or None for bytes Pillow does not take as a
    baseline/progressive JPEG (the full decoder then reads them, or says why it cannot)."""
    try:
        img = Image.open(io.BytesIO(data))
    except Exception:  # Pillow raises many types for bytes that are not an image
        return None
    return img if img.format == "JPEG" else None


def decode_box(img: Image.Image, box: tuple[float, float, float, float], out: tuple[int, int], scale: int,
               interpolation: str) -> torch.Tensor:
    """uint8 RGB ``[3, out_h, out_w]``: the region ``box`` (left, top, right, bottom, full-size pixels) of
    the opened JPEG ``img``, decoded at 1/``scale`` and resized to ``out`` (height, width)."""
    full_w, f = img.size[0], 1.0
    if scale > 1:
        _, reduced = img.draft("RGB", (img.size[0] // scale, img.size[1] // scale))
        f = reduced[2] / full_w  # 1 / the scale libjpeg applies (pixel k of the reduced image: k / f onwards)
    img = img.convert("RGB")
    region = tuple(v * f for v in box)
    img = img.resize((out[1], out[0]), resample=_RESAMPLE[interpolation], box=region)
    return torch.from_numpy(np.array(img)).permute(2, 0, 1)  # a writable copy: 150 KB at 224 px

"""JPEG decode at reduced size where the crop allows it (libjpeg's DCT scaling, through Pillow's ``draft``).

A 224 px crop of a 2000 x 1500 photo needs a small share of its pixels: libjpeg can decode at 1/2,
1/4 or 1/8 scale for a fraction of a full decode's work, before any resize. :func:`draft_scale` picks
the largest scale that still leaves the crop region at least the output size on both sides, so the
resize that follows still only shrinks; the crop box (chosen on the full image's size, so the same
region for the same seed) is mapped to the reduced image (to its nearest pixel edges) and resized
there by the kernel the full path uses. The DCT scaling saves the inverse DCT and colour conversion
of the pixels dropped, not the entropy decoding, and Pillow's decode is slower than torchvision.io's
(the full path's): measured on 1000 x 750 and 2000 x 1500 quality-90 JPEGs, Pillow at 1/2 costs about
what torchvision.io's full decode does, at 1/4 and 1/8 a half to two thirds of it. So only 1/4 and 1/8
are used, and the size is read from the JPEG's frame header first (microseconds), so an image none of
whose crops fits them is not opened twice. The result differs from a full decode's
by the DCT scaling's averaging and the rounded crop edges only (tests bound it).
"""
from __future__ import annotations

import io
from typing import Optional

import numpy as np
import torch
from PIL import Image

JPEG_EXTS = ("jpg", "jpeg")
MIN_SIZE = 64  # output sizes below it decode in full: small images decode fast, and 8 x 8 DCT blocks are coarse there
SCALES = (8, 4)  # the scale-downs used, largest first
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # frame headers (not DHT, JPG, DAC): they hold the size


def draft_scale(crop_h: float, crop_w: float, size: int) -> int:
    """The largest libjpeg scale-down leaving a ``crop_h`` x ``crop_w`` region at >= ``size`` on both
    sides; 1 (a full decode) when none does, or when ``size`` is below :data:`MIN_SIZE`."""
    if size < MIN_SIZE:
        return 1
    return next((s for s in SCALES if min(crop_h, crop_w) >= size * s), 1)


def jpeg_size(data: bytes) -> Optional[tuple[int, int]]:
    """(width, height) from a JPEG's frame header, or None where the bytes are no JPEG with one before
    its first scan (the full decoder then reads them, or says why it cannot)."""
    if data[:2] != b"\xff\xd8":
        return None
    i, n = 2, len(data)
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
        elif marker in _SOF:
            if i + 9 > n:
                return None
            height, width = int.from_bytes(data[i + 5:i + 7], "big"), int.from_bytes(data[i + 7:i + 9], "big")
            return (width, height) if width and height else None
        elif marker == 0xDA:  # a scan before any frame header
            return None
        else:
            i += 2 + int.from_bytes(data[i + 2:i + 4], "big")
    return None


def open_jpeg(data: bytes) -> Optional[Image.Image]:
    """The JPEG's header parsed (no pixels decoded yet), or None for bytes Pillow does not take as a
    baseline/progressive JPEG (the full decoder then reads them, or says why it cannot)."""
    try:
        img = Image.open(io.BytesIO(data))
    except Exception:  # Pillow raises many types for bytes that are not an image
        return None
    return img if img.format == "JPEG" else None


def decode_reduced(img: Image.Image, scale: int) -> tuple[torch.Tensor, float]:
    """The opened JPEG ``img`` decoded at 1/``scale`` as uint8 RGB ``[3, h, w]``, and the factor from full-size
    to reduced pixel coordinates (libjpeg's reduced pixel k covers full-size pixels k * scale onwards)."""
    full_w, f = img.size[0], 1.0
    if scale > 1:
        _, reduced = img.draft("RGB", (img.size[0] // scale, img.size[1] // scale))
        f = reduced[2] / full_w
    return torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1), f

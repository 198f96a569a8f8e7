"""One record -> the bytes a shard stores for it: the source's bytes kept where they can be, else encoded."""
from __future__ import annotations

import io
from typing import Optional

import numpy as np
from PIL import Image

from .pixels import BadImage, bad_image_reason, eight_bit, upright
from .splits import Record

KEEP_FORMATS = {"JPEG": "jpg", "MPO": "jpg", "PNG": "png"}  # kept byte-for-byte; anything else becomes PNG
RESIZE_QUALITY = 95  # a kept JPEG that is turned or downscaled: close to its source
JPEG_QUALITY = 90  # ``encoding: jpeg``: what an image that is not a JPEG is stored as


def _encode(img: Image.Image, fmt: str, quality: int = RESIZE_QUALITY) -> bytes:
    buf = io.BytesIO()
    if KEEP_FORMATS.get(fmt) == "jpg":
        img.save(buf, "JPEG", quality=quality)
    else:
        img.save(buf, "PNG")
    return buf.getvalue()


def pixel_histogram(img: Image.Image) -> np.ndarray:
    """``[3, 256]`` counts of each 8-bit value per RGB channel: exact integer statistics, and PIL
    computes them in C (~10 us per CIFAR image, vs ~50 us for numpy sums)."""
    if img.mode == "L":
        return np.tile(np.asarray(img.histogram(), dtype=np.int64), (3, 1))  # gray = R = G = B
    rgb = img if img.mode == "RGB" else img.convert("RGB")
    return np.asarray(rgb.histogram(), dtype=np.int64).reshape(3, 256)


STATS_SPLIT = "train"  # the split whose pixel stats dataset.json records (what training normalises by)


def prepare(rec: Record, max_side: Optional[int], stats: bool = False, encoding: str = "source"):
    """Return (extension, bytes, pixel histogram or None) for one record; raise BadImage if it does not decode.

    Encoded JPEG/PNG inputs are verified by a full decode but written unchanged unless ``max_side``
    forces a downscale or an EXIF orientation tag turns them (:func:`.pixels.upright`: re-encoded the
    right way up, the loader ignores the tag); arrays are PNG-encoded (lossless), or with ``encoding="jpeg"``
    JPEG-encoded at :data:`JPEG_QUALITY`, as is every other image that is not a JPEG. ``encoding="raw"``: instead,
    the pixels the loader would decode from those bytes, as binary PPM. ``stats`` adds the
    :func:`pixel_histogram` of the stored image (for ``augment.mean/std: dataset``).
    """
    data = rec.load()  # FileNotFoundError etc. propagate: a missing input is a hard error
    if isinstance(data, np.ndarray):
        img = Image.fromarray(data)
        fmt, raw = "PNG", None
    else:
        try:
            img = Image.open(io.BytesIO(data))
            fmt = img.format
            img.load()
        except Exception as exn:  # PIL raises many types for corrupt/truncated data
            raise BadImage(bad_image_reason(exn, rec.source_path)) from exn
        raw = data
        turned = upright(img)
        if turned is not img:
            img, raw = turned, None
    img = eight_bit(img)  # a 16-bit PNG's bytes stay as they are: the loader decodes the same high bytes
    if max_side and max(img.size) > max_side:
        img = img.copy()
        img.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
        raw = None
    if fmt not in KEEP_FORMATS:
        fmt, raw = "PNG", None
        if img.mode not in ("1", "L", "LA", "P", "RGB", "RGBA"):
            img = img.convert("RGB")
    if encoding == "jpeg" and KEEP_FORMATS[fmt] != "jpg":
        fmt, raw = "JPEG", None
        img = img if img.mode in ("L", "RGB") else img.convert("RGB")
    ext, data = KEEP_FORMATS[fmt], raw if raw is not None else _encode(img, fmt, JPEG_QUALITY if encoding == "jpeg"
                                                                        else RESIZE_QUALITY)
    if encoding == "raw":
        from .codec import decode, encode_ppm  # torch and torchvision: only this path needs them (~1.3 CPU-s)

        ext, data = "ppm", encode_ppm(decode(ext, data))
    return ext, data, pixel_histogram(img) if stats else None

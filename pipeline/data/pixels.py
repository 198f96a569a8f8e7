"""Deep images as 8-bit pixels, and photos the right way up: the rules the shard stage and
``vit-pipeline predict`` share, so a model serves on the pixels it was trained on (kept light: predict
imports it)."""
from __future__ import annotations

import re

import numpy as np
from PIL import Image, ImageOps

# The image files the imagefolder source shards and predict reads from a folder.
IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff"}
DEEP_GRAY = ("I", "I;16", "I;16B", "I;16L", "I;16N")  # PIL's 16- and 32-bit integer grayscale modes
EXIF_ORIENTATION = 0x0112  # the tag a camera or phone sets instead of rotating the pixels; 1: upright


class BadImage(ValueError):
    """An input image that cannot be decoded; the shard stage skips and reports it."""


_OBJECT_REPR = re.compile(r"<[^<>]*? at 0x[0-9a-fA-F]+>")


def bad_image_reason(exc: BaseException, source_path: str) -> str:
    """``Class: message``, with object reprs (PIL names ``<_io.BytesIO object at 0x…>``, a new address
    every run) replaced by the image's path: bad_files.json must be byte-identical between identical runs,
    and a loader's error names the sample."""
    return f"{type(exc).__name__}: {_OBJECT_REPR.sub(repr(source_path), str(exc))}"


def eight_bit(img: Image.Image) -> Image.Image:
    """Deep grayscale (a 16-bit PNG, PGM or TIFF) as 8-bit by its high byte: what the loader decodes
    from a 16-bit PNG (:func:`.codec.decode`), so the pixel stats are those of the pixels trained on.
    PIL's own conversion clips at 255 instead of scaling. Float pixels have no range to scale by."""
    if img.mode == "F":
        raise BadImage("32-bit float pixels (PIL mode F) have no 8-bit scale; store the image as 8- or 16-bit")
    if img.mode not in DEEP_GRAY:
        return img
    high = np.asarray(img).astype(np.int64) >> 8  # 32-bit values beyond 16 bits saturate
    return Image.fromarray(np.clip(high, 0, 255).astype(np.uint8), "L")


def upright(img: Image.Image) -> Image.Image:
    """``img`` turned as its EXIF orientation says, as a photo viewer shows it (a phone's portrait photo
    is stored sideways with a tag saying so), without the tag; ``img`` itself when it has none or 1.
    torchvision's and timm's ImageFolder ignore the tag: a model trained there on photos saw some sideways."""
    if img.getexif().get(EXIF_ORIENTATION, 1) == 1:
        return img
    return ImageOps.exif_transpose(img)

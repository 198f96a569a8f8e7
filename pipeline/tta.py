"""Test-time views (``evaluate.tta``): which moved and mirrored copies of a test image are scored.

Without torch, so that checking params (``pipeline.config``) does not load it; :mod:`.inference` renders them.
"""
from __future__ import annotations

from typing import NamedTuple


class View(NamedTuple):
    """One test-time view of an image: moved by ``dy``, ``dx`` pixels (black where it moves in from
    outside, as in the train crops' zero padding), then mirrored or not."""
    dy: int = 0
    dx: int = 0
    mirror: bool = False


# evaluate.tta: the views of each test image whose logits are averaged, the image itself first. A
# mirror keeps the class of CIFAR / ImageNet-style photos (and is among their train augmentations),
# not of digits or text ("shift": moves only). A ViT's patch grid makes a 1-pixel move a different
# tokenisation of the image.
DIAGONAL_MOVES = ((0, 0), (-1, -1), (-1, 1), (1, -1), (1, 1))
TTA_VIEWS: dict[str, tuple[View, ...]] = {
    "none": (View(),),
    "hflip": (View(), View(mirror=True)),
    "shift": tuple(View(dy, dx) for dy, dx in DIAGONAL_MOVES),
    "hflip-shift": tuple(View(dy, dx, mirror) for dy, dx in DIAGONAL_MOVES for mirror in (False, True)),
}

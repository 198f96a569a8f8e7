"""Training FLOPs of the ViT per image, from its config, and the device's bf16 peak: a run's MFU.

Counted as :mod:`torch.utils.flop_counter` counts them (a multiply-add is 2 FLOPs; the matmuls, the patch
embedding and the attention, nothing element-wise), so the two agree: the backward pass costs twice the
forward, except the patch embedding's, which has no input gradient to compute (the images need none).
"""
from __future__ import annotations

import torch

# Dense bf16 tensor-core peaks per GPU (vendor data sheets; SXM parts), matched against the device's name.
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}


def flops_per_image(model: dict, image_size: int | None = None) -> float:
    """Forward + backward FLOPs of one training image for the ``ViTConfig`` dict ``model`` (at its own
    ``image_size``, or at ``image_size``)."""
    size = image_size or model["image_size"]
    h, w = (size, size) if isinstance(size, int) else size
    ph, pw = (model["patch_size"],) * 2 if isinstance(model["patch_size"], int) else model["patch_size"]
    patches = (h // ph) * (w // pw)
    tokens, d = patches + 1, model["embed_dim"]  # the [CLS] token
    hidden = int(d * model.get("mlp_ratio", 4.0))
    embed = 2 * patches * model.get("in_chans", 3) * ph * pw * d
    # the last block of a [CLS]-pooled model computes its queries, attention and MLP for that token alone
    last_rows = 1 if model.get("pool", "cls") == "cls" else tokens
    blocks = (model["depth"] - 1) * _block(tokens, tokens, d, hidden) + _block(tokens, last_rows, d, hidden)
    head = 2 * d * model.get("num_classes", 0)
    return 2 * embed + 3 * (blocks + head)


def _block(tokens: int, rows: int, d: int, hidden: int) -> int:
    """Forward FLOPs of a block whose ``rows`` queries attend to ``tokens`` keys."""
    linears = 2 * (tokens * 2 * d * d + rows * (d * d + d * d + 2 * d * hidden))  # k v; q, proj, fc1, fc2
    return linears + 2 * 2 * rows * tokens * d  # q @ k^T and the weights @ v, over all heads


def device_peak(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s; None where it is not in :data:`PEAK_BF16` (a CPU, an unknown
    GPU): no MFU then, rather than one against a guessed peak."""
    return peak_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def peak_of(name: str) -> float | None:
    """The bf16 peak of the GPU called ``name`` (``torch.cuda.get_device_name``), None if unknown."""
    return next((v for k, v in PEAK_BF16.items() if k in name), None)

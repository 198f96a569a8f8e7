"""Per-layer attention probabilities, for visualisation and attention rollout.

The model uses the fused SDPA kernel, which never materialises the softmax, so the
maps are recomputed from each block's normalised input and its qkv weights.
"""
from __future__ import annotations

import torch

from .vit import VisionTransformer

__all__ = ["attention_maps", "block_attention"]


def block_attention(block, x_norm: torch.Tensor) -> torch.Tensor:
    """Softmax attention ``[B, heads, T, T]`` of ``block`` given ``norm1`` output ``x_norm``."""
    q, k, _ = block.attn.split_qkv(x_norm)
    logits = (q.float() * block.attn.scale) @ k.float().transpose(-2, -1)
    return logits.softmax(dim=-1).to(x_norm.dtype)


def attention_maps(model: VisionTransformer, images: torch.Tensor) -> list[torch.Tensor]:
    """One ``[B, heads, T, T]`` tensor per block (rows sum to 1, before attention dropout).

    Runs ``forward_features`` once with hooks on every ``norm1``. Follows the
    caller's grad mode: wrap in ``torch.no_grad()`` when only visualising.
    """
    maps: list[torch.Tensor] = []

    def hook_for(block):
        return lambda module, inputs, output: maps.append(block_attention(block, output))

    handles = [block.norm1.register_forward_hook(hook_for(block)) for block in model.blocks]
    try:
        model.forward_features(images)
    finally:
        for h in handles:
            h.remove()
    return maps

"""Map timm / torchvision ViT state dicts onto this model's parameter names.

Our names follow timm, so timm is (nearly) an identity map; torchvision renames
every module. Position embeddings are resampled when the target grid differs
(e.g. an ImageNet 14x14 checkpoint fine-tuned at a different resolution).
"""
from __future__ import annotations

import math
import re

import torch

from .resample import _as_pair, resample_pos_embed
from .vit_config import LAYOUTS, SOURCES

__all__ = ["convert_state_dict", "SOURCES", "LAYOUTS"]

_PARAM = r"(weight|bias)"
_BLOCK_PARTS = ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")
_TIMM_KEY = re.compile(
    rf"^(cls_token|pos_embed|patch_embed\.proj\.{_PARAM}|norm\.{_PARAM}|head\.{_PARAM}"
    rf"|blocks\.\d+\.({'|'.join(re.escape(p) for p in _BLOCK_PARTS)})\.{_PARAM})$"
)

_TV_RENAMES = [  # (regex on torchvision key, replacement in our naming)
    (r"^class_token$", "cls_token"),
    (r"^conv_proj\.", "patch_embed.proj."),
    (r"^encoder\.pos_embedding$", "pos_embed"),
    (r"^encoder\.ln\.", "norm."),
    (r"^heads\.head\.", "head."),
    (r"^encoder\.layers\.encoder_layer_(\d+)\.ln_1\.", r"blocks.\1.norm1."),
    (r"^encoder\.layers\.encoder_layer_(\d+)\.ln_2\.", r"blocks.\1.norm2."),
    (r"^encoder\.layers\.encoder_layer_(\d+)\.self_attention\.in_proj_(weight|bias)$", r"blocks.\1.attn.qkv.\2"),
    (r"^encoder\.layers\.encoder_layer_(\d+)\.self_attention\.out_proj\.", r"blocks.\1.attn.proj."),
    (r"^encoder\.layers\.encoder_layer_(\d+)\.mlp\.(0|linear_1)\.", r"blocks.\1.mlp.fc1."),
    (r"^encoder\.layers\.encoder_layer_(\d+)\.mlp\.(3|linear_2)\.", r"blocks.\1.mlp.fc2."),
]


def _rename_torchvision(key: str) -> str | None:
    for pattern, repl in _TV_RENAMES:
        new, n = re.subn(pattern, repl, key)
        if n:
            return new
    return None


def _with_cls_position(pos_embed: torch.Tensor, source_grid) -> torch.Tensor:
    """timm's ``no_embed_class=True`` layout (DeiT III, FlexiViT) stores no [CLS] position: it adds the grid's
    position embedding before prepending the class token, which equals a zero [CLS] entry, so add one.

    Told apart by the token count: the grid's alone (``source_grid``, else a square; ``1 + side**2`` never is).
    """
    n = pos_embed.shape[1]
    if source_grid is None:
        grid_only = math.isqrt(n) ** 2 == n
    else:
        gh, gw = _as_pair("source_grid", source_grid)
        grid_only = n == gh * gw
    if not grid_only:
        return pos_embed
    return torch.cat([pos_embed.new_zeros(pos_embed.shape[0], 1, pos_embed.shape[2]), pos_embed], dim=1)


def convert_state_dict(
    state_dict: dict[str, torch.Tensor],
    source: str,
    *,
    grid=None,
    source_grid=None,
    mode: str = "bicubic",
    antialias: bool = True,
    drop_head: bool = False,
) -> dict[str, torch.Tensor]:
    """Return a state dict loadable (``strict=True``) into :class:`VisionTransformer`.

    ``source``: ``"timm"`` (class token, token pooling, no register tokens / layer
    scale / fc_norm; ``no_embed_class`` checkpoints get a zero [CLS] position) or
    ``"torchvision"`` (``vit_*`` without ``representation_size``).
    ``grid``: the target patch grid ``(h, w)``; the position embedding is resampled
    to it if it differs from ``source_grid`` (default: square; it also tells timm's
    two position layouts apart). ``drop_head`` removes the classifier, for fine-tuning
    on a new label set (load with ``strict=False`` or after ``reset_classifier``).
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    out: dict[str, torch.Tensor] = {}
    unsupported = []
    for key, value in state_dict.items():
        if source == "timm":
            new = key if _TIMM_KEY.match(key) else None
        else:
            new = _rename_torchvision(key)
        if new is None:
            unsupported.append(key)
        else:
            out[new] = value
    if unsupported:
        raise ValueError(
            f"{len(unsupported)} {source} key(s) have no equivalent in this ViT "
            f"(register tokens, layer scale, fc_norm, pre_logits ... are not supported): {unsupported[:8]}"
        )
    if "pos_embed" not in out or "cls_token" not in out:
        raise ValueError(f"not a class-token ViT {source} state dict: missing position embedding or class token")
    if source == "timm":
        out["pos_embed"] = _with_cls_position(out["pos_embed"], source_grid)
    if grid is not None:
        out["pos_embed"] = resample_pos_embed(
            out["pos_embed"], grid, old_grid=source_grid, num_prefix_tokens=1, mode=mode, antialias=antialias
        )
    if drop_head:
        out = {k: v for k, v in out.items() if not k.startswith("head.")}
    return out

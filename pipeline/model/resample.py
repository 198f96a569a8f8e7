"""Resize learned position embeddings and patch kernels to a new geometry.

Used when fine-tuning at a different resolution (more / fewer patches) or with a
different patch size (FlexiViT-style), and when loading foreign checkpoints.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

from .vit_config import RESAMPLE_MODES as MODES

__all__ = ["resample_pos_embed", "resample_patch_embed", "MODES"]
_ANTIALIAS_MODES = ("bilinear", "bicubic")  # the only modes where torch accepts antialias=True


def _as_pair(name: str, v) -> tuple[int, int]:
    if isinstance(v, int):
        v = (v, v)
    v = tuple(int(x) for x in v)
    if len(v) != 2 or min(v) <= 0:
        raise ValueError(f"{name} must be a positive int or (h, w) pair, got {v!r}")
    return v


def _interpolate(x: torch.Tensor, size: tuple[int, int], mode: str, antialias: bool) -> torch.Tensor:
    """F.interpolate on an NCHW float tensor, passing only the kwargs ``mode`` supports."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    kwargs = {}
    if mode in _ANTIALIAS_MODES:
        kwargs = dict(align_corners=False, antialias=antialias)
    return F.interpolate(x, size=size, mode=mode, **kwargs)


def resample_pos_embed(
    pos_embed: torch.Tensor,
    new_grid,
    *,
    old_grid=None,
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = True,
) -> torch.Tensor:
    """Interpolate a ``[B, prefix + gh*gw, D]`` position embedding to ``new_grid``.

    Prefix ([CLS]) entries carry no spatial meaning and are copied unchanged. The
    grid is interpolated in float32 (bicubic in half precision is lossy) and cast
    back. ``old_grid`` defaults to a square grid. An unchanged grid returns an
    exact copy.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if pos_embed.ndim != 3:
        raise ValueError(f"pos_embed must be [B, tokens, dim], got shape {tuple(pos_embed.shape)}")
    new_grid = _as_pair("new_grid", new_grid)
    n = pos_embed.shape[1] - num_prefix_tokens
    if old_grid is None:
        side = math.isqrt(max(n, 0))
        if side * side != n:
            raise ValueError(
                f"pos_embed has {n} grid tokens (after {num_prefix_tokens} prefix), not a square; pass old_grid=(h, w)"
            )
        old_grid = (side, side)
    old_grid = _as_pair("old_grid", old_grid)
    if old_grid[0] * old_grid[1] != n:
        raise ValueError(
            f"old_grid {old_grid} implies {old_grid[0] * old_grid[1]} grid tokens but pos_embed has {n} "
            f"({pos_embed.shape[1]} tokens - {num_prefix_tokens} prefix)"
        )
    if new_grid == old_grid:
        return pos_embed.clone()

    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    b, _, d = grid.shape
    grid = grid.float().reshape(b, *old_grid, d).permute(0, 3, 1, 2)
    grid = _interpolate(grid, new_grid, mode, antialias)
    grid = grid.permute(0, 2, 3, 1).reshape(b, new_grid[0] * new_grid[1], d).to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


@lru_cache(maxsize=16)
def _pi_resize_solver(old: tuple[int, int], new: tuple[int, int], mode: str, antialias: bool) -> torch.Tensor:
    """``pinv(M^T)`` [new_n, old_n] in float64 where ``M`` is the linear resize old -> new.

    Column ``i`` of ``M`` is the resized ``i``-th basis image, so ``resize(x) = M x``.
    """
    old_n = old[0] * old[1]
    basis = torch.eye(old_n, dtype=torch.float64).reshape(old_n, 1, *old)
    resized = _interpolate(basis, new, mode, antialias)  # [old_n, 1, *new] (float64 works on CPU)
    m = resized.reshape(old_n, -1).T  # [new_n, old_n]
    return torch.linalg.pinv(m.T)  # [new_n, old_n]


def resample_patch_embed(weight: torch.Tensor, new_patch_size, *, mode: str = "bicubic", antialias: bool = True):
    """Resize a ``[D, C, ph, pw]`` patch kernel with FlexiViT's pseudo-inverse (PI) resize.

    Naively interpolating the kernel changes the token each patch produces. PI-resize
    instead solves ``<resize(x), w_new> = <x, w_old>`` for all patches ``x``
    (least-squares when shrinking), so a patch and its resized version embed to
    (nearly) the same token. Exact for upsampling; approximate when downsampling.
    """
    if weight.ndim != 4:
        raise ValueError(f"weight must be [D, C, ph, pw], got shape {tuple(weight.shape)}")
    old = (int(weight.shape[-2]), int(weight.shape[-1]))
    new = _as_pair("new_patch_size", new_patch_size)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if new == old:
        return weight.clone()
    solver = _pi_resize_solver(old, new, mode, bool(antialias)).to(weight.device)
    d, c = weight.shape[:2]
    flat = weight.detach().reshape(d * c, old[0] * old[1]).double()
    out = flat @ solver.T  # [D*C, new_n]
    return out.reshape(d, c, *new).to(weight.dtype)

"""Vision Transformer (Dosovitskiy et al., 2021) as a few small modules.

Parameter names match timm's ``VisionTransformer`` so timm checkpoints load with
an (almost) identity key mapping; see ``convert.py``.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .mimetic import mimetic_init_
from .resample import resample_patch_embed, resample_pos_embed
from .vit_config import WEIGHT_INITS, ViTConfig

__all__ = ["PatchEmbed", "Attention", "Mlp", "DropPath", "Block", "VisionTransformer"]


def _may_overwrite() -> bool:
    """Whether activations may be overwritten in place: only while autograd records nothing, now or later.

    A trace (TorchScript export traces under ``no_grad``) records the ops it sees; in-place ones would then
    break that graph when it runs with grad (saliency, fine-tuning the exported model).
    """
    return not torch.is_grad_enabled() and not torch.jit.is_tracing()


def _dropout(p: float) -> nn.Module:
    # Identity when disabled: no module-call or kernel cost in the hot loop.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class PatchEmbed(nn.Module):
    """Non-overlapping patches -> tokens. A strided conv is a per-patch linear map."""

    def __init__(self, patch_size: tuple[int, int], in_chans: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # [B, D, gh, gw] -> [B, gh*gw, D]


class Attention(nn.Module):
    """Multi-head self-attention: one fused qkv matmul + PyTorch's fused SDPA kernel."""

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool = True, attn_drop: float = 0.0, proj_drop: float = 0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.attn_drop = attn_drop  # a float: SDPA applies it inside the kernel
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = _dropout(proj_drop)

    def split_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[B, T, D]`` -> q, k, v each ``[B, heads, T, head_dim]`` (strided views, no copy).

        Unbinding dim 2 before transposing (rather than timm's single permute) lets
        autograd stack the q/k/v grads straight into the ``[B, T, 3, H, hd]`` layout
        of the qkv output: one copy fewer per block in backward (5-10% of attention time).
        """
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).unbind(2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = q.shape
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, -1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._attend(*self.split_qkv(x))

    def forward_prefix(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """Output for the first ``n`` tokens only; every token still serves as key / value.

        Queries for the other tokens are never computed (row slices of the fused
        qkv weight are contiguous views, so this costs no copies).
        """
        b, t, d = x.shape
        w, bias = self.qkv.weight, self.qkv.bias
        q = F.linear(x[:, :n], w[:d], None if bias is None else bias[:d])
        kv = F.linear(x, w[d:], None if bias is None else bias[d:])
        k, v = kv.view(b, t, 2, self.num_heads, self.head_dim).unbind(2)
        q = q.view(b, n, self.num_heads, self.head_dim)
        return self._attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


class Mlp(nn.Module):
    """Linear -> GELU -> Linear, with dropout after each (shared, stateless).

    Without autograd (eager inference) GELU overwrites fc1's output instead of allocating a second
    ``[tokens, 4 * dim]`` buffer: ~10% of a ViT-Ti/16 forward on CPU. (Hooks on ``act`` therefore
    only fire with grad enabled or while tracing.)
    """

    def __init__(self, dim: int, hidden_dim: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = _dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        x = torch.ops.aten.gelu_(x, approximate=self.act.approximate) if _may_overwrite() else self.act(x)
        return self.drop(self.fc2(self.drop(x)))


class DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample (Huang et al., 2016).

    Survivors are scaled by ``1 / keep`` so the expectation matches eval mode.
    """

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = float(drop_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep).div_(keep)
        return x * mask

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ViTConfig, drop_path: float = 0.0):
        super().__init__()
        dim = cfg.embed_dim
        self.norm1 = nn.LayerNorm(dim, eps=cfg.layer_norm_eps)
        self.attn = Attention(dim, cfg.num_heads, cfg.qkv_bias, cfg.attn_drop_rate, cfg.drop_rate)
        self.norm2 = nn.LayerNorm(dim, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(dim, int(dim * cfg.mlp_ratio), cfg.drop_rate)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x)))
        if _may_overwrite():  # x is our own buffer now; autograd needs none of it kept
            return x.add_(self.drop_path(self.mlp(self.norm2(x))))
        return x + self.drop_path(self.mlp(self.norm2(x)))

    def forward_prefix(self, x: torch.Tensor, n: int = 1) -> torch.Tensor:
        """Block output ``[B, n, D]`` for the first ``n`` tokens (see ``VisionTransformer.forward``)."""
        out = x[:, :n] + self.drop_path(self.attn.forward_prefix(self.norm1(x), n))
        return out + self.drop_path(self.mlp(self.norm2(out)))


class VisionTransformer(nn.Module):
    """ViT with a [CLS] token and learned absolute position embeddings.

    ``forward(images) = forward_head(forward_features(images))``. ``model.config``
    always describes the current geometry, so it can be saved and rebuilt. ``weight_init`` (one of
    ``WEIGHT_INITS``) only says how the new weights are drawn, so it is not part of the config.
    """

    num_prefix_tokens = 1  # the [CLS] token

    def __init__(self, config: ViTConfig, weight_init: str = "timm"):
        super().__init__()
        self.config = config
        self.grad_checkpointing = False  # a training setting, not part of the architecture or its config
        d = config.embed_dim
        self.patch_embed = PatchEmbed(config.patch_size, config.in_chans, d)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_prefix_tokens + config.num_patches, d))
        self.pos_drop = _dropout(config.drop_rate)
        # Stochastic depth grows linearly with depth: early blocks are kept more often.
        n = config.depth
        rates = [config.drop_path_rate * i / (n - 1) if n > 1 else 0.0 for i in range(n)]
        self.blocks = nn.Sequential(*[Block(config, r) for r in rates])
        self.norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.head = nn.Linear(d, config.num_classes) if config.num_classes > 0 else nn.Identity()
        self.init_weights(weight_init)

    def init_weights(self, mode: str = "timm") -> None:
        """timm's default ViT init: trunc-normal(.02) linears and pos-embed, tiny cls token; with
        ``mode="mimetic"`` each block's attention is then drawn as in trained ViTs (:mod:`.mimetic`)."""
        if mode not in WEIGHT_INITS:
            raise ValueError(f"weight_init must be one of {WEIGHT_INITS}, got {mode!r}")
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if mode == "mimetic":
            for block in self.blocks:
                mimetic_init_(block.attn)

    # ------------------------------------------------------------------ forward
    def _check_input(self, x: torch.Tensor) -> tuple[int, int]:
        cfg = self.config
        if x.ndim != 4 or x.shape[1] != cfg.in_chans:
            raise ValueError(f"expected images [B, {cfg.in_chans}, H, W], got shape {tuple(x.shape)}")
        h, w = x.shape[-2:]
        ph, pw = cfg.patch_size
        if cfg.dynamic_img_size:
            if h % ph or w % pw:
                raise ValueError(f"input size {(h, w)} is not divisible by patch_size {cfg.patch_size}")
        elif (h, w) != cfg.image_size:
            raise ValueError(
                f"input size {(h, w)} does not match the model's image_size {cfg.image_size}; "
                f"call model.set_input_size({(h, w)}) to adapt the model, or build it with dynamic_img_size=True"
            )
        return h // ph, w // pw

    def _pos_embed(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        pos = self.pos_embed
        if grid != self.config.grid_size:  # only reachable with dynamic_img_size
            pos = resample_pos_embed(pos, grid, old_grid=self.config.grid_size,
                                     num_prefix_tokens=self.num_prefix_tokens)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + pos
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images ``[B, C, H, W]`` -> normalised tokens ``[B, 1 + N, D]`` (token 0 is [CLS])."""
        grid = self._check_input(x)
        x = self._pos_embed(self.patch_embed(x), grid)
        for block in self.blocks:
            x = self._run(block, x)
        return self.norm(x)

    def pool(self, tokens: torch.Tensor) -> torch.Tensor:
        """Tokens -> one ``[B, D]`` vector per image ([CLS] token or mean of patch tokens)."""
        if self.config.pool == "cls":
            return tokens[:, 0]
        return tokens[:, self.num_prefix_tokens :].mean(dim=1)

    def forward_head(self, tokens: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = self.pool(tokens)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits; equal to ``forward_head(forward_features(x))``.

        With [CLS] pooling only token 0 of the last block reaches the head, so the
        last block computes just that token (its attention still reads every token).
        Exact, and ~1/depth of the FLOPs fewer (most with short sequences). Forward
        hooks on the last ``Block`` module itself therefore do not fire here; use
        ``forward_features`` when you need every output token.
        """
        if self.config.pool != "cls":
            return self.forward_head(self.forward_features(x))
        grid = self._check_input(x)
        x = self._pos_embed(self.patch_embed(x), grid)
        *body, last = self.blocks
        for block in body:
            x = self._run(block, x)
        x = self.norm(self._run(last.forward_prefix, x, self.num_prefix_tokens))
        return self.head(x[:, 0])

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations during backward instead of keeping them (timm's name).

        Training memory then holds one ``[B, T, D]`` tensor per block instead of every intermediate
        (qkv, attention output, the 4x-wide MLP hidden, norms), for about one more forward pass of
        compute. Results are unchanged: the recomputation replays the saved RNG state, so dropout and
        stochastic depth draw the same masks. Inference (no grad) is not affected.
        """
        self.grad_checkpointing = enable

    def _run(self, fn, x: torch.Tensor, *args) -> torch.Tensor:
        """``fn(x, *args)``, checkpointed when enabled and autograd records (non-reentrant: works
        with DDP, autocast and ``torch.compile``)."""
        if self.grad_checkpointing and torch.is_grad_enabled() and not torch.jit.is_tracing():
            return checkpoint(fn, x, *args, use_reentrant=False)
        return fn(x, *args)

    # ------------------------------------------------------------ adaptation
    @torch.no_grad()
    def set_input_size(self, image_size=None, patch_size=None, *, mode: str = "bicubic",
                       antialias: bool = True) -> None:
        """Move the model in place to a new image and/or patch size (fine-tuning at a new resolution).

        The position embedding is resampled to the new patch grid; a new patch size
        also PI-resizes the patch kernel (FlexiViT) so tokens stay comparable.
        Replaces parameters: build the optimizer *after* calling this.
        """
        cfg = self.config
        new_cfg = dataclasses.replace(
            cfg,
            image_size=cfg.image_size if image_size is None else image_size,
            patch_size=cfg.patch_size if patch_size is None else patch_size,
        )  # __post_init__ validates divisibility
        if new_cfg.patch_size != cfg.patch_size:
            old = self.patch_embed.proj
            new = PatchEmbed(new_cfg.patch_size, cfg.in_chans, cfg.embed_dim).to(old.weight.device, old.weight.dtype)
            new.proj.weight.copy_(resample_patch_embed(old.weight, new_cfg.patch_size, mode=mode, antialias=antialias))
            new.proj.bias.copy_(old.bias)
            new.proj.weight.requires_grad_(old.weight.requires_grad)
            new.proj.bias.requires_grad_(old.bias.requires_grad)
            self.patch_embed = new
        if new_cfg.grid_size != cfg.grid_size:
            pos = resample_pos_embed(
                self.pos_embed.data, new_cfg.grid_size, old_grid=cfg.grid_size,
                num_prefix_tokens=self.num_prefix_tokens, mode=mode, antialias=antialias,
            )
            self.pos_embed = nn.Parameter(pos, requires_grad=self.pos_embed.requires_grad)
        self.config = new_cfg

    def reset_classifier(self, num_classes: int) -> None:
        """Replace the head for a new label set, zero-initialised (as timm's fine-tuning heads): every
        class starts at the same logit, so the first steps do not undo the pretrained features."""
        new_cfg = dataclasses.replace(self.config, num_classes=num_classes)  # validates num_classes
        ref = self.norm.weight
        if num_classes == 0:
            self.head = nn.Identity()
        else:
            head = nn.Linear(new_cfg.embed_dim, num_classes).to(ref.device, ref.dtype)
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)
            self.head = head
        self.config = new_cfg

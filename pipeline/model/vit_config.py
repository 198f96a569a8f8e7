"""Model hyper-parameters as one validated, JSON-safe dataclass, and the named choices of params.yaml's
``model`` and fine-tune sections.

Validation happens once, at construction, so every later consumer (the model,
the checkpoint loader, the training loop) can trust the numbers. Without torch: ``pipeline.config``
checks params with this module in processes that never build a model (the shard stage).
"""
from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import Any, Protocol

__all__ = ["ViTConfig", "PRESETS", "WEIGHT_INITS", "check_divisible", "check_heads", "make_config", "section_config"]

POOLS = ("cls", "mean")
# How a new model's weights are drawn (VisionTransformer.init_weights): "timm", timm's default ViT init;
# "mimetic", the same plus self-attention initialised as trained ViTs look (Trockman & Kolter, 2023).
WEIGHT_INITS = ("timm", "mimetic")
RESAMPLE_MODES = ("nearest", "bilinear", "bicubic", "area")  # how resample.py resizes position embeddings
SOURCES = ("timm", "torchvision")  # foreign key layouts convert.py maps onto this model's
LAYOUTS = ("pipeline", *SOURCES)  # finetune.init_source: whose key layout a weights file has

# Width / depth / heads of the standard ViT family (Dosovitskiy et al., DeiT)
# plus two CPU-sized presets for smoke tests and tiny data sets.
PRESETS: dict[str, dict[str, Any]] = {
    "nano": dict(embed_dim=64, depth=4, num_heads=4, mlp_ratio=4.0),
    "micro": dict(embed_dim=128, depth=6, num_heads=4, mlp_ratio=4.0),
    "tiny": dict(embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0),
    "small": dict(embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0),
    "base": dict(embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0),
    "large": dict(embed_dim=1024, depth=24, num_heads=16, mlp_ratio=4.0),
    "huge": dict(embed_dim=1280, depth=32, num_heads=16, mlp_ratio=4.0),
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pair(name: str, value: Any) -> tuple[int, int]:
    """Accept ``16``, ``(16, 16)`` or ``[16, 16]`` (JSON) and return ``(h, w)``."""
    if _is_int(value):
        value = (value, value)
    if not isinstance(value, (tuple, list)) or len(value) != 2 or not all(_is_int(v) for v in value):
        raise ValueError(f"{name} must be a positive int or an (h, w) pair of positive ints, got {value!r}")
    h, w = value
    if h <= 0 or w <= 0:
        raise ValueError(f"{name} must be positive, got {tuple(value)!r}")
    return int(h), int(w)


def check_divisible(size: int, patch: int, size_name: str = "image_size", patch_name: str = "patch_size") -> None:
    """The patch grid must tile the image; the message names the nearest sizes that would.

    Shared with ``pipeline.config.validate``, which passes the params.yaml keys as the names.
    """
    if size % patch:
        lo, hi = size // patch * patch, (size // patch + 1) * patch
        valid = f"{lo} or {hi}" if lo else str(hi)
        raise ValueError(f"{size_name}: {size} is not divisible by {patch_name}={patch} (nearest valid sizes: {valid})")


def check_heads(embed_dim: int, num_heads: int, heads_name: str = "num_heads", width_name: str = "embed_dim") -> None:
    """Attention heads must split the width evenly; the message lists the head counts that do."""
    if embed_dim % num_heads:
        valid = [h for h in range(1, embed_dim + 1) if embed_dim % h == 0]
        raise ValueError(f"{heads_name}: {num_heads} does not divide {width_name}={embed_dim} "
                         f"(valid head counts: {', '.join(map(str, valid))})")


@dataclass
class ViTConfig:
    """Everything needed to rebuild a :class:`VisionTransformer`.

    ``image_size`` / ``patch_size`` accept an int (square) or an ``(h, w)`` pair;
    they are stored as tuples. All other fields are keyword-only.
    """

    image_size: tuple[int, int]
    patch_size: tuple[int, int]
    _: KW_ONLY
    embed_dim: int
    depth: int
    num_heads: int
    in_chans: int = 3
    num_classes: int = 10
    mlp_ratio: float = 4.0
    qkv_bias: bool = True
    drop_rate: float = 0.0  # after the pos-embed add, inside the MLP and after attn proj
    attn_drop_rate: float = 0.0
    drop_path_rate: float = 0.0  # stochastic depth of the *last* block (linear ramp from 0)
    pool: str = "cls"  # "cls" (token 0) or "mean" (mean of patch tokens)
    dynamic_img_size: bool = False  # accept any H x W divisible by patch_size
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        self.image_size = _pair("image_size", self.image_size)
        self.patch_size = _pair("patch_size", self.patch_size)
        for name in ("embed_dim", "depth", "num_heads", "in_chans"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not _is_int(self.num_classes) or self.num_classes < 0:
            raise ValueError(f"num_classes must be an int >= 0 (0 = no head), got {self.num_classes!r}")
        for i, (img, patch) in enumerate(zip(self.image_size, self.patch_size)):
            check_divisible(img, patch, f"image_size[{i}]", f"patch_size[{i}]")
        check_heads(self.embed_dim, self.num_heads)
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if not (isinstance(self.mlp_ratio, (int, float)) and self.mlp_ratio > 0):
            raise ValueError(f"mlp_ratio must be a positive number, got {self.mlp_ratio!r}")
        for name in ("drop_rate", "attn_drop_rate", "drop_path_rate"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0.0 <= v < 1.0):
                raise ValueError(f"{name} must be a float in [0, 1), got {v!r}")
        if not (isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0):
            raise ValueError(f"layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if int(self.embed_dim * self.mlp_ratio) <= 0:
            raise ValueError(f"embed_dim * mlp_ratio must be >= 1, got {self.embed_dim} * {self.mlp_ratio}")

    @property
    def grid_size(self) -> tuple[int, int]:
        """Patch grid ``(rows, cols)`` at ``image_size``."""
        return self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1]

    @property
    def num_patches(self) -> int:
        gh, gw = self.grid_size
        return gh * gw

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (tuples become lists); ``from_dict`` inverts it."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ViTConfig":
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ValueError(f"unknown ViTConfig field(s) {unknown}; valid fields: {valid}")
        return cls(**d)


class ModelSection(Protocol):
    """What the model package reads of params.yaml's ``model`` section (``pipeline.config.ModelConfig``),
    named here so that the model package depends on nothing above it."""

    preset: str
    patch_size: int
    pool: str
    drop_path_rate: float
    weight_init: str

    def overrides(self) -> dict[str, Any]: ...


def make_config(
    preset: str,
    *,
    patch_size,
    image_size,
    num_classes: int,
    **overrides,
) -> ViTConfig:
    """Preset widths + explicit geometry + ``overrides`` (ViTConfig field names)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; valid presets: {sorted(PRESETS)}")
    valid = {f.name for f in dataclasses.fields(ViTConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(f"unknown override(s) {unknown}; valid ViTConfig fields: {sorted(valid)}")
    fields = dict(PRESETS[preset])
    fields.update(patch_size=patch_size, image_size=image_size, num_classes=num_classes, **overrides)
    return ViTConfig(**fields)


def section_config(model: ModelSection, *, image_size, num_classes: int, patch_size=None) -> ViTConfig:
    """params.yaml's ``model`` section at one geometry (``patch_size``: ``model.patch_size`` if None).

    The one place the section becomes a :class:`ViTConfig` (the stages and benchmarks build from it,
    ``pipeline.config.validate`` checks with it), so a new ``model.*`` key is wired once.
    """
    return make_config(model.preset, patch_size=patch_size or model.patch_size, image_size=image_size,
                       num_classes=num_classes, pool=model.pool, drop_path_rate=model.drop_path_rate,
                       **model.overrides())

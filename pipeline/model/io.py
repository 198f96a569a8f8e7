"""Checkpoint directory = ``model.safetensors`` (weights) + ``config.json`` (how to rebuild).

safetensors instead of pickle: loading cannot execute code and is zero-copy.
Each file is written to a temp file in the same directory, synced and ``os.replace``d into place
(:func:`pipeline.utils.atomic_write`), so a crash never leaves a half-written checkpoint under the real name.
"""
from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from pipeline.utils import CONFIG_NAME, atomic_write, error_summary

from .vit import VisionTransformer
from .vit_config import ViTConfig

__all__ = ["save_model", "save_config", "load_model", "read_model_file", "ModelFileError", "WEIGHTS_NAME", "CONFIG_NAME"]

WEIGHTS_NAME = "model.safetensors"
REDO = "write it again (a stage's output: dvc repro re-runs the stage that wrote it)"


class ModelFileError(ValueError):
    """A model file that exists but cannot be used; the message names it, what is wrong and what to do."""


def read_model_file(path: Path, loader: Callable[[Path], Any], redo: str = REDO) -> Any:
    """``loader(path)``; a corrupt or incomplete file becomes a :class:`ModelFileError` naming it, a
    missing one a ``FileNotFoundError`` that also says what to do (``redo``)."""
    try:
        return loader(path)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"not found; {redo}", str(path)) from None
    except ModelFileError:
        raise
    except Exception as exc:  # json, safetensors and torch each raise their own types for a damaged file
        raise ModelFileError(f"{path}: cannot be loaded, the file is corrupt or incomplete "
                             f"({error_summary(exc)}); {redo}") from None


def save_model(model: VisionTransformer, directory, extra: dict[str, Any] | None = None) -> Path:
    """Write weights then config (config last: its presence marks a complete checkpoint).

    ``extra`` (JSON-serialisable, e.g. epoch, metrics, class names) is merged into
    ``config.json`` next to ``"model"``.
    """
    text = _config_text(model, extra)  # fail early on non-JSON extras
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    atomic_write(directory / WEIGHTS_NAME, lambda p: save_file(state, p, metadata={"format": "pt"}))
    atomic_write(directory / CONFIG_NAME, lambda p: Path(p).write_text(text))
    return directory


def save_config(model: VisionTransformer, directory, extra: dict[str, Any] | None = None) -> Path:
    """``config.json`` alone, as :func:`save_model` writes it: for an export without ``model.safetensors``
    (its other formats are read with it, for the classes and preprocessing)."""
    text = _config_text(model, extra)
    atomic_write(Path(directory) / CONFIG_NAME, lambda p: Path(p).write_text(text))
    return Path(directory) / CONFIG_NAME


def _config_text(model: VisionTransformer, extra: dict[str, Any] | None) -> str:
    extra = dict(extra or {})
    if "model" in extra:
        raise ValueError("extra must not contain the key 'model' (reserved for the model config)")
    return json.dumps({"model": model.config.to_dict(), **extra}, indent=2, sort_keys=False) + "\n"


def load_model(directory, *, map_location: str | torch.device = "cpu",
               redo: str = REDO) -> tuple[VisionTransformer, dict[str, Any]]:
    """Rebuild the model from ``config.json`` and load weights strictly.

    Returns ``(model, meta)`` where ``meta`` is the full ``config.json`` dict
    (``meta["model"]`` plus whatever ``extra`` was saved). A damaged file is a :class:`ModelFileError`
    that names it and ends with ``redo``, what the user should do.
    """
    config, weights = Path(directory) / CONFIG_NAME, Path(directory) / WEIGHTS_NAME
    meta = read_model_file(config, lambda p: json.loads(p.read_text()), redo)
    if not isinstance(meta, dict) or "model" not in meta:
        raise ModelFileError(f"{config} has no 'model' section; {redo}")
    try:
        model = VisionTransformer(ViTConfig.from_dict(meta["model"]))
    except (TypeError, ValueError) as exc:  # missing, unknown or invalid fields (hand-edited, or another version's)
        raise ModelFileError(f"{config}: its 'model' section does not describe a ViT this version can build "
                             f"({error_summary(exc)}); {redo}") from None
    state = read_model_file(weights, lambda p: load_file(str(p), device=str(map_location)), redo)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ModelFileError(f"{weights}: does not fit {config} ({error_summary(exc)}); {redo}") from None
    return model.to(map_location), meta

"""Moved to :mod:`pipeline.training` (issue 15: no ``pipeline/train/stages.py`` beside ``stages/``).

Kept only for ``tests/test_mlflow_ui.py``, which another branch is editing: delete this file once
that test imports from ``pipeline.training``.
"""
from pipeline.training import _extra_params, finetune_extra_params

__all__ = ["_extra_params", "finetune_extra_params"]

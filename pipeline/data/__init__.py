"""Data stage: shard image sources into reproducible webdataset tars and load them per rank.

The names below are imported on first use (PEP 562), so a light user of one submodule, such as
``vit-pipeline predict`` needing only ``pipeline.data.transforms``, does not pay for scikit-learn,
webdataset and pyarrow (about 2 s of start-up on a 2-core machine).
"""
from __future__ import annotations

from pipeline.utils import lazy_exports

_EXPORTS = {"shard_dataset": "shard_writer", "read_dataset_info": "shard_dir", "check_shard_files": "shard_dir",
            "require_split": "shard_dir", "require_classes": "shard_dir", "make_train_loader": "loader",
            "make_eval_loader": "loader",
            "SOURCES": "sources", "AUGMENT_DEFAULTS": "augment"}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)

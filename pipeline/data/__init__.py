"""Data stage: shard image sources into reproducible webdataset tars and load them per rank."""
from .loader import make_eval_loader, make_train_loader, read_dataset_info
from .shard import shard_dataset
from .sources import SOURCES
from .transforms import AUGMENT_DEFAULTS

__all__ = ["shard_dataset", "read_dataset_info", "make_train_loader", "make_eval_loader",
           "SOURCES", "AUGMENT_DEFAULTS"]

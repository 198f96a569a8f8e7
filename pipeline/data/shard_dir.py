"""A shard stage's output as the other stages find it: its dataset.json, and the shards and splits it lists.

Apart from :mod:`.loader`, so that a training stage's driver, which checks the shards before its ranks start
and never decodes an image, does not load torchvision (~2 s of every stage on a 2-core machine).
"""
from __future__ import annotations

import errno
import json
import os

from pipeline.storage import file_sizes, is_url, join as _join
from pipeline.utils import DATASET_INFO

from .integrity import reshard, shard_stage, size_changed
from .splits import EMPTY_SPLIT_EFFECT, lacks_given_test, why_empty


def read_dataset_info(shard_dir) -> dict:
    """Load dataset.json from a shard directory or URL prefix (s3://..., memory://...)."""
    path = _join(shard_dir, DATASET_INFO)
    if not is_url(shard_dir) and not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: {shard_dir} holds no shard stage's output; "
                                f"{reshard(shard_dir, 'first')}")
    import fsspec
    with fsspec.open(path, "rt") as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc}); {reshard(shard_dir)}") from None


def check_shard_files(shard_dir, info: dict) -> None:
    """Every shard ``dataset.json`` lists is there, at the size the shard stage wrote (shards from before
    sizes were recorded: presence only). Training and evaluation call this before they start: a tar cut
    short by an interrupted copy or sync would otherwise fail on a Ray worker (and again on each retry),
    or, cut at a member boundary, quietly lose samples."""
    sizes, listing, redo = file_sizes(shard_dir), _join(shard_dir, DATASET_INFO), reshard(shard_dir)
    for shard in (s for split in info["shards"].values() for s in split):
        path, size = _join(shard_dir, shard["name"]), sizes.get(shard["name"])
        if size is None:
            raise FileNotFoundError(errno.ENOENT, f"shard missing (listed in {listing}); {redo}", path)
        if size != shard.get("bytes", size):
            raise size_changed(path, size, shard["bytes"], shard_dir)


def require_split(shard_dir, info: dict, split: str) -> None:
    """A stage that reads ``split`` stops before its work when the shards hold none of it, saying why
    (the shard stage warned of it) and what gives it some."""
    if info["counts"][split]:
        return
    name = shard_stage(shard_dir)
    key = f"data.{name}.{split}_fraction" if name else f"{split}_fraction"
    fix = f"give the source a {split}/ folder" + ("" if lacks_given_test(info, split) else f" or set {key} above 0")
    raise ValueError(f"{shard_dir} holds no {split} images ({why_empty(info, split)}): {EMPTY_SPLIT_EFFECT[split]}; "
                     f"{fix}, then {reshard(shard_dir)}")


def require_classes(shard_dir, info: dict, model_dir, classes: list[str]) -> None:
    """A model scored or exported against shards of other classes (re-sharded since it was trained) would
    name one dataset's images with the other's classes and exit 0: stop, naming both."""
    if list(classes) != list(info["classes"]):
        raise ValueError(f"{model_dir} was trained on the classes {list(classes)[:10]} but {shard_dir} holds "
                         f"{list(info['classes'])[:10]}; train it on these shards (dvc repro finetune)")

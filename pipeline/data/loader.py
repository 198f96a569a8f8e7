"""webdataset loaders with explicit rank/world_size (no env vars, no torch.distributed lookups).

Train: every rank yields exactly ``steps_per_epoch`` full batches (each reader cycles over its own
shards), ranks read disjoint samples. Eval: every sample of a split exactly once across ranks.
Readers (rank x worker) split at shard level when there are enough shards, else by key index
modulo the number of readers, so a small split still divides exactly.
"""
from __future__ import annotations

import json
import os
import random
import zlib
from itertools import islice
from typing import Iterator, Optional

import torch
import webdataset as wds
from torch.utils.data import IterableDataset, get_worker_info

from .transforms import eval_transform, resolve_augment, train_transform

IMAGE_KEYS = "png;jpg;jpeg;webp"
SHUFFLE_BUFFER = 2000  # encoded samples (shuffled before decode, so cheap)
_FSSPEC_SCHEMES = ("s3", "gcs", "az", "abfs", "memory")


def _is_url(path) -> bool:
    return "://" in str(path)


def _join(base, name: str) -> str:
    return str(base).rstrip("/") + "/" + name if _is_url(base) else os.path.join(str(base), name)


def _fsspec_gopen(url, mode="rb", bufsize=8192, **kw):
    import fsspec
    return fsspec.open(url, mode).open()


for _scheme in _FSSPEC_SCHEMES:  # let webdataset's gopen read object stores through fsspec
    wds.gopen_schemes.setdefault(_scheme, _fsspec_gopen)


def read_dataset_info(shard_dir) -> dict:
    """Load dataset.json from a shard directory or URL prefix (s3://..., memory://...)."""
    path = _join(shard_dir, "dataset.json")
    if _is_url(shard_dir):
        import fsspec
        with fsspec.open(path, "rt") as f:
            return json.load(f)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: is {shard_dir} the output of shard_dataset()?")
    with open(path) as f:
        return json.load(f)


def split_plan(shards: list, rank: int, world_size: int, worker: int, num_workers: int):
    """Shards one reader opens, plus ``(slot, n_slots)`` for a key-index modulo filter (or None)."""
    if len(shards) >= world_size:
        mine = shards[rank::world_size]
        if len(mine) >= num_workers:
            return mine[worker::num_workers], None
        return mine, (worker, num_workers)
    return list(shards), (rank * num_workers + worker, world_size * num_workers)


def _key_index(key: str) -> int:
    tail = key.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else zlib.crc32(key.encode())


class _ShardStream(IterableDataset):
    """Raw samples for one reader; ``repeat`` cycles (reshuffling shard order) forever."""

    def __init__(self, urls, rank, world_size, *, seed=0, epoch=0, shuffle=False, repeat=False):
        super().__init__()
        self.urls, self.rank, self.world_size = list(urls), rank, world_size
        self.seed, self.epoch, self.shuffle, self.repeat = seed, epoch, shuffle, repeat

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        tag = f"{self.seed}:{self.epoch}:{self.rank}:{worker}"
        urls = list(self.urls)
        if self.shuffle:  # same permutation on every rank: rotates shard ownership per epoch
            random.Random(f"{self.seed}:{self.epoch}").shuffle(urls)
        mine, modulo = split_plan(urls, self.rank, self.world_size, worker, num_workers)
        stream = self._cycle(mine, modulo, tag)
        if self.shuffle:
            stream = wds.shuffle(SHUFFLE_BUFFER, initial=SHUFFLE_BUFFER // 2, seed=f"{tag}:buf")(stream)
        return stream

    def _cycle(self, mine, modulo, tag) -> Iterator[dict]:
        n_pass = 0
        while True:
            order = list(mine)
            if self.shuffle and n_pass:
                random.Random(f"{tag}:{n_pass}").shuffle(order)
            n = 0
            for sample in wds.tarfile_samples([{"url": u} for u in order]):
                if modulo is None or _key_index(sample["__key__"]) % modulo[1] == modulo[0]:
                    n += 1
                    yield sample
            if not self.repeat:
                return
            if n == 0:
                raise RuntimeError(f"reader {tag} got no samples from {len(order)} shard(s): "
                                   "the split has fewer samples than ranks x workers")
            n_pass += 1


def _collate(samples):
    images, labels = zip(*samples)
    return torch.stack(images), torch.tensor([int(x) for x in labels], dtype=torch.int64)


class _Loader:
    """Iterable of (images, labels); ``len()`` is the batch count when it is known up front."""

    def __init__(self, make_iter, length: Optional[int] = None):
        self._make_iter, self._length = make_iter, length

    def __iter__(self):
        return self._make_iter()

    def __len__(self):
        if self._length is None:
            raise TypeError("eval loader length is not known up front")
        return self._length


def _urls(shard_dir, split: str) -> list[str]:
    info = read_dataset_info(shard_dir)
    if split not in info["shards"]:
        raise ValueError(f"split {split!r} not in {shard_dir}; available: {sorted(info['shards'])}")
    return [_join(shard_dir, s["name"]) for s in info["shards"][split]]


def _pipeline(stream, transform, batch_size, partial):
    return wds.DataPipeline(stream, wds.decode("pil"), wds.to_tuple(IMAGE_KEYS, "cls"),
                            wds.map_tuple(transform, None),
                            wds.batched(batch_size, collation_fn=_collate, partial=partial))


def _check_rank(rank, world_size, batch_size, num_workers):
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if batch_size < 1 or num_workers < 0:
        raise ValueError(f"batch_size={batch_size} must be >= 1 and num_workers={num_workers} >= 0")


def make_train_loader(shard_dir, *, batch_size: int, image_size: int, steps_per_epoch: int, rank: int,
                      world_size: int, epoch: int, seed: int, augment: Optional[dict],
                      num_workers: int = 0) -> _Loader:
    """Exactly ``steps_per_epoch`` full, shuffled, augmented batches on this rank."""
    _check_rank(rank, world_size, batch_size, num_workers)
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch={steps_per_epoch} must be >= 1")
    resolve_augment(augment)
    urls = _urls(shard_dir, "train")
    if not urls:
        raise ValueError(f"{shard_dir} has no train shards")
    stream = _ShardStream(urls, rank, world_size, seed=seed, epoch=epoch, shuffle=True, repeat=True)
    ds = _pipeline(stream, train_transform(image_size, augment), batch_size, partial=False)
    if num_workers == 0:
        return _Loader(lambda: islice(iter(ds), steps_per_epoch), steps_per_epoch)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{epoch}:{rank}".encode()))
    loader = wds.WebLoader(ds, batch_size=None, num_workers=num_workers, generator=gen)
    return _Loader(lambda: islice(iter(loader), steps_per_epoch), steps_per_epoch)


def make_eval_loader(shard_dir, split: str, *, batch_size: int, image_size: int, rank: int,
                     world_size: int, augment: Optional[dict], num_workers: int = 0) -> _Loader:
    """Every sample of ``split`` exactly once across ranks, unshuffled; resize + normalise only."""
    _check_rank(rank, world_size, batch_size, num_workers)
    urls = _urls(shard_dir, split)
    stream = _ShardStream(urls, rank, world_size)
    ds = _pipeline(stream, eval_transform(image_size, augment), batch_size, partial=True)
    if num_workers == 0 or not urls:
        return _Loader(lambda: iter(ds))
    # Workers each end with a partial batch; re-batch in the main process so only the last is partial.
    loader = wds.WebLoader(ds, batch_size=None, num_workers=num_workers)
    loader = loader.unbatched().batched(batch_size, collation_fn=_collate, partial=True)
    return _Loader(lambda: iter(loader))

"""webdataset loaders with explicit rank/world_size (no env vars, no torch.distributed lookups).

Train: world-size invariant. Samples flow through ``num_streams`` virtual streams (see
:mod:`.streams`); global batch b is chunk b of every stream, rank r gets the streams g % W == r,
and every sample's augmentation is seeded by (seed, epoch, pass, key). So W = 1 and W = 2 runs
with the same global batch, seed and num_streams see the same samples, with the same pixels, in
every global step. Every rank yields exactly ``steps_per_epoch`` full batches (streams cycle), and
ranks read disjoint shards when there are at least num_streams of them.
Eval: every sample of a split exactly once across ranks. Readers (rank x worker) split at shard
level when there are enough shards, else by key index modulo the number of readers, so a small
split still divides exactly.
"""
from __future__ import annotations

import json
import os
from itertools import islice
from typing import Iterator, Optional

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchvision.io import ImageReadMode, decode_image

from .streams import key_index, open_streams, reader_streams, resolve_num_streams, sample_seeds
from .tario import tarfile_samples
from .transforms import BatchFinish, SampleTransform

IMAGE_KEYS = "png;jpg;jpeg;webp"
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
    """Shards one eval reader opens, plus ``(slot, n_slots)`` for a key-index modulo filter (or None)."""
    if len(shards) >= world_size:
        mine = shards[rank::world_size]
        if len(mine) >= num_workers:
            return mine[worker::num_workers], None
        return mine, (worker, num_workers)
    return list(shards), (rank * num_workers + worker, world_size * num_workers)


class _ShardStream(IterableDataset):
    """Raw samples of one eval reader (rank x DataLoader worker), in shard order, read once."""

    def __init__(self, urls, rank, world_size):
        super().__init__()
        self.urls, self.rank, self.world_size = list(urls), rank, world_size

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        mine, modulo = split_plan(self.urls, self.rank, self.world_size, worker, num_workers)
        for sample in tarfile_samples([{"url": u} for u in mine]):
            if modulo is None or key_index(sample["__key__"]) % modulo[1] == modulo[0]:
                yield sample


_PIL_RGB8 = wds.imagehandler("torchrgb8")


def decode_sample(sample: dict) -> tuple[torch.Tensor, int]:
    """Raw sample -> (uint8 RGB CHW tensor, label). torchvision.io (libjpeg-turbo/libpng) is ~3x
    faster than PIL at 32 px; other formats and 16-bit PNGs fall back to webdataset's PIL handler."""
    ext = next((e for e in IMAGE_KEYS.split(";") if e in sample), None)
    if ext is None:
        raise ValueError(f"sample {sample.get('__key__')} from {sample.get('__url__')} has no image "
                         f"({IMAGE_KEYS}); keys: {sorted(sample)}")
    data = sample[ext]
    try:
        img = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError:
        img = None
    if img is None or img.dtype != torch.uint8:
        img = _PIL_RGB8(ext, data)
    return img, int(sample["cls"])


class _Collate:
    """Stack uint8 samples, then normalise (and erase) once per batch."""

    def __init__(self, finish: BatchFinish):
        self.finish = finish

    def __call__(self, samples):
        images, labels = zip(*samples)
        return self.finish(torch.stack(images)), torch.tensor([int(x) for x in labels], dtype=torch.int64)


def _concat(samples):
    """Re-batching already-normalised samples in the main process (eval with workers)."""
    images, labels = zip(*samples)
    return torch.stack(images), torch.stack(labels)


class _Loader:
    """Iterable of (images, labels) with ``len()`` = batches per epoch and ``num_samples`` on this rank."""

    def __init__(self, make_iter, length: int, num_samples: int):
        self._make_iter, self._length, self.num_samples = make_iter, length, num_samples

    def __iter__(self):
        return self._make_iter()

    def __len__(self):
        return self._length


def _rank_samples(shards: list[dict], rank: int, world_size: int) -> int:
    """Samples an eval rank gets under :func:`split_plan` (keys are 0..N-1 within a split)."""
    if len(shards) >= world_size:
        return sum(s["count"] for s in shards[rank::world_size])
    return len(range(rank, sum(s["count"] for s in shards), world_size))


def _shards(shard_dir, split: str) -> tuple[list[str], list[dict]]:
    info = read_dataset_info(shard_dir)
    if split not in info["shards"]:
        raise ValueError(f"split {split!r} not in {shard_dir}; available: {sorted(info['shards'])}")
    shards = info["shards"][split]
    return [_join(shard_dir, s["name"]) for s in shards], shards


def _pipeline(stream, image_size, augment, batch_size, *, train: bool):
    return wds.DataPipeline(
        stream,
        wds.map(decode_sample),
        wds.map_tuple(SampleTransform(image_size, augment, train), None),
        wds.batched(batch_size, collation_fn=_Collate(BatchFinish(augment, train)), partial=not train))


def _check_rank(rank, world_size, batch_size, num_workers):
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if batch_size < 1 or num_workers < 0:
        raise ValueError(f"batch_size={batch_size} must be >= 1 and num_workers={num_workers} >= 0")


class _TrainStreams(IterableDataset):
    """One train reader (rank x DataLoader worker): per step, the chunks of its virtual streams in
    increasing stream order, decoded and augmented with per-sample seeds, as ``(worker, x, y, keys)``."""

    def __init__(self, urls, *, rank, world_size, num_streams, chunk, steps, seed, epoch, image_size,
                 augment, return_keys):
        super().__init__()
        self.urls, self.rank, self.world_size, self.num_streams = list(urls), rank, world_size, num_streams
        self.chunk, self.steps, self.seed, self.epoch, self.return_keys = chunk, steps, seed, epoch, return_keys
        self.transform = SampleTransform(image_size, augment, train=True)
        self.finish = BatchFinish(augment, train=True)

    def __iter__(self) -> Iterator[tuple]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        mine = reader_streams(self.num_streams, self.rank, self.world_size, worker, num_workers)
        streams = open_streams(self.urls, mine, self.num_streams, seed=self.seed, epoch=self.epoch)
        for _ in range(self.steps):
            raw = [sample for stream in streams for sample in islice(stream, self.chunk)]
            decoded = [decode_sample(sample) for sample in raw]
            seeds = [sample_seeds(self.seed, self.epoch, s["__pass__"], s["__key__"]) for s in raw]
            images = self.transform.seeded([img for img, _ in decoded], [a for a, _ in seeds])
            x = self.finish(torch.stack(images), seeds=[e for _, e in seeds])
            y = torch.tensor([label for _, label in decoded], dtype=torch.int64)
            yield worker, x, y, ([s["__key__"] for s in raw] if self.return_keys else None)


def _batch(parts: list[tuple], return_keys: bool) -> tuple:
    """Join the readers' parts of one rank batch (worker order == stream order)."""
    if len(parts) == 1:
        _, x, y, keys = parts[0]
    else:
        x, y = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
        keys = [k for p in parts for k in p[3]] if return_keys else None
    return (x, y, keys) if return_keys else (x, y)


def _gather(loader: DataLoader, num_workers: int, return_keys: bool) -> Iterator[tuple]:
    """DataLoader hands out worker outputs round-robin: num_workers consecutive items = one step."""
    it = iter(loader)
    while parts := list(islice(it, num_workers)):
        if [p[0] for p in parts] != list(range(num_workers)):
            raise RuntimeError(f"expected one part from each of workers 0..{num_workers - 1}, got "
                               f"{[p[0] for p in parts]}")
        yield _batch(parts, return_keys)


def make_train_loader(shard_dir, *, batch_size: int, image_size: int, steps_per_epoch: int, rank: int,
                      world_size: int, epoch: int, seed: int, augment: Optional[dict],
                      num_workers: int = 0, num_streams: Optional[int] = None,
                      return_keys: bool = False) -> _Loader:
    """Exactly ``steps_per_epoch`` full, shuffled, augmented batches of ``batch_size`` on this rank.

    World-size invariant: with the same global batch (``batch_size * world_size``), seed, epoch
    and ``num_streams``, the union over ranks of step b's batches is the same samples with the
    same augmented pixels for any ``world_size`` (and ``num_workers``) dividing ``num_streams``.
    ``num_streams`` defaults to ``lcm(R, gcd(global batch, 8))`` with ``R = world_size *
    max(1, num_workers)`` (8 for the usual power-of-two layouts; see
    :func:`.streams.resolve_num_streams`); it must be a multiple of R and divide the global batch.
    ``return_keys`` (debugging / tests) yields ``(images, labels, keys)`` instead of ``(images, labels)``.
    """
    _check_rank(rank, world_size, batch_size, num_workers)
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch={steps_per_epoch} must be >= 1")
    num_streams = resolve_num_streams(num_streams, batch_size=batch_size, world_size=world_size,
                                      num_workers=num_workers)
    urls, shards = _shards(shard_dir, "train")
    if not urls:
        raise ValueError(f"{shard_dir} has no train shards")
    total = sum(s["count"] for s in shards)
    if len(urls) < num_streams and total < num_streams:
        raise ValueError(f"{shard_dir} has {total} train samples, fewer than num_streams={num_streams}")
    ds = _TrainStreams(urls, rank=rank, world_size=world_size, num_streams=num_streams,
                       chunk=batch_size * world_size // num_streams, steps=steps_per_epoch, seed=seed,
                       epoch=epoch, image_size=image_size, augment=augment, return_keys=return_keys)
    n = steps_per_epoch * batch_size
    if num_workers == 0:
        return _Loader(lambda: (_batch([part], return_keys) for part in ds), steps_per_epoch, n)
    # augmentation is seeded per sample; the generator only keeps DataLoader's base seed off the
    # caller's global torch RNG
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers,
                        generator=torch.Generator().manual_seed(seed))
    return _Loader(lambda: _gather(loader, num_workers, return_keys), steps_per_epoch, n)


def make_eval_loader(shard_dir, split: str, *, batch_size: int, image_size: int, rank: int,
                     world_size: int, augment: Optional[dict], num_workers: int = 0) -> _Loader:
    """Every sample of ``split`` exactly once across ranks, unshuffled; resize + normalise only."""
    _check_rank(rank, world_size, batch_size, num_workers)
    urls, shards = _shards(shard_dir, split)
    n = _rank_samples(shards, rank, world_size)
    length = -(-n // batch_size)
    stream = _ShardStream(urls, rank, world_size)
    ds = _pipeline(stream, image_size, augment, batch_size, train=False)
    if num_workers == 0 or not urls:
        return _Loader(lambda: iter(ds), length, n)
    # Workers each end with a partial batch; re-batch in the main process so only the last is partial.
    loader = wds.WebLoader(ds, batch_size=None, num_workers=num_workers)
    loader = loader.unbatched().batched(batch_size, collation_fn=_concat, partial=True)
    return _Loader(lambda: iter(loader), length, n)

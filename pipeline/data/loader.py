"""webdataset loaders with explicit rank/world_size (no env vars, no torch.distributed lookups).

Train: world-size invariant. Samples flow through ``num_streams`` virtual streams (see
:mod:`.streams`); global batch b is chunk b of every stream, rank r gets the streams g % W == r,
and every sample's augmentation is seeded by (seed, epoch, pass, key). So W = 1 and W = 2 runs
with the same global batch, seed and num_streams see the same samples, with the same pixels, in
every global step. Every rank yields exactly ``steps_per_epoch`` full batches (streams cycle), no
sample twice within an epoch, and ranks read disjoint samples (whole shards but those where the
streams' ranges meet, when there are at least num_streams shards). DataLoader workers take
turns at whole parcels of consecutive steps, so any worker count gives the same batches. Workers
decode (large JPEGs at reduced size, :mod:`.draft`), crop, flip and auto-augment and ship uint8 pixels;
the training device converts, normalises and erases (:mod:`.device_augment`), a parcel at a time, and
hands out its steps one by one. With ``augment.decode: device`` the workers ship JPEG bytes and the
device decodes, crops and flips too (:mod:`.device_decode`).
Eval: every sample of a split exactly once across ranks. Readers (rank x worker) split at shard
level when there are enough shards, else by key index modulo the number of readers, so a small
split still divides exactly.
"""
from __future__ import annotations

import functools
from itertools import islice
from typing import Iterator, NamedTuple, Optional

import torch
import webdataset as wds
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.storage import is_url, join as _join

from .augment import resolve_augment
from .codec import IMAGE_KEYS, decode
from .device_augment import DeviceAugment
from .device_decode import decode_parcel, encode_parcel
from .draft import JPEG_EXTS
from .hostmem import stack_for_main
from .integrity import RecordedShards, bad_sample, sample_label
from .pixels import bad_image_reason
from .shard_dir import read_dataset_info
from .streams import key_index, open_streams, reader_streams, resolve_num_streams, sample_seeds
from .tario import IndexedShards, tarfile_samples
from .transforms import BatchFinish, SampleTransform

_FSSPEC_SCHEMES = ("s3", "gcs", "az", "abfs", "memory")


def _fsspec_gopen(url, mode="rb", bufsize=8192, **kw):
    import fsspec
    return fsspec.open(url, mode).open()


for _scheme in _FSSPEC_SCHEMES:  # let webdataset's gopen read object stores through fsspec
    wds.gopen_schemes.setdefault(_scheme, _fsspec_gopen)


def eval_reader_shards(shards: list, rank: int, world_size: int, worker: int, num_workers: int):
    """Shards one eval reader opens, plus ``(slot, n_slots)`` for a key-index modulo filter (or None).
    With fewer shards than ranks, rank r's readers take the keys ≡ r (mod W) between them, the count
    :func:`_rank_samples` gives whatever the worker count."""
    if len(shards) >= world_size:
        mine = shards[rank::world_size]
        if len(mine) >= num_workers:
            return mine[worker::num_workers], None
        return mine, (worker, num_workers)
    return list(shards), (rank + world_size * worker, world_size * num_workers)


class _ShardStream(IterableDataset):
    """Raw samples of one eval reader (rank x DataLoader worker), in shard order, read once."""

    def __init__(self, urls, rank, world_size, check: RecordedShards):
        super().__init__()
        self.urls, self.rank, self.world_size, self.check = list(urls), rank, world_size, check

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        mine, modulo = eval_reader_shards(self.urls, self.rank, self.world_size, worker, num_workers)
        for sample in tarfile_samples([{"url": u} for u in mine], self.check):
            if modulo is None or key_index(sample["__key__"]) % modulo[1] == modulo[0]:
                yield sample


def decode_sample(sample: dict, num_classes: int | None = None) -> tuple[torch.Tensor, int]:
    """Raw sample -> (uint8 RGB CHW tensor, label); the label checked to be below ``num_classes`` when given.
    A sample without an image, with one that does not decode or with a label of no class is one line
    naming its shard and key (:func:`.integrity.bad_sample`)."""
    ext = next((e for e in IMAGE_KEYS.split(";") if e in sample), None)
    if ext is None:
        raise bad_sample(sample, f"no image ({IMAGE_KEYS}); its fields: {sorted(k for k in sample if k[:2] != '__')}")
    label = sample_label(sample, num_classes)
    try:
        return decode(ext, sample[ext]), label
    except Exception as exc:  # the decoders raise many types for bytes that are not an image
        reason = bad_image_reason(exc, f"{sample.get('__key__')}.{ext}")
        raise bad_sample(sample, f"its .{ext} image does not decode ({reason})") from None


def transformed_sample(sample: dict, transform: SampleTransform, seed: int,
                       num_classes: int | None = None) -> tuple[torch.Tensor, int]:
    """Raw sample -> (``transform``'s uint8 output, label): a JPEG decoded at reduced size where the
    crop allows (:meth:`.SampleTransform.apply_encoded`), anything else (or a JPEG Pillow refuses)
    decoded in full by :func:`decode_sample`, which names what is wrong with a bad one."""
    ext = next((e for e in JPEG_EXTS if e in sample), None)
    if ext is not None:
        try:
            img = transform.apply_encoded(sample[ext], seed)
        except Exception:  # bytes Pillow cannot decode: the full decoder reads them or says why not
            img = None
        if img is not None:
            return img, sample_label(sample, num_classes)
    img, label = decode_sample(sample, num_classes)
    return transform.apply(img, seed), label


def _collate(samples):
    """Stack uint8 samples (normalised later, once per batch, on the device)."""
    images, labels = zip(*samples)
    return torch.stack(images), torch.tensor([int(x) for x in labels], dtype=torch.int64)


class _Loader:
    """Iterable of (images, labels) with ``len()`` = batches per epoch and ``num_samples`` on this rank;
    ``in_flight``: the steps its DataLoader workers hold, queued or being built, when the pipeline is full."""

    def __init__(self, make_iter, length: int, num_samples: int, in_flight: int = 0):
        self._make_iter, self._length, self.num_samples, self.in_flight = make_iter, length, num_samples, in_flight

    def __iter__(self):
        return self._make_iter()

    def __len__(self):
        return self._length


def _rank_samples(shards: list[dict], rank: int, world_size: int) -> int:
    """Samples an eval rank gets under :func:`eval_reader_shards` (keys are 0..N-1 within a split)."""
    if len(shards) >= world_size:
        return sum(s["count"] for s in shards[rank::world_size])
    return len(range(rank, sum(s["count"] for s in shards), world_size))


def _shards(shard_dir, split: str) -> tuple[list[str], list[dict], RecordedShards]:
    """A split's shard URLs, their dataset.json entries and what a loader checks them against."""
    info = read_dataset_info(shard_dir)
    if split not in info["shards"]:
        raise ValueError(f"split {split!r} not in {shard_dir}; available: {sorted(info['shards'])}")
    shards = info["shards"][split]
    urls = [_join(shard_dir, s["name"]) for s in shards]
    return urls, shards, RecordedShards(shard_dir, info, urls, shards)


def _eval_pipeline(stream: _ShardStream, image_size, augment, batch_size):
    transform = SampleTransform(image_size, augment, train=False)
    return wds.DataPipeline(
        stream,
        wds.map(functools.partial(transformed_sample, transform=transform, seed=0,
                                  num_classes=stream.check.num_classes)),
        wds.batched(batch_size, collation_fn=_collate, partial=True))


def _check_rank(rank, world_size, batch_size, num_workers):
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    if batch_size < 1 or num_workers < 0:
        raise ValueError(f"batch_size={batch_size} must be >= 1 and num_workers={num_workers} >= 0")


PREFETCH = 4  # steps each DataLoader worker has in flight, in at least 2 parcels (DataLoader's prefetch_factor)
PARCEL_BYTES, MAX_PARCEL = 8 << 20, 8  # a parcel's uint8 pixels, about; its steps, at most


def parcel_steps(batch_size: int, image_size: int) -> int:
    """Consecutive steps a loader worker builds and ships as one DataLoader item: as many as fit in
    ``PARCEL_BYTES`` of pixels, 1 to ``MAX_PARCEL``. The training process pays a fixed cost per item it
    receives (unpickling, one file-descriptor handoff per tensor, pinning: ~1.7 ms on the 2-core CPU
    machine, profiled), which a small batch (CIFAR-10's 128 x 32 px: 0.4 MB) would pay every step."""
    return max(1, min(MAX_PARCEL, PARCEL_BYTES // (batch_size * 3 * image_size * image_size)))


class TrainBatch(NamedTuple):
    """A parcel of one or more consecutive steps of a rank, as a loader worker ships it: the steps'
    samples in step order as one batch of uint8 pixels (cropped, flipped, auto-augmented) and one int64
    tensor with the labels and the per-sample draws left for the device (the erasing boxes; see
    :class:`.device_augment.DeviceAugment`). Two tensors, not one per field or step: each tensor a worker
    ships costs the training process a file-descriptor handoff (~0.3 ms each on the 2-core CPU machine).
    With ``augment.decode: device``, ``images`` holds the JPEG bytes and ``encoded`` their lengths and crop
    seeds (:mod:`.device_decode`)."""

    images: torch.Tensor          # uint8 [S * B, 3, H, W], or [total bytes] with ``encoded``
    meta: torch.Tensor            # int64 [S * B] labels, then [S * B * 4] erasing boxes when erasing is on
    keys: Optional[list[str]]
    encoded: Optional[torch.Tensor] = None  # int64 [S * B, 2]: each JPEG's length and crop seed

    @staticmethod
    def pack(labels: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """``meta`` from the labels and what :meth:`.DeviceAugment.on_host` left (the erasing boxes)."""
        if set(params) - {"erase"}:
            raise ValueError(f"a train batch ships labels and erasing boxes only, got {sorted(params)}")
        return torch.cat([labels, params["erase"].flatten()]) if params else labels

    def unpack(self, meta: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(labels, params)`` as views of ``meta`` (this batch's, or a copy of it on the device)."""
        n = len(self.images if self.encoded is None else self.encoded)
        return meta[:n], ({"erase": meta[n:].view(n, 4)} if len(meta) > n else {})


class _TrainSteps(IterableDataset):
    """A rank's train steps from ``(epoch, start_batch)`` to the end of epoch ``last_epoch``, in parcels
    of ``parcel`` consecutive steps (the last one may be shorter).

    Every DataLoader worker follows the rank's streams in full and reads, decodes and augments
    only the parcels it owns (parcel p of the run goes to worker p % num_workers). Local shards are
    followed through an index of their tar headers (:class:`.tario.IndexedShards`, built once per
    worker), so a skipped sample costs a few microseconds, not a tar read; URLs are read in full. So
    any worker count works, each parcel is built and shipped by one worker (no assembly in the main
    process), and the DataLoader's round-robin order is step order. A sample's pixels depend on its
    own seed only, so the parcel size changes no batch.
    """

    def __init__(self, shards, *, check, rank, world_size, num_streams, chunk, steps, seed, epoch, last_epoch,
                 start_batch, image_size, augment, return_keys, parcel):
        super().__init__()
        self.check, self.shards, self.rank, self.world_size = check, list(shards), rank, world_size
        self.num_streams = num_streams
        self.chunk, self.steps, self.seed, self.return_keys, self.parcel = chunk, steps, seed, return_keys, parcel
        self.epochs, self.start_batch = range(epoch, last_epoch + 1), start_batch
        self.transform = SampleTransform(image_size, augment, train=True)
        self.device_augment = DeviceAugment(augment)
        self.decode_on_device = resolve_augment(augment)["decode"] == "device"

    def __iter__(self) -> Iterator[TrainBatch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        mine = reader_streams(self.num_streams, self.rank, self.world_size)
        local = not any(is_url(u) or u.startswith("pipe:") for u, _ in self.shards)
        # local tars: read only the samples we decode; each worker hashes its share of the shards as it indexes them
        read = (IndexedShards(self.check, (worker, num_workers)) if local
                else functools.partial(tarfile_samples, check=self.check))
        k, samples, epochs = 0, [], []  # steps so far; the samples of this worker's parcel being filled
        for epoch in self.epochs:
            streams = open_streams(self.shards, mine, self.num_streams, seed=self.seed, epoch=epoch, read=read)
            first = self.start_batch if epoch == self.epochs.start else 0
            for b in range(self.steps):
                raw = [sample for stream in streams for sample in islice(stream, self.chunk)]
                if b < first:
                    continue
                if k // self.parcel % num_workers == worker:
                    samples += [read.load(r) for r in raw] if local else raw
                    epochs += [epoch] * len(raw)
                    if k % self.parcel == self.parcel - 1:
                        yield self._batch(samples, epochs)
                        samples, epochs = [], []
                k += 1
        if samples:  # the run's last parcel, short
            yield self._batch(samples, epochs)

    def _batch(self, raw: list[dict], epochs: list[int]) -> TrainBatch:
        seeds = [sample_seeds(self.seed, epoch, s["__pass__"], s["__key__"]) for s, epoch in zip(raw, epochs)]
        keys = [s["__key__"] for s in raw] if self.return_keys else None
        if self.decode_on_device:  # ship the bytes: the device decodes, crops and flips
            data, encoded = encode_parcel(raw, [a for a, _ in seeds])
            labels = torch.tensor([sample_label(s, self.check.num_classes) for s in raw], dtype=torch.int64)
            params = self.device_augment.draw([d for _, d in seeds], self.transform.size, self.transform.size)
            return TrainBatch(data, TrainBatch.pack(labels, params), keys, encoded)
        decoded = [transformed_sample(sample, self.transform, a, self.check.num_classes)
                   for sample, (a, _) in zip(raw, seeds)]
        images = stack_for_main([img for img, _ in decoded])
        params = self.device_augment.draw([d for _, d in seeds], *images.shape[-2:])
        images, params = self.device_augment.on_host(images, params)
        labels = torch.tensor([label for _, label in decoded], dtype=torch.int64)
        return TrainBatch(images, TrainBatch.pack(labels, params), keys)


def _on_device(parcels: Iterator[TrainBatch], augment: DeviceAugment, device: torch.device, batch_size: int,
               return_keys: bool, transform: SampleTransform) -> Iterator[tuple]:
    """Copy each parcel to ``device`` (non-blocking from pinned memory on CUDA) and finish the
    augmentation there (the CPU ships uint8, the device converts, normalises and erases), then hand
    out its steps' batches one by one, as views."""
    cuda = device.type == "cuda"
    for parcel in parcels:
        images, meta = parcel.images, parcel.meta
        if cuda and not images.is_pinned():  # DataLoader workers pin already (pin_memory=True)
            images, meta = images.pin_memory(), meta.pin_memory()
        y, params = parcel.unpack(meta.to(device, non_blocking=cuda))
        if parcel.encoded is None:
            images = images.to(device, non_blocking=cuda)
        else:
            images = decode_parcel(images, parcel.encoded, transform, device)
        x = augment(images, params)
        for i in range(0, len(y), batch_size):
            step = slice(i, i + batch_size)
            yield (x[step], y[step], parcel.keys[step]) if return_keys else (x[step], y[step])


def _one_ahead_on_side_stream(batches: Iterator[tuple], device: torch.device) -> Iterator[tuple]:
    """CUDA: issue batch k + 1's copy and augmentation on a side stream before handing out batch k, so
    the device runs them beside step k instead of queued behind it (the pattern of apex's ImageNet
    data_prefetcher). The consumer's stream waits for its batch on the device, never the host, and
    ``record_stream`` keeps the allocator from reusing a batch's memory before that stream is done."""
    side = torch.cuda.Stream(device)

    def issue():
        with torch.cuda.stream(side):
            return next(batches, None)

    ahead = issue()
    while ahead is not None:
        consumer = torch.cuda.current_stream(device)
        consumer.wait_stream(side)
        for t in ahead:
            if isinstance(t, torch.Tensor):
                t.record_stream(consumer)
        batch, ahead = ahead, issue()
        yield batch


def make_train_loader(shard_dir, *, batch_size: int, image_size: int, steps_per_epoch: int, rank: int,
                      world_size: int, epoch: int, seed: int, augment: Optional[dict],
                      last_epoch: Optional[int] = None, start_batch: int = 0, num_workers: int = 0,
                      prefetch: Optional[int] = None, parcel: Optional[int] = None, device: torch.device | str = "cpu",
                      num_streams: Optional[int] = None, return_keys: bool = False) -> _Loader:
    """Exactly ``steps_per_epoch`` full, shuffled, augmented batches of ``batch_size`` on this rank
    for each epoch from ``epoch`` (starting at batch ``start_batch``: mid-epoch resume, the skipped
    batches are read but not decoded) to ``last_epoch`` (default: ``epoch`` alone), on ``device``.

    World-size invariant: with the same global batch (``batch_size * world_size``), seed, epoch
    and ``num_streams``, the union over ranks of step b's batches is the same samples with the
    same augmented pixels for any ``world_size`` dividing ``num_streams`` and any ``num_workers``.
    ``num_streams`` defaults to ``lcm(W, gcd(global batch, 8))`` (8 for the usual power-of-two
    layouts; see :func:`.streams.resolve_num_streams`). One DataLoader (``num_workers`` processes,
    ``prefetch`` parcels each in flight) serves all the epochs, so workers start once per run. Each
    worker ships ``parcel`` consecutive steps at a time (default :func:`parcel_steps`); the device
    finishes a parcel at once. On CUDA the next parcel is copied and augmented on a side stream while
    the caller steps on this one.
    ``return_keys`` (debugging / tests) yields ``(images, labels, keys)`` instead of ``(images, labels)``.
    """
    _check_rank(rank, world_size, batch_size, num_workers)
    last_epoch = epoch if last_epoch is None else last_epoch
    if steps_per_epoch < 1 or last_epoch < epoch or not 0 <= start_batch < steps_per_epoch:
        raise ValueError(f"steps_per_epoch={steps_per_epoch} must be >= 1, last_epoch={last_epoch} >= "
                         f"epoch={epoch} and start_batch={start_batch} in [0, steps_per_epoch)")
    num_streams = resolve_num_streams(num_streams, batch_size=batch_size, world_size=world_size)
    urls, shards, check = _shards(shard_dir, "train")
    if not urls:
        raise ValueError(f"{shard_dir} has no train shards")
    total = sum(s["count"] for s in shards)
    if len(urls) < num_streams and total < num_streams:
        raise ValueError(f"{shard_dir} has {total} train samples, fewer than num_streams={num_streams}")
    ds = _TrainSteps([(url, s["count"]) for url, s in zip(urls, shards)], check=check, rank=rank,
                     world_size=world_size, num_streams=num_streams,
                     chunk=batch_size * world_size // num_streams, steps=steps_per_epoch, seed=seed,
                     epoch=epoch, last_epoch=last_epoch, start_batch=start_batch, image_size=image_size,
                     augment=augment, return_keys=return_keys,
                     parcel=parcel or parcel_steps(batch_size, image_size))
    device = torch.device(device)
    length = (last_epoch - epoch + 1) * steps_per_epoch - start_batch
    prefetch = prefetch or max(2, PREFETCH // ds.parcel)
    if num_workers == 0:
        source = ds
    else:  # augmentation is seeded per sample; the generator keeps DataLoader off the global torch RNG
        source = DataLoader(ds, batch_size=None, num_workers=num_workers, prefetch_factor=prefetch,
                            pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(seed))

    def batches() -> Iterator[tuple]:
        on_device = _on_device(iter(source), ds.device_augment, device, batch_size, return_keys, ds.transform)
        return _one_ahead_on_side_stream(on_device, device) if device.type == "cuda" else on_device
    return _Loader(batches, length, length * batch_size, in_flight=num_workers * (prefetch + 1) * ds.parcel)


def _rebatch(parts: Iterator[tuple[torch.Tensor, torch.Tensor]], batch_size: int) -> Iterator[tuple]:
    """Readers each end on a partial batch: regroup their batches so only the last one is partial."""
    xs, ys, held = [], [], 0
    for x, y in parts:
        xs.append(x)
        ys.append(y)
        held += len(y)
        while held >= batch_size:
            x, y = torch.cat(xs), torch.cat(ys)
            yield x[:batch_size], y[:batch_size]
            xs, ys, held = [x[batch_size:]], [y[batch_size:]], held - batch_size
    if held:
        yield torch.cat(xs), torch.cat(ys)


def _finish_on(batches: Iterator[tuple], finish: BatchFinish, device: torch.device) -> Iterator[tuple]:
    cuda = device.type == "cuda"
    for x, y in batches:
        yield finish(x.to(device, non_blocking=cuda)), y.to(device, non_blocking=cuda)


def make_eval_loader(shard_dir, split: str, *, batch_size: int, image_size: int, rank: int,
                     world_size: int, augment: Optional[dict], num_workers: int = 0,
                     device: torch.device | str = "cpu") -> _Loader:
    """Every sample of ``split`` exactly once across ranks, unshuffled; resize + normalise only.

    Readers decode and resize on the CPU and ship uint8; normalisation runs on ``device``. With
    ``num_workers`` the workers persist between iterations (one eval per epoch reuses them).
    """
    _check_rank(rank, world_size, batch_size, num_workers)
    urls, shards, check = _shards(shard_dir, split)
    n = _rank_samples(shards, rank, world_size)
    length = -(-n // batch_size)
    stream = _ShardStream(urls, rank, world_size, check)
    ds = _eval_pipeline(stream, image_size, augment, batch_size)
    finish, device = BatchFinish(augment), torch.device(device)
    if num_workers == 0 or not urls:
        return _Loader(lambda: _finish_on(iter(ds), finish, device), length, n)
    # its own generator, as the train loader's: creating the iterator (again in a resumed launch) must not
    # draw from the global torch RNG, which dropout and drop-path use on a CPU and checkpoints carry
    loader = DataLoader(ds, batch_size=None, num_workers=num_workers, persistent_workers=True,
                        pin_memory=device.type == "cuda", generator=torch.Generator())
    return _Loader(lambda: _finish_on(_rebatch(iter(loader), batch_size), finish, device), length, n)

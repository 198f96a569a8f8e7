"""Virtual streams: the world-size invariant sample order of the train loader.

A run has ``S`` virtual streams (``num_streams``), a number fixed independently of the world size
(the idea of MosaicML Streaming's canonical nodes). Stream ``g`` is a deterministic, endless
sequence of raw samples that only depends on (shards, S, seed, epoch, g):

* ``#shards >= S``: the epoch's shard permutation (seeded by (seed, epoch)), laid end to end, is cut
  into S ranges of equal sample counts (``N // S`` or one more): stream g owns range g, whole shards
  and at most one part of a shard at each end, and reads it pass after pass, its pieces in an order
  seeded by (seed, epoch, g, pass). Streams read disjoint samples, and whole shards but those at the
  cuts. Equal ranges matter: a stream gives ``steps * B / S <= N // S`` samples an epoch, so none
  wraps into a second pass within an epoch (no sample twice) and none leaves more than its share
  unseen. (Dealing whole shards round-robin, as before, gave streams of unequal length whenever
  the shards were: 13 % of the 4-GPU CIFAR-10 recipe's epoch was repeats, 14 % of its images unseen.)
* ``#shards < S``: stream g keeps the samples whose index in the split is congruent to g modulo S,
  reading all shards in an order seeded by (seed, epoch, pass). The streams of one reader share one
  read (filtered before decoding), so a reader reads the split once per pass, as a plain
  rank/worker modulo split would.

Each pass of a stream is shuffled by a buffer of :data:`STREAM_BUFFER` samples seeded by (seed,
epoch, g, pass) and drained at the end of the pass, so a pass is a permutation of its samples.

Global batch ``b`` (``B`` samples) is chunk ``b`` (``B / S`` samples) of every stream, g = 0..S-1.
Rank ``r`` of ``W`` owns the streams g with ``g % W == r`` and its batch is their chunks in
increasing g (DataLoader workers take turns at whole steps, see :mod:`.loader`). So the union over
ranks of batch b is the same multiset of samples for every W dividing S, and per-sample
augmentation seeded by :func:`sample_seeds` (seed, epoch, pass, key) makes the pixels identical too.
"""
from __future__ import annotations

import hashlib
import math
import random
import zlib
from collections import deque
from itertools import islice
from typing import Callable, Generator, Iterable, Iterator, Optional

from .tario import tarfile_samples

Reader = Callable[[Iterable[dict]], Generator[dict, None, None]]


DEFAULT_STREAMS = 8
STREAM_BUFFER = 256  # encoded samples per stream (shuffled before decode, so cheap); S/W streams per rank
_SEED_MASK = (1 << 63) - 1


def key_index(key: str) -> int:
    """Index of a sample in its split (``train_0000123`` -> 123); a crc32 for foreign key formats."""
    tail = key.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else zlib.crc32(key.encode())


def resolve_num_streams(num_streams: Optional[int], *, batch_size: int, world_size: int) -> int:
    """Check (or pick) S for a per-rank ``batch_size`` on ``world_size`` ranks.

    S must be a multiple of ``world_size`` (every rank owns whole streams) and divide the global
    batch ``B = batch_size * world_size`` (every stream gives B / S samples per step). Default:
    ``lcm(W, gcd(B, 8))``, i.e. 8 when B is a multiple of 8 and W divides 8; it does not change
    with W as long as W divides gcd(B, 8), so 1, 2, 4 and 8 ranks with the same global batch
    agree. For other layouts pass the same explicit ``num_streams`` (a multiple of every W you
    use) to each run. DataLoader workers do not enter: they split a rank's steps, not its streams.
    """
    global_batch = batch_size * world_size
    if num_streams is None:
        return math.lcm(world_size, math.gcd(global_batch, DEFAULT_STREAMS))
    if isinstance(num_streams, bool) or not isinstance(num_streams, int) or num_streams < 1:
        raise ValueError(f"num_streams={num_streams!r} must be a positive integer")
    if num_streams % world_size:
        raise ValueError(f"num_streams={num_streams} is not divisible by world_size={world_size}: every rank "
                         f"must own whole streams; use a multiple of {world_size}")
    if global_batch % num_streams:
        raise ValueError(f"global batch batch_size * world_size = {batch_size} * {world_size} = {global_batch} "
                         f"is not divisible by num_streams={num_streams}: every stream gives "
                         f"global_batch / num_streams samples per step")
    return num_streams


def reader_streams(num_streams: int, rank: int, world_size: int) -> list[int]:
    """Streams (increasing) of one rank: g % W == r."""
    return list(range(rank, num_streams, world_size))


def stream_pieces(shards: list[tuple[str, int]], num_streams: int, g: int, *, seed: int,
                  epoch: int) -> list[tuple[str, int, int]] | None:
    """Stream g's range of the epoch as ``(url, start, stop)`` pieces (samples ``start:stop`` of the
    shard, in its order), from ``(url, sample count)`` shards; None with fewer shards than streams
    (the streams then filter all shards by key index modulo S)."""
    perm = list(shards)
    random.Random(f"{seed}:{epoch}").shuffle(perm)  # same on every rank: rotates ownership per epoch
    if len(perm) < num_streams:
        return None
    total = sum(n for _, n in perm)
    lo, hi = g * total // num_streams, (g + 1) * total // num_streams
    pieces, offset = [], 0
    for url, n in perm:
        start, stop = max(lo, offset), min(hi, offset + n)
        if start < stop:
            pieces.append((url, start - offset, stop - offset))
        offset += n
    return pieces


def open_streams(shards: list[tuple[str, int]], streams: list[int], num_streams: int, *, seed: int, epoch: int,
                 buffer: int = STREAM_BUFFER, read: Reader = tarfile_samples) -> list[Iterator[dict]]:
    """Endless raw samples (webdataset dicts plus ``__pass__``) of each stream in ``streams``, from the
    split's ``(url, sample count)`` shards.

    A stream goes pass after pass over its samples; each pass is shuffled on its own (piece order,
    then a buffer drained at the end of the pass), so a pass is a permutation of the stream's
    samples: none repeats before all were seen, however small the stream. With fewer shards than
    streams, the given streams share one read of the shards (each pass in an order seeded by
    (seed, epoch, pass)), so a reader reads the split once per pass whatever its stream count.
    ``read`` turns ``[{"url": ...}]`` into samples (``tarfile_samples``, or index records from
    :class:`.tario.IndexedShards`: the order only depends on keys).
    """
    if len(shards) >= num_streams:
        raws = [_piece_passes(stream_pieces(shards, num_streams, g, seed=seed, epoch=epoch), g,
                              num_streams, f"{seed}:{epoch}:{g}", read) for g in streams]
    else:
        source = _ModuloSource([url for url, _ in shards], streams, num_streams, f"{seed}:{epoch}", read)
        raws = [source.stream(g) for g in streams]
    return [_pass_shuffled(raw, buffer, f"{seed}:{epoch}:{g}") for g, raw in zip(streams, raws)]


def _piece_passes(pieces: list[tuple[str, int, int]], g: int, num_streams: int, tag: str,
                  read: Reader) -> Iterator[dict]:
    """Stream g owning ``pieces``: every pass reads them all, in an order seeded by (tag, pass)."""
    n_pass = 0
    while True:
        order = list(pieces)
        random.Random(f"{tag}:{n_pass}").shuffle(order)
        n = 0
        for url, start, stop in order:
            samples = read([{"url": url}])
            for sample in islice(samples, start, stop):
                sample["__pass__"] = n_pass
                n += 1
                yield sample
            samples.close()  # a piece that ends before its shard does: the file is closed now
        if n == 0:
            raise RuntimeError(f"stream {g} of {num_streams} got no samples from its {len(order)} piece(s)")
        n_pass += 1


class _ModuloSource:
    """Fewer shards than streams: one endless read of all shards (pass p in an order seeded by
    (tag, p)), dealt to the wanted streams by key index modulo S, the rest dropped before decoding."""

    def __init__(self, urls: list[str], streams: list[int], num_streams: int, tag: str, read: Reader):
        self.urls, self.num_streams, self.tag, self.read = list(urls), num_streams, tag, read
        self.queues: dict[int, deque] = {g: deque() for g in streams}
        self.source = self._read()

    def _read(self) -> Iterator[tuple[int, dict]]:
        n_pass = 0
        while True:
            order = list(self.urls)
            random.Random(f"{self.tag}:{n_pass}").shuffle(order)
            got = dict.fromkeys(self.queues, 0)
            for sample in self.read([{"url": u} for u in order]):
                g = key_index(sample["__key__"]) % self.num_streams
                if g in got:
                    got[g] += 1
                    sample["__pass__"] = n_pass
                    yield g, sample
            empty = [g for g, n in got.items() if n == 0]
            if empty:
                raise RuntimeError(f"stream(s) {empty} of {self.num_streams} got no samples from "
                                   f"{len(order)} shard(s): the split has fewer samples than num_streams")
            n_pass += 1

    def stream(self, g: int) -> Iterator[dict]:
        queue = self.queues[g]
        while True:
            while not queue:
                h, sample = next(self.source)
                self.queues[h].append(sample)
            yield queue.popleft()


def _pass_shuffled(raw: Iterator[dict], bufsize: int, tag: str) -> Iterator[dict]:
    """Shuffle each pass of an endless pass-tagged stream on its own (buffer seeded by (tag, pass))."""
    pending = next(raw)

    def rest_of_pass(n_pass: int) -> Iterator[dict]:
        nonlocal pending
        while pending["__pass__"] == n_pass:
            sample, pending = pending, next(raw)
            yield sample

    while True:
        n_pass = pending["__pass__"]
        yield from shuffle_buffer(rest_of_pass(n_pass), bufsize, random.Random(f"{tag}:{n_pass}:buffer"))


def shuffle_buffer(items: Iterator, bufsize: int, rng: random.Random) -> Iterator:
    """webdataset's shuffle (fills to ``bufsize`` reading 2 per output once half full) with an explicit
    rng, drained (shuffled) when ``items`` ends."""
    initial = max(1, bufsize // 2)
    buf: list = []
    for item in items:
        buf.append(item)
        if len(buf) < bufsize:
            nxt = next(items, None)
            if nxt is not None:
                buf.append(nxt)
        if len(buf) >= initial:
            j = rng.randrange(len(buf))
            buf[j], buf[-1] = buf[-1], buf[j]
            yield buf.pop()
    rng.shuffle(buf)
    yield from buf


def sample_seeds(seed: int, epoch: int, n_pass: int, key: str) -> tuple[int, int]:
    """(augmentation, erasing) seeds of one sample: a stable hash, the same in every process."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{n_pass}:{key}".encode(), digest_size=16).digest()
    return (int.from_bytes(digest[:8], "little") & _SEED_MASK,
            int.from_bytes(digest[8:], "little") & _SEED_MASK)

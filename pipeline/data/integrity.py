"""Shards as the shard stage wrote them: the size and sha256 ``dataset.json`` records of each, checked where
a loader reads the shard, and each sample's label against its classes.

A shard cut short or changed while a run trains (a sync, a copy, a failing disk) stops the run with one line
naming it, and again on every attempt a Ray restart makes (a restarted loader checks the shard as it opens
it), instead of training on what is left. Sequential reads hash the bytes they read anyway; index reads
(:class:`.tario.IndexedShards`) check the size when they open a shard and hash it once per loader process,
each shard by one of a rank's loader workers (see :meth:`RecordedShards.hashes`).
"""
from __future__ import annotations

import hashlib
import os
from typing import IO

from pipeline.config import TRAINING_STAGES
from pipeline.storage import join as _join
from pipeline.utils import DATASET_INFO

from .tario import TarFormatError

HASH_BLOCK = 1 << 20


def shard_stage(shard_dir) -> str | None:
    """The shard stage whose output the folder is named as (data/shards/<stage>), if any."""
    name = str(shard_dir).rstrip("/").rsplit("/", 1)[-1]
    return name if name in TRAINING_STAGES else None


def reshard(shard_dir, when: str = "again") -> str:
    """What to do about a missing or damaged shard directory: the shard stage's command where the
    folder is named as one of its outputs, else the function it runs."""
    name = shard_stage(shard_dir)
    if name is None:
        return f"write it {when} with the shard stage or pipeline.data.shard_dataset()"
    return f"run the shard stage {when} (dvc repro, or python -m stages.shard {name})"


def shard_dir_of(url: str) -> str:
    """The shard directory (or URL prefix) a shard's path or URL lies in."""
    return str(url).rsplit("/", 1)[0] if "/" in str(url) else "."


def size_changed(path: str, size: int, wrote: int, shard_dir) -> TarFormatError:
    """A shard whose size is not the one the shard stage wrote."""
    return TarFormatError(f"{path}: {size:,} bytes, but the shard stage wrote {wrote:,} "
                          f"({_join(shard_dir, DATASET_INFO)}): cut short or changed since; {reshard(shard_dir)}")


class BadSample(ValueError):
    """A sample that cannot be trained on: an image that does not decode, a label that names no class."""


def bad_sample(sample: dict, what: str) -> BadSample:
    """``what`` is wrong with ``sample``: one line naming its shard and key, and what to do."""
    url = sample.get("__url__")
    return BadSample(f"{url}: sample {sample.get('__key__')}: {what}; the shard stage writes no such sample: "
                     f"{reshard(shard_dir_of(url))}")


def sample_label(sample: dict, num_classes: int | None) -> int:
    """A sample's ``.cls`` as a class index, checked against the split's ``num_classes`` when given."""
    raw = sample.get("cls")
    try:
        label = int(raw)
    except (TypeError, ValueError):
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        raise bad_sample(sample, f"its label {text[:40]!r} is not a class number") from None
    if num_classes is not None and not 0 <= label < num_classes:
        listing = _join(shard_dir_of(sample.get("__url__")), DATASET_INFO)
        raise bad_sample(sample, f"label {label} names no class ({listing} lists {num_classes}: "
                                 f"0..{num_classes - 1})")
    return label


class RecordedShards:
    """What ``dataset.json`` records of a split's shards, by the URL a loader opens each as: its size and
    sha256 (shards from before those were recorded: nothing to check) and the split's class count."""

    def __init__(self, shard_dir, info: dict, urls: list[str], entries: list[dict]):
        self.shard_dir, self.num_classes = str(shard_dir), len(info["classes"])
        self.entries = {url: (e.get("bytes"), e.get("sha256")) for url, e in zip(urls, entries)}
        self.position = {url: i for i, url in enumerate(urls)}

    def check_size(self, url: str, size: int) -> None:
        wrote = self.entries.get(url, (None, None))[0]
        if wrote is not None and size != wrote:
            raise size_changed(url, size, wrote, self.shard_dir)

    def check(self, url: str, size: int, digest: str) -> None:
        """The size, then the sha256, of a shard's bytes as read."""
        self.check_size(url, size)
        wrote = self.entries.get(url, (None, None))[1]
        if wrote is not None and digest != wrote:
            raise TarFormatError(f"{url}: sha256 {digest[:12]}…, but the shard stage wrote {wrote[:12]}… "
                                 f"({_join(self.shard_dir, DATASET_INFO)}): changed since; {reshard(self.shard_dir)}")

    def hashes(self, url: str, worker: int, num_workers: int) -> bool:
        """Whether loader worker ``worker`` of ``num_workers`` hashes ``url`` when it indexes it: every worker
        of a rank follows the same shards, so each hashes its share and the rank reads each shard once more,
        whatever its worker count."""
        return self.position.get(url, 0) % num_workers == worker

    def check_file(self, url: str, f: IO[bytes], digest: bool) -> None:
        """An open local shard: its size, and with ``digest`` its sha256 (reading it whole, from the start)."""
        self.check_size(url, os.fstat(f.fileno()).st_size)
        if digest and self.entries.get(url, (None, None))[1] is not None:
            f.seek(0)
            h = hashlib.file_digest(f, "sha256")
            self.check(url, f.tell(), h.hexdigest())

    def reading(self, url: str, stream: IO[bytes]) -> "HashingStream":
        return HashingStream(stream, url, self)


class HashingStream:
    """A shard's stream that hashes and counts what is read through it; :meth:`finish` reads the rest (a
    tar reader stops at the end-of-archive blocks) and checks the whole against ``dataset.json``."""

    def __init__(self, stream: IO[bytes], url: str, recorded: RecordedShards):
        self.stream, self.url, self.recorded = stream, url, recorded
        self.hash, self.size = hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.stream.read(n)
        self.hash.update(data)
        self.size += len(data)
        return data

    def finish(self) -> None:
        while self.read(HASH_BLOCK):
            pass
        self.recorded.check(self.url, self.size, self.hash.hexdigest())

    def close(self) -> None:
        close = getattr(self.stream, "close", None)
        if close is not None:
            close()

"""The shard stage's work split into tasks: contiguous chunks of the listing are encoded in parallel (in
this process's threads, or as Ray tasks), each record's bytes spooled to disk; the records are laid
into shards in listing order here; each shard is assembled whole from the spools by a task.

The output does not depend on the split: a record's bytes come from :func:`.record_encode.prepare`
alone, and shard boundaries follow webdataset's ShardWriter rule (a new shard once ``maxcount``
records or ``maxsize`` bytes of member data are in the current one), applied in order to the sizes
the chunks report. A task holds one chunk's records and one image at a time. A killed run leaves its
finished chunks and shards in the staging folder (``WORK`` keeps the bookkeeping); the next run with
the same params keeps them and does the rest.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import resource
import shutil
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.utils import MANIFEST, atomic_write_json

from . import record_encode
from .pixels import BadImage
from .record_encode import STATS_SPLIT
from .shard_tar import write_tar
from .splits import SPLITS, SourceListing

MANIFEST_SCHEMA = pa.schema([("key", pa.string()), ("split", pa.string()), ("shard", pa.string()),
                             ("label", pa.int64()), ("source_path", pa.string()), ("bytes", pa.int64())])
CHUNK = 512  # records per encode task: a multiple of the fractals' render batch
WORK = ".work"  # the staging folder's bookkeeping: chunk spools and their sizes, removed before publishing
RUN = "run.json"  # what the staged work was made from: a run with other params starts afresh
MANIFEST_GROUP, MANIFEST_FLUSH = 256, 8192  # manifest row groups: flushed at this many rows, checked per group
PROGRESS_S = 10.0  # seconds between progress lines
AUTO_RAY_MIN = 20_000  # shard_tasks: null shards a set this large on the Ray cluster's CPUs, smaller ones here
LAST_RUN: dict[str, Any] = {}  # what the last write_all here saw of its tasks (benchmarks and tests read it)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def encode_chunk(records: list, spool: str, max_side, encoding: str) -> dict:
    """Encode ``records`` into ``spool`` (their bytes back to back); return, and write beside it as JSON,
    each record's ``[ext, size]`` (``[None, error]`` if undecodable), the train records' pixel histogram,
    this process's peak RSS and the CPU time the chunk took."""
    entries, hist, cpu0 = [], np.zeros((3, 256), dtype=np.int64), time.thread_time()
    part = spool + ".part"
    with open(part, "wb") as f:
        for rec in records:
            try:
                ext, data, img_hist = record_encode.prepare(rec, max_side, stats=rec.split == STATS_SPLIT, encoding=encoding)
            except BadImage as exn:
                entries.append([None, str(exn)])
                continue
            f.write(data)
            entries.append([ext, len(data)])
            if img_hist is not None:
                hist += img_hist
    os.replace(part, spool)
    meta = {"entries": entries, "hist": hist.tolist(), "peak_rss_mb": _peak_rss_mb(), "pid": os.getpid(),
            "cpu_s": time.thread_time() - cpu0}
    atomic_write_json(Path(spool + ".json"), meta)
    return meta


def assemble_shard(path: str, members: list[tuple]) -> dict:
    """Write the tar ``path`` from ``members`` ``(spool, offset, size, ext, key, label)``, hashing it as it
    goes, unless a previous run finished it (then read to hash it); return its dataset.json entry."""
    if os.path.exists(path):
        digest = _sha256(Path(path))
    else:
        part, spools = path + ".part", {}

        def samples():
            for spool, offset, size, ext, key, label in members:
                f = spools.get(spool) or spools.setdefault(spool, open(spool, "rb"))
                f.seek(offset)
                yield key, {ext: f.read(size), "cls": str(label).encode()}

        try:
            with open(part, "wb") as out:
                digest = write_tar(out, samples())
        finally:
            for f in spools.values():
                f.close()
        os.replace(part, path)
    return {"name": os.path.basename(path), "count": len(members), "bytes": os.path.getsize(path), "sha256": digest}


class _Threads:
    """Tasks on a thread pool in this process (decoding and encoding release the GIL)."""

    def __init__(self, workers: int):
        self.pool, self.slots = ThreadPoolExecutor(workers), workers

    def submit(self, fn, *args):
        return self.pool.submit(fn, *args)

    def wait_one(self, handles: list) -> None:
        wait(handles, return_when=FIRST_COMPLETED)

    def done(self, handle) -> bool:
        return handle.done()

    def result(self, handle):
        return handle.result()

    def close(self) -> None:
        self.pool.shutdown(cancel_futures=True)


def _call(fn, args: bytes):
    """``fn(*args)``, the arguments pickled as one: Ray would serialize a chunk's records one by one
    (two msgpack extensions and a pickle each; profiled, most of the driver's CPU per image)."""
    return fn(*pickle.loads(args))


class _Ray:
    """Tasks on the Ray cluster this process has joined, one CPU each."""

    def __init__(self, tasks: int):
        import ray

        self.ray, self.slots, self.remote, self.submitted = ray, tasks, {}, []
        self.pickle = ray.cloudpickle

    def submit(self, fn, *args):
        if fn not in self.remote:
            self.remote[fn] = self.ray.remote(num_cpus=1, max_retries=2)(_call).options(name=fn.__name__)
        ref = self.remote[fn].remote(fn, self.pickle.dumps(args))
        if len(self.submitted) >= 64:  # keep only those still running: their results are not held here
            self.submitted = self._running()
        self.submitted.append(ref)
        return ref

    def _running(self) -> list:
        return self.ray.wait(self.submitted, num_returns=len(self.submitted), timeout=0)[1] if self.submitted else []

    def wait_one(self, handles: list) -> None:
        self.ray.wait(handles, num_returns=1)

    def done(self, handle) -> bool:
        return bool(self.ray.wait([handle], timeout=0)[0])

    def result(self, handle):
        try:
            return self.ray.get(handle)
        except self.ray.exceptions.RayTaskError as exc:  # the task's own error, not Ray's wrapper and traceback
            raise exc.cause from None

    def close(self) -> None:
        """Cancel what is still running (after an error or a signal here), before the staging folder goes."""
        for ref in self._running():
            self.ray.cancel(ref, force=True)


def runner(tasks: int, total: int, ray_cfg=None):
    """Threads in this process for ``tasks == 0``, else that many Ray tasks at a time (``None``: see
    :data:`AUTO_RAY_MIN`), on the cluster :func:`pipeline.cluster.init_ray` starts or joins."""
    if tasks is None and total < AUTO_RAY_MIN or tasks == 0:
        return _Threads(min(8, (os.cpu_count() or 1) + 2))
    import dataclasses

    import ray

    from pipeline.cluster import init_ray
    from pipeline.config import RayConfig

    if not ray.is_initialized():  # the shard stage's tasks are one CPU each: no training ranks to fit
        init_ray(dataclasses.replace(ray_cfg or RayConfig(), num_workers=1, use_gpu=False))
    return _Ray(tasks or max(1, int(ray.cluster_resources().get("CPU", 1))))


def _eta(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def progress_line(done: int, total: int, elapsed: float) -> str:
    rate = done / max(elapsed, 1e-9)
    eta = _eta((total - done) / rate) if rate > 0 else "?"
    return f"[shard] {done:,}/{total:,} images ({100 * done / max(total, 1):.0f}%), {rate:,.0f} img/s, ETA {eta}"


class _Split:
    """One split's shards as webdataset's ShardWriter would cut them; each closed shard goes to ``assemble``."""

    def __init__(self, tmp: Path, split: str, maxcount: int, maxsize: int, assemble):
        self.tmp, self.split, self.maxcount, self.maxsize, self.assemble = tmp, split, maxcount, maxsize, assemble
        self.shard, self.count, self.size, self.n = -1, 0, 0, 0
        self.members: list[tuple] = []
        self.handles: list = []

    def name(self) -> str:
        return f"{self.split}-{self.shard:06d}.tar"

    def add(self, spool: str, offset: int, size: int, ext: str, label: int) -> tuple[str, str]:
        if self.shard < 0 or self.count >= self.maxcount or self.size >= self.maxsize:
            self.close()
            self.shard, self.count, self.size = self.shard + 1, 0, 0
        key = f"{self.split}_{self.n:07d}"
        self.members.append((spool, offset, size, ext, key, label))
        self.count, self.size, self.n = self.count + 1, self.size + size + len(str(label)), self.n + 1
        return key, self.name()

    def close(self) -> None:
        if self.members:
            self.handles.append(self.assemble(str(self.tmp / self.name()), self.members))
            self.members = []


class _Spools:
    """Chunk spools deleted once every shard that reads them is written: the staging folder holds the
    output and the spools of the chunks in flight, not a second copy of the set. A chunk's sizes stay
    (a resumed run lays the shards out from them)."""

    def __init__(self, run):
        self.run, self.users, self.laid, self.assembling = run, {}, set(), []

    def assemble(self, path: str, members: list[tuple]):
        read = {m[0] for m in members}
        for spool in read:
            self.users[spool] = self.users.get(spool, 0) + 1
        handle = self.run.submit(assemble_shard, path, members)
        self.assembling.append((handle, read))
        return handle

    def release(self, spool: str, splits) -> None:
        """``spool``'s records are laid out; delete the spools no shard still needs."""
        self.laid.add(spool)
        still = []
        for handle, read in self.assembling:
            if self.run.done(handle):
                for s in read:
                    self.users[s] -= 1
            else:
                still.append((handle, read))
        self.assembling = still
        open_shards = {m[0] for split in splits for m in split.members}
        for s in [s for s in self.laid if not self.users.get(s) and s not in open_shards]:
            Path(s).unlink(missing_ok=True)
            self.laid.discard(s)


def prepare_staging(tmp: Path, run: dict) -> Path:
    """The work folder in ``tmp``: kept from a killed run with the same ``run`` description, else new."""
    work = tmp / WORK
    try:
        same = json.loads((work / RUN).read_text()) == run
    except (OSError, ValueError):
        same = False
    if not same:
        for entry in list(tmp.iterdir()) if tmp.exists() else ():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        work.mkdir(parents=True)
        atomic_write_json(work / RUN, run)
    return work


def write_all(tmp: Path, listing: SourceListing, *, maxcount, maxsize, max_side, max_bad_fraction, encoding,
              tasks, ray_cfg=None) -> dict[str, Any]:
    """Encode, lay out and assemble every record of ``listing`` into ``tmp``; ``tmp/WORK`` must exist
    (:func:`prepare_staging`). Returns the shards per split, class counts, the train histogram, the bad files."""
    work = tmp / WORK
    run = runner(tasks, listing.total, ray_cfg)
    spools = _Spools(run)
    splits = {s: _Split(tmp, s, maxcount, maxsize, spools.assemble) for s in SPLITS}
    class_counts = {s: [0] * len(listing.classes) for s in SPLITS}
    bad: list[dict] = []
    allowed_bad = math.floor(max_bad_fraction * listing.total + 1e-9)
    rows: dict[str, list] = {name: [] for name in MANIFEST_SCHEMA.names}
    hist = np.zeros((3, 256), dtype=np.int64)
    peak_rss, pids, cpu_s = 0.0, set(), 0.0
    chunks = ((c, part) for c, part in enumerate(_chunks(listing.records, CHUNK)))
    pending: deque = deque()  # (records, spool, handle or meta), in listing order
    seen, started, last_report = 0, time.perf_counter(), time.perf_counter()
    try:
        with pq.ParquetWriter(tmp / MANIFEST, MANIFEST_SCHEMA) as manifest:
            while True:
                running = [h for _, _, h in pending if not isinstance(h, dict) and not run.done(h)]
                while len(running) < run.slots and len(pending) < 4 * run.slots:
                    nxt = next(chunks, None)
                    if nxt is None:
                        break
                    c, part = nxt
                    spool = str(work / f"chunk-{c:07d}.bin")
                    meta = _finished_chunk(spool)
                    if meta is None:
                        meta = run.submit(encode_chunk, part, spool, max_side, encoding)
                        running.append(meta)
                    pending.append((part, spool, meta))
                if not pending:
                    break
                part, spool, handle = pending[0]
                if not isinstance(handle, dict) and not run.done(handle):
                    run.wait_one(running)
                    continue
                pending.popleft()
                meta = handle if isinstance(handle, dict) else run.result(handle)
                peak_rss = max(peak_rss, meta["peak_rss_mb"])
                pids.add(meta["pid"])
                cpu_s += meta["cpu_s"]
                hist += np.asarray(meta["hist"], dtype=np.int64)
                offset = 0
                for rec, (ext, size) in zip(part, meta["entries"]):
                    seen += 1
                    if ext is None:
                        bad.append({"path": rec.source_path, "split": rec.split, "error": size})
                        if len(bad) > allowed_bad:
                            raise ValueError(
                                f"more than max_bad_fraction={max_bad_fraction} of the {listing.total} images "
                                f"({allowed_bad}) are undecodable, seen before stopping: {len(bad)}; the first: "
                                f"{bad[0]['path']} ({bad[0]['error']}); remove or fix them, or raise max_bad_fraction")
                    else:
                        key, shard = splits[rec.split].add(spool, offset, size, ext, rec.label)
                        offset += size
                        class_counts[rec.split][rec.label] += 1
                        for name, v in zip(MANIFEST_SCHEMA.names,
                                           (key, rec.split, shard, rec.label, rec.source_path, size)):
                            rows[name].append(v)
                    if seen % MANIFEST_GROUP == 0 and len(rows["key"]) >= MANIFEST_FLUSH:
                        manifest.write_table(pa.table(rows, schema=MANIFEST_SCHEMA))
                        rows = {name: [] for name in MANIFEST_SCHEMA.names}
                spools.release(spool, splits.values())
                if time.perf_counter() - last_report >= PROGRESS_S:
                    last_report = time.perf_counter()
                    print(progress_line(seen, listing.total, last_report - started), flush=True)
            if seen % MANIFEST_GROUP and len(rows["key"]) >= MANIFEST_FLUSH:
                manifest.write_table(pa.table(rows, schema=MANIFEST_SCHEMA))
                rows = {name: [] for name in MANIFEST_SCHEMA.names}
            manifest.write_table(pa.table(rows, schema=MANIFEST_SCHEMA))
        for split in splits.values():
            split.close()
        shards = {s: [run.result(h) for h in splits[s].handles] for s in SPLITS}
    finally:
        run.close()
    shutil.rmtree(work)
    LAST_RUN.clear()
    LAST_RUN.update(tasks=run.slots, ray=isinstance(run, _Ray), task_pids=sorted(pids), peak_task_rss_mb=peak_rss,
                    encode_cpu_s=cpu_s)
    totals = np.sum([class_counts[s] for s in SPLITS], axis=0)
    empty = [listing.classes[i] for i in np.flatnonzero(totals == 0)]
    if empty:
        raise ValueError(f"class(es) {empty} ended up with no decodable images")
    if not shards["train"]:
        raise ValueError("the train split is empty; check the source and the split fractions")
    return {"shards": shards, "class_counts": class_counts, "hist": hist,
            "bad_files": sorted(bad, key=lambda b: (b["path"], b["split"]))}


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _finished_chunk(spool: str) -> dict | None:
    """The sizes a killed run recorded for this chunk (written once its spool was complete), else None."""
    try:
        return json.loads(Path(spool + ".json").read_text())
    except (OSError, ValueError):
        return None


def _chunks(it, n: int):
    chunk = []
    for x in it:
        chunk.append(x)
        if len(chunk) == n:
            yield chunk
            chunk = []
    if chunk:
        yield chunk

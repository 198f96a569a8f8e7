"""Sharding in parallel tasks on a real local Ray cluster: the same bytes for any number of tasks, a
SIGKILLed run resumed without rewriting its finished shards, memory per task that does not grow with the set."""
from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import DataConfig
from pipeline.data import shard_dataset, shard_tasks
from tests.data_helpers import REPO, make_imagefolder

pytestmark = pytest.mark.slow


def _digests(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}


@pytest.fixture(scope="module")
def ray_local():
    """Ray started as the shard stage starts it, in this process; stopped after the module, and the
    signal handlers it replaced put back."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    shard_tasks.runner(2, 0)
    yield
    import ray

    ray.shutdown()
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """1,110 tiny images (JPEG, PNG, BMP: three chunks) and one that does not decode."""
    root = make_imagefolder(tmp_path_factory.mktemp("photos"), per_class=370)
    (root / "cat" / "zzz.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    return root


def test_output_is_identical_for_any_number_of_tasks(photos, ray_local, tmp_path):
    """Copy-through and max_side re-encodes, this process's threads vs 1, 2 and 3 Ray tasks: the same tars,
    manifest, dataset.json and bad_files.json, with a small maxsize cutting shards by bytes."""
    for max_side in (None, 6):
        spec = dict(source="imagefolder", root=str(photos), maxcount=150, maxsize=9000, max_side=max_side,
                    max_bad_fraction=0.01)
        shard_dataset(tmp_path / "threads", DataConfig(**spec, shard_tasks=0))
        want = _digests(tmp_path / "threads")
        assert not shard_tasks.LAST_RUN["ray"] and len(want) > 8
        for tasks in (1, 2, 3):
            out = tmp_path / f"ray{tasks}"
            shard_dataset(out, DataConfig(**spec, shard_tasks=tasks))
            assert shard_tasks.LAST_RUN["ray"] and _digests(out) == want, (max_side, tasks)
            assert len(shard_tasks.LAST_RUN["task_pids"]) >= min(tasks, 2)  # three chunks, two CPUs
    from PIL import Image

    with tarfile.open(out / "train-000000.tar") as tar:  # max_side: re-encoded at 6 px
        sizes = {Image.open(tar.extractfile(m)).size for m in tar.getmembers() if not m.name.endswith(".cls")}
    assert max(max(s) for s in sizes) == 6
    kept = tmp_path / "threads"
    shard_dataset(kept, DataConfig(**{**spec, "max_side": None}, shard_tasks=2))
    import pyarrow.parquet as pq

    row = next(r for r in pq.read_table(kept / "manifest.parquet").to_pylist() if r["source_path"].endswith(".jpg"))
    with tarfile.open(kept / row["shard"]) as tar:
        stored = {Path(m.name).suffix: tar.extractfile(m).read() for m in tar.getmembers()
                  if m.name.startswith(row["key"] + ".")}
    assert stored[".jpg"] == (photos / row["source_path"]).read_bytes()  # copy-through: the source's bytes


def test_a_killed_run_resumes_and_writes_only_the_missing_shards(ray_local, tmp_path):
    """SIGKILL part-way (threads: no Ray start to wait for), then the same params on 2 Ray tasks: the
    shards the killed run finished keep their inode and mtime, the rest are written, the output is an
    uninterrupted run's; nothing but the output is left."""
    spec = dict(source="fractals", num_classes=4, samples_per_class=700, image_size=48, maxcount=60)
    out = tmp_path / "out"
    code = (f"from pipeline.config import DataConfig\nfrom pipeline.data import shard_dataset\n"
            f"shard_dataset({str(out)!r}, DataConfig(**{spec!r}, shard_tasks=0))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    staging = tmp_path / ".partial.out"
    deadline = time.monotonic() + 30
    while len(list(staging.glob("*.tar"))) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.kill()
    assert proc.wait() == -signal.SIGKILL and not out.exists()
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in staging.glob("*.tar")}
    assert finished
    shard_dataset(out, DataConfig(**spec, shard_tasks=2))
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.tar")}
    assert {n: after[n] for n in finished} == finished and len(after) > len(finished)
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    shard_dataset(tmp_path / "whole", DataConfig(**spec, shard_tasks=0))
    assert _digests(out) == _digests(tmp_path / "whole")


def test_peak_memory_per_task_does_not_grow_with_the_set(ray_local, tmp_path):
    """2 Ray tasks copy through 768, then 3,072 incompressible ~45 kB JPEGs: the tasks' peak RSS grows by
    less than 20 MB; a task that kept its records' bytes would hold ~50 MB more."""
    from PIL import Image

    rng = np.random.default_rng(0)
    peaks = []
    for n in (768, 3072):
        root = tmp_path / f"noise{n}"
        for i in range(n):
            d = root / f"c{i % 2}"
            d.mkdir(parents=True, exist_ok=True)
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)).save(buf, "JPEG", quality=100)
            (d / f"{i:05d}.jpg").write_bytes(buf.getvalue())
        shard_dataset(tmp_path / f"out{n}", DataConfig(source="imagefolder", root=str(root), shard_tasks=2))
        peaks.append(shard_tasks.LAST_RUN["peak_task_rss_mb"])
    assert peaks[1] - peaks[0] < 20, peaks

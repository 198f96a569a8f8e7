"""The shard stage's tar writer: webdataset's TarWriter's bytes without importing torch."""
from __future__ import annotations

import hashlib
import io
import subprocess
import sys

import webdataset as wds

from pipeline.data.shard_tar import TAR_META, write_tar
from tests.data_helpers import REPO


def _samples() -> list[tuple[str, dict[str, bytes]]]:
    """Fields out of sorted order, sizes off and on the 512-byte block, an empty one, more than one
    10 kB tar record in all (the end-of-archive padding)."""
    sizes = [0, 1, 511, 512, 513, 9000, 20_480]
    return [(f"train_{i:07d}", {ext: bytes(range(256)) * (n // 256) + b"x" * (n % 256), "cls": str(i).encode()})
            for i, (n, ext) in enumerate(zip(sizes, ["png", "jpg", "ppm", "jpg", "png", "ppm", "jpg"]))]


def test_the_tar_is_byte_for_byte_webdatasets_and_its_digest_is_its_sha256():
    mine = io.BytesIO()
    digest = write_tar(mine, _samples())
    theirs = io.BytesIO()
    writer = wds.TarWriter(theirs, encoder=False, **TAR_META)
    for key, fields in _samples():
        writer.write({"__key__": key, **fields})
    writer.close()
    assert len(mine.getvalue()) % 10240 == 0 and mine.getvalue() == theirs.getvalue()
    assert digest == hashlib.sha256(theirs.getvalue()).hexdigest()


def test_the_shard_tasks_code_imports_no_torch():
    """What a shard process and each Ray shard task import: no torch, torchvision or webdataset (over a
    CPU-second each on 2 cores); ``encoding: raw`` imports the codec when it is first used."""
    modules = ["shard_tasks", "shard_writer", "record_encode", "sources", "folder", "cifar_source",
               "parquet_source", "fractals"]
    code = (f"import sys\nfor m in {modules!r}: __import__('pipeline.data.' + m)\n"
            f"print(sorted(m for m in ('torch', 'torchvision', 'webdataset') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

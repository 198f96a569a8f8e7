"""A shard's tar written with the standard library, byte for byte what webdataset's
``TarWriter(fileobj, encoder=False, **TAR_META)`` writes, and hashed as it is written.

webdataset's package import pulls in torch (over a CPU-second on a 2-core machine), which every shard
process and Ray shard task would pay for a few tarfile calls. tests/test_shard_tar.py checks the bytes
against webdataset's writer.
"""
from __future__ import annotations

import hashlib
import io
import tarfile
from typing import BinaryIO, Iterable

TAR_META = dict(user="root", group="root", mode=0o444, mtime=0)  # fixed: tars are byte-reproducible


class _Hashing:
    """The writes tarfile makes to ``f``, fed to a sha256 on the way."""

    def __init__(self, f: BinaryIO):
        self.f, self.digest = f, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.f.tell()


def write_tar(f: BinaryIO, samples: Iterable[tuple[str, dict[str, bytes]]]) -> str:
    """Write ``samples`` ``(key, {ext: bytes})`` to ``f`` (open for writing, at its start) as one tar: a
    member ``key.ext`` per field, a sample's fields in sorted order as webdataset writes them (PAX format,
    which webdataset's writer leaves as tarfile's default). Returns the tar's sha256 hex digest."""
    out = _Hashing(f)
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for key, fields in samples:
            for ext in sorted(fields):
                data = fields[ext]
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode = len(data), TAR_META["mtime"], TAR_META["mode"]
                info.uname, info.gname = TAR_META["user"], TAR_META["group"]
                tar.addfile(info, io.BytesIO(data))
    return out.digest.hexdigest()

"""Shards checked against dataset.json as the loaders read them, and samples that cannot be trained on: each
ends in one line naming the shard (and the sample) and what to do. Real tars (digits) throughout."""
from __future__ import annotations

import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from pipeline.cli import _known_failure, _raised_in_loader_worker
from pipeline.data import make_eval_loader, make_train_loader, read_dataset_info
from pipeline.data.integrity import BadSample
from pipeline.data.tario import TarFormatError, tar_members

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

REDO = "run the shard stage again (dvc repro, or python -m stages.shard pretrain)"
BATCH = 16


@pytest.fixture
def shards(tmp_path, digits_dir) -> Path:
    """A writable copy of the digits shards, in a folder named as the pretrain shard stage's output."""
    return Path(shutil.copytree(digits_dir, tmp_path / "pretrain"))


def _steps(shards: Path) -> int:
    return read_dataset_info(shards)["counts"]["train"] // BATCH


def _train(shards, **kw):
    return make_train_loader(shards, batch_size=BATCH, image_size=8, steps_per_epoch=_steps(shards), rank=0,
                             world_size=1, epoch=0, seed=0, augment=None, parcel=1, **kw)


def _victim(shards: Path) -> tuple[Path, dict]:
    entry = read_dataset_info(shards)["shards"]["train"][1]
    return shards / entry["name"], entry


def _one_line(exc: BaseException) -> str:
    """The line the stage prints for ``exc`` (as ``pipeline.cli.run_stage`` turns it into one)."""
    line, code = _known_failure(_raised_in_loader_worker(exc))
    assert code == 1 and "\n" not in line, line
    return line


def test_a_shard_cut_while_the_loader_reads_it_stops_it_and_every_restart(shards):
    """A shard cut at a member boundary after the loader indexed it (a sync cutting it mid-run; a tar
    reader would take the cut for the end of the archive): the next sample past the cut stops the loader
    naming the shard, both sizes and what to do, and so does every loader started after (a Ray worker
    restarted from a checkpoint), in a DataLoader worker too."""
    path, entry = _victim(shards)
    want = (f"{path}: 5,120 bytes, but the shard stage wrote {entry['bytes']:,} ({shards / 'dataset.json'}): "
            f"cut short or changed since; {REDO}")
    batches = iter(_train(shards, last_epoch=1))
    for _ in range(_steps(shards)):  # epoch 0 read whole: the shard indexed, its bytes as written
        next(batches)
    path.write_bytes(path.read_bytes()[:10 * 512])
    with pytest.raises(TarFormatError) as mid_run:
        for _ in batches:
            pass
    assert str(mid_run.value) == want
    for workers in (0, 1):
        with pytest.raises(TarFormatError) as restarted:
            next(iter(_train(shards, num_workers=workers)))
        assert _one_line(restarted.value) == f"error: TarFormatError: {want}"


@pytest.mark.slow
def test_a_shard_changed_in_place_is_named_by_its_sha256(shards):
    """One byte changed, the size kept: a sample's label turned into another valid one, which no size
    check and no decoder notices. Indexed train reads (each DataLoader worker hashing its share), URL
    reads and eval reads all stop naming the shard."""
    import fsspec

    path, entry = _victim(shards)
    data = bytearray(path.read_bytes())
    with open(path, "rb") as f:
        offset = next(o for name, _, o, _ in tar_members(f, str(path), skip_data=True) if name.endswith(".cls"))
    data[offset] = ord("0") + (data[offset] - ord("0") + 1) % 10
    path.write_bytes(data)
    got = hashlib.sha256(data).hexdigest()
    fs, url = fsspec.filesystem("memory"), "memory://integrity/pretrain"
    for p in shards.iterdir():
        fs.pipe(f"/integrity/pretrain/{p.name}", p.read_bytes())

    def message(where):
        return (f"{where}/{entry['name']}: sha256 {got[:12]}…, but the shard stage wrote {entry['sha256'][:12]}… "
                f"({where}/dataset.json): changed since; {REDO}")

    for loader in (_train(shards), _train(shards, num_workers=2),
                   make_eval_loader(shards, "train", batch_size=BATCH, image_size=8, rank=0, world_size=1,
                                    augment=None)):
        with pytest.raises(TarFormatError) as changed:
            list(loader)
        assert _one_line(changed.value) == f"error: TarFormatError: {message(shards)}"
    with pytest.raises(TarFormatError) as remote:
        list(_train(url))
    assert str(remote.value) == message(url)


def _rewrite(shards: Path, key: str, ext: str, data: bytes) -> Path:
    """Replace sample ``key``'s ``ext`` member in the shard holding it, and record the shard's new size and
    sha256 in dataset.json: a listing that matches its tars, so the sample, not the shard, is what is wrong."""
    info = read_dataset_info(shards)
    for entry in info["shards"]["train"]:
        path = shards / entry["name"]
        with tarfile.open(path) as tf:
            members = [(m, tf.extractfile(m).read()) for m in tf.getmembers()]
        if any(m.name == f"{key}.{ext}" for m, _ in members):
            break
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for member, content in members:
            content = data if member.name == f"{key}.{ext}" else content
            member.size = len(content)
            tf.addfile(member, io.BytesIO(content))
    path.write_bytes(buf.getvalue())
    entry.update(bytes=len(buf.getvalue()), sha256=hashlib.sha256(buf.getvalue()).hexdigest())
    (shards / "dataset.json").write_text(json.dumps(info))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("ext, data, what", [
    ("png", b"not an image", "its .png image does not decode (UnidentifiedImageError: cannot identify image file "
                             "'{key}.png')"),
    ("cls", b"12", "label 12 names no class ({shards}/dataset.json lists 10: 0..9)"),
    ("cls", b"dog", "its label 'dog' is not a class number"),
], ids=["corrupt-image", "label-out-of-range", "label-not-a-number"])
def test_a_bad_sample_names_its_shard_and_key(shards, ext, data, what):
    """A sample the train loader decodes in its first step, and the eval loader reads: its image bytes
    are not an image, or its label names no class of dataset.json's: one line naming the shard, the key and
    what to do, in the rank or a DataLoader worker (not PIL's ``<_io.BytesIO object at 0x…>`` or torch's
    ``Target 12 is out of bounds`` at the loss)."""
    (_, _, keys), = list(_train(shards, return_keys=True))[:1]
    key = keys[0]
    path = _rewrite(shards, key, ext, data)
    want = f"error: BadSample: {path}: sample {key}: {what.format(key=key, shards=shards)}; the shard stage " \
           f"writes no such sample: {REDO}"
    for loader in (_train(shards), _train(shards, num_workers=1),
                   make_eval_loader(shards, "train", batch_size=BATCH, image_size=8, rank=0, world_size=1,
                                    augment=None)):
        with pytest.raises(BadSample) as bad:
            list(loader)
        assert _one_line(bad.value) == want


def test_only_a_loader_workers_own_error_is_unwrapped():
    """torch re-raises a DataLoader worker's error as its type with the worker's traceback for a message:
    the stage's line is the worker's own message; anything else is left as it is."""
    from torch._utils import ExceptionWrapper

    try:
        raise TarFormatError("/data/train-000001.tar: truncated tar archive (a 304-byte header)")
    except TarFormatError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(TarFormatError) as reraised:
        wrapped.reraise()
    assert "Original Traceback" in str(reraised.value)
    assert _one_line(reraised.value) == "error: TarFormatError: /data/train-000001.tar: truncated tar archive " \
                                        "(a 304-byte header)"
    plain = ValueError("Caught nothing: a message of its own")
    assert _raised_in_loader_worker(plain) is plain

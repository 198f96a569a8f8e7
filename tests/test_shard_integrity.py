"""Shards checked against dataset.json as the loaders read them: a shard cut or changed ends in one line
naming it and what to do. Real tars (digits) throughout."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from pipeline.cli import _known_failure, _raised_in_loader_worker
from pipeline.data import make_eval_loader, make_train_loader, read_dataset_info
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

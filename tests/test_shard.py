"""Shard stage: every source into real WebDataset tars + manifest, read back; errors; atomic writes."""
from __future__ import annotations

import errno
import json
import math
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import DataConfig
from pipeline.data import (
    make_eval_loader,
    make_train_loader,
    read_dataset_info,
    record_encode,
    shard_dataset,
    shard_tasks,
)
from tests.data_helpers import (
    CIFAR_TGZ,
    REPO,
    img_bytes,
    make_fake_cifar,
    make_hf_parquet,
    make_imagefolder,
    sideways_photo,
    tar_keys,
)


def test_digits_counts_and_each_sample_once(digits_dir):
    info = read_dataset_info(digits_dir)
    assert info["classes"] == [str(i) for i in range(10)]
    assert sum(info["counts"].values()) == 1797
    assert info["counts"] == {"train": 1257, "val": 180, "test": 360}
    keys = []
    sources = []
    for split in ("train", "val", "test"):
        assert sum(sh["count"] for sh in info["shards"][split]) == info["counts"][split]
        for sh in info["shards"][split]:
            k = tar_keys(digits_dir / sh["name"])
            assert len(k) == sh["count"] <= 200
            assert sh["bytes"] == (digits_dir / sh["name"]).stat().st_size
            keys += k
    assert len(keys) == len(set(keys)) == 1797
    import pyarrow.parquet as pq
    manifest = pq.read_table(digits_dir / "manifest.parquet").to_pydict()
    assert sorted(manifest["key"]) == sorted(keys)
    sources = manifest["source_path"]
    assert len(set(sources)) == 1797  # every source image written exactly once
    # stratified: every class in every split
    for split in ("train", "val", "test"):
        assert all(c > 0 for c in info["class_counts"][split])


def test_digits_tar_contents(digits_dir):
    info = read_dataset_info(digits_dir)
    with tarfile.open(digits_dir / info["shards"]["test"][0]["name"]) as tf:
        members = tf.getmembers()
        assert {m.name.rsplit(".", 1)[1] for m in members} == {"png", "cls"}
        assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "root" for m in members)
        import io

        from PIL import Image
        img = Image.open(io.BytesIO(tf.extractfile(members[1] if members[1].name.endswith("png")
                                                   else members[0]).read()))
        assert img.size == (8, 8) and img.mode == "L"
        assert np.asarray(img).max() > 200  # scaled from 0..16 to 0..255


@pytest.mark.slow
def test_byte_identical_rerun(tmp_path):
    a = shard_dataset(tmp_path / "a", DataConfig(source="digits", maxcount=500, seed=3))
    b = shard_dataset(tmp_path / "b", DataConfig(source="digits", maxcount=500, seed=3))
    assert a["shards"] == b["shards"]
    for split in a["shards"]:
        for sh in a["shards"][split]:
            assert (tmp_path / "a" / sh["name"]).read_bytes() == (tmp_path / "b" / sh["name"]).read_bytes()
    c = shard_dataset(tmp_path / "c", DataConfig(source="digits", maxcount=500, seed=4))
    assert c["shards"]["train"][0]["sha256"] != a["shards"]["train"][0]["sha256"]


def test_rerun_replaces_old_output(tmp_path):
    out = tmp_path / "out"
    shard_dataset(out, DataConfig(source="digits", maxcount=100))
    assert len(read_dataset_info(out)["shards"]["train"]) == 13
    shard_dataset(out, DataConfig(source="digits", maxcount=1000))
    assert sorted(p.name for p in out.glob("train-*.tar")) == ["train-000000.tar", "train-000001.tar"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_what_a_killed_run_left_is_cleared_by_the_next(tmp_path):
    """A run killed outright (SIGKILL, the OOM killer) leaves its half-written copy beside the output, or, killed
    between the two renames, the previous output aside: the next run puts that back, removes the half copy
    and replaces the output (each killed run used to leave one more copy of the shards behind)."""
    out = tmp_path / "out"
    shard_dataset(out, DataConfig(source="digits", maxcount=1000))
    before = read_dataset_info(out)["shards"]
    (tmp_path / ".partial.out").mkdir()
    (tmp_path / ".partial.out/train-000000.tar").write_bytes(b"half")
    out.rename(tmp_path / ".partial.old.out")  # killed after moving the old output aside
    shard_dataset(out, DataConfig(source="digits", maxcount=1000))
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and read_dataset_info(out)["shards"] == before


def test_a_signal_while_the_shards_are_swapped_in_keeps_the_previous_ones(tmp_path, monkeypatch, stage_signals):
    """SIGTERM between moving the previous shards aside and the new ones in: the previous ones come back whole
    and nothing is left beside them (the output used to be gone, the previous one hidden aside)."""
    import signal

    from pipeline.signals import StageInterrupted

    out = tmp_path / "out"
    shard_dataset(out, DataConfig(source="digits", maxcount=100))
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = os.replace

    def signalled(src, dst):
        if Path(dst) == out:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(src, dst)

    monkeypatch.setattr(os, "replace", signalled)
    with pytest.raises(StageInterrupted):
        shard_dataset(out, DataConfig(source="digits", maxcount=1000))
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_atomic_on_failure(tmp_path, monkeypatch):
    calls = {"n": 0}
    real = record_encode.prepare

    def flaky(rec, max_side, **kw):
        calls["n"] += 1
        if calls["n"] == 700:
            raise RuntimeError("boom mid-way")
        return real(rec, max_side, **kw)

    monkeypatch.setattr(record_encode, "prepare", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        shard_dataset(tmp_path / "out", DataConfig(source="digits", maxcount=100))
    assert list(tmp_path.iterdir()) == []  # no out_dir, no temp dir


def test_atomic_failure_keeps_previous_output(tmp_path, monkeypatch):
    out = tmp_path / "out"
    first = shard_dataset(out, DataConfig(source="digits", maxcount=1000))
    monkeypatch.setattr(record_encode, "prepare", lambda rec, ms, **kw: (_ for _ in ()).throw(KeyError("x")))
    with pytest.raises(KeyError):
        shard_dataset(out, DataConfig(source="digits", maxcount=10))
    assert read_dataset_info(out) == first
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_refuses_to_replace_foreign_dir(tmp_path):
    (tmp_path / "precious.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="dataset.json"):
        shard_dataset(tmp_path, DataConfig(source="digits"))
    assert (tmp_path / "precious.txt").exists()


@pytest.mark.parametrize("kw, match", [
    (dict(source="nope"), "valid"),
    (dict(val_fraction=0.6, test_fraction=0.5), "< 1"),
    (dict(maxcount=0), "maxcount"),
    (dict(max_bad_fraction=1.0), r"max_bad_fraction: 1.0 must be in \[0, 1\)"),  # the params check's range
])
def test_bad_params(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        shard_dataset(tmp_path / "x", DataConfig(**kw))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("n, val_fraction, test_fraction", [(100, 0.1, 0.15), (1000, 0.1, 0.3), (2000, 0.05, 0.3),
                                                             (3000, 0.1, 0.2), (1797, 0.1, 0.2)])
def test_carved_splits_take_their_fractions_of_the_whole(n, val_fraction, test_fraction):
    """Each carved split holds ceil(fraction x N) samples, not one more where floating point lands a whole
    count just above itself (0.15 x 100 = 15.000000000000002); the three are disjoint and cover N."""
    from pipeline.data.splits import carve_splits
    splits = carve_splits(np.arange(n) % 3, 0, val_fraction, test_fraction)
    assert len(splits["val"]) == math.ceil(round(val_fraction * n, 6))
    assert len(splits["test"]) == math.ceil(round(test_fraction * n, 6))
    assert sorted(np.concatenate(list(splits.values())).tolist()) == list(range(n))


def _folder_without_classes(root: Path) -> None:
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()


@pytest.mark.parametrize("make, kw, match", [
    (lambda root: None, {}, r"imagefolder root {root} does not exist; expected root/<class>/<image> or "),
    (lambda root: root.write_text("x"), {}, r"imagefolder root {root} is a file, not a directory"),
    (lambda root: root.mkdir(), {}, r"imagefolder root {root} has no class directories; expected root/<class>"),
    (_folder_without_classes, {}, r"imagefolder root {root}: no class directories under \['test', 'train'\]"),
    (lambda root: (make_imagefolder(root), (root / "cow").mkdir()), {},
     r"class directory {root}/cow is empty; expected image files with extensions \['.bmp'"),
    (make_imagefolder, dict(class_names=["cat", "dog"]),
     r"class directories \['eel'\] under {root} are not in class_names \['cat', 'dog'\]"),
], ids=["missing", "a-file", "no-classes", "splits-without-classes", "empty-class", "unknown-class"])
def test_imagefolder_bad_layout_names_the_folder_and_the_layout(tmp_path, make, kw, match):
    """Every way an imagefolder root can be wrong names the folder and what is expected, before any shard
    is written (before: split directories without classes ended in "the train split is empty")."""
    root = tmp_path / "src"
    make(root)
    with pytest.raises((ValueError, FileNotFoundError), match="^" + match.format(root=re.escape(str(root)))):
        shard_dataset(tmp_path / "out", DataConfig(source="imagefolder", root=root, **kw))
    assert not (tmp_path / "out").exists()


def test_imagefolder_keeps_bytes_and_reencodes_others(tmp_path):
    root = make_imagefolder(tmp_path / "src")
    (root / "cat" / "notes.txt").write_text("not an image: ignored")
    out = tmp_path / "out"
    info = shard_dataset(out, DataConfig(source="imagefolder", root=root, maxcount=5))
    assert info["classes"] == ["cat", "dog", "eel"] and sum(info["counts"].values()) == 24
    import pyarrow.parquet as pq
    manifest = pq.read_table(out / "manifest.parquet").to_pylist()
    members = {}
    for split in info["shards"]:
        for sh in info["shards"][split]:
            with tarfile.open(out / sh["name"]) as tf:
                members.update({m.name: tf.extractfile(m).read() for m in tf.getmembers()})
    assert len(manifest) == 24
    for row in manifest:
        src = root / row["source_path"]
        if src.suffix in (".jpg", ".png"):
            assert members[f"{row['key']}.{src.suffix[1:]}"] == src.read_bytes()  # no re-encode
        else:  # BMP -> PNG
            assert f"{row['key']}.png" in members
        assert members[f"{row['key']}.cls"] == str(row["label"]).encode()
        assert info["classes"][row["label"]] == src.parent.name


def test_imagefolder_given_splits_and_val_carve(tmp_path):
    root = make_imagefolder(tmp_path / "src", per_class=10, splits=["train", "test"])
    info = shard_dataset(tmp_path / "out", DataConfig(source="imagefolder", root=root, val_fraction=0.2,
                                                      test_fraction=0.5))  # test_fraction ignored: test is given
    assert info["given_splits"] == ["test", "train"]
    assert info["counts"] == {"train": 24, "val": 6, "test": 30}
    assert info["class_counts"]["val"] == [2, 2, 2]


def test_raw_encoding_stores_the_pixels_the_loader_decodes(tmp_path):
    """``encoding: raw``: every sample is binary PPM (any image tool reads it) holding exactly the pixels
    the loader decodes from the source shard's bytes: JPEG, PNG, grayscale and RGBA inputs alike."""
    import io

    import pyarrow.parquet as pq
    import torch
    from PIL import Image

    from pipeline.data.loader import decode_sample
    rng = np.random.default_rng(1)
    root = make_imagefolder(tmp_path / "in", per_class=4)
    (root / "cat" / "gray.png").write_bytes(img_bytes(rng, "PNG", mode="L"))
    (root / "dog" / "alpha.png").write_bytes(img_bytes(rng, "PNG", mode="RGBA"))
    (root / "eel" / "gray.jpg").write_bytes(img_bytes(rng, "JPEG", mode="L"))
    samples = {}
    for encoding in ("source", "raw"):
        out = tmp_path / encoding
        info = shard_dataset(out, DataConfig(source="imagefolder", root=root, encoding=encoding, val_fraction=0,
                                             test_fraction=0))
        assert info["params"]["encoding"] == encoding
        with tarfile.open(out / info["shards"]["train"][0]["name"]) as tf:
            members = {m.name: tf.extractfile(m).read() for m in tf.getmembers()}
        keys = sorted({name.split(".")[0] for name in members})
        samples[encoding] = {k: {n.split(".", 1)[1]: v for n, v in members.items() if n.startswith(k + ".")} for k in keys}
        sizes = dict(zip(*pq.read_table(out / "manifest.parquet", columns=["key", "bytes"]).to_pydict().values()))
        assert all(sizes[k] == len(next(v for e, v in sample.items() if e != "cls"))
                   for k, sample in samples[encoding].items())
    assert samples["raw"].keys() == samples["source"].keys() and len(samples["raw"]) == 15
    for key, raw in samples["raw"].items():
        assert sorted(raw) == ["cls", "ppm"], key
        img, label = decode_sample(raw)
        want, want_label = decode_sample(samples["source"][key])
        assert label == want_label and torch.equal(img, want), key
        pil = np.asarray(Image.open(io.BytesIO(raw["ppm"])))
        assert np.array_equal(pil, img.permute(1, 2, 0).numpy()), key


def test_imagefolder_max_side(tmp_path):
    root = tmp_path / "src"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    rng = np.random.default_rng(0)
    (root / "a" / "big.jpg").write_bytes(img_bytes(rng, "JPEG", size=(40, 30)))
    (root / "b" / "small.png").write_bytes(img_bytes(rng, "PNG", size=(8, 6)))
    out = tmp_path / "out"
    shard_dataset(out, DataConfig(source="imagefolder", root=root, max_side=16, val_fraction=0, test_fraction=0))
    import io

    from PIL import Image
    with tarfile.open(out / "train-000000.tar") as tf:
        sizes = {m.name.rsplit(".", 1)[1]: Image.open(io.BytesIO(tf.extractfile(m).read())).size
                 for m in tf.getmembers() if not m.name.endswith(".cls")}
    assert sizes == {"jpg": (16, 12), "png": (8, 6)}


def test_corrupt_files_skipped_and_reported(tmp_path):
    root = make_imagefolder(tmp_path / "src", per_class=6)
    good = (root / "cat" / "000.jpg").read_bytes()
    (root / "cat" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "dog" / "garbage.png").write_bytes(b"definitely not a png")
    with pytest.raises(ValueError, match=r"max_bad_fraction=0.0.*(truncated|garbage)"):
        shard_dataset(tmp_path / "strict", DataConfig(source="imagefolder", root=root))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    info = shard_dataset(tmp_path / "ok", DataConfig(source="imagefolder", root=root, max_bad_fraction=0.1))
    bad = json.loads((tmp_path / "ok" / "bad_files.json").read_text())
    assert sorted(b["path"] for b in bad) == ["cat/truncated.jpg", "dog/garbage.png"]
    assert info["bad_files"] == bad and sum(info["counts"].values()) == 18


def _with_bad_images(root: Path) -> Path:
    good = (root / "cat" / "000.jpg").read_bytes()
    (root / "cat" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "dog" / "garbage.png").write_bytes(b"definitely not a png")
    return root


def test_bad_file_report_is_byte_identical_between_runs(tmp_path):
    """PIL names the stream it was given (``<_io.BytesIO object at 0x…>``): the report names the file."""
    root = _with_bad_images(make_imagefolder(tmp_path / "src", per_class=6))
    for out in ("a", "b"):
        shard_dataset(tmp_path / out, DataConfig(source="imagefolder", root=root, max_bad_fraction=0.1))
    for name in ("bad_files.json", "dataset.json"):
        text = (tmp_path / "a" / name).read_text()
        assert "object at 0x" not in text and text == (tmp_path / "b" / name).read_text()
    bad = json.loads((tmp_path / "a" / "bad_files.json").read_text())
    assert [b["path"] for b in bad] == ["cat/truncated.jpg", "dog/garbage.png"]  # sorted by path
    assert bad[1]["error"] == "UnidentifiedImageError: cannot identify image file 'dog/garbage.png'"


@pytest.mark.slow
def test_stage_warns_about_skips_empty_test_and_unlearnable_class(tmp_path):
    """`python -m stages.shard`: skipped images counted per split, no test split, a class only in val."""
    root = make_imagefolder(tmp_path / "src", classes=("cat", "dog"), per_class=6, splits=["train", "val"])
    make_imagefolder(root / "val", classes=("eel",), per_class=2)
    _with_bad_images(root / "train")
    (tmp_path / "params.yaml").write_text(
        f"data:\n  pretrain:\n    source: imagefolder\n    root: {root}\n    max_bad_fraction: 0.2\n")
    proc = subprocess.run([sys.executable, "-m", "stages.shard", "pretrain"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"VIT_PARAMS": "params.yaml", "PYTHONPATH": str(REPO),
                                                       "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("[shard:pretrain] warning: ")]
    assert [w.split(": ", 1)[1] for w in warnings] == [
        "skipped 2 undecodable image(s) (train 2, val 0, test 0); the list is in data/shards/pretrain/bad_files.json",
        "the test split is empty (the source has no test split; test_fraction applies only to sources without "
        "splits of their own): the evaluate and export stages have no test images",
        "class 'eel' has no train images (val 2, test 0): the model cannot learn it",
    ], proc.stderr
    # what evaluate and export then say: only a test split of its own fills it, no fraction does
    from pipeline.data.shard_dir import require_split
    shards = tmp_path / "data/shards/pretrain"
    with pytest.raises(ValueError, match=r"\(the source has no test split; .*\): the evaluate and export stages "
                                         r"have no test images; give the source a test/ folder, then run the shard"):
        require_split(shards, read_dataset_info(shards), "test")


@pytest.mark.slow
@pytest.mark.parametrize("per_class, extra, line", [
    (1, "", "error: ValueError: data.pretrain (imagefolder {root}): val_fraction takes 1 of the 1 image(s) left to "
            "it, leaving none to train on: add images, or lower val_fraction\n"),
    (4, "    max_bad_fraction: 0.1\n",
     "error: ValueError: data.pretrain (imagefolder {root}): more than max_bad_fraction=0.1 of the 10 images (1) "
     "are undecodable, seen before stopping: 2; the first: "),
], ids=["too-few-images", "too-many-bad-images"])
def test_stage_names_the_data_whose_images_do_not_do(tmp_path, per_class, extra, line):
    """Too few images for the split fractions, too many undecodable ones: the line names the data section
    and its root, the key to change and what it counts (before: "fraction 0.125 of 1 samples leaves
    nothing for the remaining split"; "1 undecodable image(s) out of 20" when every one was)."""
    root = make_imagefolder(tmp_path / "src", classes=("cat", "dog"), per_class=per_class)
    if extra:
        _with_bad_images(root)
    (tmp_path / "params.yaml").write_text(f"data:\n  pretrain:\n    source: imagefolder\n    root: {root}\n{extra}")
    proc = subprocess.run([sys.executable, "-m", "stages.shard", "pretrain"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"VIT_PARAMS": "params.yaml", "PYTHONPATH": str(REPO),
                                                       "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1 and proc.stderr.startswith(line.format(root=root)), proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "data/shards/pretrain").exists()


def test_full_disk_is_one_line_and_keeps_the_previous_output(tmp_path, monkeypatch, capsys):
    """ENOSPC mid-way (injected: CI cannot fill a disk): one error line, exit 1, the temp dir removed."""
    from pipeline.cli import run_stage
    from stages.shard import main as shard_stage

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VIT_PARAMS", "params.yaml")
    Path("params.yaml").write_text("data:\n  pretrain:\n    source: digits\n    maxcount: 100\n")
    run_stage(shard_stage, "pretrain")
    before = {p.name: p.read_bytes() for p in Path("data/shards/pretrain").iterdir()}
    Path("params.yaml").write_text("data:\n  pretrain:\n    source: digits\n    maxcount: 300\n")
    real, calls = shard_tasks.assemble_shard, {"n": 0}

    def assemble(*args):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)

    monkeypatch.setattr(shard_tasks, "assemble_shard", assemble)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        run_stage(shard_stage, "pretrain")
    err = capsys.readouterr().err
    assert exit_.value.code == 1 and len(err.splitlines()) == 1, err
    assert err.startswith("error: no space left on the device of data/shards while writing the shards "
                          "(No space left on device); the partial output was removed"), err
    assert [p.name for p in Path("data/shards").iterdir()] == ["pretrain"]
    assert {p.name: p.read_bytes() for p in Path("data/shards/pretrain").iterdir()} == before
    open_files = [os.readlink(fd) for fd in Path("/proc/self/fd").iterdir() if fd.is_symlink()]
    assert not [f for f in open_files if ".partial.pretrain" in f]  # no tar left to finish at exit


def test_imagefolder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=tmp_path / "missing"))
    (tmp_path / "file.jpg").write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=tmp_path / "file.jpg"))
    root = make_imagefolder(tmp_path / "src", per_class=3)
    (root / "empty_class").mkdir()
    with pytest.raises(ValueError, match="empty_class is empty"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=root))
    (root / "empty_class").rmdir()
    with pytest.raises(ValueError, match=r"\['eel'\].*not in class_names"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=root, class_names=["cat", "dog"]))
    with pytest.raises(ValueError, match=r"\['fox'\] have no samples"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=root,
                                                 class_names=["cat", "dog", "eel", "fox"]))
    assert not (tmp_path / "o").exists()


def test_parquet_both_encodings(tmp_path):
    src = make_hf_parquet(tmp_path / "pq")
    info = shard_dataset(tmp_path / "out", DataConfig(source="parquet", root=src, maxcount=10))
    assert info["classes"] == ["ant", "bee", "cow"]
    assert sum(info["counts"].values()) == 48
    loader = make_eval_loader(tmp_path / "out", "train", batch_size=64, image_size=8, rank=0,
                              world_size=1, augment={})
    (x, y), = list(loader)
    assert x.shape == (info["counts"]["train"], 3, 8, 8)
    assert np.bincount(y.numpy()).tolist() == info["class_counts"]["train"]


def test_parquet_sorted_by_class_is_sharded_shuffled(tmp_path, monkeypatch):
    """A file stored class by class (as Hugging Face's imagefolder builder writes one) is written in a
    seeded shuffled order, as the other sources are: in file order each shard held one class. Every row
    once, the same shards from the same seed, the spool files gone."""
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    rows = [(img_bytes(rng, "PNG"), c) for c in range(4) for _ in range(30)]  # 4 classes x 30, sorted
    src = tmp_path / "sorted.parquet"
    pq.write_table(pa.table({"image": pa.array([b for b, _ in rows], pa.binary()),
                             "label": pa.array([c for _, c in rows], pa.int64())}), src, row_group_size=16)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("pipeline.data.parquet_source.SPOOL_BYTES", 2000)  # several buckets for 120 small images
    cfg = DataConfig(source="parquet", root=src, maxcount=10, val_fraction=0.0, test_fraction=0.0)
    shard_dataset(tmp_path / "out", cfg)
    manifest = pq.read_table(tmp_path / "out/manifest.parquet").to_pylist()
    per_shard = {}
    for r in manifest:
        per_shard.setdefault(r["shard"], set()).add(r["label"])
    assert len(per_shard) == 12 and min(map(len, per_shard.values())) >= 2
    assert np.mean([len(c) for c in per_shard.values()]) >= 3  # file order: one class each
    assert sorted((r["source_path"], r["label"]) for r in manifest) == sorted(
        (f"sorted.parquet#{i}", c) for i, (_, c) in enumerate(rows))
    assert not list((tmp_path / "tmp").iterdir())
    shard_dataset(tmp_path / "again", cfg)
    assert pq.read_table(tmp_path / "again/manifest.parquet").equals(pq.read_table(tmp_path / "out/manifest.parquet"))


def test_parquet_given_splits_and_class_names(tmp_path):
    src = make_hf_parquet(tmp_path / "pq")
    (src / "part-0.parquet").rename(src / "train-00000-of-00001.parquet")
    (src / "part-1.parquet").rename(src / "test-00000-of-00001.parquet")
    info = shard_dataset(tmp_path / "out", DataConfig(source="parquet", root=src, val_fraction=0.25,
                                                      class_names=["A", "B", "C"]))
    assert info["classes"] == ["A", "B", "C"]
    assert info["counts"] == {"train": 18, "val": 6, "test": 24}


def test_parquet_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    src = make_hf_parquet(tmp_path / "pq")
    with pytest.raises(ValueError, match=r"label 2 is unknown; valid labels are 0..1"):
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=src, class_names=["x", "y"]))
    with pytest.raises(ValueError, match=r"class_names names \['x'\] more than once"):  # every source alike
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=src, class_names=["x", "y", "x"]))
    (src / "imgs" / "3.png").unlink()
    with pytest.raises(FileNotFoundError, match="imgs/3.png"):
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=src))
    with pytest.raises(FileNotFoundError, match="no \\*.parquet"):
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=src / "imgs"))
    pq.write_table(pa.table({"img": [b"x"], "label": [0]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"has no 'image' column \(image_column: name the column\); "
                                         r"columns are \['img', 'label'\]"):
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=tmp_path / "bad.parquet"))
    assert not (tmp_path / "o").exists()


def test_cifar10_pickle(tmp_path):
    import pickle
    root = make_fake_cifar(tmp_path / "src")
    info = shard_dataset(tmp_path / "out", DataConfig(source="cifar", root=root, val_fraction=0.1))
    assert info["classes"] == [f"c{i}" for i in range(10)]
    assert info["counts"] == {"train": 90, "val": 10, "test": 20}
    # pixels survive exactly (PNG is lossless; CHW -> HWC handled)
    import io

    import pyarrow.parquet as pq
    from PIL import Image
    row = [r for r in pq.read_table(tmp_path / "out" / "manifest.parquet").to_pylist()
           if r["split"] == "test"][0]
    fname, j = row["source_path"].split(":")[0].split("#")
    with open(root / "cifar-10-batches-py" / fname, "rb") as fh:
        ref = pickle.load(fh, encoding="bytes")[b"data"][int(j)].reshape(3, 32, 32).transpose(1, 2, 0)
    with tarfile.open(tmp_path / "out" / row["shard"]) as tf:
        got = np.asarray(Image.open(io.BytesIO(tf.extractfile(f"{row['key']}.png").read())))
    assert np.array_equal(got, ref)


def test_cifar100_pickle_and_errors(tmp_path):
    root = make_fake_cifar(tmp_path / "src", hundred=True, per_file=100)
    info = shard_dataset(tmp_path / "out", DataConfig(source="cifar", root=root / "cifar-100-python"))
    assert len(info["classes"]) == 100 and info["counts"]["test"] == 100
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no CIFAR python batches"):
        shard_dataset(tmp_path / "o", DataConfig(source="cifar", root=tmp_path / "empty"))
    with pytest.raises(ValueError, match="is a file"):
        shard_dataset(tmp_path / "o", DataConfig(source="cifar", root=root / "cifar-100-python" / "meta"))


def test_damaged_cifar_batch_is_named(tmp_path):
    """A batch cut short by an interrupted download or extraction (a raw pickle traceback before), or
    another pickle under its name: a ValueError naming the file."""
    import pickle
    root = make_fake_cifar(tmp_path / "src")
    batch = root / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(batch.read_bytes()[:1000])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(batch))}: not a readable CIFAR python batch "
                                         rf"\(UnpicklingError: pickle data was truncated\); extract"):
        shard_dataset(tmp_path / "o", DataConfig(source="cifar", root=root))
    batch.write_bytes(pickle.dumps({b"other": 1}))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(batch))}: not a CIFAR python batch \(no labels\)"):
        shard_dataset(tmp_path / "o", DataConfig(source="cifar", root=root))
    for data in ([1, 2, 3], np.zeros((19, 3072), np.uint8)):  # not rows of pixels; a row short of its 20 labels
        batch.write_bytes(pickle.dumps({b"labels": [0] * 20, b"data": data}))
        with pytest.raises(ValueError, match=rf"^{re.escape(str(batch))}: its data is \({len(data)},[^)]*\), not one "
                                             r"row of 3 x 32 x 32 pixels for each of its 20 labels; extract"):
            shard_dataset(tmp_path / "o", DataConfig(source="cifar", root=root))
    assert not (tmp_path / "o").exists()



def test_cifar_batches_load_as_pickled_and_a_planted_one_is_refused_unrun(tmp_path):
    """The unpickler admits what numpy's arrays pickle with, as the release has it (Python 2, numpy 1's
    module names) and as Python 3 writes it at protocol 5; a batch that names anything else, such as a
    function that runs a command, is refused naming the file, and nothing in it runs."""
    import pickle

    from tests.data_helpers import cifar_pickle
    from tests.faults import RunsCode

    release = make_fake_cifar(tmp_path / "release", python2=True)
    info = shard_dataset(tmp_path / "out", DataConfig(source="cifar", root=release))
    assert info["classes"] == [f"c{i}" for i in range(10)] and info["counts"]["test"] == 20
    batch = release / "cifar-10-batches-py" / "data_batch_3"
    assert b"cnumpy.core.multiarray\n_reconstruct" in batch.read_bytes()
    with open(batch, "rb") as fh:
        rows = pickle.load(fh, encoding="bytes")
    batch.write_bytes(pickle.dumps(rows, protocol=5))
    assert shard_dataset(tmp_path / "out5", DataConfig(source="cifar", root=release))["counts"] == info["counts"]
    marker = tmp_path / "marker"
    with open(batch, "wb") as fh:
        cifar_pickle({**rows, b"labels": RunsCode(marker)}, fh, python2=True)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(batch))}: not a readable CIFAR python batch \(Unpickling"
                                         r"Error: it names posix.system, which a CIFAR batch does not hold; refused, "
                                         r"not run\); extract the CIFAR archive again$"):
        shard_dataset(tmp_path / "o", DataConfig(source="cifar", root=release))
    assert not marker.exists() and not (tmp_path / "o").exists()

def test_split_names_beside_train_are_all_splits(tmp_path):
    """``dev/`` names val; a folder or file beside ``train`` that names no split is an error (the split
    folders were read as classes, every image labelled by its split; parquet pooled the given splits)."""
    root = make_imagefolder(tmp_path / "src", classes=("cat", "dog"), per_class=3, splits=["train", "dev", "test"])
    info = shard_dataset(tmp_path / "out", DataConfig(source="imagefolder", root=root))
    assert info["classes"] == ["cat", "dog"] and info["counts"] == {"train": 6, "val": 6, "test": 6}
    (root / "dev").rename(root / "holdout")
    with pytest.raises(ValueError, match=r"imagefolder root .*: \['holdout'\] beside the split\(s\) \['test', 'train'\] "
                                         r"name no split \(split names: train, val, valid, validation, dev, test\)"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=root))
    src = make_hf_parquet(tmp_path / "pq")
    (src / "part-0.parquet").rename(src / "train-00000-of-00001.parquet")
    with pytest.raises(ValueError, match=r"parquet root .*: \['part-1.parquet'\] beside the split\(s\) \['train'\]"):
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=src))
    assert not (tmp_path / "o").exists()


def test_allowed_bad_images_count_as_the_fraction_says(tmp_path):
    """29 undecodable of 100 is within max_bad_fraction 0.29 (0.29 * 100 is 28.999... in floating point)."""
    root = make_imagefolder(tmp_path / "src", classes=("cat", "dog"), per_class=36)
    sorted((root / "dog").iterdir())[0].unlink()  # 71 good images
    for i in range(29):
        (root / "cat" / f"bad{i:02d}.png").write_bytes(b"not a png")
    info = shard_dataset(tmp_path / "out", DataConfig(source="imagefolder", root=root, max_bad_fraction=0.29,
                                                      val_fraction=0.0, test_fraction=0.0))
    assert len(info["bad_files"]) == 29 and info["counts"]["train"] == 71


def test_fractals(tmp_path):
    info = shard_dataset(tmp_path / "a", DataConfig(source="fractals", num_classes=8, samples_per_class=50,
                                                    image_size=24, maxcount=100))
    assert len(info["classes"]) == 8 and sum(info["counts"].values()) == 400
    again = shard_dataset(tmp_path / "b", DataConfig(source="fractals", num_classes=8, samples_per_class=50,
                                                     image_size=24, maxcount=100))
    assert again["shards"] == info["shards"]  # seeded: byte-identical
    (x, y), = list(make_eval_loader(tmp_path / "a", "test", batch_size=200, image_size=24, rank=0,
                                    world_size=1, augment={"mean": [0] * 3, "std": [1] * 3}))
    assert x.shape == (80, 3, 24, 24)
    per_img_std = x.flatten(1).std(dim=1)
    assert (per_img_std > 0.02).all()  # no blank renders


@pytest.fixture(scope="module")
def cifar10_test_dir(tmp_path_factory) -> Path:
    if not CIFAR_TGZ.exists():
        pytest.skip(f"shared CIFAR-10 archive not found at {CIFAR_TGZ} (../shared/data/ relative to repo)")
    dest = tmp_path_factory.mktemp("cifar10")
    with tarfile.open(CIFAR_TGZ) as tf:  # only the 10k test images keep this fast
        members = [m for m in tf.getmembers() if m.name.startswith("test/")]
        tf.extractall(dest, members=members, filter="data")
    return dest / "test"


def test_progress_line_says_images_per_second_and_what_is_left():
    assert shard_tasks.progress_line(2500, 10000, 10.0) == "[shard] 2,500/10,000 images (25%), 250 img/s, ETA 0m30s"
    assert shard_tasks.progress_line(1000, 10**6, 10.0).endswith("100 img/s, ETA 2h46m")


def test_fractals_at_imagenet_size_as_jpegs(tmp_path):
    """``encoding: jpeg`` stores 256-px fractals as RGB JPEGs; a listed record holds no pixels, so tasks render them."""
    import io
    import pickle

    from PIL import Image

    from pipeline.data.sources import list_source

    spec = DataConfig(source="fractals", num_classes=2, samples_per_class=5, image_size=256, encoding="jpeg")
    info = shard_dataset(tmp_path / "a", spec)
    with tarfile.open(tmp_path / "a" / info["shards"]["train"][0]["name"]) as tar:
        images = [tar.extractfile(m).read() for m in tar.getmembers() if not m.name.endswith(".cls")]
    assert images and all(Image.open(io.BytesIO(b)).format == "JPEG" for b in images)
    assert {Image.open(io.BytesIO(b)).size for b in images} == {(256, 256)}
    listing = list_source("fractals", seed=0, val_fraction=0.1, test_fraction=0.2, class_names=None, num_classes=2,
                          samples_per_class=5, image_size=256)
    records = list(listing.records)
    records[0].load()
    assert len(pickle.dumps(records)) < 256 * 256  # no rendered image travels with them


@pytest.mark.slow
def test_shared_cifar10_imagefolder(tmp_path, cifar10_test_dir):
    out = tmp_path / "c10"
    info = shard_dataset(out, DataConfig(source="imagefolder", root=cifar10_test_dir, maxcount=2000))
    assert info["classes"] == ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog",
                               "horse", "ship", "truck"]
    assert info["counts"] == {"train": 7000, "val": 1000, "test": 2000}
    assert info["class_counts"]["test"] == [200] * 10 and info["bad_files"] == []
    sh = info["shards"]["test"][0]
    with tarfile.open(out / sh["name"]) as tf:
        names = [m.name for m in tf.getmembers()]
    assert len(names) == 2 * sh["count"] and all(n.endswith((".jpg", ".cls")) for n in names)
    sizes = []
    for rank in range(2):
        loader = make_eval_loader(out, "test", batch_size=256, image_size=32, rank=rank, world_size=2,
                                  augment={})
        sizes.append(sum(len(y) for _, y in loader))
    assert sizes == [1000, 1000]
    loader = make_train_loader(out, batch_size=128, image_size=32, steps_per_epoch=3, rank=0,
                               world_size=2, epoch=0, seed=0,
                               augment={"random_resized_crop": [0.5, 1.0], "hflip": 0.5})
    assert [tuple(x.shape) for x, _ in loader] == [(128, 3, 32, 32)] * 3


def _decoded_stats(out: Path) -> tuple[np.ndarray, np.ndarray]:
    import io

    from PIL import Image

    from pipeline.data import tario
    info = read_dataset_info(out)
    pixels = np.concatenate([
        np.asarray(Image.open(io.BytesIO(s.get("jpg") or s["png"])).convert("RGB"), dtype=np.float64).reshape(-1, 3)
        for s in tario.tarfile_samples([{"url": str(out / sh["name"])} for sh in info["shards"]["train"]])]) / 255
    return pixels.mean(0), pixels.std(0)


def test_pixel_stats_are_the_train_split_stats(tmp_path):
    """dataset.json's pixel_stats equal mean/std over every pixel of the decoded train tars."""
    root = make_imagefolder(tmp_path / "src", per_class=9)
    out = tmp_path / "out"
    info = shard_dataset(out, DataConfig(source="imagefolder", root=root, val_fraction=0.2, test_fraction=0.2, seed=1))
    mean, std = _decoded_stats(out)
    assert info["pixel_stats"]["split"] == "train"
    np.testing.assert_allclose(info["pixel_stats"]["mean"], mean, atol=2e-6)
    np.testing.assert_allclose(info["pixel_stats"]["std"], std, atol=2e-6)
    assert len(set(info["pixel_stats"]["mean"])) == 3  # colour images: the channels differ


@pytest.mark.slow
def test_shard_benchmark_runs_on_a_small_imagefolder(tmp_path):
    """``benchmarks/shard_speed.py`` (docs/data.md's sharding benchmark), shrunk: an ImageFolder given as ``--data``
    (so no CIFAR-10 tarball is extracted), upscaled to 40 px, sharded by 1 and 2 Ray tasks, re-encoded and copied;
    its last line the figures as JSON, recorded where the tests send records."""
    make_imagefolder(tmp_path / "data", splits=["train"], per_class=10)
    proc = subprocess.run([sys.executable, "benchmarks/shard_speed.py", "--data", tmp_path / "data", "--image-size", "40",
                           "--max-side", "16", "--out", tmp_path / "out", "--maxcount", "8", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.splitlines()[-1])
    assert figures["images"] == 30 and figures["identical"] is True
    assert set(figures["img_per_s_per_core"]) == set(figures["scaling_1_to_2"]) == {"reencode", "copy"}
    assert all(v > 0 for v in figures["img_per_s_per_core"].values())
    assert re.search(r"reencode, 2 task\(s\): 30 images -> \d+ shards in [\d.]+ s = \d+ img/s", proc.stdout), proc.stdout
    info = read_dataset_info(tmp_path / "out" / "reencode-2")
    assert info["params"]["max_side"] == 16 and sum(info["counts"].values()) == 30
    record = json.loads((Path(os.environ["VIT_RESULTS_DIR"]) / "shard_speed.jsonl").read_text().splitlines()[-1])
    assert record["figures"]["images"] == 30 and record["case"] == "imagefolder-40px"
    assert record["command"].startswith("python benchmarks/shard_speed.py --data ")


def test_shard_benchmark_names_a_missing_or_damaged_tarball(tmp_path):
    # --cifar-tarball: a missing or a damaged one is one line, exit 2 (it was exit 1, or a traceback), nothing left
    (tmp_path / "cut.tar.gz").write_bytes(b"\x1f\x8b not a whole tarball")
    for tarball, says in (("nope.tar.gz", "no such CIFAR-10 tarball"), ("cut.tar.gz", "not a whole CIFAR-10 tarball")):
        bad = subprocess.run([sys.executable, "benchmarks/shard_speed.py", "--data", tmp_path / "cifar",
                              "--cifar-tarball", tmp_path / tarball, "--out", tmp_path / "out2"],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        assert bad.returncode == 2 and bad.stderr == f"error: {tmp_path / tarball}: {says}" + bad.stderr.split(says)[1]
        assert bad.stderr.count("\n") == 1 and not (tmp_path / "cifar").exists() and not (tmp_path / "out2").exists()


def test_deep_grayscale_is_scaled_to_8_bits_and_float_images_are_skipped(tmp_path):
    """16-bit PNG and PGM inputs (PIL modes I;16 and I) shard, both encodings decode to each value's
    high byte (not clipped at 255), and the pixel stats are those pixels'; a float TIFF is a bad image."""
    import pyarrow.parquet as pq
    import torch
    from PIL import Image

    from pipeline.data import tario
    from pipeline.data.loader import decode_sample
    root = make_imagefolder(tmp_path / "in", per_class=3)
    ramp = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 1024)  # 0 .. 64512: high bytes 0, 4, .. 252
    Image.fromarray(ramp).save(root / "cat" / "deep.png")
    (root / "dog" / "deep.pgm").write_bytes(b"P5\n8 8\n65535\n" + (ramp + 700).astype(">u2").tobytes())
    Image.fromarray(np.full((8, 8), 0.5, np.float32)).save(root / "eel" / "float.tif")
    for encoding in ("source", "raw"):
        out = tmp_path / encoding
        info = shard_dataset(out, DataConfig(source="imagefolder", root=root, encoding=encoding, val_fraction=0,
                                             test_fraction=0, max_bad_fraction=0.1))
        bad = json.loads((out / "bad_files.json").read_text())
        assert [b["path"] for b in bad] == ["eel/float.tif"] and "mode F" in bad[0]["error"]
        manifest = pq.read_table(out / "manifest.parquet", columns=["key", "source_path"]).to_pydict()
        name_of = {k: Path(p).name for k, p in zip(manifest["key"], manifest["source_path"])}
        decoded = {s["__key__"]: decode_sample(s)[0] for s in tario.tarfile_samples(
            [{"url": str(out / sh["name"])} for sh in info["shards"]["train"]])}
        for name, values in (("deep.png", ramp), ("deep.pgm", ramp + 700)):
            want = torch.from_numpy((values >> 8).astype(np.uint8)).expand(3, 8, 8)
            [got] = [img for key, img in decoded.items() if name_of[key] == name]
            assert torch.equal(got, want), (encoding, name)
        pixels = torch.cat([img.flatten(1) for img in decoded.values()], 1).double() / 255
        np.testing.assert_allclose(info["pixel_stats"]["mean"], pixels.mean(1), atol=2e-6)
        np.testing.assert_allclose(info["pixel_stats"]["std"], pixels.std(1, correction=0), atol=2e-6)


def test_imagefolder_layouts_that_would_mislabel_are_one_line(tmp_path):
    """Split folders without train/ (`val/` + `test/`, `training/` + `validation/`) were read as classes,
    each image labelled with its split; images straight in a split folder or the root were dropped in
    silence; an empty class under `validation/` was named under `val/`; a repeated class name merged."""
    root = make_imagefolder(tmp_path / "a", per_class=2, splits=["val", "test"])
    with pytest.raises(ValueError, match=r"\['test', 'val'\] name a split but none is the train split"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=root))
    root = make_imagefolder(tmp_path / "b", per_class=2, splits=["train", "test"])
    (root / "test" / "loose.png").write_bytes((root / "train/cat/001.png").read_bytes())
    with pytest.raises(ValueError, match=rf"^{root / 'test'} holds 1 image\(s\) directly \(e.g. loose.png\), "
                                         "outside any class directory; a split directory must hold"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=root))
    root = make_imagefolder(tmp_path / "c", per_class=2, splits=["train", "validation"])
    (root / "validation" / "fox").mkdir()
    with pytest.raises(ValueError, match=rf"class directory {root / 'validation' / 'fox'} is empty"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=root))
    root = make_imagefolder(tmp_path / "d", per_class=2)
    with pytest.raises(ValueError, match=r"class_names names \['cat'\] more than once"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=root, class_names=["cat", "cat", "eel"]))
    (root / "stray.jpg").write_bytes((root / "cat/000.jpg").read_bytes())
    with pytest.raises(ValueError, match=r"holds 1 image\(s\) directly .*the root must hold"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=root))
    assert not (tmp_path / "o").exists()


def test_one_class_is_refused(tmp_path):
    """One class trained to top-1 1.0 and exited 0: most often an archive unpacked one level deeper than
    its classes (root/PetImages/{cat,dog}/), named with the root meant; a one-class folder, parquet file
    or num_classes: 1 is refused too."""
    nested = make_imagefolder(tmp_path / "nested" / "PetImages", classes=("cat", "dog"), per_class=2).parent
    with pytest.raises(ValueError, match=rf"holds one directory, PetImages/, .*did you mean root: "
                                         rf"{re.escape(str(nested / 'PetImages'))}\?"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=nested))
    single = make_imagefolder(tmp_path / "single", classes=("cat",), per_class=4)
    with pytest.raises(ValueError, match=r"1 class\(es\) \['cat'\]; a classifier needs at least 2"):
        shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=single))
    parquet = make_hf_parquet(tmp_path / "pq", classes=("ant",))
    with pytest.raises(ValueError, match=r"a classifier needs at least 2"):
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=parquet))
    with pytest.raises(ValueError, match=r"num_classes: 1 must be >= 2"):
        shard_dataset(tmp_path / "o", DataConfig(source="fractals", num_classes=1))
    assert not (tmp_path / "o").exists()


def test_imagefolder_follows_links_and_keeps_any_file_name(tmp_path):
    """Images in a folder linked into a class are read (as torchvision's ImageFolder does; a link back up
    the tree is read once), and a file name that is not UTF-8 (an old zip's Latin-1) is kept in the
    manifest escaped, where it stopped the run after every image was written."""
    import pyarrow.parquet as pq

    root = make_imagefolder(tmp_path / "src", per_class=3)
    more = make_imagefolder(tmp_path / "more", classes=("cat",), per_class=2)
    (root / "cat" / "batch2").symlink_to(more / "cat", target_is_directory=True)
    (root / "cat" / "loop").symlink_to(root / "cat", target_is_directory=True)
    latin1 = os.fsencode(root / "dog") + b"/caf\xe9.png"
    with open(latin1, "wb") as f:
        f.write((root / "dog/001.png").read_bytes())
    info = shard_dataset(tmp_path / "o", DataConfig(source="imagefolder", root=root, val_fraction=0, test_fraction=0))
    assert info["class_counts"]["train"] == [5, 4, 3]
    names = pq.read_table(tmp_path / "o/manifest.parquet").column("source_path").to_pylist()
    assert "dog/caf\\xe9.png" in names and sum(n.startswith("cat/batch2/") for n in names) == 2


def test_parquet_columns_from_the_huggingface_metadata(tmp_path):
    """The image and label columns are the ones the huggingface metadata types Image / ClassLabel (beans:
    `image`, `labels`; cifar10: `img`), or the ones image_column / label_column name; two ClassLabels
    (cifar100's fine_label, coarse_label) are one line naming them. Before, only `image` / `label` worked."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    imgs = [{"bytes": img_bytes(rng, "PNG"), "path": f"{i}.png"} for i in range(12)]
    features = {"img": {"_type": "Image"}, "fine_label": {"_type": "ClassLabel", "names": ["a", "b", "c"]},
                "coarse_label": {"_type": "ClassLabel", "names": ["x", "y"]}}
    table = pa.table({"img": imgs, "fine_label": [i % 3 for i in range(12)], "coarse_label": [i % 2 for i in range(12)]})
    (tmp_path / "src").mkdir()
    pq.write_table(table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": features}})}),
                   tmp_path / "src/train-00000.parquet")
    with pytest.raises(ValueError, match=r"has no 'label' column \(label_column: its metadata types "
                                         r"\['fine_label', 'coarse_label'\] as ClassLabel: name one\)"):
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=str(tmp_path / "src")))
    info = shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=str(tmp_path / "src"),
                                                    label_column="coarse_label"))
    assert info["classes"] == ["x", "y"] and sum(info["counts"].values()) == 12
    del features["coarse_label"]  # now one ClassLabel: found without being named
    pq.write_table(table.drop(["coarse_label"]).replace_schema_metadata(
        {"huggingface": json.dumps({"info": {"features": features}})}), tmp_path / "src/train-00000.parquet")
    assert shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=str(tmp_path / "src")))["classes"] == \
        ["a", "b", "c"]


def test_parquet_problems_name_the_file_or_the_folder(tmp_path, monkeypatch):
    """A damaged data page and unreadable huggingface metadata name the file (they were `error: Corrupt snappy
    compressed data.` and a bare JSONDecodeError); a full $TMPDIR while the rows are spooled names $TMPDIR,
    not the shards' device; only test/validation files, no train one, are refused rather than pooled."""
    import pickle

    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.cli import _known_failure
    from pipeline.data import parquet_source

    rng = np.random.default_rng(0)
    table = pa.table({"image": [img_bytes(rng, "PNG", size=(64, 64)) for _ in range(40)], "label": [0, 1] * 20})
    (tmp_path / "src").mkdir()
    pq.write_table(table, tmp_path / "src/train-00000.parquet")
    damaged = bytearray((tmp_path / "src/train-00000.parquet").read_bytes())
    damaged[4:204] = bytes(200)  # the first page's header, after the magic bytes; the footer intact
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad/train-00000.parquet").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'bad/train-00000.parquet'} is not a readable parquet file"):
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=str(tmp_path / "bad")))
    pq.write_table(table.replace_schema_metadata({"huggingface": "{not json"}), tmp_path / "bad/train-00000.parquet")
    with pytest.raises(ValueError, match=r"train-00000.parquet: its 'huggingface' schema metadata is not the JSON"):
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=str(tmp_path / "bad")))
    (tmp_path / "bad/train-00000.parquet").rename(tmp_path / "bad/validation-00000.parquet")
    with pytest.raises(ValueError, match=r"\['validation-00000.parquet'\] name a split but none is the train"):
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=str(tmp_path / "bad")))

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(parquet_source.pickle, "dump", full)
    with pytest.raises(OSError) as exc:
        shard_dataset(tmp_path / "o", DataConfig(source="parquet", root=str(tmp_path / "src")))
    line = _known_failure(exc.value)[0]
    assert line.startswith("error: no space left in ") and "($TMPDIR), where the parquet rows wait" in line, line
    monkeypatch.setattr(parquet_source.pickle, "dump", pickle.dump)
    assert not (tmp_path / "o").exists()


def test_column_keys_are_for_the_parquet_source_only():
    from pipeline.config import ConfigError, load_params

    with pytest.raises(ConfigError, match=r"data.finetune.label_column: 'labels' would be ignored: only source "
                                          "'parquet' reads it"):
        load_params(REPO / "params.yaml", {"data.finetune.label_column": "labels"})


def test_exif_orientation_is_applied_and_other_images_keep_their_bytes(tmp_path):
    """A photo tagged "turn 90°" trains the right way up in both encodings; images without an orientation
    tag keep their bytes (the tag of 1, "upright", too)."""
    import pyarrow.parquet as pq
    from PIL import Image

    from pipeline.data import tario
    from pipeline.data.loader import decode_sample
    root = make_imagefolder(tmp_path / "in", per_class=3)
    photos = {"phone.jpg": sideways_photo(root / "cat" / "phone.jpg", "JPEG"),
              "phone.png": sideways_photo(root / "dog" / "phone.png", "PNG")}
    exif = Image.Exif()
    exif[0x0112] = 1
    Image.open(root / "eel" / "000.jpg").save(root / "eel" / "tagged-upright.jpg", exif=exif)
    for encoding in ("source", "raw"):
        out = tmp_path / encoding
        info = shard_dataset(out, DataConfig(source="imagefolder", root=root, encoding=encoding, val_fraction=0,
                                             test_fraction=0))
        manifest = pq.read_table(out / "manifest.parquet", columns=["key", "source_path"]).to_pydict()
        source_of = dict(zip(manifest["key"], manifest["source_path"]))
        samples = {s["__key__"]: s for s in tario.tarfile_samples(
            [{"url": str(out / sh["name"])} for sh in info["shards"]["train"]])}
        for key, sample in samples.items():
            name = Path(source_of[key]).name
            img = decode_sample(sample)[0].permute(1, 2, 0).numpy()
            if name in photos:
                assert img.shape == (24, 16, 3), (encoding, name)  # upright: taller than wide
                top, rest = img[:4].reshape(-1, 3).mean(0), img[10:].astype(int)  # JPEG blurs the band's edge
                assert np.abs(top - photos[name][0, 0]).max() < 12 and rest.max() < 40, (encoding, name)
            elif encoding == "source" and name.endswith((".jpg", ".png")):  # BMPs become PNGs
                stored = next(v for k, v in sample.items() if k in ("jpg", "png"))
                assert stored == (root / source_of[key]).read_bytes(), name


def test_imagefolder_records_pickle_as_their_own_path(tmp_path):
    """A chunk of records sent to a shard task carries its own paths, not the whole listing's."""
    import pickle
    from pathlib import PurePosixPath

    from pipeline.data.folder import imagefolder_listing

    def records(per_class: int, root_text: str) -> list:
        root = make_imagefolder(tmp_path / f"src{per_class}", per_class=per_class)
        listing = imagefolder_listing(root=root_text.format(root=root), seed=0, val_fraction=0.0,
                                      test_fraction=0.0, class_names=None)
        return list(listing.records)

    small, large = records(2, "{root}"), records(200, "{root}/")
    assert len(pickle.dumps(large[0])) < 2 * len(pickle.dumps(small[0]))
    assert pickle.loads(pickle.dumps(large[5])).load() == (tmp_path / "src200" / large[5].source_path).read_bytes()
    assert all(PurePosixPath(r.source_path).parts[0] in ("cat", "dog", "eel") for r in large + small)

"""The lean tar reader against webdataset's, and the per-sample transforms against torchvision's."""
from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest
import torch

from pipeline.data import read_dataset_info


@pytest.mark.parametrize("interp", ["nearest", "bilinear", "bicubic"])
@pytest.mark.parametrize("rrc", [None, [0.3, 1.0]])
def test_sample_transform_interpolations(interp, rrc):
    from pipeline.data.transforms import SampleTransform
    x = torch.randint(0, 256, (3, 40, 30), dtype=torch.uint8)
    aug = {"interpolation": interp, "random_resized_crop": rrc, "auto_augment": "randaugment", "hflip": 1.0}
    y = SampleTransform(16, aug, train=True)(x)
    assert y.shape == (3, 16, 16) and y.dtype == torch.uint8
    with pytest.raises(ValueError, match="valid: \\['bicubic', 'bilinear', 'nearest'\\]"):
        SampleTransform(16, {"interpolation": "area"}, train=True)


def _write_tar(path: Path, members: list[tuple[str, bytes]], fmt: int) -> Path:
    import io
    with tarfile.open(path, "w", format=fmt) as tf:
        d = tarfile.TarInfo("a_dir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_tario_reads_what_webdataset_reads(tmp_path, fmt):
    """Same samples as webdataset.tarfile_samples: long names (pax / GNU / ustar prefix), non-ASCII
    names, directories and __meta__ files skipped, empty and block-sized members."""
    import webdataset as wds

    from pipeline.data import tario
    long_dir = "d" * 120
    members = [(f"{long_dir}/s_1.jpg", b"\xff" * 700), (f"{long_dir}/s_1.cls", b"3"),
               ("s_2.jpg", b"x" * 512), ("s_2.cls", b""), ("__meta__", b"z")]
    if fmt != tarfile.USTAR_FORMAT:
        members.append(("é" * 60 + "_3.txt", b"h" * 1025))  # > 100 bytes in UTF-8: needs pax / GNU
    path = _write_tar(tmp_path / "x.tar", members, fmt)
    ours = list(tario.tarfile_samples([{"url": str(path)}]))
    assert ours == list(wds.tarfile_samples([{"url": str(path)}]))
    assert [s["__key__"] for s in ours][:2] == [f"{long_dir}/s_1", "s_2"]
    assert ours[0]["jpg"] == b"\xff" * 700 and ours[1]["cls"] == b""
    index = tario.IndexedShards()  # headers only, bytes on demand: the same samples
    assert [index.load(r) for r in index([{"url": str(path)}])] == ours


@pytest.mark.slow
def test_tario_matches_webdataset_on_shards(digits_dir):
    import webdataset as wds

    from pipeline.data import tario
    urls = [{"url": str(digits_dir / sh["name"])} for sh in read_dataset_info(digits_dir)["shards"]["train"]]
    ours = list(tario.tarfile_samples(urls))
    assert len(ours) == read_dataset_info(digits_dir)["counts"]["train"]
    assert ours == list(wds.tarfile_samples(urls))
    index = tario.IndexedShards()
    records = list(index(urls))
    assert [r["__key__"] for r in records] == [s["__key__"] for s in ours]
    assert all(isinstance(r["jpg" if "jpg" in r else "png"], tuple) for r in records)  # no bytes held
    assert [index.load(r) for r in reversed(records)] == ours[::-1]  # random access


def test_indexed_shards_keep_few_files_open(digits_dir, monkeypatch):
    """A reader of many shards keeps only the ``OPEN_SHARDS`` it used last open: it kept every shard it had
    read, and a set of more shards than the process's file limit (1,024, often) stopped mid-epoch."""
    import os

    from pipeline.data import tario
    monkeypatch.setattr(tario, "OPEN_SHARDS", 2)
    urls = [{"url": str(digits_dir / sh["name"])} for sh in read_dataset_info(digits_dir)["shards"]["train"]]
    assert len(urls) > 3
    ours = list(tario.tarfile_samples(urls))
    index = tario.IndexedShards()
    fds = len(os.listdir("/proc/self/fd"))
    loaded = [index.load(r) for r in index(urls)]
    assert len(os.listdir("/proc/self/fd")) <= fds + 2 and len(index._files) == 2
    assert loaded == ours and [index.load(r) for r in reversed(list(index(urls)))] == ours[::-1]


def test_train_loader_same_batches_from_a_url(digits_dir):
    """URLs are read in full, local shards through the header index: the same batches."""
    import fsspec

    from pipeline.data import make_train_loader
    fs = fsspec.filesystem("memory")
    for p in digits_dir.iterdir():
        fs.pipe(f"/shards_idx/{p.name}", p.read_bytes())
    kw = dict(batch_size=16, image_size=8, steps_per_epoch=3, rank=0, world_size=1, epoch=1, seed=4,
              augment={"random_resized_crop": [0.5, 1.0], "hflip": 0.5}, return_keys=True)
    local, remote = list(make_train_loader(digits_dir, **kw)), list(make_train_loader("memory://shards_idx", **kw))
    for (x, y, k), (x2, y2, k2) in zip(local, remote, strict=True):
        assert k == k2 and torch.equal(x, x2) and torch.equal(y, y2)


@pytest.mark.parametrize("damage, match", [
    (lambda b: b[:1500], "truncated tar archive"),
    (lambda b: b[:300], "truncated tar archive"),
    (lambda b: b"", "empty file"),
    (lambda b: b[:148] + b"0000001\0" + b[156:], "checksum mismatch"),
    (lambda b: bytes(range(256)) * 8, "not a tar archive"),
])
def test_tario_bad_shards_raise_naming_the_file(digits_dir, tmp_path, damage, match):
    from pipeline.data import tario
    good = (digits_dir / read_dataset_info(digits_dir)["shards"]["train"][0]["name"]).read_bytes()
    bad = tmp_path / "bad.tar"
    bad.write_bytes(damage(good))
    with pytest.raises(tario.TarFormatError, match=match) as err:
        list(tario.tarfile_samples([{"url": str(bad)}]))
    assert str(bad) in str(err.value)


def test_crop_params_follow_torchvision_distribution():
    """crop_params is RandomResizedCrop.get_params drawn from random.Random: same distribution."""
    import random
    import statistics

    from torchvision import transforms as v1

    from pipeline.data.transforms import crop_params
    n, h, w = 6000, 32, 48
    ours = [crop_params(random.Random(i), h, w, (0.08, 1.0)) for i in range(n)]
    torch.manual_seed(0)
    ref = [v1.RandomResizedCrop.get_params(torch.zeros(3, h, w), [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(n)]
    for k in range(4):
        a, b = [p[k] for p in ours], [p[k] for p in ref]
        assert abs(statistics.mean(a) - statistics.mean(b)) < 0.06 * statistics.pstdev(b) + 0.05, k
        assert abs(statistics.pstdev(a) - statistics.pstdev(b)) < 0.06 * statistics.pstdev(b), k
    assert all(0 <= i and 0 <= j and i + ch <= h and j + cw <= w for i, j, ch, cw in ours)
    assert crop_params(random.Random(1), 10, 100, (0.99, 1.0)) == (0, 43, 10, 13)  # fallback: ratio clamp


@pytest.mark.parametrize("interp", ["nearest", "bilinear", "bicubic"])
def test_sample_transform_equals_torchvision_ops(interp):
    """The seeded transform is torchvision's resized_crop + horizontal_flip with crop_params' box."""
    import random

    from torchvision.transforms.v2 import functional as F

    from pipeline.data.transforms import INTERPOLATIONS, SampleTransform, crop_params
    x = torch.randint(0, 256, (3, 37, 29), dtype=torch.uint8)
    t = SampleTransform(24, {"interpolation": interp, "random_resized_crop": [0.2, 1.0], "hflip": 0.5}, train=True)
    flips = 0
    for seed in range(20):
        rng = random.Random(seed)
        i, j, h, w = crop_params(rng, 37, 29, (0.2, 1.0))
        ref = F.resized_crop(x, i, j, h, w, [24, 24], interpolation=INTERPOLATIONS[interp], antialias=True)
        if rng.random() < 0.5:
            ref, flips = F.horizontal_flip(ref), flips + 1
        assert torch.equal(t.apply(x, seed), ref), seed
    assert 0 < flips < 20


def test_random_crop_is_torchvision_padded_crop_with_every_offset():
    """``random_crop: p`` (after the resize) is RandomCrop(size, padding=p): the zero-padded image cut at
    an offset drawn per seed, every offset in [0, 2p]^2 reachable; then the flip. The reference
    pipeline has torchvision's own RandomCrop there."""
    import random

    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional as F

    from pipeline.data.transforms import SampleTransform, train_transform
    x = torch.randint(1, 256, (3, 12, 12), dtype=torch.uint8)  # no zero pixel: the padding shows
    t = SampleTransform(12, {"random_crop": 3, "hflip": 0.5}, train=True)
    offsets = set()
    for seed in range(400):
        rng = random.Random(seed)
        i, j = rng.randint(0, 6), rng.randint(0, 6)
        ref = F.crop(F.pad(x, [3]), i, j, 12, 12)
        if rng.random() < 0.5:
            ref = F.horizontal_flip(ref)
        assert torch.equal(t.apply(x, seed), ref), seed
        offsets.add((i, j))
    assert len(offsets) == 49
    assert torch.equal(SampleTransform(12, {"random_crop": 3}, train=False).apply(x, 0), x)  # eval: no crop
    assert any(isinstance(op, v2.RandomCrop) and op.padding == [3, 3, 3, 3]
               for op in train_transform(12, {"random_crop": 3}).transforms)


@pytest.mark.parametrize("augment, needle", [
    ({"random_crop": -1}, "augment.random_crop must be null or the padding in pixels (an int >= 0), got -1"),
    ({"random_crop": 2.5}, "augment.random_crop must be null or the padding in pixels (an int >= 0), got 2.5"),
    ({"random_crop": 4, "random_resized_crop": [0.5, 1.0]}, "choose one crop (set the other to null)"),
])
def test_random_crop_bad_values(augment, needle):
    from pipeline.data.augment import resolve_augment
    with pytest.raises(ValueError, match=re.escape(needle)):
        resolve_augment(augment)


def _ramp_jpeg(width: int, height: int) -> bytes:
    """R rises left to right, G top to bottom, B constant: a crop's edges can be read off its pixels."""
    import numpy as np

    from tests.data_helpers import jpeg_bytes
    x = np.linspace(0, 255, width)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height)[:, None].repeat(width, 1)
    return jpeg_bytes(np.stack([x, y, np.full_like(x, 128)], -1).round().astype(np.uint8), quality=95)


DRAFT_AUGMENTS = {"train": ({"random_resized_crop": [0.08, 1.0], "hflip": 0.5, "interpolation": "bilinear"}, True),
                  "eval": ({}, False)}


@pytest.mark.parametrize("case", sorted(DRAFT_AUGMENTS))
def test_draft_decode_covers_the_full_decodes_region(case):
    """A JPEG decoded at 1/4 or 1/8 size (libjpeg's DCT scaling) then cropped and resized gives the
    region and flip of the full decode's path for the same seed: on ramps, an edge off by 1 % of the
    image is ~2.5 levels; both paths agree within 2 at every pixel's mean over a row or column."""
    from pipeline.data.codec import decode
    from pipeline.data.transforms import SampleTransform
    aug, train = DRAFT_AUGMENTS[case]
    t = SampleTransform(64, aug, train=train)
    data = _ramp_jpeg(1200, 900)
    drafted = flipped = 0
    for seed in range(40):
        fast = t.apply_encoded(data, seed)
        if fast is None:
            continue
        drafted += 1
        full = t.apply(decode("jpg", data), seed).float()
        fast = fast.float()
        assert fast.shape == full.shape == (3, 64, 64)
        for ch, dim in ((0, 1), (1, 2)):  # R's column means (x extent), G's row means (y extent)
            assert (fast[ch].mean(dim - 1) - full[ch].mean(dim - 1)).abs().max() < 2.0, (seed, ch)
        flipped += bool(full[0, :, 0].mean() > full[0, :, -1].mean())
    assert drafted >= 10  # the reduced decode ran (crops of >= 256 px of a 1200 x 900 image)
    assert not train or 0 < flipped < drafted  # flips drawn as in the full path, both ways


@pytest.mark.parametrize("case", sorted(DRAFT_AUGMENTS))
def test_draft_decode_pixels_close_to_full_decode(case):
    """On photo-like JPEGs at 224 px the reduced decode's pixels stay within a few levels of the full
    decode's (mean absolute difference; another region would be tens), and an image too small to
    reduce is left to the full path."""
    import numpy as np

    from pipeline.data.codec import decode
    from pipeline.data.draft import draft_scale
    from pipeline.data.transforms import SampleTransform
    from tests.data_helpers import jpeg_bytes, photo
    aug, train = DRAFT_AUGMENTS[case]
    t = SampleTransform(224, aug, train=train)
    rng = np.random.default_rng(0)
    diffs = []
    for seed in range(16):
        data = jpeg_bytes(photo(rng, (2000, 1500), detail=24))
        fast = t.apply_encoded(data, seed)
        if fast is not None:
            diffs.append(float((fast.float() - t.apply(decode("jpg", data), seed).float()).abs().mean()))
    # noise of +-6 levels, averaged by the DCT scaling and by the resize differently: 0.4 to 3.5 here
    assert len(diffs) >= 4 and max(diffs) < 4.0 and sum(diffs) / len(diffs) < 2.5, diffs
    assert t.apply_encoded(jpeg_bytes(photo(rng, (800, 600))), 0) is None  # < 896 px: no scale-down fits
    assert SampleTransform(32, aug, train=train).apply_encoded(data, 0) is None  # small outputs decode in full
    assert [draft_scale(n, n, 224) for n in (895, 896, 1791, 1792, 5000)] == [1, 4, 4, 8, 8]


def test_jpeg_size_reads_the_frame_header():
    """The size read from a JPEG's header (baseline, progressive, grayscale) is Pillow's; other bytes: None."""
    import io

    import numpy as np
    from PIL import Image

    from pipeline.data.draft import jpeg_size
    from tests.data_helpers import photo
    arr = photo(np.random.default_rng(0), (37, 23))
    for mode, kw in (("RGB", {}), ("RGB", {"progressive": True}), ("L", {}), ("RGB", {"exif": b"Exif\0\0" + b"x" * 300})):
        buf = io.BytesIO()
        Image.fromarray(arr).convert(mode).save(buf, "JPEG", **kw)
        assert jpeg_size(buf.getvalue()) == (37, 23), (mode, kw)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    assert jpeg_size(buf.getvalue()) is None and jpeg_size(b"\xff\xd8\xff") is None


def test_each_augment_choice_has_its_pipeline():
    """augment.py names the choices params.yaml may give (checked without torchvision); transforms.py builds each."""
    from pipeline.data.augment import AUTO_AUGMENTS, INTERPOLATION_CHOICES
    from pipeline.data.transforms import AUTO_AUGMENT_TRANSFORMS, INTERPOLATIONS

    assert set(AUTO_AUGMENT_TRANSFORMS) == set(AUTO_AUGMENTS) - {None}
    assert [mode.value for mode in INTERPOLATIONS.values()] == list(INTERPOLATION_CHOICES)

"""Helpers shared by the data tests: read tar keys back, build small source datasets in tmp_path."""
from __future__ import annotations

import io
import json
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np

from pipeline.data import read_dataset_info

REPO = Path(__file__).resolve().parents[1]
CIFAR_TGZ = REPO.parent / "shared" / "data" / "cifar10-jpg.tar.gz"


def tar_keys(path: Path) -> list[str]:
    """Sample keys in a tar, in order (one per image member)."""
    with tarfile.open(path) as tf:
        return [m.name.rsplit(".", 1)[0] for m in tf.getmembers() if not m.name.endswith(".cls")]


def all_keys(out: Path, split: str) -> list[str]:
    info = read_dataset_info(out)
    return [k for sh in info["shards"][split] for k in tar_keys(out / sh["name"])]


def img_bytes(rng, fmt: str, size=(12, 10), mode="RGB") -> bytes:
    import io

    from PIL import Image
    arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    img = Image.fromarray(arr).convert(mode)
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def make_imagefolder(root: Path, classes=("cat", "dog", "eel"), per_class=8, splits=None, seed=0) -> Path:
    rng = np.random.default_rng(seed)
    for split in (splits or [""]):
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                fmt, ext = [("JPEG", "jpg"), ("PNG", "png"), ("BMP", "bmp")][i % 3]
                (d / f"{i:03d}.{ext}").write_bytes(img_bytes(rng, fmt))
    return root


def make_hf_parquet(d: Path, n=24, classes=("ant", "bee", "cow"), seed=0) -> Path:
    """Two HF-style files: image as struct<bytes, path> (some rows path-only) and as raw bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    (d / "imgs").mkdir()
    meta = {b"huggingface": json.dumps({"info": {"features": {
        "image": {"_type": "Image"}, "label": {"names": list(classes), "_type": "ClassLabel"}}}}).encode()}
    structs, labels = [], []
    for i in range(n):
        b = img_bytes(rng, "PNG" if i % 2 else "JPEG")
        if i % 4 == 3:  # path-only row, resolved relative to the parquet file
            (d / "imgs" / f"{i}.png").write_bytes(b)
            structs.append({"bytes": None, "path": f"imgs/{i}.png"})
        else:
            structs.append({"bytes": b, "path": f"orig_{i}.jpg"})
        labels.append(i % len(classes))
    t1 = pa.table({"image": structs, "label": pa.array(labels, pa.int64())})
    pq.write_table(t1.replace_schema_metadata(meta), d / "part-0.parquet")
    raw = [img_bytes(rng, "PNG") for _ in range(n)]
    t2 = pa.table({"image": pa.array(raw, pa.binary()), "label": pa.array(labels, pa.int32())})
    pq.write_table(t2.replace_schema_metadata(meta), d / "part-1.parquet", row_group_size=5)
    return d


class _Python2Pickler(pickle._Pickler):
    """Protocol 2 with bytes and str as Python 2's ``str`` (BINSTRING): how the CIFAR release was pickled."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_bytes(self, obj: bytes) -> None:
        n = len(obj)
        self.write(pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n))
        self.write(obj)
        self.memoize(obj)

    def save_str(self, obj: str) -> None:  # Python 2's str literals (numpy's dtype codes among them): bytes too
        self.save_bytes(obj.encode("latin-1"))

    dispatch[bytes], dispatch[str] = save_bytes, save_str


def cifar_pickle(obj, fh, python2: bool = False) -> None:
    """``obj`` pickled into ``fh``: as this Python does by default, or (``python2``) as the release is, by
    Python 2 with numpy 1's module names."""
    if not python2:
        pickle.dump(obj, fh)
        return
    buf = io.BytesIO()
    _Python2Pickler(buf, protocol=2).dump(obj)
    fh.write(buf.getvalue().replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n"))


def make_fake_cifar(root: Path, hundred=False, per_file=20, seed=0, python2=False) -> Path:
    """The real python-pickle layout (bytes keys, uint8 rows of 3072 in CHW order); ``python2``: pickled
    as the release is (see :func:`cifar_pickle`)."""
    rng = np.random.default_rng(seed)
    if hundred:
        d, n_cls, files, meta = root / "cifar-100-python", 100, ["train", "test"], "meta"
        names_key, labels_key = "fine_label_names", "fine_labels"
    else:
        d, n_cls = root / "cifar-10-batches-py", 10
        files, meta = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"], "batches.meta"
        names_key, labels_key = "label_names", "labels"
    d.mkdir(parents=True)
    for f in files:
        n = per_file * (5 if hundred and f == "train" else 1)
        batch = {b"batch_label": f.encode(), labels_key.encode():
                 [i % n_cls for i in range(n)], b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"filenames": [f"img_{f}_{i}.png".encode() for i in range(n)]}
        with open(d / f, "wb") as fh:
            cifar_pickle(batch, fh, python2)
    with open(d / meta, "wb") as fh:
        cifar_pickle({names_key.encode(): [f"c{i}".encode() for i in range(n_cls)]}, fh, python2)
    return root


def sideways_photo(path: Path, fmt: str) -> np.ndarray:
    """A portrait photo (16 wide, 24 tall, a red band along its top) saved as a phone saves one: its pixels
    turned a quarter counter-clockwise and an EXIF orientation of 6 (show it turned a quarter clockwise).
    Returns the upright pixels."""
    from PIL import Image
    upright = np.zeros((24, 16, 3), np.uint8)
    upright[:6] = (250, 30, 30)
    exif = Image.Exif()
    exif[0x0112] = 6
    quality = {"quality": 95} if fmt == "JPEG" else {}
    Image.fromarray(np.rot90(upright).copy()).save(path, fmt, exif=exif, **quality)
    return upright


def photo(rng, size=(480, 360), detail=8) -> np.ndarray:
    """A smooth random RGB image (``size`` = width, height): random colours at a ``detail`` x ``detail``
    grid, bicubic-upscaled, plus a little noise; photo-like for a JPEG codec (no 8 x 8 block edges)."""
    from PIL import Image
    coarse = Image.fromarray(rng.integers(0, 256, (detail, detail, 3), dtype=np.uint8))
    arr = np.asarray(coarse.resize(size, Image.Resampling.BICUBIC), dtype=np.int16)
    return np.clip(arr + rng.integers(-6, 7, arr.shape), 0, 255).astype(np.uint8)


def jpeg_bytes(arr: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def make_photo_folder(root: Path, classes=("ant", "bee", "cow", "dog"), per_class=12, size=(480, 360),
                      seed=0) -> Path:
    """An ImageFolder of photo-like JPEGs (:func:`photo`) at quality 90, as a camera or ImageNet has them."""
    rng = np.random.default_rng(seed)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            (root / c / f"{i:03d}.jpg").write_bytes(jpeg_bytes(photo(rng, size)))
    return root

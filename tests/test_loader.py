"""Train / eval loaders over real tars: world-size invariance, disjoint ranks, exactly-once eval, augment."""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline.config import DataConfig
from pipeline.data import check_shard_files, make_eval_loader, make_train_loader, read_dataset_info, shard_dataset
from pipeline.data.loader import MAX_PARCEL, parcel_steps
from pipeline.data.tario import TarFormatError
from tests.data_helpers import REPO, all_keys, make_imagefolder, tar_keys

# The worker counts here are the point (3 or 5 loader processes on a 2-core machine): torch's advice to
# use fewer is not a finding.
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

AUG_ALL_RANDOM = {"random_resized_crop": [0.3, 1.0], "hflip": 0.5, "random_erasing": 0.5,
                  "auto_augment": "trivialaugment", "interpolation": "bilinear"}


def _rank_batches(out, world_size, *, global_batch, steps, epoch=0, seed=0, augment=None,
                  num_workers=0, num_streams=None, image_size=12):
    """Per rank: the list of (images, labels, keys) batches of one epoch."""
    return [list(make_train_loader(out, batch_size=global_batch // world_size, image_size=image_size,
                                   steps_per_epoch=steps, rank=rank, world_size=world_size, epoch=epoch,
                                   seed=seed, augment=augment, num_workers=num_workers,
                                   num_streams=num_streams, return_keys=True))
            for rank in range(world_size)]


def _global_step(per_rank, step) -> list[tuple[str, int, bytes]]:
    """The multiset of (key, label, image bytes) that all ranks together train on in ``step``."""
    return sorted((k, int(y), x.numpy().tobytes())
                  for batches in per_rank for x_b, y_b, keys in [batches[step]]
                  for x, y, k in zip(x_b, y_b, keys, strict=True))


def _tiny_train(tmp_path, n_shards_max: int, test_fraction: float = 0.97) -> Path:
    """digits with a tiny train split (~40 samples) cut into shards of ``n_shards_max`` samples."""
    out = tmp_path / f"tiny{n_shards_max}"
    shard_dataset(out, DataConfig(source="digits", maxcount=n_shards_max, val_fraction=0.0, test_fraction=test_fraction))
    return out


def _case_shards(tmp_path, request, case: str) -> tuple[Path, int]:
    """(shards, image size) of a loader test case: digits cut into shards of N (``"N-shards"`` /
    ``"1-shard"``), or 224 px from the photo-like JPEGs (``"jpeg-224"``: some decoded at reduced size)."""
    if case == "jpeg-224":
        return request.getfixturevalue("photo_shards"), 224
    out = tmp_path / "s"
    shard_dataset(out, DataConfig(source="digits", maxcount={"13-shards": 100, "1-shard": 2000}[case]))
    return out, 12


@pytest.mark.parametrize("case", ["13-shards", "1-shard", "jpeg-224"])
def test_train_world_size_invariant(tmp_path, request, case):
    """W=1, W=2 and W=4 (and W=2 with DataLoader workers) with the same global batch, seed and
    streams train on the same samples with bitwise-identical augmented pixels in every step."""
    out, image_size = _case_shards(tmp_path, request, case)
    steps = 1 if case == "jpeg-224" else 4  # 36 JPEGs: one step of 32 before streams wrap
    kw = dict(global_batch=32, steps=steps, epoch=3, seed=7, augment=AUG_ALL_RANDOM, image_size=image_size)
    one = _rank_batches(out, 1, **kw)
    runs = {"W=2": _rank_batches(out, 2, **kw), "W=4": _rank_batches(out, 4, **kw),
            "W=2 x 2 workers": _rank_batches(out, 2, num_workers=2, **kw),
            "W=1 x 3 workers": _rank_batches(out, 1, num_workers=3, **kw)}
    for step in range(steps):
        ref = _global_step(one, step)
        assert len(ref) == 32 and len({k for k, _, _ in ref}) == 32
        for name, per_rank in runs.items():
            assert _global_step(per_rank, step) == ref, (name, step)
    # the layout: rank r's batch is the chunks (32 / 8 = 4 samples) of streams g = r, r + W, ...
    chunks = [one[0][0][2][4 * g:4 * g + 4] for g in range(8)]
    for rank in range(2):
        assert runs["W=2"][rank][0][2] == [k for g in range(rank, 8, 2) for k in chunks[g]]
        assert runs["W=2 x 2 workers"][rank][0][2] == runs["W=2"][rank][0][2]
    # augmentation is on: the same sample differs between epochs
    other = _rank_batches(out, 1, **{**kw, "epoch": 4})
    assert _global_step(other, 0) != _global_step(one, 0)


@pytest.mark.parametrize("maxcount", [5, 2000], ids=["shard-streams", "modulo-streams"])
def test_train_invariant_when_streams_wrap(tmp_path, maxcount):
    """Streams shorter than an epoch cycle pass after pass; still the same samples and pixels
    for any W, and each pass of a stream is a permutation of its samples."""
    out = _tiny_train(tmp_path, maxcount)
    n = read_dataset_info(out)["counts"]["train"]
    kw = dict(global_batch=16, steps=12, seed=1, augment={"random_resized_crop": [0.5, 1.0], "hflip": 0.5})
    one, two = _rank_batches(out, 1, **kw), _rank_batches(out, 2, **kw)
    assert 12 * 16 > 3 * n  # every stream wraps a few times
    for step in range(12):
        assert _global_step(two, step) == _global_step(one, step)
    assert {k for _, _, ks in one[0] for k in ks} == set(all_keys(out, "train"))
    from itertools import islice

    from pipeline.data.loader import _shards
    from pipeline.data.streams import key_index, open_streams, stream_pieces
    urls, listed, _ = _shards(out, "train")
    shards = [(u, s["count"]) for u, s in zip(urls, listed)]
    for g in (0, 7):
        pieces = stream_pieces(shards, 8, g, seed=1, epoch=0)
        assert (pieces is None) == (maxcount == 2000)
        mine = ({k for u, a, b in pieces for k in tar_keys(Path(u))[a:b]} if pieces else
                {k for u in urls for k in tar_keys(Path(u)) if key_index(k) % 8 == g})
        stream = open_streams(shards, [g], 8, seed=1, epoch=0)[0]
        got = [(s["__key__"], s["__pass__"]) for s in islice(stream, 3 * len(mine))]
        for p in range(3):
            assert sorted(k for k, _ in got[p * len(mine):(p + 1) * len(mine)]) == sorted(mine)
            assert {q for _, q in got[p * len(mine):(p + 1) * len(mine)]} == {p}
        assert [k for k, _ in got[:len(mine)]] != [k for k, _ in got[len(mine):2 * len(mine)]]


def test_train_equal_steps_and_disjoint_ranks(tmp_path):
    """Fewer, as many and more shards than streams: every rank yields the same full batches and
    ranks never share a sample within an epoch; with >= S shards two ranks open the same shard only
    where two streams' ranges meet in it (at most S - 1 shards)."""
    for maxcount, n_shards in [(200, 7), (158, 8), (100, 13)]:
        out = tmp_path / f"m{maxcount}"
        info = shard_dataset(out, DataConfig(source="digits", maxcount=maxcount))
        assert len(info["shards"]["train"]) == n_shards
        shard_of = {k: sh["name"] for sh in info["shards"]["train"] for k in tar_keys(out / sh["name"])}
        for world_size in (2, 4):
            per_rank = _rank_batches(out, world_size, global_batch=32, steps=9, seed=3, augment={"hflip": 0.5})
            keys = []
            for batches in per_rank:
                assert len(batches) == 9
                assert all(x.shape == (32 // world_size, 3, 12, 12) and y.dtype == torch.int64
                           for x, y, _ in batches)
                keys.append([k for _, _, ks in batches for k in ks])
            assert sum(len(k) for k in keys) == 9 * 32 == len({k for ks in keys for k in ks})  # disjoint
            if n_shards >= 8:
                opened = [{shard_of[k] for k in ks} for ks in keys]
                shared = {s for i, a in enumerate(opened) for b in opened[i + 1:] for s in a & b}
                assert len(shared) <= 7, shared


@pytest.mark.parametrize("maxcount", [100, 158, 200, 2000], ids=["13-shards", "8-shards", "7-shards", "1-shard"])
def test_train_epoch_sees_no_sample_twice(tmp_path, maxcount):
    """Whole epochs (steps = N // global batch) over shards of unequal sizes: no sample twice within an
    epoch, and only the N - steps * B that no full batch holds go unseen, on 1 and 2 ranks alike."""
    out = tmp_path / "s"
    info = shard_dataset(out, DataConfig(source="digits", maxcount=maxcount))
    counts = [sh["count"] for sh in info["shards"]["train"]]
    n, batch = sum(counts), 48
    assert len(counts) == 1 or len(set(counts)) > 1  # the last shard is short
    for world_size in (1, 2):
        for epoch in (0, 1):
            per_rank = _rank_batches(out, world_size, global_batch=batch, steps=n // batch, epoch=epoch, seed=5)
            keys = [k for batches in per_rank for _, _, ks in batches for k in ks]
            assert len(keys) == n // batch * batch == len(set(keys)), (world_size, epoch)


def test_train_epoch_order_and_mid_epoch_resume(digits_dir):
    def loader(epoch, num_workers=0, **kw):
        return make_train_loader(digits_dir, batch_size=16, image_size=12, steps_per_epoch=6, rank=1,
                                 world_size=2, epoch=epoch, seed=0, augment=AUG_ALL_RANDOM,
                                 num_workers=num_workers, return_keys=True, **kw)
    full = list(loader(2))
    assert len(full) == len(loader(2)) == 6
    first = list(loader(1))
    assert [ks for _, _, ks in first] != [ks for _, _, ks in full]
    # one loader over several epochs (what a run uses) == the epochs' loaders one after another;
    # resume = start at (epoch, batch): the skipped batches are not produced at all. Parcels of
    # consecutive steps (8 by default here) may span epochs, and the last one of a run is short
    for num_workers, parcel in ((0, None), (2, None), (5, None), (0, 1), (2, 5)):
        run = list(loader(1, num_workers, last_epoch=2, parcel=parcel))
        resumed = list(loader(2, num_workers, start_batch=4, parcel=parcel))
        assert len(run) == 12 and len(resumed) == 2 == len(loader(2, start_batch=4))
        for (x, y, ks), (x2, y2, ks2) in zip(first + full, run, strict=True):
            assert ks == ks2 and torch.equal(y, y2) and torch.equal(x, x2)
        for (x, y, ks), (x2, y2, ks2) in zip(full[4:], resumed, strict=True):
            assert ks == ks2 and torch.equal(y, y2) and torch.equal(x, x2)


AUG_PADDED_CROP = {"random_crop": 2, "hflip": 0.5, "auto_augment": "randaugment", "random_erasing": 0.5}


@pytest.mark.parametrize("parcel", [1, 2])
@pytest.mark.parametrize("augment", [AUG_ALL_RANDOM, AUG_PADDED_CROP], ids=["resized-crop", "padded-crop"])
def test_train_any_worker_count(digits_dir, augment, parcel):
    """Workers take turns at whole parcels of steps: a batch of 5 with 3 workers is fine, and identical to
    no workers, shipped one step or two at a time (a sample's pixels never depend on the batch around it)."""
    kw = dict(batch_size=5, image_size=8, steps_per_epoch=7, rank=0, world_size=1, epoch=0, seed=2,
              augment=augment, return_keys=True)
    ref = list(make_train_loader(digits_dir, parcel=1, **kw))
    got = list(make_train_loader(digits_dir, num_workers=3, prefetch=1, parcel=parcel, **kw))
    assert [ks for _, _, ks in got] == [ks for _, _, ks in ref]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(ref, got, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_made_one_ahead_on_a_side_stream(digits_dir):
    """On a GPU, the parcel of step k + 1 is copied and augmented on a side stream while step k runs: each
    batch still arrives complete (the CPU's pixels, to rounding), overwriting a batch at once spoils none
    of the next, and taking a batch never syncs the host (parcels of 2 steps: two of the three are issued
    while the host is watched)."""
    kw = dict(batch_size=16, image_size=16, steps_per_epoch=6, rank=0, world_size=1, epoch=0, seed=3,
              augment=AUG_ALL_RANDOM, parcel=2)
    cpu = list(make_train_loader(digits_dir, **kw))
    batches = iter(make_train_loader(digits_dir, device="cuda", **kw))
    got = [tuple(t.clone() for t in next(batches))]  # the first call per device copies constants over
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches:
            got.append((x.clone(), y.clone()))
            x.zero_()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for (a, b), (c, d) in zip(cpu, got, strict=True):
        diff = (c.cpu() - a).abs()
        assert torch.equal(d.cpu(), b) and (diff > 0).float().mean() < 0.01 and diff.mean() < 0.01


def test_raw_encoded_shards_give_the_same_batches(tmp_path):
    """Shards written with ``encoding: raw`` (pixels, no decode at load time) feed the same train and eval
    batches as the source-encoded ones, every random augmentation on, with loader workers."""
    dirs = {enc: tmp_path / enc for enc in ("source", "raw")}
    for enc, out in dirs.items():
        shard_dataset(out, DataConfig(source="digits", encoding=enc, maxcount=300))
    kw = dict(batch_size=16, image_size=16, steps_per_epoch=6, rank=0, world_size=1, epoch=1, seed=4, augment=AUG_ALL_RANDOM)
    ref = list(make_train_loader(dirs["source"], **kw))
    got = list(make_train_loader(dirs["raw"], num_workers=2, **kw))
    assert len(got) == len(ref) == 6
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(ref, got, strict=True))
    evals = [list(make_eval_loader(dirs[enc], "val", batch_size=50, image_size=16, rank=0, world_size=1, augment=None))
             for enc in ("source", "raw")]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(*evals, strict=True))


def test_train_loader_leaves_global_rng_alone(digits_dir):
    for num_workers in (0, 2):
        torch.manual_seed(123)
        expected = torch.rand(3)
        torch.manual_seed(123)
        list(make_train_loader(digits_dir, batch_size=8, image_size=12, steps_per_epoch=2, rank=0, world_size=1,
                               epoch=0, seed=0, augment=AUG_ALL_RANDOM, num_workers=num_workers))
        assert torch.equal(torch.rand(3), expected)


def test_train_first_step_loss_invariant(digits_dir):
    """The acceptance criterion at loader level: one linear model, W=1 vs the mean over 2 ranks."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3 * 12 * 12, 10)
    kw = dict(global_batch=64, steps=1, seed=11, augment=AUG_ALL_RANDOM)
    with torch.no_grad():
        losses = {w: sum(torch.nn.functional.cross_entropy(model(x.flatten(1)), y).item()
                         for batches in _rank_batches(digits_dir, w, **kw) for x, y, _ in batches[:1]) / w
                  for w in (1, 2)}
    assert losses[1] == pytest.approx(losses[2], rel=1e-6)


def test_parcel_size_rule():
    """Small batches travel several steps at a time, up to 8; a batch of big images alone."""
    assert parcel_steps(128, 32) == MAX_PARCEL == 8  # CIFAR-10's 1-GPU recipe: 0.4 MB a step
    assert parcel_steps(512, 32) == 5                # 1.6 MB a step
    assert parcel_steps(256, 224) == parcel_steps(1024, 224) == 1


def test_num_streams_default_rule():
    from pipeline.data.streams import resolve_num_streams
    cases = {  # (batch_size, world_size) -> S
        (128, 1): 8, (64, 2): 8, (32, 4): 8, (16, 8): 8,
        (100, 1): 4, (50, 2): 4, (25, 4): 4,  # global batch 100: gcd(100, 8) = 4
        (8, 16): 16, (33, 3): 3, (7, 1): 1,
    }
    for (bs, w), s in cases.items():
        assert resolve_num_streams(None, batch_size=bs, world_size=w) == s, (bs, w)
    assert resolve_num_streams(24, batch_size=16, world_size=3) == 24


@pytest.mark.parametrize("kw, match", [
    (dict(num_streams=6, world_size=4, batch_size=6), r"num_streams=6 is not divisible by world_size=4"),
    (dict(num_streams=16, world_size=2, batch_size=12), r"global batch .* = 24 is not divisible by num_streams=16"),
    (dict(num_streams=0, world_size=1, batch_size=8), "positive integer"),
    (dict(world_size=1, batch_size=8, num_workers=-1), r"num_workers=-1 >= 0"),
    (dict(world_size=1, batch_size=8, start_batch=1), r"start_batch=1 in \[0, steps_per_epoch\)"),
])
def test_num_streams_errors(digits_dir, kw, match):
    kw = {"rank": 0, "num_workers": 0, **kw}
    with pytest.raises(ValueError, match=match):
        make_train_loader(digits_dir, image_size=8, steps_per_epoch=1, epoch=0, seed=0, augment=None, **kw)


def test_train_fewer_samples_than_streams(tmp_path):
    out = _tiny_train(tmp_path, 2000)  # 1 shard, ~50 samples
    n = read_dataset_info(out)["counts"]["train"]
    assert n < 64
    with pytest.raises(ValueError, match=f"{n} train samples, fewer than num_streams=64"):
        make_train_loader(out, batch_size=64, image_size=8, steps_per_epoch=1, rank=0, world_size=1, epoch=0,
                          seed=0, augment=None, num_streams=64)


def test_train_disjoint_keys_by_pixels(tmp_path):
    """End to end: decoded eval images let us identify which samples each train rank used."""
    out = tmp_path / "s"
    shard_dataset(out, DataConfig(source="digits", maxcount=2000, val_fraction=0.0, test_fraction=0.0))
    # 1 train shard < world_size: falls back to a sample-index modulo split
    got = []
    for rank in range(2):
        loader = make_train_loader(out, batch_size=50, image_size=8, steps_per_epoch=3, rank=rank,
                                   world_size=2, epoch=1, seed=5, augment={"interpolation": "nearest"})
        got.append({tuple(img.flatten().tolist()) for x, _ in loader for img in x})
    assert len(got[0]) > 50 and len(got[1]) > 50
    # digits contains a few exact duplicate images; allow those but nothing systematic
    assert len(got[0] & got[1]) <= 5


def test_train_epoch_changes_order(digits_dir):
    def first_labels(epoch):
        loader = make_train_loader(digits_dir, batch_size=32, image_size=8, steps_per_epoch=1, rank=0,
                                   world_size=1, epoch=epoch, seed=0, augment=None)
        return next(iter(loader))[1].tolist()
    assert first_labels(0) == first_labels(0)
    assert first_labels(0) != first_labels(1)


def test_train_more_steps_than_data_cycles(tmp_path):
    out = tmp_path / "s"
    shard_dataset(out, DataConfig(source="digits", maxcount=1000))
    loader = make_train_loader(out, batch_size=100, image_size=8, steps_per_epoch=30, rank=1,
                               world_size=2, epoch=0, seed=0, augment={})
    assert sum(1 for _ in loader) == 30


def _eval_labels(out, split, world_size, batch_size, num_workers=0, image_size=8):
    per_rank = []
    for rank in range(world_size):
        loader = make_eval_loader(out, split, batch_size=batch_size, image_size=image_size, rank=rank,
                                  world_size=world_size, augment={"mean": [0.1, 0.2, 0.3]},
                                  num_workers=num_workers)
        batches = list(loader)
        for b in batches[:-1]:
            assert len(b[1]) == batch_size
        assert len(batches) == len(loader) and sum(len(b[1]) for b in batches) == loader.num_samples
        per_rank.append(batches)
    return per_rank


@pytest.mark.parametrize("case, world_size, num_workers",
                         [("digits", 2, 0), ("digits", 4, 0), ("digits", 2, 3), ("jpeg-224", 2, 0), ("jpeg-224", 4, 2)])
def test_eval_exactly_once_uneven_shards(tmp_path, request, case, world_size, num_workers):
    if case == "digits":
        out, image_size, batch, counts = tmp_path / "s", 8, 64, [130, 130, 100]
        info = shard_dataset(out, DataConfig(source="digits", maxcount=130))  # test: 360 -> 130+130+100 (3 shards)
    else:  # 12 JPEGs in shards of 5, 5, 2; 224 px, decoded at a quarter size
        out, image_size, batch, counts = request.getfixturevalue("photo_shards"), 224, 5, [5, 5, 2]
        info = read_dataset_info(out)
    assert [s["count"] for s in info["shards"]["test"]] == counts
    per_rank = _eval_labels(out, "test", world_size, batch_size=batch, num_workers=num_workers, image_size=image_size)
    total = sum(len(b[1]) for batches in per_rank for b in batches)
    assert total == sum(counts)
    # exactly once: the multiset of decoded images equals a single-rank pass
    single = _eval_labels(out, "test", 1, batch_size=batch, image_size=image_size)[0]
    ref = sorted(tuple(x.flatten().tolist()) + (int(y),) for xb, yb in single for x, y in zip(xb, yb))
    got = sorted(tuple(x.flatten().tolist()) + (int(y),)
                 for batches in per_rank for xb, yb in batches for x, y in zip(xb, yb))
    assert got == ref


def test_eval_fewer_shards_than_ranks_with_workers_counts_right(tmp_path):
    """One shard, 3 ranks x 2 loader workers: each rank's len() and num_samples are what it yields
    (1257 = 3 x 419: 419 each, one batch of 419), and together they cover the split once."""
    out = tmp_path / "s"
    info = shard_dataset(out, DataConfig(source="digits", maxcount=2000))
    assert len(info["shards"]["train"]) == 1 and info["counts"]["train"] == 1257
    per_rank = _eval_labels(out, "train", 3, batch_size=419, num_workers=2)
    assert [[len(b[1]) for b in batches] for batches in per_rank] == [[419]] * 3


def test_eval_rank_may_get_nothing(tmp_path):
    out = tmp_path / "s"
    shard_dataset(out, DataConfig(source="digits", maxcount=2000, val_fraction=0.002))  # val: 4 samples
    per_rank = _eval_labels(out, "val", 8, batch_size=3)
    sizes = [sum(len(b[1]) for b in batches) for batches in per_rank]
    assert sum(sizes) == read_dataset_info(out)["counts"]["val"] and 0 in sizes


def test_eval_with_workers_single_partial_batch(digits_dir):
    per_rank = _eval_labels(digits_dir, "test", 2, batch_size=50, num_workers=2)
    assert sum(len(b[1]) for batches in per_rank for b in batches) == 360


def test_eval_pass_after_an_abandoned_one_gives_every_sample(digits_dir):
    """The loop's sanity check takes one val batch and stops; the workers persist, and each later pass
    still gives every sample once."""
    loader = make_eval_loader(digits_dir, "test", batch_size=50, image_size=8, rank=0, world_size=1,
                              augment=None, num_workers=2)
    next(iter(loader))
    passes = [sorted(torch.cat([y for _, y in loader]).tolist()) for _ in range(2)]
    assert len(passes[0]) == 360 and passes[0] == passes[1]


def test_train_with_workers(digits_dir):
    loader = make_train_loader(digits_dir, batch_size=32, image_size=16, steps_per_epoch=6, rank=0,
                               world_size=2, epoch=0, seed=0, augment={"auto_augment": "trivialaugment"},
                               num_workers=2)
    assert [x.shape[0] for x, _ in loader] == [32] * 6


def test_normalisation(digits_dir):
    loader = make_eval_loader(digits_dir, "val", batch_size=512, image_size=8, rank=0, world_size=1,
                              augment={"mean": [0.0] * 3, "std": [1.0] * 3})
    x, _ = next(iter(loader))
    assert 0.0 <= x.min() and x.max() <= 1.0
    loader = make_eval_loader(digits_dir, "val", batch_size=512, image_size=8, rank=0, world_size=1,
                              augment=None)
    x2, _ = next(iter(loader))
    assert torch.allclose(x2, (x - 0.5) / 0.5, atol=1e-6)


def test_loader_matches_reference_compose(tmp_path):
    """The loader's split transform (uint8 ops per sample, normalise per batch) == one v2.Compose."""
    import webdataset as wds

    from pipeline.data.loader import decode_sample
    from pipeline.data.transforms import eval_transform, train_transform
    root = make_imagefolder(tmp_path / "src", per_class=4)
    out = tmp_path / "out"
    shard_dataset(out, DataConfig(source="imagefolder", root=root, val_fraction=0, test_fraction=0))
    augment = {"mean": [0.2, 0.3, 0.4], "std": [0.5, 0.6, 0.7], "interpolation": "bilinear"}
    (x, y), = list(make_eval_loader(out, "train", batch_size=64, image_size=7, rank=0, world_size=1,
                                    augment=augment))
    ref_eval, ref_train = eval_transform(7, augment), train_transform(7, augment)
    samples = [decode_sample(s) for s in wds.tarfile_samples([{"url": str(out / "train-000000.tar")}])]
    ref = torch.stack([ref_eval(img) for img, _ in samples])
    assert torch.allclose(x, ref, atol=1e-5) and y.tolist() == [lab for _, lab in samples]
    assert torch.allclose(torch.stack([ref_train(img) for img, _ in samples]), ref, atol=1e-5)


def test_unknown_augment_key(digits_dir):
    with pytest.raises(ValueError, match=r"hflp.*valid keys.*hflip"):
        make_train_loader(digits_dir, batch_size=8, image_size=8, steps_per_epoch=1, rank=0,
                          world_size=1, epoch=0, seed=0, augment={"hflp": 0.5})
    with pytest.raises(ValueError, match="auto_augment"):
        make_eval_loader(digits_dir, "test", batch_size=8, image_size=8, rank=0, world_size=1,
                         augment={"auto_augment": "autoaugment"})


def test_all_augments_build_and_run(digits_dir):
    augment = {"mean": [0.4, 0.4, 0.4], "std": [0.2, 0.2, 0.2], "random_resized_crop": [0.3, 1.0],
               "hflip": 0.5, "auto_augment": "randaugment", "random_erasing": 0.5,
               "interpolation": "bilinear"}
    (x, y), = list(make_train_loader(digits_dir, batch_size=8, image_size=24, steps_per_epoch=1, rank=0,
                                     world_size=1, epoch=0, seed=0, augment=augment))
    assert x.shape == (8, 3, 24, 24) and torch.isfinite(x).all()


def test_missing_shard_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"{tmp_path / 'nope' / 'dataset.json'} not found: {tmp_path / 'nope'} holds no shard stage's output; "
            "write it first with the shard stage or pipeline.data.shard_dataset()")):
        read_dataset_info(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=re.escape(  # a stage's own folder: the stage's command
            "finetune holds no shard stage's output; run the shard stage first (dvc repro, or python -m "
            "stages.shard finetune)")):
        read_dataset_info(tmp_path / "finetune")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "dataset.json").write_text('{"classes": ["a", ')
    with pytest.raises(ValueError, match=f"^{tmp_path / 'cut' / 'dataset.json'}: not valid JSON .*"
                                         r"write it again with the shard stage or pipeline.data.shard_dataset\(\)$"):
        read_dataset_info(tmp_path / "cut")


def test_loader_reads_url_prefix(tmp_path, digits_dir):
    import fsspec
    fs = fsspec.filesystem("memory")
    for p in digits_dir.iterdir():
        fs.pipe(f"/shards_test/{p.name}", p.read_bytes())
    url = "memory://shards_test"
    assert read_dataset_info(url) == read_dataset_info(digits_dir)
    n = sum(len(y) for _, y in make_eval_loader(url, "val", batch_size=64, image_size=8, rank=0,
                                                world_size=1, augment={}))
    assert n == 180


def test_shard_files_checked_against_dataset_json(tmp_path, digits_dir):
    """Before a stage reads them: a shard cut short (here at a member boundary, which a tar reader takes
    for the end of the archive and so would lose samples quietly) or missing is named with what to do;
    shards from before sizes were recorded are checked for presence only; an object-store prefix too."""
    import fsspec
    shards = tmp_path / "shards"
    shards.mkdir()
    for p in digits_dir.iterdir():
        (shards / p.name).write_bytes(p.read_bytes())
    info = read_dataset_info(shards)
    check_shard_files(shards, info)
    victim = info["shards"]["train"][1]
    path = shards / victim["name"]
    path.write_bytes(path.read_bytes()[:10 * 512])
    with pytest.raises(TarFormatError) as cut:
        check_shard_files(shards, info)
    assert f"{path}: 5,120 bytes, but the shard stage wrote {victim['bytes']:,}" in str(cut.value)
    assert str(cut.value).endswith("write it again with the shard stage or pipeline.data.shard_dataset()")
    check_shard_files(shards, {"shards": {"train": [{k: v for k, v in victim.items() if k != "bytes"}]}})
    path.unlink()
    with pytest.raises(FileNotFoundError, match="shard missing") as gone:
        check_shard_files(shards, info)
    assert gone.value.filename == str(path)

    fs = fsspec.filesystem("memory")
    for p in digits_dir.iterdir():
        fs.pipe(f"/checked/{p.name}", p.read_bytes())
    check_shard_files("memory://checked", info)
    fs.pipe(f"/checked/{victim['name']}", b"")
    with pytest.raises(TarFormatError, match=f"memory://checked/{victim['name']}: 0 bytes"):
        check_shard_files("memory://checked", info)


def test_augment_dataset_normalisation(digits_dir):
    from pipeline.data.augment import resolve_augment, with_dataset_stats
    from pipeline.data.transforms import BatchFinish
    info = read_dataset_info(digits_dir)
    aug = with_dataset_stats({"mean": "dataset", "std": "dataset", "hflip": 0.0}, info)
    assert aug == {"mean": info["pixel_stats"]["mean"], "std": info["pixel_stats"]["std"], "hflip": 0.0}
    assert with_dataset_stats({"mean": [0.1, 0.2, 0.3]}, {}) == {"mean": [0.1, 0.2, 0.3]}  # nothing to resolve
    (x, _), = list(make_eval_loader(digits_dir, "train", batch_size=2000, image_size=8, rank=0, world_size=1,
                                    augment=aug))
    np.testing.assert_allclose(x.mean((0, 2, 3)), 0.0, atol=1e-4)  # train split standardised per channel
    np.testing.assert_allclose(x.std((0, 2, 3)), 1.0, atol=1e-3)
    with pytest.raises(ValueError, match="re-run the shard stage"):
        with_dataset_stats({"std": "dataset"}, {"classes": []})
    with pytest.raises(ValueError, match="augment.mean must be 3 numbers .* or 'dataset'"):
        BatchFinish({"mean": "dataset"})  # unresolved: loaders need numbers
    assert resolve_augment({"mean": "dataset"}, allow_dataset=True)["mean"] == "dataset"


@pytest.mark.slow
def test_loader_benchmark_runs_all_four_loaders(tmp_path):
    """``benchmarks/loader_speed.py``, shrunk: an ImageFolder (class folders, no train/) given as ``--data`` is
    used as it is (no CIFAR-10 tarball extracted), sharded both ways, each loader timed, the ratios printed,
    and with ``--json`` the figures as the last line."""
    import json
    import subprocess
    import sys

    from tests.data_helpers import REPO
    make_imagefolder(tmp_path / "data", per_class=12)
    for bmp in (tmp_path / "data").rglob("*.bmp"):  # the ImageFolder baselines decode with torchvision.io: JPEG/PNG
        bmp.unlink()
    proc = subprocess.run([sys.executable, "benchmarks/loader_speed.py", "--data", tmp_path / "data", "--shards",
                           tmp_path / "shards", "--workers", "1", "--batch-size", "4", "--batches", "3", "--warmup", "1",
                           "--rounds", "1", "--image-size", "8", "--max-side", "8", "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    medians = {line.split(":")[0].split()[1]: float(line.split(":")[1].split()[0])
               for line in proc.stdout.splitlines() if line.startswith("median ")}
    assert sorted(medians) == ["imagefolder", "imagefolder-fast", "webdataset", "webdataset-max-side",
                               "webdataset-raw"], proc.stdout
    assert all(v > 0 for v in medians.values()), proc.stdout
    assert "encoding: raw vs source" in proc.stdout
    assert read_dataset_info(tmp_path / "shards-raw")["params"]["encoding"] == "raw"
    assert read_dataset_info(tmp_path / "shards")["counts"]["train"] == 24  # the folder's JPEGs and PNGs
    figures = json.loads(proc.stdout.splitlines()[-1])
    assert figures["ratio_vs_imagefolder"] > 0 and figures["webdataset_img_s"] == round(medians["webdataset"])
    assert figures["ratio_vs_imagefolder_steady"] > 0 and figures["warmup_batches"] == 1
    # --max-side: shards the stage re-encoded, timed against ImageFolder on the originals, recorded apart
    assert read_dataset_info(tmp_path / "shards-max-side-8")["params"]["max_side"] == 8
    assert "webdataset_max_side_img_s" not in figures
    assert figures["max_side"]["webdataset_max_side_img_s"] == round(medians["webdataset-max-side"])
    records = [json.loads(line) for line in
               (Path(os.environ["VIT_RESULTS_DIR"]) / "loader_speed.jsonl").read_text().splitlines()[-2:]]
    assert records[0]["figures"]["webdataset_img_s"] == figures["webdataset_img_s"]
    assert records[1]["case"].endswith("shards re-encoded at max_side 8, ImageFolder on the original images")
    assert records[1]["figures"] == figures["max_side"]


def test_loader_benchmark_upscales_a_folder(tmp_path):
    """``--upscale``'s realistic set: so many images of the folder, at the size asked, as JPEGs, classes kept."""
    from PIL import Image

    from benchmarks.loader_speed import upscaled
    src = make_imagefolder(tmp_path / "src", per_class=4)
    out = upscaled(src, (40, 30), 7, under=tmp_path)
    files = sorted(out.rglob("*"))
    images = [f for f in files if f.is_file()]
    assert len(images) == 7 and {f.parent.name for f in images} == {"cat", "dog", "eel"}
    for f in images:
        with Image.open(f) as img:
            assert img.format == "JPEG" and img.size == (40, 30)
    assert upscaled(src, (40, 30), 7, under=tmp_path) == out  # once


def test_decode_benchmark_reports_both_paths(tmp_path):
    """``benchmarks/decode_speed.py``, shrunk: per size and crop the full and the loader's decode timed, and
    the share the reduced decode served (none at 300 x 200, every eval crop at 1000 x 800 for 64 px)."""
    import json
    import subprocess
    import sys

    from tests.data_helpers import REPO
    make_imagefolder(tmp_path / "data", per_class=2)
    proc = subprocess.run([sys.executable, "benchmarks/decode_speed.py", "--data", tmp_path / "data", "--sizes",
                           "300x200,1000x800", "--image-size", "64", "--images", "3", "--repeats", "1", "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.splitlines()[-1])
    assert figures["eval_300x200_draft_share"] == 0 and figures["eval_1000x800_draft_share"] == 1, figures
    assert all(figures[f"{c}_{s}_{k}"] > 0 for c in ("train", "eval") for s in ("300x200", "1000x800")
               for k in ("full_ms", "loader_ms", "speedup")), figures
    bad = subprocess.run([sys.executable, "benchmarks/decode_speed.py", "--data", tmp_path / "data", "--sizes", "big"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--sizes: 'big': give WIDTHxHEIGHT" in bad.stderr, bad.stderr


def test_the_resize_a_model_trained_with_is_the_one_it_is_evaluated_exported_and_served_with(digits_dir):
    """config.json records ``<stage>.augment.interpolation`` beside mean / std, and evaluate, export and
    predict (``eval_augment``) resize with it: a model trained and validated on nearest-resized images was
    tested and served on bicubic ones. A config.json from before keeps the default."""
    from pipeline.config import load_params
    from pipeline.data.augment import eval_augment, resolve_augment
    from pipeline.train.stage import model_meta

    params = load_params(REPO / "params.yaml", {"finetune.augment.interpolation": "nearest"})
    info = read_dataset_info(digits_dir)
    meta = model_meta("finetune", params.finetune, info, "run")
    assert meta["interpolation"] == "nearest"

    def first_batch(augment):
        loader = make_eval_loader(digits_dir, "val", batch_size=16, image_size=32, rank=0, world_size=1,
                                  augment=augment)
        return next(iter(loader))[0]

    trained_on = first_batch({**meta["normalize"], "interpolation": "nearest"})
    assert torch.equal(first_batch(eval_augment(meta)), trained_on)
    before = {k: v for k, v in meta.items() if k != "interpolation"}
    assert eval_augment(before) == meta["normalize"]
    assert resolve_augment(eval_augment(before))["interpolation"] == "bicubic"
    assert not torch.equal(first_batch(eval_augment(before)), trained_on)


DEVICE_DECODE_AUGMENT = {"random_resized_crop": [0.08, 0.3], "hflip": 0.5, "random_erasing": 0.5,
                         "interpolation": "bilinear"}  # crops under 896 px: the loader decodes these in full too


def _decode_batches(shards, decode: str, device: str = "cpu", world_size: int = 1, num_workers: int = 0):
    aug = {**DEVICE_DECODE_AUGMENT, "decode": decode}
    return _rank_batches(shards, world_size, global_batch=16, steps=2, seed=3, augment=aug, image_size=224,
                         num_workers=num_workers) if device == "cpu" else \
        [list(make_train_loader(shards, batch_size=16, image_size=224, steps_per_epoch=2, rank=0, world_size=1,
                                epoch=0, seed=3, augment=aug, device=device, return_keys=True))]


def test_device_decode_gives_the_loader_decodes_batches(photo_shards):
    """``augment.decode: device`` (JPEG bytes shipped, decoded, cropped and flipped in the training process)
    gives the very batches of ``decode: loader`` where both decode in full, here on the CPU, on 1 rank and
    on 2 with a loader worker each."""
    ref = _decode_batches(photo_shards, "loader")
    for world_size, workers in ((1, 0), (2, 1)):
        got = _decode_batches(photo_shards, "device", world_size=world_size, num_workers=workers)
        for step in range(2):
            assert _global_step(got, step) == _global_step(ref, step), (world_size, step)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_decode_on_cuda_matches_the_cpu(photo_shards):
    """nvJPEG's decode, cropped and flipped on the GPU, is the CPU path's image within a few levels."""
    ref, got = _decode_batches(photo_shards, "loader")[0], _decode_batches(photo_shards, "device", "cuda")[0]
    for (x_ref, y_ref, k_ref), (x, y, k) in zip(ref, got, strict=True):
        assert k == k_ref and torch.equal(y.cpu(), y_ref) and x.is_cuda
        assert (x.cpu() - x_ref).abs().mean() * 127.5 < 2.0  # normalised by 0.5: 1 level = 1 / 127.5


@pytest.mark.parametrize("augment, match", [
    ({"decode": "gpu"}, r"augment.decode='gpu'; valid: \['loader', 'device'\]"),
    ({"decode": "device", "auto_augment": "randaugment"}, "set auto_augment to null or decode to loader")])
def test_decode_choice_checked(augment, match):
    from pipeline.data.augment import resolve_augment
    with pytest.raises(ValueError, match=match):
        resolve_augment(augment)

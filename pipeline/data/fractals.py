"""``fractals`` source: a FractalDB-style formula-driven synthetic set (no images to download).

Each class is a random iterated function system (IFS) of 2-4 contractive affine maps, kept only
if its attractor fills a sensible part of the canvas. Instances jitter the maps' parameters and
get a random colour; rendering is a vectorised chaos game (thousands of chains in lock-step).
"""
from __future__ import annotations

import threading
from functools import partial

import numpy as np

from .records import resolve_classes
from .splits import SPLITS, Record, SourceListing, carve_splits

BURN_IN, STEPS = 6, 30
FILL_RANGE = (0.08, 0.6)
# Pixels rendered together (64 images of 64 px): the chaos game's arrays stay tens of MB at any size.
BATCH_PIXELS, MAX_BATCH = 64 * 64 * 64, 64
CHECK_SIZE = 64  # a system's fill is judged at most at this size (~6 points per pixel at any size)


def _chaos_game(coef: np.ndarray, shift: np.ndarray, cum: np.ndarray, rng, n_chains: int) -> np.ndarray:
    """Attractor points (B, N, 2) for B systems at once; coef (B, 4, 4) = a b c d per map (zero-padded),
    shift (B, 4, 2), cum (B, 4) cumulative map probabilities (padding = 1.0, never chosen)."""
    n_sys = coef.shape[0]
    base = np.repeat(np.arange(n_sys) * 4, n_chains)  # row of map 0 of each chain's system
    cum_c = [cum[:, m][base // 4] for m in range(3)]  # cum[:, 3] == 1: map 3 needs no test
    cols = [np.ascontiguousarray(a) for a in (*coef.reshape(-1, 4).T, *shift.reshape(-1, 2).T)]
    x = rng.uniform(-1, 1, base.size)
    y = rng.uniform(-1, 1, base.size)
    out = np.empty((STEPS - BURN_IN, 2, base.size))
    for t, u in enumerate(rng.random((STEPS, base.size))):
        idx = base + (u >= cum_c[0]) + (u >= cum_c[1]) + (u >= cum_c[2])
        a, b, c, d, e, f = (col.take(idx) for col in cols)
        x, y = a * x + b * y + e, c * x + d * y + f
        if t >= BURN_IN:
            out[t - BURN_IN, 0], out[t - BURN_IN, 1] = x, y
    # (steps, 2, B*K) -> (B, K*steps, 2)
    return out.reshape(STEPS - BURN_IN, 2, n_sys, n_chains).transpose(2, 3, 0, 1).reshape(n_sys, -1, 2)


def _density(points: np.ndarray, size: int) -> np.ndarray:
    """Per-system histograms (B, size, size), each fitted robustly (aspect kept) into the canvas."""
    n_sys = points.shape[0]
    lo, hi = np.percentile(points[:, ::4], [0.5, 99.5], axis=1)  # robust bounds from a subsample
    span = np.maximum((hi - lo).max(axis=1), 1e-6)[:, None, None]
    margin = 0.06 * size
    scaled = (points - ((lo + hi) / 2)[:, None, :]) / span * (size - 2 * margin) + size / 2
    i, j = np.floor(scaled[..., 1]).astype(np.int64), np.floor(scaled[..., 0]).astype(np.int64)
    ok = (i >= 0) & (i < size) & (j >= 0) & (j < size)
    flat = (np.arange(n_sys)[:, None] * size * size + i * size + j)[ok]
    return np.bincount(flat, minlength=n_sys * size * size).reshape(n_sys, size, size).astype(np.float32)


def _n_chains(size: int) -> int:
    return int(max(256, size * size // 4))  # ~6 points per pixel after burn-in


def _pack(systems: list[dict]):
    """Zero-pad 2-4 map systems into (B, 4, ...) arrays for the batched chaos game."""
    n_sys = len(systems)
    coef, shift, cum = np.zeros((n_sys, 4, 4)), np.zeros((n_sys, 4, 2)), np.ones((n_sys, 4))
    for b, sysm in enumerate(systems):
        n = sysm["coef"].shape[0]
        coef[b, :n], shift[b, :n] = sysm["coef"], sysm["shift"]
        cum[b, :n] = np.cumsum(sysm["probs"])
        cum[b, n - 1:] = 1.0
    return coef, shift, cum


def sample_system(rng, size: int) -> dict:
    """A random contractive IFS whose attractor covers FILL_RANGE of the canvas."""
    for _ in range(200):
        n = int(rng.integers(2, 5))
        mats = rng.uniform(-1, 1, (n, 2, 2))
        norms = np.linalg.norm(mats, ord=2, axis=(1, 2))
        mats *= (rng.uniform(0.35, 0.85, n) / np.maximum(norms, 1e-6))[:, None, None]
        det = np.abs(np.linalg.det(mats)) + 1e-3
        system = {"coef": mats.reshape(n, 4), "shift": rng.uniform(-1, 1, (n, 2)), "probs": det / det.sum()}
        pts = _chaos_game(*_pack([system]), rng, _n_chains(size))
        fill = float((_density(pts, size) > 0).mean())
        if FILL_RANGE[0] <= fill <= FILL_RANGE[1]:
            return system
    return system  # rare: keep the last candidate rather than fail


def render_batch(systems: list[dict], rngs: list, chain_rng, size: int) -> np.ndarray:
    """Instances (B, size, size, 3) uint8: each system's maps jittered ±10 %, random colours."""
    jittered = [{"coef": s["coef"] * (1 + r.uniform(-0.1, 0.1, s["coef"].shape)),
                 "shift": s["shift"] + r.normal(0, 0.05, s["shift"].shape), "probs": s["probs"]}
                for s, r in zip(systems, rngs)]
    dens = _density(_chaos_game(*_pack(jittered), chain_rng, _n_chains(size)), size)
    level = np.log1p(dens) / np.maximum(np.log1p(dens.max(axis=(1, 2))), 1e-6)[:, None, None]
    fg = np.stack([r.uniform(0.35, 1.0, 3) for r in rngs])[:, None, None, :]
    bg = np.stack([r.uniform(0.0, 0.15, 3) for r in rngs])[:, None, None, :]
    img = bg + level[..., None] * (fg - bg)
    return np.clip(np.round(img * 255), 0, 255).astype(np.uint8)


def batch_size(size: int) -> int:
    """A power of two (so a shard task's chunk holds whole batches), MAX_BATCH at 64 px and below."""
    return min(MAX_BATCH, 1 << max(0, (BATCH_PIXELS // (size * size)).bit_length() - 1))


class _Batch:
    """Instances rendered together on their first load, in whichever process loads them (a shard task),
    and let go once each was loaded; pickled without pixels, so listing them renders nothing."""

    def __init__(self, systems: list[dict], idx: list[int], seed: int, start: int, size: int):
        self.systems, self.idx, self.seed, self.start, self.size = systems, idx, seed, start, size
        self._imgs, self._left, self._lock = None, len(idx), threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_imgs", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _imgs=None, _lock=threading.Lock())

    def image(self, j: int) -> np.ndarray:
        with self._lock:
            imgs = self._imgs
            if imgs is None:
                imgs = self._imgs = render_batch(self.systems, [np.random.default_rng([self.seed, 2, i]) for i in self.idx],
                                                 np.random.default_rng([self.seed, 3, self.start]), self.size)
            self._left -= 1
            if self._left <= 0:
                self._imgs = None
        return imgs[j]


def _records(splits, labels, systems, seed, samples_per_class, size):
    """Records in batches of :func:`batch_size` rendered together (vectorised) when first loaded."""
    order = [(split, int(i)) for split in SPLITS for i in splits[split]]
    chunk = batch_size(size)
    for start in range(0, len(order), chunk):
        part = order[start:start + chunk]
        idx = [i for _, i in part]
        batch = _Batch([systems[labels[i]] for i in idx], idx, seed, start, size)
        for j, (split, i) in enumerate(part):
            yield Record(split, int(labels[i]), f"fractals:class{labels[i]}#{i % samples_per_class}",
                         partial(batch.image, j))


def fractals_listing(*, seed, val_fraction, test_fraction, class_names, num_classes, samples_per_class,
                  image_size, **_) -> SourceListing:
    """``num_classes`` systems x ``samples_per_class`` instances, rendered lazily by the writer."""
    if num_classes < 1 or samples_per_class < 1 or image_size < 8:
        raise ValueError(f"fractals needs num_classes >= 1 (got {num_classes}), samples_per_class >= 1 "
                         f"(got {samples_per_class}) and image_size >= 8 (got {image_size})")
    classes = resolve_classes(class_names, [f"ifs_{c:04d}" for c in range(num_classes)], "fractals")
    check = min(image_size, CHECK_SIZE)
    systems = [sample_system(np.random.default_rng([seed, 1, c]), check) for c in range(num_classes)]
    labels = np.repeat(np.arange(num_classes, dtype=np.int64), samples_per_class)
    splits = carve_splits(labels, seed, val_fraction, test_fraction)
    records = _records(splits, labels, systems, seed, samples_per_class, image_size)
    return SourceListing(classes, int(labels.size), records, [])

"""PNG figures a person would rather look at: training curves, confusion matrix, attention maps."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pipeline.utils import atomic_write  # noqa: E402


def _save(fig, path: str | Path) -> None:
    path = Path(path)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format=path.suffix.lstrip("."), dpi=110, bbox_inches="tight"))
    finally:
        plt.close(fig)


def plot_history(histories: dict[str, list[dict]], path: str | Path) -> None:
    """Loss and top-1 per epoch, one line per stage (train solid, val dashed)."""
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (stage, rows), color in zip(histories.items(), ("tab:blue", "tab:orange", "tab:green")):
        epochs = [r["epoch"] for r in rows]
        for key, ax in (("loss", ax_loss), ("top1", ax_acc)):
            ax.plot(epochs, [r[f"train_{key}"] for r in rows], color=color, label=f"{stage} train")
            val = [(r["epoch"], r[f"val_{key}"]) for r in rows if f"val_{key}" in r]
            if val:
                ax.plot(*zip(*val), color=color, linestyle="--", marker="o", ms=3, label=f"{stage} val")
    ax_loss.set(title="loss", xlabel="epoch")
    ax_acc.set(title="top-1", xlabel="epoch", ylim=(0, 1))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no history (a model trained elsewhere): no legend, no warning
            ax.legend(fontsize=8)
    _save(fig, path)


def x_label_style(labels: list[str]) -> dict:
    """Column labels slanted, ending under their column, once any is longer than a column is wide
    (~4 characters) whatever the number of classes; short ones ("0" … "99") stay upright and centred."""
    if max(map(len, labels), default=0) > 3:
        return {"rotation": 45, "ha": "right", "rotation_mode": "anchor"}
    return {"rotation": 0, "ha": "center"}


def plot_confusion(matrix: np.ndarray, classes: list[str], path: str | Path) -> None:
    """Row-normalised confusion matrix with counts in the cells."""
    n = len(classes)
    norm = matrix / np.maximum(matrix.sum(1, keepdims=True), 1)
    size = max(4.0, 0.45 * n + 2)
    fig, ax = plt.subplots(figsize=(size, size * 0.9))
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    ax.set(xticks=range(n), yticks=range(n), xlabel="predicted", ylabel="actual", title="confusion matrix (test)")
    ax.set_xticklabels(classes, **x_label_style(classes))
    ax.set_yticklabels(classes)
    if n <= 30:
        for i in range(n):
            for j in range(n):
                if matrix[i, j]:
                    ax.text(j, i, int(matrix[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if norm[i, j] > 0.5 else "black")
    fig.colorbar(im, ax=ax, fraction=0.046)
    _save(fig, path)


def plot_attention(images: np.ndarray, maps: np.ndarray, titles: list[str], path: str | Path) -> None:
    """Images (N, H, W, 3 in [0, 1]) above the same images overlaid with an attention map (N, h, w)."""
    n = len(images)
    fig, axes = plt.subplots(2, n, figsize=(1.8 * n, 3.8), squeeze=False)
    for i in range(n):
        axes[0, i].imshow(images[i])
        axes[0, i].set_title(titles[i], fontsize=8)
        axes[1, i].imshow(images[i])
        axes[1, i].imshow(maps[i], cmap="inferno", alpha=0.6, extent=(-0.5, images[i].shape[1] - 0.5,
                                                                       images[i].shape[0] - 0.5, -0.5))
        for ax in axes[:, i]:
            ax.axis("off")
    axes[1, 0].set_title("attention rollout", fontsize=8, loc="left")
    _save(fig, path)

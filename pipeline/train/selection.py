"""Which weights a training stage keeps, when it stops early, and when it first reached an accuracy.

After each evaluation the loop calls :meth:`Selection.update` with the epoch's metrics. The
candidate is the better of the raw and the EMA weights by val top-1 (the raw ones on a tie).
``keep: last`` keeps the candidate of the last evaluation, ``keep: best`` the best candidate
of the run; ``early_stop_patience`` stops the run after that many evaluations without a new best.
Everything here is saved in the checkpoints, so a resumed run selects as an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

KEEP_CHOICES = ("last", "best")
THRESHOLDS = (0.8, 0.9, 0.93)  # val top-1 levels whose first epoch, time and images are reported


@dataclass
class Selection:
    keep: str = "last"
    patience: Optional[int] = None
    best: float = -1.0               # best candidate val top-1 so far
    stale: int = 0                   # evaluations since that best
    kept: dict = field(default_factory=dict)     # epoch, step, source, val_top1, reason
    reached: dict = field(default_factory=dict)  # "0.9" -> epoch, step, time_s, images
    stopped_epoch: Optional[int] = None
    wall_time_s: float = 0.0         # training, evaluation and checkpoint time so far, over every launch
    weights: Optional[dict] = field(default=None, repr=False)  # the kept state dict (rank 0, CPU)

    def update(self, metrics: dict, *, images: int, last: bool = False) -> bool:
        """Take an evaluated epoch's metrics; True when the weights to keep are this epoch's.
        ``last``: the run ends with this epoch anyway, so running out of patience is no early stop."""
        source, score, time_s = *candidate(metrics), self.wall_time_s
        epoch, step = metrics["epoch"], metrics["step"]
        for level in THRESHOLDS:
            if score >= level and str(level) not in self.reached:
                self.reached[str(level)] = {"epoch": epoch, "step": step, "time_s": time_s, "images": images}
        improved = score > self.best
        self.best, self.stale = (score, 0) if improved else (self.best, self.stale + 1)
        if self.patience is not None and self.stale >= self.patience and not last:
            self.stopped_epoch = epoch
        if self.keep == "best" and not improved:
            return False
        self.kept = {"epoch": epoch, "step": step, "source": source, "val_top1": score,
                     "reason": self._reason(metrics, source)}
        return True

    @property
    def stopped(self) -> bool:
        return self.stopped_epoch is not None

    def _reason(self, metrics: dict, source: str) -> str:
        which = "best" if self.keep == "best" else "last"
        if "val_top1_ema" not in metrics:
            return f"keep: {self.keep}: the {which} evaluation's weights (no EMA)"
        raw, ema = metrics["val_top1"], metrics["val_top1_ema"]
        return (f"keep: {self.keep}: {source} weights of the {which} evaluation "
                f"(val top-1 EMA {ema:.4f} vs raw {raw:.4f})")

    def state_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def load_state_dict(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)


def candidate(metrics: dict) -> tuple[str, float]:
    """("ema" or "raw", val top-1) of the better weight set of an evaluated epoch."""
    raw, ema = metrics["val_top1"], metrics.get("val_top1_ema")
    return ("ema", ema) if ema is not None and ema > raw else ("raw", raw)


def summary(selection: Selection) -> dict:
    """The flat numbers for ``metrics/<stage>.json`` and MLflow."""
    out = {f"kept_{k}": v for k, v in selection.kept.items() if k != "reason"}
    out["wall_time_s"] = selection.wall_time_s
    if selection.stopped:
        out["stopped_epoch"] = selection.stopped_epoch
    for level, at in selection.reached.items():
        tag = f"{round(float(level) * 100)}"
        out[f"epoch_to_top1_{tag}"], out[f"time_to_top1_{tag}_s"] = at["epoch"], at["time_s"]
        out[f"images_to_top1_{tag}"] = at["images"]
    return out

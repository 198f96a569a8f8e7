"""A time budget for a training launch: stop at the first epoch boundary past a wall-clock deadline.

Used as a step hook (``fit(step_hooks=...)`` or ``$VIT_STEP_HOOKS``), so the loop needs no change:
before the first step of an epoch the previous epoch's checkpoint is already written, so stopping
there loses nothing and launching the same run again continues from it. A launch always makes at
least one epoch of progress, however small the budget, so repeated launches finish the run.
"""
from __future__ import annotations

import time
import weakref

HOOK = "pipeline.train.deadline:stop_at_epoch_end"

_first_step: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # context (one per launch) -> its first step


class DeadlinePassed(Exception):
    """The launch's time budget is spent; the run continues when launched again."""


def hook(deadline: float, steps_per_epoch: int) -> str:
    """The step-hook name that stops a launch at the first epoch boundary after ``deadline`` (``time.time()``)."""
    return f"{HOOK}={deadline:.3f}/{steps_per_epoch}"


def stop_at_epoch_end(step: int, ctx, argument: str) -> None:
    """Raise :class:`DeadlinePassed` before an epoch's first step once the deadline has passed, unless
    this launch has not reached an epoch boundary yet."""
    deadline, steps_per_epoch = argument.split("/")
    first = _first_step.setdefault(ctx, step)
    if step > first and step % int(steps_per_epoch) == 0 and time.time() >= float(deadline):
        raise DeadlinePassed(f"time budget spent: stopped after epoch {step // int(steps_per_epoch)} "
                             f"(step {step}), its checkpoint written")

"""A time budget for a training launch: stop at the first checkpoint past a wall-clock deadline.

Used as a step hook (``fit(step_hooks=...)`` or ``$VIT_STEP_HOOKS``), so the loop needs no change:
it stops only before the first step after an epoch-end checkpoint (every ``checkpoint_every_epochs``
epochs), so stopping there loses nothing and launching the same run again continues from it. A
launch always gets as far as one such checkpoint, however small the budget, so repeated launches
finish the run.
"""
from __future__ import annotations

import time
import weakref

HOOK = "pipeline.train.deadline:stop_at_checkpoint"

_first_step: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # context (one per launch) -> its first step


class DeadlinePassed(Exception):
    """The launch's time budget is spent; the run continues when launched again."""


def hook(deadline: float, steps_per_epoch: int, checkpoint_every_epochs: int) -> str:
    """The step-hook name that stops a launch at the first epoch-end checkpoint after ``deadline``
    (``time.time()``)."""
    return f"{HOOK}={deadline:.3f}/{steps_per_epoch}/{checkpoint_every_epochs}"


def stop_at_checkpoint(step: int, ctx, argument: str) -> None:
    """Raise :class:`DeadlinePassed` before the first step after an epoch-end checkpoint once the
    deadline has passed, unless this launch has not written such a checkpoint yet."""
    deadline, steps_per_epoch, every = argument.split("/")
    first = _first_step.setdefault(ctx, step)
    if step > first and step % (int(steps_per_epoch) * int(every)) == 0 and time.time() >= float(deadline):
        raise DeadlinePassed(f"time budget spent: stopped after epoch {step // int(steps_per_epoch)} "
                             f"(step {step}), its checkpoint written")

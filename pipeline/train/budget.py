"""A training stage's length from a time budget (``time_budget_minutes``): train as many epochs as fit.

Comparing recipes at equal wall-clock time, or proving one within a time limit, needs a run whose
length comes from the clock, yet a cosine schedule must know its length. The loop therefore fixes
it once, at the end of the learning-rate warm-up (:func:`plan_epoch`), whose rates do not depend on
the length, by the pace of the epochs after the first (which holds the compiles and first calls, the
val path's too: ``worker.check_val_batch``), their evaluations and checkpoints included. So the run
is exactly the run launched with ``epochs`` set to the planned count: repeating it on other hardware
means setting that (logged as ``planned_epochs``) and dropping the budget.
"""
from __future__ import annotations

import math

PLAN_AFTER_EPOCHS = 2  # at least: one epoch to warm up, one to show the pace (so warmup_epochs >= 2)


def plan_epoch(warmup_steps: int, steps_per_epoch: int) -> int:
    """The epochs after which the length is fixed: the warm-up's whole epochs."""
    return max(PLAN_AFTER_EPOCHS, warmup_steps // steps_per_epoch)


def unplanned(stage: str, epochs: int, warmup_epochs: float, after: int, how: str = "") -> str | None:
    """Why a budget could never plan the run (``epochs`` ends it by epoch ``after``, where the plan
    is made), or None. The config checks it with the warm-up's whole epochs, before any data is read;
    the driver again with the plan's own epoch (:func:`plan_epoch`), once steps per epoch are known."""
    if epochs > after:
        return None
    return (f"{stage}.time_budget_minutes: the run's length is fixed at the end of the warm-up "
            f"({stage}.warmup_epochs={warmup_epochs!r}{how}), which {stage}.epochs={epochs} never passes; "
            f"raise {stage}.epochs (the most the budget may train) or shorten the warm-up")


def planned_epochs(budget_s: float, spent_s: float, epoch_s: float, done: int, most: int) -> int:
    """Epochs for the whole run: those ``done`` (``spent_s`` of the budget), then as many more as the
    rest holds at ``epoch_s`` each; at least one more (a run ends with an evaluated, checkpointed
    epoch), at most ``most`` (the stage's ``epochs``)."""
    more = math.floor((budget_s - spent_s) / max(epoch_s, 1e-9))
    return max(done + 1, min(most, done + more))

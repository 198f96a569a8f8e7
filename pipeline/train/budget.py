"""A training stage's length from a time budget (``time_budget_minutes``): train as many epochs as fit.

Comparing recipes at equal wall-clock time, or proving one within a time limit, needs a run whose
length comes from the clock, yet a cosine schedule must know its length. The loop therefore fixes
it once, after :data:`PLAN_AFTER_EPOCHS` epochs: the first holds the compiles and warm-ups, the
second shows the steady pace, its evaluation and checkpoint included. The config requires the
warm-up to last that long, and warm-up learning rates do not depend on the length, so the run
is exactly the run launched with ``epochs`` set to the planned count: repeating it on other
hardware means setting that (logged as ``planned_epochs``) and dropping the budget.
"""
from __future__ import annotations

import math

PLAN_AFTER_EPOCHS = 2


def planned_epochs(budget_s: float, spent_s: float, epoch_s: float, done: int, most: int) -> int:
    """Epochs for the whole run: those ``done`` (``spent_s`` of the budget), then as many more as the
    rest holds at ``epoch_s`` each; at least one more (a run ends with an evaluated, checkpointed
    epoch), at most ``most`` (the stage's ``epochs``)."""
    more = math.floor((budget_s - spent_s) / max(epoch_s, 1e-9))
    return max(done + 1, min(most, done + more))

"""Signals end a stage like an exception, not like a crash.

Ray's core library installs a C-level SIGTERM handler that aborts the process (exit 134 and a stack
dump), so a stage killed by a scheduler or `kill` left its MLflow run RUNNING. :func:`raise_on_signals`
makes SIGTERM / SIGINT raise :class:`StageInterrupted` instead: context managers unwind (the MLflow
run is marked KILLED), and the stage exits with 128 + the signal number and one line of explanation.
It is installed when a stage starts and again after Ray starts (which replaces the handler).

Once the stage is stopping, a second signal (Ctrl-C pressed again) is only recorded: raised inside the
clean-up, it cut Ray's shutdown short (the stage then exited 1, not 130). A third ends the process at once.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StageInterrupted(KeyboardInterrupt):
    """The stage received ``signum``; a KeyboardInterrupt, so code that cleans up on Ctrl-C also runs.
    Made here or from a held signal, it marks the stage as stopping."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        _stopping.append(signum)


_received: list[int] = []  # what arrived: Ray turns an interrupted ray.get into a plain KeyboardInterrupt
_stopping: list[int] = []  # the signals acted on, then those that arrived during the clean-up


def _raise(signum: int, _frame) -> None:
    _received.append(signum)
    if not _stopping:
        raise StageInterrupted(signum)
    _stopping.append(signum)  # the clean-up goes on
    if len(_stopping) >= 3:
        print(f"error: stopped by {signal.Signals(signum).name} a third time: its clean-up was cut short (its "
              "MLflow run may stay RUNNING); run the stage again", file=sys.stderr, flush=True)
        os._exit(128 + signum)


def received(exc: KeyboardInterrupt) -> int:
    """The signal behind ``exc``: its own, the last one handled, or SIGINT (Ctrl-C before the handler)."""
    return getattr(exc, "signum", None) or (_received[-1] if _received else signal.SIGINT)


def raise_on_signals() -> None:
    """Route SIGTERM and SIGINT to :class:`StageInterrupted` (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        _stopping.clear()  # a stage starting (or Ray started): nothing is stopping
        for sig in HANDLED:
            signal.signal(sig, _raise)


@contextmanager
def held_signals() -> Iterator[list[int]]:
    """Record SIGTERM/SIGINT instead of acting on them, for a few steps that must finish or be undone
    together (publishing outputs); the caller acts on what arrived. Main thread only (a no-op elsewhere)."""
    pending: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return

    def hold(signum: int, _frame) -> None:
        pending.append(signum)
        _received.append(signum)

    previous = {sig: signal.getsignal(sig) for sig in HANDLED}
    held = [sig for sig, handler in previous.items() if handler not in (signal.SIG_IGN, None)]
    for sig in held:
        signal.signal(sig, hold)
    try:
        yield pending
    finally:
        for sig in held:
            signal.signal(sig, previous[sig])

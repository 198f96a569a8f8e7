"""Signals end a stage like an exception, not like a crash.

Ray's core library installs a C-level SIGTERM handler that aborts the process (exit 134 and a stack
dump), so a stage killed by a scheduler or `kill` left its MLflow run RUNNING. :func:`raise_on_signals`
makes SIGTERM / SIGINT raise :class:`StageInterrupted` instead: context managers unwind (the MLflow
run is marked KILLED), and the stage exits with 128 + the signal number and one line of explanation.
It is installed when a stage starts and again after Ray starts (which replaces the handler).
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StageInterrupted(KeyboardInterrupt):
    """The stage received ``signum``; a KeyboardInterrupt, so code that cleans up on Ctrl-C also runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []  # what arrived: Ray turns an interrupted ray.get into a plain KeyboardInterrupt


def _raise(signum: int, _frame) -> None:
    _received.append(signum)
    raise StageInterrupted(signum)


def received(exc: KeyboardInterrupt) -> int:
    """The signal behind ``exc``: its own, the last one handled, or SIGINT (Ctrl-C before the handler)."""
    return getattr(exc, "signum", None) or (_received[-1] if _received else signal.SIGINT)


def raise_on_signals() -> None:
    """Route SIGTERM and SIGINT to :class:`StageInterrupted` (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread():
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

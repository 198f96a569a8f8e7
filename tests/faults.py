"""Failure injection for the fault-tolerance tests, installed as a training step hook
(``$VIT_STEP_HOOKS``, see ``pipeline.train.worker.load_step_hooks``) so the production loop holds none of it.

    inject_fault(monkeypatch, "raise@12:/tmp/marker")   # or kill@12:...; then run the stage

The hook runs in each rank's own process (Ray workers included): this module imports nothing from
the test session, and ``fault_env`` puts the repository root on PYTHONPATH so a repo copy finds it.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


OOM = ("CUDA out of memory. Tried to allocate 12.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
       "3.06 GiB is free. Including non-PyTorch memory, this process has 76.12 GiB memory in use. Of the allocated "
       "memory 74.90 GiB is allocated by PyTorch, and 0.70 GiB is reserved by PyTorch but unallocated.")  # torch's form


def fail_once(step: int, ctx, spec: str) -> None:
    """``spec`` = ``raise@N:MARKER``, ``oom@N:MARKER`` or ``kill@N:MARKER``: before step N, on the last
    rank, once per marker file, raise (a worker error; with oom, torch's out-of-memory error, as a GPU
    raises it) or SIGKILL the rank's process (a lost worker)."""
    mode, rest = spec.split("@", 1)
    at, marker = rest.split(":", 1)
    if step != int(at) or ctx.rank != ctx.world_size - 1 or Path(marker).exists():
        return
    Path(marker).write_text(f"failed at step {step}\n")
    time.sleep(5)  # let Ray Train's controller collect the last report (a kill before that: found on disk)
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "oom":
        import torch
        raise torch.OutOfMemoryError(OOM)
    raise RuntimeError(f"injected failure at step {step}")


def truncate_shard(step: int, ctx, spec: str) -> None:
    """``spec`` = ``N:BYTES:SHARD``: before step N, on rank 0, cut the shard file to BYTES bytes (a sync or
    copy cutting it while the run trains), when it is longer."""
    at, size, shard = spec.split(":", 2)
    if step == int(at) and ctx.rank == 0 and os.path.getsize(shard) > int(size):
        os.truncate(shard, int(size))


def record_staging(step: int, ctx, out: str) -> None:
    """Rank 0, at its first step: write its checkpoint staging folder and the names in it to ``out``."""
    if ctx.rank == 0 and not Path(out).exists():
        names = sorted(p.name for p in Path(ctx.staging_dir).iterdir())
        Path(out).write_text("\n".join([ctx.staging_dir, *names]))


def hook_env(hook: str) -> dict[str, str]:
    """Environment for a stage whose ranks call ``hook`` (``function=argument``, of this module)."""
    path = os.environ.get("PYTHONPATH")
    return {"VIT_STEP_HOOKS": f"tests.faults:{hook}",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT)}


def fault_env(spec: str) -> dict[str, str]:
    """Environment for a stage that should fail once as ``spec`` says (see :func:`fail_once`)."""
    return hook_env(f"fail_once={spec}")


def inject_fault(monkeypatch, spec: str) -> None:
    """Make the stages this test runs (with its environment) fail once as ``spec`` says."""
    for key, value in fault_env(spec).items():
        monkeypatch.setenv(key, value)


class RunsCode:
    """Unpickled, it runs ``touch marker``: a file anyone who can write a data or checkpoint folder could plant."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)

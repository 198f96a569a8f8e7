"""Ends the processes of a stage's own Ray instance once the stage is gone, however it went.

Ray's dashboard and runtime-env agents outlive a stage killed with ``kill -9`` (its raylet dies, they
stay, orphaned, and ignore SIGTERM). :func:`watch` starts this module beside the stage:

    python -m pipeline.reaper STAGE_PID PID...

It waits for the stage to end, gives Ray's own shutdown a moment, then kills whichever of the PIDs
still run (the same processes: psutil compares their start times, so a reused PID is left alone).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

GRACE_S = 3  # what Ray's own shutdown takes to end its processes after a normal exit


def watch(pids: list[int]) -> None:
    """Start the reaper for this process and ``pids``, in a session of its own (a signal to the stage's
    process group does not reach it) with no terminal."""
    subprocess.Popen([sys.executable, "-m", "pipeline.reaper", str(os.getpid()), *map(str, pids)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str]) -> None:
    import psutil

    def process(pid: int):
        try:
            return psutil.Process(pid)
        except psutil.Error:
            return None

    stage = process(int(argv[0]))
    procs = [p for p in map(process, map(int, argv[1:])) if p is not None]
    if stage is not None:
        try:
            stage.wait()
        except psutil.Error:
            pass
    time.sleep(GRACE_S)
    for p in procs:
        try:
            if p.is_running():
                p.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    main(sys.argv[1:])

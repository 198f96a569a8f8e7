"""Entry-point wrapper for the stages: load params, take the stage's lock, run, and turn known
errors into one line and an exit code (docs/troubleshooting.md lists them)."""
from __future__ import annotations

import errno
import fcntl
import inspect
import logging
import os
import re
import signal
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from pipeline import outputs, storage
from pipeline.config import TRAINING_STAGES, ConfigError, Params, load_stage_params
from pipeline.signals import raise_on_signals, received
from pipeline.utils import freeze_heap_at_exit

LOCK_DIR = Path(".stage-locks")  # in the stage's working directory, beside the outputs it guards
EXIT_FAILED, EXIT_CONFIG, EXIT_BUSY = 1, 2, 3


class StageBusy(RuntimeError):
    """Another process runs the same stage in the same directory."""


@contextmanager
def stage_lock(name: str) -> Iterator[None]:
    """One running instance of a stage per working directory: a second one would share the first's
    outputs, Ray run directory and MLflow run. The OS drops the lock when the holder dies."""
    LOCK_DIR.mkdir(exist_ok=True)
    path = LOCK_DIR / f"{name}.lock"
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):  # ENOLCK: an NFS mount without a lock service
                raise OSError(exc.errno, f"cannot lock ({exc.strerror})", str(path)) from None
            f.seek(0)
            raise StageBusy(f"stage {name!r} is already running in {Path.cwd()} (pid {f.read().strip() or '?'}, "
                            f"lock {path}); wait for it to finish or stop it first") from None
        f.truncate(0)
        f.write(f"{os.getpid()} on {socket.gethostname()}")  # a checkout on NFS: the pid may be another host's
        f.flush()
        yield


def run_stage(fn: Callable[..., object], *args: str, name: str | None = None) -> None:
    """Load ``params.yaml`` (or ``$VIT_PARAMS``), call ``fn(params, *args)`` under the lock ``name``
    (default: the function's name), exit non-zero with one line on error."""
    raise_on_signals()
    _check_arguments(fn, args, name or fn.__name__)
    # keep the console to progress lines: MLflow sets its logger's level when it is imported (later,
    # in the stage and its Ray workers) from MLFLOW_LOGGING_LEVEL, INFO unless set
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.getLogger("mlflow").setLevel(os.environ["MLFLOW_LOGGING_LEVEL"].upper())  # MLflow takes "debug" too
    freeze_heap_at_exit()
    published_before = len(outputs.published)
    try:
        params: Params = load_stage_params()
        with stage_lock(name or fn.__name__):
            fn(params, *args)
    except KeyboardInterrupt as exc:
        _fail(_stopped_line(received(exc), outputs.published[published_before:]), 128 + received(exc))
    except Exception as exc:
        known = _known_failure(_raised_in_loader_worker(_raised_on_ray_worker(exc)), name or fn.__name__)
        if known is None:
            raise  # a bug: the traceback is what its reader needs
        _fail(*known)


def _stopped_line(signum: int, published: list[Path]) -> str:
    """What a stop left: a stage stopped while logging to MLflow may have published its outputs already."""
    name = signal.Signals(signum).name
    if published:
        return (f"error: stopped by {name} after this stage had replaced its outputs "
                f"({', '.join(map(str, published))}); its MLflow run is marked KILLED; run it again to complete it")
    return (f"error: stopped by {name}; outputs of this stage were not replaced, its MLflow run is marked KILLED; "
            f"run it again to resume from the last checkpoint")


def _check_arguments(fn: Callable[..., object], args: tuple[str, ...], label: str) -> None:
    """A stage's command-line arguments fit its function (``fn(params, *args)``); stray ones are an error,
    not silently ignored."""
    try:
        inspect.signature(fn).bind(None, *args)
    except TypeError:
        n = len(inspect.signature(fn).parameters) - 1
        _fail(f"error: stage {label} takes {f'at most {n} argument(s)' if n else 'no arguments'}, got: "
              f"{' '.join(args)}", EXIT_CONFIG)


def _known_failure(exc: BaseException, stage: str = "") -> tuple[str, int] | None:
    """The one line and exit code for a problem docs/troubleshooting.md lists, else None."""
    if _out_of_memory(exc):
        return f"error: out of memory: {_smaller_step(str(exc), stage)}", EXIT_FAILED
    if (problem := storage.access_problem(exc)) is not None:
        return f"error: {problem}", EXIT_FAILED
    if isinstance(exc, ConfigError):
        return f"error: {exc}", EXIT_CONFIG
    if isinstance(exc, StageBusy):
        return f"error: {exc}", EXIT_BUSY
    if isinstance(exc, ValueError):
        return f"error: {type(exc).__name__}: {exc}", EXIT_FAILED
    if isinstance(exc, OSError):  # a missing input, a full disk, a read-only directory: the path and the reason
        where = f"{exc.filename}: " if exc.filename else ""
        return f"error: {where}{exc.strerror or exc}", EXIT_FAILED
    return None


def _out_of_memory(exc: BaseException) -> bool:
    """torch could not allocate: on a GPU (``torch.OutOfMemoryError``) or on the CPU (a RuntimeError)."""
    torch = sys.modules.get("torch")  # not imported here: a stage that ran out of memory has imported it
    if torch is not None and isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


def _smaller_step(message: str, stage: str) -> str:
    """torch's own account (what it tried to allocate, what was free; not its allocator's statistics),
    then the params that shrink what a step of ``stage`` holds."""
    what = message.split(" Including non-PyTorch memory")[0].split(" Of the allocated memory")[0].strip()
    if stage in TRAINING_STAGES:
        return (f"{what} A rank's {stage} step holds {stage}.global_batch_size / ray.num_workers images: lower "
                f"{stage}.global_batch_size, or keep it and set {stage}.max_worker_batch (the step accumulates "
                f"gradients over micro-batches that size) or {stage}.grad_checkpointing: true (activations "
                f"recomputed in the backward)")
    return f"{what} Lower evaluate.batch_size" if stage == "evaluate" else what


def _raised_on_ray_worker(exc: BaseException) -> BaseException:
    """What a Ray task or Ray Train rank raised, out of Ray's wrapper (whose message is the remote
    traceback): a damaged shard met on a worker then reads like one met in this process."""
    if "ray" not in sys.modules:  # the local runner: nothing is wrapped
        return exc
    from ray.exceptions import RayTaskError
    from ray.train import WorkerGroupError

    if isinstance(exc, RayTaskError):
        return exc.cause
    if isinstance(exc, WorkerGroupError) and exc.worker_failures:
        return exc.worker_failures[min(exc.worker_failures)]
    return exc


_LOADER_WORKER = re.compile(r"Caught \w+ in DataLoader worker process \d+\.\nOriginal Traceback")


def _raised_in_loader_worker(exc: BaseException) -> BaseException:
    """What a DataLoader worker raised, out of torch's re-raise (the same type, whose message is the
    worker's traceback): a damaged shard met in a loader worker then reads like one met in the rank."""
    text = str(exc)
    if not _LOADER_WORKER.match(text):
        return exc
    lines = text.rstrip("\n").split("\n")
    last_frame = max((i for i, line in enumerate(lines) if line.startswith(" ")), default=len(lines))
    name, _, message = "\n".join(lines[last_frame + 1:]).partition(": ")  # the error follows the last frame
    if not message or name.rsplit(".", 1)[-1] != type(exc).__name__:
        return exc
    try:
        return type(exc)(message)
    except Exception:  # a type that takes other arguments: its wrapped form
        return exc


def _fail(message: str, code: int) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)

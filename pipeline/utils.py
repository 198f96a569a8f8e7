"""Small helpers shared by the stages: atomic writes, output modes and output locations."""
from __future__ import annotations

import argparse
import atexit
import csv
import gc
import io
import json
import os
import reprlib
import tempfile
from pathlib import Path
from typing import Any, Callable

SHARDS = Path("data/shards")
MODELS = Path("models")
METRICS = Path("metrics")
PLOTS = Path("plots")
PARTIAL = ".partial."  # the prefix of an output being written (.gitignore'd): atomic_write's and pipeline.outputs'
EXPORTS = Path("exports")
PRETRAINED = MODELS / "pretrain"  # what the fine-tune starts from with finetune.init: null
# A shard directory's files besides its tars; DATASET_INFO is written last, so it marks a complete one.
DATASET_INFO, MANIFEST, BAD_FILES = "dataset.json", "manifest.parquet", "bad_files.json"
CONFIG_NAME = "config.json"  # a model or export directory's config, written after the weights


def trained_by(model_dir: str | os.PathLike) -> str | None:
    """The MLflow run that trained the model in ``model_dir``, as its config.json names it (None: none named)."""
    try:
        run_id = json.loads((Path(model_dir) / CONFIG_NAME).read_text()).get("mlflow_run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return run_id if isinstance(run_id, str) and run_id else None


def metrics_path(stage: str) -> Path:
    """``metrics/<stage>.json``: a stage's numbers, what DVC and the pipeline run compare."""
    return METRICS / f"{stage}.json"


def history_path(stage: str) -> Path:
    """A training stage's per-epoch rows (DVC plots, evaluate's curves)."""
    return PLOTS / f"{stage}_history.csv"


def error_summary(exc: BaseException) -> str:
    """The exception's class and the first line of its message (loaders' messages run long): for an
    error line that names a damaged file."""
    lines = str(exc).strip().splitlines()
    first = lines[0][:200] if lines else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


SHOWN_CHARS = 120  # the most of a value an error message echoes
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 3, SHOWN_CHARS, SHOWN_CHARS, SHOWN_CHARS
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 10


def shown(value: Any) -> str:
    """``repr(value)`` for an error message, at most :data:`SHOWN_CHARS` long: a value read from a file can be
    megabytes long. reprlib shortens long strings and lists inside ("...") without writing all of it out
    first; what is still too long ends in "…"."""
    text = _SHOWN.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 1] + "…"


def freeze_heap_at_exit() -> None:
    """For entry points: at exit, after the exit handlers registered later (Ray's shutdown, MLflow's
    flush), freeze the heap, so Python's teardown skips walking every object torch, MLflow and Ray
    made (1-2 s a process on 2 cores). Registered once however often it is called."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)


def current_umask() -> int:
    """The process umask. Read from /proc where it can be: setting it to read it back would, for an
    instant, give files that other threads create a different mode."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # no /proc: the strictest mask while it is swapped out
    os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike) -> None:
    """Give a ``mkstemp``/``mkdtemp`` path (always 0600/0700) the mode ``open``/``mkdir`` would have,
    so an output renamed into place is as readable by group and others as the user's umask says."""
    full = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, full & ~current_umask())


def atomic_write(path: str | os.PathLike, write: Callable[[str], object]) -> None:
    """``write(tmp)`` next to ``path``, on disk (fsync), then renamed over it: readers never see a
    half-written file, and a crash or power loss leaves the old file or the new one, not an empty one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{PARTIAL}{path.name}.")  # .gitignore'd if a kill leaves it
    os.close(fd)
    try:
        write(tmp)
        apply_umask(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def csv_text(header: list[str], rows) -> str:
    """CSV with fields quoted where needed: Hugging Face class names hold commas ("tench, Tinca tinca")."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return buf.getvalue()


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def positive_int(text: str) -> int:
    """argparse type for sizes: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid: must be an integer >= 1")
    return value


def seconds(text: str) -> float:
    """argparse type for durations: a finite number >= 0 (``nan`` and ``inf`` parse as floats)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not valid: must be a number of seconds >= 0")
    return value


def lazy_exports(package: str, namespace: dict, exports: dict[str, str]):
    """A package's ``__getattr__`` and ``__dir__`` (PEP 562) for ``exports`` (name -> submodule): each name
    is imported from its submodule on first use and then kept in the package's ``namespace``, so a user of
    one submodule does not pay for the others' imports."""
    import importlib

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *exports])

    return __getattr__, __dir__

"""Measured figures as data: a benchmark run appends one JSON line to ``benchmarks/results/<name>.jsonl``.

Each record says when (``date``, UTC), on what code (``commit``, ``dirty``), where (``machine``: the CPU,
its cores, the GPU) and how (``command``) its ``figures`` were measured; ``case`` (optional) names what
was measured when one benchmark measures several things (a recipe, a model size). ``python -m
benchmarks.render_results`` renders ``docs/results.md`` from these files. A figure measured by hand
(a fresh clone's ``bash scripts/pipeline.sh``) is recorded the same way::

    python -m benchmarks.results pipeline --command "bash scripts/pipeline.sh" wall_time_s=290 test_top1=0.989

``$VIT_RESULTS_DIR`` sends records elsewhere (the tests do; a GPU box can write under ``$OUT``), and each
benchmark's ``--no-record`` writes none. Only the standard library at import: the GPU-box commands
import this too.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"
DIR_VAR = "VIT_RESULTS_DIR"


def results_dir() -> Path:
    return Path(os.environ.get(DIR_VAR) or RESULTS_DIR)


def add_record_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--no-record", dest="record", action="store_false",
                    help=f"do not append this run's figures to {RESULTS_DIR.relative_to(ROOT)}/ (or ${DIR_VAR})")


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def code_version() -> tuple[str, bool | None]:
    """(commit, dirty): the checked-out commit and whether tracked or new files differ from it, records
    aside (a record just appended must not mark the next one dirty); ("unknown", None) outside git."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return "unknown", None
    status = _git("status", "--porcelain", "--", ".", f":!{RESULTS_DIR.relative_to(ROOT)}")
    return head.strip(), None if status is None else bool(status.strip())


def machine() -> dict:
    """The CPU (model, cores this process may use, AVX-512: ``pipeline.environment.cpu_name``), the
    machine's core count, and the first GPU's name where torch sees one, else None."""
    import torch

    from pipeline.environment import cpu_name  # imports torch, which every benchmark has loaded already
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "gpu": gpu}


def command_line(script: str, argv: list[str] | None = None) -> str:
    """The command as typed in the repository's root: ``python benchmarks/x.py ARGS``."""
    path = Path(script).resolve()
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return shlex.join(["python", str(shown), *map(str, sys.argv[1:] if argv is None else argv)])


def flat_figures(figures: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: a record's figures are one level, each a value the renderer shows."""
    flat = {}
    for key, value in figures.items():
        if isinstance(value, dict):
            flat.update(flat_figures(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def append_record(benchmark: str, figures: dict, *, command: str, case: str | None = None) -> Path:
    """Append one record of ``figures`` (nested ones flattened: :func:`flat_figures`) to
    ``<results dir>/<benchmark>.jsonl``, in one write; returns the file."""
    commit, dirty = code_version()
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit, "dirty": dirty, "machine": machine(), "command": command}
    if case is not None:
        record["case"] = case
    record["figures"] = flat_figures(figures)
    out = results_dir() / f"{benchmark}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return out


def record_and_say(benchmark: str, figures: dict, *, command: str, case: str | None = None) -> None:
    """Append the record, and say where on stderr (stdout holds the figures, which tests and scripts parse)."""
    print(f"recorded in {append_record(benchmark, figures, command=command, case=case)}", file=sys.stderr, flush=True)


def _figure(item: str) -> tuple[str, object]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{item!r}: give KEY=VALUE, e.g. wall_time_s=290")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Record figures measured by hand (one JSON line).")
    ap.add_argument("benchmark", help="the file's name: benchmarks/results/BENCHMARK.jsonl")
    ap.add_argument("figures", nargs="+", type=_figure, metavar="KEY=VALUE", help="numbers as JSON, else text")
    ap.add_argument("--command", required=True, help="what was run and timed")
    ap.add_argument("--case", help="what was measured, where the benchmark measures several things")
    args = ap.parse_args(argv)
    if not args.benchmark.replace("_", "").isalnum():
        ap.error(f"benchmark {args.benchmark!r}: letters, digits and _ only (it names a file)")
    try:
        record_and_say(args.benchmark, dict(args.figures), command=args.command, case=args.case)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

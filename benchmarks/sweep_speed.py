"""Sweep wall time: the same trials with ASHA stopping the worst early, and run to their end (scheduler
``none``), side by side, and whether both find the same best trial.

Both sweeps tune ``pretrain.lr`` (log-uniform over two decades) on digits with the tiny model, from the
same seed (so the same draws), each through ``vit-pipeline sweep`` in a work folder of its own params.yaml
and shards (Ray started by each). ASHA's rungs: ``--grace`` epochs, then every ``--reduction-factor``-fold
more. Target (issue 77): ASHA's wall time <= 0.5x, with the same best trial.

    python benchmarks/sweep_speed.py --trials 16 --epochs 8 --json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.utils import positive_int

TARGET = 0.5


def params_file(epochs: int) -> dict:
    """params.yaml for a short digits pretrain on one in-process rank per trial."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["data"]["pretrain"]["source"] = "digits"
    raw["model"].update(depth=2)
    raw["pretrain"].update(epochs=epochs, warmup_epochs=0)
    raw["ray"].update(backend="local")
    return raw


def sweep_file(trials: int, scheduler: str, concurrent: int, grace: int, reduction_factor: int) -> dict:
    return {"stage": "pretrain", "num_samples": trials, "max_concurrent": concurrent,
            "scheduler": {"name": scheduler, "grace_period": grace, "reduction_factor": reduction_factor},
            "space": {"pretrain.lr": {"loguniform": [0.0003, 0.03]}}}


def _run(cmd: list[str], cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed in {cwd}:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def measure(work: Path, trials: int, epochs: int, concurrent: int, grace: int, reduction_factor: int) -> dict:
    (work / "params.yaml").write_text(yaml.safe_dump(params_file(epochs), sort_keys=False))
    _run([sys.executable, "-m", "stages.shard", "pretrain"], work)  # untimed
    figures, best = {}, {}
    for scheduler in ("asha", "none"):
        sweep = sweep_file(trials, scheduler, concurrent, grace, reduction_factor)
        (work / f"{scheduler}.yaml").write_text(yaml.safe_dump(sweep))
        figures[f"{scheduler}_wall_s"] = round(_run([sys.executable, "-m", "pipeline", "sweep",
                                                     f"{scheduler}.yaml"], work), 1)
        best[scheduler] = yaml.safe_load((work / "sweeps" / scheduler / "best.yaml").read_text())
    figures["ratio"] = round(figures["asha_wall_s"] / figures["none_wall_s"], 3)
    figures["same_best"] = str(best["asha"] == best["none"]).lower()
    figures.update(trials=trials, epochs=epochs, max_concurrent=concurrent, grace_period=grace,
                   reduction_factor=reduction_factor, target_ratio=TARGET)
    return figures


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=positive_int, default=16, help="trials drawn (the same in both sweeps)")
    ap.add_argument("--epochs", type=positive_int, default=8, help="pretrain.epochs: a trial's full length")
    ap.add_argument("--grace", type=positive_int, default=1, help="ASHA's grace period, in epochs")
    ap.add_argument("--reduction-factor", type=positive_int, default=2, help="ASHA keeps 1 in this many per rung")
    ap.add_argument("--concurrent", type=positive_int, default=2, help="trials at once (max_concurrent)")
    ap.add_argument("--workdir", type=Path, help="keep the work folder here (default: a temporary one, removed)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    add_record_option(ap)
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="sweep-speed-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        figures = measure(work, args.trials, args.epochs, args.concurrent, args.grace, args.reduction_factor)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"ASHA {figures['asha_wall_s']} s vs to the end {figures['none_wall_s']} s: {figures['ratio']}x "
          f"(target <= {TARGET}x), same best trial: {figures['same_best']}", flush=True)
    if args.record:
        record_and_say("sweep_speed", figures, command=command_line(__file__, argv),
                       case=f"{args.trials} trials x {args.epochs} epochs, {args.concurrent} at once, ASHA grace "
                            f"{args.grace}, reduction factor {args.reduction_factor}")
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())

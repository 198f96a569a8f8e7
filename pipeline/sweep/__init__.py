"""`vit-pipeline sweep SWEEP.yaml`: Ray Tune over params.yaml keys of a training stage (docs/experiments.md,
Sweeps). The sweep file is checked (:mod:`.sweep_file`) before Ray starts; :mod:`.tuning` runs the trials
(:mod:`.trial`) and writes the best one's overrides."""
from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None, prog: str = "python -m pipeline.sweep") -> int:
    ap = argparse.ArgumentParser(prog=prog, description="Tune a training stage's params.yaml keys with Ray Tune; "
                                 "writes sweeps/<name>/best.yaml and prints the `dvc exp run -S` line that "
                                 "reproduces the best trial (docs/experiments.md, Sweeps).")
    ap.add_argument("sweep_file", help="the sweep: stage, space, metric, scheduler, resources "
                                       "(e.g. configs/sweep-finetune.yaml)")
    args = ap.parse_args(argv)
    from pipeline.cli import run_stage
    from pipeline.sweep.tuning import sweep

    run_stage(sweep, args.sweep_file, name=f"sweep-{Path(args.sweep_file).stem}")
    return 0

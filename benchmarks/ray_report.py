"""How long a rank waits in ``ray.train.report``: with Ray Train's default controller poll interval
and with the stages' (``$RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, else ``pipeline.cluster.REPORT_POLL_S``),
side by side in one run.

    python benchmarks/ray_report.py                  # 2 ranks, 10 reports, 1 s of "training" between them

Ray Train V2 takes a rank's report when its controller polls the ranks, and a rank's next report waits
until the last one was taken, so a loop that reports more often than the poll interval waits in
``report``. Each rank here reports as the training loop does (rank 0 attaches a checkpoint directory),
sleeping ``--gap`` seconds between reports in place of an epoch.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.cluster import REPORT_POLL_VAR, init_ray, torch_trainer
from pipeline.config import RayConfig
from pipeline.utils import positive_int, seconds


def reporting_loop(cfg: dict) -> None:
    """Each rank: ``reports`` reports ``gap`` seconds apart, then a last one carrying rank 0's waits
    (Ray's result holds the metrics of the last checkpoint)."""
    import logging

    import ray.train
    import torch

    logging.getLogger().setLevel(logging.WARNING)  # Ray Train's per-report INFO lines, as in the stages
    rank, waits = ray.train.get_context().get_world_rank(), []

    def report(metrics: dict) -> None:
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                torch.save(metrics, Path(d) / "state.pt")
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report(metrics, checkpoint=checkpoint)

    for i in range(cfg["reports"]):
        time.sleep(cfg["gap"])
        t0 = time.perf_counter()
        report({"i": i})
        waits.append(time.perf_counter() - t0)
    report({"median_report_s": statistics.median(waits), "max_report_s": max(waits),
            "poll_interval_s": float(os.environ[REPORT_POLL_VAR])})


def measure(interval: str, args: argparse.Namespace, storage: str) -> dict:
    from ray.train import LoggingConfig, RunConfig, ScalingConfig

    os.environ[REPORT_POLL_VAR] = interval  # read when fit() starts the controller, passed on to the ranks
    trainer = torch_trainer(RayConfig(num_workers=args.workers), reporting_loop,
                            train_loop_config={"reports": args.reports, "gap": args.gap},
                            scaling_config=ScalingConfig(num_workers=args.workers),
                            run_config=RunConfig(name=f"report-{interval}", storage_path=storage,
                                                 logging_config=LoggingConfig(log_level="WARNING")))
    return trainer.fit().metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=positive_int, default=2)
    ap.add_argument("--reports", type=positive_int, default=10)
    ap.add_argument("--gap", type=seconds, default=1.0, help="seconds of 'training' between reports")
    add_record_option(ap)
    args = ap.parse_args()
    from ray.train.v2._internal.constants import DEFAULT_HEALTH_CHECK_INTERVAL_S

    init_ray(RayConfig(num_workers=args.workers))
    stages = os.environ[REPORT_POLL_VAR]  # what init_ray left: $RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, else REPORT_POLL_S
    with tempfile.TemporaryDirectory() as storage:
        default = DEFAULT_HEALTH_CHECK_INTERVAL_S
        rows = [(f"Ray's default ({default:g} s)", measure(str(default), args, storage)),
                (f"the stages' ({stages} s)", measure(stages, args, storage))]
    print(f"{args.workers} ranks, {args.reports} reports {args.gap:g} s apart; time rank 0 spends in ray.train.report:")
    for name, m in rows:
        print(f"  poll interval {name:24s}: median {m['median_report_s']:.3f} s, max {m['max_report_s']:.3f} s "
              f"(ranks saw {m['poll_interval_s']:g} s)")
    if args.record:
        (_, default_run), (_, stages_run) = rows
        record_and_say("ray_report", {f"{which}_{k}": run[k] for which, run in (("default", default_run),
                                                                                ("stages", stages_run))
                                      for k in ("poll_interval_s", "median_report_s", "max_report_s")},
                       command=command_line(__file__), case=f"{args.workers} ranks, {args.gap:g} s apart")


if __name__ == "__main__":
    main()

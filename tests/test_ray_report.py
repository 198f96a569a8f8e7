"""Ray Train reports: the stages make Ray's controller poll the ranks every ``REPORT_POLL_S`` (Ray's own
default, 2 s, made a loop that reports every epoch wait in ``ray.train.report``), through real Ray."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import tracebacks

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_report_benchmark_runs_both_intervals_and_ranks_see_them(env_factory):
    """docs/training.md's benchmark, shortened: two real 2-rank Ray Train runs, one with Ray's default
    interval and one with the stages' (set by ``init_ray``), each passed on by Ray to the ranks."""
    from ray.train.v2._internal.constants import DEFAULT_HEALTH_CHECK_INTERVAL_S

    from pipeline.cluster import REPORT_POLL_S

    proc = subprocess.run([sys.executable, "benchmarks/ray_report.py", "--reports", "3", "--gap", "0.2"], cwd=ROOT,
                          env=env_factory(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    seen = re.findall(r"median ([\d.]+) s, max ([\d.]+) s \(ranks saw ([\d.]+) s\)", proc.stdout)
    assert [float(s[2]) for s in seen] == [DEFAULT_HEALTH_CHECK_INTERVAL_S, float(REPORT_POLL_S)], proc.stdout
    assert all(0 <= float(median) <= float(most) for median, most, _ in seen), proc.stdout
    assert not tracebacks(proc.stderr)


"""``<stage>.profile_steps``: rank 0 records that many train steps with ``torch.profiler`` and saves the
trace (Perfetto / chrome://tracing) as the MLflow run's artifact ``profile/``, or, without a run, in the
run's folder. It starts a few steps into the launch, after the first calls' one-off costs."""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from pipeline.train.context import TrainContext
from pipeline.train.loop_config import LoopConfig, LoopRun

WAIT_STEPS = 3  # steps of the launch before the recording: compiles, first calls, CUDA graph captures
TRACE = "trace.json"


class StepProfiler:
    """A step hook (``hook(step, ctx)`` before each step): starts the profiler ``WAIT_STEPS`` steps into
    the launch and stops it ``profile_steps`` steps later; :meth:`close` saves a recording the run's end
    cut short."""

    def __init__(self, cfg: LoopConfig, run: LoopRun, first_step: int):
        self.stage, self.run, self.steps = cfg.stage, run, cfg.profile_steps
        self.start = first_step + WAIT_STEPS
        self.prof: torch.profiler.profile | None = None
        self.done = 0

    def __call__(self, step: int, ctx: TrainContext) -> None:
        if step == self.start and self.prof is None:
            cuda = ctx.device.type == "cuda"
            activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
        elif step == self.start + self.steps:
            self.close(ctx)

    def close(self, ctx: TrainContext) -> None:
        if self.prof is None:
            return
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as tmp:
            prof.export_chrome_trace(str(Path(tmp) / TRACE))
            where = self._save(Path(tmp) / TRACE)
        print(f"[{self.stage}] torch.profiler trace of steps {self.start + 1}-{self.start + self.steps}: {where}",
              flush=True)

    def _save(self, trace: Path) -> str:
        if self.run.run_id:
            from mlflow.tracking import MlflowClient
            MlflowClient(self.run.tracking_uri).log_artifact(self.run.run_id, str(trace), "profile")
            return f"the MLflow run's artifact profile/{TRACE}"
        if self.run.run_dir:
            out = Path(self.run.run_dir) / "profile"
            out.mkdir(parents=True, exist_ok=True)
            trace.replace(out / TRACE)
            return str(out / TRACE)
        return "not saved (no MLflow run and no local run folder)"

"""One sweep trial, in its Tune actor: the stage's own run (its data, initial weights, loop, checkpoints)
with the trial's values, each epoch reported to Tune, logged into the trial's MLflow run under the sweep's.

One rank per trial runs the loop in the trial's process (``ray.backend: local``); more run it on Ray Train,
whose reports reach Tune through Ray's ``TuneReportCallback``."""
from __future__ import annotations

import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

from pipeline.config import Params, load_params
from pipeline.sweep.sweep_file import Sweep

TRIAL_TAG, STATUS_TAG = "sweep.trial_id", "sweep.status"
FINISHED, STOPPED = "finished", "stopped early"


def trial_params(sweep: Sweep, config: dict[str, Any], runs_dir: str) -> Params:
    """params.yaml as the trial runs it: its values, its ranks, its checkpoints in the sweep's folder (a
    stage run of the same params, the reproduction, starts its own run instead of continuing the trial's)."""
    return load_params(sweep.params_path, overrides={**sweep.trial_overrides(config), "ray.storage_path": runs_dir})


def train_trial(config: dict[str, Any], *, sweep: Sweep, parent_run_id: str, tracking_uri: str,
                sweep_dir: str, root: str) -> None:
    """Tune's function trainable, run in ``root``, the sweep's working directory (its shards, models/pretrain;
    on a cluster, a shared path). The trial's console output goes to ``<sweep_dir>/logs/<trial id>.log``."""
    import os

    from ray import tune

    os.chdir(root)
    trial_id = tune.get_context().get_trial_id()
    logs = Path(sweep_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{trial_id}.log", "a") as log, redirect_stdout(log), redirect_stderr(log):
        # a folder per trial: two trials drawing the same values are two runs, not one continuing the other
        _train(config, sweep, parent_run_id, tracking_uri, str(Path(sweep_dir) / "runs" / trial_id), trial_id)


def _train(config: dict, sweep: Sweep, parent_run_id: str, tracking_uri: str, runs_dir: str, trial_id: str) -> None:
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import stage_params
    from pipeline.train.driver import fit
    from pipeline.train.stage import plan_stage, run_params, stage_start

    params = trial_params(sweep, config, runs_dir)
    recipe, model, shard_dir, info = stage_start(sweep.stage, params)
    logged = stage_params(sweep.stage, params, run_params(sweep.stage, params, recipe, model, info))
    recipe, spec = plan_stage(sweep.stage, params, recipe, model, shard_dir, info)
    client = MlflowClient(tracking_uri)
    run_id = child_run(client, parent_run_id, trial_id, f"{sweep.name} {trial_id}",
                       {"stage": sweep.stage, "kind": "sweep-trial", "ray.run_name": spec.run_name}, logged)
    print(f"[sweep] trial {trial_id}: {config}", flush=True)
    local = params.ray.backend == "local"
    try:
        fit(spec, params.ray, model, run_id=run_id, on_epoch=_reporter(sweep.metric) if local else None,
            train_callbacks=() if local else (_train_reporter(sweep.metric),))
    except Exception:  # not Tune ending the thread of a trial it stopped (SystemExit): the driver closes that run
        client.set_terminated(run_id, "FAILED")
        raise
    end_trial(client, run_id, FINISHED)


def _reporter(metric: str):
    """Each epoch's numbers to Tune, once the loop's MLflow writes are in the store (Tune may stop the
    trial at this report, and its process with it)."""
    import mlflow
    from ray import tune

    def report(metrics: dict) -> None:
        if metric in metrics:  # an epoch without an evaluation (eval_every > 1): nothing to rank by
            mlflow.flush_async_logging()
            tune.report({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
    return report


def _train_reporter(metric: str):
    """Ray Train's relay of rank 0's reports to Tune, less those without ``metric`` (mid-epoch checkpoints)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    class EpochReports(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metric in metrics[0]:
                super().after_report(run_context, metrics, checkpoint)
    return EpochReports()


def child_run(client, parent_run_id: str, trial_id: str, name: str, tags: dict[str, str],
              params: dict[str, str]) -> str:
    """The trial's MLflow run under the sweep's: the one it began before (a resumed sweep), or a new one."""
    from mlflow.entities import Param
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    found = find_child(client, parent_run_id, trial_id)
    if found is not None:
        client.update_run(found.info.run_id, status="RUNNING")
        return found.info.run_id
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    run = client.create_run(experiment_id, run_name=name,
                            tags={**tags, TRIAL_TAG: trial_id, MLFLOW_PARENT_RUN_ID: parent_run_id})
    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
        client.log_batch(run.info.run_id, params=items[i:i + 100])
    return run.info.run_id


def find_child(client, parent_run_id: str, trial_id: str):
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    found = client.search_runs([experiment_id], f"tags.`{TRIAL_TAG}` = '{trial_id}' and "
                               f"tags.`mlflow.parentRunId` = '{parent_run_id}'", max_results=1)
    return found[0] if found else None


def end_trial(client, run_id: str, status: str) -> None:
    """How the trial ended (``sweep.status``), its duration, and the run closed."""
    run = client.get_run(run_id)
    client.set_tag(run_id, STATUS_TAG, status)
    client.log_metric(run_id, "duration_s", time.time() - run.info.start_time / 1000)
    client.set_terminated(run_id, "FINISHED")

"""The sweep's driver: Ray Tune over the trials (:mod:`.trial`), an MLflow parent run over theirs, one
line per trial as it ends, and the best trial's overrides (``best.yaml`` and a `dvc exp run -S` line).

Everything lives in ``sweeps/<sweep file's name>/``: Tune's state (``tune/``, what a stopped sweep
resumes from), the trials' checkpoints (``runs/``), their console output (``logs/``) and ``best.yaml``."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
import time
from pathlib import Path

import yaml
from ray.tune import Callback

from pipeline import storage
from pipeline.config import ConfigError, Params, apply_override, flatten, params_file, read_partial_params
from pipeline.recipes import override_key, override_value
from pipeline.signals import StageInterrupted
from pipeline.sweep.sweep_file import Sweep, candidates, load_sweep, search_space, sweep_settings
from pipeline.sweep.trial import FINISHED, STATUS_TAG, STOPPED, end_trial, find_child, train_trial, trial_params
from pipeline.utils import atomic_write_text

SWEEPS = Path("sweeps")
TUNE_DIR, BEST_FILE, PARENT_FILE, DIGEST_FILE = "tune", "best.yaml", "mlflow_run_id", "sweep.sha256"


def sweep(params: Params, path: str) -> dict:
    """Run (or resume) the sweep in ``path``; its best trial's overrides."""
    spec = load_sweep(path, params_file())
    out = (SWEEPS / spec.name).resolve()
    _check_same_sweep(out, spec)
    _check_inputs(spec, params)
    from pipeline.tracking import check_tracking_uri, configured_uri

    uri = configured_uri()
    check_tracking_uri(uri)
    parent = _parent_run(uri, params, spec, out)
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # Tune's own tables off (verbose=0): the lines below say it
    from pipeline.cluster import ray_cluster

    started = time.time()
    try:
        with ray_cluster(_driver_ray(params, spec)):
            grid = _fit(_tuner(spec, parent, uri, out))
        return _finish(spec, grid, parent, uri, out, time.time() - started)
    except KeyboardInterrupt:
        _end_parent(uri, parent, "KILLED")  # resumed by running the sweep again
        raise
    except BaseException:
        _end_parent(uri, parent, "FAILED")
        raise


def _fit(tuner):
    """Tune's fit, which takes Ctrl-C itself: it stops the trials, saves the sweep's state and returns. Its
    handler puts the one before back when it fires (only then): a stop, raised as the stage's own."""
    import signal

    os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
    ours = signal.getsignal(signal.SIGINT)
    grid = tuner.fit()
    if signal.getsignal(signal.SIGINT) is ours:
        raise StageInterrupted(signal.SIGINT)
    signal.signal(signal.SIGINT, ours)
    return grid


def _end_parent(uri: str, parent: str, status: str) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).set_terminated(parent, status)


def _check_same_sweep(out: Path, spec: Sweep) -> None:
    """A sweep resumes only with the sweep file and params it began with: its trials were drawn from them."""
    digest = hashlib.sha256(Path(spec.path).read_bytes() + b"\0" + Path(spec.params_path).read_bytes()).hexdigest()
    recorded = out / DIGEST_FILE
    if recorded.exists() and recorded.read_text().strip() != digest:
        raise ConfigError(f"{spec.path}: {out} holds a sweep begun with another {spec.path} or "
                          f"{spec.params_path}; put them back to resume it, or remove {out} (or rename the "
                          "sweep file) to start a new one")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(recorded, digest + "\n")


def _check_inputs(spec: Sweep, params: Params) -> None:
    """What every trial reads is there before any starts: the stage's shards, a fine-tune's starting weights."""
    from pipeline.data import read_dataset_info
    from pipeline.train.stage import PRETRAINED, check_finetune_init

    read_dataset_info(storage.shard_dir(spec.stage))
    if spec.stage == "finetune":
        check_finetune_init(params)
        if params.finetune.init is None and not PRETRAINED.exists():
            raise FileNotFoundError(f"{PRETRAINED}: not found; a fine-tune sweep starts from the pretrained "
                                    "model: run the pretrain stage first (dvc repro pretrain)")


def _driver_ray(params: Params, spec: Sweep):
    """The Ray the sweep starts or joins: one trial's ranks must fit it."""
    ray = {k.removeprefix("ray."): v for k, v in spec.ray_overrides().items()}
    return dataclasses.replace(params.ray, **{**ray, "backend": "ray"})


def _tuner(spec: Sweep, parent: str, uri: str, out: Path):
    from ray import tune

    trainable = tune.with_parameters(train_trial, sweep=spec, parent_run_id=parent, tracking_uri=uri,
                                     sweep_dir=str(out), root=str(Path.cwd()))
    r = spec.resources
    # one rank: the loop runs in the trial; more: the trial only drives Ray Train, whose ranks reserve their own
    # CPUs (Tune refuses a trial of no resources: a token of memory, which leaves every CPU to the ranks).
    # Trials reuse the actors of ended ones (reuse_actors below): a new process and its imports cost more than
    # the few epochs ASHA lets a bad trial run.
    trainable = tune.with_resources(trainable, {"cpu": r.cpus, "gpu": r.gpus} if r.workers == 1 else {"memory": 1})
    progress = TrialLines(spec, parent, uri, out)
    run_config = tune.RunConfig(name=TUNE_DIR, storage_path=str(out), verbose=0, callbacks=[progress])
    if tune.Tuner.can_restore(str(out / TUNE_DIR)):
        print(f"[sweep] resuming {out / TUNE_DIR}: finished trials are kept, the others go on", flush=True)
        return tune.Tuner.restore(str(out / TUNE_DIR), trainable, resume_unfinished=True, resume_errored=True)
    scheduler = None
    if spec.scheduler.name == "asha":
        from ray.tune.schedulers import ASHAScheduler

        scheduler = ASHAScheduler(time_attr="epoch", max_t=_max_epochs(spec),
                                  grace_period=spec.scheduler.grace_period,
                                  reduction_factor=spec.scheduler.reduction_factor)
    from ray.tune.search import BasicVariantGenerator

    return tune.Tuner(trainable, param_space=search_space(spec), run_config=run_config,
                      tune_config=tune.TuneConfig(metric=spec.metric, mode=spec.best_mode, scheduler=scheduler,
                                                  num_samples=spec.num_samples, reuse_actors=True,
                                                  search_alg=BasicVariantGenerator(
                                                      random_state=spec.seed, max_concurrent=spec.max_concurrent or 0)))


def _max_epochs(spec: Sweep) -> int:
    """The longest a trial can run, in epochs (``<stage>.epochs`` may be in the space)."""
    key = f"{spec.stage}.epochs"
    if key in spec.space:
        return int(max(candidates(key, spec.space[key])))
    return getattr(trial_params(spec, {}, "."), spec.stage).epochs


class TrialLines(Callback):
    """Tune callback on the driver: a line per trial as it ends (its values, best metric, epochs run) and the
    best so far; each trial's MLflow run closed with how it ended (a trial Tune stopped cannot close its own)."""

    def __init__(self, spec: Sweep, parent: str, uri: str, out: Path):
        self.spec, self.parent, self.uri, self.logs = spec, parent, uri, out / "logs"

    def on_trial_complete(self, iteration, trials, trial, **info) -> None:
        self._ended(trial, trials, failed=False)

    def on_trial_error(self, iteration, trials, trial, **info) -> None:
        self._ended(trial, trials, failed=True)

    def _ended(self, trial, trials, failed: bool) -> None:
        from mlflow.tracking import MlflowClient

        spec = self.spec
        epochs = int((trial.last_result or {}).get("epoch", 0))
        planned = getattr(trial_params(spec, trial.config, "."), spec.stage).epochs
        values = ", ".join(f"{k}={_short(v)}" for k, v in trial.config.items())
        client = MlflowClient(self.uri)
        child = find_child(client, self.parent, trial.trial_id)
        if failed:
            state = f"failed (its output: {self.logs / trial.trial_id}.log)"
            if child is not None and child.info.status == "RUNNING":
                client.set_terminated(child.info.run_id, "FAILED")
        else:
            state = FINISHED if epochs >= planned else STOPPED
            if child is not None and STATUS_TAG not in child.data.tags:
                end_trial(client, child.info.run_id, state)
        ended = [t for t in trials if t is trial or t.status in ("TERMINATED", "ERROR")]  # a resumed sweep's too
        scored = [(v, t.trial_id) for t in ended if (v := best_value(t, spec)) is not None]
        value = best_value(trial, spec)
        got = f"best {spec.metric} {value:.4f}" if value is not None else f"no {spec.metric}"
        lead = "no best yet"
        if scored:
            top = (max if spec.best_mode == "max" else min)(scored)
            lead = f"best so far: {top[1]} {spec.metric} {top[0]:.4f}"
        print(f"[sweep] trial {trial.trial_id} {state} after {epochs}/{planned} epochs ({values}): {got}; "
              f"{lead} [{len(ended)} of {spec.total_trials} ended]", flush=True)


def best_value(trial, spec: Sweep) -> float | None:
    """The trial's best ``metric`` over its epochs."""
    stats = (trial.metric_analysis or {}).get(spec.metric)
    return stats[spec.best_mode] if stats else None


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _parent_run(uri: str, params: Params, spec: Sweep, out: Path) -> str:
    """The sweep's MLflow run (the one it began, when it resumes): its settings as params, the trials under it."""
    import mlflow
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import check_artifact_location, git_info

    client = MlflowClient(uri)
    recorded = out / PARENT_FILE
    if recorded.exists():
        run_id = recorded.read_text().strip()
        client.update_run(run_id, status="RUNNING")
        return run_id
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.set_experiment(params.mlflow.experiment)
    check_artifact_location(uri, experiment)
    run = client.create_run(experiment.experiment_id, run_name=f"sweep {spec.name}",
                            tags={"kind": "sweep", "stage": spec.stage, "sweep.file": spec.path, **git_info()})
    settings = {k: str(v) for k, v in sweep_settings(spec).items()}
    client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in settings.items()])
    atomic_write_text(recorded, run.info.run_id + "\n")
    return run.info.run_id


def _finish(spec: Sweep, grid, parent: str, uri: str, out: Path, seconds: float) -> dict:
    """The best trial's overrides into best.yaml, the dvc line, and both onto the parent run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    best = grid.get_best_result(spec.metric, spec.best_mode, scope="all") if grid.num_terminated else None
    if best is None or spec.metric not in (best.metrics or {}):
        raise ValueError(f"sweep {spec.path}: no trial reported {spec.metric} (their output: {out / 'logs'})")
    value = float(best.metrics_dataframe[spec.metric].agg(spec.best_mode))
    overrides = spec.best_overrides(best.config)
    best_yaml = out / BEST_FILE
    atomic_write_text(best_yaml, yaml.safe_dump(_nested(overrides), sort_keys=False))
    line = dvc_line(overrides, spec.params_path)
    trial_id = best.metrics["trial_id"]
    client.log_metric(parent, f"best_{spec.metric}", value)
    client.log_metric(parent, "duration_s", seconds)
    for key, text in {"best.trial_id": trial_id, "best.dvc_exp_run": line,
                      **{f"best.{k}": str(v) for k, v in overrides.items()}}.items():
        client.set_tag(parent, key, text)
    client.log_artifact(parent, str(best_yaml))
    client.set_terminated(parent, "FINISHED")
    print(f"[sweep] best: trial {trial_id}, {spec.metric} {value:.4f} -> {best_yaml}", flush=True)
    print(f"[sweep] reproduce it: {line}", flush=True)
    return overrides


def _nested(flat: dict) -> dict:
    """``{"pretrain.lr": x}`` -> ``{"pretrain": {"lr": x}}``: best.yaml is a recipe (a partial params.yaml)."""
    out: dict = {}
    for key, value in flat.items():
        apply_override(out, key, value)
    return out


def dvc_line(overrides: dict, params_path: str) -> str:
    """The `dvc exp run` that runs the pipeline with ``overrides`` (in ``vit-pipeline recipe``'s grammar)."""
    present = set(flatten(read_partial_params(params_path)))
    sets = " ".join(f"-S {shlex.quote(f'{override_key(k, present)}={override_value(v)}')}"
                    for k, v in overrides.items())
    return f"dvc exp run {sets}"


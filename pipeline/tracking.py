"""MLflow plumbing shared by the stages.

The driver (the stage process) owns the run: it creates it, tags it and ends it. Ray workers only
log metrics into it by run id (:class:`RunLogger`), so a restarted worker never creates a second
run. All runs of one pipeline invocation (same code + same params.yaml + DVC experiment name) hang under
one parent run, the pipeline run (:mod:`pipeline.pipeline_run`): each stage's results, wall time and
datasets land on it as the stage ends.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, Iterator

from pipeline import environment, pipeline_run
from pipeline.config import DEFAULT_TRACKING_URI, ConfigError, Params, flatten, params_file, tracking_uri
from pipeline.signals import StageInterrupted, held_signals
from pipeline.storage import file_hash
from pipeline.utils import METRICS, PLOTS, error_summary


class TrackingUnreachable(ConfigError):
    """The configured MLflow server does not answer."""


SQLITE = "sqlite:///"  # + a path: MLflow's sqlite store


def resolve_tracking_uri(uri: str) -> str:
    """Make a relative ``sqlite:///file.db`` absolute so Ray workers (other cwd) hit the same file."""
    if uri.startswith(SQLITE) and not uri.startswith(SQLITE + "/"):
        # A queued `dvc exp run` runs in a temp copy; DVC_ROOT is the repository it belongs to.
        root = Path(os.environ.get("DVC_ROOT") or ".")
        return SQLITE + str((root / uri[len(SQLITE):]).resolve())
    return uri


def configured_uri() -> str:
    """The store this process logs to (:func:`pipeline.config.tracking_uri`), a relative sqlite path made
    absolute."""
    return resolve_tracking_uri(tracking_uri())


class TrackingStoreDamaged(ValueError):
    """The sqlite tracking store exists but is not a readable database."""


def check_tracking_uri(uri: str, timeout: float = 3.0) -> None:
    """Fail fast (before Ray starts) when an HTTP tracking server is not reachable, a sqlite store
    is damaged (SQLAlchemy's own error is a page of traceback that does not name the file), or MLflow
    refuses the URI (a scheme it does not know; its file store, which MLflow 3 turns down by default)."""
    if uri.startswith(SQLITE):
        return _check_sqlite(Path(uri[len(SQLITE):]))
    if uri.startswith("sqlite:"):  # SQLAlchemy's "Invalid SQLite URL" came as a page of traceback
        raise ConfigError(f"MLFLOW_TRACKING_URI={uri}: a sqlite store is {SQLITE}<path>, three slashes before a "
                          f"relative path ({DEFAULT_TRACKING_URI}), four before an absolute one")
    if not uri.startswith(("http://", "https://")):
        return _check_other_store(uri)
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout).read()
        # /health skips the server's Host-header guard; the API calls the stage makes do not
        urllib.request.urlopen(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1",
                               timeout=timeout).read()
    except urllib.error.HTTPError as exc:
        body = exc.read(200).decode(errors="replace")
        if "Invalid Host header" in body:
            host = urllib.parse.urlsplit(uri).netloc
            raise ConfigError(f"MLFLOW_TRACKING_URI={uri}: the server refuses the name {host!r} (Invalid Host "
                              f"header); start it with MLFLOW_ALLOWED_HOSTS listing {host} (infra/mlflow-server.sh)")
        if exc.code in (401, 403):  # an auth proxy in front of the server: MLflow's client signs in
            return
        raise TrackingUnreachable(f"MLFLOW_TRACKING_URI={uri} answers HTTP {exc.code} ({exc.reason}) at "
                                  f"{urllib.parse.urlsplit(exc.url).path}: not an MLflow tracking server, or one "
                                  "that is down behind its proxy") from None
    except (urllib.error.URLError, OSError) as exc:
        raise TrackingUnreachable(
            f"MLFLOW_TRACKING_URI={uri} is not reachable ({exc}). Start a local server with "
            f"`bash infra/mlflow-server.sh` (or `mlflow server --host 127.0.0.1 --port 5000`), "
            f"or unset MLFLOW_TRACKING_URI to log to {DEFAULT_TRACKING_URI}") from None


def check_artifact_location(uri: str, experiment) -> None:
    """An experiment created through an MLflow server keeps its artifacts behind it (``mlflow-artifacts:``):
    a stage logging to the same store file without the server failed at its first artifact in a page of
    traceback. Stop before the work, saying what to use."""
    if experiment.artifact_location.startswith("mlflow-artifacts:") and not uri.startswith(("http://", "https://")):
        raise ConfigError(f"mlflow.experiment {experiment.name!r} in {uri} was created through an MLflow server "
                          f"(its artifacts are at {experiment.artifact_location}, behind the server): set "
                          f"MLFLOW_TRACKING_URI to that server's http:// address, or another mlflow.experiment")


def _check_other_store(uri: str) -> None:
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        MlflowClient(uri)  # opens the tracking and model-registry stores the URI names
    except Exception as exc:  # noqa: BLE001 - also ImportError (a database driver not installed), SQLAlchemy's
        why = exc.message.strip() if isinstance(exc, MlflowException) else error_summary(exc)
        raise ConfigError(f"MLFLOW_TRACKING_URI={uri}: MLflow cannot use it ({why}); use "
                          f"{DEFAULT_TRACKING_URI} (the default) or an http(s):// tracking server") from None


def _check_sqlite(path: Path) -> None:
    import sqlite3

    if not path.is_file():
        return  # MLflow creates it
    try:
        with closing(sqlite3.connect(f"file:{urllib.request.pathname2url(str(path))}?mode=ro", uri=True)) as db:
            problems = [row[0] for row in db.execute("PRAGMA quick_check")]
    except sqlite3.OperationalError:
        return  # locked by a writer, not readable by this user, ...: not damage; MLflow reports it
    except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
        problems = [str(exc)]
    if problems != ["ok"]:
        raise TrackingStoreDamaged(
            f"{path}: the MLflow store is damaged ({problems[0]}); move it aside and run again (a new store "
            f"starts empty; `sqlite3 {path.name} .recover` can save its runs), or set MLFLOW_TRACKING_URI")


GIT_ENV = {"git.commit": "VIT_GIT_COMMIT", "git.dirty": "VIT_GIT_DIRTY"}  # a cluster job's: infra/submit.sh sets them
# Not "dirty": what the pipeline itself rewrites in git (DVC's lock, the metrics and plots it keeps in git),
# and params.yaml, which every run logs in full (each `dvc exp run -S` edits it: every experiment was dirty).
NOT_CODE = tuple(f":(top,exclude){p}" for p in ("dvc.lock", METRICS, PLOTS, "params.yaml"))


def git_info(cwd: str | os.PathLike = ".") -> dict[str, str]:
    """The commit and whether the code differs from it (params.yaml and the stages' own outputs aside). Without a
    git checkout (a cluster job's uploaded code has no .git) the submitter's, from ``GIT_ENV``."""
    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
            return out.stdout.strip() if out.returncode == 0 else ""
        except (OSError, subprocess.TimeoutExpired):
            return ""

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {"git.commit": os.environ.get(GIT_ENV["git.commit"]) or "unknown",
                "git.dirty": os.environ.get(GIT_ENV["git.dirty"]) or "false"}
    dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", ":/", *NOT_CODE))
    return {"git.commit": commit, "git.dirty": str(dirty).lower()}


def pipeline_id(params_path: str | os.PathLike | None = None) -> str:
    """Same commit + same params file → same id: the stages of one `dvc repro` share it. The file is the
    one the stages read (``$VIT_PARAMS`` or params.yaml): cluster jobs with different params are
    different pipeline runs."""
    params_path = params_path or params_file()
    commit = git_info(Path(params_path).parent)["git.commit"]
    key = f"{commit}:{file_hash(params_path)}"
    if os.environ.get(pipeline_run.EXP_NAME_ENV):  # each DVC experiment is its own pipeline run
        key += ":" + os.environ[pipeline_run.EXP_NAME_ENV]
    return hashlib.sha256(key.encode()).hexdigest()[:12]


@contextmanager
def stage_run(stage: str, params: Params, *, extra_params: dict[str, Any] | None = None,
              tags: dict[str, str] | None = None, resume_key: str | None = None,
              system_metrics: bool = False, params_path: str | None = None) -> Iterator[Any]:
    """Create the stage's MLflow run under the pipeline's parent run; yields the active run.

    ``resume_key`` (the Ray run name) makes a re-launched training run that did not finish log into the
    MLflow run it started before instead of opening a second one. The run ends FAILED if the stage raises.
    """
    import mlflow
    from mlflow.tracking import MlflowClient
    from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

    uri = configured_uri()
    check_tracking_uri(uri)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.set_experiment(params.mlflow.experiment)
    check_artifact_location(uri, experiment)
    client = MlflowClient(uri)
    pipeline_run.mark_training_experiment(client, experiment)
    base_tags = {**git_info(), "dvc.lock": file_hash("dvc.lock")}
    listing = environment.packages()
    pid = pipeline_id(params_path)
    start_ms = pipeline_run.process_start_ms()
    all_tags = {**base_tags, **environment.describe(listing=listing), **(tags or {}), "stage": stage, "kind": "stage",
                "pipeline.id": pid, **pipeline_run.experiment_name_tag()}  # a stage run is found by its experiment too
    run_name = all_tags.pop("run_name", stage)
    if resume_key:
        all_tags["ray.run_name"] = resume_key
    status, run_id, parent = "FAILED", None, None
    try:
        with held_signals() as pending:  # a stop between the two runs' starts would leave the parent RUNNING
            parent = pipeline_run.find_or_create(client, experiment.experiment_id, pid, params,
                                                 {**base_tags, **pipeline_run.experiment_name_tag()}, start_ms)
            ctx, resumed = _start_stage_run(client, experiment.experiment_id, run_name, all_tags, parent,
                                            resume_key, system_metrics)
        with ctx as run:
            run_id = run.info.run_id
            try:
                if pending:
                    raise StageInterrupted(pending[-1])
                if resumed:  # under this `dvc repro`'s pipeline run: start_run moves no existing run
                    mlflow.set_tags({**all_tags, MLFLOW_PARENT_RUN_ID: parent})
                mlflow.log_params(stage_params(stage, params, extra_params))
                mlflow.log_text(listing, environment.ARTIFACT)
                pipeline_run.log_datasets(client, [run_id, parent], stage)
                yield run
            except KeyboardInterrupt:  # Ctrl-C or SIGTERM (pipeline.signals), also while the run is set up:
                status = "KILLED"      # stopped, not failed
                mlflow.end_run("KILLED")
                raise
            status = "FINISHED"
    finally:  # after the stage's run has ended: the pipeline run ends with (or after) it
        if parent is not None:
            _finish_parent(client, experiment.experiment_id, parent, pid, stage, run_id, start_ms, status)


def _start_stage_run(client, experiment_id: str, run_name: str, tags: dict[str, str], parent: str,
                     resume_key: str | None, system_metrics: bool):
    """The stage's active MLflow run, and whether it is one a re-launch resumes: the newest run of the same
    Ray run (``resume_key``) that did not finish. One that finished belongs to its own pipeline run and stays
    there; a new run names it (``ray.previous_mlflow_run``: a re-run that trains nothing has its curves).
    A new run starts under ``parent``, the pipeline run of this `dvc repro`."""
    import mlflow

    if resume_key:
        found = client.search_runs([experiment_id], f"tags.`ray.run_name` = '{resume_key}'", max_results=1,
                                   order_by=["attributes.start_time DESC"])
        if found and found[0].info.status != "FINISHED":
            return mlflow.start_run(run_id=found[0].info.run_id, log_system_metrics=system_metrics), True
        if found:
            tags = {**tags, pipeline_run.PREVIOUS_RUN_TAG: pipeline_run.trainer_of(found[0])}
    return mlflow.start_run(run_name=run_name, tags=tags, parent_run_id=parent,
                            log_system_metrics=system_metrics), False


def _finish_parent(client, experiment_id: str, parent: str, pid: str, stage: str, run_id: str | None,
                   start_ms: int, status: str) -> None:
    """The stage's results and wall time onto the pipeline run; never turns a stage's outcome around."""
    try:
        if status != "KILLED":  # a failed stage's pipeline run still shows the stages DVC reused before it
            pipeline_run.backfill_skipped(client, experiment_id, parent, pid, stage, failed=status == "FAILED")
        pipeline_run.stage_finished(client, parent, stage, run_id, start_ms, status)
        if status == "FINISHED":
            print(f"[{stage}] MLflow runs: {pipeline_run.ui_link(client.tracking_uri, experiment_id)}", flush=True)
    except Exception as exc:  # noqa: BLE001 - tracking trouble must not fail a finished stage
        import sys

        print(f"[{stage}] warning: could not update the pipeline run {parent}: {exc}", file=sys.stderr, flush=True)


def stage_params(stage: str, params: Params, extra_params: dict[str, Any] | None = None) -> dict[str, str]:
    """The params a stage's MLflow run logs: the model section, the stage's own section, the data section
    of the shards it reads and ``extra_params``."""
    reads = pipeline_run.stage_data(stage)
    data = pipeline_run.data_params(params, reads[0]) if reads else {}
    logged = {**flatten(params.model, "model"), **flatten(getattr(params, stage, {}), stage), **data,
              **(extra_params or {})}
    return {k: pipeline_run.param_value(v) for k, v in logged.items()}


class RunLogger:
    """Logs metrics and tags into an existing run by id: rank 0 of a training run, while it trains.

    Writes go through MLflow's asynchronous logging, so the loop never waits on the tracking store
    (a write to a local SQLite store took ~10 ms here, about as long as a whole train step of the
    CIFAR-10 recipe on an H200); :meth:`close` waits for them all and raises what failed.
    """

    def __init__(self, tracking_uri: str, run_id: str):
        from mlflow.tracking import MlflowClient

        self.client, self.run_id = MlflowClient(tracking_uri), run_id
        self._pending: list = []  # MLflow's RunOperations, one per write
        self._logged = self._last_steps()

    def _last_steps(self) -> dict[str, int]:
        """The last step of each metric the run already has: a resumed launch replays the steps after its
        checkpoint, which an earlier launch logged (the same values, resume being exact), so they are not
        logged twice (as W&B drops a resumed run's earlier steps). The driver's system metrics aside."""
        from mlflow.exceptions import MlflowException

        try:
            keys = [k for k in self.client.get_run(self.run_id).data.metrics if not k.startswith("system/")]
            return {k: max(m.step for m in self.client.get_metric_history(self.run_id, k)) for k in keys}
        except MlflowException:  # a run that cannot be read: its writes fail too, and close() raises that
            return {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        new = {k: v for k, v in metrics.items() if step > self._logged.get(k, -1)}
        if new:
            self._log([Metric(k, float(v), now, step) for k, v in new.items()], [])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self._log([], [RunTag(k, v) for k, v in tags.items()])

    def _log(self, metrics: list, tags: list) -> None:
        self._pending.append(self.client.log_batch(self.run_id, metrics=metrics, tags=tags, synchronous=False))

    def close(self, *, check: bool = True) -> None:
        """Wait until every write is in the store; with ``check``, raise if any failed."""
        pending, self._pending = self._pending, []
        for operations in pending:
            try:
                operations.wait()
            except Exception:
                if check:
                    raise

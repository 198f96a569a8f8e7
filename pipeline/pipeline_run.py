"""The pipeline (parent) MLflow run: what one `dvc repro` / `dvc exp run` is, and what it produced.

One parent run per pipeline invocation (same commit + params.yaml + DVC experiment name). It carries
every params.yaml value (flattened, ``model.patch_size``, ``finetune.interpolation.mode``, ...) plus
``world_size``; tags for the DVC experiment name, the git commit and the dvc.lock hash; the shards as
MLflow dataset inputs; and, as each stage finishes, that stage's results and wall time. Its start is
the first stage's start and its end moves to the end of each stage that finishes, so the run spans the
pipeline. Stages DVC skipped (unchanged, e.g. pretrain under a fine-tune sweep, or export when only
evaluate changed) are filled in from their ``metrics/<stage>.json`` and the run that produced their
output, whether DVC skipped them before or after the stage that ran.
"""
from __future__ import annotations

import functools
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

from pipeline import storage
from pipeline.config import TRAINING_STAGES, Params, flatten
from pipeline.utils import MODELS, PRETRAINED, SHARDS, metrics_path, trained_by

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's "model training" experiment type (not GenAI)
EXP_NAME_ENV = "DVC_EXP_NAME"  # set by DVC for `dvc exp run` (also for queued experiments)
# On a re-run of a finished training run (it trains nothing, publishes the same weights): the run that trained.
PREVIOUS_RUN_TAG = "ray.previous_mlflow_run"
DVC_YAML = Path(__file__).resolve().parents[1] / "dvc.yaml"


@functools.cache
def _dvc_stages() -> dict[str, dict]:
    """dvc.yaml's stages that log a run, in its order (the shard stage, a ``foreach``, logs none)."""
    import yaml

    stages = yaml.safe_load(DVC_YAML.read_text())["stages"]
    return {name: stage for name, stage in stages.items() if "foreach" not in stage}


def stage_names() -> tuple[str, ...]:
    return tuple(_dvc_stages())


def downstream(stage: str) -> set[str]:
    """The stages that read ``stage``'s model, directly or through another (dvc.yaml's deps): their files
    are older than a model trained since."""
    readers = {s for s, spec in _dvc_stages().items() if str(MODELS / stage) in spec["deps"]}
    return readers.union(*(downstream(s) for s in readers))


def stage_data(stage: str) -> tuple[str, list[str]] | None:
    """The shards ``stage`` reads (its ``data/shards/<name>`` dep), as (dataset, [splits]): a training stage
    reads train and val, the others test. A split's context is its MLflow input context."""
    deps = _dvc_stages().get(stage, {}).get("deps", [])
    names = [d.split("/")[-1] for d in deps if str(Path(d).parent) == str(SHARDS)]
    return (names[0], ["train", "val"] if stage in TRAINING_STAGES else ["test"]) if names else None


_IMPORTED_MS = int(time.time() * 1000)


def now_ms() -> int:
    return int(time.time() * 1000)


def process_start_ms() -> int:
    """When this stage's process started (a stage's wall time includes imports and Ray's start)."""
    try:
        import psutil  # comes with Ray

        return int(psutil.Process().create_time() * 1000)
    except Exception:  # noqa: BLE001
        return _IMPORTED_MS


def experiment_name_tag() -> dict[str, str]:
    name = os.environ.get(EXP_NAME_ENV)
    return {"dvc.exp_name": name} if name else {}


def mark_training_experiment(client, experiment) -> None:
    """Open the experiment on its training runs (MLflow 3 otherwise may show the GenAI overview)."""
    if experiment.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
        client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)


def ui_link(tracking_uri: str, experiment_id: str) -> str:
    """Where to look at the experiment's runs. MLflow 3.17's UI takes its GenAI or model-training view
    from ``?workflowType=`` or its own switch, not from :data:`EXPERIMENT_KIND_TAG`, so the link says."""
    page = f"/#/experiments/{experiment_id}?workflowType=machine_learning"
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/") + page
    return f"mlflow ui --backend-store-uri {tracking_uri}, then http://127.0.0.1:5000{page}"


def pipeline_params(params: Params) -> dict[str, str]:
    """Every params.yaml value, flattened, plus what is derived from them (world size, patch sizes); not the
    ``mlflow`` section (where the runs go, not what they are), and of ``data.<name>`` what its source reads."""
    flat = {k: v for k, v in flatten(params).items() if not k.startswith(("mlflow.", "data."))}
    for name in TRAINING_STAGES:
        flat.update(data_params(params, name))
    flat.update({"world_size": params.ray.world_size, "finetune.effective_patch_size": params.finetune_patch_size,
                 "finetune.init": finetune_init(params)})
    return {k: param_value(v) for k, v in flat.items()}


def data_params(params: Params, name: str) -> dict[str, Any]:
    """``data.<name>.*``, the keys its source reads (``DataConfig.in_use``)."""
    return flatten(getattr(params.data, name).in_use(), f"data.{name}")


def finetune_init(params: Params) -> str:
    """What the fine-tune starts from, as the pipeline run and the fine-tune's own run log it."""
    return params.finetune.init or str(PRETRAINED)


MAX_PARAM_CHARS = 6000  # MLflow's MAX_PARAM_VAL_LENGTH, named here without importing MLflow (the GPU benchmarks)


def param_value(v: Any) -> str:
    """A value as an MLflow param: lists and dicts as JSON, cut to what MLflow stores."""
    s = json.dumps(v) if isinstance(v, (list, dict)) else str(v)
    return s[:MAX_PARAM_CHARS]


def trainer_of(run) -> str:
    """The MLflow run that trained ``run``'s weights: itself, or the one a re-run of a finished run names."""
    return run.data.tags.get(PREVIOUS_RUN_TAG) or run.info.run_id


def find_or_create(client, experiment_id: str, pid: str, params: Params, tags: dict[str, str],
                   start_ms: int) -> str:
    """The parent run of pipeline ``pid``; a new one starts now, with the pipeline's params and tags."""
    found = client.search_runs([experiment_id], f"tags.`pipeline.id` = '{pid}' and tags.kind = 'pipeline'",
                               max_results=1)
    if found:
        run_id = found[0].info.run_id
        client.update_run(run_id, status="RUNNING")
        for k, v in tags.items():
            client.set_tag(run_id, k, v)
        return run_id
    exp_name = tags.get("dvc.exp_name")
    run = client.create_run(experiment_id, start_time=start_ms, run_name=exp_name or f"pipeline-{pid}",
                            tags={**tags, "kind": "pipeline", "pipeline.id": pid})
    run_id = run.info.run_id
    from mlflow.entities import Param

    client.log_batch(run_id, params=[Param(k, v) for k, v in sorted(pipeline_params(params).items())])
    return run_id


# --------------------------------------------------------------------------- datasets


def shard_datasets(stage: str) -> list[tuple[Any, str]]:
    """``[(mlflow Dataset, context), ...]`` for the shards ``stage`` reads (empty if none are there)."""
    reads = stage_data(stage)
    if reads is None:
        return []
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    from pipeline.data import read_dataset_info

    name, splits = reads
    shard_dir = storage.shard_dir(name)
    try:
        info = read_dataset_info(shard_dir)
    except (FileNotFoundError, OSError, ValueError):
        return []
    manifest = storage.manifest_digest(shard_dir)
    location = str(shard_dir) if storage.is_url(shard_dir) else str(Path(shard_dir).resolve())
    with warnings.catch_warnings():  # "can be interpreted in multiple ways": local paths are local
        warnings.simplefilter("ignore")
        source = resolve_dataset_source(location)

    class ShardDataset(MetaDataset):
        """Metadata of one split of a shard directory: the tars stay where they are."""

        def __init__(self, split: str):
            self._split = split
            super().__init__(source, name=f"{name}-{info.get('source', 'shards')}-{split}",
                             digest=f"{manifest[:10]}-{split}")

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(self.profile)}

        @property
        def profile(self) -> dict:
            counts = info.get("counts", {})
            return {"split": self._split, "num_samples": counts.get(self._split),
                    "num_classes": len(info.get("classes", [])), "counts_per_split": counts,
                    "dataset": name, "source": info.get("source"), "manifest_sha256_16": manifest}

    return [(ShardDataset(split), split) for split in splits]


def dataset_inputs(stage: str) -> list:
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    return [DatasetInput(ds._to_mlflow_entity(), tags=[InputTag(MLFLOW_DATASET_CONTEXT, ctx)])
            for ds, ctx in shard_datasets(stage)]


def log_datasets(client, run_ids: list[str], stage: str) -> None:
    """The stage's shards as inputs of its run and of the pipeline run (a warning if that fails); inputs a
    run already has are left out (a reused stage's shards are often a running stage's too)."""
    try:
        inputs = dataset_inputs(stage)
        for run_id in run_ids if inputs else ():
            have = {_input_key(i) for i in client.get_run(run_id).inputs.dataset_inputs}
            new = [i for i in inputs if _input_key(i) not in have]
            if new:
                client.log_inputs(run_id, datasets=new)
    except Exception as exc:  # noqa: BLE001 - an unreadable manifest must not stop the training
        import sys

        print(f"[{stage}] warning: could not log the datasets to MLflow: {exc}", file=sys.stderr, flush=True)


def _input_key(dataset_input) -> tuple:
    ds = dataset_input.dataset
    return ds.name, ds.digest, tuple((t.key, t.value) for t in dataset_input.tags)


# --------------------------------------------------------------------------- results


# The pipeline run's tag naming the registered version its export stage made (``models:/name/version``).
REGISTERED_MODEL_TAG = "registered_model"
TEST_METRICS = ("top1", "top5", "loss", "ece", "top1_single_view")  # of metrics/evaluate.json, as test_<name>;
# top1_single_view with evaluate.tta only


def _read_metrics(stage: str) -> dict:
    try:
        m = json.loads(metrics_path(stage).read_text())
    except (OSError, ValueError):
        return {}
    return m if isinstance(m, dict) else {}


def stage_results(stage: str) -> dict[str, float]:
    """The numbers of ``metrics/<stage>.json`` worth comparing across pipelines, keyed for the parent."""
    return result_metrics(stage, _read_metrics(stage))


def result_metrics(stage: str, m: dict) -> dict[str, float]:
    """A stage's results (its metrics file's content) under the names both its own MLflow run and the
    pipeline run log them: ``test_top1``, ``macro_f1``, ``top1_at_32px``, ``export.onnx.max_abs_diff``, …"""
    out: dict[str, float] = {}
    if stage in TRAINING_STAGES:  # every number: time to accuracy (time_to_top1_90_s, ...) compared across runs
        for k, v in m.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[f"{stage}.{k}"] = float(v)
    elif stage == "evaluate":
        for k in (*TEST_METRICS, "num_samples"):
            if isinstance(m.get(k), (int, float)):
                out[f"test_{k}"] = float(m[k])
        for k in ("macro_f1", "macro_precision", "macro_recall"):
            if isinstance(m.get(k), (int, float)):
                out[k] = float(m[k])
        for res, v in (m.get("resolution_sweep") or {}).items():
            out[f"top1_at_{res}px"] = float(v)
    elif stage == "export":
        if "passed" in m:
            out["export.passed"] = float(bool(m["passed"]))
        for fmt, r in (m.get("formats") or {}).items():
            for k in ("max_abs_diff", "top1_agreement"):
                if isinstance(r.get(k), (int, float)):
                    out[f"export.{fmt}.{k}"] = float(r[k])
    return out


def failed_results(stage: str, run) -> dict[str, float]:
    """What a failed export still tells (its run logged each format's parity numbers, then failed; no
    metrics file): ``export.passed`` 0 and the numbers."""
    if stage != "export" or run is None:
        return {}
    return {**{k: float(v) for k, v in run.data.metrics.items() if k.startswith("export.")}, "export.passed": 0.0}


def _result_keys(stage: str, keys) -> set[str]:
    """Which of the pipeline run's metric names ``stage`` logs (as :func:`stage_results` keys them)."""
    prefixes = ("test_", "macro_", "top1_at_") if stage == "evaluate" else (f"{stage}.",)
    return {k for k in keys if k.startswith(prefixes) and k != f"{stage}.wall_s"}


def log_results(client, parent: str, metrics: dict[str, float]) -> None:
    from mlflow.entities import Metric

    t = now_ms()
    client.log_batch(parent, metrics=[Metric(k, v, t, 0) for k, v in metrics.items()])


def _producing_run(client, stage: str):
    """For a skipped stage: the MLflow run that made its output -- a training stage's id is in
    models/<stage>/config.json, export's is the source run of the version metrics/export.json names."""
    try:
        if stage == "export":
            version = _read_metrics("export")["registered_model"]
            run_id = client.get_model_version(version["name"], str(version["version"])).run_id
        else:
            run_id = trained_by(MODELS / stage)
        return client.get_run(run_id) if run_id else None
    except Exception:  # noqa: BLE001 - another store, a deleted run: the metrics file still counts
        return None


def _wall_s(client, run, stage: str) -> float:
    """The stage's wall time as its own pipeline run recorded it (its process), else its run's duration."""
    try:
        value = client.get_run(run.data.tags["mlflow.parentRunId"]).data.metrics.get(f"{stage}.wall_s")
    except Exception:  # noqa: BLE001
        value = None
    return value if value is not None else (run.info.end_time - run.info.start_time) / 1000


def _tag_device(client, parent: str, stage: str, run) -> None:
    """``<stage>.device`` on the pipeline run: what the stage computed on (its run's ``env.device``)."""
    device = run.data.tags.get("env.device")
    if device:
        client.set_tag(parent, f"{stage}.device", device)


def backfill_skipped(client, experiment_id: str, parent: str, pid: str, finished: str, failed: bool = False) -> None:
    """Every other stage that has not run under this pipeline -- DVC found it up to date, or it is still to
    run -- gets its results, producing run and shards from its outputs, tagged reused; a stage that does
    run later replaces them (:func:`stage_finished`). With no metrics file there is nothing to fill in.
    Not a stage that reads the model of one that trained under it (``dvc repro pretrain`` left the
    fine-tune's files from the model before), nor, after a failed stage, those after it: they will not run."""
    runs = client.search_runs([experiment_id], f"tags.`pipeline.id` = '{pid}' and tags.kind = 'stage'",
                              max_results=100)
    ran = {finished} | {r.data.tags.get("stage") for r in runs}
    # a re-run of a finished training run published the same model again
    trained = {r.data.tags.get("stage") for r in runs if trainer_of(r) == r.info.run_id}
    stale = {s for r in trained for s in downstream(r)}
    stages = stage_names()
    stages = stages[:stages.index(finished)] if failed and finished in stages else stages
    for stage in stages:
        results = {} if stage in ran or stage in stale else stage_results(stage)
        if not results:
            continue
        producer = _producing_run(client, stage)
        if producer is not None and producer.info.end_time:
            results[f"{stage}.wall_s"] = _wall_s(client, producer, stage)
            client.set_tag(parent, f"{stage}.run_id", producer.info.run_id)
            _tag_device(client, parent, stage, producer)
            if stage == "export":  # the version it registered is in this store
                version = _read_metrics("export")["registered_model"]
                client.set_tag(parent, REGISTERED_MODEL_TAG, f"models:/{version['name']}/{version['version']}")
        log_results(client, parent, results)
        client.set_tag(parent, f"{stage}.reused", "true")
        log_datasets(client, [parent], stage)


def stage_finished(client, parent: str, stage: str, run_id: str | None, start_ms: int, status: str) -> None:
    """Onto the parent: the stage's wall time and (if it succeeded) results, or a failed export's (passed 0,
    its parity numbers); the parent ends now. What was filled in for it before it ran (reused) goes: its
    other numbers become NaN, a failed export's version."""
    end = now_ms()
    metrics = {f"{stage}.wall_s": (end - start_ms) / 1000}
    run = client.get_run(run_id) if run_id else None
    if status == "FINISHED":
        metrics.update(stage_results(stage))
    elif status == "FAILED":
        metrics.update(failed_results(stage, run))
    previous = client.get_run(parent).data
    if previous.tags.get(f"{stage}.reused") == "true":
        metrics.update(dict.fromkeys(_result_keys(stage, previous.metrics) - metrics.keys(), float("nan")))
        if stage == "export" and status != "FINISHED" and REGISTERED_MODEL_TAG in previous.tags:
            client.delete_tag(parent, REGISTERED_MODEL_TAG)
    log_results(client, parent, metrics)
    if run is not None:
        client.set_tag(parent, f"{stage}.run_id", run_id)
        _tag_device(client, parent, stage, run)
    client.set_tag(parent, f"{stage}.reused", "false")
    client.set_tag(parent, f"{stage}.status", status)
    client.set_terminated(parent, status, end_time=end)

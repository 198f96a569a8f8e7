"""The model registry: what a registered version is (where it came from, how it tested), and its export.

MLflow's registry shows a version with only its source run (here the export stage's run). Whoever picks
a version to deploy wants more at a glance, and wants to search on it: the pipeline run to compare it on,
the DVC experiment, the commit, the data, the fine-tune run that trained it and its test top-1. The export
stage writes these as the version's tags and description, and the version's URI onto the pipeline run,
so each leads to the other. ``vit-pipeline predict --model models:/<name>@<alias>`` fetches the export
files that the version's run logged.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline import pipeline_run, storage
from pipeline.model.io import ModelFileError

# A stage run's tag naming the fine-tune run that trained the model it used (models/finetune/config.json).
MODEL_RUN_TAG = "finetune.run_id"
MODEL_URI = "models:/"  # a registered version: models:/<name>/<version> or models:/<name>@<alias>
EXPORT_ARTIFACTS = "exports"  # where the export stage logs exports/ in its run (pipeline/exporter.py)
_FIND = "list the versions with `MlflowClient().search_model_versions()`, or set MLFLOW_TRACKING_URI"


def model_run_tag(meta: dict[str, Any]) -> dict[str, str]:
    """For the run of a stage that uses a trained model: the tag naming the run that trained it."""
    return {MODEL_RUN_TAG: meta["mlflow_run_id"]} if meta.get("mlflow_run_id") else {}


def evaluation_of(client, experiment_id: str, model_run_id: str) -> dict[str, float]:
    """Test metrics of the newest finished evaluate run of the model that ``model_run_id`` trained."""
    if not model_run_id:
        return {}
    found = client.search_runs([experiment_id], f"tags.stage = 'evaluate' and tags.`{MODEL_RUN_TAG}` = "
                               f"'{model_run_id}' and attributes.status = 'FINISHED'",
                               order_by=["attributes.end_time DESC"], max_results=1)
    metrics = found[0].data.metrics if found else {}
    return {name: metrics[name] for name in (f"test_{k}" for k in pipeline_run.TEST_METRICS) if name in metrics}


def _dataset_tag(name: str) -> str:
    """``<dataset>-<source>@<manifest digest>``, the digest of the MLflow dataset inputs (pipeline_run)."""
    from pipeline.data import read_dataset_info

    shard_dir = storage.shard_dir(name)
    source = read_dataset_info(shard_dir).get("source", "shards")
    return f"{name}-{source}@{storage.manifest_digest(shard_dir)[:10]}"


def trained_on(client, model_run_id: str) -> str | None:
    """What the run that trained the model computed on (its ``env.device``), when that run is in this store."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(model_run_id).data.tags.get("env.device") if model_run_id else None
    except MlflowException:  # another store's run, or a deleted one
        return None


def version_tags(run, meta: dict[str, Any], test: dict[str, float], device: str | None = None) -> dict[str, str]:
    """The tags of the version that the export stage's ``run`` registered from a model with ``meta``,
    trained on ``device``."""
    tags = run.data.tags  # in the order the registry's version list shows them: what tells versions apart first
    out = {k: f"{v:.4f}" for k, v in test.items()}
    out.update(pipeline_run.experiment_name_tag())
    out["data.finetune"] = _dataset_tag("finetune")
    out["image_size"], out["patch_size"] = str(meta["image_size"]), str(meta["model"]["patch_size"][0])
    if device:
        out["trained_on"] = device
    out.update({k: tags[k] for k in ("git.commit", "git.dirty") if k in tags})
    out["pipeline.run_id"] = tags["mlflow.parentRunId"]
    out.update(model_run_tag(meta))
    return out


def describe(tags: dict[str, str], pipeline_name: str) -> str:
    """One paragraph for the registry page: which pipeline run, experiment and commit, and how it tested."""
    commit = tags.get("git.commit", "unknown")[:10]
    commit += " (uncommitted changes)" if tags.get("git.dirty") == "true" else ""
    exp = f", DVC experiment {tags['dvc.exp_name']}" if "dvc.exp_name" in tags else ""
    test = (f"test top-1 {float(tags['test_top1']):.2%} on {tags['data.finetune']}" if "test_top1" in tags
            else "not evaluated when registered (the pipeline run has the test metrics once evaluate ends)")
    if "test_top1_single_view" in tags:  # evaluate.tta
        test += f" (test-time views averaged; the image alone {float(tags['test_top1_single_view']):.2%})"
    device = f", trained on {tags['trained_on']}" if "trained_on" in tags else ""
    return (f"Pipeline run {pipeline_name} ({tags['pipeline.run_id']}){exp}, commit {commit}; "
            f"{tags['image_size']} px, patch {tags['patch_size']}{device}; {test}.")


def record_version(client, run, name: str, version: int, meta: dict[str, Any]) -> dict[str, str]:
    """Tag and describe version ``version`` of ``name``, and name it on the pipeline run; returns the tags."""
    test = evaluation_of(client, run.info.experiment_id, meta.get("mlflow_run_id", ""))
    tags = version_tags(run, meta, test, trained_on(client, meta.get("mlflow_run_id", "")))
    for k, v in tags.items():
        client.set_model_version_tag(name, str(version), k, v)
    parent = client.get_run(tags["pipeline.run_id"])
    client.update_model_version(name, str(version), description=describe(tags, parent.info.run_name))
    client.set_tag(tags["pipeline.run_id"], pipeline_run.REGISTERED_MODEL_TAG, f"models:/{name}/{version}")
    return tags


def download_export(uri: str, files: list[str], dst: Path) -> tuple[Path, Any]:
    """``files`` of the export directory behind registered version ``uri``, fetched from its source run into
    ``dst``; returns their folder and the ModelVersion. Any problem is a :class:`ModelFileError` naming the
    URI."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from pipeline.tracking import SQLITE, check_tracking_uri, configured_uri

    tracking_uri = configured_uri()
    name, alias, version = _parse_model_uri(uri)
    try:
        if tracking_uri.startswith(SQLITE) and not Path(tracking_uri[len(SQLITE):]).is_file():
            raise FileNotFoundError("there is no such store (MLflow would make an empty one)")
        check_tracking_uri(tracking_uri)
        client = MlflowClient(tracking_uri)
        found = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
        folder = _download(client, found, files, dst)
    except (MlflowException, OSError, ValueError) as exc:
        why = exc.message if isinstance(exc, MlflowException) else str(exc)
        raise ModelFileError(f"{uri}: cannot fetch its export from the MLflow store {tracking_uri} "
                             f"({why.strip().splitlines()[0][:300]}); {_FIND}") from None
    return folder, found


def _download(client, version, files: list[str], dst: Path) -> Path:
    """The version's run's ``exports/<file>`` artifacts into ``dst/exports``; a missing one is named."""
    listed = {a.path for a in client.list_artifacts(version.run_id, EXPORT_ARTIFACTS)}
    folder = dst / EXPORT_ARTIFACTS
    folder.mkdir(parents=True, exist_ok=True)
    for f in files:
        if f"{EXPORT_ARTIFACTS}/{f}" not in listed:
            raise ValueError(f"version {version.version}'s run {version.run_id} has no {EXPORT_ARTIFACTS}/{f} "
                             f"artifact: the export stage logs exports/ beside the model it registers")
        client.download_artifacts(version.run_id, f"{EXPORT_ARTIFACTS}/{f}", str(folder))
    return folder


def _parse_model_uri(uri: str) -> tuple[str, str, str]:
    """``models:/name@alias`` -> (name, alias, ""); ``models:/name/3`` -> (name, "", "3")."""
    rest = uri[len(MODEL_URI):]
    name, at, alias = rest.partition("@")
    if not at:
        name, _, version = rest.rpartition("/")
        if name and version.isdigit():
            return name, "", version
    elif name and alias:
        return name, alias, ""
    raise ModelFileError(f"{uri}: not a registered model version; want models:/<name>/<version> or "
                         f"models:/<name>@<alias>")

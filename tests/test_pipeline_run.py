"""The pipeline (parent) MLflow run, fast: the stages' own tracking code (``stage_run``) against a real
sqlite store in a temp directory, with real digits shards and the metrics files a stage writes."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from pipeline.config import load_params
from pipeline.pipeline_run import result_metrics
from pipeline.tracking import stage_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def workdir(tmp_path, monkeypatch, digits_dir):
    for var in ("MLFLOW_TRACKING_URI", "VIT_SHARDS_URL", "DVC_EXP_NAME", "DVC_ROOT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(digits_dir, tmp_path / "data/shards/finetune")
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "metrics").mkdir()
    return tmp_path


def _client_and_parent(workdir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    exp = client.get_experiment_by_name("vit-pipeline")
    parents = client.search_runs([exp.experiment_id], "tags.kind = 'pipeline'")
    return client, exp, parents


def _stage(name: str, params, metrics: dict | None = None, fail: bool = False) -> str:
    with stage_run(name, params) as run:
        if metrics is not None:
            (Path("metrics") / f"{name}.json").write_text(json.dumps(metrics))
        if fail:
            raise RuntimeError("boom")
    return run.info.run_id


@pytest.mark.slow
def test_parent_carries_results_datasets_and_spans_the_stages(workdir, monkeypatch, capsys):
    monkeypatch.setenv("DVC_EXP_NAME", "interp-bilinear")
    params = load_params("params.yaml", {"finetune.interpolation.mode": "bilinear"})
    # finetune "did not run" (DVC found it up to date): its metrics file is there from before
    (workdir / "metrics/finetune.json").write_text(json.dumps({"val_top1": 0.75, "kept_epoch": 3}))
    ev = _stage("evaluate", params, {"top1": 0.5, "top5": 0.9, "loss": 1.2, "ece": 0.05, "macro_f1": 0.45,
                                     "resolution_sweep": {"24": 0.25, "32": 0.5}})
    ex = _stage("export", params, {"passed": True, "formats": {"onnx": {"max_abs_diff": 1e-6,
                                                                           "top1_agreement": 1.0}}})
    client, exp, parents = _client_and_parent(workdir)
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    link = (f"[export] MLflow runs: mlflow ui --backend-store-uri sqlite:///{workdir}/mlflow.db, then "
            f"http://127.0.0.1:5000/#/experiments/{exp.experiment_id}?workflowType=machine_learning")
    assert link in capsys.readouterr().out.splitlines()  # the UI's model-training view (docs/experiments.md)
    (parent,) = parents
    assert parent.info.run_name == "interp-bilinear" and parent.data.tags["dvc.exp_name"] == "interp-bilinear"
    assert client.get_run(ev).data.tags["dvc.exp_name"] == "interp-bilinear"  # stage runs too, to search them by it
    assert parent.info.status == "FINISHED"
    p, m, t = parent.data.params, parent.data.metrics, parent.data.tags
    assert p["finetune.interpolation.mode"] == "bilinear" and p["model.preset"] == "nano"
    assert p["world_size"] == "2" and p["finetune.init"] == "models/pretrain" and "mlflow.experiment" not in p
    # the generator's keys for the fractals source only, not for digits, which has fixed images
    assert p["data.pretrain.samples_per_class"] == "60" and "data.finetune.samples_per_class" not in p
    assert p["data.finetune.source"] == "digits" and "data.finetune.seed" in p
    assert m["test_top1"] == 0.5 and m["test_ece"] == 0.05 and m["top1_at_24px"] == 0.25 and m["export.passed"] == 1.0
    assert m["export.onnx.max_abs_diff"] == 1e-6 and m["macro_f1"] == 0.45
    assert m["finetune.val_top1"] == 0.75 and t["finetune.reused"] == "true"  # filled in from its output
    assert "pretrain.val_top1" not in m  # no metrics/pretrain.json: nothing made up
    children = [client.get_run(i) for i in (ev, ex)]
    assert t["evaluate.run_id"] == ev and t["export.status"] == "FINISHED"
    assert parent.info.start_time <= min(c.info.start_time for c in children)
    assert parent.info.end_time >= max(c.info.end_time for c in children)
    for c in children:
        assert c.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert m[f"{c.data.tags['stage']}.wall_s"] >= (c.info.end_time - c.info.start_time) / 1000 - 0.01
    splits = {ds.tags[0].value: ds for ds in parent.inputs.dataset_inputs}  # each once
    assert len(splits) == len(parent.inputs.dataset_inputs) and sorted(splits) == ["test", "train", "val"]
    ds = splits["test"]  # evaluate and export both read it; train and val are the reused finetune's
    info = json.loads((workdir / "data/shards/finetune/dataset.json").read_text())
    profile = json.loads(ds.dataset.profile)
    assert ds.dataset.name == "finetune-digits-test" and ds.tags[0].value == "test"
    assert json.loads(ds.dataset.source)["uri"] == str(workdir / "data/shards/finetune")
    assert profile["num_samples"] == info["counts"]["test"] and profile["counts_per_split"] == info["counts"]


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "800000 100000\n"}, 8.0),                     # cgroup v2, a limit
    ({"cpu.max": "max 100000\n"}, None),                       # v2, none
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({}, None),                                                 # neither: not a container we can read
])
def test_cpu_quota_reads_either_cgroup_layout_and_is_named_where_it_is_lower(tmp_path, monkeypatch, files, quota):
    """A container can show every core to ``sched_getaffinity`` and still allow fewer CPUs of time; the
    benchmark's worker table and the ``env.device`` tag then say so."""
    import os

    from pipeline import environment

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(environment, "CGROUP_CPU_LIMITS", (tmp_path / "cpu.max", tmp_path / "cpu/cpu.cfs_quota_us"))
    assert environment.cpu_quota() == quota
    cores = len(os.sched_getaffinity(0))
    named = quota is not None and quota < cores
    assert ("cgroup quota" in environment.cpu_name()) == named
    if named:
        assert f"a cgroup quota of {quota:g} CPUs" in environment.cpu_name()
    assert f"({cores} cores" in environment.cpu_name()


def test_every_stage_run_records_what_it_computed_on(workdir):
    """``env.*`` tags (device, torch build, Python, host, package digest), the package list as an
    artifact whose digest is the tag, and ``<stage>.device`` on the pipeline run."""
    from pipeline import environment

    run_id = _stage("evaluate", load_params("params.yaml"), {"top1": 0.5})
    client, _, (parent,) = _client_and_parent(workdir)
    tags = client.get_run(run_id).data.tags
    here = environment.describe()
    assert {k: tags[k] for k in here} == here
    assert here["env.device"].endswith(("AVX-512)", "cores)")) and "(CUDA " in here["env.torch"]
    listing = Path(client.download_artifacts(run_id, environment.ARTIFACT, str(workdir))).read_text()
    assert environment.packages_digest(listing) == tags["env.packages"]
    import torch
    assert f"torch=={torch.__version__.split('+')[0]}" in listing.splitlines() and "mlflow==" in listing
    assert parent.data.tags["evaluate.device"] == here["env.device"]


@pytest.mark.slow
def test_a_failed_stage_fails_the_pipeline_run_and_a_rerun_resumes_it(workdir, capsys):
    params = load_params("params.yaml")
    with pytest.raises(RuntimeError):
        _stage("export", params, fail=True)
    assert "MLflow runs:" not in capsys.readouterr().out
    _, _, (parent,) = _client_and_parent(workdir)
    assert parent.info.status == "FAILED" and parent.data.tags["export.status"] == "FAILED"
    assert "dvc.exp_name" not in parent.data.tags and parent.info.run_name.startswith("pipeline-")
    _stage("export", params, {"passed": True, "formats": {}})  # same commit + params: the same pipeline
    _, _, (again,) = _client_and_parent(workdir)
    assert again.info.run_id == parent.info.run_id and again.info.status == "FINISHED"
    assert again.info.end_time > parent.info.end_time and again.data.metrics["export.passed"] == 1.0


def test_relative_sqlite_store_follows_dvc_root(tmp_path, monkeypatch):
    """A queued experiment runs in a temp copy; its runs belong in the repository's store."""
    from pipeline.tracking import resolve_tracking_uri

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    assert resolve_tracking_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("DVC_ROOT", "/srv/repo")
    assert resolve_tracking_uri("sqlite:///mlflow.db") == "sqlite:////srv/repo/mlflow.db"
    assert resolve_tracking_uri("sqlite:////abs/x.db") == "sqlite:////abs/x.db"


def test_ui_link_opens_the_model_training_view():
    from pipeline.pipeline_run import ui_link

    assert ui_link("http://mlflow.internal:5000/", "7") == (
        "http://mlflow.internal:5000/#/experiments/7?workflowType=machine_learning")


def _register(client, run, name: str = "vit-pipeline") -> int:
    """A version of ``name`` from ``run``, as `mlflow.pytorch.log_model(registered_model_name=...)` makes one."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException:  # already there
        pass
    return int(client.create_model_version(name, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id).version)


@pytest.mark.slow
def test_registered_version_names_its_pipeline_run_and_how_it_tested(workdir, monkeypatch):
    """The export stage's version carries the pipeline run, DVC experiment, data, the run that trained the
    model and the test metrics of that model's evaluation (not another model's); the pipeline run names
    the version. A model never evaluated says so."""
    import hashlib

    import mlflow

    from pipeline.registry import model_run_tag, record_version

    monkeypatch.setenv("DVC_EXP_NAME", "p8-r48")
    params = load_params("params.yaml")
    with stage_run("finetune", params) as trained:
        pass
    meta = {"mlflow_run_id": trained.info.run_id, "image_size": 48, "model": {"patch_size": [8, 8]}}
    for model_tags, top1 in ((model_run_tag(meta), 0.875), ({"finetune.run_id": "another-model"}, 0.25)):
        with stage_run("evaluate", params, tags=model_tags):
            mlflow.log_metrics(result_metrics("evaluate", {"top1": top1, "top5": 1.0, "loss": 0.5, "ece": 0.0625}))
    client, _, (parent,) = _client_and_parent(workdir)
    with stage_run("export", params, tags=model_run_tag(meta)) as run:
        version = _register(client, run)
        tags = record_version(client, run, "vit-pipeline", version, meta)
    got = client.get_model_version("vit-pipeline", str(version))
    manifest = hashlib.sha256((workdir / "data/shards/finetune/manifest.parquet").read_bytes()).hexdigest()[:10]
    assert got.tags == tags
    assert {k: tags[k] for k in ("pipeline.run_id", "dvc.exp_name", "finetune.run_id", "data.finetune",
                                 "image_size", "patch_size", "test_top1", "test_top5", "test_ece")} == {
        "pipeline.run_id": parent.info.run_id, "dvc.exp_name": "p8-r48", "finetune.run_id": trained.info.run_id,
        "data.finetune": f"finetune-digits@{manifest}", "image_size": "48", "patch_size": "8",
        "test_top1": "0.8750", "test_top5": "1.0000", "test_ece": "0.0625"}
    device = trained.data.tags["env.device"]  # the fine-tune run's, which trained the weights
    assert tags["trained_on"] == device
    assert got.description == (f"Pipeline run p8-r48 ({parent.info.run_id}), DVC experiment p8-r48, commit unknown; "
                               f"48 px, patch 8, trained on {device}; test top-1 87.50% on finetune-digits@{manifest}.")
    assert client.get_run(parent.info.run_id).data.tags["registered_model"] == f"models:/vit-pipeline/{version}"
    (found,) = client.search_model_versions("tags.`dvc.exp_name` = 'p8-r48'")  # docs/export.md's search
    assert found.version == got.version

    with stage_run("evaluate", params, tags=model_run_tag(meta)):  # evaluated again, now with evaluate.tta
        mlflow.log_metrics(result_metrics("evaluate", {"top1": 0.9, "top5": 1.0, "loss": 0.4, "ece": 0.05,
                                                       "top1_single_view": 0.875}))
    with stage_run("export", params, tags=model_run_tag(meta)) as run:
        version = _register(client, run)
        tags = record_version(client, run, "vit-pipeline", version, meta)
    assert (tags["test_top1"], tags["test_top1_single_view"]) == ("0.9000", "0.8750")
    assert client.get_model_version("vit-pipeline", str(version)).description.endswith(
        f"test top-1 90.00% on finetune-digits@{manifest} (test-time views averaged; the image alone 87.50%).")

    meta["mlflow_run_id"] = "never-evaluated"
    with stage_run("export", params, tags=model_run_tag(meta)) as run:
        version = _register(client, run)
        tags = record_version(client, run, "vit-pipeline", version, meta)
    assert "test_top1" not in tags and tags["finetune.run_id"] == "never-evaluated" and "trained_on" not in tags
    assert client.get_model_version("vit-pipeline", str(version)).description.endswith(
        "not evaluated when registered (the pipeline run has the test metrics once evaluate ends).")


@pytest.mark.slow
def test_a_registered_version_that_cannot_be_fetched_is_one_error(workdir, tmp_path, monkeypatch):
    """predict's --model models:/...: a version without exports/ artifacts, an alias or model that is not
    there, a URI that names no version: a ModelFileError naming the URI (predict: one line, exit 2)."""
    from pipeline.model.io import ModelFileError
    from pipeline.registry import download_export

    params = load_params("params.yaml")
    with stage_run("export", params) as run:
        pass
    client, _, _ = _client_and_parent(workdir)
    _register(client, run)
    store = f"sqlite:///{workdir}/mlflow.db"
    for uri, why in (("models:/vit-pipeline/1", "has no exports/config.json artifact"),  # not by the export stage
                     ("models:/vit-pipeline@champion", "alias champion not found"),
                     ("models:/other/2", "(name=other, version=2) not found")):
        with pytest.raises(ModelFileError) as err:
            download_export(uri, ["config.json"], tmp_path)
        assert str(err.value).startswith(f"{uri}: cannot fetch its export from the MLflow store {store} (")
        assert why in str(err.value) and "\n" not in str(err.value)
    missing = tmp_path / "elsewhere.db"  # a store that is not there: said, not made
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{missing}")
    with pytest.raises(ModelFileError, match=f"store sqlite:///{missing} \\(there is no such store"):
        download_export("models:/vit-pipeline/1", ["config.json"], tmp_path)
    assert not missing.exists()
    for bad in ("models:/vit-pipeline", "models:/vit-pipeline@", "models:/x/latest"):
        with pytest.raises(ModelFileError, match="want models:/<name>/<version> or models:/<name>@<alias>"):
            download_export(bad, ["config.json"], tmp_path)


@pytest.mark.slow
def test_stages_given_other_params_by_vit_params_are_other_pipeline_runs(workdir, monkeypatch):
    """``$VIT_PARAMS`` (a cluster job's params, infra/job.sh) names the file the stages read; the pipeline
    run is that file's, not ./params.yaml's: two jobs with different params are two pipeline runs, each
    with its own params."""
    from pipeline.config import load_params
    from pipeline.tracking import pipeline_id

    for name, opset in (("a", 17), ("b", 19)):
        text = (ROOT / "params.yaml").read_text().replace("opset: 18", f"opset: {opset}")
        (workdir / f"params.{name}.yaml").write_text(text)
    ids = {}
    for name in ("a", "b"):
        monkeypatch.setenv("VIT_PARAMS", str(workdir / f"params.{name}.yaml"))
        ids[name] = pipeline_id()
        _stage("export", load_params(workdir / f"params.{name}.yaml"))
    monkeypatch.delenv("VIT_PARAMS")
    assert len({ids["a"], ids["b"], pipeline_id()}) == 3
    client, _, parents = _client_and_parent(workdir)
    assert sorted(p.data.params["export.opset"] for p in parents) == ["17", "19"]
    assert sorted(p.data.tags["pipeline.id"] for p in parents) == sorted(ids.values())


EXPORT_OK = {"passed": True, "formats": {"onnx": {"max_abs_diff": 1e-6, "top1_agreement": 1.0}}}


@pytest.mark.slow
def test_stages_dvc_skips_after_the_one_that_runs_are_filled_in_with_their_shards(workdir, monkeypatch):
    """`dvc exp run -S evaluate.tta=hflip`: only evaluate runs; finetune (before it) and export (after it)
    keep their outputs, so the pipeline run takes their numbers, producing runs, registered version and
    shards from there. pretrain has no metrics file: left out."""
    monkeypatch.setenv("DVC_EXP_NAME", "before")
    with stage_run("export", load_params("params.yaml")) as old_export:  # the pipeline that made them
        client, _, _ = _client_and_parent(workdir)
        version = _register(client, old_export)
    (workdir / "metrics/export.json").write_text(json.dumps(
        {**EXPORT_OK, "registered_model": {"name": "vit-pipeline", "version": version,
                                           "uri": f"models:/vit-pipeline/{version}"}}))
    (workdir / "metrics/finetune.json").write_text(json.dumps({"val_top1": 0.75}))
    shutil.copytree(workdir / "data/shards/finetune", workdir / "data/shards/pretrain")
    monkeypatch.setenv("DVC_EXP_NAME", "tta-hflip")
    _stage("evaluate", load_params("params.yaml", {"evaluate.tta": "hflip"}), {"top1": 0.5})
    client, _, parents = _client_and_parent(workdir)
    (before,) = [p for p in parents if p.info.run_name == "before"]
    (parent,) = [p for p in parents if p.info.run_name == "tta-hflip"]
    m, t = parent.data.metrics, parent.data.tags
    assert m["test_top1"] == 0.5 and t["evaluate.reused"] == "false"
    assert m["export.passed"] == 1.0 and m["export.onnx.max_abs_diff"] == 1e-6 and t["export.reused"] == "true"
    assert m["export.wall_s"] == before.data.metrics["export.wall_s"]  # as its own pipeline run has it
    assert t["export.run_id"] == old_export.info.run_id and t["registered_model"] == f"models:/vit-pipeline/{version}"
    assert m["finetune.val_top1"] == 0.75 and t["finetune.reused"] == "true"
    assert not any(k.startswith("pretrain.") for k in [*m, *t])
    inputs = sorted((i.dataset.name, i.tags[0].value) for i in parent.inputs.dataset_inputs)
    assert inputs == [("finetune-digits-test", "test"), ("finetune-digits-train", "train"),
                      ("finetune-digits-val", "val")]  # finetune's reused shards, evaluate's and export's once


def test_the_stage_graph_is_read_from_dvc_yaml():
    """The stages that log runs, which read a stage's model (directly or through another) and which shards
    each reads, all come from dvc.yaml."""
    from pipeline.pipeline_run import downstream, stage_data, stage_names

    assert stage_names() == ("pretrain", "finetune", "evaluate", "export")
    assert {s: downstream(s) for s in stage_names()} == {
        "pretrain": {"finetune", "evaluate", "export"}, "finetune": {"evaluate", "export"},
        "evaluate": set(), "export": set()}
    assert {s: stage_data(s) for s in stage_names()} == {
        "pretrain": ("pretrain", ["train", "val"]), "finetune": ("finetune", ["train", "val"]),
        "evaluate": ("finetune", ["test"]), "export": ("finetune", ["test"])}


def test_stages_reading_a_model_trained_since_are_not_filled_in(workdir):
    """`dvc repro pretrain` (or a full repro while it is under way): evaluate's and export's files are
    those of the model before, so the pipeline run shows none of their numbers (it showed them as this
    pipeline's); finetune, which reads pretrain's model, neither."""
    (workdir / "metrics/finetune.json").write_text(json.dumps({"val_top1": 0.75}))
    (workdir / "metrics/evaluate.json").write_text(json.dumps({"top1": 0.25}))
    (workdir / "metrics/export.json").write_text(json.dumps(EXPORT_OK))
    _stage("pretrain", load_params("params.yaml"), {"val_top1": 0.5})
    _, _, (parent,) = _client_and_parent(workdir)
    m, t = parent.data.metrics, parent.data.tags
    assert m["pretrain.val_top1"] == 0.5
    assert not any(k.startswith(("finetune.", "test_", "export.")) for k in m if not k.endswith(".wall_s")), m
    assert not any(t.get(f"{s}.reused") == "true" for s in ("finetune", "evaluate", "export")), t


def test_a_model_published_again_keeps_the_stages_after_it(workdir, monkeypatch):
    """A re-run of a finished training run trains nothing and publishes the same model again (its run is
    tagged ray.previous_mlflow_run): DVC re-runs nothing after it, so the pipeline run takes their numbers
    from their files, where a stage that trained leaves them out."""
    params = load_params("params.yaml")
    (workdir / "metrics/evaluate.json").write_text(json.dumps({"top1": 0.25}))
    for exp in ("first", "again"):
        monkeypatch.setenv("DVC_EXP_NAME", exp)
        with stage_run("pretrain", params, resume_key="pretrain-0123abcd"):
            (workdir / "metrics/pretrain.json").write_text(json.dumps({"val_top1": 0.5}))
    _, _, parents = _client_and_parent(workdir)
    by_name = {p.info.run_name: p for p in parents}
    assert "test_top1" not in by_name["first"].data.metrics
    assert by_name["again"].data.metrics["test_top1"] == 0.25 and by_name["again"].data.tags["evaluate.reused"] == "true"


@pytest.mark.slow
def test_a_stage_filled_in_before_it_runs_keeps_nothing_of_that(workdir, monkeypatch):
    """Only evaluate and export run (their params changed), in either order: the one still to run is
    filled in from its previous outputs when the other ends; when it then runs, its own results replace
    those, and numbers it no longer logs (another resolution, a failed export's parity, its registered
    version) do not stay: a failed export is export.passed 0."""
    (workdir / "metrics/evaluate.json").write_text(json.dumps({"top1": 0.25, "resolution_sweep": {"24": 0.2}}))
    (workdir / "metrics/export.json").write_text(json.dumps(EXPORT_OK))
    monkeypatch.setenv("DVC_EXP_NAME", "export-first")
    _stage("export", load_params("params.yaml", {"export.opset": 19}), EXPORT_OK)
    _, _, (parent,) = _client_and_parent(workdir)
    assert parent.data.metrics["test_top1"] == 0.25 and parent.data.tags["evaluate.reused"] == "true"
    _stage("evaluate", load_params("params.yaml", {"export.opset": 19}), {"top1": 0.5, "resolution_sweep": {"32": 0.5}})
    _, _, (parent,) = _client_and_parent(workdir)
    m, t = parent.data.metrics, parent.data.tags
    assert m["test_top1"] == 0.5 and m["top1_at_32px"] == 0.5 and t["evaluate.reused"] == "false"
    assert m["top1_at_24px"] != m["top1_at_24px"] and m["export.passed"] == 1.0  # NaN

    monkeypatch.setenv("DVC_EXP_NAME", "evaluate-first")
    params = load_params("params.yaml", {"export.opset": 17})
    _stage("evaluate", params, {"top1": 0.5})
    client, _, parents = _client_and_parent(workdir)
    (parent,) = [p for p in parents if p.info.run_name == "evaluate-first"]
    assert parent.data.metrics["export.passed"] == 1.0 and parent.data.tags["export.reused"] == "true"
    client.set_tag(parent.info.run_id, "registered_model", "models:/vit-pipeline/1")  # as an earlier export's
    (workdir / "metrics/export.json").unlink()  # DVC removes a stage's outputs before it runs it
    with pytest.raises(RuntimeError):
        _stage("export", params, fail=True)
    _, _, parents = _client_and_parent(workdir)
    (parent,) = [p for p in parents if p.info.run_name == "evaluate-first"]
    m, t = parent.data.metrics, parent.data.tags
    assert m["export.passed"] == 0.0 and m["export.onnx.max_abs_diff"] != m["export.onnx.max_abs_diff"]  # NaN
    assert t["export.reused"] == "false" and t["export.status"] == "FAILED" and "registered_model" not in t


@pytest.mark.slow
def test_git_dirty_is_about_code_not_params_or_the_pipelines_own_outputs(workdir, monkeypatch):
    """``git.dirty`` stays false while the stages rewrite what they keep in git (metrics/, plots/,
    dvc.lock) and for a params.yaml edit (every `dvc exp run -S` makes one; the runs log the params in
    full), and turns true for an uncommitted code change; without a checkout (a cluster job's upload) the
    tags are the ones infra/submit.sh passes."""
    import subprocess

    from mlflow.tracking import MlflowClient

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=workdir, check=True,
                       capture_output=True)

    (workdir / "dvc.lock").write_text("schema: '2.0'\n")
    (workdir / "metrics/pretrain.json").write_text("{}")
    git("init", "-q")
    (workdir / "pipeline").mkdir()
    (workdir / "pipeline/code.py").write_text("x = 1\n")
    git("add", "params.yaml", "dvc.lock", "metrics", "pipeline")
    git("commit", "-qm", "pipeline")
    params = load_params("params.yaml")
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    first = _stage("pretrain", params, {"val_top1": 0.5})  # rewrites metrics/pretrain.json
    (workdir / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")  # as DVC does after a stage
    second = _stage("finetune", params, {"val_top1": 0.6})
    with open(workdir / "params.yaml", "a") as f:
        f.write("# an edit\n")
    third = _stage("evaluate", params, {"top1": 0.6})
    (workdir / "pipeline/code.py").write_text("x = 2\n")
    fourth = _stage("evaluate", params, {"top1": 0.6})
    assert [client.get_run(r).data.tags["git.dirty"] for r in (first, second, third, fourth)] == [
        "false", "false", "false", "true"]

    shutil.rmtree(workdir / ".git")
    monkeypatch.setenv("VIT_GIT_COMMIT", "0123abc")
    monkeypatch.setenv("VIT_GIT_DIRTY", "true")
    tags = client.get_run(_stage("export", params, {"passed": True})).data.tags
    assert (tags["git.commit"], tags["git.dirty"]) == ("0123abc", "true")


def test_a_stop_while_the_stage_run_is_set_up_is_killed_not_failed(workdir, monkeypatch):
    """Ctrl-C or SIGTERM (a KeyboardInterrupt, pipeline.signals) while the stage's run logs its params and
    datasets: the run and the pipeline run end KILLED, as a stop during the work does (it was FAILED)."""
    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("pipeline.pipeline_run.log_datasets", stopped)
    with pytest.raises(KeyboardInterrupt):
        _stage("evaluate", load_params("params.yaml"), {"top1": 0.5})
    client, exp, (parent,) = _client_and_parent(workdir)
    (run,) = client.search_runs([exp.experiment_id], "tags.stage = 'evaluate'")
    assert run.info.status == "KILLED" and client.get_run(parent.info.run_id).info.status == "KILLED"


def test_a_stop_while_the_pipeline_run_starts_ends_it_killed(workdir, monkeypatch, stage_signals):
    """SIGTERM while the pipeline run is being opened (before the stage's run exists) is held until the
    stage's run has started; then both end KILLED, instead of the pipeline run staying RUNNING."""
    import os
    import signal

    from pipeline import pipeline_run
    from pipeline.signals import StageInterrupted

    real = pipeline_run.find_or_create

    def signalled(*args, **kwargs):
        run_id = real(*args, **kwargs)  # the pipeline run exists, RUNNING; the stage's does not yet
        os.kill(os.getpid(), signal.SIGTERM)
        return run_id

    monkeypatch.setattr(pipeline_run, "find_or_create", signalled)
    with pytest.raises(StageInterrupted):
        _stage("evaluate", load_params("params.yaml"), {"top1": 0.5})
    client, exp, (parent,) = _client_and_parent(workdir)
    (run,) = client.search_runs([exp.experiment_id], "tags.stage = 'evaluate'")
    assert run.info.status == "KILLED" and client.get_run(parent.info.run_id).info.status == "KILLED"
    assert client.get_run(parent.info.run_id).data.tags["evaluate.status"] == "KILLED"


@pytest.mark.slow
def test_a_finished_training_run_stays_under_its_pipeline_and_an_unfinished_one_resumes(workdir, monkeypatch):
    """The MLflow run of a Ray run that finished belongs to its pipeline run: launched again under another
    pipeline (`dvc exp run -f`, a code change) the stage opens a new run naming it, instead of taking it
    (with its history) away from its pipeline; a run that did not finish is resumed wherever it is."""
    params = load_params("params.yaml")

    def launch(exp: str, fail: bool = False) -> str:
        monkeypatch.setenv("DVC_EXP_NAME", exp)
        try:
            with stage_run("pretrain", params, resume_key="pretrain-0123abcd") as run:
                if fail:
                    raise RuntimeError("boom")
        except RuntimeError:
            pass
        return run.info.run_id

    first = launch("base")
    second = launch("again")
    client, exp, parents = _client_and_parent(workdir)
    by_name = {p.info.run_name: p.info.run_id for p in parents}
    assert second != first
    assert client.get_run(first).data.tags["mlflow.parentRunId"] == by_name["base"]
    assert client.get_run(second).data.tags["mlflow.parentRunId"] == by_name["again"]
    assert client.get_run(second).data.tags["ray.previous_mlflow_run"] == first
    assert client.get_run(launch("thrice")).data.tags["ray.previous_mlflow_run"] == first  # the run that trained
    third = launch("failing", fail=True)
    assert launch("retry") == third != second  # the FAILED one resumes, moved to the pipeline that runs it
    assert client.get_run(third).info.status == "FINISHED"


def test_a_failed_pipeline_run_keeps_what_it_reused_and_a_failed_export_its_numbers(workdir):
    """A pipeline run whose export fails its parity check has `export.passed` 0 and each format's numbers
    (`export.passed` could only ever be 1) and the numbers of the stages DVC reused before it; a failed
    fine-tune does not take evaluate's older numbers as this pipeline's."""
    import mlflow

    params = load_params("params.yaml")
    (workdir / "metrics/finetune.json").write_text(json.dumps({"val_top1": 0.75}))
    (workdir / "metrics/evaluate.json").write_text(json.dumps({"top1": 0.5}))
    report = {"passed": False, "formats": {"onnx": {"max_abs_diff": 0.5, "top1_agreement": 0.9},
                                           "torchscript": {"max_abs_diff": 0.0}}}
    with pytest.raises(ValueError):
        with stage_run("export", params):
            mlflow.log_metrics(result_metrics("export", report))  # as the export stage logs them
            raise ValueError("export parity check failed")
    client, exp, (parent,) = _client_and_parent(workdir)
    run = client.get_run(parent.info.run_id)
    assert run.info.status == "FAILED" and run.data.tags["export.status"] == "FAILED"
    assert {k: v for k, v in run.data.metrics.items() if not k.endswith("wall_s")} == {
        "export.passed": 0.0, "export.onnx.max_abs_diff": 0.5, "export.onnx.top1_agreement": 0.9,
        "export.torchscript.max_abs_diff": 0.0, "finetune.val_top1": 0.75, "test_top1": 0.5}

    os.environ["DVC_EXP_NAME"] = "other"  # another pipeline run: the fine-tune fails there
    try:
        _stage("finetune", params, fail=True)
    except RuntimeError:
        pass
    finally:
        del os.environ["DVC_EXP_NAME"]
    (other,) = [p for p in _client_and_parent(workdir)[2] if p.info.run_name == "other"]
    assert "test_top1" not in client.get_run(other.info.run_id).data.metrics


def test_an_experiment_made_through_a_server_is_named_without_it(workdir):
    """infra/mlflow-server.sh serves the repository's store: an experiment it created keeps its artifacts
    behind the server, and a stage logging to the file directly failed at its first artifact with a page
    of traceback. Now a ConfigError (exit 2) before any run starts, naming what to set."""
    from mlflow.tracking import MlflowClient

    from pipeline.config import ConfigError

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    client.create_experiment("vit-pipeline", artifact_location="mlflow-artifacts:/1")
    with pytest.raises(ConfigError, match=r"^mlflow.experiment 'vit-pipeline' in sqlite:///.*mlflow.db was created "
                                          r"through an MLflow server .*set MLFLOW_TRACKING_URI to that server's"):
        _stage("evaluate", load_params("params.yaml"), {"top1": 0.5})
    assert client.search_runs([client.get_experiment_by_name("vit-pipeline").experiment_id]) == []

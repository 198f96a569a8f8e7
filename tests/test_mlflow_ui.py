"""MLflow's compare view, as a person sees it: two fine-tune runs logged through the pipeline's own
tracking code (``stage_run`` + the workers' ``RunLogger``) to a real server started by
infra/mlflow-server.sh, then a real headless Chromium (Playwright) opens the experiment, selects both
runs, presses Compare and finds the model size, patch size, resolution, interpolation and a metric.
Its metric values are made up (no training here); the README's picture of two real pipeline runs is
taken by tests/test_pipeline.py::test_compare_two_real_pipeline_runs_in_the_ui."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser import CHROMIUM, CHROMIUM_ARGS, compact_screenshot, ensure_chromium, param_row

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = "ui-compare"
# name, params.yaml overrides, (train_loss, val_top1) per epoch
RUNS = [
    ("finetune-nano-p4-32px-bicubic",
     {"model.preset": "nano", "finetune.patch_size": None, "finetune.image_size": 32,
      "finetune.interpolation.mode": "bicubic"},
     [(1.91, 0.612), (1.12, 0.834), (0.83, 0.917)]),
    ("finetune-micro-p8-48px-bilinear",
     {"model.preset": "micro", "finetune.patch_size": 8, "finetune.image_size": 48,
      "finetune.interpolation.mode": "bilinear"},
     [(2.05, 0.544), (1.37, 0.689), (1.02, 0.781)]),
]

pytestmark = pytest.mark.slow


def _log_runs(tracking_uri: str, workdir: Path) -> list[str]:
    """Two fine-tune runs exactly as the stage names its params: stage_run + run_params + RunLogger."""
    from pipeline.config import load_params
    from pipeline.model import build_vit
    from pipeline.tracking import RunLogger, stage_run
    from pipeline.train.stage import run_params

    ids = []
    for name, overrides, curve in RUNS:
        params = load_params(ROOT / "params.yaml", {**overrides, "mlflow.experiment": EXPERIMENT})
        params_path = workdir / f"params.{name}.yaml"  # a pipeline id per params file, as in dvc repro
        params_path.write_text(f"# {name}\n")
        ft = params.finetune
        model = build_vit(params.model.preset, patch_size=params.finetune_patch_size, image_size=ft.image_size,
                          num_classes=10, pool=params.model.pool, **params.model.overrides())
        info = {"source": "digits", "classes": [str(i) for i in range(10)]}
        # exactly what pipeline.train.stage.finetune logs
        extra = run_params("finetune", params, ft, model, info)
        with stage_run("finetune", params, extra_params=extra, tags={"run_name": name},
                       params_path=str(params_path)) as run:
            logger = RunLogger(tracking_uri, run.info.run_id)
            for epoch, (loss, top1) in enumerate(curve, 1):
                logger.log_metrics({"train_loss": loss, "val_top1": top1}, step=epoch * 19)
            logger.close()  # as the loop does before it returns: every write in the store
        ids.append(run.info.run_id)
    return ids


def test_compare_view_shows_params_and_metrics(mlflow_server, tmp_path, monkeypatch):
    ensure_chromium()
    screenshot = tmp_path / "mlflow-compare.png"
    from mlflow.tracking import MlflowClient
    from playwright.sync_api import sync_playwright

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    run_ids = _log_runs(mlflow_server.url, tmp_path)
    exp_id = MlflowClient(mlflow_server.url).get_experiment_by_name(EXPERIMENT).experiment_id

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 1400})
            page.set_default_timeout(30_000)
            page.goto(f"{mlflow_server.url}/#/experiments/{exp_id}/runs")
            # The stage runs hang under their pipeline parent runs: expand the parents.
            page.get_by_text("pipeline-").first.wait_for()
            if page.get_by_role("button", name="Close").count():  # the assistant side panel
                page.get_by_role("button", name="Close").first.click()
            parents = page.locator("[role=row]").filter(has_text="pipeline-")
            for i in range(parents.count()):
                row = parents.nth(i)
                expander = row.locator("button[data-component-id*=runnamecellrenderer]")
                (expander if expander.count() else row.get_by_role("button")).first.click()
            for name, _, _ in RUNS:
                page.get_by_text(name).first.wait_for()
                index = page.locator("[role=row]").filter(has_text=name).first.get_attribute("row-index")
                page.locator(f'[role=row][row-index="{index}"] input[type=checkbox]').first.check()
            page.get_by_role("button", name="Compare").click()

            page.get_by_text("Comparing 2 Runs").wait_for()
            assert all(rid in page.url for rid in run_ids), page.url
            for param, values in {"model_size": ("nano", "micro"), "patch_size": ("4", "8"),
                                  "image_size": ("32", "48"),
                                  "finetune.interpolation.mode": ("bicubic", "bilinear"),
                                  "world_size": ("2", "2")}.items():
                row = param_row(page, param)
                assert row.count() == 1, f"no row for param {param}"
                cells = [c.strip() for c in row.locator("td").all_inner_texts()]
                assert tuple(cells) == values, (param, cells)
            metric = page.get_by_role("link", name="val_top1")
            assert metric.count() >= 1, "metric val_top1 not in the compare view"
            for _, _, curve in RUNS:  # the last logged value of each run
                assert page.get_by_text(f"{curve[-1][1]:g}", exact=True).count() >= 1

            compact_screenshot(page, screenshot, hidden="world_size", kept="model_size")
        finally:
            browser.close()
    assert screenshot.stat().st_size > 20_000

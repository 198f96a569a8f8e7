"""`vit-pipeline sweep`: sweep files checked before Ray starts (fast, in-process), and real sweeps on a local
Ray with a real MLflow store (slow): ASHA stopping trials, the trials as child runs, best.yaml reproduced
by the stage, a grid sweep resumed after Ctrl-C."""
from __future__ import annotations

import csv
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError
from pipeline.sweep.sweep_file import load_sweep
from tests.conftest import ROOT, clean_env
from tests.repo_copy import run, set_params, sharded_short_run, short_run

EPOCHS = 3
ASHA_SWEEP = {"stage": "pretrain", "num_samples": 6, "max_concurrent": 2,
              "scheduler": {"name": "asha", "grace_period": 1, "reduction_factor": 2},
              "space": {"pretrain.lr": {"loguniform": [0.0001, 0.02]}, "pretrain.warmup_epochs": {"choice": [0, 1]}}}


def _sweep_repo(raw: dict) -> dict:
    raw = short_run(raw)
    raw["pretrain"].update(epochs=EPOCHS, checkpoint_every_steps=None)
    raw["ray"].update(backend="local")
    return raw


def _write(path: Path, body) -> Path:
    path.write_text(body if isinstance(body, str) else yaml.safe_dump(body, sort_keys=False))
    return path


# --- the sweep file, checked in-process before any Ray -------------------------------------------------

BAD = {
    "unknown_key": ("space:\n  pretrain.lrr: {choice: [0.1]}", "space: pretrain.lrr: unknown key"),
    "empty_space": ("space: {}", "space: is empty"),
    "metric": ("metric: accuracy\nspace:\n  pretrain.lr: {choice: [0.1]}",
               "metric: 'accuracy' is not a metric the pretrain stage reports"),
    "distribution": ("space:\n  pretrain.lr: {normal: [0, 1]}", "space: pretrain.lr: {'normal': [0, 1]} is not a range"),
    "range": ("space:\n  pretrain.lr: {loguniform: [0, 0.1]}", "loguniform: [0, 0.1] is not valid"),
    "value": ("space:\n  pretrain.lr: {choice: [0.1, -1]}", "space: pretrain.lr: -1.0 must be > 0"),
    "int_range": ("space:\n  pretrain.epochs: {uniform: [1, 4]}", "use choice or grid for an integer key"),
    "other_section": ("space:\n  ray.num_workers: {choice: [1]}", "space: ray.num_workers: not a key the pretrain"),
    "top_level": ("stages: pretrain\nspace:\n  pretrain.lr: {choice: [0.1]}", "stages: unknown key"),
    "workers": ("resources: {workers: 3}\nspace:\n  pretrain.lr: {choice: [0.1]}",
                "resources: pretrain.global_batch_size: 64 is not divisible by ray.num_workers=3"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sweep_file_is_one_line_and_exit_2(case, tmp_path, monkeypatch, capsys, stage_signals):
    import ray

    from pipeline.console import main

    body, expected = BAD[case]
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    stage = "" if body.startswith("stages:") else "stage: pretrain\n"
    _write(tmp_path / "s.yaml", stage + body + "\n")
    with pytest.raises(SystemExit) as exit_:
        main(["sweep", "s.yaml"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2
    assert err.splitlines() == [err] and err.startswith("error: s.yaml: ") and expected in err, err
    assert not ray.is_initialized() and not (tmp_path / "sweeps").exists()


def test_example_sweep_file_is_valid():
    sweep = load_sweep(str(ROOT / "configs/sweep-finetune.yaml"), str(ROOT / "params.yaml"))
    assert sweep.stage == "finetune" and sweep.scheduler.name == "asha" and sweep.space


def test_the_speed_benchmarks_sweeps_are_valid(tmp_path):
    """benchmarks/sweep_speed.py's two sweeps (ASHA and to the end) over its params, as `vit-pipeline sweep`
    checks them: the same trials, only the scheduler differs."""
    from benchmarks.sweep_speed import params_file, sweep_file

    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(params_file(4)))
    asha, none = (load_sweep(str(_write(tmp_path / f"{name}.yaml", sweep_file(16, name, 2, 1, 2))), str(params))
                  for name in ("asha", "none"))
    assert (asha.scheduler.name, none.scheduler.name) == ("asha", "none") and asha.space == none.space
    assert asha.stage == "pretrain" and asha.total_trials == none.total_trials == 16


def test_best_overrides_carry_the_world_size_the_trials_ran_with(tmp_path):
    """A trial of 1 rank is reproduced by a 1-rank stage run: params.yaml's 2 Ray ranks would compute another."""
    from pipeline.sweep.tuning import dvc_line

    params = shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    sweep = load_sweep(str(_write(tmp_path / "s.yaml", {"stage": "finetune", "space": {
        "finetune.interpolation.mode": {"grid": ["bilinear", "bicubic"]}, "finetune.lr": {"choice": [0.001]}}})),
        str(params))
    best = sweep.best_overrides({"finetune.interpolation.mode": "bilinear", "finetune.lr": 0.001})
    assert best == {"finetune.interpolation.mode": "bilinear", "finetune.lr": 0.001, "ray.num_workers": 1}
    assert sweep.total_trials == 2
    assert shlex.split(dvc_line(best, str(params))) == [
        "dvc", "exp", "run", "-S", "finetune.interpolation.mode='bilinear'", "-S", "finetune.lr=0.001",
        "-S", "ray.num_workers=1"]
    with pytest.raises(ConfigError, match="is not valid"):
        load_sweep(str(_write(tmp_path / "t.yaml", {"stage": "finetune", "mode": "up", "space": {
            "finetune.lr": {"choice": [0.001]}}})), str(params))


# --- a real ASHA sweep, run once for the tests below ------------------------------------------------------

@pytest.fixture(scope="module")
def asha(tmp_path_factory):
    repo = sharded_short_run(tmp_path_factory.mktemp("sweep-repo"), edit=_sweep_repo)
    _write(repo / "sweep.yaml", ASHA_SWEEP)
    proc = run(["python", "-m", "pipeline", "sweep", "sweep.yaml"], repo)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return repo, proc


def _runs(repo: Path, sweep: str = "sweep"):
    """The sweep's MLflow parent run and its children, by trial id."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    parent = client.get_run((repo / "sweeps" / sweep / "mlflow_run_id").read_text().strip())
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return client, parent, {c.data.tags["sweep.trial_id"]: c for c in children}


def _trial_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("[sweep] trial ") and " epochs (" in line]


@pytest.mark.slow
def test_asha_stops_trials_and_each_is_a_child_run_with_its_curve(asha):
    repo, proc = asha
    lines = _trial_lines(proc.stdout)
    assert len(lines) == 6 and all("best so far: " in line for line in lines), proc.stdout
    client, parent, children = _runs(repo)
    assert parent.info.status == "FINISHED" and parent.data.params["space.pretrain.lr"] == "loguniform[0.0001, 0.02]"
    assert len(children) == 6
    stopped = 0
    for trial_id, child in children.items():
        assert child.info.status == "FINISHED" and child.data.metrics["duration_s"] > 0
        curve = client.get_metric_history(child.info.run_id, "val_top1")
        epochs = len(curve)
        status = child.data.tags["sweep.status"]
        assert status == ("finished" if epochs == EPOCHS else "stopped early"), (trial_id, epochs, status)
        stopped += status == "stopped early"
        assert [m.step for m in sorted(curve, key=lambda m: m.step)] == [19 * (e + 1) for e in range(epochs)]
        line = next(line for line in lines if f"trial {trial_id} " in line)
        assert f"{status} after {epochs}/{EPOCHS} epochs (pretrain.lr=" in line
        assert f"best val_top1 {max(m.value for m in curve):.4f}" in line
        assert float(child.data.params["pretrain.warmup_epochs"]) in (0, 1) and float(child.data.params["pretrain.lr"])
    assert stopped >= 1


@pytest.mark.slow
def test_best_yaml_names_the_best_trial_and_its_dvc_line(asha):
    repo, proc = asha
    client, parent, children = _runs(repo)
    best_of = {t: max(m.value for m in client.get_metric_history(c.info.run_id, "val_top1"))
               for t, c in children.items()}
    winner = max(best_of, key=best_of.get)
    assert parent.data.tags["best.trial_id"] == winner
    assert parent.data.metrics["best_val_top1"] == best_of[winner]
    best = yaml.safe_load((repo / "sweeps/sweep/best.yaml").read_text())
    params = children[winner].data.params
    assert best == {"pretrain": {"lr": float(params["pretrain.lr"]), "warmup_epochs": float(params["pretrain.warmup_epochs"])}}
    line = next(line for line in proc.stdout.splitlines() if line.startswith("[sweep] reproduce it: "))
    assert line.removeprefix("[sweep] reproduce it: ") == parent.data.tags["best.dvc_exp_run"]
    assert shlex.split(line)[3:] == ["dvc", "exp", "run", "-S", f"pretrain.lr={best['pretrain']['lr']}",
                                     "-S", f"pretrain.warmup_epochs={best['pretrain']['warmup_epochs']}"]


@pytest.mark.slow
def test_the_stage_run_with_best_yaml_repeats_the_trials_first_epoch(asha):
    """best.yaml applied to params.yaml, then the command dvc.yaml's pretrain stage runs: the same first epoch
    as the trial, exactly (one CPU thread, as the trial's 1-CPU actor had)."""
    repo, _ = asha
    client, parent, children = _runs(repo)
    best = yaml.safe_load((repo / "sweeps/sweep/best.yaml").read_text())
    set_params(repo, **{f"pretrain.{k}": v for k, v in best["pretrain"].items()})
    proc = subprocess.run(["python", "-m", "stages.pretrain"], cwd=repo, env=clean_env(OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[pretrain] in-process: 1 worker(s)" in proc.stdout and "resumed" not in proc.stdout  # trained anew
    assert "already finished" not in proc.stdout
    with open(repo / "plots/pretrain_history.csv") as f:
        first = next(csv.DictReader(f))
    trial = children[parent.data.tags["best.trial_id"]].info.run_id
    for key in ("train_loss", "train_top1", "val_loss", "val_top1"):
        at_19 = [m.value for m in client.get_metric_history(trial, key) if m.step == 19]
        assert at_19 == [float(first[key])], key


# --- a grid sweep, stopped by Ctrl-C and resumed ---------------------------------------------------------

@pytest.mark.slow
def test_grid_sweep_resumes_after_ctrl_c_without_rerunning_finished_trials(tmp_path):
    repo = sharded_short_run(tmp_path / "repo", edit=_sweep_repo)
    set_params(repo, **{"pretrain.epochs": 1})
    grid = [0.001, 0.002, 0.004]
    _write(repo / "grid.yaml", {"stage": "pretrain", "max_concurrent": 1, "scheduler": {"name": "none"},
                                "space": {"pretrain.lr": {"grid": grid}}})
    cmd = ["python", "-m", "pipeline", "sweep", "grid.yaml"]
    proc = subprocess.Popen(cmd, cwd=repo, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = []
    for line in proc.stdout:
        first.append(line)
        if line.startswith("[sweep] trial ") and " epochs (" in line:
            time.sleep(0.5)  # the next trial under way
            proc.send_signal(signal.SIGINT)
            break
    out, err = proc.communicate(timeout=300)
    first_out = "".join(first) + out
    assert proc.returncode == 128 + signal.SIGINT, first_out + err
    assert "error: stopped by SIGINT" in err
    done_before = [line.split()[2] for line in _trial_lines(first_out)]
    assert 1 <= len(done_before) < len(grid)
    _, parent, _ = _runs(repo, "grid")
    assert parent.info.status == "KILLED"

    again = run(cmd, repo)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "[sweep] resuming " in again.stdout
    done_after = [line.split()[2] for line in _trial_lines(again.stdout)]
    assert not set(done_before) & set(done_after) and len(done_before) + len(done_after) == len(grid)
    assert _trial_lines(again.stdout)[-1].endswith(f"[{len(grid)} of {len(grid)} ended]")
    client, parent, children = _runs(repo, "grid")
    assert parent.info.status == "FINISHED" and sorted(children) == sorted(done_before + done_after)
    assert sorted(float(c.data.params["pretrain.lr"]) for c in children.values()) == grid
    for trial_id in done_before:  # each trial's log starts with its values: written once
        log = (repo / "sweeps/grid/logs" / f"{trial_id}.log").read_text()
        assert log.count(f"[sweep] trial {trial_id}: ") == 1, log

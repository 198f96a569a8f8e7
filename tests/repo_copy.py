"""A copy of this repository for a test to run stages in: copy it, edit its params, run commands there."""
from __future__ import annotations

import atexit
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

from tests.conftest import clean_env

ROOT = Path(__file__).resolve().parents[1]
REPO_FILES = ["pipeline", "stages", "dvc.yaml", "params.yaml", ".dvcignore", ".dvc/config", ".gitignore"]


def copy_repo_files(dst: Path, names: list[str]) -> Path:
    """Files and directories ``names`` (relative to the repo root) copied to ``dst``, their bytecode with
    them (scripts/test.sh compiles it; each copy's stages would otherwise compile the same code again)."""
    for name in names:
        src, target = ROOT / name, dst / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target)
        else:
            shutil.copy2(src, target)
    return dst


def tiny_params(raw: dict) -> dict:
    """Same structure as params.yaml, scaled down so the whole pipeline takes about two minutes."""
    raw["data"]["pretrain"].update(source="fractals", num_classes=10, samples_per_class=30)
    raw["model"].update(depth=2)
    raw["pretrain"].update(epochs=2, warmup_epochs=0)
    raw["finetune"].update(epochs=10, warmup_epochs=0)  # 1-4 epochs: still at chance (1 in 10)
    raw["evaluate"]["resolutions"] = [24, 32]
    raw["export"]["num_images"] = 16
    return raw


def short_run(raw: dict) -> dict:
    """A short pretrain on digits (1257 train images) with checkpoints and logs every 5 steps, no retries."""
    raw["data"]["pretrain"]["source"] = "digits"
    raw["model"].update(depth=2)
    raw["pretrain"].update(epochs=2, warmup_epochs=0, checkpoint_every_steps=5, log_every_steps=5)
    raw["ray"].update(max_failures=0)
    return raw


def make_repo(dst: Path, edit=tiny_params) -> Path:
    """The stages, pipeline and DVC files in ``dst`` as a git repo, params.yaml passed through ``edit``."""
    copy_repo_files(dst, REPO_FILES)
    raw = yaml.safe_load((dst / "params.yaml").read_text())
    (dst / "params.yaml").write_text(yaml.safe_dump(edit(raw), sort_keys=False))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init"]):
        subprocess.run(cmd, cwd=dst, check=True)
    return dst


def set_params(repo: Path, **updates) -> None:
    """``set_params(repo, **{"ray.num_workers": 1})``: edit section.key values of the copy's params.yaml."""
    raw = yaml.safe_load((repo / "params.yaml").read_text())
    for dotted, value in updates.items():
        section, key = dotted.split(".")
        raw[section][key] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def run(cmd: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """``cmd`` in the copy, in the test's environment less what would point it at the developer's own
    servers or params (:func:`tests.conftest.clean_env`)."""
    return subprocess.run(cmd, cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=timeout)


_SHARDED: dict[str, Path] = {}  # data.pretrain (as YAML) -> its shards, written once per test process


def sharded_short_run(dst: Path, edit=short_run) -> Path:
    """A copy set up by ``edit`` (:func:`short_run`, or an edit of it) with its pretrain shards written.
    The shard stage runs once per data section and test process; later copies get a copy of its output
    (the same bytes, so the same run identities)."""
    repo = make_repo(dst, edit=edit)
    data = yaml.safe_dump(yaml.safe_load((repo / "params.yaml").read_text())["data"]["pretrain"])
    shards = repo / "data/shards/pretrain"
    if data in _SHARDED:
        shutil.copytree(_SHARDED[data], shards)
        return repo
    proc = run(["python", "-m", "stages.shard", "pretrain"], repo)
    assert proc.returncode == 0, proc.stderr
    cache = Path(tempfile.mkdtemp(prefix="vit-shards-"))
    atexit.register(shutil.rmtree, cache, ignore_errors=True)
    _SHARDED[data] = shutil.copytree(shards, cache / "pretrain")
    return repo


def pretrain_runs(repo: Path):
    """The copy's MLflow client and its pretrain runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{repo}/mlflow.db")
    exp = client.get_experiment_by_name("vit-pipeline")  # None before any stage has logged
    return client, client.search_runs([exp.experiment_id], "tags.stage = 'pretrain'") if exp else []

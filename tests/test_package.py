"""The installable package: declared dependencies, the `vit-pipeline` command, what its start-up imports."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from tests.conftest import locked_versions, normalized_name, pinned_requirements
from tests.repo_copy import ROOT, copy_repo_files

HEAVY = ("ray", "mlflow", "dvc", "torch")
# Prints the heavy top-level packages that `vit-pipeline ARGS...` imported (stdout: the help itself).
PROBE = """
import sys
from pipeline.console import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(sorted({m.split('.')[0] for m in sys.modules} & set(%r)), file=sys.stderr)
""" % (HEAVY,)


def _imported(*args: str) -> tuple[list[str], str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    return json.loads(proc.stderr.strip().splitlines()[-1].replace("'", '"')), proc.stdout


def test_help_imports_no_heavy_package():
    """`vit-pipeline --help` and the help of the light subcommands load no torch, Ray, MLflow or DVC."""
    from pipeline.console import COMMANDS

    for args in (["--help"], ["stage", "--help"], ["stage", "pretrain", "--help"], ["storage", "--help"],
                 ["recipe", "--help"]):
        imported, out = _imported(*args)
        assert imported == [], (args, imported)
        assert "usage: vit-pipeline" in out, (args, out)
    _, out = _imported("--help")
    assert all(name in out for name in COMMANDS)
    _, out = _imported("stage", "export", "--help")
    assert "writes exports/" in out.replace("\n", " ")


def test_predict_help_imports_no_ray_or_mlflow():
    imported, out = _imported("predict", "--help")
    assert not {"ray", "mlflow", "dvc"} & set(imported), imported
    assert "usage: vit-pipeline predict" in out and "config.json" in out


NOOP_STAGE = "from pipeline.cli import run_stage; run_stage(lambda params: print('ran'), name='noop')"


@pytest.mark.slow
@pytest.mark.parametrize("call, params, code", [
    (NOOP_STAGE, "data:\n  pretrain:\n    source: digits\n", 0),
    (NOOP_STAGE, "\n", 2),  # an empty params file: exit 2 before the stage runs
    ("import sys; from pipeline.console import main; sys.exit(main(['--version']))", None, 0),
])
def test_entry_points_freeze_the_heap_at_exit(tmp_path, call, params, code):
    """A stage (run_stage) and the `vit-pipeline` command leave Python's teardown little to walk:
    gc.freeze at exit, after the handlers registered later (Ray's shutdown, MLflow's flush), whether
    they succeed or fail; the exit code stays."""
    if params is not None:
        (tmp_path / "params.yaml").write_text(params)
    script = ("import atexit, gc\n"
              "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0, flush=True))\n" + call)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.splitlines()[-1] == "frozen at exit: True", proc.stdout
    assert ("ran" in proc.stdout.splitlines()) == (params is not None and code == 0)


@pytest.mark.slow
def test_stage_runs_the_stage_module():
    """`vit-pipeline stage shard <bad name>` reaches stages/shard.py's own check (exit 2, its usage line)."""
    proc = subprocess.run([sys.executable, "-m", "pipeline", "stage", "shard", "nope"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "stages.shard {pretrain|finetune}" in proc.stderr, proc.stderr


# Pinned to build and install the environment, not needed at run time (and not declared in pyproject).
INSTALLERS = {"setuptools", "uv", "pip"}
LOCKS = {"requirements.lock": ("requirements.txt",),
         "requirements-test.lock": ("requirements.txt", "requirements-test.txt")}


def _pins() -> dict[str, str]:
    """``{name: version}`` pinned in requirements*.txt (what scripts/lock.sh resolves)."""
    return pinned_requirements("requirements.txt", "requirements-test.txt")


def test_declared_dependencies_match_the_pins():
    """pyproject's lower bounds are the pinned versions (the tested ones), for the same packages."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {}
    for req in project["dependencies"] + project["optional-dependencies"]["test"]:
        name, version = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=(\S+)", req).groups()
        declared[name.lower()] = version
    assert declared == {k: v for k, v in _pins().items() if k not in INSTALLERS}
    assert project["requires-python"] == ">=3.11"


@pytest.mark.parametrize("lock", LOCKS)
def test_the_lock_holds_the_pins_hashed(lock):
    """Each lock pins every direct requirement of its files at exactly the pinned version, and every entry
    carries a hash (scripts/env.sh installs with --require-hashes): a pin changed without `bash
    scripts/lock.sh` fails here."""
    locked = locked_versions(lock)
    pins = {normalized_name(k): v for k, v in pinned_requirements(*LOCKS[lock]).items()}
    assert {k: locked.get(k) for k in pins} == {k: {v} for k, v in pins.items()}
    assert "vit-pipeline" not in locked and len(locked) > len(pins)  # the project itself is installed editable
    entries = re.split(r"\n(?=[A-Za-z0-9])", (ROOT / lock).read_text().split("\n", 2)[2])
    assert all("--hash=sha256:" in entry for entry in entries if "==" in entry.split("\n")[0])


def test_the_runtime_lock_is_the_test_lock_less_the_test_tools():
    """requirements.lock is resolved at requirements-test.lock's versions, so the test environment is the
    pipeline's plus the test tools (scripts/env.sh counts a test env as a runtime one)."""
    runtime, test = locked_versions("requirements.lock"), locked_versions("requirements-test.lock")
    assert {k: test.get(k) for k in runtime} == runtime


def test_this_environment_is_the_lock():
    """Every installed package that the test lock names is at a version it locks, pip included
    (scripts/env.sh syncs the venv to the lock): the suite tests the environment a fresh clone builds.
    Read from site-packages, as pip sees it: once setuptools is imported (torch.compile does), its
    vendored copies of importlib-metadata, zipp, … are on sys.path too, and they are not installed packages."""
    site = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    installed = {normalized_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=list(site))}
    locked = locked_versions("requirements-test.lock")
    assert "pip" in installed and "uv" in installed
    assert not {k: v for k, v in installed.items() if k in locked and v not in locked[k]}
    assert set(installed) - set(locked) == {"vit-pipeline"}  # nothing the lock does not name


def test_this_environment_is_compiled_to_bytecode():
    """scripts/env.sh compiles the venv as it installs: with PYTHONDONTWRITEBYTECODE set, each stage and
    Ray worker would otherwise compile the modules it imports (seconds per process)."""
    import importlib.util

    for module in ("torch", "mlflow.sagemaker", "ray.autoscaler._private.aws.config"):  # the last two: never imported
        source = importlib.util.find_spec(module).origin
        assert Path(importlib.util.cache_from_source(source)).is_file(), module


def _site_packages_without_this_project(dst: Path) -> Path:
    """Links to every entry of this environment's site-packages except an install of this project.

    A fresh venv that sees these (via a .pth file) has the declared dependencies already installed,
    so pip can check and resolve them offline without copying gigabytes.
    """
    dst.mkdir()
    for key in ("purelib", "platlib"):
        for entry in Path(sysconfig.get_paths()[key]).iterdir():
            low = entry.name.lower()
            if low.startswith(("vit_pipeline", "__editable__.vit_pipeline", "__editable___vit_pipeline")) \
                    or low in ("pipeline", "stages") or (dst / entry.name).exists():
                continue
            (dst / entry.name).symlink_to(entry)
    return dst


def _exported_model(out: Path) -> Path:
    """The tiniest exported model (safetensors + config.json + ONNX), as the export stage writes it."""
    import torch

    from pipeline.exporter import export_onnx
    from pipeline.model import build_vit, save_model

    torch.manual_seed(0)
    model = build_vit("nano", patch_size=4, image_size=16, num_classes=3).eval()
    save_model(model, out, extra={"classes": ["cat", "dog", "fox"], "image_size": 16,
                                  "normalize": {"mean": [0.5] * 3, "std": [0.5] * 3}})
    export_onnx(model, torch.rand(2, 3, 16, 16), out / "model.onnx", opset=18)
    return out


@pytest.mark.slow
def test_wheel_installs_and_predicts(tmp_path):
    """Acceptance: build the wheel, install it with the lock into a fresh venv, then
    `vit-pipeline --help` and `vit-pipeline predict` on an exported model, from outside the checkout."""
    src = copy_repo_files(tmp_path / "src", ["pyproject.toml", "README.md", "pipeline", "stages"])
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                    "-q", "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    wheel, = (tmp_path / "dist").glob("vit_pipeline-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    deps = _site_packages_without_this_project(tmp_path / "deps")
    (site / "_deps.pth").write_text(f"{deps}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    # docs/install.md's `pip install` of the wheel with the pins, offline (--no-index): the wheel's Requires-Dist and the pins
    # must both be met by this (the tested) environment.
    subprocess.run([py, "-m", "pip", "install", "--no-index", "-q", "-r", ROOT / "requirements.txt", str(wheel)],
                   cwd=tmp_path, env=env, check=True, timeout=300)
    # and `pip install '.[test]'`: the extra's tools are declared and met by the tested environment
    subprocess.run([py, "-m", "pip", "install", "--no-index", "-q", f"{wheel}[test]"], cwd=tmp_path, env=env,
                   check=True, timeout=300)
    subprocess.run([py, "-m", "pip", "check"], cwd=tmp_path, env=env, check=True, timeout=120)

    work = tmp_path / "work"
    work.mkdir()
    exports = _exported_model(work / "exports")
    from PIL import Image
    Image.new("RGB", (20, 24), (200, 30, 30)).save(work / "red.png")

    def vit(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([venv / "bin" / "vit-pipeline", *args], cwd=work, env=env, capture_output=True,
                              text=True, timeout=300)

    helped = vit("--help")
    assert helped.returncode == 0 and "predict" in helped.stdout, helped.stderr
    where = subprocess.run([py, "-c", "import pipeline; print(pipeline.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert Path(where).resolve().is_relative_to(site.resolve()), where  # the installed copy, not the checkout
    got = vit("predict", "red.png", "--model", str(exports))
    assert got.returncode == 0, got.stderr
    path, label, prob = got.stdout.strip().split("\t")
    assert path == "red.png" and label in ("cat", "dog", "fox") and 0 < float(prob) <= 1

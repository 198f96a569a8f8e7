"""Publishing a stage's outputs (pipeline.outputs) and the stage wrapper's lock and stop line: fast,
in-process; a failure, a signal or a kill while outputs are renamed into place."""
from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli
from pipeline.outputs import PARTIAL, StagedOutputs, staged_outputs
from pipeline.signals import StageInterrupted
from pipeline.utils import atomic_write_text
from tests.conftest import clean_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def old_outputs(tmp_path, monkeypatch):
    """A directory output and a file output from a previous run, in a temp working directory."""
    monkeypatch.chdir(tmp_path)
    Path("exports").mkdir()
    Path("exports/old.onnx").write_text("old")
    Path("metrics").mkdir()
    Path("metrics/export.json").write_text("old")
    return tmp_path


def _state(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _write_new(out: StagedOutputs) -> None:
    out["exports"].mkdir()
    (out["exports"] / "new.onnx").write_text("new")
    out["metrics/export.json"].write_text("new")


def _on_rename_of(name: str, action, monkeypatch) -> None:
    """Run ``action`` when ``name`` is renamed (by os.rename, os.replace or Path.rename), before the rename."""
    for fn in ("rename", "replace"):
        real = getattr(os, fn)

        def wrapped(src, dst, *a, _real=real, **kw):
            if Path(src).name == name:
                action()
            return _real(src, dst, *a, **kw)
        monkeypatch.setattr(os, fn, wrapped)


OLD = {"exports/old.onnx": "old", "metrics/export.json": "old"}


def test_a_failed_stage_takes_back_the_folders_made_for_its_outputs(tmp_path, monkeypatch):
    """A first run that fails leaves no empty data/shards/ or models/ behind; a folder that holds anything
    else stays, and a stage that succeeds keeps them."""
    monkeypatch.chdir(tmp_path)
    Path("plots").mkdir()
    with pytest.raises(RuntimeError, match="boom"):
        with staged_outputs("data/shards/pretrain", "models/pretrain", "plots/curves.png") as out:
            out["data/shards/pretrain"].mkdir()
            Path("models/notes.txt").write_text("someone else's")
            raise RuntimeError("boom")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["models", "models/notes.txt", "plots"]
    with staged_outputs("data/shards/pretrain") as out:
        out["data/shards/pretrain"].mkdir()
    assert Path("data/shards/pretrain").is_dir()


def test_a_failed_rename_while_publishing_puts_the_previous_outputs_back(old_outputs, monkeypatch):
    """Before: the old exports/ stayed renamed aside, the new one was discarded: no exports/ at all."""
    def fail():
        raise OSError(errno.EIO, "I/O error")
    _on_rename_of(f"{PARTIAL}export.json", fail, monkeypatch)
    with pytest.raises(OSError, match="I/O error"):
        with staged_outputs("exports", "metrics/export.json") as out:
            _write_new(out)
    assert _state(old_outputs) == OLD


def test_a_signal_while_publishing_leaves_every_previous_output(old_outputs, monkeypatch, stage_signals):
    """Before: SIGTERM between two renames left new exports/ beside the old metrics and the old
    exports/ under .partial.old.exports."""
    _on_rename_of(f"{PARTIAL}export.json", lambda: os.kill(os.getpid(), signal.SIGTERM), monkeypatch)
    with pytest.raises(StageInterrupted):
        with staged_outputs("exports", "metrics/export.json") as out:
            _write_new(out)
    assert _state(old_outputs) == OLD


def test_a_signal_after_the_last_rename_publishes_and_then_stops(old_outputs, monkeypatch, stage_signals):
    """A signal while the previous outputs are deleted stops the stage after the cleanup, outputs new."""
    real = shutil.rmtree
    monkeypatch.setattr(shutil, "rmtree", lambda p, *a, **kw: (os.kill(os.getpid(), signal.SIGTERM), real(p, *a, **kw)))
    with pytest.raises(StageInterrupted):
        with staged_outputs("exports", "metrics/export.json") as out:
            _write_new(out)
    assert _state(old_outputs) == {"exports/new.onnx": "new", "metrics/export.json": "new"}


def test_an_output_left_aside_by_a_killed_publish_is_put_back(old_outputs):
    """SIGKILL between moving exports/ aside and renaming the new one in; the next run starts.
    Before: the next run never restored it, exports/ stayed missing."""
    Path("exports").rename(f"{PARTIAL}old.exports")
    Path(f"{PARTIAL}exports").mkdir()
    Path(f"{PARTIAL}exports/new.onnx").write_text("new")
    StagedOutputs([Path("exports"), Path("metrics/export.json")])
    assert _state(old_outputs) == OLD


def test_a_stale_aside_copy_is_removed_when_the_target_is_there(old_outputs):
    Path(f"{PARTIAL}old.exports").mkdir()
    Path(f"{PARTIAL}old.exports/older.onnx").write_text("older")
    StagedOutputs([Path("exports")])
    assert _state(old_outputs) == OLD


def test_publish_into_a_symlinked_output_folder(old_outputs, tmp_path_factory):
    """An output whose parent folder is a link to another disk is staged and published there."""
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    shutil.move("metrics", elsewhere / "metrics")
    Path("metrics").symlink_to(elsewhere / "metrics")
    with staged_outputs("exports", "metrics/export.json") as out:
        _write_new(out)
    assert (elsewhere / "metrics/export.json").read_text() == "new" and Path("metrics").is_symlink()
    assert not list(old_outputs.glob(f"**/{PARTIAL}*")) and not list(elsewhere.rglob(f"{PARTIAL}*"))


@pytest.fixture
def stage_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.delenv("VIT_PARAMS", raising=False)
    monkeypatch.setenv("MLFLOW_LOGGING_LEVEL", "WARNING")
    return tmp_path


def test_a_stop_after_publishing_says_the_outputs_were_replaced(stage_dir, stage_signals, capsys):
    """SIGTERM while MLflow logs the published outputs. Before: 'outputs ... were not replaced'."""
    def demo(params):
        with staged_outputs("metrics/demo.json") as out:
            out["metrics/demo.json"].write_text("new")
            out.publish()
            os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        cli.run_stage(demo)
    assert stop.value.code == 128 + signal.SIGTERM
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: stopped by SIGTERM after this stage had replaced its outputs (metrics/demo.json)")


def test_a_stop_before_publishing_says_the_outputs_were_not_replaced(stage_dir, stage_signals, capsys):
    def demo(params):
        with staged_outputs("metrics/demo.json") as out:
            out["metrics/demo.json"].write_text("new")
            os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(SystemExit) as stop:
        cli.run_stage(demo)
    assert stop.value.code == 128 + signal.SIGINT
    assert capsys.readouterr().err.startswith("error: stopped by SIGINT; outputs of this stage were not replaced")
    assert not Path("metrics/demo.json").exists() and not list(stage_dir.rglob(f"{PARTIAL}*"))


STOPPING_STAGE = """
import os, signal, sys, time
from pathlib import Path
from pipeline import cli

def demo(params):
    try:
        os.kill(os.getpid(), signal.SIGINT)
    finally:  # the clean-up (the MLflow run ended, Ray shut down) while Ctrl-C is pressed again
        for _ in range(int(sys.argv[1])):
            os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        Path("cleaned-up").touch()

cli.run_stage(demo)
"""


@pytest.mark.slow
@pytest.mark.parametrize("again", [1, 2])
def test_ctrl_c_again_while_the_stage_cleans_up(stage_dir, again):
    """Ctrl-C pressed again while a stopping stage cleans up raised inside the clean-up: Ray's shutdown cut
    short (the stage exited 1, not 130). Now a second is recorded and the clean-up ends; a third ends the
    process at once, saying so."""
    proc = subprocess.run([sys.executable, "-c", STOPPING_STAGE, str(again)], cwd=stage_dir, capture_output=True,
                          text=True, timeout=60, env=clean_env(PYTHONPATH=str(ROOT)))
    assert proc.returncode == 128 + signal.SIGINT and len(proc.stderr.splitlines()) == 1, proc.stderr
    if again == 1:
        assert (stage_dir / "cleaned-up").exists(), "the clean-up was cut short"
        assert proc.stderr.startswith("error: stopped by SIGINT; outputs of this stage were not replaced")
    else:
        assert not (stage_dir / "cleaned-up").exists()
        assert proc.stderr.startswith("error: stopped by SIGINT a third time: its clean-up was cut short")


def test_a_lock_file_left_with_garbage_does_not_block(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path(".stage-locks").mkdir()
    Path(".stage-locks/demo.lock").write_bytes(b"\xff\xfe not a pid\n" * 50)
    with cli.stage_lock("demo"):
        assert Path(".stage-locks/demo.lock").read_text() == f"{os.getpid()} on {socket.gethostname()}"


def test_a_busy_stage_names_the_holder_and_its_host(tmp_path, monkeypatch):
    """A checkout shared over NFS: the pid to stop may be another machine's. Before: the pid alone."""
    monkeypatch.chdir(tmp_path)
    with cli.stage_lock("demo"):
        with pytest.raises(cli.StageBusy, match=rf"\(pid {os.getpid()} on {re.escape(socket.gethostname())},"):
            with cli.stage_lock("demo"):
                pass


def test_atomic_write_leaves_no_temp_outside_the_ignored_names(tmp_path, monkeypatch):
    """A kill mid-write leaves the temp file: it is named like staged outputs (.gitignore'd, swept by tests).
    Before: '.<name>.XXXX', which git status showed in metrics/."""
    def killed(fd):
        raise SystemExit("killed before the rename")
    monkeypatch.setattr(os, "fsync", killed)
    monkeypatch.setattr(Path, "unlink", lambda self, missing_ok=False: None)  # as SIGKILL: no cleanup
    with pytest.raises(SystemExit):
        atomic_write_text(tmp_path / "metrics" / "m.json", "{}")
    assert [p.name.startswith(PARTIAL) for p in (tmp_path / "metrics").iterdir()] == [True]


def test_a_filesystem_without_locks_is_one_line_naming_the_lock(tmp_path, monkeypatch):
    """flock on an NFS mount without a lock service: ENOLCK. Before: 'error: No locks available'."""
    monkeypatch.chdir(tmp_path)

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(OSError) as exc:
        with cli.stage_lock("demo"):
            pass
    assert cli._known_failure(exc.value) == (
        f"error: .stage-locks/demo.lock: cannot lock ({os.strerror(errno.ENOLCK)})", cli.EXIT_FAILED)


def test_a_published_file_is_never_missing(old_outputs, monkeypatch):
    """A reader of metrics/export.json (another stage, dvc metrics) finds the old or the new file."""
    seen = []
    _on_rename_of(f"{PARTIAL}export.json", lambda: seen.append(Path("metrics/export.json").read_text()), monkeypatch)
    with staged_outputs("exports", "metrics/export.json") as out:
        _write_new(out)
    assert seen == ["old"] and _state(old_outputs) == {"exports/new.onnx": "new", "metrics/export.json": "new"}

"""A stage's outputs, published together at its end.

Each output is written beside its target under a temporary name (``.partial.<name>``, the suffix
kept so writers that go by it still work) and renamed into place only when the whole stage has
succeeded. A failed or interrupted stage leaves the previous outputs untouched, never new plots
beside a stale metrics file. Where a target cannot be written is found out before any work starts.
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

PARTIAL = ".partial."


class StagedOutputs:
    """The temporary paths of a stage's outputs; see the module docstring."""

    def __init__(self, targets: list[Path]):
        self.targets = {Path(t): Path(t).parent / f"{PARTIAL}{Path(t).name}" for t in targets}
        self.published = False
        for target, tmp in self.targets.items():
            _check_writable(target.parent)
            _remove(tmp)  # left by a killed run

    def __getitem__(self, target: str | os.PathLike) -> Path:
        return self.targets[Path(target)]

    def publish(self) -> None:
        """Rename every written output into place (a directory replaces the old one whole); once."""
        if self.published:
            return
        for target, tmp in self.targets.items():
            if not tmp.exists():
                raise RuntimeError(f"stage output {target} was not written")
        for target, tmp in self.targets.items():
            if tmp.is_dir() and target.exists():
                old = target.parent / f"{PARTIAL}old.{target.name}"
                _remove(old)
                target.rename(old)
                tmp.rename(target)
                _remove(old)
            else:
                os.replace(tmp, target)
        self.published = True

    def discard(self) -> None:
        for tmp in self.targets.values():
            _remove(tmp)


@contextmanager
def staged_outputs(*targets: str | os.PathLike) -> Iterator[StagedOutputs]:
    """``with staged_outputs(a, b) as out:`` write to ``out[a]``, ``out[b]``; published on success."""
    out = StagedOutputs([Path(t) for t in targets])
    try:
        yield out
        out.publish()
    finally:
        out.discard()


def _check_writable(directory: Path) -> None:
    """Create ``directory`` and a file in it now, so an unwritable output fails before the work."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f"{PARTIAL}probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write stage outputs into {directory}/ ({exc.strerror}); "
                                 f"fix its permissions or free space, then re-run the stage") from None


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)

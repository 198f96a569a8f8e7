"""A stage's outputs, published together at its end.

Each output is written beside its target under a temporary name (``.partial.<name>``, the suffix
kept so writers that go by it still work) and renamed into place only when the whole stage has
succeeded. A failed or interrupted stage leaves the previous outputs untouched, never new plots
beside a stale metrics file. Where a target cannot be written is found out before any work starts.

Publishing moves each previous output aside (``.partial.old.<name>``) and the new one in, with
SIGTERM/SIGINT held: a failure or a signal on the way puts every previous output back. A process
killed outright (SIGKILL) between the two renames of an output leaves it aside; the stage's next run
puts it back before it starts.
"""
from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from pipeline.signals import StageInterrupted, held_signals
from pipeline.utils import PARTIAL

published: list[Path] = []  # what this process has published: a stage stopped after it says so


class StagedOutputs:
    """The temporary paths of a stage's outputs; see the module docstring."""

    def __init__(self, targets: list[Path], resumable: bool = False):
        """``resumable``: what a killed run left under the temporary names is kept for the stage to resume
        from (it checks it was made the same way); else it is removed."""
        self.targets = {Path(t): Path(t).parent / f"{PARTIAL}{Path(t).name}" for t in targets}
        self.published = False
        self.created: list[Path] = []  # folders made for the outputs: a stage that fails takes them back
        for target, tmp in self.targets.items():
            self.created += _check_writable(target.parent)
            _restore_aside(target)  # left by a run killed while publishing
            if not resumable:
                _remove(tmp)  # left by a killed run

    def __getitem__(self, target: str | os.PathLike) -> Path:
        return self.targets[Path(target)]

    def publish(self) -> None:
        """Rename every written output into place (a directory replaces the old one whole); once.
        All or none: on any exception or signal before the last rename, the previous outputs return."""
        if self.published:
            return
        for target, tmp in self.targets.items():
            if not tmp.exists():
                raise RuntimeError(f"stage output {target} was not written")
        with held_signals() as pending:
            self._swap_in(pending)
            self.published = True
            published.extend(self.targets)
            for target in self.targets:  # published: a leftover is removed by the next run
                _remove(_aside(target), ignore_errors=True)
        if pending:  # arrived after the last rename: the stage stops, its outputs are the new ones
            raise StageInterrupted(pending[0])

    def _swap_in(self, pending: list[int]) -> None:
        """Move the previous outputs aside and the new ones in; put all back on an error or a signal."""
        moved: list[Path] = []
        try:
            for target, tmp in self.targets.items():
                _move_aside(target)
                moved.append(target)
                os.replace(tmp, target)
            if pending:
                raise StageInterrupted(pending[0])
        except BaseException:
            _undo(moved, self.targets)
            raise

    def discard(self) -> None:
        for tmp in self.targets.values():
            _remove(tmp)
        if not self.published:
            for folder in self.created:  # deepest first; one that holds anything else stays
                try:
                    folder.rmdir()
                except OSError:
                    pass


@contextmanager
def staged_outputs(*targets: str | os.PathLike) -> Iterator[StagedOutputs]:
    """``with staged_outputs(a, b) as out:`` write to ``out[a]``, ``out[b]``; published on success."""
    out = StagedOutputs([Path(t) for t in targets])
    try:
        yield out
        out.publish()
    finally:
        out.discard()


def _aside(target: Path) -> Path:
    return target.parent / f"{PARTIAL}old.{target.name}"


def _move_aside(target: Path) -> None:
    """Keep the previous output (if any) under its aside name, so it can be put back. A file stays in
    place too (a hard link), so a reader never finds it missing; a directory is renamed."""
    _remove(_aside(target))
    if not os.path.lexists(target):
        return
    if not target.is_dir():
        try:
            return os.link(target, _aside(target), follow_symlinks=False)
        except OSError:
            pass  # no hard links here: rename
    os.rename(target, _aside(target))


def _undo(moved: list[Path], targets: dict[Path, Path]) -> None:
    """Put back the previous outputs of ``moved`` (newest first); a new output goes back to its temp name."""
    for target in reversed(moved):
        if not os.path.lexists(targets[target]) and os.path.lexists(target):
            os.rename(target, targets[target])
        _restore_aside(target)


def _restore_aside(target: Path) -> None:
    """A previous output left aside goes back where the target is missing; else it is stale."""
    old = _aside(target)
    if os.path.lexists(old):
        if os.path.lexists(target):
            _remove(old)
        else:
            os.rename(old, target)


def _check_writable(directory: Path) -> list[Path]:
    """Create ``directory`` and a file in it now, so an unwritable output fails before the work; the
    folders it created, deepest first."""
    missing = [d for d in (directory, *directory.parents) if not os.path.lexists(d)]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f"{PARTIAL}probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
        return missing
    except OSError as exc:
        fix = ("a file is in the way on this path: move it aside" if exc.errno in (errno.EEXIST, errno.ENOTDIR)
               else "fix its permissions or free space")
        raise OSError(exc.errno, f"cannot write stage outputs into {directory}/ ({exc.strerror}); "
                                 f"{fix}, then re-run the stage") from None


def _remove(path: Path, ignore_errors: bool = False) -> None:
    """Delete a file, link (not what it points to) or directory tree, if there."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        if not ignore_errors:
            raise

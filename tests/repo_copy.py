"""Copy the parts of this repository a test needs into a temp dir (tests then run stages there)."""
from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def copy_repo_files(dst: Path, names: list[str]) -> Path:
    """Files and directories ``names`` (relative to the repo root) copied to ``dst``, without caches."""
    for name in names:
        src, target = ROOT / name, dst / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, target)
    return dst

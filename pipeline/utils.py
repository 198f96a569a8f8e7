"""Small helpers shared by the stages: atomic writes and output locations."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

SHARDS = Path("data/shards")
MODELS = Path("models")
METRICS = Path("metrics")
PLOTS = Path("plots")
EXPORTS = Path("exports")


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write next to the target, then rename: readers never see a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")

"""Entry-point wrapper for the stages: load params, run, turn known errors into one line and an exit code.

Exit codes: 2 a params problem (ConfigError); 1 a missing input, a bad value or an OS error such as
a full disk (FileNotFoundError, ValueError, OSError).
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable

from pipeline.config import ConfigError, Params, load_params


def run_stage(fn: Callable[..., object], *args: str) -> None:
    """Load ``params.yaml`` (or ``$VIT_PARAMS``), call ``fn(params, *args)``, exit non-zero on error."""
    path = os.environ.get("VIT_PARAMS", "params.yaml")
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # keep the console to progress lines
    try:
        params: Params = load_params(path)
        fn(params, *args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(1)
    except OSError as exc:  # a full disk, a read-only directory: one line naming the path, not a traceback
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        sys.exit(1)

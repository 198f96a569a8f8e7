#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and activate it.
# Source it: `source scripts/env.sh [test]`. Needs Python 3.11, 3.12 or 3.13 on PATH ($PYTHON, else
# the first supported of python3.11, python3.12, python3.13, python3).
# It installs pip, the pins (requirements.txt, or requirements-test.txt for `test`) and everything
# they pull in, all at the versions of constraints.txt, then the project itself, editable and without dependencies,
# for the `vit-pipeline` command. The environment is rebuilt only when one of those files or
# pyproject.toml changes (a stamp holds their hash, written once every step has succeeded).
# The install runs as a child bash with `set -euo pipefail`: sourcing leaves the caller's shell options
# as they were, and a failed step returns 1 to the caller instead of closing its shell.
_vit_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_vit_venv="${VIT_VENV:-$_vit_root/.venv}"
if [ "${_VIT_ENV_INSTALL:-}" != 1 ]; then
  if ! _VIT_ENV_INSTALL=1 bash "${BASH_SOURCE[0]}" "$@"; then
    unset _vit_root _vit_venv
    return 1 2>/dev/null || exit 1
  fi
  export PATH="$_vit_venv/bin:$PATH"
  export VIRTUAL_ENV="$_vit_venv"
  unset _vit_root _vit_venv
  return 0 2>/dev/null || exit 0
fi

set -euo pipefail
ROOT=$_vit_root
VENV=$_vit_venv
REQ="$ROOT/requirements.txt"
[ "${1:-}" = "test" ] && REQ="$ROOT/requirements-test.txt"
SUPPORTED='import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))'
inputs_hash() { cat "$ROOT"/requirements*.txt "$ROOT/constraints.txt" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16; }
want="$(inputs_hash)-$(basename "$REQ")"
stamp="$VENV/.installed"
if [ -f "$stamp" ] && grep -qx "$want" "$stamp" 2>/dev/null; then
  exit 0
fi
if ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then  # none yet, or one cut short before its pip
  PY="${PYTHON:-}"
  if [ -z "$PY" ]; then
    for cand in python3.11 python3.12 python3.13 python3; do
      if command -v "$cand" >/dev/null && "$cand" -c "$SUPPORTED" 2>/dev/null; then PY="$cand"; break; fi
    done
  fi
  if [ -z "$PY" ] || ! "$PY" -c "$SUPPORTED" 2>/dev/null; then
    echo "[env] need Python 3.11, 3.12 or 3.13 (python3.11, python3.12, python3.13 or python3 on PATH," \
         "or PYTHON=/path/to/python); found ${PY:-python3}: $( ("${PY:-python3}" -V) 2>&1 | head -1)" >&2
    exit 1
  fi
  echo "[env] creating $VENV with $("$PY" -V 2>&1) (first run installs torch, ray, mlflow, dvc: a few minutes)" >&2
  "$PY" -m venv --clear "$VENV"
fi
rm -f "$stamp"  # until every step below has succeeded
"$VENV/bin/python" -m pip install --quiet --upgrade pip -c "$ROOT/constraints.txt" >&2
"$VENV/bin/python" -m pip install --quiet -r "$REQ" -c "$ROOT/constraints.txt" >&2
# The project: editable, no dependencies (the lock above has them), built with the lock's setuptools,
# without setuptools' informational "Editable installation" banner (about ten lines on every first run).
PYTHONWARNINGS="ignore:Editable installation" \
  "$VENV/bin/python" -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT" >&2
# A test env satisfies the runtime one too; record what was installed.
echo "$want" > "$stamp"
if [ "$(basename "$REQ")" = requirements-test.txt ]; then echo "$(inputs_hash)-requirements.txt" >> "$stamp"; fi

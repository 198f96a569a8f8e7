#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and activate it.
# Source it: `source scripts/env.sh [test]`. Needs Python 3.11, 3.12 or 3.13 on PATH ($PYTHON, else
# the first supported of python3.11, python3.12, python3.13, python3).
# It installs uv (a wheel, hash-checked) with the venv's pip, then has uv make the venv exactly the lock:
# requirements.lock, or requirements-test.lock for `test` (every package hashed; scripts/lock.sh writes
# both), and installs the project itself, editable and without dependencies, for the `vit-pipeline`
# command. Nothing runs when the lock and pyproject.toml are as last installed (a stamp holds their hash,
# written once every step has succeeded); a changed lock re-syncs only the packages that changed.
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
LOCK="$ROOT/requirements.lock"
[ "${1:-}" = "test" ] && LOCK="$ROOT/requirements-test.lock"
SUPPORTED='import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))'
inputs_hash() { cat "$1" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16; }
want="$(inputs_hash "$LOCK")-$(basename "$LOCK")"
stamp="$VENV/.installed"
if [ -f "$stamp" ] && grep -qx "$want" "$stamp" 2>/dev/null; then
  exit 0
fi
if ! "$VENV/bin/uv" --version >/dev/null 2>&1; then  # none yet, or one cut short before its uv
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
  echo "[env] creating $VENV with $("$PY" -V 2>&1) from $(basename "$LOCK") (uv; a first run downloads torch, ray, mlflow, dvc)" >&2
  "$PY" -m venv --clear "$VENV"
  # uv's own entry of the lock (name, version, hashes), installed by pip with every hash checked
  uv_entry="$(mktemp)"
  trap 'rm -f "$uv_entry"' EXIT
  awk '/^uv==/ {on = 1} on && /^[a-z]/ && !/^uv==/ {on = 0} on && !/^ *#/' "$LOCK" | sed 's/ *;[^\\]*//' > "$uv_entry"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
    --require-hashes -r "$uv_entry" >&2
fi
rm -f "$stamp"  # until every step below has succeeded
# exactly the lock: what it lacks is removed, what differs is replaced, each artifact hash-checked.
# Compiled to bytecode now: where Python may not write it (PYTHONDONTWRITEBYTECODE, a read-only venv)
# every process, each Ray worker included, would compile the ~1,400 modules a stage imports (2-3 s).
"$VENV/bin/uv" pip sync --quiet --compile-bytecode --python "$VENV/bin/python" --require-hashes "$LOCK" >&2
# The project: editable, no dependencies (the lock has them), built with the lock's setuptools.
"$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" --no-deps --no-build-isolation -e "$ROOT" >&2
# A test env holds the runtime one too (scripts/lock.sh resolves it at the test lock's versions).
echo "$want" > "$stamp"
if [ "$LOCK" = "$ROOT/requirements-test.lock" ]; then
  echo "$(inputs_hash "$ROOT/requirements.lock")-requirements.lock" >> "$stamp"
fi

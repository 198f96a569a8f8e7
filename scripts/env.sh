#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and activate it.
# Source it: `source scripts/env.sh [test]`. Needs only python3.11 on PATH.
# The environment is rebuilt only when requirements*.txt change (a stamp holds their hash).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VIT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
REQ="$ROOT/requirements.txt"
[ "${1:-}" = "test" ] && REQ="$ROOT/requirements-test.txt"
want="$(cat "$ROOT"/requirements*.txt | sha256sum | cut -c1-16)-$(basename "$REQ")"
stamp="$VENV/.installed"
if [ ! -f "$stamp" ] || ! grep -qx "$want" "$stamp" 2>/dev/null; then
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"need Python 3.11, found {sys.version}"'
    echo "[env] creating $VENV (first run installs torch, ray, mlflow, dvc: a few minutes)" >&2
    "$PY" -m venv "$VENV"
  fi
  "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
  "$VENV/bin/python" -m pip install --quiet -r "$REQ" >&2
  # A test env satisfies the runtime one too; record what was installed.
  echo "$want" > "$stamp"
  [ "$(basename "$REQ")" = requirements-test.txt ] && \
    echo "$(cat "$ROOT"/requirements*.txt | sha256sum | cut -c1-16)-requirements.txt" >> "$stamp"
fi
export PATH="$VENV/bin:$PATH"
export VIRTUAL_ENV="$VENV"

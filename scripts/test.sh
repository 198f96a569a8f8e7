#!/usr/bin/env bash
# Run the test suite: creates .venv (with test extras) on first use, installs the browser the MLflow
# UI test drives (Debian's Chromium) when it is missing, lints with ruff (pyproject.toml's settings),
# then pytest on 2 processes (pytest-xdist).
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k config`; `-n 0` runs in one process).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh test
if [ ! -x /usr/bin/chromium ]; then
  echo "[test] installing Chromium for tests/test_mlflow_ui.py: apt-get install chromium fonts-dejavu-core" >&2
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  { DEBIAN_FRONTEND=noninteractive $sudo apt-get update -q &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
  } >&2 || echo "[test] warning: could not install Chromium; tests/test_mlflow_ui.py will fail" >&2
fi
echo "[test] ruff check" >&2
ruff check --quiet .
# The project's own modules as bytecode (what scripts/env.sh does for the packages): where Python may not
# write it (PYTHONDONTWRITEBYTECODE), each of the suite's few hundred stage and Ray worker processes
# compiled them again. tests/repo_copy.py copies it along.
python -m compileall -q pipeline stages benchmarks tests
# Two processes, each test file whole in one of them (its module fixtures, e.g. the dvc repro, run once):
# most of a slow test is waiting on Ray / DVC / MLflow start-up, so two share 2 cores well. Files go
# out in collection order, the longest first (tests/conftest.py: LONGEST_FIRST).
exec python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"

#!/usr/bin/env bash
# Run the test suite: creates .venv (with test extras) on first use, installs the browser the MLflow
# UI test drives (Debian's Chromium) when it is missing, then pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k config`).
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
exec python -m pytest "$@"

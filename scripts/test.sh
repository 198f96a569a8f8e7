#!/usr/bin/env bash
# Run the test suite: creates .venv (with test extras) on first use, then pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k config`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh test
exec python -m pytest "$@"

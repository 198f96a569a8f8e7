#!/usr/bin/env bash
# Resolve the pins into the locks scripts/env.sh installs: requirements-test.txt into requirements-test.lock,
# then requirements.txt into requirements.lock at the test lock's versions (so the test environment is the
# pipeline's plus the test tools). One lock serves Linux and macOS, x86 and ARM, Python 3.11-3.13, and
# every artifact is hashed. A version already locked is kept unless a pin needs another (uv prefers the
# output file's versions). Run it after changing a pin, then `bash scripts/test.sh`:
# tests/test_package.py fails while a pin and its lock disagree.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh test  # for uv
compile() { uv pip compile --quiet --universal --generate-hashes --python-version 3.11 "$@"; }
compile requirements-test.txt -o requirements-test.lock
compile requirements.txt -c requirements-test.lock -o requirements.lock
echo "[lock] requirements-test.lock and requirements.lock resolved; run bash scripts/test.sh" >&2

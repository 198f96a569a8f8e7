"""Before infra/submit.sh uploads anything: is there a Ray token, and does the job API take it?

    python infra/job_api_check.py http://HEAD:8265

Ray's own client fails on a missing token or an unreachable head with a traceback, after the upload is
packed; this says which, in one line, exit 2. The token is found where Ray looks, in Ray's order:
``RAY_AUTH_TOKEN``, the file ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``.
"""
from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

FETCH_TOKEN = "the head's: bash infra/ray-head.sh token, on the head"


def find_token() -> tuple[str, str]:
    """(token, where it came from); the token is "" when there is none."""
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if token:
        return token, "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    try:
        return Path(path).read_text().strip(), path
    except OSError:
        return "", path


def problem(address: str) -> str | None:
    """What stops a job from being submitted to ``address`` with this machine's token, or None."""
    token, where = find_token()
    if not token:
        return (f"no Ray token: set RAY_AUTH_TOKEN, or RAY_AUTH_TOKEN_PATH to its file, or put it in "
                f"~/.ray/auth_token ({FETCH_TOKEN})")
    address = address.rstrip("/")
    if not address.startswith(("http://", "https://")):  # another form Ray accepts: Ray's client says
        return None
    request = urllib.request.Request(f"{address}/api/version", headers={"Authorization": f"Bearer {token}"})
    try:
        urllib.request.urlopen(request, timeout=15).close()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            return f"the Ray job API at {address} refused the token from {where} (HTTP {exc.code}): use {FETCH_TOKEN}"
        return (f"{address}/api/version answered HTTP {exc.code}: RAY_API_SERVER_ADDRESS (or --address) names no "
                f"Ray job API")
    except (OSError, ValueError) as exc:
        return (f"no Ray job API at {address} ({getattr(exc, 'reason', exc)}): set RAY_API_SERVER_ADDRESS (or "
                f"--address) to the head's; on this machine: bash infra/ray-head.sh start, then source its env")
    return None


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(f"usage: python {sys.argv[0]} JOB_API_URL")
    found = problem(sys.argv[1])
    if found:
        print(f"submit: {found}", file=sys.stderr)
        sys.exit(2)

#!/usr/bin/env bash
# MLflow tracking server (UI + REST API + artifact proxy) for the pipeline. Runs in the foreground.
#
#   bash infra/mlflow-server.sh                      # http://127.0.0.1:5000, <repo>/mlflow.db + <repo>/mlartifacts
#   MLFLOW_PORT=5001 bash infra/mlflow-server.sh
#   then: export MLFLOW_TRACKING_URI=http://127.0.0.1:5000 (your MLFLOW_PORT; for the stages, infra/submit.sh)
#
# Environment (defaults in brackets):
#   MLFLOW_HOST                  bind address; 0.0.0.0 to serve a cluster  [127.0.0.1]
#   MLFLOW_PORT                  [5000]
#   MLFLOW_BACKEND_STORE_URI     sqlite:///ABS/PATH.db or postgresql://user:pass@host:5432/mlflow
#                                [sqlite:///<repo>/mlflow.db — the store the stages use by default]
#   MLFLOW_ARTIFACTS_DESTINATION where the server stores run artifacts: a directory or s3://bucket/prefix
#                                (clients upload through the server: workers need no bucket access)
#                                [<repo>/mlartifacts]
#   MLFLOW_ALLOWED_HOSTS         Host headers accepted (DNS-rebinding guard). Default: localhost and
#                                private IPs. Behind a name or public IP list it; the list replaces the
#                                default, so keep localhost (an `ssh -L` tunnel sends it), e.g.
#                                "mlflow.internal:5000,localhost:*,127.0.0.1:*". Never "*" on an open network.
#   MLFLOW_CORS_ALLOWED_ORIGINS  only if a browser app on another origin calls the API
#   MLFLOW_WORKERS               uvicorn workers  [2]
# On a cluster: MLFLOW_HOST=0.0.0.0 on a machine the nodes reach, Postgres as the backend, artifacts in
# the bucket, the port open only to the cluster (and to you, e.g. via `ssh -L 5000:localhost:5000`).
# The server has no login of its own: keep it on a private network or behind an authenticating proxy.
# Extra arguments go to `mlflow server`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

host=${MLFLOW_HOST:-127.0.0.1}
port=${MLFLOW_PORT:-5000}
workers=${MLFLOW_WORKERS:-2}
backend=${MLFLOW_BACKEND_STORE_URI:-sqlite:///$root/mlflow.db}
artifacts=${MLFLOW_ARTIFACTS_DESTINATION:-$root/mlartifacts}

# Checked before anything is created: `mlflow server` creates the store, then exits 0 when it cannot
# bind its port (uvicorn only logs it), and the stages would log to whatever holds the port.
die() { echo "mlflow-server: $*" >&2; exit 2; }
command -v mlflow >/dev/null || die "mlflow not found on PATH (source .venv/bin/activate)"
[[ $port =~ ^[0-9]+$ ]] || die "MLFLOW_PORT=$port is not a port number"
[[ $workers =~ ^[1-9][0-9]*$ ]] || die "MLFLOW_WORKERS=$workers is not a whole number above 0"
probe=$host
[[ $host == 0.0.0.0 || $host == "::" ]] && probe=127.0.0.1
if (exec 3<>"/dev/tcp/$probe/$port") 2>/dev/null; then
  echo "mlflow-server: port $port (MLFLOW_PORT) on $probe is already in use: stop what holds it, or set MLFLOW_PORT to a free port" >&2
  exit 1
fi
case $artifacts in *://*) ;; *) mkdir -p "$artifacts"; artifacts=$(cd "$artifacts" && pwd) ;; esac

# The store's URI (a database password in it) goes by the environment, which `mlflow server` reads, not on
# the long-running server's command line, which every user of the machine can read with ps.
export MLFLOW_BACKEND_STORE_URI=$backend
args=(--artifacts-destination "$artifacts" --serve-artifacts
      --host "$host" --port "$port" --workers "$workers")
[[ -n ${MLFLOW_ALLOWED_HOSTS:-} ]] && args+=(--allowed-hosts "$MLFLOW_ALLOWED_HOSTS")
[[ -n ${MLFLOW_CORS_ALLOWED_ORIGINS:-} ]] && args+=(--cors-allowed-origins "$MLFLOW_CORS_ALLOWED_ORIGINS")
# The pipeline uses no server-side MLflow jobs: skip the job runner and its worker processes.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}
# No usage telemetry from a private server (without egress it also delays shutdown by seconds).
export MLFLOW_DISABLE_TELEMETRY=${MLFLOW_DISABLE_TELEMETRY:-true}

echo "MLflow: http://$host:$port  backend ${backend%%://*}://…  artifacts $artifacts" >&2
exec mlflow server "${args[@]}" "$@"

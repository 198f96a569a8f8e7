#!/usr/bin/env bash
# Submit the training stages to a Ray cluster as one Ray job, and wait for it (exit 1 unless it
# succeeds: a job that fails, or that `ray job stop` stops).
#
#   bash infra/submit.sh [ray job submit options] [-- ENTRYPOINT ...]
#   bash infra/submit.sh                                  # pretrain finetune evaluate export
#   bash infra/submit.sh -- bash infra/job.sh shard-pretrain shard-finetune pretrain
#   bash infra/submit.sh --no-wait --submission-id vit-42 # then: RAY_AUTH_MODE=token ray job logs -f vit-42
#
# The repository (this script's parent directory) is uploaded as the job's working dir, without
# .git (excluded here) and everything .gitignore'd (Ray honours it) — data/shards, models/, exports/,
# mlflow.db, .venv — so inputs
# and outputs never travel with the upload: the job (infra/job.sh) reads shards from and writes
# models / metrics / plots / Ray checkpoints to VIT_WORKSPACE, a directory every node mounts at the
# same path (NFS, EFS, a local path for a one-machine cluster) or an s3:// prefix. See infra/README.md.
# Before uploading, it runs the job's own checks here (`job.sh --check`: stage names, workspace, params),
# checks that the params files travel with the upload, and asks the job API whether it takes the token:
# each problem is one line and exit 2, nothing submitted.
#
# Environment:
#   RAY_API_SERVER_ADDRESS  job API of the head  [http://127.0.0.1:8265]; --address URL says it too
#   RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH   the cluster's token (else ~/.ray/auth_token)
#   VIT_WORKSPACE           where the job's inputs and outputs live, as the cluster sees it  (required)
#   VIT_PARAMS              params file, relative to the repo root  [params.yaml]
#   VIT_PARAMS_OVERLAY      keys merged over it in the job, e.g. infra/params.cluster.yaml (GPU Ray section)
#   MLFLOW_TRACKING_URI     tracking server the job logs to (an http:// URL reachable from the
#                           cluster; unset: sqlite in the workspace, shared paths only)
#   VIT_SHARDS_URL, AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3, AWS_DEFAULT_REGION, AWS_REGION   passed on when set
#   VIT_JOB_ENV             extra NAME=VALUE pairs (space separated) for the job's environment
# The job also gets VIT_GIT_COMMIT / VIT_GIT_DIRTY, this checkout's commit and state, for its runs' tags.
# AWS credentials are NOT put in the job's runtime env (the dashboard shows it): give the nodes an
# instance role / IRSA, or their own ~/.aws, or VIT_JOB_ENV at your own risk.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

opts=()
while [[ $# -gt 0 && $1 != -- ]]; do
  # after the cd above: "$0" may be relative to the caller's directory, infra/submit.sh is not
  case $1 in -h|--help) sed -n '2,/^set -euo/p' infra/submit.sh | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
  opts+=("$1"); shift
done
[[ ${1:-} == -- ]] && shift
entry=("$@")
[[ ${#entry[@]} -gt 0 ]] || entry=(bash infra/job.sh pretrain finetune evaluate export)

die() { echo "submit: $*" >&2; exit 2; }
[[ -n ${VIT_WORKSPACE:-} ]] || die "set VIT_WORKSPACE to a shared path or s3:// prefix the cluster can reach (see infra/README.md)"
# A relative path would resolve inside the job's uploaded working dir (job.sh cd's to it there): the
# outputs would land in a temp dir on one node and be lost.
[[ $VIT_WORKSPACE == /* || $VIT_WORKSPACE == *://* ]] ||
  die "VIT_WORKSPACE=$VIT_WORKSPACE must be an absolute path (as the cluster's nodes mount it) or an s3:// prefix"
command -v python >/dev/null || die "python not found on PATH (source .venv/bin/activate)"

# What the upload leaves out beside what .gitignore names (Ray honours it); rooted, so that a folder of
# the same name deeper down (pipeline/metrics/, say) still travels.
EXCLUDES=(/.git /docs /benchmarks /tests /.dvc/cache /.dvc/tmp /metrics /plots)
uploaded() {  # VAR FILE: the file must reach the job with the working dir; prints its path there
  local var=$1 file=$2 rel ex
  rel=$(python -c 'import os, sys; print(os.path.relpath(os.path.join(sys.argv[2], sys.argv[1]), sys.argv[2]))' "$file" "$PWD")
  [[ $rel != ../* ]] || die "$var=$file is outside the repository: the upload does not carry it"
  for ex in "${EXCLUDES[@]}"; do
    [[ /$rel != "$ex"/* ]] || die "$var=$file is under ${ex#/}/, which the upload leaves out: put it elsewhere"
  done
  ! git check-ignore -q -- "$rel" 2>/dev/null || die "$var=$file is .gitignore'd: the upload leaves it out"
  echo "$rel"
}
params=${VIT_PARAMS:-params.yaml}
[[ $params != /* ]] || die "VIT_PARAMS=$params must be relative to the repo root (the file is uploaded with it)"
[[ -f $params ]] || die "VIT_PARAMS=$params: no such file in $PWD"
params=$(uploaded VIT_PARAMS "$params") || exit 2
if [[ -n ${VIT_PARAMS_OVERLAY:-} ]]; then
  [[ $VIT_PARAMS_OVERLAY != /* ]] || die "VIT_PARAMS_OVERLAY=$VIT_PARAMS_OVERLAY must be relative to the repo root"
  [[ -f $VIT_PARAMS_OVERLAY ]] || die "VIT_PARAMS_OVERLAY=$VIT_PARAMS_OVERLAY: no such file in $PWD"
  VIT_PARAMS_OVERLAY=$(uploaded VIT_PARAMS_OVERLAY "$VIT_PARAMS_OVERLAY") || exit 2
fi
# VIT_JOB_ENV: NAME=VALUE pairs, but not the variables this script checks and passes itself.
set -f; pairs=(${VIT_JOB_ENV:-}); set +f
for pair in ${pairs[@]+"${pairs[@]}"}; do
  [[ $pair =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] ||
    die "VIT_JOB_ENV: '$pair' is not NAME=VALUE (space-separated pairs; a value cannot hold a space)"
  case ${pair%%=*} in VIT_WORKSPACE|VIT_PARAMS|VIT_PARAMS_OVERLAY|VIT_GIT_*)
    die "VIT_JOB_ENV: ${pair%%=*} is checked and passed by submit.sh: set it as itself" ;;
  esac
done
# The job's own checks (its stages, the workspace, the params), here, before anything is uploaded.
stages=()
[[ ${entry[0]} == bash && ${entry[1]:-} == infra/job.sh ]] && stages=("${entry[@]:2}")
env ${pairs[@]+"${pairs[@]}"} VIT_PARAMS="$params" bash infra/job.sh --check ${stages[@]+"${stages[@]}"} >/dev/null ||
  exit 2

# Ray's `job submit` exits 1 for a failed job but 0 for a stopped one: name the job, to ask how it ended.
job_id="" no_wait=false
for i in "${!opts[@]}"; do
  case ${opts[i]} in
    --submission-id|--address)  # the value is the next option: not there, or an option itself
      [[ -n ${opts[i+1]:-} && ${opts[i+1]} != -* ]] || die "${opts[i]} needs a value (got '${opts[i+1]:-}')" ;;
  esac
  case ${opts[i]} in
    --no-wait) no_wait=true ;;
    --submission-id) job_id=${opts[i+1]} ;;
    --submission-id=*) job_id=${opts[i]#*=} ;;
    --address) RAY_API_SERVER_ADDRESS=${opts[i+1]} ;;  # the head the job goes to is the one to ask
    --address=*) RAY_API_SERVER_ADDRESS=${opts[i]#*=} ;;
  esac
done
if [[ -z $job_id ]]; then
  job_id=vit-$(date +%Y%m%d-%H%M%S)-$RANDOM
  opts+=(--submission-id "$job_id")
fi

export RAY_AUTH_MODE=token
address=${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}
# The token and the job API, asked before the upload: Ray's own client fails on either with a traceback.
python infra/job_api_check.py "$address" || exit 2

runtime_env=$(VIT_PARAMS=$params EXCLUDES="${EXCLUDES[*]}" python - ${pairs[@]+"${pairs[@]}"} <<'EOF'
import json, os, sys
from pipeline.tracking import GIT_ENV, git_info
names = ["VIT_WORKSPACE", "VIT_PARAMS", "VIT_PARAMS_OVERLAY", "VIT_SHARDS_URL", "MLFLOW_TRACKING_URI",
         "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION"]
env = {k: os.environ[k] for k in names if os.environ.get(k)}
# the upload has no .git: the runs' git.commit / git.dirty tags (and pipeline run) come from this checkout
env.update({GIT_ENV[k]: v for k, v in git_info().items() if v != "unknown"})
env.update(pair.split("=", 1) for pair in sys.argv[1:])  # VIT_JOB_ENV's pairs, as checked above
print(json.dumps({"env_vars": env, "excludes": os.environ["EXCLUDES"].split()}))
EOF
)

ray job submit --address "$address" --working-dir . --runtime-env-json "$runtime_env" "${opts[@]}" -- "${entry[@]}"
$no_wait && exit 0
status=$(python -c 'import sys; from ray.job_submission import JobSubmissionClient
print(JobSubmissionClient(sys.argv[1]).get_job_status(sys.argv[2]).value)' "$address" "$job_id" 2>/dev/null) || status=unknown
[[ $status == SUCCEEDED ]] || {
  echo "submit: job $job_id ended $status, not SUCCEEDED (its log: RAY_AUTH_MODE=token ray job logs --address $address $job_id)" >&2
  exit 1; }

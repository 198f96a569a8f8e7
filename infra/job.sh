#!/usr/bin/env bash
# Ray job entrypoint (see infra/submit.sh): run pipeline stages with inputs and outputs in a workspace
# outside the uploaded working dir.
#
#   bash infra/job.sh [STAGE ...]   STAGE: shard-pretrain shard-finetune pretrain finetune evaluate export,
#                                   or sweep:FILE (`vit-pipeline sweep FILE`, FILE relative to the repo
#                                   root; its sweeps/ lands in the workspace)
#                                   (default: pretrain finetune evaluate export)
#   bash infra/job.sh --check [STAGE ...]   only the checks below, nothing created (infra/submit.sh runs
#                                   them before it uploads: a job that can only fail never starts)
#
# VIT_WORKSPACE (required):
#   a path  the stages run with it as their current directory, so data/shards/, models/, metrics/,
#           plots/, exports/, .ray_results/ (Ray checkpoints) and, without MLFLOW_TRACKING_URI,
#           mlflow.db are all read and written there. On a multi-node cluster it must be mounted at
#           the same path on every node (NFS, EFS, Filestore, a PVC with ReadWriteMany).
#   s3://…  the workspace is mirrored through a local scratch dir ($VIT_SCRATCH, default derived
#           from the URL so a re-run lands on the same path and resumes the same Ray run): the
#           stages' inputs (shards, models, the training curves evaluate draws) are pulled first,
#           each stage's outputs pushed right after it. Put Ray checkpoints in the bucket too
#           (`ray.storage_path: s3://…`) and set MLFLOW_TRACKING_URI.
# VIT_PARAMS: params file, relative to the repo root (the uploaded working dir) or absolute.
# VIT_PARAMS_OVERLAY: optional overlay merged into it (infra/params.cluster.yaml: the GPU Ray section).
# Runs anywhere the repo and its venv are: on the submitter too (e.g. to shard into the workspace).
set -euo pipefail

die() { echo "job: $*" >&2; exit 2; }
case ${1:-} in -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
check_only=false
[[ ${1:-} == --check ]] && { check_only=true; shift; }
code=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ws=${VIT_WORKSPACE:-}
[[ -n $ws ]] || die "set VIT_WORKSPACE (a shared path or s3:// prefix)"
stages=("$@")
[[ ${#stages[@]} -gt 0 ]] || stages=(pretrain finetune evaluate export)
for s in "${stages[@]}"; do
  case $s in shard-pretrain|shard-finetune|pretrain|finetune|evaluate|export) ;;
    sweep:*) f=${s#sweep:}; [[ $f == /* ]] || f=$code/$f
      [[ -f $f ]] || die "$s: no sweep file $f (give it relative to the repository root)" ;;
    *) die "unknown stage '$s' (valid: shard-pretrain shard-finetune pretrain finetune evaluate export sweep:FILE)" ;;
  esac
done
[[ $ws != *://* || -n ${MLFLOW_TRACKING_URI:-} ]] ||
  die "with an object-store workspace set MLFLOW_TRACKING_URI (a tracking server): a local mlflow.db would be lost"
command -v python >/dev/null || die "python not found on PATH (source .venv/bin/activate)"
params=${VIT_PARAMS:-params.yaml}
[[ $params == /* ]] || params=$code/$params
export PYTHONPATH=$code${PYTHONPATH:+:$PYTHONPATH}
# The params, checked before anything is created (exit 2 naming the file and key).
given="$params${VIT_PARAMS_OVERLAY:+ + overlay $VIT_PARAMS_OVERLAY}"
if [[ -n ${VIT_PARAMS_OVERLAY:-} ]]; then  # e.g. infra/params.cluster.yaml: only the keys that differ
  overlay=$VIT_PARAMS_OVERLAY
  [[ $overlay == /* ]] || overlay=$code/$overlay
  merged=$(mktemp -d)/params.yaml
  trap 'rm -rf "${merged%/*}"' EXIT
  python "$code/infra/params_overlay.py" "$params" "$overlay" "$merged" || exit 2
  params=$merged
else
  python -c 'import sys; from pipeline.config import ConfigError, load_params
try: load_params(sys.argv[1])
except ConfigError as e: sys.exit(f"job: VIT_PARAMS: {e}")' "$params" || exit 2
fi
export VIT_PARAMS=$params
if $check_only; then echo "[job] checked: workspace $ws, params $given, stages: ${stages[*]}"; exit 0; fi

# What each stage reads and writes, relative to the workspace (for an object-store workspace).
inputs() {  # with VIT_SHARDS_URL the stages stream shards from there: no local copy needed
  local shards=""
  case $1 in
    pretrain) shards=data/shards/pretrain ;;
    finetune|evaluate|export) shards=data/shards/finetune ;;
    sweep:*) shards="data/shards/pretrain data/shards/finetune" ;;  # either stage's; missing ones are fine
  esac
  [[ -n ${VIT_SHARDS_URL:-} ]] && shards=""
  case $1 in
    shard-*) ;;
    pretrain) echo "$shards" ;;
    finetune|sweep:*) echo "$shards models/pretrain" ;;
    evaluate) echo "$shards models/finetune plots" ;;  # plots: the training curves it draws together
    export) echo "$shards models/finetune" ;;
  esac
}
outputs() {
  case $1 in
    shard-*) echo "data/shards/${1#shard-}" ;;
    pretrain|finetune) echo "models/$1 metrics plots" ;;
    evaluate) echo "metrics plots" ;;
    export) echo "exports metrics" ;;
    sweep:*) echo "sweeps" ;;
  esac
}

remote=""
case $ws in
  *://*)
    remote=${ws%/}
    ws=${VIT_SCRATCH:-${TMPDIR:-/tmp}/vit-ws-$(printf '%s' "$remote" | sha256sum | cut -c1-12)}
    mkdir -p "$ws" 2>/dev/null || die "cannot create the scratch dir $ws (VIT_SCRATCH, or TMPDIR it is made in)"
    cd "$ws"
    # Inputs that no earlier stage of this job produces, pulled in one go. plots/ is pulled even after a
    # training stage of the job: each writes only its own files there (evaluate also reads the other's).
    pulls=() made=" "
    for s in "${stages[@]}"; do
      for d in $(inputs "$s"); do
        [[ ($d != plots && $made == *" $d "*) || " ${pulls[*]:-} " == *" $remote/$d "* ]] || pulls+=("$remote/$d" "$d")
      done
      for d in $(outputs "$s"); do made+="$d "; done
    done
    [[ ${#pulls[@]} -eq 0 ]] || python -m pipeline.storage pull --missing-ok "${pulls[@]}"
    ;;
  *)
    mkdir -p "$ws" 2>/dev/null || die "cannot create the workspace VIT_WORKSPACE=$ws (a folder this machine can write)"
    cd "$ws"
    ;;
esac

echo "[job] workspace $(pwd)${remote:+ (mirror of $remote)}, params $VIT_PARAMS, stages: ${stages[*]}"
for s in "${stages[@]}"; do
  case $s in
    shard-*) python -m stages.shard "${s#shard-}" ;;
    sweep:*) f=${s#sweep:}; [[ $f == /* ]] || f=$code/$f; python -m pipeline sweep "$f" ;;
    *) python -m stages."$s" ;;
  esac
  if [[ -n $remote ]]; then  # publish this stage's outputs before the next stage starts
    pushes=()
    for out in $(outputs "$s"); do pushes+=("$out" "$remote/$out"); done
    python -m pipeline.storage push --keep --missing-ok "${pushes[@]}"
  fi
done
echo "[job] done: ${stages[*]}"

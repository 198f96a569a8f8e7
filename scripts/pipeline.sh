#!/usr/bin/env bash
# Run the default pipeline end to end: creates .venv on first use, then `dvc repro`.
# Extra arguments go to `dvc repro` (e.g. `bash scripts/pipeline.sh -f finetune`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
start=$(date +%s)
dvc repro "$@"
echo
echo "pipeline finished in $(( $(date +%s) - start )) s. Results:"
echo "  metrics:  dvc metrics show      (metrics/*.json)"
echo "  plots:    dvc plots show        (plots/*.csv -> dvc_plots/index.html)"
echo "  models:   models/pretrain, models/finetune; exports/ (safetensors, TorchScript, ONNX)"
echo "  runs:     .venv/bin/mlflow ui, then the link each stage printed as 'MLflow runs:' (its model-training view;"
echo "            or press 'Model training' at the top left once: MLflow 3.17 opens on its GenAI view otherwise)"

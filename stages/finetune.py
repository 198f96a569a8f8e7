"""DVC stage `finetune`: models/pretrain fine-tuned on data/shards/finetune -> models/finetune (pipeline.train.stage).

Reads params `model`, `finetune`, `ray`, `mlflow`, models/pretrain/ (or `finetune.init`) and
data/shards/finetune/; writes models/finetune/, metrics/finetune.json, plots/finetune_history.csv,
plots/finetune_curves.png, Ray checkpoints and an MLflow run.
"""
import sys

from pipeline.cli import run_stage
from pipeline.train.stage import finetune

if __name__ == "__main__":
    run_stage(finetune, *sys.argv[1:])

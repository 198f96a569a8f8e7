"""DVC stage `pretrain`: a ViT from scratch on data/shards/pretrain -> models/pretrain (pipeline.train.stage).

Reads params `model`, `pretrain`, `ray`, `mlflow` and data/shards/pretrain/ (or $VIT_SHARDS_URL); writes
models/pretrain/ (model.safetensors, config.json), metrics/pretrain.json, plots/pretrain_history.csv,
plots/pretrain_curves.png, Ray checkpoints in .ray_results/ (or `ray.storage_path`) and an MLflow run.
"""
import sys

from pipeline.cli import run_stage
from pipeline.train.stage import pretrain

if __name__ == "__main__":
    run_stage(pretrain, *sys.argv[1:])

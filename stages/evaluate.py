"""DVC stage `evaluate`: models/finetune on the test split -> metrics/evaluate.json and plots/ (pipeline.evaluation).

Reads params `evaluate`, `finetune.interpolation`, `ray`, models/finetune/, data/shards/finetune/ and
plots/*_history.csv; writes metrics/evaluate.json, plots/ (confusion.csv, per_class.csv, curves.png,
confusion.png, attention.png) and an MLflow run.
"""
import sys

from pipeline.cli import run_stage
from pipeline.evaluation import evaluate

if __name__ == "__main__":
    run_stage(evaluate, *sys.argv[1:])

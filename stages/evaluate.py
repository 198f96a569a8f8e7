"""DVC stage `evaluate`: see pipeline.evaluate.evaluate."""
from pipeline.cli import run_stage
from pipeline.evaluate import evaluate

if __name__ == "__main__":
    run_stage(evaluate)

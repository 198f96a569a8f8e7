"""DVC stage `finetune`: see pipeline.train.stages.finetune."""
from pipeline.cli import run_stage
from pipeline.train.stages import finetune

if __name__ == "__main__":
    run_stage(finetune)

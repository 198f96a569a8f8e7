"""DVC stage `pretrain`: see pipeline.train.stages.pretrain."""
from pipeline.cli import run_stage
from pipeline.train.stages import pretrain

if __name__ == "__main__":
    run_stage(pretrain)

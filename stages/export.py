"""DVC stage `export`: see pipeline.export.export."""
from pipeline.cli import run_stage
from pipeline.export import export

if __name__ == "__main__":
    run_stage(export)

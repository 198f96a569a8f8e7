"""DVC stage `export`: models/finetune -> exports/ (safetensors, TorchScript, ONNX; pipeline.exporter).

Reads params `export`, models/finetune/ and test images from data/shards/finetune/; writes exports/
(config.json always; model.safetensors, model.torchscript.pt, model.onnx as `export.formats` lists),
metrics/export.json, an MLflow run and a new version of the registered model
`export.registered_model_name`.
"""
import sys

from pipeline.cli import run_stage
from pipeline.exporter import export

if __name__ == "__main__":
    run_stage(export, *sys.argv[1:])

"""The export stage: safetensors, TorchScript and ONNX, each reloaded and checked against PyTorch."""
from __future__ import annotations

import contextlib
import io
import sys
import warnings
from pathlib import Path

import mlflow
import numpy as np
import torch

from pipeline import pipeline_run, storage
from pipeline.config import ExportConfig, Params
from pipeline.data import make_eval_loader, read_dataset_info, require_classes, require_split
from pipeline.data.augment import eval_augment
from pipeline.model import VisionTransformer, load_model, save_config, save_model
from pipeline.outputs import staged_outputs
from pipeline.predict import MODEL_FILES, RUNNERS
from pipeline.registry import EXPORT_ARTIFACTS, model_run_tag, record_version
from pipeline.tracking import stage_run
from pipeline.utils import EXPORTS, MODELS, atomic_write_json, metrics_path

# The model's code travels with it; by location, not "pipeline" relative to the current directory
# (a cluster job runs in its workspace, not in the checkout).
PACKAGE_DIR = str(Path(__file__).resolve().parent)
# What loading the logged model imports (its code imports torch and safetensors; pyfunc numpy), pinned
# to this environment; MLflow adds itself. Named, not inferred: MLflow's inference imports the model
# again in a subprocess (~10 s of every export here) and lists whatever else that loaded.
SERVING_PACKAGES = ("torch", "safetensors", "numpy", "cloudpickle")


def sample_images(shard_dir, n: int, image_size: int, normalize: dict) -> torch.Tensor:
    """The first ``n`` real test images, preprocessed exactly as in evaluation."""
    batches, got = [], 0
    for images, _ in make_eval_loader(shard_dir, "test", batch_size=min(n, 256), image_size=image_size,
                                      rank=0, world_size=1, augment=normalize):
        batches.append(images)
        got += len(images)
        if got >= n:
            break
    return torch.cat(batches)[:n]


def export_torchscript(model: VisionTransformer, example: torch.Tensor, path: Path) -> None:
    with warnings.catch_warnings():  # shape checks become constants: intended, the size is fixed
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", FutureWarning)  # "torch.jit is deprecated": the format is asked for
        traced = torch.jit.trace(model, example[:2], check_trace=False)
    traced.save(str(path))


def export_onnx(model: VisionTransformer, example: torch.Tensor, path: Path, opset: int) -> None:
    """Dynamic batch; the position embeddings are those of the export resolution (fixed H×W)."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    torch.onnx.export(model, (example[:2],), str(path), input_names=["images"], output_names=["logits"],
                      opset_version=opset, dynamo=True, dynamic_shapes={"x": {0: batch}},
                      external_data=False, verbose=False)


def _compare(reference: torch.Tensor, other: np.ndarray | torch.Tensor) -> dict[str, float]:
    other = torch.as_tensor(np.asarray(other))
    return {"max_abs_diff": (reference - other).abs().max().item(),
            "top1_agreement": (reference.argmax(1) == other.argmax(1)).float().mean().item()}


def within_limits(result: dict[str, float], cfg: ExportConfig) -> bool:
    """A format's parity within the limits; a NaN difference (a format that computes NaN) is not."""
    return result["max_abs_diff"] <= cfg.max_abs_diff and result["top1_agreement"] >= cfg.min_top1_agreement


# What MLflow prints to stderr when it registers a version; the stage's own line names the version.
REGISTRY_CHATTER = ("Successfully registered model ", "Registered model ", "Created version ")


@contextlib.contextmanager
def _without_lines(prefixes: tuple[str, ...]):
    """stderr passes through, less the lines that start with ``prefixes`` (held until the block ends)."""
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
    finally:
        sys.stderr.write("".join(line for line in held.getvalue().splitlines(keepends=True)
                                 if not line.startswith(prefixes)))


def log_and_register(model: VisionTransformer, images: torch.Tensor, logits: torch.Tensor, name: str,
                      run, meta: dict) -> dict:
    """Log the model (pyfunc-servable, with signature and input example), register a new version and
    say on it where it came from (:mod:`pipeline.registry`)."""
    from importlib import metadata

    from mlflow.models import infer_signature

    signature = infer_signature(images[:4].numpy(), logits[:4].numpy())
    with _without_lines(REGISTRY_CHATTER):
        info = mlflow.pytorch.log_model(model, name="model", signature=signature, input_example=images[:2].numpy(),
                                        registered_model_name=name, code_paths=[PACKAGE_DIR],
                                        pip_requirements=[f"{p}=={metadata.version(p)}" for p in SERVING_PACKAGES])
    version = int(info.registered_model_version)
    record_version(mlflow.MlflowClient(), run, name, version, meta)
    return {"name": name, "version": version, "uri": f"models:/{name}/{version}"}


def _write(fmt: str, model: VisionTransformer, images: torch.Tensor, out_dir: Path, opset: int,
           extra: dict) -> Path:
    """Write one format into ``out_dir``; its file."""
    path = out_dir / MODEL_FILES[fmt]
    with torch.no_grad():
        if fmt == "safetensors":
            save_model(model, out_dir, extra=extra)
        elif fmt == "torchscript":
            export_torchscript(model, images, path)
    if fmt == "onnx":
        export_onnx(model, images, path, opset)
    return path


@torch.no_grad()
def compare_export(fmt: str, path: Path, images: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """The export at ``path`` loaded as ``vit-pipeline predict`` does, its logits on ``images`` compared
    with ``reference``, PyTorch's: the check covers the loaders serving uses."""
    return _compare(reference, RUNNERS[fmt](path)(images))


def export_formats(model: VisionTransformer, images: torch.Tensor, reference: torch.Tensor, out_dir: Path,
                   formats: list[str], opset: int, extra: dict) -> dict[str, dict[str, float]]:
    """config.json, then each of ``formats`` written, reloaded and compared with PyTorch. config.json
    whatever the formats: predict reads the classes and preprocessing from it."""
    save_config(model, out_dir, extra)
    return {fmt: compare_export(fmt, _write(fmt, model, images, out_dir, opset, extra), images, reference)
            for fmt in formats}


def parity_failure(results: dict[str, dict[str, float]], cfg: ExportConfig) -> str | None:
    """The stage's error when a format's parity is outside the limits (each such format named); else None."""
    failed = [f"{fmt}: max |diff| {r['max_abs_diff']:.2e} (limit {cfg.max_abs_diff:g}), "
              f"top-1 agreement {r['top1_agreement']:.3f} (limit {cfg.min_top1_agreement:g})"
              for fmt, r in results.items() if not within_limits(r, cfg)]
    return "export parity check failed: " + "; ".join(failed) if failed else None


def export(params: Params) -> dict:
    model, meta = load_model(MODELS / "finetune")
    model.eval()
    shard_dir = storage.shard_dir("finetune")
    info = read_dataset_info(shard_dir)
    require_split(shard_dir, info, "test")
    require_classes(shard_dir, info, MODELS / "finetune", meta["classes"])
    cfg = params.export
    images = sample_images(shard_dir, cfg.num_images, meta["image_size"], eval_augment(meta))
    with torch.no_grad():
        reference = model(images)
    extra = {k: v for k, v in meta.items() if k != "model"}
    with staged_outputs(EXPORTS, metrics_path("export")) as out, \
            stage_run("export", params, extra_params={"model_size": params.model.preset,
                                                      "image_size": meta["image_size"]},
                      tags=model_run_tag(meta)) as run:
        tmp = out[EXPORTS]
        tmp.mkdir()
        results = export_formats(model, images, reference, tmp, cfg.formats, cfg.opset, extra)
        failure = parity_failure(results, cfg)
        report = {"num_images": len(images), "formats": results, "passed": failure is None}
        mlflow.log_metrics(pipeline_run.result_metrics("export", report))  # the pipeline run's names
        if failure:
            raise ValueError(failure)
        # the files a version's users fetch (predict --model models:/…) are in its run before it is registered
        mlflow.log_artifacts(str(tmp), artifact_path=EXPORT_ARTIFACTS)
        report["registered_model"] = log_and_register(model, images, reference, cfg.registered_model_name,
                                                        run, meta)
        atomic_write_json(out[metrics_path("export")], report)
        out.publish()
        mlflow.log_artifact(str(metrics_path("export")))  # as the other stages log their metrics file
    for fmt, r in results.items():
        print(f"[export] {fmt}: max |logit diff| {r['max_abs_diff']:.2e}, top-1 agreement "
              f"{r['top1_agreement']:.3f}", flush=True)
    print(f"[export] wrote {', '.join(sorted(p.name for p in EXPORTS.iterdir()))} to {EXPORTS}/; registered "
          f"{report['registered_model']['uri']}", flush=True)
    return report

"""Time to accuracy: train a recipe's pretrain and finetune stages through the project's own loop,
then measure the kept weights' top-1 on the test split.

    python benchmarks/time_to_accuracy.py --recipe configs/cifar10-1gpu.yaml --cifar --stages pretrain \
        --max-minutes 9.2 --out tta.json

The stages' own pieces run here (``plan_stage``, ``fit``, ``pretrain_start``, ``load_finetune_start``,
``stage_summary``) with ``ray.backend: local`` (one rank, in this process) and no MLflow run, so it
imports neither Ray nor MLflow nor DVC: it runs on a GPU box that has only torch, torchvision,
webdataset, PyYAML, Pillow, pyarrow, safetensors, scikit-learn and matplotlib (tested: every other
requirement is blocked in its tests).

Resumable: checkpoints go to ``--workdir/<stage>-<hash>/`` (the run name is a hash of the recipe,
data, initial weights and training code), so the same command run again, on the same code, continues an interrupted stage and does
not retrain a finished one. ``--max-minutes`` stops at the first epoch-end checkpoint past the budget
(every ``checkpoint_every_epochs`` epochs) with exit code 75: run the same command again to continue.

A finished run appends its figures to ``benchmarks/results/time_to_accuracy.jsonl`` (``--no-record``: not;
``VIT_RESULTS_DIR=$OUT/results`` on a GPU box brings the record back with the run's other files).

A recipe whose training diverges (loss and weights no longer finite) stops there, exit 2, one line.

The device is the recipe's: ``ray.use_gpu: true`` without CUDA is an error (exit 2), not a silent
CPU run, since a CPU time answers nothing; ``--set ray.use_gpu=false`` smoke-tests on the CPU.
"""
from __future__ import annotations

import time

STARTED = time.time()  # the command's wall time and --max-minutes count from here, imports included

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cifar import add_tarball_option, cifar_shards
from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.config import TRAINING_STAGES, ConfigError, Params
from pipeline.data import read_dataset_info
from pipeline.data.augment import eval_augment
from pipeline.environment import device_name
from pipeline.inference import predict_split, scored_metrics, views_note
from pipeline.model import VisionTransformer, load_model, save_model
from pipeline.plots import plot_history
from pipeline.recipes import load_recipe_params
from pipeline.train.context import local_device
from pipeline.train.deadline import DeadlinePassed, hook as deadline_hook
from pipeline.train.driver import TrainingDiverged, check_stage, fit
from pipeline.train.selection import THRESHOLDS
from pipeline.train.stage import (
    check_finetune_init,
    load_finetune_start,
    model_meta,
    plan_stage,
    pretrain_start,
    stage_summary,
)
from pipeline.utils import atomic_write_text

EXIT_BAD_INPUT, EXIT_RUN_AGAIN = 2, 75  # 75: EX_TEMPFAIL, "try again"
LEVELS = [round(level * 100) for level in THRESHOLDS]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default=str(ROOT / "params.yaml"), help="base params (default: params.yaml)")
    ap.add_argument("--recipe", help="a configs/*.yaml recipe applied over --params")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one key (repeatable)")
    ap.add_argument("--stages", choices=["all", "pretrain"], default="all",
                    help="all: pretrain then finetune (default); pretrain: stop after it and test its weights")
    ap.add_argument("--shards", type=Path, help="shard stage output (dataset.json + tars) for both stages "
                    "(with --cifar: where to build them; default WORKDIR/cifar10-shards)")
    ap.add_argument("--finetune-shards", type=Path, help="the finetune stage's shards, when not --shards")
    ap.add_argument("--cifar", action="store_true", help="build --shards from the CIFAR-10 tarball first (once)")
    add_tarball_option(ap)
    ap.add_argument("--workdir", type=Path, default=ROOT / ".tta", help="checkpoints and kept models (default: .tta/)")
    ap.add_argument("--max-minutes", type=float, help="stop at the first epoch-end checkpoint after this many minutes "
                    f"of this command (exit {EXIT_RUN_AGAIN}; the same command again continues)")
    ap.add_argument("--out", type=Path, help="write the report as JSON here (each stage's per-epoch history "
                    "included) and its training curves as NAME_curves.png beside it")
    add_record_option(ap)
    return ap.parse_args(argv)


def fail(message: object) -> int:
    print(f"error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def load_recipe(args: argparse.Namespace) -> Params:
    """The merged params, forced to run in this process with checkpoints under --workdir."""
    return load_recipe_params(args.params, args.recipe, args.set,
                              forced={"ray.backend": "local", "ray.storage_path": str(args.workdir.resolve())})


def training_device(params: Params) -> torch.device:
    """The local runner's device for the recipe; no CUDA for a GPU recipe is an error, not a CPU run."""
    try:
        return local_device(params.ray.use_gpu)
    except ValueError as exc:
        raise ConfigError(f"{exc}; this measures a GPU run (--set ray.use_gpu=false to smoke-test on the "
                          "CPU)") from None


def stage_shards(args: argparse.Namespace, params: Params, stages: list[str]) -> dict[str, Path]:
    """Each stage's shard directory; CIFAR-10 shards are built first with --cifar (as the recipe's
    ``data.pretrain`` says: both stages read them)."""
    if args.finetune_shards and "finetune" not in stages:
        raise ConfigError("--finetune-shards: --stages pretrain trains no fine-tune (drop one of them)")
    if args.shards is None and not args.cifar:
        raise ConfigError("--shards DIR is required (the shard stage's output), or --cifar to build CIFAR-10 shards")
    shards = args.shards or args.workdir / "cifar10-shards"
    if args.cifar:
        cifar_shards(shards, params.data.pretrain, args.cifar_tarball)
    dirs = {"pretrain": shards, "finetune": args.finetune_shards or shards}
    return {stage: dirs[stage] for stage in stages}


def start_model(stage: str, params: Params, classes: list[str], pretrained: Path | None) -> VisionTransformer:
    """The stage's initial weights, built as the stage builds them."""
    if stage == "pretrain":
        return pretrain_start(params, len(classes))
    return load_finetune_start(params, classes, pretrained=pretrained)


def train_stage(stage: str, params: Params, shard_dir: Path, info: dict, model: VisionTransformer,
                deadline: float | None) -> tuple[dict, Path]:
    """Train (or continue, or just reload a finished) run; save its kept weights. Returns its report
    and the model directory."""
    recipe, spec = plan_stage(stage, params, getattr(params, stage), model, shard_dir, info)
    loop = spec.loop
    hooks = () if deadline is None else (deadline_hook(deadline, loop.steps_per_epoch, loop.checkpoint_every_epochs),)
    result = fit(spec, params.ray, model, step_hooks=hooks)
    model_dir = save_model(result.model, Path(params.ray.storage_path) / spec.run_name / "model",
                           extra=model_meta(stage, recipe, info, spec.run_name))
    report = {"run": spec.run_name, **stage_summary(result), **pace(result.history), "history": result.history}
    return report, model_dir


def pace(history: list[dict]) -> dict:
    """How fast the loop trained and what bound it: medians over the epochs (robust to the first
    epoch of each launch, which holds the compiles) of images/s and of the share of an epoch the loop
    waited for its input (near 1: the input bounds it; near 0: the step)."""
    return {"images_per_s": statistics.median(e["images_per_s"] for e in history),
            "input_wait_share": statistics.median(e["input_wait_s"] / e["epoch_time_s"] for e in history)}


def evaluate_test(model_dir: Path, shard_dir: Path, params: Params, device: torch.device) -> dict:
    """Test top-1, loss and calibration of the saved weights, every test sample once, scored as the
    evaluate stage scores them (its batch size, ``evaluate.tta``'s views, the saved normalisation; fp32)."""
    model, meta = load_model(model_dir)
    scored = predict_split(model.to(device), shard_dir, "test", image_size=meta["image_size"],
                           batch_size=params.evaluate.batch_size, normalize=eval_augment(meta), tta=params.evaluate.tta)
    metrics = scored_metrics(scored, params.evaluate.tta)
    return {"test_tta": params.evaluate.tta, "test_images": metrics.pop("num_samples"),
            **{f"test_{k}": v for k, v in metrics.items()}}


def run(args: argparse.Namespace, params: Params, shards: dict[str, Path], device: torch.device,
        deadline: float | None) -> dict:
    """Every stage in order, each starting from the previous one's kept weights, then the test split."""
    stages, model_dir = {}, None
    for stage, shard_dir in shards.items():
        info = read_dataset_info(shard_dir)
        model = start_model(stage, params, info["classes"], model_dir)
        stages[stage], model_dir = train_stage(stage, params, shard_dir, info, model, deadline)
    test = evaluate_test(model_dir, shard_dir, params, device)
    return {"params": args.params, "recipe": args.recipe, "set": args.set, "device": device_name(device),
            "torch": torch.__version__, "stages": stages, **test, "model_dir": str(model_dir),
            "training_wall_time_s": sum(s["wall_time_s"] for s in stages.values())}


def print_summary(report: dict) -> None:
    print(f"\ntime to accuracy: {report['recipe'] or report['params']} on {report['device']}")
    for stage, s in report["stages"].items():
        reached = ", ".join(f"{lvl} % at epoch {s[f'epoch_to_top1_{lvl}']} ({s[f'time_to_top1_{lvl}_s']:.1f} s)"
                            if f"epoch_to_top1_{lvl}" in s else f"{lvl} % not reached" for lvl in LEVELS)
        print(f"  {stage:<9}: {s['epoch']} epoch(s), {s['wall_time_s']:.1f} s training, "
              f"{s['images_per_s']:.0f} img/s, input wait {s['input_wait_share']:.0%} (medians over epochs); "
              f"kept epoch {s['kept_epoch']} ({s['kept_source']} weights), val top-1 {s['kept_val_top1']:.4f}; "
              f"val {reached}")
    views = views_note(report["test_tta"], report.get("test_top1_single_view"))
    print(f"  test     : top-1 {report['test_top1']:.4f}{views}, loss {report['test_loss']:.4f} "
          f"({report['test_images']} images)")
    print(f"  wall time: {report['training_wall_time_s']:.1f} s training (all stages, every launch); "
          f"{report['command_wall_time_s']:.1f} s this command", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stages = ["pretrain"] if args.stages == "pretrain" else list(TRAINING_STAGES)
    try:
        if args.max_minutes is not None and not 0 <= args.max_minutes < float("inf"):  # nan fails both
            raise ConfigError(f"--max-minutes {args.max_minutes:g}: give the minutes this command may train, "
                              "a number >= 0 (0: stop at the first checkpoint)")
        params = load_recipe(args)
        device = training_device(params)
        shards = stage_shards(args, params, stages)
        check_stages(params, shards)  # the fine-tune's too, before the pretrain spends its time
        if args.out:  # writable now, not found unwritable after the training (the report would be lost)
            check_out(args.out)
    except (ConfigError, OSError, ValueError) as exc:
        return fail(exc)
    deadline = None if args.max_minutes is None else STARTED + 60 * args.max_minutes
    print(f"[tta] {device_name(device)}; checkpoints in {args.workdir}", flush=True)
    try:
        report = run(args, params, shards, device, deadline)
    except (ConfigError, TrainingDiverged, OSError, ValueError) as exc:  # a finetune.init not there, say
        return fail(exc)
    except DeadlinePassed as exc:
        minutes = (time.time() - STARTED) / 60
        print(f"[tta] {exc}, {minutes:.1f} min into this command (--max-minutes {args.max_minutes:g}): "
              f"run the same command again to continue", flush=True)
        return EXIT_RUN_AGAIN
    report["command_wall_time_s"] = time.time() - STARTED
    if args.out:  # first: the report is what the run was for
        try:
            atomic_write_text(args.out, json.dumps(report, indent=2) + "\n")
            plot_history({stage: s["history"] for stage, s in report["stages"].items()}, curves_path(args.out))
        except OSError as exc:
            return fail(exc)
    print_summary(report)
    if args.record:
        try:
            record_and_say("time_to_accuracy", figures(report), command=command_line(__file__, argv),
                           case=f"{report['recipe'] or report['params']}, {' + '.join(report['stages'])}")
        except OSError as exc:
            return fail(exc)
    return 0


STAGE_FIGURES = ("wall_time_s", "epoch", "images_per_s", "input_wait_share", "kept_epoch", "kept_val_top1",
                 *(f"time_to_top1_{level}_s" for level in LEVELS))


def figures(report: dict) -> dict:
    """What a record keeps of the report: the test figures, the wall times, each stage's pace and kept weights."""
    got = {k: report[k] for k in ("test_top1", "test_top1_single_view", "test_loss", "training_wall_time_s",
                                  "command_wall_time_s") if report.get(k) is not None}
    for stage, s in report["stages"].items():
        got |= {f"{stage}_{k}": s[k] for k in STAGE_FIGURES if s.get(k) is not None}
    return got


def check_stages(params: Params, shards: dict[str, Path]) -> None:
    """What each stage would otherwise find only after the training before it: its shards' dataset.json,
    a val split (what keeps and stops a run) and, for the last stage, a test split (what the command
    scores: missing, it reported a NaN top-1); the stage's own checks that need no model (shard files, a
    full batch, the time budget's plan); the fine-tune's ``finetune.init``."""
    infos, last = {stage: read_dataset_info(shard_dir) for stage, shard_dir in shards.items()}, list(shards)[-1]
    for stage, shard_dir in shards.items():  # the splits of every stage first: the cheapest checks
        counts = infos[stage]["counts"]
        for split in ("val", "test") if stage == last else ("val",):
            if not counts.get(split):
                raise ConfigError(f"{shard_dir} holds no {split} split (counts: {counts}); the {stage} stage "
                                  f"{'keeps its weights by' if split == 'val' else 'is tested on'} it: shard with "
                                  f"a {split}_fraction above 0")
    for stage, shard_dir in shards.items():
        check_stage(stage, params.ray, getattr(params, stage), shard_dir, infos[stage])
    if "finetune" in shards:
        check_finetune_init(params)


def check_out(out: Path) -> None:
    """``--out`` names a file whose folder this command can write into (made now if missing)."""
    if out.is_dir():
        raise ConfigError(f"--out {out}: is a folder; give a file in it, e.g. --out {out / 'tta.json'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, prefix=".tta-check-"):
        pass


def curves_path(out: Path) -> Path:
    """Where ``--out NAME.json``'s training curves go: ``NAME_curves.png`` beside it."""
    return out.with_name(f"{out.stem}_curves.png")


if __name__ == "__main__":
    sys.exit(main())

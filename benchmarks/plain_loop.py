"""A plain PyTorch loop for a recipe's pretrain stage, to check the project's loop against: torchvision's
``ImageFolder`` + v2 transforms per sample, one DataLoader, AdamW with warm-up + cosine (``LambdaLR``),
label smoothing and gradient clipping, written out here without the pipeline's data, loop or optimiser
code (shared: the model class, the auto-augment policies' names, the names that skip weight decay,
the amp rule and the check that a batch fits the train split). Train it and
``time_to_accuracy.py --stages pretrain`` on the same images with the same recipe, then compare the
per-epoch train loss and the test top-1:

    python benchmarks/plain_loop.py --imagefolder DIR --set model.preset=nano ...     # DIR/train, DIR/test

A gap beyond run-to-run noise points at the project's loop; none means the recipe, not the loop,
decides the accuracy. It covers crop, flip, RandAugment / TrivialAugmentWide, normalisation and
random erasing per sample (torchvision's own transforms, where the project batches them on the
device) and MixUp / CutMix per batch, not EMA, layer decay, a time budget, ``keep: best`` or early
stopping (a recipe that asks for them is refused, exit 2: it trains ``epochs`` and tests the last).
It runs where the stages would: on a GPU when there is one (bf16 autocast unless ``amp: off``, as
the stages' ``auto``; eager, no CUDA graphs), else on the CPU in full precision.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torchvision import datasets
from torchvision.transforms import v2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.config import ConfigError, TrainConfig
from pipeline.data.transforms import AUTO_AUGMENT_TRANSFORMS
from pipeline.model import build_model
from pipeline.recipes import load_recipe_params
from pipeline.train.driver import check_batch_fits
from pipeline.train.optim import NO_DECAY_NAMES
from pipeline.train.techniques import amp_dtype, autocast


def check_supported(cfg: TrainConfig) -> dict:
    """The recipe's augmentation, or ConfigError naming what this loop does not implement."""
    aug = dict(cfg.augment or {})
    asked = {"ema_decay": cfg.ema_decay, "layer_decay": cfg.layer_decay, "amp": "fp16" if cfg.amp == "fp16" else None,
             "mix_prob": cfg.mix_prob if cfg.mix_prob < 1 else None,  # and what picks the epochs and weights:
             "time_budget_minutes": cfg.time_budget_minutes, "keep": cfg.keep if cfg.keep != "last" else None,
             "early_stop_patience": cfg.early_stop_patience}  # it trains `epochs` and tests the last
    off = [f"pretrain.{k}={v!r}" for k, v in asked.items() if v]
    if off:
        raise ConfigError(f"the plain loop has no {', '.join(off)}; set them off (--set) to compare")
    if "dataset" in (aug.get("mean"), aug.get("std")):
        raise ConfigError("pretrain.augment.mean / std: give numbers (the plain loop reads no dataset.json)")
    return aug


def transforms(cfg: TrainConfig, aug: dict) -> tuple[v2.Compose, v2.Compose]:
    norm = [v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(aug.get("mean", [0.5] * 3), aug.get("std", [0.5] * 3))]
    crop, pad = aug.get("random_resized_crop"), aug.get("random_crop")
    train = [v2.PILToTensor(),
             v2.RandomResizedCrop(cfg.image_size, scale=tuple(crop), antialias=True) if crop
             else v2.Resize((cfg.image_size, cfg.image_size), antialias=True),
             *([v2.RandomCrop(cfg.image_size, padding=pad)] if pad else []),
             v2.RandomHorizontalFlip(aug.get("hflip", 0.0))]
    auto = AUTO_AUGMENT_TRANSFORMS.get(aug.get("auto_augment"))  # torchvision's, as the pipeline's
    if auto:  # the project's too: bilinear warps (nearest only with interpolation: nearest)
        train.append(auto(interpolation=v2.InterpolationMode.BILINEAR))
    erase = [v2.RandomErasing(aug["random_erasing"])] if aug.get("random_erasing") else []
    test = [v2.PILToTensor(), v2.Resize((cfg.image_size, cfg.image_size), antialias=True)]
    return v2.Compose(train + norm + erase), v2.Compose(test + norm)


def mixer(cfg: TrainConfig, num_classes: int):
    """MixUp / CutMix on each batch (one of them, chosen per batch, when both are on), or None."""
    alphas = ((v2.MixUp, cfg.mixup_alpha), (v2.CutMix, cfg.cutmix_alpha))
    ops = [op(alpha=a, num_classes=num_classes) for op, a in alphas if a > 0]
    return v2.RandomChoice(ops) if len(ops) > 1 else (ops[0] if ops else None)


def optimiser(model: torch.nn.Module, cfg: TrainConfig, steps_per_epoch: int):
    """AdamW (no decay on 1-d params, pos-embed and [CLS], as timm and the stages do), linear warm-up
    then cosine to ``min_lr``, per step."""
    plain = [p for n, p in model.named_parameters() if p.ndim <= 1 or any(k in n for k in NO_DECAY_NAMES)]
    decay = [p for p in model.parameters() if all(p is not q for q in plain)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": plain, "weight_decay": 0.0}], lr=cfg.lr)
    warm, total = round(cfg.warmup_epochs * steps_per_epoch), cfg.epochs * steps_per_epoch
    floor = cfg.min_lr / cfg.lr

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


@torch.no_grad()
def test_top1(model: torch.nn.Module, data, device: torch.device, workers: int) -> float:
    """In full precision, as time_to_accuracy.py tests."""
    model.eval()
    correct = torch.zeros((), dtype=torch.long, device=device)
    for x, y in torch.utils.data.DataLoader(data, 256, num_workers=workers):
        correct += (model(x.to(device)).argmax(-1) == y.to(device)).sum()
    model.train()
    return correct.item() / len(data)


def image_folder(root: Path, transform: v2.Compose) -> datasets.ImageFolder:
    """torchvision's ImageFolder; a folder without class folders or images is a ConfigError naming it."""
    try:
        return datasets.ImageFolder(root, transform)
    except FileNotFoundError as exc:  # "Couldn't find any class folder", "Found no valid file"
        raise ConfigError(f"{root}: {str(exc).rstrip('.')} (--imagefolder needs train/<class>/ and "
                          "test/<class>/ images)") from None


def train(cfg: TrainConfig, params, folder: Path, workers: int, device: torch.device) -> tuple[float, float]:
    """(test top-1, seconds of training and testing)."""
    train_tf, test_tf = transforms(cfg, check_supported(cfg))
    torch.manual_seed(cfg.seed)
    train_set, test_set = image_folder(folder / "train", train_tf), image_folder(folder / "test", test_tf)
    check_batch_fits("pretrain", cfg.global_batch_size, len(train_set), folder / "train")  # drop_last: no step
    loader = torch.utils.data.DataLoader(train_set, cfg.global_batch_size, shuffle=True, drop_last=True,
                                         num_workers=workers, persistent_workers=workers > 0,
                                         pin_memory=device.type == "cuda")
    model = build_model(params.model, image_size=cfg.image_size, num_classes=len(train_set.classes)).to(device)
    opt, sched = optimiser(model, cfg, len(loader))
    mix = mixer(cfg, len(train_set.classes))
    dtype = amp_dtype(cfg.amp, device) if device.type == "cuda" else None  # the stages' amp rule; fp32 on a CPU
    start = time.perf_counter()
    for epoch in range(1, cfg.epochs + 1):
        loss_sum, correct = torch.zeros((), device=device), torch.zeros((), device=device)  # one sync an epoch
        for x, y in loader:
            x, target = mix(x, y) if mix else (x, y)  # mixed: class probabilities
            x, target, y = (t.to(device, non_blocking=True) for t in (x, target, y))
            with autocast(device, dtype):
                logits = model(x)
            loss = F.cross_entropy(logits.float(), target, label_smoothing=cfg.label_smoothing)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            loss_sum += loss.detach() * len(y)
            correct += (logits.argmax(-1) == y).sum()
        seen, elapsed = len(loader) * cfg.global_batch_size, time.perf_counter() - start
        print(f"[plain] epoch {epoch}/{cfg.epochs} loss {loss_sum.item() / seen:.4f} "
              f"top1 {correct.item() / seen:.4f} | {elapsed:.1f}s, {epoch * seen / elapsed:.0f} img/s", flush=True)
    top1, elapsed = test_top1(model, test_set, device, workers), time.perf_counter() - start
    print(f"[plain] test top-1 {top1:.4f} ({len(test_set)} images), {elapsed:.1f} s training on {device.type}")
    return top1, elapsed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--recipe", help="a configs/*.yaml recipe applied over --params")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one key (repeatable)")
    ap.add_argument("--imagefolder", type=Path, required=True, help="a folder with train/<class>/ and test/<class>/")
    ap.add_argument("--workers", type=int, default=1, help="DataLoader workers (default 1)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
                    help="default: cuda when there is a GPU")
    add_record_option(ap)
    args = ap.parse_args(argv)
    try:
        params = load_recipe_params(args.params, args.recipe, args.set)
        if args.workers < 0:
            raise ConfigError(f"--workers {args.workers}: give 0 (load in this process) or more")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device here (--device cpu)")
        for split in ("train", "test"):
            if not (args.imagefolder / split).is_dir():
                raise ConfigError(f"{args.imagefolder / split}: no such folder (--imagefolder needs train/ and test/)")
        top1, elapsed = train(params.pretrain, params, args.imagefolder, args.workers, torch.device(args.device))
        if args.record:
            record_and_say("plain_loop", {"test_top1": top1, "training_s": round(elapsed, 1)},
                           command=command_line(__file__, argv), case=args.recipe or "params.yaml")
    except (ConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

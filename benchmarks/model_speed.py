"""Images/s of pipeline.model's ViT vs timm's VisionTransformer with the identical config.

Both models get the same weights and inputs; runs are interleaved in one process
(alternating order each repeat) so CPU frequency / background load hit both
equally, and medians are reported. Run: ``python benchmarks/model_speed.py``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.model import build_vit, convert_state_dict  # noqa: E402

CASES = [  # (preset, image, patch, batch, train iters/run, infer iters/run)
    ("nano", 16, 4, 128, 20, 40),
    ("tiny", 224, 16, 8, 3, 6),
]


def make_pair(preset: str, image: int, patch: int, num_classes: int = 10):
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    ours = build_vit(preset, patch_size=patch, image_size=image, num_classes=num_classes)
    c = ours.config
    ref = TimmViT(
        img_size=image, patch_size=patch, num_classes=num_classes, embed_dim=c.embed_dim,
        depth=c.depth, num_heads=c.num_heads, mlp_ratio=c.mlp_ratio, qkv_bias=c.qkv_bias,
    )
    ref.load_state_dict(ours.state_dict())  # identical weights (timm names == ours)
    return {"ours": ours, "timm": ref}


def train_runner(model, x, y):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def infer_runner(model, x):
    model.eval()

    def step():
        with torch.inference_mode():
            model(x)

    return step


def timed(step, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    return time.perf_counter() - t0


def bench(runners: dict, iters: int, batch: int, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median images/s per implementation; order alternates every repeat."""
    names = list(runners)
    for name in names:
        timed(runners[name], warmup)
    samples = {n: [] for n in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(batch * iters / timed(runners[name], iters))
    return {n: statistics.median(s) for n, s in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(ours) (slow first call)")
    ap.add_argument("--cases", default="nano,tiny", help="comma-separated presets from CASES")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, repeats={args.repeats}")

    rows = []
    for preset, image, patch, batch, train_iters, infer_iters in CASES:
        if preset not in args.cases.split(","):
            continue
        models = make_pair(preset, image, patch)
        x, y = torch.randn(batch, 3, image, image), torch.randint(0, 10, (batch,))
        with torch.no_grad():  # sanity: same weights, same function
            models["ours"].eval(), models["timm"].eval()
            diff = (models["ours"](x) - models["timm"](x)).abs().max().item()
        if args.compile:
            models["ours+compile"] = torch.compile(make_pair(preset, image, patch)["ours"])
        for mode, iters in (("train", train_iters), ("infer", infer_iters)):
            runners = {
                n: train_runner(m, x, y) if mode == "train" else infer_runner(m, x) for n, m in models.items()
            }
            res = bench(runners, iters, batch, args.repeats)
            rows.append((f"{preset} {image}px/p{patch} b{batch}", mode, res, diff))

    print(f"\n{'case':<24} {'mode':<6} {'ours img/s':>11} {'timm img/s':>11} {'ours/timm':>10}  extra")
    for case, mode, res, diff in rows:
        extra = "  ".join(f"{k}={v:.1f} ({v / res['timm']:.2f}x)" for k, v in res.items() if k not in ("ours", "timm"))
        print(f"{case:<24} {mode:<6} {res['ours']:>11.1f} {res['timm']:>11.1f} {res['ours'] / res['timm']:>9.3f}x  {extra}")
    print(f"\nmax |logit diff| ours vs timm (same weights): {max(r[3] for r in rows):.2e}")


if __name__ == "__main__":
    main()

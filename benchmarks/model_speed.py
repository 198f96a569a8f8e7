"""Images/s of pipeline.model's ViT vs timm's VisionTransformer with the identical config.

Both models get the same weights and inputs; steps are interleaved in one process
(order flips every round) so CPU frequency / background load hit both equally, and
medians are reported. Cases: ``nano`` 16 px / patch 4 / batch 128 and ``tiny``
224 px / patch 16 / batch 8; train step = forward + backward + fused AdamW step (the
pipeline's optimizer, the same for both).

    python benchmarks/model_speed.py                         # all cores, wall clock
    python benchmarks/model_speed.py --threads 1 --clock cpu # shared / busy machine
    python benchmarks/model_speed.py --compile --cases nano  # + torch.compile (slow start)
    python benchmarks/model_speed.py --control               # + a copy of ours: the noise floor
    python benchmarks/model_speed.py --breakdown             # + where each step's time goes

Each (case, mode) stops after ``--budget`` seconds; the default run takes ~1.5-3 min.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.model import build_vit
from pipeline.utils import positive_int, seconds

CASES = [  # (preset, image, patch, batch, max timed steps per mode)
    ("nano", 16, 4, 128, 80),
    ("tiny", 224, 16, 8, 40),
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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as pipeline.train.optim, for both

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


def bench(runners: dict, batch: int, steps: int, budget_s: float, clock=time.perf_counter, warmup: int = 2):
    """Time single steps, alternating implementations (order flips every round).

    Per-step interleaving keeps background load symmetric; the ratio reported is the
    median of per-round paired ratios, which is robust to load drifting over time.
    """
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            runners[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    t_start = time.perf_counter()
    for i in range(steps):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = clock()
            runners[name]()
            times[name].append(clock() - t0)
        if time.perf_counter() - t_start > budget_s and i >= 4:
            break
    out = {}
    for n in names:
        ts = sorted(times[n])
        ratios = [t / o for t, o in zip(times["timm"], times[n])]
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        out[n] = {
            "img_s": batch / statistics.median(ts),
            "best_img_s": batch / ts[0],
            "ratio_vs_timm": statistics.median(ratios),
            "ratio_iqr": (q1, q3),
            "rounds": len(ts),
        }
    return out


# Kernels both models run on identical shapes: their time is a floor neither can go below.
SHARED_KERNELS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::mkldnn_convolution", "aten::convolution_backward"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
}


def breakdown(runners: dict, steps: int = 5) -> dict[str, dict[str, float]]:
    """ms per step by kernel group (torch.profiler, self time; run after ``bench`` so all are warm)."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name, step in runners.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        groups = dict.fromkeys([*SHARED_KERNELS, "other"], 0.0)
        for ev in prof.key_averages():
            group = next((g for g, ops in SHARED_KERNELS.items() if ev.key in ops), "other")
            groups[group] += ev.self_cpu_time_total / 1e3 / steps
        out[name] = groups
    return out


def print_breakdown(case: str, mode: str, parts: dict) -> None:
    """Per model: ms/step in shared kernels vs the rest, and the best ratio these kernels allow."""
    timm_total = sum(parts["timm"].values())
    for name, g in parts.items():
        kernels = g["matmul"] + g["attention"]
        print(f"  {case:<22} {mode:<5} {name:<12} matmul+conv {g['matmul']:7.1f} ms  attention "
              f"{g['attention']:6.1f} ms  other {g['other']:6.1f} ms  ({g['other'] / (kernels + g['other']):.0%})"
              f"  | timm / (matmul+attention) = {timm_total / kernels:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=seconds, default=20.0, help="seconds per (case, mode) before stopping early")
    ap.add_argument("--threads", type=positive_int, default=torch.get_num_threads())
    ap.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="cpu = this thread's CPU time: immune to other processes on a shared box, exact only with --threads 1",
    )
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(ours) (slow first call)")
    ap.add_argument("--control", action="store_true", help="also time an identical copy of ours: its "
                    "ratio differs from ours' only by measurement noise, which shows what a run can resolve")
    ap.add_argument("--breakdown", action="store_true", help="profile each model after timing: ms/step in "
                    "matmul/conv and attention kernels (the same for both) vs everything else")
    ap.add_argument("--cases", default="nano,tiny", help="comma-separated presets from CASES")
    ap.add_argument("--rounds", type=positive_int, default=None, help="timed train rounds per case (infer: 2x); "
                    "default: CASES' figure. More rounds narrow the median on a noisy machine")
    add_record_option(ap)
    args = ap.parse_args()
    unknown = sorted(set(args.cases.split(",")) - {case[0] for case in CASES})
    if unknown:
        ap.error(f"--cases: {', '.join(unknown)} not among {', '.join(case[0] for case in CASES)}")
    torch.set_num_threads(args.threads)
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu measures only the calling thread: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.manual_seed(0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, cpus={os.cpu_count()}, "
          f"clock={args.clock}, load avg={load:.2f}")

    rows, parts = [], []
    for preset, image, patch, batch, steps in CASES:
        if preset not in args.cases.split(","):
            continue
        models = make_pair(preset, image, patch)
        x, y = torch.randn(batch, 3, image, image), torch.randint(0, 10, (batch,))
        with torch.no_grad():  # sanity: same weights, same function
            models["ours"].eval(), models["timm"].eval()
            diff = (models["ours"](x) - models["timm"](x)).abs().max().item()
        if args.control:
            models["ours-copy"] = copy.deepcopy(models["ours"])
        if args.compile:
            models["ours+compile"] = torch.compile(make_pair(preset, image, patch)["ours"])
        for mode in ("train", "infer"):
            make = (lambda m: train_runner(m, x, y)) if mode == "train" else (lambda m: infer_runner(m, x))
            runners = {n: make(m) for n, m in models.items()}
            n_steps = (args.rounds or steps) * (1 if mode == "train" else 2)
            res = bench(runners, batch, n_steps, args.budget, clock)
            rows.append((f"{preset} {image}px/p{patch} b{batch}", mode, res, diff))
            if args.breakdown:
                parts.append((rows[-1][0], mode, breakdown(runners)))

    print(f"\n{'case':<22} {'mode':<5} {'ours img/s':>10} {'timm img/s':>10} {'ours/timm':>9} "
          f"{'IQR':>13} {'best-case':>9} {'rounds':>6}  extra")
    for case, mode, res, diff in rows:
        o, t = res["ours"], res["timm"]
        extra = "  ".join(
            f"{k}: {v['img_s']:.1f} img/s ({v['ratio_vs_timm']:.2f}x)"
            for k, v in res.items() if k not in ("ours", "timm")
        )
        print(
            f"{case:<22} {mode:<5} {o['img_s']:>10.1f} {t['img_s']:>10.1f} {o['ratio_vs_timm']:>8.3f}x "
            f"{o['ratio_iqr'][0]:>6.3f}-{o['ratio_iqr'][1]:.3f} "
            f"{o['best_img_s'] / t['best_img_s']:>8.3f}x {o['rounds']:>6}  {extra}"
        )
    print("\nimg/s = batch / median step time; ours/timm = median of paired per-round speed ratios")
    print("(IQR: their interquartile range, the noise of this run);")
    print("best-case = ratio of the fastest steps. Train step = forward + backward + fused AdamW step.")
    print(f"max |logit diff| ours vs timm (same weights): {max(r[3] for r in rows):.2e}")
    if parts:
        print("\nbreakdown (torch.profiler self time per step; the profiler adds a little per op):")
        for case, mode, p in parts:
            print_breakdown(case, mode, p)
        print("timm / (matmul+attention): the ratio a model would reach if everything but these kernels cost nothing")
    if args.record:
        for case in dict.fromkeys(case for case, *_ in rows):  # one record per case, both modes
            got = {"threads": args.threads, "clock": args.clock}
            for _, mode, res, _ in (r for r in rows if r[0] == case):
                got |= {f"{mode}_img_s": round(res["ours"]["img_s"], 1),
                        f"{mode}_timm_img_s": round(res["timm"]["img_s"], 1),
                        f"{mode}_ratio_vs_timm": round(res["ours"]["ratio_vs_timm"], 3),
                        **{f"{mode}_{k}_ratio_vs_timm": round(v["ratio_vs_timm"], 3)
                           for k, v in res.items() if k not in ("ours", "timm")}}
            record_and_say("model_speed", got, command=command_line(__file__), case=case)


if __name__ == "__main__":
    main()

"""Feed ratio: images/s of the training loop (real tars -> loader workers -> device augmentation ->
train step) over images/s of the model alone (the same train step on a batch already on the
device), measured side by side in one process, plus peak GPU memory and MFU. The input alone (the
same batches, no step) says which side bounds the loop; ``--compare-eager`` says what
``torch.compile`` buys the model.

    python benchmarks/train_throughput.py --shards data/shards/pretrain                 # params.yaml
    python benchmarks/train_throughput.py --recipe configs/cifar10.yaml \\
        --shards /tmp/cifar10-shards --set ray.loader_workers=15 --steps 60

The stage's own pieces run here (``plan_stage``, ``make_train_loader``, ``Stepper``), in-process
and without Ray, as the local runner does. ``--shards`` must hold the shard stage's output
(``dataset.json`` + tars) for the chosen data; ``--cifar`` builds CIFAR-10 shards from the
tarball in ``../shared/data`` first.
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cifar import add_tarball_option, cifar_shards
from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.config import COMPILE_MODES, CUDAGRAPH_MODES, TRAINING_STAGES, ConfigError
from pipeline.data import make_train_loader, read_dataset_info
from pipeline.environment import cpu_name, device_name
from pipeline.model import build_model
from pipeline.recipes import load_recipe_params
from pipeline.train.flops import flops_per_image as analytic_flops, peak_of
from pipeline.train.loop_config import LoopConfig
from pipeline.train.stage import plan_stage
from pipeline.train.step import Stepper
from pipeline.utils import positive_int


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(device: torch.device, steps: int, batch: int, body) -> float:
    """Images/s of ``steps`` calls of ``body()``, ``batch`` images each, device work included."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        body()
    sync(device)
    return steps * batch / (time.perf_counter() - t0)


def twin(stepper: Stepper, loop: LoopConfig, **changes) -> Stepper:
    """The same model (a copy of its weights) stepped with ``changes`` to the loop config: uncompiled
    (FLOPs can only be counted eagerly; ``--compare-eager``) or compiled in another mode (``--compare-mode``)."""
    return Stepper(copy.deepcopy(stepper.model), dataclasses.replace(loop, **changes), stepper.device)


def mode_twin(stepper: Stepper, loop: LoopConfig, mode: str) -> Stepper:
    """``--compare-mode``'s twin, compiled in ``mode``; a mode that captures CUDA graphs itself leaves the
    recipe's whole-step graph (``cuda_graph``): the stages refuse that pair, and it cannot nest."""
    return twin(stepper, loop, compile=True, compile_mode=mode,
                cuda_graph=loop.cuda_graph and mode not in CUDAGRAPH_MODES)


def flops_per_image(stepper: Stepper, images: torch.Tensor, labels: torch.Tensor) -> float:
    from torch.utils.flop_counter import FlopCounterMode
    counter = FlopCounterMode(display=False)
    with counter:
        stepper(images, labels)
    return float(counter.get_total_flops()) / len(labels)


def measure(args, stepper: Stepper, twins: dict[str, Stepper], batches, drain: int) -> dict[str, list[float]]:
    """``args.rounds`` rounds of: model alone (a fixed batch already on the device), each twin's model
    alone, input alone (loader workers -> device augmentation, no step), the full loop and each
    compiled twin's full loop.
    While the model-alone rounds run, the loader's workers fill their queue; ``drain`` batches (that
    queue, then one more parcel per worker) are taken, untimed, before the input is timed, so input and
    loop are timed in the steady state: not on batches made during the model's turn, and not from an
    empty pipeline either (right after the queue is taken, every worker is still on its first parcel,
    and a short round would time little more than that one parcel's latency)."""
    images, labels = next(batches)  # the fixed batch for the model alone
    device, n = stepper.device, len(labels)
    looped = {"": stepper, **{name: t for name, t in twins.items() if name != "eager"}}
    for _ in range(3):  # warm-up: cudnn/compile (CUDA graphs: recorded), allocator, the workers' first batches
        for s in (stepper, *twins.values()):
            s(images, labels)
        for s in looped.values():
            s(*next(batches))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    got: dict[str, list[float]] = collections.defaultdict(list)
    for r in range(args.rounds):
        for name, s in {"model": stepper, **twins}.items():
            got[name].append(timed(device, args.steps, n, lambda: s(images, labels)))
        for _ in range(drain):
            next(batches)
        got["input"].append(timed(device, args.steps, n, lambda: next(batches)))
        for name, s in looped.items():
            got[f"loop {name}".strip()].append(timed(device, args.steps, n, lambda: s(*next(batches))))
        print(f"round {r}: model alone {got['model'][-1]:8.0f} img/s   input alone {got['input'][-1]:8.0f} img/s   "
              f"full loop {got['loop'][-1]:8.0f} img/s   feed ratio {got['loop'][-1] / got['model'][-1]:.3f}",
              flush=True)
    return got


def train_batches(loop: LoopConfig, device: torch.device, steps: int, num_workers: int, drains: int = 1):
    """The stage's train loader from epoch 0, as its one rank would get it, on ``device``: at least ``steps``
    batches, plus ``drains`` times its full pipeline (``.in_flight``, taken untimed before timing input)."""
    def loader(n: int):
        return make_train_loader(
            loop.shard_dir, batch_size=loop.per_worker_batch, image_size=loop.image_size,
            steps_per_epoch=loop.steps_per_epoch, epoch=0, last_epoch=-(-n // loop.steps_per_epoch) - 1,
            rank=0, world_size=1, seed=loop.seed, augment=loop.augment, num_workers=num_workers, device=device)
    return loader(steps + drains * loader(1).in_flight)  # the first one only tells its size: nothing starts


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of processes ``pids`` so far (Linux ``/proc``; 0 where unreadable)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
        except (OSError, IndexError, ValueError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def input_scaling(loop: LoopConfig, device: torch.device, counts: list[int], steps: int) -> dict[int, float]:
    """Images/s of the input alone (tars -> loader workers -> copy -> device augmentation, no step)
    for each loader-worker count, in the steady state: the first epoch (each worker indexes the tar
    headers of every shard once) and the workers' first queue are taken untimed. Beside it the CPU
    time per batch of this process (its main thread, the pin-memory thread, the copies and launches)
    and of the workers: this process's close to the wall time per batch means it bounds the input;
    the workers' (summed) close to count x the wall time means they do."""
    print(f"\ninput alone by loader workers ({steps} steps each after {loop.steps_per_epoch} untimed, "
          f"batch {loop.per_worker_batch}; the workers run on {cpu_name()}):")
    print(f"{'workers':>8} {'img/s':>9} {'per worker':>11} {'ms/batch':>9} {'main CPU':>9} {'workers CPU':>12}")
    rates = {}
    for count in counts:
        loader = train_batches(loop, device, loop.steps_per_epoch + steps, count)
        warm, batches = max(loop.steps_per_epoch, loader.in_flight), iter(loader)
        for _ in range(warm):
            next(batches)
        workers = [p.pid for p in multiprocessing.active_children()]
        main0, kids0 = time.process_time(), cpu_seconds(workers)
        rate = timed(device, steps, loop.per_worker_batch, lambda b=batches: next(b))
        main, kids = time.process_time() - main0, cpu_seconds(workers) - kids0
        del batches, loader  # the DataLoader's workers exit
        per = 1e3 / steps
        print(f"{count:>8} {rate:>9.0f} {rate / max(count, 1):>11.0f} {loop.per_worker_batch / rate * 1e3:>9.1f} "
              f"{main * per:>9.1f} {kids * per:>12.1f}", flush=True)
        rates[count] = rate
    return rates


RANGES = ("input", "train_step")  # the profile's own record_function ranges


def host_ms(events, name: str) -> float:
    """Milliseconds of the host-side range ``name``, summed. (torch 2.11 also records each range on
    the device, as a user annotation under the same name: a per-key average merged the two.)"""
    from torch.autograd import DeviceType
    return sum(e.time_range.end - e.time_range.start for e in events
               if e.name == name and e.device_type == DeviceType.CPU) / 1e3


def busy_us(events) -> float:
    """Microseconds in which the device ran at least one kernel or copy (overlaps counted once; the
    device-side copies of the profile's own ranges are not device work)."""
    from torch.autograd import DeviceType
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA and e.name not in RANGES)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def profile(stepper: Stepper, batches, steps: int, out: Path) -> None:
    """Where the full loop's time goes: ``steps`` steps under ``torch.profiler``. Host time of the input
    (loader -> device augmentation) and of the step (its launches, or its waits), the device's busy
    share, the top ops, and a trace for Perfetto / chrome://tracing in ``out``. Host input + step close
    to the wall time with the device idle part of it: the host bounds the loop (fewer launches help:
    ``compile_mode: reduce-overhead``); device busy close to the wall time: the kernels do."""
    from torch.profiler import ProfilerActivity, record_function
    cuda = stepper.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        sync(stepper.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            with record_function(RANGES[0]):
                batch = next(batches)
            with record_function(RANGES[1]):
                stepper(*batch)
        sync(stepper.device)
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    out.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out / "trace.json"))
    ops = prof.key_averages()
    host = {name: host_ms(prof.events(), name) / steps for name in RANGES}
    print(f"\nprofile, {steps} full-loop steps (profiler on): {wall_ms:.1f} ms/step wall")
    print(f"host, input        : {host['input']:9.1f} ms/step   (loader queue -> device augmentation)")
    print(f"host, train step   : {host['train_step']:9.1f} ms/step   (launches, and any wait for the device)")
    busy_ms = busy_us(prof.events()) / 1e3 / steps
    if cuda and busy_ms:
        print(f"device busy        : {busy_ms:9.1f} ms/step   ({busy_ms / wall_ms:.0%} of the wall time)")
    elif cuda:
        print("device busy        : the profiler recorded no device activity")
    print(ops.table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=15))
    if cuda:  # the same ops by the host's time: which launches, copies or waits the host spends its step on
        print(ops.table(sort_by="self_cpu_time_total", row_limit=15))
    print(f"trace: {out / 'trace.json'}")


def worker_counts(value: str) -> list[int]:
    """``--input-scaling``'s value: comma-separated loader-worker counts, each >= 0."""
    try:
        counts = [int(c) for c in value.split(",")]
    except ValueError:
        counts = [-1]
    if min(counts) < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: comma-separated worker counts >= 0, e.g. 1,4,8,15")
    return counts


def refuse(message: str) -> NoReturn:
    """Bad input: one line and exit 2, as time_to_accuracy.py and plain_loop.py."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--recipe", help="a configs/*.yaml recipe applied over --params")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--stage", default="pretrain", choices=TRAINING_STAGES)
    ap.add_argument("--shards", type=Path, required=True)
    ap.add_argument("--cifar", action="store_true", help="build --shards from the CIFAR-10 tarball first (once)")
    add_tarball_option(ap)
    ap.add_argument("--steps", type=positive_int, default=30, help="timed steps per measurement")
    ap.add_argument("--rounds", type=positive_int, default=3, help="alternating model-alone / input / loop rounds")
    ap.add_argument("--compare-eager", action="store_true",
                    help="with compile on: also time the model alone without torch.compile, side by side")
    ap.add_argument("--compare-mode", choices=COMPILE_MODES, metavar="MODE",
                    help=f"also time the model alone and the loop compiled in MODE ({', '.join(COMPILE_MODES)})")
    ap.add_argument("--compare-graph", action="store_true",
                    help="also time the model alone and the loop with the whole step as one CUDA graph "
                         "(cuda_graph: true; a CUDA-graph compile_mode becomes default)")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="then profile --profile-steps full-loop steps: host and device time, top ops, DIR/trace.json")
    ap.add_argument("--profile-steps", type=positive_int, default=10)
    ap.add_argument("--input-scaling", type=worker_counts, metavar="COUNTS",
                    help="instead: the input alone for each loader-worker count in COUNTS (e.g. 1,4,8,15), "
                         "with the CPU time per batch of this process and of the workers")
    add_record_option(ap)
    args = ap.parse_args(argv)

    try:
        # ray.backend local: one rank, the whole global batch on this device
        params = load_recipe_params(args.params, args.recipe, args.set, forced={"ray.backend": "local"})
        shard_dir = args.shards
        cfg = getattr(params, args.stage)
        if args.compare_graph and cfg.cuda_graph:  # before the shards are built and the model planned
            refuse(f"--compare-graph: {args.stage}.cuda_graph is already true in {args.recipe or args.params}; "
                   f"compare against the plain step with --set {args.stage}.cuda_graph=false "
                   f"--set {args.stage}.compile_mode=reduce-overhead")
        if args.profile:  # its folder now, not after the measurement
            args.profile.mkdir(parents=True, exist_ok=True)
        if args.cifar:
            shard_dir = cifar_shards(args.shards, getattr(params.data, args.stage), args.cifar_tarball)
        info = read_dataset_info(shard_dir)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.manual_seed(cfg.seed)
        model = build_model(params.model, image_size=cfg.image_size, num_classes=len(info["classes"]))
        loop = plan_stage(args.stage, params, cfg, model, shard_dir, info)[1].loop  # as the stage plans its run
    except (ConfigError, OSError, ValueError) as exc:  # bad params, no tarball, no or damaged shards, a batch
        refuse(str(exc))                              # too large, no CUDA for a GPU recipe: one line
    if args.input_scaling:
        rates = input_scaling(loop, device, args.input_scaling, args.steps)
        if args.record:
            record_and_say("train_throughput", {f"input_img_s_{n}_workers": round(r) for n, r in rates.items()},
                           command=command_line(__file__, argv), case=f"{args.recipe or args.params}, input scaling")
        return
    stepper = Stepper(model.to(device), loop, device)
    twins = {"eager": twin(stepper, loop, compile=False)} if args.compare_eager and loop.compile else {}
    if args.compare_mode:
        twins[args.compare_mode] = mode_twin(stepper, loop, args.compare_mode)
    if args.compare_graph:
        mode = "default" if loop.compile_mode in CUDAGRAPH_MODES else loop.compile_mode
        twins["cuda_graph"] = twin(stepper, loop, cuda_graph=True, compile_mode=mode)
    steps_needed = (args.rounds * (3 + len(twins)) * args.steps + 8 * (1 + len(twins))
                    + (args.profile_steps if args.profile else 0))
    loader = train_batches(loop, device, steps_needed, loop.loader_workers, drains=args.rounds)
    batches = iter(loader)
    got = measure(args, stepper, twins, batches, drain=loader.in_flight)
    peak_memory = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0  # before the FLOP count's step
    # a fresh eager step (a replayed graph dispatches no ops to count), without the recomputation of
    # grad_checkpointing, which MFU leaves out by definition
    uncompiled = twin(stepper, loop, compile=False, cuda_graph=False, grad_checkpointing=False)
    counted = flops_per_image(uncompiled, *next(batches))
    analytic = analytic_flops(loop.model, loop.image_size)  # what the stages log MFU by
    print(f"FLOPs per image: counted {counted / 1e9:.4g} G, pipeline/train/flops.py {analytic / 1e9:.4g} G "
          f"({analytic / counted - 1:+.1%})")
    figures = report(args, params, loop, device, {k: statistics.median(v) for k, v in got.items() if v},
                     peak_memory, counted)
    if args.record:
        record_and_say("train_throughput", figures, command=command_line(__file__, argv), case=args.recipe or args.params)
    if args.profile:
        profile(stepper, batches, args.profile_steps, args.profile)


def report(args, params, loop: LoopConfig, device, median: dict[str, float], peak_memory: int,
           flops: float) -> dict:
    """Print the medians and what they say; return them as a record's figures."""
    name = device_name(device)
    alone, fed = median["model"], median["loop"]
    print(f"\n{args.stage} of {args.recipe or args.params} on {name}: {params.model.preset} "
          f"(patch {params.model.patch_size}, {loop.image_size} px), batch {loop.per_worker_batch}, amp {loop.amp}, "
          f"compile {loop.compile}{f' ({loop.compile_mode})' if loop.compile else ''}"
          f"{', the whole step as one CUDA graph' if loop.cuda_graph else ''}, "
          f"{loop.loader_workers} loader workers, {args.steps} steps x {args.rounds} rounds")
    print(f"median model alone : {alone:9.0f} img/s")
    if "eager" in median:
        print(f"median eager alone : {median['eager']:9.0f} img/s   (compile buys {alone / median['eager']:.2f}x)")
    print(f"median input alone : {median['input']:9.0f} img/s   (input / model {median['input'] / alone:.2f}: "
          f"below 1, the input bounds the loop)")
    print(f"median full loop   : {fed:9.0f} img/s")
    print(f"feed ratio         : {fed / alone:9.3f}   (target >= 0.9 on a GPU)")
    got = {"model_img_s": round(alone), "input_img_s": round(median["input"]), "loop_img_s": round(fed),
           "feed_ratio": round(fed / alone, 3)}
    if "eager" in median:
        got["eager_img_s"] = round(median["eager"])
    for twin in (n for n in median if f"loop {n}" in median):  # --compare-mode, --compare-graph
        twin_alone, twin_fed = median[twin], median[f"loop {twin}"]
        print(f"{twin} alone : {twin_alone:9.0f} img/s   ({twin_alone / alone:.2f}x the model alone above)")
        print(f"{twin} loop  : {twin_fed:9.0f} img/s   (feed ratio {twin_fed / twin_alone:.3f}; "
              f"{twin_fed / fed:.2f}x the full loop above)")
        got |= {f"{twin}_model_img_s": round(twin_alone), f"{twin}_loop_img_s": round(twin_fed),
                f"{twin}_feed_ratio": round(twin_fed / twin_alone, 3)}
    if device.type == "cuda":
        note = "   (the twins' steps included)" if len(median) > 3 else ""
        print(f"peak GPU memory    : {peak_memory / 2**30:9.2f} GiB{note}")
        peak = peak_of(name)
        if peak:
            print(f"MFU (bf16 peak)    : {flops * fed / peak:9.1%} of {peak / 1e12:.0f} TFLOP/s "
                  f"({flops / 1e9:.2f} GFLOP per image, fwd + bwd)")
            got["mfu"] = round(flops * fed / peak, 3)
        got["peak_gpu_memory_gib"] = round(peak_memory / 2**30, 2)
    return got


if __name__ == "__main__":
    main()

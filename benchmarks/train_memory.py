"""Peak memory and images/s of the training step with and without activation checkpointing
(``{pretrain,finetune}.grad_checkpointing``), measured side by side in one process, in alternating
rounds.

    python benchmarks/train_memory.py                                  # tiny/16 at 224 px, batch 32
    python benchmarks/train_memory.py --preset base --batch 64 --steps 10   # on a GPU

The step is the stages' own ``Stepper`` (forward, backward, clipping, fused AdamW where it applies;
bf16 autocast on a GPU, fp32 on a CPU) on a random batch already on the device. *Step memory* is the
peak during the steps less what was held before them (weights, gradients, AdamW's moments, the
batch), so it is the activations and the backward's temporaries: on a GPU from
``torch.cuda.max_memory_allocated``; on a Linux CPU from the process's peak resident set (VmHWM, reset
through ``/proc/self/clear_refs``), with glibc told to map every allocation of 64 KiB or more on its
own, so that freed tensors leave the resident set at once (both sides run under that setting, which
costs a CPU step some speed in page faults).
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import re
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import add_record_option, command_line, record_and_say
from pipeline.config import TrainConfig
from pipeline.environment import device_name
from pipeline.model import PRESETS, build_vit
from pipeline.train.loop_config import LoopConfig
from pipeline.train.step import Stepper
from pipeline.utils import positive_int

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


class PeakMemory:
    """Bytes held at the peak of a block of work, less those held when it started."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cpu":
            try:  # a fixed threshold also stops glibc from raising it as large blocks are freed
                ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
                Path("/proc/self/clear_refs").write_text("5")
            except OSError as exc:
                sys.exit(f"error: peak memory on a CPU needs Linux with glibc ({exc}); run it on a GPU instead")

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # peak resident set := current
            self.base = self._status("VmRSS")

    def stop(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return self._status("VmHWM") - self.base

    @staticmethod
    def _status(field: str) -> int:
        kib = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
        return int(kib.group(1)) * 1024


def make_stepper(model: torch.nn.Module, batch: int, image_size: int, checkpointing: bool,
                 device: torch.device) -> Stepper:
    """params.yaml's pretrain recipe (AdamW, clipping, label smoothing) on ``model``; no mixing, no EMA."""
    loop = LoopConfig.from_train(
        TrainConfig(image_size=image_size, grad_checkpointing=checkpointing), stage="pretrain",
        model=model.config.to_dict(), shard_dir="", steps_per_epoch=1000, per_worker_batch=batch,
        warmup_steps=0, loader_workers=0, verbose=False)
    return Stepper(copy.deepcopy(model).to(device), loop, device)


def measure(stepper: Stepper, images, labels, steps: int, memory: PeakMemory) -> tuple[float, int]:
    """Images/s and step memory of ``steps`` optimizer steps."""
    memory.start()
    t0 = time.perf_counter()
    for _ in range(steps):
        stepper(images, labels)
    held = memory.stop()  # synchronises the device first
    return steps * images.shape[0] / (time.perf_counter() - t0), held


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--patch-size", type=positive_int, default=16)
    ap.add_argument("--image-size", type=positive_int, default=224)
    ap.add_argument("--batch", type=positive_int, default=32)
    ap.add_argument("--classes", type=positive_int, default=1000)
    ap.add_argument("--steps", type=positive_int, default=2, help="timed steps per measurement")
    ap.add_argument("--rounds", type=positive_int, default=3, help="alternating rounds without / with checkpointing")
    add_record_option(ap)
    args = ap.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    try:
        model = build_vit(args.preset, patch_size=args.patch_size, image_size=args.image_size, num_classes=args.classes)
    except ValueError as exc:  # a geometry the model refuses: its message names the sizes that would work
        ap.error(str(exc))
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, args.classes, (args.batch,), device=device)
    steppers = {mode: make_stepper(model, args.batch, args.image_size, mode, device) for mode in (False, True)}
    memory = PeakMemory(device)
    for stepper in steppers.values():  # warm-up: AdamW's moments, kernels, the allocator's pools
        stepper(images, labels)
    got: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for mode, stepper in steppers.items():
            got[mode].append(measure(stepper, images, labels, args.steps, memory))
    report(args, device, {mode: (statistics.median(s for s, _ in r), statistics.median(m for _, m in r))
                          for mode, r in got.items()})


def report(args, device: torch.device, median: dict[bool, tuple[float, int]]) -> None:
    name = device_name(device)
    print(f"train step of {args.preset}/{args.patch_size} at {args.image_size} px on {name}: batch {args.batch}, "
          f"{'bf16 autocast' if device.type == 'cuda' else 'fp32'}, {args.steps} steps x {args.rounds} rounds, median")
    (speed_off, mem_off), (speed_on, mem_on) = median[False], median[True]
    print(f"without checkpointing : {speed_off:9.1f} img/s   step memory {mem_off / 2**20:9.3f} MiB")
    print(f"with checkpointing    : {speed_on:9.1f} img/s   step memory {mem_on / 2**20:9.3f} MiB")
    print(f"checkpointing         : {mem_off / max(mem_on, 1):9.2f}x less step memory at "
          f"{speed_on / speed_off:.2f}x the speed")
    if args.record:
        record_and_say("train_memory", {"img_s": round(speed_off, 1), "step_memory_mib": round(mem_off / 2**20, 1),
                                        "checkpointed_img_s": round(speed_on, 1),
                                        "checkpointed_step_memory_mib": round(mem_on / 2**20, 1)},
                       command=command_line(__file__),
                       case=f"{args.preset}/{args.patch_size} at {args.image_size} px, batch {args.batch}")


if __name__ == "__main__":
    main()

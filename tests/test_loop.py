"""The training step and the throughput benchmark, in-process (no Ray): compile, device batches."""
from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from pipeline.model import build_vit
from pipeline.train.loop_config import LoopConfig
from pipeline.train.worker import Stepper
from tests.conftest import ROOT


def _cfg(**kw) -> LoopConfig:
    base = dict(stage="pretrain", model={}, shard_dir="unused", image_size=16, epochs=1, steps_per_epoch=4,
                per_worker_batch=8, lr=1e-3, min_lr=1e-5, weight_decay=0.05, warmup_steps=0,
                label_smoothing=0.1, seed=0, eval_every=1, grad_clip=1.0)
    return LoopConfig(**{**base, **kw})


def _model():
    torch.manual_seed(0)  # no qkv bias: the key bias has a ~0 gradient, which Adam turns into noise
    return build_vit("nano", patch_size=4, image_size=16, num_classes=10, depth=2, qkv_bias=False)


def test_compiled_step_matches_eager():
    """``compile: true`` trains the same model: equal loss and (to float tolerance) equal weights."""
    model = _model()
    x, y = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 10
    results = []
    for compiled in (False, True):
        m = copy.deepcopy(model)
        cfg = _cfg(model=m.config.to_dict(), compile=compiled)
        stepper = Stepper(m, cfg, torch.device("cpu"))
        losses = [stepper(x, y)[0].item() / 8 for _ in range(2)]
        results.append((losses, m.state_dict()))
    (eager_loss, eager_state), (comp_loss, comp_state) = results
    assert comp_loss == pytest.approx(eager_loss, rel=1e-4)
    assert eager_loss[1] < eager_loss[0]  # it did learn
    for k in eager_state:
        torch.testing.assert_close(comp_state[k], eager_state[k], rtol=1e-3, atol=1e-5, msg=k)


def test_accumulated_step_equals_one_big_step():
    """``max_worker_batch`` splits the batch into micro-batches: same gradients as the whole batch."""
    x, y = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(2)), torch.arange(8) % 10
    states, outs = [], []
    for max_batch in (None, 4):
        m = _model()
        stepper = Stepper(m, _cfg(model=m.config.to_dict(), max_worker_batch=max_batch, grad_clip=None),
                          torch.device("cpu"))
        outs.append(stepper(x, y))
        states.append({n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    assert outs[0][1].item() == outs[1][1].item()
    for k in states[0]:
        torch.testing.assert_close(states[0][k], states[1][k], rtol=1e-4, atol=1e-7, msg=k)


def test_throughput_benchmark_runs_on_cpu(digits_dir):
    """The README's benchmark command, shortened: it measures both sides and prints the feed ratio."""
    proc = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--shards", str(digits_dir),
                           "--steps", "2", "--rounds", "1", "--set", "ray.loader_workers=1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split(":")[0].strip(): line.split(":", 1)[1] for line in proc.stdout.splitlines() if ":" in line}
    alone = float(lines["median model alone"].split()[0])
    fed = float(lines["median full loop"].split()[0])
    assert alone > 0 and fed > 0
    assert float(lines["feed ratio"].split()[0]) == pytest.approx(fed / alone, rel=0.01)
    assert "batch 64" in proc.stdout and "1 loader workers" in proc.stdout  # one rank takes the global batch

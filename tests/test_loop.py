"""The training step and the throughput benchmark, in-process (no Ray): compile, device batches."""
from __future__ import annotations

import copy
import dataclasses
import json
import re
import time
from pathlib import Path

import pytest
import torch

from pipeline.config import TrainConfig
from pipeline.model import build_vit
from pipeline.train import worker
from pipeline.train.flops import flops_per_image
from pipeline.train.loop_config import LoopConfig
from pipeline.train.step import Stepper
from tests.conftest import run_as_on_gpu_box, run_cases_as_on_gpu_box


def _cfg(model: dict, **kw) -> LoopConfig:
    train = TrainConfig(**{**dict(image_size=16, epochs=1, lr=1e-3, min_lr=1e-5, weight_decay=0.05,
                                  label_smoothing=0.1, seed=0, eval_every=1, grad_clip=1.0), **kw})
    return LoopConfig.from_train(train, stage="pretrain", model=model, shard_dir="unused", steps_per_epoch=4,
                                 per_worker_batch=8, warmup_steps=0, loader_workers=0, verbose=False)


def _model():
    torch.manual_seed(0)  # no qkv bias: the key bias has a ~0 gradient, which Adam turns into noise
    return build_vit("nano", patch_size=4, image_size=16, num_classes=10, depth=2, qkv_bias=False)


def _steps(model, device: torch.device, steps: int = 2, **cfg):
    """The per-step mean losses and the final weights of ``steps`` steps on one fixed batch."""
    x, y = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 10
    m = copy.deepcopy(model).to(device)
    stepper = Stepper(m, _cfg(m.config.to_dict(), **cfg), device)
    losses = [stepper(x.to(device), y.to(device))[0].item() / 8 for _ in range(steps)]
    return losses, {k: v.cpu() for k, v in m.state_dict().items()}, stepper


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_step_matches_eager(mode):
    """``compile: true`` trains the same model, in each ``compile_mode`` (on a CPU ``reduce-overhead``
    compiles without CUDA graphs): equal loss and (to float tolerance) equal weights."""
    model = _model()
    eager_loss, eager_state, _ = _steps(model, torch.device("cpu"))
    comp_loss, comp_state, _ = _steps(model, torch.device("cpu"), compile=True, compile_mode=mode)
    assert comp_loss == pytest.approx(eager_loss, rel=1e-4)
    assert eager_loss[1] < eager_loss[0]  # it did learn
    for k in eager_state:
        torch.testing.assert_close(comp_state[k], eager_state[k], rtol=1e-3, atol=1e-5, msg=k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graph", [dict(compile=True, compile_mode="reduce-overhead"), dict(cuda_graph=True),
                                   dict(cuda_graph=True, compile=True)],
                         ids=["reduce-overhead", "cuda_graph", "cuda_graph-compiled"])
def test_cuda_graphed_step_matches_eager_and_never_syncs(graph):
    """On a GPU the step replays CUDA graphs and trains as eager does, micro batches included: the
    model's forward and backward with ``compile_mode: reduce-overhead``; the whole step (clipping,
    AdamW and EMA too) with ``cuda_graph: true``, eager or compiled, once its warm-up steps are done.
    Once warm, a step (EMA, clipping, scheduler and all) never waits for the GPU."""
    from pipeline.train.graphs import WARMUP_STEPS
    model, cuda = _model(), torch.device("cuda")
    recipe = dict(amp="off", max_worker_batch=4, ema_decay=0.99, steps=WARMUP_STEPS + 2)
    eager_loss, eager_state, _ = _steps(model, cuda, **recipe)
    loss, state, stepper = _steps(model, cuda, **graph, **recipe)
    assert stepper.graphed if "compile_mode" in graph else stepper.captured.graph is not None
    assert loss == pytest.approx(eager_loss, rel=1e-3)
    for k in eager_state:
        torch.testing.assert_close(state[k], eager_state[k], rtol=1e-2, atol=1e-4, msg=k)
    x, y = torch.randn(8, 3, 16, 16, device=cuda), torch.arange(8, device=cuda) % 10
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            stepper(x, y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_graph_safe_step_matches_the_plain_step():
    """``cuda_graph: true`` on a CPU runs the step it would capture, eagerly: learning rates in device
    tensors the scheduler fills, the EMA's weight read from a tensor, MixUp drawn outside. It trains
    as the plain step does (warm-up schedule, EMA warm-up, clipping, accumulation and MixUp on half the
    batches, one-hot targets on the others)."""
    model, cpu = _model(), torch.device("cpu")
    recipe = dict(ema_decay=0.99, max_worker_batch=4, mixup_alpha=0.8, mix_prob=0.5, warmup_epochs=1.0, steps=5)
    runs = []
    for graph in (False, True):
        torch.manual_seed(7)  # MixUp's draws
        cfg = dict(recipe)
        steps = cfg.pop("steps")
        x, y = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 10
        m = copy.deepcopy(model)
        loop = dataclasses.replace(_cfg(m.config.to_dict(), cuda_graph=graph, **cfg), warmup_steps=3)
        stepper = Stepper(m, loop, cpu)
        losses, lrs = [], []
        for _ in range(steps):
            losses.append(stepper(x, y)[0].item())
            lrs.append(stepper.lr())
        runs.append((losses, lrs, m.state_dict(), stepper.ema.module.state_dict(), stepper))
    (plain_loss, plain_lr, plain_w, plain_ema, _), (loss, lr, w, ema, stepper) = runs
    assert isinstance(stepper.optimizer.param_groups[0]["lr"], torch.Tensor)  # the graph-safe step ran
    assert stepper.ema.updates == 5 and len(set(plain_lr)) > 2  # the schedule moved
    assert loss == pytest.approx(plain_loss, rel=1e-5) and lr == pytest.approx(plain_lr, rel=1e-6)
    for k in plain_w:
        torch.testing.assert_close(w[k], plain_w[k], rtol=1e-4, atol=1e-6, msg=k)
        torch.testing.assert_close(ema[k], plain_ema[k], rtol=1e-4, atol=1e-6, msg=k)


def test_mix_prob_mixes_that_share_of_the_batches_with_one_shape_of_targets():
    """``mix_prob: 0.5``: about half the batches are mixed; the others keep their pixels and get one-hot
    targets, the same shape as mixed ones (a CUDA graph replays one shape). At 1 every batch is mixed."""
    from pipeline.train.techniques import batch_mixer
    x, y = torch.rand(8, 3, 16, 16), torch.arange(8) % 10
    torch.manual_seed(0)
    mixer, mixed = batch_mixer(0.8, 1.0, 10, prob=0.5), 0
    for _ in range(200):
        images, targets = mixer(x, y)
        assert targets.shape == (8, 10) and targets.dtype == torch.float32
        torch.testing.assert_close(targets.sum(-1), torch.ones(8))
        if torch.equal(images, x):
            assert torch.equal(targets, torch.nn.functional.one_hot(y, 10).float())
        else:
            mixed += 1
    assert 70 < mixed < 130, mixed
    every = batch_mixer(0.8, 0.0, 10, prob=1.0)
    assert all(not torch.equal(every(x, y)[0], x) for _ in range(20))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_the_step_s_loss_is_soft_cross_entropy(label_smoothing):
    """The step's loss is torch's cross-entropy on the mixer's soft targets, smoothing included: the
    same values as written out (smoothed targets times the negative log-softmax), and for one-hot targets
    the same as integer labels."""
    import torch.nn.functional as F

    from pipeline.train.techniques import batch_mixer
    torch.manual_seed(0)
    logits, y = torch.randn(64, 10) * 3, torch.arange(64) % 10
    _, soft = batch_mixer(0.8, 1.0, 10)(torch.rand(64, 3, 8, 8), y)
    smoothed = soft * (1 - label_smoothing) + label_smoothing / 10
    by_hand = torch.sum(-smoothed * F.log_softmax(logits, dim=-1), dim=-1).mean()
    assert abs(F.cross_entropy(logits, soft, label_smoothing=label_smoothing) - by_hand) < 2e-6
    one_hot = F.one_hot(y, 10).float()
    torch.testing.assert_close(F.cross_entropy(logits, one_hot, label_smoothing=label_smoothing),
                               F.cross_entropy(logits, y, label_smoothing=label_smoothing))


def test_accumulated_step_equals_one_big_step():
    """``max_worker_batch`` splits the batch into micro-batches: same gradients as the whole batch."""
    x, y = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(2)), torch.arange(8) % 10
    states, outs = [], []
    for max_batch in (None, 4):
        m = _model()
        stepper = Stepper(m, _cfg(m.config.to_dict(), max_worker_batch=max_batch, grad_clip=None),
                          torch.device("cpu"))
        outs.append(stepper(x, y))
        states.append({n: p.grad for n, p in m.named_parameters()})
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    assert outs[0][1].item() == outs[1][1].item()
    for k in states[0]:
        torch.testing.assert_close(states[0][k], states[1][k], rtol=1e-4, atol=1e-7, msg=k)


def test_grad_checkpointing_step_equals_the_plain_step():
    """``grad_checkpointing: true`` reaches the model through the recipe and trains identically (CPU:
    bit for bit, stochastic depth included)."""
    x, y = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(3)), torch.arange(8) % 10
    model = build_vit("nano", patch_size=4, image_size=16, num_classes=10, depth=2, drop_path_rate=0.3)
    results = []
    for enable in (False, True):
        m = copy.deepcopy(model)
        stepper = Stepper(m, _cfg(m.config.to_dict(), grad_checkpointing=enable), torch.device("cpu"))
        assert m.grad_checkpointing is enable
        torch.manual_seed(5)
        results.append(([stepper(x, y)[0].item() for _ in range(2)], m.state_dict()))
    (plain_loss, plain), (ck_loss, ck) = results
    assert ck_loss == plain_loss
    for k in plain:
        assert torch.equal(ck[k], plain[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("args, line", [
    (("--preset", "nope"), "train_memory.py: error: argument --preset: invalid choice: 'nope' (choose from 'base',"),
    (("--preset", "nano", "--patch-size", "5"), "train_memory.py: error: image_size[0]: 224 is not divisible by "
                                                "patch_size[0]=5 (nearest valid sizes: 220 or 225)"),
])
def test_train_memory_benchmark_refuses_a_model_it_cannot_build(args, line):
    """A preset or geometry the model refuses: argparse's usage line and exit 2 (before: a traceback)."""
    proc = run_as_on_gpu_box("benchmarks/train_memory.py", *args)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr


@pytest.mark.slow
def test_train_memory_benchmark_runs_on_cpu():
    """docs/training.md's activation-memory benchmark, shortened: both sides measured and compared."""
    proc = run_as_on_gpu_box("benchmarks/train_memory.py", "--preset", "nano", "--patch-size", "4",
                             "--image-size", "32", "--batch", "32", "--classes", "10", "--steps", "1",
                             "--rounds", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split(":")[0].strip(): line.split(":", 1)[1] for line in proc.stdout.splitlines()[1:]}
    (off_speed, off_mem), (on_speed, on_mem) = (
        (float(rows[k].split()[0]), float(rows[k].split("step memory")[1].split()[0]))
        for k in ("without checkpointing", "with checkpointing"))
    assert min(off_speed, on_speed, off_mem, on_mem) > 0
    ratio = float(rows["checkpointing"].split("x")[0])
    assert ratio == pytest.approx(off_mem / on_mem, abs=0.01)
    assert re.search(r"train step of nano/4 at 32 px on .* \(\d+ cores.*\): batch 32, fp32", proc.stdout)


def _printed_ratio(printed: str, num: float, den: float) -> None:
    """``printed`` is num / den, up to the rounding of all three as printed (images/s as whole numbers:
    a few-step CPU round can print 20 img/s, where rounding alone moves a ratio by a few percent)."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    ratio = num / den
    assert float(printed) == pytest.approx(ratio, abs=0.5 * 10 ** -decimals + ratio * (0.5 / num + 0.5 / den))


@pytest.mark.slow
def test_throughput_benchmark_runs_on_cpu(digits_dir, tmp_path):
    """The README's benchmark command, shortened, compiled, with --compare-eager, --compare-mode, --compare-graph
    and --profile (the GPU runbook's form): it measures every side and prints the feed ratio and where the
    loop's time goes, and runs where Ray, MLflow, DVC, ONNX and the rest that a GPU box may lack are not
    installed (conftest.GPU_BOX_REQUIREMENTS). The uncompiled form runs in test_time_to_accuracy.py."""
    proc = run_as_on_gpu_box("benchmarks/train_throughput.py", "--shards", digits_dir, "--steps", "2",
                             "--rounds", "1", "--set", "ray.loader_workers=1", "--set", "model.depth=1",
                             "--set", "pretrain.compile=true", "--compare-eager", "--compare-mode", "reduce-overhead",
                             "--compare-graph", "--profile", tmp_path / "profile", "--profile-steps", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = {line.split(":")[0].strip(): line.split(":", 1)[1] for line in proc.stdout.splitlines() if ":" in line}
    alone, eager, fed = (float(lines[f"median {k}"].split()[0]) for k in ("model alone", "eager alone", "full loop"))
    assert alone > 0 and eager > 0 and fed > 0 and float(lines["median input alone"].split()[0]) > 0
    _printed_ratio(lines["median eager alone"].split("compile buys ")[1].split("x")[0], alone, eager)
    _printed_ratio(lines["feed ratio"].split()[0], fed, alone)
    assert "batch 64" in proc.stdout and "compile True (default), 1 loader workers" in proc.stdout  # one rank, whole batch
    for name in ("reduce-overhead", "cuda_graph"):  # each twin, alone and in the loop, beside the recipe's
        twin_alone, twin_fed = (float(lines[f"{name} {k}"].split()[0]) for k in ("alone", "loop"))
        _printed_ratio(lines[f"{name} alone"].split("(")[1].split("x")[0], twin_alone, alone)
        ratio, speedup = lines[f"{name} loop"].split("feed ratio ")[1].split("; ")
        _printed_ratio(ratio, twin_fed, twin_alone)
        _printed_ratio(speedup.split("x")[0], twin_fed, fed)
    wall = float(lines["profile, 8 full-loop steps (profiler on)"].split()[0])
    host = [float(lines[f"host, {k}"].split()[0]) for k in ("input", "train step")]
    # both inside the timed steps; 8 steps (a parcel here) always hold one parcel's fetch, where the input works
    assert 0 < sum(host) <= wall * 1.05 and min(host) > 0
    trace = json.loads((tmp_path / "profile" / "trace.json").read_text())
    assert {"input", "train_step"} <= {e.get("name") for e in trace["traceEvents"]}


def test_throughput_report_gives_mfu_beside_the_twins(monkeypatch, capsys):
    """On a GPU the report ends with MFU against the device's bf16 peak, also after --compare-graph's
    twin lines (whose loop once reused the device name's variable, so no MFU followed them)."""
    from types import SimpleNamespace as NS

    from benchmarks import train_throughput as tp
    monkeypatch.setattr(tp, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    args = NS(stage="pretrain", recipe="configs/cifar10-1gpu.yaml", params="params.yaml", steps=40, rounds=2)
    params = NS(model=NS(preset="small", patch_size=4))
    loop = NS(image_size=32, per_worker_batch=512, amp="auto", compile=True, compile_mode="reduce-overhead",
              cuda_graph=False, loader_workers=15)
    median = {"model": 47620.0, "input": 42141.0, "loop": 45273.0, "cuda_graph": 47889.0, "loop cuda_graph": 47771.0}
    tp.report(args, params, loop, torch.device("cuda"), median, 2**30, 1e9)
    out = capsys.readouterr().out
    assert "cuda_graph loop  :     47771 img/s   (feed ratio 0.998; 1.06x the full loop above)" in out
    assert f"MFU (bf16 peak)    : {1e9 * 45273 / 989e12:9.1%} of 989 TFLOP/s" in out


def test_ema_warmup_follows_the_schedule_and_resumes():
    """Update 0 copies the weights (decay 0), then 1 - (1 + t)^(-2/3) until it reaches ema_decay."""
    from pipeline.train.techniques import EMA, ema_decay_at
    assert ema_decay_at(0, 0.9998, True) == 0.0
    assert ema_decay_at(9, 0.9998, True) == pytest.approx(1 - 10 ** (-2 / 3))
    assert ema_decay_at(10**9, 0.9998, True) == 0.9998 and ema_decay_at(0, 0.9998, False) == 0.9998
    decays = [ema_decay_at(t, 0.99, True) for t in range(5000)]
    assert all(a <= b for a, b in zip(decays, decays[1:])) and decays[-1] == 0.99
    model = torch.nn.Linear(3, 2)
    ema = EMA(model, 0.99)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ema.update(model)
    assert torch.equal(ema.module.weight, model.weight)  # random start forgotten at once
    before = ema.module.weight.clone()
    with torch.no_grad():
        model.weight.fill_(3.0)
    ema.update(model)
    d = ema_decay_at(1, 0.99, True)  # ~0.37: a fixed 0.99 would have moved 0.02 of the way
    torch.testing.assert_close(ema.module.weight, d * before + (1 - d) * model.weight)
    fixed = EMA(torch.nn.Linear(3, 2), 0.99, warmup=False)
    fixed.update(model)
    assert not torch.equal(fixed.module.weight, model.weight)
    restored = EMA(torch.nn.Linear(3, 2), 0.99)
    restored.load_state_dict(ema.state_dict())
    assert restored.updates == 2 and torch.equal(restored.module.weight, ema.module.weight)


def _evals(*pairs):
    """Evaluated epochs with (raw, ema) val top-1 (ema None: no EMA)."""
    rows = []
    for epoch, (raw, ema) in enumerate(pairs, start=1):
        row = {"epoch": epoch, "step": 10 * epoch, "val_top1": raw}
        if ema is not None:
            row["val_top1_ema"] = ema
        rows.append(row)
    return rows


def test_selection_keeps_the_better_weights_best_or_last_and_stops_early():
    from pipeline.train.selection import Selection, summary
    rows = _evals((0.5, 0.6), (0.85, 0.7), (0.8, 0.82), (0.91, 0.95), (0.9, 0.9))
    last, best = Selection(keep="last"), Selection(keep="best", patience=2)
    for i, row in enumerate(rows):
        last.wall_time_s = best.wall_time_s = 10.0 * (i + 1)
        changed = [last.update(row, images=100 * (i + 1)), best.update(row, images=100 * (i + 1))]
        assert changed[0]
        assert changed[1] == (row["epoch"] in (1, 2, 4))
    assert last.kept["epoch"] == 5 and last.kept["source"] == "raw"  # tie: raw
    assert best.kept == {"epoch": 4, "step": 40, "source": "ema", "val_top1": 0.95,
                         "reason": "keep: best: ema weights of the best evaluation (val top-1 EMA 0.9500 vs raw 0.9100)"}
    assert not best.stopped and best.stale == 1
    at_the_end = copy.deepcopy(best)
    at_the_end.update(_evals((0.1, 0.2))[0] | {"epoch": 6}, images=600, last=True)
    assert not at_the_end.stopped and at_the_end.stale == 2  # out of patience on the last epoch: no early stop
    best.update(_evals((0.1, 0.2))[0] | {"epoch": 6}, images=600)
    assert best.stopped and best.stopped_epoch == 6
    s = summary(best)
    assert s["kept_epoch"] == 4 and s["stopped_epoch"] == 6
    assert (s["epoch_to_top1_80"], s["epoch_to_top1_90"], s["epoch_to_top1_93"]) == (2, 4, 4)
    assert s["time_to_top1_80_s"] == 20.0 and s["images_to_top1_93"] == 400
    again = Selection()
    again.load_state_dict(best.state_dict())
    assert again == best


def record_step(step: int, ctx, path: str) -> None:
    """A step hook (see test below): one line per call."""
    with open(path, "a") as f:
        f.write(f"{ctx.rank}:{step}\n")


@pytest.mark.slow
def test_step_hooks_run_by_name_before_each_step(digits_dir, tmp_path):
    """``LoopRun.step_hooks`` names ``module:function=argument``; the loop imports and calls each one
    before every optimizer step (how tests/faults.py injects failures into Ray workers)."""
    import dataclasses

    from pipeline.train.context import LocalContext
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.worker import load_step_hooks, run_loop

    model = _model()
    cfg = dataclasses.replace(_cfg(model.config.to_dict()), shard_dir=str(digits_dir), steps_per_epoch=3)
    log = tmp_path / "steps.txt"
    run = LoopRun(init_state=model.state_dict(), step_hooks=(f"tests.test_loop:record_step={log}",))
    run_loop(cfg, run, LocalContext(str(tmp_path / "run"), use_gpu=False, keep=1))
    assert log.read_text().split() == ["0:0", "0:1", "0:2"]
    with pytest.raises(ValueError, match="step hook 'tests.nope:fn'"):
        load_step_hooks(["tests.nope:fn"])


def sleep_step(step: int, ctx, seconds: str) -> None:
    time.sleep(float(seconds))


@pytest.mark.slow
def test_epoch_reports_the_time_spent_waiting_for_input(digits_dir, tmp_path, capsys, monkeypatch):
    """``input_wait_s`` (timm's data_time): the seconds the loop waited for its batches, not the steps'
    own time. A hook that sleeps 0.2 s before each of 3 steps makes the epoch long, not the wait. Its
    share of the epoch, images/s and (on a device of a known peak) MFU go into the MLflow run."""
    from mlflow.tracking import MlflowClient

    from pipeline.train.checkpoint import load_state
    from pipeline.train.context import LocalContext, list_checkpoints
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.worker import _Waited

    def slow(n: int):
        for i in range(n):
            time.sleep(0.05)
            yield i
    items = _Waited(slow(3))
    assert list(items) == [0, 1, 2] and 0.15 <= items.seconds < 1.0

    model = _model()
    cfg = dataclasses.replace(_cfg(model.config.to_dict()), shard_dir=str(digits_dir), steps_per_epoch=3)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("wait")).info.run_id
    run = LoopRun(init_state=model.state_dict(), step_hooks=("tests.test_loop:sleep_step=0.2",), run_id=run_id,
                  tracking_uri=uri)
    monkeypatch.setattr(worker, "device_peak", lambda device: 1e12)  # as on a GPU of a 1 TFLOP/s bf16 peak
    worker.run_loop(cfg, run, LocalContext(str(tmp_path / "run"), use_gpu=False, keep=1))
    (epoch,) = load_state(tmp_path / "run" / list_checkpoints(str(tmp_path / "run"))[0])["history"]
    assert epoch["epoch_time_s"] >= 0.6 and 0 < epoch["input_wait_s"] < epoch["epoch_time_s"] - 0.55
    share = re.search(r"\| input wait (\d+)% \|", capsys.readouterr().out)
    assert share and abs(int(share[1]) - 100 * epoch["input_wait_share"]) <= 0.5 + 1e-9
    logged = client.get_run(run_id).data.metrics  # each run's throughput and MFU, in MLflow
    assert logged["input_wait_share"] == pytest.approx(epoch["input_wait_s"] / epoch["epoch_time_s"])
    assert logged["images_per_s"] == pytest.approx(epoch["images_per_s"])
    assert logged["mfu"] == pytest.approx(epoch["images_per_s"] * flops_per_image(cfg.model, 16) / 1e12)


def test_profile_steps_saves_a_trace_as_the_runs_artifact(digits_dir, tmp_path, monkeypatch, capsys):
    """``profile_steps: 2``: rank 0 records steps 4-5 of the launch (after WAIT_STEPS) with torch.profiler and
    the trace, holding the steps' ops, becomes the MLflow run's artifact profile/trace.json; it does not
    change the run's name (what it computes)."""
    from mlflow.tracking import MlflowClient

    from pipeline.train.context import LocalContext
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.profiling import WAIT_STEPS

    monkeypatch.chdir(tmp_path)  # the experiment's artifacts: ./mlruns
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("profile")).info.run_id
    model = _model()
    cfg = dataclasses.replace(_cfg(model.config.to_dict(), profile_steps=2), shard_dir=str(digits_dir),
                              steps_per_epoch=WAIT_STEPS + 3)
    assert cfg.identity() == dataclasses.replace(cfg, profile_steps=None).identity()
    worker.run_loop(cfg, LoopRun(init_state=model.state_dict(), run_id=run_id, tracking_uri=uri),
                    LocalContext(str(tmp_path / "run"), use_gpu=False, keep=1))
    assert f"[pretrain] torch.profiler trace of steps {WAIT_STEPS + 1}-{WAIT_STEPS + 2}: the MLflow run's " \
           "artifact profile/trace.json" in capsys.readouterr().out
    trace = json.loads(Path(client.download_artifacts(run_id, "profile/trace.json", str(tmp_path))).read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::addmm" in names or "aten::mm" in names  # the steps' matmuls


def test_analytic_flops_are_what_torch_counts_and_mfu_needs_a_known_peak(capsys):
    """pipeline/train/flops.py's FLOPs per training image equal torch.utils.flop_counter's count of a step
    (attention as the math kernel, which the counter sees on a CPU), for a [CLS] model (whose last block
    computes one token) and a mean-pooled one; MFU only against a peak in the table, never a CPU's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from pipeline.train.context import LocalContext
    from pipeline.train.flops import device_peak, peak_of

    for kw in (dict(depth=2), dict(depth=3, pool="mean", mlp_ratio=2.0, patch_size=8, image_size=32)):
        model = build_vit("nano", **{**dict(patch_size=4, image_size=16, num_classes=10), **kw})
        x = torch.randn(2, 3, model.config.image_size[0], model.config.image_size[1])
        counter = FlopCounterMode(display=False)
        with counter, sdpa_kernel(SDPBackend.MATH):
            model(x).sum().backward()
        assert flops_per_image(model.config.to_dict()) == pytest.approx(counter.get_total_flops() / 2, rel=0.01)
    assert peak_of("NVIDIA H100 80GB HBM3") == 989e12 and peak_of("Tesla T4") is None
    assert device_peak(torch.device("cpu")) is None
    cfg = _cfg(_model().config.to_dict())
    assert worker._mfu_rate(cfg, LocalContext("unused", use_gpu=False, keep=1)) is None
    assert "[pretrain] MFU not logged: no bf16 peak known for" in capsys.readouterr().out


@pytest.mark.slow
def test_a_long_epoch_prints_lines_within_it(digits_dir, tmp_path, capsys, monkeypatch):
    """Rank 0 prints a line within an epoch at a logged step once none has come for PROGRESS_EVERY_S
    (here 0: at every logged step), with the step's global loss, the pace and the ETA; not at a step
    that only checkpoints."""
    from pipeline.train import worker
    from pipeline.train.context import LocalContext
    from pipeline.train.loop_config import LoopRun

    monkeypatch.setattr(worker, "PROGRESS_EVERY_S", 0.0)
    model = _model()
    cfg = dataclasses.replace(_cfg(model.config.to_dict(), log_every_steps=2, checkpoint_every_steps=3),
                              shard_dir=str(digits_dir), steps_per_epoch=5)
    worker.run_loop(cfg, LoopRun(init_state=model.state_dict()), LocalContext(str(tmp_path), use_gpu=False, keep=1))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[pretrain] epoch 1/1 ")]
    within = [re.fullmatch(r"\[pretrain\] epoch 1/1 step (\d)/5 loss \d+\.\d{4} \| \d+ img/s \| input wait \d+% \| "
                           r"ETA 0:00:\d\d", ln) for ln in lines[:-1]]
    assert [m and m[1] for m in within] == ["1", "2", "4"]  # step 1, then every log_every_steps
    assert lines[-1].startswith("[pretrain] epoch 1/1 step 5 loss ")  # the epoch's own line
    monkeypatch.setattr(worker, "PROGRESS_EVERY_S", 3600.0)  # a short epoch: its own line only
    worker.run_loop(cfg, LoopRun(init_state=model.state_dict()), LocalContext(str(tmp_path / "b"), use_gpu=False,
                                                                             keep=1))
    assert [ln[:30] for ln in capsys.readouterr().out.splitlines() if " epoch 1/1 " in ln] == [lines[-1][:30]]


@pytest.mark.slow
def test_graph_safe_run_checkpoints_and_a_plain_run_continues_it(digits_dir, tmp_path):
    """A ``cuda_graph: true`` run (on a CPU its graph-safe step runs eagerly) checkpoints its tensor
    learning rates and EMA; a plain run continues from its first epoch (``cuda_graph`` is not part of
    a run's identity), and all three end where one plain run does."""
    from pipeline.train.checkpoint import load_state
    from pipeline.train.context import LocalContext, list_checkpoints
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.worker import run_loop

    model = _model()
    plain = dataclasses.replace(_cfg(model.config.to_dict(), ema_decay=0.99, epochs=2), shard_dir=str(digits_dir),
                                steps_per_epoch=3, warmup_steps=2)

    def train(cfg, run_dir, resume_from=None) -> list[dict]:
        ctx = LocalContext(str(run_dir), use_gpu=False, keep=2, resume_from=resume_from)
        run_loop(cfg, LoopRun(init_state=model.state_dict()), ctx)
        return [load_state(run_dir / name) for name in list_checkpoints(str(run_dir))]

    (_, reference), (first, graphed) = train(plain, tmp_path / "plain"), train(
        dataclasses.replace(plain, cuda_graph=True), tmp_path / "graph")
    assert isinstance(graphed["optimizer"]["param_groups"][0]["lr"], torch.Tensor) and first["epoch"] == 1
    (continued,) = train(plain, tmp_path / "continued", resume_from=str(tmp_path / "graph" / list_checkpoints(
        str(tmp_path / "graph"))[0]))
    assert [(type(g["lr"]), g["lr"], g["capturable"]) for g in continued["optimizer"]["param_groups"]] == [
        (float, g["lr"], False) for g in reference["optimizer"]["param_groups"]]  # plain again: float rates
    for end in (graphed, continued):
        assert end["step"] == 6 and end["ema"]["_extra_state"] == {"updates": 6}
        for part in ("model", "ema"):
            for k, v in reference[part].items():
                if isinstance(v, torch.Tensor):
                    torch.testing.assert_close(end[part][k], v, rtol=1e-4, atol=1e-6, msg=f"{part}.{k}")


def test_graph_free_undoes_what_a_capture_left_in_the_groups():
    """A GPU capture leaves tensor learning rates and ``capturable`` in the groups it saves; a plain
    step restored from them gets floats and ``capturable`` off again, and steps as before."""
    from pipeline.train.graphs import graph_free, graph_safe

    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.01)
    graph_safe(opt, torch.device("cpu"))
    opt.param_groups[0]["capturable"] = True  # what CapturedStep._capture sets on a GPU
    graph_free(opt)
    assert type(opt.param_groups[0]["lr"]) is float and opt.param_groups[0]["lr"] == pytest.approx(0.01)
    assert opt.param_groups[0]["capturable"] is False
    w.grad = torch.ones(3)
    opt.step()
    assert torch.all(w < 1)


def test_a_run_short_of_its_end_is_reported_as_diverged():
    """The driver's reading of the final checkpoint: the last epoch (of ``epochs``, or of a time budget's
    plan) or an early stop is a finished run; anything short of both (or no checkpoint at all) is the
    loop's divergence stop."""
    from types import SimpleNamespace

    from pipeline.train.driver import TrainingDiverged, check_finished

    def final(epoch, step, batch_in_epoch=0, stopped_epoch=None, planned_epochs=None):
        return {"epoch": epoch, "step": step, "batch_in_epoch": batch_in_epoch, "planned_epochs": planned_epochs,
                "selection": {"stopped_epoch": stopped_epoch}}

    spec = SimpleNamespace(stage="finetune", run_name="finetune-abc", loop=SimpleNamespace(epochs=5))
    check_finished(spec, final(5, 50))
    check_finished(spec, final(3, 30, stopped_epoch=3))
    check_finished(spec, final(3, 30, planned_epochs=3))
    with pytest.raises(TrainingDiverged, match=r"finetune run finetune-abc diverged after its last checkpoint "
                                                r"\(step 20, epoch 2\).*lower finetune\.lr"):  # the end of epoch 2
        check_finished(spec, final(2, 20))
    with pytest.raises(TrainingDiverged, match=r"\(step 23, epoch 3\)"):  # 3 steps into epoch 3
        check_finished(spec, final(2, 23, batch_in_epoch=3))
    with pytest.raises(TrainingDiverged, match=r"\(step 30, epoch 3\)"):  # short of its plan
        check_finished(spec, final(3, 30, planned_epochs=4))
    with pytest.raises(TrainingDiverged, match="diverged before its first checkpoint"):
        check_finished(spec, None)


def test_run_name_covers_every_param_the_run_logs(digits_dir, tmp_path):
    """A resumed MLflow run cannot change a param, so the Ray run name (which picks the run to resume)
    changes with every logged param, even one that changes nothing computed; not with ``ray.loader_workers``,
    nor with where the shards are (a job's scratch folder, a bucket): with what they hold."""
    import json
    import shutil
    from pathlib import Path

    from pipeline.config import load_params
    from pipeline.data import read_dataset_info
    from pipeline.train.stage import plan_stage

    root = Path(__file__).resolve().parents[1]

    def run_name(shards=digits_dir, **overrides):
        params = load_params(root / "params.yaml", overrides)
        torch.manual_seed(0)  # the same initial weights each time
        model = build_vit("nano", patch_size=4, image_size=32, num_classes=10)
        return plan_stage("finetune", params, params.finetune, model, shards, read_dataset_info(shards))[1].run_name

    base = run_name()
    assert run_name() == base and run_name(**{"ray.loader_workers": 3}) == base
    moved = shutil.copytree(digits_dir, tmp_path / "elsewhere")
    assert run_name(moved) == base
    meta = json.loads((moved / "dataset.json").read_text())
    meta["shards"]["train"][0]["sha256"] = "0" * 64  # other bytes in a shard: another run
    (moved / "dataset.json").write_text(json.dumps(meta))
    assert run_name(moved) != base
    # init: null loads models/pretrain whatever the layout says; 1.01 epochs round to the same warm-up steps
    for key, value in (("finetune.init_source", "timm"), ("finetune.warmup_epochs", 1.01)):
        assert run_name(**{key: value}) != base, key


def test_run_name_changes_with_the_training_code(digits_dir, tmp_path, monkeypatch):
    """Edited training code is another run: `dvc repro` after the edit trains again (it republished the
    finished run of the code before). A comment or docstring edit, or an edit to code outside WEIGHTS_CODE
    (logging), continues a run; every WEIGHTS_CODE entry is a dvc.yaml dep of both training stages, so DVC
    re-runs them when the name changes."""
    import shutil

    import yaml

    from pipeline.config import load_params
    from pipeline.data import read_dataset_info
    from pipeline.train import driver
    from pipeline.train.stage import plan_stage

    root = driver.PACKAGE_ROOT
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    for stage in ("pretrain", "finetune"):
        assert set(driver.WEIGHTS_CODE) <= set(stages[stage]["deps"]), stage
    for entry in (*driver.WEIGHTS_CODE, "pipeline/tracking.py"):
        copy = (shutil.copytree if (root / entry).is_dir() else shutil.copy)
        (tmp_path / entry).parent.mkdir(parents=True, exist_ok=True)
        copy(root / entry, tmp_path / entry)
    base = driver.code_digest(tmp_path)
    assert base == driver.code_digest(root)
    with open(tmp_path / "pipeline/tracking.py", "a") as f:
        f.write("LOGGING_EDIT = 1\n")
    assert driver.code_digest(tmp_path) == base
    step = tmp_path / "pipeline/train/step.py"
    code = step.read_text()
    # comments, a reflowed docstring and blank lines: what the code does is unchanged, the run continues
    first_doc = code.index('"""', code.index("def "))
    step.write_text("# a comment\n\n" + code[:first_doc + 3] + "Reflowed,\n    " + code[first_doc + 3:])
    assert driver.code_digest(tmp_path) == base
    step.write_text(code + "\nTRAINING_EDIT = 1\n")
    assert driver.code_digest(tmp_path) != base

    params, info = load_params(root / "params.yaml"), read_dataset_info(digits_dir)

    def run_name():
        torch.manual_seed(0)
        model = build_vit("nano", patch_size=4, image_size=32, num_classes=10)
        return plan_stage("finetune", params, params.finetune, model, digits_dir, info)[1].run_name

    before = run_name()
    monkeypatch.setattr(driver, "code_digest", lambda: "edited")
    assert run_name() != before


@pytest.mark.slow
def test_input_scaling_reports_each_worker_count(digits_dir):
    """``--input-scaling``: the input alone per loader-worker count in the steady state, with where the CPU
    time goes (this process vs the workers), as the GPU runbook runs it; a bad count is one clear line."""
    proc = run_as_on_gpu_box("benchmarks/train_throughput.py", "--shards", digits_dir, "--steps", "32",
                             "--input-scaling", "0,2")  # 4 parcels of 8 steps: the workers' CPU shows in /proc ticks
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"input alone by loader workers \(32 steps each after \d+ untimed, batch 64; the workers run "
                     r"on .+ \(\d+ cores.*\)\):", proc.stdout)
    rows = {int(r[0]): [float(v) for v in r[1:]] for r in (line.split() for line in proc.stdout.splitlines())
            if len(r) == 6 and r[0].isdigit()}
    assert sorted(rows) == [0, 2]
    for count, (rate, per_worker, ms, main_cpu, workers_cpu) in rows.items():
        # ms/batch from img/s, both as printed: ms to 0.05, img/s to 0.5 (at 3,084 img/s that is 0.0034 ms more)
        assert rate > 0 and abs(ms - 64 / rate * 1e3) <= 0.05 + 64e3 * 0.5 / (rate - 0.5) ** 2 + 1e-9
        assert per_worker == pytest.approx(rate / max(count, 1), rel=0.01)
        assert main_cpu > 0
    assert rows[0][4] == 0 and rows[2][4] > 0  # no workers: all in this process; two: they did the work
    (damaged_dir := digits_dir.parent / "damaged").mkdir(exist_ok=True)
    (damaged_dir / "dataset.json").write_text("{")
    bad, *zeros, damaged, too_big = run_cases_as_on_gpu_box(
        "benchmarks/train_throughput.py", ("--shards", digits_dir, "--input-scaling", "1,-2"),
        *(("--shards", digits_dir, flag, "0") for flag in ("--steps", "--rounds", "--profile-steps")),
        ("--shards", damaged_dir), ("--shards", digits_dir, "--set", "pretrain.global_batch_size=100000"))
    assert bad.returncode == 2 and "'1,-2': comma-separated worker counts >= 0" in bad.stderr
    assert "Traceback" not in bad.stderr
    for zero in zeros:  # they were a ZeroDivisionError / KeyError
        assert zero.returncode == 2 and "'0' is not valid: must be an integer >= 1" in zero.stderr, zero.stderr
    assert damaged.returncode == 2 and damaged.stderr.startswith("error: ") and damaged.stderr.count("\n") == 1
    assert "dataset.json: not valid JSON" in damaged.stderr
    assert too_big.returncode == 2 and too_big.stderr.count("\n") == 1, too_big.stderr[-2000:]  # a traceback before
    assert too_big.stderr.startswith("error: pretrain.global_batch_size: 100000 is larger than the train split")


def test_mfu_counts_no_recomputation_and_compare_mode_leaves_the_step_graph(digits_dir):
    """The FLOPs behind MFU are the step's without grad_checkpointing's second forward (which made them 4/3
    too many: that is HFU); a --compare-mode twin in a mode that captures CUDA graphs itself is not put
    inside the recipe's whole-step graph (the combination the stages refuse)."""
    import dataclasses

    from benchmarks import train_throughput as tp

    model = _model()
    loop = dataclasses.replace(_cfg(model.config.to_dict()), cuda_graph=True, grad_checkpointing=True)
    stepper = Stepper(copy.deepcopy(model), loop, torch.device("cpu"))
    x, y = torch.randn(8, 3, 16, 16), torch.arange(8) % 10
    plain = Stepper(copy.deepcopy(model), dataclasses.replace(loop, cuda_graph=False, grad_checkpointing=False),
                    torch.device("cpu"))
    eager = tp.twin(stepper, loop, compile=False, cuda_graph=False, grad_checkpointing=False)
    assert tp.flops_per_image(eager, x, y) == tp.flops_per_image(plain, x, y)
    assert tp.flops_per_image(tp.twin(stepper, loop, compile=False, cuda_graph=False), x, y) > \
        tp.flops_per_image(plain, x, y)  # what was counted before
    assert not tp.mode_twin(stepper, loop, "reduce-overhead").cfg.cuda_graph
    assert tp.mode_twin(stepper, loop, "default").cfg.cuda_graph


def test_a_resumed_launch_draws_drop_path_as_the_whole_run(digits_dir, tmp_path):
    """On a CPU, drop-path draws from the global torch RNG, which checkpoints carry. The val loader
    (workers) must not draw from it: a launch resumed at epoch 1 creates its val loader anew, and
    still ends with the weights of the run that never stopped."""
    from pipeline.train.checkpoint import load_state
    from pipeline.train.context import LocalContext, list_checkpoints
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.worker import run_loop

    torch.manual_seed(0)
    model = build_vit("nano", patch_size=4, image_size=16, num_classes=10, depth=2, drop_path_rate=0.5)
    cfg = dataclasses.replace(_cfg(model.config.to_dict(), epochs=3), shard_dir=str(digits_dir),
                              steps_per_epoch=3, loader_workers=1)

    def train(run_dir, resume_from=None) -> list[dict]:
        ctx = LocalContext(str(run_dir), use_gpu=False, keep=3, resume_from=resume_from)
        run_loop(cfg, LoopRun(init_state=model.state_dict()), ctx)
        return [load_state(run_dir / name) for name in list_checkpoints(str(run_dir))]

    whole = train(tmp_path / "whole")
    assert [c["epoch"] for c in whole] == [1, 2, 3]
    first = tmp_path / "whole" / list_checkpoints(str(tmp_path / "whole"))[0]
    (*_, resumed) = train(tmp_path / "resumed", resume_from=str(first))
    assert resumed["epoch"] == 3
    for k, v in whole[-1]["model"].items():
        assert torch.equal(resumed["model"][k], v), k


def test_one_val_batch_runs_before_the_first_step(digits_dir, tmp_path):
    """The loop's sanity check: a val split that cannot be read fails the run before it trains a
    step, not at the first evaluation ``eval_every`` epochs later."""
    import shutil

    from pipeline.train.context import LocalContext
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.worker import run_loop

    shards = tmp_path / "shards"
    shutil.copytree(digits_dir, shards)
    (shards / "val-000000.tar").write_bytes(b"not a tar" * 100)
    model = _model()
    log = tmp_path / "steps.txt"
    cfg = dataclasses.replace(_cfg(model.config.to_dict(), eval_every=2, epochs=2), shard_dir=str(shards),
                              steps_per_epoch=3)
    run = LoopRun(init_state=model.state_dict(), step_hooks=(f"tests.test_loop:record_step={log}",))
    with pytest.raises(Exception, match="val-000000.tar"):
        run_loop(cfg, run, LocalContext(str(tmp_path / "run"), use_gpu=False, keep=1))
    assert not log.exists() or log.read_text() == ""


def test_checkpoint_every_steps_holds_at_epoch_ends(digits_dir, tmp_path):
    """A step checkpoint due at an epoch's last step is the epoch's own checkpoint, also in an epoch that
    ``checkpoint_every_epochs`` skips (it was dropped there: a failure replayed twice the steps)."""
    from pipeline.train.checkpoint import load_state
    from pipeline.train.context import LocalContext, list_checkpoints
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.worker import run_loop

    model = _model()
    cfg = dataclasses.replace(_cfg(model.config.to_dict(), epochs=4, checkpoint_every_steps=3,
                                   checkpoint_every_epochs=2), shard_dir=str(digits_dir), steps_per_epoch=3)
    run_loop(cfg, LoopRun(init_state=model.state_dict()), LocalContext(str(tmp_path), use_gpu=False, keep=10))
    states = [load_state(tmp_path / name) for name in list_checkpoints(str(tmp_path))]
    assert [(s["step"], s["epoch"], s["batch_in_epoch"]) for s in states] == [(3, 1, 0), (6, 2, 0), (9, 3, 0),
                                                                              (12, 4, 0)]


def stop_before(step: int, ctx, at: str) -> None:
    """A step hook: the launch stops before step ``at`` (as a lost worker or a SIGTERM stops it)."""
    if step == int(at):
        raise RuntimeError(f"stopped before step {at}")


def test_a_launch_resumed_mid_epoch_ends_with_the_weights_of_the_whole_run(digits_dir, tmp_path, capsys):
    """Stopped 2 batches into its second epoch, after a step checkpoint there, and launched again from it,
    a run trains that epoch's batches 2 and 3 (not 0 and 1 again, nor the whole epoch) and ends with the
    weights and the epoch's loss of the run that never stopped."""
    from pipeline.train.checkpoint import load_state
    from pipeline.train.context import LocalContext, list_checkpoints
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.worker import run_loop

    model = _model()
    cfg = dataclasses.replace(_cfg(model.config.to_dict(), epochs=2, checkpoint_every_steps=2),
                              shard_dir=str(digits_dir), steps_per_epoch=4)

    def train(run_dir, hooks=(), resume_from=None) -> list[dict]:
        run_loop(cfg, LoopRun(init_state=model.state_dict(), step_hooks=hooks),
                 LocalContext(str(run_dir), use_gpu=False, keep=10, resume_from=resume_from))
        return [load_state(run_dir / name) for name in list_checkpoints(str(run_dir))]

    whole = train(tmp_path / "whole")[-1]
    with pytest.raises(RuntimeError, match="stopped before step 6"):
        train(tmp_path / "stopped", hooks=("tests.test_loop:stop_before=6",))
    last = tmp_path / "stopped" / list_checkpoints(str(tmp_path / "stopped"))[-1]
    stopped = load_state(last)
    assert (stopped["epoch"], stopped["batch_in_epoch"], stopped["step"]) == (1, 2, 6)
    capsys.readouterr()
    resumed = train(tmp_path / "resumed", resume_from=str(last))[-1]
    assert "resumed from checkpoint: epoch 1, batch 2, step 6" in capsys.readouterr().out
    assert (resumed["epoch"], resumed["step"]) == (whole["epoch"], whole["step"]) == (2, 8)
    for k, v in whole["model"].items():
        assert torch.equal(resumed["model"][k], v), k
    assert resumed["history"][-1]["train_loss"] == pytest.approx(whole["history"][-1]["train_loss"])


@pytest.mark.slow
def test_a_launch_resumed_mid_epoch_keeps_the_time_before_its_checkpoint(digits_dir, tmp_path):
    """``wall_time_s`` (and with it the thresholds' times and a budget's spent time) counts the steps
    trained before a mid-epoch checkpoint: resumed there, the run reports the time of the whole run."""
    from pipeline.train.checkpoint import load_state
    from pipeline.train.context import LocalContext, list_checkpoints
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.worker import run_loop

    model = _model()
    cfg = dataclasses.replace(_cfg(model.config.to_dict(), epochs=2, checkpoint_every_steps=2),
                              shard_dir=str(digits_dir), steps_per_epoch=4)
    run = LoopRun(init_state=model.state_dict(), step_hooks=("tests.test_loop:sleep_step=0.3",))

    def train(run_dir, resume_from=None) -> list[dict]:
        run_loop(cfg, run, LocalContext(str(run_dir), use_gpu=False, keep=10, resume_from=resume_from))
        return [load_state(run_dir / name) for name in list_checkpoints(str(run_dir))]

    whole = train(tmp_path / "whole")
    [mid] = [name for name, c in zip(list_checkpoints(str(tmp_path / "whole")), whole)
             if (c["epoch"], c["batch_in_epoch"]) == (0, 2)]
    resumed = train(tmp_path / "resumed", resume_from=str(tmp_path / "whole" / mid))[-1]
    walls = [h["wall_time_s"] for h in resumed["history"]]
    # every step's sleep, the 2 before the resume too (without them: ~0.7 s for the first epoch); the two runs'
    # totals are not compared, a loaded machine stretches either (4.7 s against 3.8 s in one suite)
    assert walls[0] >= 4 * 0.3 and walls[1] >= 8 * 0.3, walls
    assert len(whole[-1]["history"]) == len(resumed["history"]) == 2


def launch_cost(step: int, ctx, seconds: str) -> None:
    """A step hook: ``seconds`` before a launch's first step (as its compiles and first calls would take),
    0.05 s before every step, and a stop before step 10, after a 3-epoch warm-up's plan."""
    if not getattr(ctx, "launched", False):
        ctx.launched = True
        time.sleep(float(seconds))
    if step == 10:
        raise RuntimeError("stopped after the plan")
    time.sleep(0.05)


@pytest.mark.slow
def test_a_budget_planned_after_a_resume_leaves_out_the_launch_costs(digits_dir, tmp_path, capsys):
    """The plan's pace leaves out the first epoch of each launch (its start-up costs): resumed after
    epoch 1, a run plans at the pace of the run that never stopped, not slowed by a second start-up."""
    from pipeline.train.context import LocalContext, list_checkpoints
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.worker import run_loop

    model = _model()
    cfg = dataclasses.replace(_cfg(model.config.to_dict(), epochs=30, warmup_epochs=3.0, time_budget_minutes=0.5),
                              shard_dir=str(digits_dir), steps_per_epoch=3, warmup_steps=9)
    run = LoopRun(init_state=model.state_dict(), step_hooks=("tests.test_loop:launch_cost=10.0",))

    def pace(run_dir, resume_from=None) -> float:
        with pytest.raises(RuntimeError, match="stopped after the plan"):
            run_loop(cfg, run, LocalContext(str(run_dir), use_gpu=False, keep=10, resume_from=resume_from))
        plan = re.search(r"time budget 0.5 min: [\d.]+ s spent, ([\d.]+) s per epoch", capsys.readouterr().out)
        return float(plan[1])

    whole = pace(tmp_path / "whole")
    first = tmp_path / "whole" / list_checkpoints(str(tmp_path / "whole"))[0]
    resumed = pace(tmp_path / "resumed", resume_from=str(first))
    # with the resumed launch's 10 s start-up in its pace, ~5 s more per epoch than the whole run's (a loaded
    # machine slows both alike, or a stalled epoch one of them by a second or two)
    assert resumed < whole + 3, (whole, resumed)


def test_layer_decay_reaches_a_ddp_wrapped_model(tmp_path):
    """Ray Train wraps the model in DDP with two or more ranks: its parameters are named
    ``module.blocks.N.…`` and it has no ``blocks``, which put every parameter in one group at the
    head's rate (layer decay silently off)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    plain = Stepper(_model(), _cfg(_model().config.to_dict(), layer_decay=0.5), torch.device("cpu"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = Stepper(DistributedDataParallel(_model()), _cfg(_model().config.to_dict(), layer_decay=0.5),
                          torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    rates = [sorted(g["lr"] for g in s.optimizer.param_groups) for s in (plain, wrapped)]
    assert rates[0] == rates[1] and len(set(rates[1])) == 4  # embeddings, 2 blocks, head


def test_the_logged_lr_is_the_schedules_base_rate_with_layer_decay():
    """``lr`` / ``lr_step`` are the schedule's rate (the head's), not the first group's: with layer decay
    the embeddings run at ``layer_decay ** (depth + 1)`` of it (0.125 here), which read like a broken run."""
    _, _, plain = _steps(_model(), torch.device("cpu"), steps=1)
    _, _, decayed = _steps(_model(), torch.device("cpu"), steps=1, layer_decay=0.5)
    rates = [g["lr"] for g in decayed.optimizer.param_groups]
    assert decayed.lr() == plain.lr() == max(rates) and min(rates) == pytest.approx(decayed.lr() / 8)


def test_evaluation_batches_are_no_larger_than_the_micro_batches(digits_dir, tmp_path, monkeypatch):
    """``max_worker_batch`` bounds the evaluation's forward too: the val batches are the train step's micro
    batches, not the worker's whole share (with accumulation that was the run's largest allocation, and ran
    out of memory in the check before the first step)."""
    from pipeline.train import worker
    from pipeline.train.context import LocalContext
    from pipeline.train.loop_config import LoopRun

    seen = []
    real = worker.make_eval_loader

    def recorded(*args, **kwargs):
        return (seen.append(kwargs["batch_size"]), real(*args, **kwargs))[1]

    monkeypatch.setattr(worker, "make_eval_loader", recorded)
    model = _model()
    cfg = dataclasses.replace(_cfg(model.config.to_dict(), max_worker_batch=3), shard_dir=str(digits_dir),
                              steps_per_epoch=2)
    worker.run_loop(cfg, LoopRun(init_state=model.state_dict()), LocalContext(str(tmp_path), use_gpu=False, keep=1))
    assert seen == [2]  # 8 per worker, at most 3 at once: 4 micro batches of 2


def test_a_resumed_launch_logs_no_step_twice(digits_dir, tmp_path):
    """A launch resumed from an earlier checkpoint replays the steps after it; the MLflow run already has
    them from the launch that was stopped (the same values: resume is exact), so they are not logged again:
    each metric's history has each step once (it had the replayed epoch twice, throughput differing)."""
    import shutil

    from mlflow.tracking import MlflowClient

    from pipeline.train.context import LocalContext, list_checkpoints
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.worker import run_loop

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("resume")).info.run_id
    model = _model()
    cfg = dataclasses.replace(_cfg(model.config.to_dict(), epochs=2, log_every_steps=2), shard_dir=str(digits_dir),
                              steps_per_epoch=3)
    run, run_dir = LoopRun(init_state=model.state_dict(), run_id=run_id, tracking_uri=uri), tmp_path / "run"

    def histories() -> dict[str, list[tuple[int, float]]]:
        return {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k))
                for k in ("train_loss", "train_loss_step", "val_top1", "images_per_s")}

    run_loop(cfg, run, LocalContext(str(run_dir), use_gpu=False, keep=3))
    first = histories()
    assert [step for step, _ in first["train_loss"]] == [3, 6]
    shutil.rmtree(run_dir / list_checkpoints(str(run_dir))[-1])  # stopped before its last checkpoint
    run_loop(cfg, run, LocalContext(str(run_dir), use_gpu=False, keep=3))
    assert histories() == first


@pytest.mark.slow
def test_checkpoints_hold_only_data_and_a_planted_one_is_refused_unrun(digits_dir, tmp_path):
    """Checkpoints load with ``weights_only=True`` (every object in them: optimizer, scheduler, fp16 grad
    scaler, EMA, selection, history, each RNG state) and resume; a state.pt that holds anything else is
    refused without running it, naming the file; one that torch cannot read is "not a checkpoint"."""
    import zipfile

    import numpy as np

    from pipeline.train.checkpoint import CheckpointError, load_state, set_rng_state
    from pipeline.train.context import STATE_FILE, LocalContext, checkpoint_name, latest_checkpoint, list_checkpoints
    from pipeline.train.loop_config import LoopRun
    from pipeline.train.worker import run_loop
    from tests.faults import RunsCode

    model, run_dir, marker = _model(), tmp_path / "run", tmp_path / "marker"
    cfg = dataclasses.replace(_cfg(model.config.to_dict(), ema_decay=0.99, keep="best", amp="fp16",
                                   checkpoint_every_steps=2), shard_dir=str(digits_dir), steps_per_epoch=3)

    def train(resume_from=None) -> None:
        run_loop(cfg, LoopRun(init_state=model.state_dict()), LocalContext(str(run_dir), use_gpu=False, keep=10,
                                                                           resume_from=resume_from))

    train()
    states = [load_state(run_dir / name) for name in list_checkpoints(str(run_dir))]
    assert [(s["epoch"], s["batch_in_epoch"]) for s in states] == [(0, 2), (1, 0)]
    assert states[-1]["scaler"]["scale"] > 0 and states[-1]["ema"] and states[-1]["selection"]["kept"]
    set_rng_state(states[0]["rng"][0], torch.device("cpu"))
    assert np.array_equal(np.random.get_state()[1], states[0]["rng"][0]["numpy"][1].numpy())

    planted = run_dir / checkpoint_name()
    planted.mkdir()
    torch.save({**states[-1], "model": RunsCode(marker)}, planted / STATE_FILE)
    assert latest_checkpoint(str(run_dir)) == str(planted)
    with pytest.raises(CheckpointError) as refused:
        train(resume_from=str(planted))
    assert str(refused.value) == (
        f"{planted / STATE_FILE}: not a checkpoint this pipeline wrote: it holds objects other than tensors "
        f"(posix.system); refusing to unpickle it; remove {planted} to resume from the checkpoint before it")
    assert not marker.exists()
    with zipfile.ZipFile(planted / STATE_FILE, "w") as z:  # a zip, as torch.save writes, of something else
        z.writestr("archive/data.pkl", b"")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(planted / STATE_FILE))}: not a checkpoint: torch "
                                              r"cannot read it \(.+\); remove "):
        load_state(planted)
    torch.save({"model": {}}, planted / STATE_FILE)
    with pytest.raises(CheckpointError, match=r": not a checkpoint of a training run \(no rng, selection, epoch"):
        load_state(planted)

"""benchmarks/time_to_accuracy.py, the README's one GPU command, shrunk to the digits shards on the CPU
with every requirement a GPU box may lack blocked (Ray, MLflow, DVC, ONNX, ...): a time budget stops it at an epoch-end
checkpoint, the same command continues, a finished run is not retrained, and its test top-1 is what
the evaluate stage's own prediction of the saved weights gives."""
from __future__ import annotations

import json
import re

import pytest
import torch

from pipeline.data import read_dataset_info
from pipeline.data.augment import AUTO_AUGMENTS
from pipeline.inference import predict_split
from pipeline.model import load_model
from pipeline.recipes import recipe_overrides
from pipeline.train.checkpoint import load_state
from tests.conftest import ROOT, run_as_on_gpu_box, run_cases_as_on_gpu_box

SCRIPT = "benchmarks/time_to_accuracy.py"
TINY = ("--set", "model.depth=1", "--set", "pretrain.epochs=2", "--set", "finetune.epochs=1",
        "--set", "ray.loader_workers=0")
TRAINED = re.compile(r"^\[\w+\] epoch \d+/\d+ ", re.M)  # the loop's line after each trained epoch


def saved_test_top1(model_dir: str, shard_dir, tta: str = "none") -> tuple[float, int]:
    """Test top-1 and sample count of the saved weights, predicted as the evaluate stage predicts."""
    model, meta = load_model(model_dir)
    scored = predict_split(model, shard_dir, "test", image_size=meta["image_size"], batch_size=256,
                           normalize=meta["normalize"], tta=tta)
    return (scored.logits.argmax(1) == scored.labels).sum().item() / scored.labels.numel(), scored.labels.numel()


def checkpointed_epochs(run_dir) -> list[int]:
    """The epoch of each checkpoint a run left (oldest first); fails on a staging folder left behind."""
    names = sorted(p.name for p in run_dir.iterdir() if p.name != "model")
    assert all(n.startswith("checkpoint_") for n in names), names
    return [load_state(run_dir / n)["epoch"] for n in names]


@pytest.mark.slow
def test_budget_stop_resume_and_no_retraining(digits_dir, tmp_path):
    """Checkpoints every 2 epochs: the budget stops the run at the first one, after epoch 2."""
    out = tmp_path / "results" / "tta.json"  # a folder not there yet: made before the training
    command = ("--shards", digits_dir, "--workdir", tmp_path / "work", *TINY, "--set", "pretrain.epochs=3",
               "--set", "pretrain.checkpoint_every_epochs=2", "--max-minutes", "0", "--out", out)

    first = run_as_on_gpu_box(SCRIPT, *command)
    assert first.returncode == 75, first.stderr[-3000:]
    assert "run the same command again" in first.stdout and not out.exists()
    assert TRAINED.findall(first.stdout) == ["[pretrain] epoch 1/3 ", "[pretrain] epoch 2/3 "]

    second = run_as_on_gpu_box(SCRIPT, *command)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "[pretrain] resumed from checkpoint: epoch 2, batch 0" in second.stdout
    assert TRAINED.findall(second.stdout) == ["[pretrain] epoch 3/3 ", "[finetune] epoch 1/1 "]
    report = json.loads(out.read_text())
    assert checkpointed_epochs(tmp_path / "work" / report["stages"]["pretrain"]["run"]) == [2, 3]  # last one too
    assert 0.0 <= report["test_top1"] <= 1.0 and report["test_loss"] > 0
    assert f"test     : top-1 {report['test_top1']:.4f}" in second.stdout
    assert report["test_images"] == read_dataset_info(digits_dir)["counts"]["test"]
    assert (report["stages"]["pretrain"]["epoch"], report["stages"]["finetune"]["epoch"]) == (3, 1)
    pretrain = report["stages"]["pretrain"]  # every epoch's row, the first launch's two included
    assert [row["epoch"] for row in pretrain["history"]] == [1, 2, 3]
    assert [row["epoch"] for row in report["stages"]["finetune"]["history"]] == [1]
    last = pretrain["history"][-1]
    assert (last["val_top1"], last["wall_time_s"], last["images_seen"]) == \
        (pretrain["val_top1"], pretrain["wall_time_s"], pretrain["images_seen"])
    assert (tmp_path / "results" / "tta_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # beside --out
    assert all(s["wall_time_s"] > 0 for s in report["stages"].values())
    for stage, s in report["stages"].items():  # the loop's pace: medians over its epochs
        assert s["images_per_s"] > 0 and 0 < s["input_wait_share"] < 1
        assert f"{s['images_per_s']:.0f} img/s, input wait {s['input_wait_share']:.0%} (medians" in second.stdout
    top1, count = saved_test_top1(report["model_dir"], digits_dir)
    # float32 means: 1e-6 still tells one sample apart (>= 1e-4 here)
    assert count == report["test_images"] and top1 == pytest.approx(report["test_top1"], abs=1e-6)

    third = run_as_on_gpu_box(SCRIPT, *command)  # both runs finished: nothing to train
    assert third.returncode == 0, third.stderr[-3000:]
    assert TRAINED.findall(third.stdout) == []
    assert "[pretrain] run already finished, nothing to train: epoch 3, batch 0" in third.stdout
    assert "resumed" not in third.stdout
    again = json.loads(out.read_text())
    assert {k: v for k, v in again.items() if k != "command_wall_time_s"} == \
        {k: v for k, v in report.items() if k != "command_wall_time_s"}  # same wall times: no epoch re-run


@pytest.mark.slow
def test_bad_input_is_one_line_and_exit_2(digits_dir, tmp_path):
    recipe = tmp_path / "bad-recipe.yaml"
    recipe.write_text("pretrain:\n  augment: {auto_augment: autoaugment}\n")
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged/dataset.json").write_text("{")
    untested = tmp_path / "no-test"  # shards without a test split: the command had nothing to score, after training
    info = json.loads((digits_dir / "dataset.json").read_text())
    info["counts"]["test"] = 0
    untested.mkdir()
    (untested / "dataset.json").write_text(json.dumps(info))
    (tmp_path / "results").mkdir()
    work = ("--workdir", tmp_path / "work")
    cases = {  # argv -> what its one line names
        (f"{tmp_path / 'nope'}/dataset.json"): ("--shards", tmp_path / "nope", *work),
        "pretrain.nope": ("--shards", digits_dir, *work, "--set", "pretrain.nope=1"),
        "dataset.json: not valid JSON": ("--shards", tmp_path / "damaged", *work),
        f"{untested} holds no test split": ("--shards", untested, *work),
        # the report would be lost after the training
        f"--out {tmp_path / 'results'}: is a folder": ("--shards", digits_dir, *work, "--out", tmp_path / "results"),
        # trained on: no deadline was ever passed
        "--max-minutes nan: give the minutes this command may train": ("--shards", digits_dir, *work,
                                                                       "--max-minutes", "nan"),
        # the fine-tune's own checks, found after the pretrain had trained (--stages all, the default)
        "finetune.global_batch_size: 100000 is larger than the train split": (
            "--shards", digits_dir, *work, "--set", "finetune.global_batch_size=100000"),
        # silently overridden or ignored before: the command's own ray.storage_path (--workdir), fine-tune
        # shards for a pretrain alone
        f"--set ray.storage_path={tmp_path / 'elsewhere'}: this command sets ray.storage_path itself "
        f"(to {tmp_path / 'work'})": ("--shards", digits_dir, *work, "--set", f"ray.storage_path={tmp_path / 'elsewhere'}"),
        "--finetune-shards: --stages pretrain trains no fine-tune": ("--shards", digits_dir, *work, "--stages",
                                                                     "pretrain", "--finetune-shards", digits_dir),
        f"finetune.init: {tmp_path / 'nope.safetensors'} does not exist": (
            "--shards", digits_dir, *work, "--set", f"finetune.init={tmp_path / 'nope.safetensors'}"),
        "ray.use_gpu: true": ("--shards", digits_dir, *work, "--set", "ray.use_gpu=true"),  # this machine: no CUDA
        "pretrain.augment.auto_augment='autoaugment'; valid: ": ("--recipe", recipe, "--shards", digits_dir, *work),
        # a recipe that diverges: the local runner stops at the first non-finite step, the driver says so
        "diverged": ("--shards", digits_dir, *work, "--set", "pretrain.lr=10000", "--set", "pretrain.warmup_epochs=0",
                     "--set", "model.depth=1"),
    }
    procs = dict(zip(cases, run_cases_as_on_gpu_box(SCRIPT, *cases.values())))
    diverged = procs.pop("diverged")
    for names, proc in procs.items():
        assert proc.returncode == 2 and proc.stdout == "", (names, proc.stderr[-3000:])
        assert proc.stderr.startswith("error: ") and names in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    bad_value = procs["pretrain.augment.auto_augment='autoaugment'; valid: "]
    assert bad_value.stderr.startswith(f"error: {recipe}: ")  # the recipe named, not only params.yaml
    assert diverged.returncode == 2 and diverged.stderr.count("\n") == 1, diverged.stderr[-3000:]
    assert re.search(r"^error: pretrain run pretrain-\w+ diverged (before its first|after its last) checkpoint",
                     diverged.stderr)
    assert re.search(r"\[pretrain\] diverged: the training loss is \S+ at step \d+ \(epoch 1\)", diverged.stdout)


@pytest.mark.slow
def test_cifar_recipe_command_on_a_small_tarball(tmp_path):
    """The README's GPU command as written (``configs/cifar10-1gpu.yaml --cifar --stages pretrain``) on
    a CIFAR-shaped tarball of a few images, made CPU-sized with --set: the shards follow the recipe's
    data section, the pretrain alone trains (within the recipe's time budget, planned at the end of a
    warm-up shortened to 2 epochs, its step as the recipe's one CUDA graph runs eagerly on a CPU, with
    the recipe's MixUp / CutMix on half the batches) and the test split scores its kept weights."""
    import tarfile

    from tests.data_helpers import make_imagefolder

    make_imagefolder(tmp_path / "c10", classes=("cat", "dog", "eel"), per_class=30, splits=["train", "test"])
    tarball = tmp_path / "cifar.tar.gz"
    with tarfile.open(tarball, "w:gz") as tf:
        tf.add(tmp_path / "c10" / "train", "train")
        tf.add(tmp_path / "c10" / "test", "test")
    cpu_sized = [f"--set={k}" for k in (
        "ray.use_gpu=false", "ray.loader_workers=0", "model.preset=nano", "model.depth=1", "model.num_heads=4",
        "pretrain.epochs=3", "pretrain.warmup_epochs=2", "finetune.epochs=1", "pretrain.global_batch_size=16",
        "finetune.global_batch_size=16", "pretrain.compile=false", "finetune.compile=false")]
    out, shards = tmp_path / "tta.json", tmp_path / "work" / "cifar10-shards"
    proc = run_as_on_gpu_box(SCRIPT, "--recipe", "configs/cifar10-1gpu.yaml", "--cifar", "--stages", "pretrain",
                             "--cifar-tarball", tarball, "--workdir", tmp_path / "work", *cpu_sized, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = read_dataset_info(shards)
    assert info["classes"] == ["cat", "dog", "eel"] and info["counts"]["test"] == 90
    assert info["params"]["maxcount"] == 1000 and info["params"]["val_fraction"] == 0.02  # the recipe's data section
    report = json.loads(out.read_text())
    assert report["recipe"] == "configs/cifar10-1gpu.yaml" and report["test_images"] == 90
    assert list(report["stages"]) == ["pretrain"] and report["model_dir"].startswith(str(tmp_path / "work" / "pretrain-"))
    budget = recipe_overrides(str(ROOT / "configs" / "cifar10-1gpu.yaml"))["pretrain.time_budget_minutes"]
    assert re.search(rf"\[pretrain\] time budget {budget:g} min: .* -> 3 epochs \(at most 3\)", proc.stdout), proc.stdout
    assert TRAINED.findall(proc.stdout) == ["[pretrain] epoch 1/3 ", "[pretrain] epoch 2/3 ", "[pretrain] epoch 3/3 "]
    assert "cuda_graph: no GPU, the graph-safe step runs eagerly" in proc.stdout  # the recipe's cuda_graph: true
    assert report["test_tta"] == "hflip-shift"  # the recipe's evaluate.tta: 10 views' logits averaged
    assert f"(tta hflip-shift; the image alone {report['test_top1_single_view']:.4f})" in proc.stdout
    assert saved_test_top1(report["model_dir"], shards, "hflip-shift")[0] == pytest.approx(report["test_top1"],
                                                                                         abs=1e-6)
    assert saved_test_top1(report["model_dir"], shards)[0] == pytest.approx(report["test_top1_single_view"], abs=1e-6)

    # the README's feed-ratio command before it, on the same tarball: the same shards, its figures
    tp_shards = tmp_path / "tp-shards"
    bench = run_as_on_gpu_box("benchmarks/train_throughput.py", "--recipe", "configs/cifar10-1gpu.yaml",
                              "--cifar", "--cifar-tarball", tarball, "--shards", tp_shards, *cpu_sized,
                              "--steps", "1", "--rounds", "1", "--compare-eager")
    assert bench.returncode == 0, bench.stderr[-3000:]
    assert "feed ratio" in bench.stdout and "batch 16" in bench.stdout
    assert "compile False, the whole step as one CUDA graph, 0 loader workers" in bench.stdout  # the recipe's step
    twice = run_as_on_gpu_box("benchmarks/train_throughput.py", "--recipe", "configs/cifar10-1gpu.yaml", "--shards",
                              tp_shards, *cpu_sized, "--compare-graph")
    assert twice.returncode == 2 and "Traceback" not in twice.stderr
    assert twice.stderr.strip() == ("error: --compare-graph: pretrain.cuda_graph is already true in "
                                    "configs/cifar10-1gpu.yaml; compare against the plain step with --set "
                                    "pretrain.cuda_graph=false --set pretrain.compile_mode=reduce-overhead")
    assert read_dataset_info(tp_shards)["shards"] == info["shards"]  # sharded as the recipe says, both ways


def test_cifar_extraction_is_all_or_nothing(tmp_path):
    """The benchmarks' CIFAR-10 extraction: a tarball cut short leaves no folder behind (before, its
    half-extracted train/ was taken for the data set by the next run), a missing one is named, and a
    whole one is extracted once."""
    import tarfile

    from benchmarks.cifar import extract_cifar
    from tests.data_helpers import make_imagefolder

    make_imagefolder(tmp_path / "c10", classes=("cat", "dog"), per_class=20, splits=["train", "test"])
    tarball, cut = tmp_path / "cifar.tar", tmp_path / "cut.tar"
    with tarfile.open(tarball, "w") as tf:
        tf.add(tmp_path / "c10" / "train", "train")
        tf.add(tmp_path / "c10" / "test", "test")
    cut.write_bytes(tarball.read_bytes()[: tarball.stat().st_size // 3])  # inside train/
    dest = tmp_path / "data" / "cifar10"
    with pytest.raises(ValueError, match=f"^{cut}: not a whole CIFAR-10 tarball"):
        extract_cifar(dest, cut)
    assert not (tmp_path / "data").exists()  # neither dest nor the temp folder, nor the folder made for them
    with pytest.raises(FileNotFoundError, match=f"^{tmp_path / 'none.tgz'}: no such CIFAR-10 tarball"):
        extract_cifar(dest, tmp_path / "none.tgz")
    assert extract_cifar(dest, tarball) == dest
    assert sorted(p.name for p in dest.iterdir()) == ["test", "train"]

    def files(d):
        return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())

    assert files(dest) == files(tmp_path / "c10") and len(files(dest)) > 40
    tarball.unlink()
    assert extract_cifar(dest, tarball) == dest  # already there: the tarball is not needed again
    mine = tmp_path / "my-images"  # an ImageFolder without train/ (--data of a flat one) is not replaced
    (mine / "cat").mkdir(parents=True)
    (mine / "cat" / "1.jpg").write_bytes(b"mine")
    with pytest.raises(FileExistsError, match="not empty and holds no train/"):
        extract_cifar(mine, cut)
    assert (mine / "cat" / "1.jpg").read_bytes() == b"mine"


@pytest.mark.slow
def test_plain_loop_follows_the_recipe_and_refuses_what_it_lacks(tmp_path):
    """benchmarks/plain_loop.py: the recipe (RandAugment, erasing, MixUp / CutMix included) trained without the
    pipeline's loop (docs/gpu.md's check that the loop is not what limits accuracy), on a GPU box's packages; a
    recipe it cannot follow (EMA), or a folder without test/, is one line and exit 2."""
    from tests.data_helpers import make_imagefolder

    folder = make_imagefolder(tmp_path / "f", per_class=12, splits=["train", "test"])
    small = [f"--set={k}" for k in ("model.preset=nano", "model.depth=1", "model.num_heads=4", "pretrain.epochs=2",
                                    "pretrain.global_batch_size=8", "pretrain.augment.hflip=0.5",
                                    "pretrain.augment.auto_augment=randaugment", "pretrain.augment.random_erasing=0.5",
                                    "pretrain.mixup_alpha=0.8", "pretrain.cutmix_alpha=1.0")]
    proc = run_as_on_gpu_box("benchmarks/plain_loop.py", "--imagefolder", folder, "--workers", "0", *small)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.findall(r"^\[plain\] epoch (\d)/2 loss \d\.\d+ top1 [01]\.\d+ ", proc.stdout, re.M) == ["1", "2"]
    assert re.search(r"^\[plain\] test top-1 [01]\.\d{4} \(36 images\), [\d.]+ s training on cpu$", proc.stdout, re.M)
    assert re.search(r"^\[plain\] epoch 2/2 .* \| [\d.]+s, \d+ img/s$", proc.stdout, re.M)
    no_test = make_imagefolder(tmp_path / "no-test", per_class=2, splits=["train"])
    (tmp_path / "bare" / "train" / "cat").mkdir(parents=True)
    (tmp_path / "bare" / "test").mkdir()
    cases = {  # the one line each gives; the last three were tracebacks: a negative worker count, a batch
        # larger than the train split (no step an epoch: a ZeroDivisionError), a test/ without class folders
        "the plain loop has no pretrain.ema_decay=0.9998, pretrain.mix_prob=0.5, pretrain.time_budget_minutes=7.5, "
        "pretrain.keep='best'; set them off (--set) to compare": ("--imagefolder", folder, "--recipe",
                                                                  "configs/cifar10-1gpu.yaml"),
        f"{no_test / 'test'}: no such folder": ("--imagefolder", no_test, *small),
        "--workers -1: give 0": ("--imagefolder", folder, "--workers", "-1"),
        "pretrain.global_batch_size: 1000 is larger than the train split (36 images in ": (
            "--imagefolder", folder, "--workers", "0", *small, "--set=pretrain.global_batch_size=1000"),
        f"{tmp_path / 'bare' / 'train'}: Found no valid file": ("--imagefolder", tmp_path / "bare", "--workers", "0",
                                                                *small),
    }
    if not torch.cuda.is_available():  # a GPU asked for where there is none: one line, as bad input
        cases["error: --device cuda: no CUDA device here (--device cpu)"] = ("--imagefolder", folder, "--device",
                                                                             "cuda", *small)
    for line, bad in zip(cases, run_cases_as_on_gpu_box("benchmarks/plain_loop.py", *cases.values())):
        assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1, bad.stderr[-2000:]
        assert bad.stderr.startswith("error: ") and line in bad.stderr


# the schedules step here without training, which torch warns about
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
def test_plain_loop_schedule_is_the_stages():
    """The plain loop's AdamW groups and per-step LR, written out on their own, are the stages' (else
    comparing the two loops would compare two recipes)."""
    from benchmarks.plain_loop import optimiser
    from pipeline.config import TrainConfig, load_params
    from pipeline.model import build_model
    from pipeline.train.optim import build_optimizer

    cfg = TrainConfig(epochs=3, lr=1e-3, min_lr=1e-5, warmup_epochs=1.0, weight_decay=0.05)
    params = load_params(ROOT / "params.yaml", overrides={"model.depth": 1})
    model = build_model(params.model, image_size=16, num_classes=3)
    plain, plain_sched = optimiser(model, cfg, steps_per_epoch=7)
    ours, ours_sched = build_optimizer(model, lr=cfg.lr, weight_decay=cfg.weight_decay, min_lr=cfg.min_lr,
                                       warmup_steps=7, total_steps=21)
    decayed = {g["weight_decay"]: {id(p) for p in g["params"]} for g in plain.param_groups}
    assert decayed == {g["weight_decay"]: {id(p) for p in g["params"]} for g in ours.param_groups}
    for _ in range(21):
        assert plain.param_groups[0]["lr"] == pytest.approx(ours.param_groups[0]["lr"], rel=1e-12)
        plain_sched.step()
        ours_sched.step()


@pytest.mark.parametrize("choice", AUTO_AUGMENTS)
def test_plain_loop_auto_augments_as_the_pipeline(choice):
    """Every ``auto_augment`` choice the pipeline offers gives the plain loop the same torchvision
    transform as the pipeline's reference pipeline (a choice it missed would train without one)."""
    from benchmarks.plain_loop import transforms
    from pipeline.config import TrainConfig
    from pipeline.data.transforms import train_transform

    aug = {"auto_augment": choice}
    plain, _ = transforms(TrainConfig(image_size=16), aug)

    def auto(compose) -> list[tuple]:
        return [(type(t), getattr(t, "policy", None)) for t in compose.transforms
                if "Augment" in type(t).__name__]
    assert auto(plain) == auto(train_transform(16, aug)) and bool(auto(plain)) == bool(choice)

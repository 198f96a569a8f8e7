"""params.yaml → typed config: defaults load, and bad values stop with a message naming key and value."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import ConfigError, Params, flatten, load_params
from pipeline.train.driver import worker_batch
from pipeline.train.optim import warmup_cosine

ROOT = Path(__file__).resolve().parents[1]


def test_repo_params_load():
    p = load_params(ROOT / "params.yaml")
    assert p.finetune.image_size > p.pretrain.image_size
    assert p.finetune.interpolation.mode == "bicubic"
    flat = flatten(p)
    assert flat["model.preset"] == p.model.preset and "finetune.interpolation.antialias" in flat


@pytest.mark.parametrize("stage", ["pretrain", "finetune", "evaluate"])
def test_stages_that_compute_on_the_runner_rerun_when_it_changes(stage):
    """DVC re-runs a stage whose numbers the runner can change (CPU or GPU, one rank or several, Ray or
    in-process): its ``params`` list the ray keys that decide where and how it computes."""
    listed = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][stage]["params"]
    assert {"ray.backend", "ray.num_workers", "ray.use_gpu"} <= set(listed)


def test_params_yaml_and_code_defaults_agree():
    """Each default is defined once: a key left out of a params file means what params.yaml says.

    The dataclass defaults in pipeline/config.py must equal every value of the repository's
    params.yaml (keys it does not list keep their dataclass default); change both or neither.
    """
    shipped, code = flatten(load_params(ROOT / "params.yaml")), flatten(Params())
    assert shipped.keys() == code.keys()
    drift = {k: {"params.yaml": shipped[k], "pipeline/config.py": code[k]} for k in shipped if shipped[k] != code[k]}
    assert not drift, f"params.yaml and the dataclass defaults disagree: {drift}"
    listed = flatten(yaml.safe_load((ROOT / "params.yaml").read_text()))
    assert listed.keys() <= shipped.keys() and len(listed) > 50  # the check above covered the file's keys


@pytest.mark.parametrize("override, needles", [
    ({"model.num_heads": 5}, ["model.num_heads", "5", "valid head counts", "4"]),
    ({"pretrain.image_size": 18}, ["pretrain.image_size", "18", "model.patch_size=4", "16 or 20"]),
    ({"finetune.image_size": 30}, ["finetune.image_size", "30", "28 or 32"]),
    ({"finetune.patch_size": 5}, ["finetune.image_size", "finetune.patch_size=5"]),
    ({"pretrain.lrr": 0.1}, ["pretrain.lrr", "unknown key", "lr"]),
    ({"pretrain.epochs": "ten"}, ["pretrain.epochs", "'ten'", "int"]),
    ({"ray.use_gpu": "yes"}, ["ray.use_gpu", "bool"]),
    ({"model.preset": "gigantic"}, ["model.preset", "gigantic", "tiny", "base"]),
    ({"model.pool": "max"}, ["model.pool", "'max'", "cls, mean"]),
    ({"pretrain.mix_prob": 0.0}, ["pretrain.mix_prob", "0.0", "(0, 1]"]),
    ({"model.weight_init": "xavier"}, ["model.weight_init", "'xavier'", "timm, mimetic"]),
    ({"model.drop_path_rate": 1.0}, ["model.drop_path_rate", "[0, 1)", "1.0"]),
    ({"model.mlp_ratio": -2.0}, ["model.mlp_ratio", "positive", "-2.0"]),
    ({"finetune.interpolation.mode": "lanczos"}, ["finetune.interpolation.mode", "lanczos", "bicubic"]),
    ({"data.pretrain.source": "mnist"}, ["data.pretrain.source", "mnist", "imagefolder"]),
    ({"data.finetune.source": "imagefolder"}, ["data.finetune.root", "required"]),
    ({"data.finetune.root": "/data/x"}, ["data.finetune.root", "'/data/x'", "ignored", "'digits'", "imagefolder"]),
    ({"data.pretrain.encoding": "npy"}, ["data.pretrain.encoding", "'npy'", "source, raw"]),
    ({"finetune.compile_mode": "fast"}, ["finetune.compile_mode", "'fast'", "reduce-overhead"]),
    ({"pretrain.cuda_graph": True, "pretrain.amp": "fp16"}, ["pretrain.cuda_graph", "amp: fp16", "host"]),
    ({"finetune.cuda_graph": True}, ["finetune.cuda_graph", "2 ranks", "ray.backend: local"]),
    ({"pretrain.cuda_graph": True, "ray.backend": "local", "pretrain.compile": True,
      "pretrain.compile_mode": "reduce-overhead"}, ["pretrain.cuda_graph", "compile_mode: reduce-overhead", "default"]),
    ({"pretrain.global_batch_size": 63}, ["pretrain.global_batch_size", "63", "ray.num_workers=2"]),
    ({"evaluate.resolutions": [32, 33]}, ["evaluate.resolutions[1]", "33"]),
    ({"evaluate.tta": "flip"}, ["evaluate.tta", "'flip'", "none, hflip"]),
    ({"export.formats": ["onnx", "tflite"]}, ["export.formats[1]", "tflite", "torchscript"]),
    ({"finetune.augment": {"mean": [0.5, 0.5]}}, ["finetune.augment.mean", "[0.5, 0.5]", "3 numbers", "'dataset'"]),
    ({"pretrain.augment": {"mean": "datset"}}, ["pretrain.augment.mean", "'datset'", "'dataset'"]),
    ({"pretrain.augment": {"hlfip": 0.5}}, ["pretrain.augment", "hlfip", "hflip"]),
    ({"finetune.augment": {"auto_augment": "autoaugment"}}, ["finetune.augment.auto_augment", "randaugment"]),
    ({"ray.num_workers": 0}, ["ray.num_workers", "0", "> 0"]),
    ({"pretrain.time_budget_minutes": 0}, ["pretrain.time_budget_minutes", "0", "> 0"]),
    ({"finetune.time_budget_minutes": 8}, ["finetune.time_budget_minutes", "finetune.warmup_epochs >= 2", "got 1"]),
    ({"pretrain.time_budget_minutes": 8, "pretrain.epochs": 2}, ["pretrain.time_budget_minutes", "warmup_epochs=2",
                                                                  "pretrain.epochs=2 never passes"]),
    ({"finetune.checkpoint_every_epochs": 0}, ["finetune.checkpoint_every_epochs", "0", "> 0"]),
    ({"ray.checkpoints_to_keep": 0}, ["ray.checkpoints_to_keep", "0", "> 0"]),
    ({"ray.max_failures": -1}, ["ray.max_failures", "-1", ">= 0"]),
    ({"export.num_images": 0}, ["export.num_images", "0", "> 0"]),
    # optimiser values that train backwards (a negative clip flips every gradient)
    ({"pretrain.grad_clip": -1}, ["pretrain.grad_clip", "-1.0", "> 0 or null"]),
    ({"finetune.grad_clip": 0}, ["finetune.grad_clip", "0.0", "> 0 or null"]),
    ({"pretrain.min_lr": -1}, ["pretrain.min_lr", "-1.0", ">= 0"]),
    # a seed the generators refuse only at shard time or at the first step, in their own words
    ({"data.finetune.seed": -1}, ["data.finetune.seed: -1 must be in [0, 2**32 - 1)"]),
    ({"data.pretrain.seed": 2**32 - 1}, ["data.pretrain.seed: 4294967295 must be in [0, 2**32 - 1)"]),
    ({"pretrain.seed": 2**53}, ["pretrain.seed", "must be in [0, 2**53)"]),
    ({"data.pretrain.num_classes": 1}, ["data.pretrain.num_classes: 1 must be >= 2"]),
    ({"evaluate.resolutions": []}, ["evaluate.resolutions: [] sweeps nothing", "[32]"]),
    # '' read as the current folder
    ({"finetune.init": ""}, ["finetune.init: '' names nothing", "null (the pretrain stage's model)"]),
    ({"ray.address": " "}, ["ray.address: ' ' names nothing"]),
    ({"ray.storage_path": ""}, ["ray.storage_path: '' names nothing"]),
    ({"ray.storage_path": "s3:/bucket/runs"}, ["ray.storage_path: 's3:/bucket/runs': a URL needs two slashes",
                                               "s3://bucket/runs?"]),
    ({"ray.backend": "local", "ray.storage_path": "s3://bucket/runs"},
     ["ray.storage_path: 's3://bucket/runs' with ray.backend: local", "object storage needs backend: ray"]),
    ({"export.max_abs_diff": -1}, ["export.max_abs_diff", "-1", ">= 0"]),
    ({"export.min_top1_agreement": 1.5}, ["export.min_top1_agreement: 1.5 must be in [0, 1]"]),
    ({"finetune.lr": 5e-6}, ["finetune.min_lr: 1e-05 is above finetune.lr (5e-06)", "at most finetune.lr"]),
    ({"finetune.weight_decay": -1}, ["finetune.weight_decay", "-1.0", ">= 0"]),
    ({"pretrain.warmup_epochs": -1}, ["pretrain.warmup_epochs", "-1.0", ">= 0"]),
    # nan / inf pass every range check, so they are refused where a float is read
    ({"pretrain.lr": float("nan")}, ["pretrain.lr", "nan", "not a finite number"]),
    ({"finetune.lr": float("inf")}, ["finetune.lr", "inf", "not a finite number"]),
    ({"pretrain.mixup_alpha": float("nan")}, ["pretrain.mixup_alpha", "nan", "not a finite number"]),
    ({"pretrain.time_budget_minutes": float("nan")}, ["pretrain.time_budget_minutes", "nan", "not a finite number"]),
    ({"ray.resource_wait_s": float("nan")}, ["ray.resource_wait_s", "nan", "not a finite number"]),
    ({"export.max_abs_diff": float("nan")}, ["export.max_abs_diff", "nan", "not a finite number"]),
    ({"export.opset": 26}, ["export.opset", "26", "17 to 25"]),
    ({"export.opset": 16}, ["export.opset", "16", "17 to 25"]),
    ({"export.formats": []}, ["export.formats", "[]", "one or more of: safetensors, torchscript, onnx"]),
    ({"export.registered_model_name": ""}, ["export.registered_model_name", "''", "non-empty"]),
    ({"export.registered_model_name": "team/vit"}, ["export.registered_model_name", "'team/vit'", "'/' or ':'"]),
    ({"export.registered_model_name": "vit:1"}, ["export.registered_model_name", "'vit:1'", "'/' or ':'"]),
    ({"export.registered_model_name": "vit@1"}, ["export.registered_model_name", "'vit@1'", "or '@'"]),
    ({"mlflow.experiment": " "}, ["mlflow.experiment", "' '", "non-empty"]),
    # sizes: positive, under their own key, before the divisibility check (0 divides by any patch)
    ({"pretrain.image_size": 0}, ["pretrain.image_size: 0 must be > 0"]),
    ({"finetune.image_size": 0}, ["finetune.image_size: 0 must be > 0"]),
    ({"finetune.image_size": -32}, ["finetune.image_size: -32 must be > 0"]),
    ({"evaluate.resolutions": [32, 0]}, ["evaluate.resolutions[1]: 0 must be > 0"]),
    ({"evaluate.resolutions": [-32]}, ["evaluate.resolutions[0]: -32 must be > 0"]),
    ({"finetune.patch_size": 0}, ["finetune.patch_size: 0 must be > 0"]),  # not null: null keeps model.patch_size
    ({"finetune.patch_size": -4}, ["finetune.patch_size: -4 must be > 0"]),
    # the shard stage's checks, named as params keys before any stage runs
    ({"data.finetune.val_fraction": 0.6, "data.finetune.test_fraction": 0.5},
     ["data.finetune.val_fraction + test_fraction", "1.1", "< 1"]),
    ({"data.pretrain.test_fraction": 1.0}, ["data.pretrain.test_fraction: 1.0", "[0, 1)"]),
    ({"data.pretrain.max_side": 0}, ["data.pretrain.max_side: 0 must be > 0 or null"]),
    ({"data.pretrain.shard_tasks": -1}, ["data.pretrain.shard_tasks: -1 must be >= 0", "or null"]),
    ({"data.finetune.class_names": list("0123456789")[:9] + ["8"]},
     ["data.finetune.class_names names ['8'] more than once"]),
    # augment values of the wrong type: the key and its valid form, not a TypeError from a comparison
    ({"pretrain.augment": {"random_resized_crop": 0.5}}, ["pretrain.augment.random_resized_crop", "0.5",
                                                         "[min_scale, max_scale]"]),
    ({"pretrain.augment": {"random_resized_crop": ["a", "b"]}}, ["pretrain.augment.random_resized_crop",
                                                                "['a', 'b']", "[min_scale, max_scale]"]),
    ({"finetune.augment": {"hflip": [0.5]}}, ["finetune.augment.hflip", "[0.5]", "a number in [0, 1]"]),
    ({"finetune.augment": {"random_erasing": "0.25"}}, ["finetune.augment.random_erasing", "'0.25'", "a number"]),
    ({"pretrain.augment": {"std": ["a", "b", "c"]}}, ["pretrain.augment.std", "['a', 'b', 'c']", "3 numbers"]),
    ({"pretrain.augment": {"mean": ["a", "b", "c"]}}, ["pretrain.augment.mean", "['a', 'b', 'c']", "3 numbers"]),
    ({"pretrain.augment": {"mean": [0.5, float("nan"), 0.5]}}, ["pretrain.augment.mean", "nan", "3 numbers"]),
    ({"pretrain.augment": {"interpolation": ["bicubic"]}}, ["pretrain.augment.interpolation", "bilinear"]),
])
def test_bad_values_name_key_value_and_valid(override, needles):
    with pytest.raises(ConfigError) as err:
        load_params(ROOT / "params.yaml", overrides=override)
    for n in needles:
        assert n in str(err.value), (n, str(err.value))


def test_local_backend_is_one_rank_whatever_num_workers_says():
    """``ray.backend: local`` trains one rank: a global batch ``ray.num_workers`` does not divide is fine
    (it was refused), and the capacity check asks it for a CUDA device, not for CPUs per worker."""
    from pipeline.cluster import check_local_capacity

    p = load_params(ROOT / "params.yaml", overrides={"ray.backend": "local", "ray.num_workers": 3})
    assert p.ray.world_size == 1 and p.pretrain.global_batch_size % 3
    check_local_capacity(p.ray)
    with pytest.raises(ConfigError, match="pretrain.global_batch_size: 64 is not divisible by ray.num_workers=3"):
        load_params(ROOT / "params.yaml", overrides={"ray.num_workers": 3})


def test_test_servers_ports_are_free_and_outside_the_ports_others_are_handed():
    """The tests' servers' ports are free, and neither one the kernel gives outgoing connections (Ray took
    one such port before a dashboard bound it, in CI) nor one of `ray start`'s worker ports."""
    import socket

    from tests.conftest import RAY_CLI_WORKER_PORTS, ephemeral_ports, free_port

    low, high = ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20  # none handed out twice
    for port in ports:
        assert not low <= port <= high and not RAY_CLI_WORKER_PORTS[0] <= port <= RAY_CLI_WORKER_PORTS[1], port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_augment_dataset_stats_accepted():
    p = load_params(ROOT / "params.yaml", overrides={"finetune.augment": {"mean": "dataset", "std": "dataset"}})
    assert p.finetune.augment == {"mean": "dataset", "std": "dataset"}


def test_float_accepts_int_and_yaml_exponent(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["pretrain"]["lr"] = "1e-3"  # YAML 1.1 reads this as a string
    raw["pretrain"]["weight_decay"] = 0
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    p = load_params(tmp_path / "params.yaml")
    assert p.pretrain.lr == pytest.approx(1e-3) and isinstance(p.pretrain.weight_decay, float)


def test_nan_and_inf_from_yaml_are_refused(tmp_path):
    """YAML's .nan / .inf (and "nan" as a string) are floats no range check catches: nan <= 0 is False."""
    for section, key, text in [("pretrain", "lr", ".nan"), ("export", "max_abs_diff", ".inf"),
                               ("finetune", "lr", '"nan"')]:
        (tmp_path / "params.yaml").write_text(_with_value((ROOT / "params.yaml").read_text(), section, key, text))
        with pytest.raises(ConfigError, match=rf"{section}\.{key}: .* is not a finite number"):
            load_params(tmp_path / "params.yaml")


def _with_value(text: str, section: str, key: str, value: str) -> str:
    """params.yaml's text with ``section.key`` set to the YAML ``value`` (written as-is)."""
    head, _, rest = text.partition(f"\n{section}:\n")
    lines = rest.split("\n")
    i = next(n for n, line in enumerate(lines) if line.startswith(f"  {key}:"))
    lines[i] = f"  {key}: {value}"
    return f"{head}\n{section}:\n" + "\n".join(lines)


def test_finetune_patch_size_null_keeps_the_model_patch_size():
    p = load_params(ROOT / "params.yaml", overrides={"model.patch_size": 8, "finetune.patch_size": None})
    assert p.finetune_patch_size == 8
    p = load_params(ROOT / "params.yaml", overrides={"finetune.patch_size": 8})
    assert p.finetune_patch_size == 8 and p.model.patch_size == 4


@pytest.mark.parametrize("override, message", [
    ({"model.depth": 6, "model.depth.x": 5},
     "model.depth.x: model.depth is a value, not a section: set model.depth itself"),
    ({"evaluate.resolutions.0": 32}, "evaluate.resolutions.0: evaluate.resolutions is a value, not a section"),
    ({"pretrain.lr.max": 1}, "pretrain.lr.max: pretrain.lr is a value, not a section"),
])
def test_override_below_a_value_names_the_key(override, message):
    """A dotted override (recipe --set) that goes below a value: a ConfigError, not a TypeError."""
    with pytest.raises(ConfigError) as err:
        load_params(ROOT / "params.yaml", overrides=override)
    assert message in str(err.value)


@pytest.mark.parametrize("name, content, needle", [
    ("latin1.yaml", b"model:\n  preset: nano  # \xe9t\xe9\n", "latin1.yaml: not UTF-8 text (byte 0xe9 at offset 25)"),
    ("dir", None, "dir: cannot read it (Is a directory)"),
    ("dup.yaml", b"model:\n  preset: nano\npretrain:\n  lr: 0.1\n  epochs: 2\n  lr: 0.2\n",
     "dup.yaml: pretrain.lr is set twice (lines 4 and 6); YAML would keep only the last"),
    ("dup-section.yaml", b"model:\n  preset: nano\nmodel:\n  depth: 2\n",
     "dup-section.yaml: model is set twice (lines 1 and 3)"),
], ids=["not-utf8", "directory", "duplicate-key", "duplicate-section"])
def test_unreadable_params_file_is_a_config_error_naming_it(tmp_path, name, content, needle):
    """docs/troubleshooting.md: a params file that cannot be read as one YAML mapping is exit 2 naming
    the file (before: `error: UnicodeDecodeError`, an IsADirectoryError with exit 1, or a silent last-wins)."""
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert str(err.value).startswith(str(path)) and needle in str(err.value), str(err.value)


@pytest.mark.slow
def test_stage_with_unreadable_params_exits_2(tmp_path):
    """What a stage prints for one of the above ($VIT_PARAMS naming a directory was exit 1)."""
    proc = subprocess.run([sys.executable, "-m", "stages.shard", "pretrain"], cwd=tmp_path, capture_output=True,
                          text=True, env={"VIT_PARAMS": str(tmp_path), "PYTHONPATH": str(ROOT),
                                          "PATH": "/usr/bin:/bin"}, timeout=120)
    assert (proc.returncode, proc.stderr) == (2, f"error: $VIT_PARAMS: {tmp_path}: cannot read it (Is a directory)\n")


@pytest.mark.slow
def test_stage_exits_nonzero_with_message_before_any_work(tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["model"]["num_heads"] = 3
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "stages.pretrain"], cwd=ROOT, capture_output=True, text=True,
                          env={"VIT_PARAMS": str(tmp_path / "params.yaml"), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.returncode == 2
    assert "model.num_heads: 3 does not divide model.embed_dim=64" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("stage, line", [
    ("pretrain", "error: data/shards/pretrain/dataset.json not found: data/shards/pretrain holds no shard stage's "
                 "output; run the shard stage first (dvc repro, or python -m stages.shard pretrain)\n"),
    ("export", "error: models/finetune/config.json: not found; write it again (a stage's output: dvc repro "
               "re-runs the stage that wrote it)\n"),
])
def test_stage_before_its_input_says_what_to_run(tmp_path, stage, line):
    """docs/troubleshooting.md: a stage run in a checkout where the stage before it never ran."""
    proc = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=tmp_path, capture_output=True, text=True,
                          env={"VIT_PARAMS": str(ROOT / "params.yaml"), "PYTHONPATH": str(ROOT),
                               "PATH": "/usr/bin:/bin"}, timeout=120)
    assert (proc.returncode, proc.stderr) == (1, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".stage-locks"]  # nothing else written


@pytest.mark.parametrize("text", ["", "# all commented out\n# pretrain:\n#   lr: 0.1\n"])
def test_empty_params_file_is_an_error(tmp_path, text):
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"params.yaml: is empty \(or only comments\); expected the sections data, "):
        load_params(tmp_path / "params.yaml")


@pytest.mark.slow
def test_stage_with_empty_params_exits_2(tmp_path):
    (tmp_path / "params.yaml").write_text("\n")
    proc = subprocess.run([sys.executable, "-m", "stages.shard", "pretrain"], cwd=tmp_path, capture_output=True,
                          text=True, env={"VIT_PARAMS": str(tmp_path / "params.yaml"), "PYTHONPATH": str(ROOT),
                                          "PATH": "/usr/bin:/bin", "MLFLOW_LOGGING_LEVEL": "debug"}, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: $VIT_PARAMS: {tmp_path / 'params.yaml'}: is empty")
    assert "Traceback" not in proc.stderr and not (tmp_path / "data").exists()


def test_worker_batch_and_schedule():
    assert worker_batch(64, 2) == 32 and worker_batch(64, 1) == 64
    with pytest.raises(ValueError):
        worker_batch(63, 2)
    lrs = [warmup_cosine(s, warmup_steps=10, total_steps=100, base_lr=1e-3, min_lr=1e-5) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine decays monotonically
    assert lrs[-1] == pytest.approx(1e-2, abs=2e-3)  # ends near min_lr / base_lr


@pytest.mark.slow
@pytest.mark.parametrize("recipe, patch_size, image_size", [("configs/cifar10.yaml", 4, 32),
                                                             ("configs/imagenet-vit-s16.yaml", 16, 224)])
def test_recipe_expands_to_valid_overrides(tmp_path, recipe, patch_size, image_size):
    import shlex

    from pipeline.recipes import main, recipe_overrides

    flat = recipe_overrides(str(ROOT / recipe), ["data.pretrain.root=/x y/cifar"])
    assert flat["data.pretrain.root"] == "/x y/cifar" and flat["model.patch_size"] == patch_size
    assert flat["pretrain.augment"]["auto_augment"] == "randaugment"  # a dict param stays whole
    p = load_params(ROOT / "params.yaml", overrides=flat)
    assert p.pretrain.mixup_alpha > 0 and p.model.drop_path_rate == 0.1 and p.ray.use_gpu
    assert p.pretrain.image_size == image_size and p.model.preset == "small"
    proc = subprocess.run([sys.executable, "-m", "pipeline.recipes", str(ROOT / recipe),
                           "--set", "data.pretrain.root=/x y/cifar"], cwd=ROOT, capture_output=True, text=True)
    args = shlex.split(proc.stdout)  # what xargs hands to `dvc exp run`
    assert proc.returncode == 0 and args[0] == "-S" and "data.pretrain.root='/x y/cifar'" in args
    assert main([str(ROOT / recipe), "--set", "model.num_heads=5"]) == 2


@pytest.mark.slow
def test_recipe_overrides_are_what_dvc_exp_run_applies(tmp_path):
    """The printed `-S` arguments through DVC's own override code (what `dvc exp run -S` / `--queue`
    does to params.yaml): keys params.yaml leaves out are added, augment dicts replaced whole."""
    import shlex

    from dvc.utils.hydra import apply_overrides

    from pipeline.recipes import recipe_overrides

    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    # strings JSON would escape (é as \u00e9, a backslash doubled), a quote, a backslash before it and at the end
    sets = ["data.pretrain.root=/x y/café", "data.finetune.root=C:\\data\\it's\\'q\\",
            "data.finetune.class_names=[gato, cão, 'say \"hi\"']"]
    proc = subprocess.run([sys.executable, "-m", "pipeline.recipes", str(ROOT / "configs/cifar10.yaml"),
                           *(a for s in sets for a in ("--set", s))], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    args = shlex.split(proc.stdout)
    assert args[::2] == ["-S"] * (len(args) // 2) and "++model.num_heads=12" in args
    apply_overrides(tmp_path / "params.yaml", args[1::2])
    p = load_params(tmp_path / "params.yaml")
    expected = recipe_overrides(str(ROOT / "configs/cifar10.yaml"), sets)
    assert expected["data.finetune.root"] == "C:\\data\\it's\\'q\\" and p.data.pretrain.root == "/x y/café"
    assert p.data.finetune.class_names == ["gato", "cão", 'say "hi"'] and p.data.finetune.root == expected["data.finetune.root"]
    raw = yaml.safe_load((tmp_path / "params.yaml").read_text())
    for key, value in expected.items():
        node = raw
        for part in key.split("."):
            node = node[part]
        assert node == value or float(node) == value, (key, node, value)  # DVC writes 1e-05 (a str to PyYAML)
    assert p.pretrain.augment == expected["pretrain.augment"] and p.model.num_heads == 12


@pytest.mark.parametrize("recipe, sets, needle", [
    ("nope.yaml", [], "nope.yaml: cannot read it (No such file or directory)"),
    (".", [], ": cannot read it (Is a directory)"),
    ("list.yaml", [], "list.yaml: expected a partial params.yaml, a mapping of sections"),
    ("bad.yaml", [], "bad.yaml: not valid YAML (expected the node content, but found '<stream end>' at line 3"),
    (None, ["model.depth"], "--set model.depth: expected KEY=VALUE"),
    (None, ["model.depth=[6"], "--set model.depth=[6: the value is not valid YAML (expected ',' or ']'"),
    ("dup.yaml", [], "dup.yaml: model.depth is set twice (lines 2 and 3)"),
    (None, ["model.depth.x=5"], "error: --set model.depth.x=5: model.depth.x: model.depth is a value, not a section"),
    (None, ["evaluate.resolutions.0=32"],
     "--set evaluate.resolutions.0=32: evaluate.resolutions.0: evaluate.resolutions is a value, not a section"),
    (None, ["pretrain.epochs=abc"], "error: --set pretrain.epochs=abc: pretrain.epochs: expected int, got 'abc'"),
    ("unknown.yaml", [], "error: unknown.yaml: pretrain.lrr: unknown key (valid keys in pretrain: image_size,"),
], ids=["missing", "directory", "not-a-mapping", "bad-yaml", "set-without-value", "set-bad-yaml", "duplicate-key",
        "set-below-a-value", "set-into-a-list", "set-bad-value", "recipe-unknown-key"])
def test_recipe_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, recipe, sets, needle):
    """`vit-pipeline recipe` with a recipe it cannot read or a malformed --set: one line naming it, exit 2
    (before: a traceback, or a --set without '=' quietly became an override of a whole section)."""
    from pipeline.recipes import main

    (tmp_path / "list.yaml").write_text("model: [1, 2]\n")
    (tmp_path / "bad.yaml").write_text("model:\n  depth: [\n")
    (tmp_path / "dup.yaml").write_text("model:\n  depth: 6\n  depth: 8\n")
    (tmp_path / "unknown.yaml").write_text("pretrain:\n  lrr: 0.1\n")
    monkeypatch.chdir(tmp_path)
    argv = [recipe or str(ROOT / "configs/cifar10.yaml"), "--params", str(ROOT / "params.yaml")]
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert str(ROOT / "params.yaml") not in err, "the recipe or the --set is where the value came from"


def test_params_with_bad_yaml_is_one_line(tmp_path):
    (tmp_path / "params.yaml").write_text("model:\n  preset: nano\n depth: 2\n")
    with pytest.raises(ConfigError) as err:
        load_params(tmp_path / "params.yaml")
    message = str(err.value)  # PyYAML's own message spans three lines
    assert message.startswith(f"{tmp_path / 'params.yaml'}: not valid YAML (expected <block end>")
    assert message.endswith("at line 3, column 2)") and "\n" not in message


def test_imagenet_recipe_is_deit_s_schedule():
    """configs/imagenet-vit-s16.yaml: DeiT-S/16's published schedule (lr 5e-4 per 512 images, 5 warm-up
    epochs of 300, weight decay 0.05) at 224 px with 196 tokens, valid over params.yaml."""
    from pipeline.recipes import recipe_overrides
    p = load_params(ROOT / "params.yaml", overrides=recipe_overrides(str(ROOT / "configs/imagenet-vit-s16.yaml")))
    t = p.pretrain
    assert t.lr == pytest.approx(5e-4 * t.global_batch_size / 512) and (t.epochs, t.warmup_epochs) == (300, 5)
    assert (t.weight_decay, t.label_smoothing, t.mixup_alpha, t.cutmix_alpha) == (0.05, 0.1, 0.8, 1.0)
    assert (t.image_size // p.model.patch_size) ** 2 == 196 and p.data.pretrain.source == "imagefolder"


def test_one_gpu_recipe_is_valid_and_runs_in_process():
    from pipeline.recipes import recipe_overrides
    p = load_params(ROOT / "params.yaml", overrides=recipe_overrides(str(ROOT / "configs/cifar10-1gpu.yaml")))
    assert p.ray.backend == "local" and p.ray.use_gpu and p.ray.loader_workers == 15
    assert p.pretrain.keep == "best" and p.pretrain.ema_decay and p.pretrain.ema_warmup and p.pretrain.compile
    # what the measured runs ran with (docs/results.md): MixUp or CutMix on half the batches
    assert (p.pretrain.mixup_alpha, p.pretrain.cutmix_alpha, p.pretrain.mix_prob, p.pretrain.warmup_epochs) == (
        1.0, 1.0, 0.5, 30)


def test_params_file_named_by_vit_params_names_the_variable(tmp_path, monkeypatch):
    """A file ``$VIT_PARAMS`` names that is missing or wrong: the line says the variable chose it, and an
    absolute path, or any file but params.yaml, gets no "run from the repository root" hint (which cannot help it)."""
    from pipeline.config import PARAMS_ENV, load_stage_params

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^nope.yaml: file not found$"):  # a file named: no hint
        load_params("nope.yaml")
    with pytest.raises(ConfigError, match=r"^params.yaml: file not found \(run from the repository root\)$"):
        load_stage_params()
    monkeypatch.setenv(PARAMS_ENV, str(tmp_path / "cluster.yaml"))
    with pytest.raises(ConfigError, match=rf"^\$VIT_PARAMS: {tmp_path / 'cluster.yaml'}: file not found$"):
        load_stage_params()
    (tmp_path / "cluster.yaml").write_text("model:\n  depth: x\n")
    with pytest.raises(ConfigError, match=rf"^\$VIT_PARAMS: {tmp_path / 'cluster.yaml'}: model.depth: expected"):
        load_stage_params()


def _alias_bomb(levels: int) -> str:
    """A "billion laughs" list under data.finetune.class_names: 10**levels strings once its aliases expand,
    a few hundred bytes of YAML."""
    rows = ['      - &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    rows += [f"      - &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "data:\n  finetune:\n    class_names:\n" + "\n".join(rows) + "\n"


BOMB_CHILD = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a regression fails here, not on the machine
from pipeline.config import ConfigError, load_params
start = time.monotonic()
try:
    load_params(sys.argv[1])
except ConfigError as exc:
    peak = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]  # kB; ru_maxrss
    print(repr(str(exc)), time.monotonic() - start, peak)  # would be the parent's, kept across exec
"""


@pytest.mark.parametrize("levels", [5, 9])
def test_alias_bomb_is_refused_quickly_in_bounded_memory(tmp_path, levels):
    """Aliases that expand a few hundred bytes to 10**9 values: refused before anything walks or prints the
    value, in a line naming the file (a message echoed the whole value, gigabytes of it)."""
    path = tmp_path / "params.yaml"
    path.write_text(_alias_bomb(levels))
    child = subprocess.run([sys.executable, "-c", BOMB_CHILD, str(path)], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
    assert child.returncode == 0 and child.stdout, child.stderr[-2000:]
    message, seconds, peak_kb = child.stdout.rsplit(" ", 2)
    message = eval(message)
    assert message == (f"{path}: its aliases (*name) expand it by more than 100,000 values; write the values "
                       f"out, or repeat fewer aliases")
    assert float(seconds) < 5 and int(peak_kb) < 200 * 1024


def test_aliases_and_merge_keys_within_the_limit_still_load(tmp_path):
    """What anchors are for in a params file: one section's settings reused by another."""
    path = tmp_path / "params.yaml"
    path.write_text("pretrain: &train\n  epochs: 3\n  lr: 0.002\nfinetune:\n  <<: *train\n  lr: 0.001\n"
                    "evaluate:\n  resolutions: &sizes [32, 64]\nmodel:\n  preset: nano\n")
    p = load_params(path)
    assert (p.finetune.epochs, p.finetune.lr, p.pretrain.lr) == (3, 0.001, 0.002)


@pytest.mark.parametrize("text, needle", [
    ("model:\n  preset: " + "x" * 100_000 + "\n", "model.preset: 'xxxx"),
    ("data:\n  finetune:\n    class_names: [" + ", ".join(["[a]"] * 2000) + "]\n",
     "data.finetune.class_names: expected list[str] or null, got [['a'], ['a'], "),
    ("model:\n  preset: " + "[" * 600 + "]" * 600 + "\n", "nested too deeply"),
], ids=["long-string", "long-list", "deep"])
def test_a_long_value_is_echoed_cut_short(tmp_path, text, needle):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_params(path)
    assert needle in str(err.value) and len(str(err.value)) < 300, str(err.value)[:1000]


def test_recipe_set_with_an_alias_bomb_is_one_line(capsys):
    from pipeline.recipes import main

    bomb = "[" + ", ".join(f"&l{i} [{', '.join([f'*l{i - 1}' if i else 'x'] * 10)}]" for i in range(6)) + "]"
    argv = [str(ROOT / "configs/cifar10.yaml"), "--params", str(ROOT / "params.yaml")]
    assert main(argv + ["--set", f"data.finetune.class_names={bomb}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set data.finetune.class_names: its aliases (*name) expand it") and len(err) < 300

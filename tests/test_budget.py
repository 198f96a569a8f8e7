"""A time budget's plan: its arithmetic, and the schedule it gives (the real runs: tests/test_training.py)."""
import pytest
import torch

from pipeline.train.budget import plan_epoch, planned_epochs
from pipeline.train.optim import build_optimizer, set_total_steps


def test_planned_epochs_fill_the_rest_of_the_budget_within_bounds():
    # 100 s spent of 400 after 2 epochs, 30 s an epoch: 10 more fit (300 s), not 11
    assert planned_epochs(400, 100, 30, done=2, most=50) == 12
    assert planned_epochs(400, 100, 30, done=2, most=9) == 9       # never more than `epochs`
    assert planned_epochs(60, 100, 30, done=2, most=50) == 3       # over budget already: one more, which ends
    assert planned_epochs(130, 100, 30, done=2, most=50) == 3      # the run evaluated and checkpointed
    assert planned_epochs(129.9, 100, 30, done=2, most=50) == 3


def test_the_length_is_fixed_at_the_end_of_the_warm_up():
    assert plan_epoch(warmup_steps=100, steps_per_epoch=20) == 5
    assert plan_epoch(warmup_steps=99, steps_per_epoch=20) == 4   # within the warm-up, never past it
    assert plan_epoch(warmup_steps=40, steps_per_epoch=20) == 2   # its last step: the cosine's first rate is 1


def _schedule(total_steps: int):
    model = torch.nn.Linear(3, 2)
    return build_optimizer(model, lr=1e-3, weight_decay=0.05, min_lr=1e-5, warmup_steps=20, total_steps=total_steps)


def _rates(optimizer, scheduler, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_a_schedule_given_its_length_in_warm_up_is_the_schedule_of_that_length():
    """Planned at the end of the warm-up (the first rate it sets is the cosine's), and again after a
    checkpoint of the planned schedule is loaded into one built with the stage's ``epochs``."""
    opt, sched = _schedule(total_steps=60)
    early = _rates(opt, sched, 20)
    set_total_steps(sched, 30)
    planned = early + _rates(opt, sched, 5)
    ref_opt, ref_sched = _schedule(total_steps=30)
    assert planned == _rates(ref_opt, ref_sched, 25)
    assert planned[20] > planned[24] > 0  # the cosine of 30 steps, which falls faster than that of 60
    new_opt, new_sched = _schedule(total_steps=60)
    new_opt.load_state_dict(opt.state_dict())
    new_sched.load_state_dict(sched.state_dict())
    set_total_steps(new_sched, 30)
    assert _rates(new_opt, new_sched, 5) == _rates(ref_opt, ref_sched, 5) == _rates(opt, sched, 5)


def test_a_new_length_applies_from_the_next_step():
    """Past the warm-up (where the loop never plans) too: the rate already set for the next step is redone."""
    opt, sched = _schedule(total_steps=60)
    _rates(opt, sched, 25)
    set_total_steps(sched, 30)
    ref_opt, ref_sched = _schedule(total_steps=30)
    assert _rates(opt, sched, 5) == _rates(ref_opt, ref_sched, 30)[25:]
    assert sched.get_last_lr() == ref_sched.get_last_lr()


def test_a_captured_step_reads_the_planned_rates():
    """With ``cuda_graph: true`` the rates are device tensors a captured graph reads: the plan must
    fill those tensors, not put new values in their place (the graph would keep the old rates)."""
    from pipeline.train.graphs import graph_safe

    opt, sched = _schedule(total_steps=60)
    graph_safe(opt, torch.device("cpu"))
    _rates(opt, sched, 25)
    captured = [group["lr"] for group in opt.param_groups]
    before = [float(t) for t in captured]
    set_total_steps(sched, 30)
    ref_opt, ref_sched = _schedule(total_steps=30)
    _rates(ref_opt, ref_sched, 25)
    planned = [g["lr"] for g in ref_opt.param_groups]
    assert all(group["lr"] is t for group, t in zip(opt.param_groups, captured))  # the same tensors,
    assert [float(t) for t in captured] == pytest.approx(planned, rel=1e-6)  # refilled with the plan's rates
    assert planned != pytest.approx(before, rel=1e-6)


def test_a_warm_up_that_rounds_past_its_whole_epochs_is_refused_before_the_run(digits_dir):
    """2.9999 warm-up epochs pass the config's check with ``epochs: 3`` (its whole epochs: 2), but at 3
    steps an epoch they are 9 steps, so the plan would come after epoch 3, the run's last: the driver,
    which knows the steps, refuses it in one line rather than ignore the budget; one more epoch passes."""
    from pathlib import Path

    from pipeline.config import ConfigError, load_params
    from pipeline.data import read_dataset_info
    from pipeline.model import VisionTransformer, ViTConfig
    from pipeline.train.driver import prepare_run

    batch = read_dataset_info(digits_dir)["counts"]["train"] // 3  # 3 steps an epoch

    def prepare(epochs: int):
        params = load_params(Path(__file__).parents[1] / "params.yaml", overrides={
            "pretrain.time_budget_minutes": 1, "pretrain.warmup_epochs": 2.9999, "pretrain.epochs": epochs,
            "pretrain.global_batch_size": batch, "ray.num_workers": 1})
        model = VisionTransformer(ViTConfig(image_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                                            num_classes=10))
        return prepare_run("pretrain", params.ray, params.pretrain, model, str(digits_dir))

    with pytest.raises(ConfigError) as err:
        prepare(3)
    assert str(err.value).startswith("pretrain.time_budget_minutes: the run's length is fixed at the end of the "
                                     "warm-up (pretrain.warmup_epochs=2.9999: 9 steps of 3 an epoch), which "
                                     "pretrain.epochs=3 never passes")
    assert prepare(4).loop.warmup_steps == 9


def test_a_warm_up_as_long_as_the_run_is_said(digits_dir, capsys):
    """Without a time budget a warm-up covering every epoch is allowed (a quick try), but the stage says that
    the learning rate then never decays; one epoch shorter is quiet."""
    from pathlib import Path

    from pipeline.config import load_params
    from pipeline.model import VisionTransformer, ViTConfig
    from pipeline.train.driver import prepare_run

    def warnings(epochs: int, warmup: float) -> list[str]:
        params = load_params(Path(__file__).parents[1] / "params.yaml", overrides={
            "pretrain.warmup_epochs": warmup, "pretrain.epochs": epochs, "ray.num_workers": 1})
        model = VisionTransformer(ViTConfig(image_size=16, patch_size=4, embed_dim=16, depth=1, num_heads=2,
                                            num_classes=10))
        prepare_run("pretrain", params.ray, params.pretrain, model, str(digits_dir))
        return capsys.readouterr().err.splitlines()

    assert warnings(2, 2) == ["[pretrain] warning: pretrain.warmup_epochs=2 covers all of pretrain.epochs=2: the "
                              "learning rate rises to the end and never decays; lower pretrain.warmup_epochs for a "
                              "real run"]
    assert warnings(3, 5)[0].startswith("[pretrain] warning: pretrain.warmup_epochs=5 covers all of")
    assert warnings(3, 2) == []

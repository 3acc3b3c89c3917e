"""common/optim.py: the optimizer (--opt) and its weight-decay groups as torchvision builds them, and the lr
schedule: LrFactor per step or per epoch (against torchvision's schedulers), LrSchedule's state (its step) on resume,
each parameter group's lr kept."""

import functools

import pytest
import torch
import torch.nn as nn
import torchvision

from common.header import describe_optimizer
from common.optim import LrFactor, LrSchedule, build_optimizer, build_scheduler, parameter_groups
from conftest import parse, tensor_datasets

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables


def test_step_schedule_is_full_lr_through_the_last_step_of_epoch_29():
    factor = LrFactor("step", steps_per_epoch=10, epochs=90)
    assert factor(0) == 1.0
    assert factor(30 * 10 - 1) == 1.0


def test_step_schedule_decays_tenfold_at_the_first_step_of_epoch_30():
    factor = LrFactor("step", steps_per_epoch=10, epochs=90)
    assert factor(30 * 10) == pytest.approx(0.1)
    assert factor(60 * 10 - 1) == pytest.approx(0.1)


def test_step_schedule_is_a_hundredth_at_epoch_60():
    factor = LrFactor("step", steps_per_epoch=10, epochs=90)
    assert factor(60 * 10) == pytest.approx(0.01)
    assert factor(90 * 10 - 1) == pytest.approx(0.01)


def test_step_schedule_honours_step_size_and_gamma():
    factor = LrFactor("step", steps_per_epoch=4, epochs=10, step_size=2, gamma=0.5)
    assert [factor(epoch * 4) for epoch in range(6)] == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.25])


def test_cosine_schedule_starts_at_full_lr_right_after_warmup():
    assert LrFactor("cosine", steps_per_epoch=10, epochs=10)(0) == 1.0
    assert LrFactor("cosine", steps_per_epoch=10, epochs=10, warmup_epochs=2)(20) == 1.0


def test_cosine_schedule_is_half_at_the_midpoint_and_zero_at_the_end():
    factor = LrFactor("cosine", steps_per_epoch=10, epochs=10, warmup_epochs=2)
    # 20 warmup steps, then 80 cosine steps: the midpoint is step 20 + 40.
    assert factor(60) == pytest.approx(0.5)
    assert factor(100) == pytest.approx(0.0, abs=1e-12)
    assert factor(99) > 0.0
    no_warmup = LrFactor("cosine", steps_per_epoch=10, epochs=10)
    assert no_warmup(50) == pytest.approx(0.5)
    assert no_warmup(100) == pytest.approx(0.0, abs=1e-12)


def test_cosine_schedule_decreases_monotonically():
    factor = LrFactor("cosine", steps_per_epoch=7, epochs=5)
    values = [factor(step) for step in range(36)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_warmup_starts_at_one_percent_and_reaches_full_lr_at_its_end():
    for schedule in ("step", "cosine", "constant"):
        factor = LrFactor(schedule, steps_per_epoch=10, epochs=10, warmup_epochs=2)
        assert factor(0) == pytest.approx(0.01)
        assert factor(10) == pytest.approx(0.01 + 0.99 * 0.5)  # linear
        assert 0.01 < factor(19) < 1.0
        assert factor(20) == pytest.approx(1.0)


def test_constant_schedule_keeps_the_lr():
    factor = LrFactor("constant", steps_per_epoch=10, epochs=10)
    assert {factor(step) for step in range(0, 101, 7)} == {1.0}


def config(schedule="cosine", *argv):
    return parse(
        "--dummy",
        "--lr-schedule",
        schedule,
        "--lr",
        "0.1",
        "--epochs",
        "10",
        "--warmup-epochs",
        "1",
        "--lr-step-size",
        "3",
        *argv,
    )


def stepped(scheduler, optimizer, steps):
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return [group["lr"] for group in optimizer.param_groups]


@pytest.mark.parametrize("schedule", ["step", "cosine", "constant"])
@pytest.mark.parametrize("start_step", [0, 3, 5, 17, 32, 50])
def test_a_schedule_loaded_at_step_k_stands_where_stepping_k_times_does(schedule, start_step):
    """A resumed run builds its scheduler anew and loads the state of the one it saved: its step alone."""
    steps_per_epoch, settings = 5, config(schedule)
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    expected = stepped(build_scheduler(optimizer, settings, steps_per_epoch), optimizer, start_step)
    saved = build_scheduler(optimizer, settings, steps_per_epoch)
    saved.last_epoch = start_step
    resumed_optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    resumed = build_scheduler(resumed_optimizer, settings, steps_per_epoch)
    resumed.load_state_dict(saved.state_dict())
    assert saved.state_dict() == {"last_epoch": start_step, "steps_per_epoch": 5}
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(expected[0], rel=1e-12, abs=1e-15)
    factor = LrFactor(schedule, steps_per_epoch, 10, 1.0, 3, 0.1)
    assert resumed.get_last_lr()[0] == pytest.approx(0.1 * factor(start_step), rel=1e-12, abs=1e-15)
    assert stepped(resumed, resumed_optimizer, 3) == pytest.approx(stepped(saved, optimizer, 3), rel=1e-12, abs=1e-15)


def test_a_resumed_schedule_follows_this_run_s_flags_over_the_optimizer_s_saved_lr():
    """The optimizer's state holds the lr of the run that saved it; a resumed run may change --lr or --epochs."""
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.05)
    scheduler = build_scheduler(optimizer, config("constant", "--warmup-epochs", "0", "--lr", "0.05"), 5)
    optimizer.load_state_dict(
        {
            **optimizer.state_dict(),
            "param_groups": [{**optimizer.state_dict()["param_groups"][0], "lr": 0.3, "initial_lr": 0.3}],
        }
    )  # the saved run's
    scheduler.load_state_dict({"last_epoch": 10, "steps_per_epoch": 5})
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert optimizer.param_groups[0]["initial_lr"] == pytest.approx(0.05)


def test_each_parameter_group_keeps_its_own_lr_through_the_schedule_and_a_resume():
    """A backbone at a tenth of the head's lr stays at a tenth: the schedule multiplies each group's lr (it once
    set every group's to --lr), and so does a resumed run's."""

    def optimizer_of(model):
        return torch.optim.SGD(
            [{"params": model[0].parameters(), "lr": 0.01}, {"params": model[1].parameters()}], lr=0.1, momentum=0.9
        )

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = optimizer_of(model)
    scheduler = build_scheduler(optimizer, config("cosine"), 5)
    lrs = stepped(scheduler, optimizer, 12)
    assert lrs[0] == pytest.approx(lrs[1] / 10) and lrs[1] < 0.1
    resumed_optimizer = optimizer_of(model)
    resumed = build_scheduler(resumed_optimizer, config("cosine"), 5)
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    resumed.load_state_dict(scheduler.state_dict())
    assert [group["lr"] for group in resumed_optimizer.param_groups] == pytest.approx(lrs)
    assert stepped(resumed, resumed_optimizer, 4) == pytest.approx(stepped(scheduler, optimizer, 4))
    assert describe_optimizer(optimizer_of(model), config("cosine")).startswith(
        "optimizer: SGD, lr by parameter group 0.01, 0.1, momentum 0.9"
    )  # the header: each group's


def test_the_schedule_s_state_loads_with_weights_only(tmp_path):
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    scheduler = build_scheduler(optimizer, config("cosine"), steps_per_epoch=5)
    stepped(scheduler, optimizer, 7)
    torch.save(scheduler.state_dict(), tmp_path / "scheduler.pth")
    assert torch.load(tmp_path / "scheduler.pth", weights_only=True) == {"last_epoch": 7, "steps_per_epoch": 5}
    assert isinstance(scheduler, LrSchedule)


# ----------------------------------------------------------------------------- weight-decay groups


class EveryNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.lrn = nn.LocalResponseNorm(2)
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 3, bias=False)
        self.tied = nn.Linear(3, 3, bias=False)
        self.tied.weight = self.head.weight  # one parameter in two modules


NORM_WEIGHTS = {"bn.weight", "gn.weight", "inorm.weight", "ln.weight"}
NORM_BIASES = {"bn.bias", "gn.bias", "inorm.bias", "ln.bias"}
OTHER_BIASES = {"conv.bias", "fc.bias"}


def group_names(model, groups):
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return {group.get("name"): [names[id(parameter)] for parameter in group["params"]] for group in groups}


def test_norm_and_bias_weight_decay_groups_hold_every_parameter_once_where_it_belongs():
    """Both flags: every bias (a norm layer's too) has the bias decay, the norm layers' weights the norm decay."""
    model = EveryNorm()
    groups = parameter_groups(model, 1e-4, norm_weight_decay=0.0, bias_weight_decay=0.0)
    named = group_names(model, groups)
    everything = [name for names in named.values() for name in names]
    assert sorted(everything) == sorted(name for name, _ in model.named_parameters())  # each exactly once
    assert set(named["norm"]) == NORM_WEIGHTS and set(named["bias"]) == NORM_BIASES | OTHER_BIASES
    assert [(group["name"], group["weight_decay"]) for group in groups] == [
        ("other", 1e-4),
        ("norm", 0.0),
        ("bias", 0.0),
    ]
    order = [name for name, _ in model.named_parameters()]
    assert all(names == sorted(names, key=order.index) for names in named.values())  # model order in each group
    assert group_names(model, parameter_groups(model, 1e-4, 0.0, 0.0)) == named  # deterministic


def test_norm_weight_decay_alone_covers_the_norm_layers_and_bias_weight_decay_alone_every_bias():
    model = EveryNorm()
    named = group_names(model, parameter_groups(model, 2e-5, norm_weight_decay=0.0))
    assert set(named) == {"other", "norm"} and set(named["norm"]) == NORM_WEIGHTS | NORM_BIASES
    assert OTHER_BIASES <= set(named["other"])
    named = group_names(model, parameter_groups(model, 2e-5, bias_weight_decay=0.0))
    assert set(named) == {"other", "bias"} and set(named["bias"]) == NORM_BIASES | OTHER_BIASES
    assert NORM_WEIGHTS <= set(named["other"])


def decay_of_each_parameter(model, groups, weight_decay):
    """{parameter name: its weight decay} under the optimizer's parameter groups (a plain list: weight_decay)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return {
        names[id(parameter)]: group.get("weight_decay", weight_decay)
        for group in groups
        for parameter in group["params"]
    }


@pytest.mark.parametrize("arch", ["resnet50", "vit_b_16"])
def test_every_parameter_has_the_weight_decay_torchvision_s_set_weight_decay_gives_it(arch):
    """torchvision's references/classification utils.set_weight_decay, called as its train.py calls it from the
    same flags (tests/torchvision_reference.py), against ours: the same decay for each parameter."""
    from tests.torchvision_reference import torchvision_parameter_groups

    model = getattr(torchvision.models, arch)()
    for norm, bias in [(None, None), (0.0, None), (None, 0.0), (0.0, 0.0), (1e-5, 0.0), (0.0, 2e-5), (2e-5, 2e-5)]:
        theirs = decay_of_each_parameter(model, torchvision_parameter_groups(model, 2e-5, norm, bias), 2e-5)
        groups = parameter_groups(model, 2e-5, norm, bias)
        ours = decay_of_each_parameter(model, groups, 2e-5)
        assert ours == theirs, (norm, bias)
        assert sorted(ours) == sorted(name for name, _ in model.named_parameters())  # every parameter, once
        assert sum(len(group["params"]) if isinstance(group, dict) else 1 for group in groups) == len(ours)
    if arch == "resnet50":  # --bias-weight-decay 0 alone: every bias, BatchNorm's included, 54 of 161 tensors
        decays = decay_of_each_parameter(model, parameter_groups(model, 2e-5, None, 0.0), 2e-5)
        assert sum(decay == 0.0 for decay in decays.values()) == 54 and len(decays) == 161


def test_frozen_parameters_are_left_out_of_the_groups_as_torchvision_does():
    model = EveryNorm()
    model.conv.requires_grad_(False)
    named = group_names(model, parameter_groups(model, 1e-4, norm_weight_decay=0.0))
    assert not {"conv.weight", "conv.bias"} & {name for names in named.values() for name in names}


def test_without_other_decays_every_trainable_parameter_is_in_one_group():
    model = EveryNorm()
    model.fc.requires_grad_(False)
    for norm, bias in [(None, None), (1e-4, None), (None, 1e-4), (1e-4, 1e-4)]:
        groups = parameter_groups(model, 1e-4, norm, bias)
        assert [(group["name"], group["weight_decay"]) for group in groups] == [("other", 1e-4)]
        assert group_names(model, groups)["other"] == [name for name, p in model.named_parameters() if p.requires_grad]
        assert (
            len(
                build_optimizer(
                    model, parse("--wd", "1e-4", *(["--norm-weight-decay", norm] if norm else []))
                ).param_groups
            )
            == 1
        )


def test_the_schedule_sets_the_lr_of_every_group():
    model = EveryNorm()
    settings = parse(
        "--dummy",
        "--lr",
        "0.2",
        "--wd",
        "1e-4",
        "--norm-weight-decay",
        "0",
        "--bias-weight-decay",
        "0",
        "--lr-schedule",
        "cosine",
        "--epochs",
        "2",
        "--warmup-epochs",
        "0",
    )
    optimizer = build_optimizer(model, settings)
    scheduler = build_scheduler(optimizer, settings, steps_per_epoch=4)
    stepped(scheduler, optimizer, 3)
    assert [group["initial_lr"] for group in optimizer.param_groups] == [0.2] * 3
    assert len({group["lr"] for group in optimizer.param_groups}) == 1 and optimizer.param_groups[0]["lr"] < 0.2
    assert [group["weight_decay"] for group in optimizer.param_groups] == [1e-4, 0.0, 0.0]
    assert scheduler.last_epoch == 3


def test_lr_scaling_linear_shows_the_scaled_lr_and_how():
    settings = parse("--dummy", "--lr", "0.1", "-b", "1024", "--lr-scaling", "linear")
    line = describe_optimizer(build_optimizer(nn.Linear(2, 2), settings), settings)
    assert line.startswith("optimizer: SGD, lr 0.4 (--lr 0.1 x 1024/256, --lr-scaling linear), momentum 0.9"), line
    settings = parse("--dummy", "--lr", "0.1", "-b", "1024")
    assert "lr 0.1, " in describe_optimizer(build_optimizer(nn.Linear(2, 2), settings), settings)


@pytest.mark.parametrize(
    "argv, env, header",
    [
        # A preset's lr is scaled from the batch it was set for, not from 256.
        (["--dummy", "--preset", "tv-v2"], {}, "lr 0.5 (--preset tv-v2's lr 0.5 x 1024/1024"),
        (["--dummy", "--preset", "tv-v2", "-b", "2048"], {}, "lr 1 (--preset tv-v2's lr 0.5 x 2048/1024"),
        ([], {}, "lr 0.04 (the demo preset's lr 0.04 x 64/64"),
        (["-b", "32", "--preset", "tv-v2"], {}, "lr 0.02 (the demo preset's lr 0.04 x 32/64"),
        (["--dummy", "-b", "512"], {}, "lr 0.2 (the imagenet preset's lr 0.1 x 512/256"),
        # The user's lr, from the command line or the platform's LR, is for 256 images, over any preset.
        (["--dummy", "--preset", "tv-v2", "--lr", "0.1", "-b", "1024"], {}, "lr 0.4 (--lr 0.1 x 1024/256"),
        (["--dummy", "--preset", "tv-v2", "-b", "512"], {"LR": "0.2"}, "lr 0.4 (LR 0.2 x 512/256"),
    ],
)
def test_lr_scaling_linear_scales_an_lr_from_the_batch_it_was_given_for(no_platform_env, argv, env, header):
    for name, value in env.items():
        no_platform_env.setenv(name, value)
    settings = parse(*argv, "--lr-scaling", "linear")
    line = describe_optimizer(build_optimizer(nn.Linear(2, 2), settings), settings)
    assert line.startswith(f"optimizer: SGD, {header}, --lr-scaling linear), momentum 0.9"), line


# ----------------------------------------------------------------------------- --lr-step-unit epoch


def torchvision_epoch_lrs(lr, schedule, epochs, warmup, step_size=30, gamma=0.1, lr_min=0.0):
    """The lr of each epoch as torchvision's references/classification/train.py schedules it: its schedulers
    (LinearLR warmup from 0.01, then CosineAnnealingLR or StepLR, in a SequentialLR), stepped once per epoch."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    if schedule == "cosine":
        main = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs - warmup, eta_min=lr_min)
    else:
        main = torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=gamma)
    if warmup > 0:
        warm = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=warmup)
        scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers=[warm, main], milestones=[warmup])
    else:
        scheduler = main
    lrs = []
    for _ in range(epochs):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.parametrize(
    "schedule, epochs, warmup, lr_min",
    [
        ("cosine", 12, 3, 0.0),
        ("cosine", 10, 0, 0.0),
        ("cosine", 12, 3, 0.02),
        ("step", 70, 5, 0.0),
        ("step", 65, 0, 0.0),
    ],
)
def test_lr_step_unit_epoch_follows_torchvision_s_schedulers_stepped_per_epoch(schedule, epochs, warmup, lr_min):
    """--lr-min is CosineAnnealingLR's eta_min (torchvision's --lr-min)."""
    settings = parse(
        "--dummy",
        "--lr",
        "0.5",
        "--lr-schedule",
        schedule,
        "--epochs",
        epochs,
        "--warmup-epochs",
        warmup,
        "--lr-step-unit",
        "epoch",
        "--lr-min",
        lr_min,
    )
    optimizer = build_optimizer(nn.Linear(2, 2), settings)
    scheduler = build_scheduler(optimizer, settings, steps_per_epoch=3)
    ours = []
    for _ in range(epochs * 3):
        ours.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [lr for lr in torchvision_epoch_lrs(0.5, schedule, epochs, warmup, lr_min=lr_min) for _ in range(3)]
    assert ours == pytest.approx(expected, rel=1e-9, abs=1e-12)
    if schedule == "step" and warmup:  # the decays come 30 epochs after the warmup's end, as there
        assert ours[3 * 34] == pytest.approx(0.5) and ours[3 * 35] == pytest.approx(0.05)


# ----------------------------------------------------------------------------- optimizers and clipping


@pytest.mark.parametrize(
    "opt, expected",
    [
        ("sgd", functools.partial(torch.optim.SGD, momentum=0.9, weight_decay=1e-4, nesterov=False)),
        ("sgd-nesterov", functools.partial(torch.optim.SGD, momentum=0.9, weight_decay=1e-4, nesterov=True)),
        ("rmsprop", functools.partial(torch.optim.RMSprop, momentum=0.9, weight_decay=1e-4, eps=0.0316, alpha=0.9)),
        ("adamw", functools.partial(torch.optim.AdamW, weight_decay=1e-4)),
    ],
)
def test_opt_builds_the_optimizer_torchvisions_train_py_builds(opt, expected):
    """torchvision's references/classification/train.py: SGD(momentum, weight_decay, nesterov="nesterov" in opt),
    RMSprop(momentum, weight_decay, eps=0.0316, alpha=0.9), AdamW(weight_decay); the header names it."""
    settings = parse("--opt", opt, "--lr", "0.1")
    ours, theirs = build_optimizer(nn.Linear(2, 2), settings), expected(nn.Linear(2, 2).parameters(), lr=0.1)
    assert type(ours) is type(theirs) and ours.defaults == theirs.defaults
    assert describe_optimizer(ours, settings).startswith(f"optimizer: {type(theirs).__name__}, lr 0.1")


def test_the_layerwise_example_splits_the_default_optimizer_s_groups_by_head(tmp_path):
    """examples/layerwise_lr.py made SGD with one weight decay whatever --opt, --norm-weight-decay and
    --bias-weight-decay said, and took the last Linear for the head (an auxiliary head; a SqueezeNet: IndexError)."""
    from common.trainer import trainer_class
    from unit.test_checkpoint import SMALL, started

    argv = ["--trainer", "examples.layerwise_lr:LayerwiseLr", "--opt", "adamw", "--bias-weight-decay", "0"]
    trainer = trainer_class("examples.layerwise_lr:LayerwiseLr")
    run = started(*SMALL, *argv, "-a", "examples.aux_model:build", "--output-dir", tmp_path / "aux", trainer=trainer)
    assert isinstance(run.optimizer, torch.optim.AdamW)
    heads = {id(p) for name in ("head.1", "aux.2") for p in run.model.get_submodule(name).parameters()}
    for group in run.optimizer.param_groups:
        in_head = {id(p) in heads for p in group["params"]}
        assert len(in_head) == 1 and group["lr"] == pytest.approx(0.05 if in_head.pop() else 0.005), group["lr"]
        assert group["weight_decay"] == (0.0 if all(p.ndim == 1 for p in group["params"]) else 1e-4)
    assert len(run.optimizer.param_groups) == 4  # (heads and backbone, each with and without decay)
    sizes = ["--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32"]
    run = started(*SMALL, *argv, *sizes, "-a", "squeezenet1_1", "--output-dir", tmp_path / "sq", trainer=trainer)
    assert run.optimizer.param_groups[0]["params"][0] is run.model.classifier[1].weight  # (a 1x1 convolution)

    # A backbone's layers of as many outputs as classes (resnet's 1x1 convolutions of 64 channels) are no heads.
    class SixtyFourClasses(trainer):
        def build_datasets(self):
            _, train, val = tensor_datasets()
            return [str(index) for index in range(64)], train, val

    run = started(*SMALL, *argv, "-a", "resnet50", "--output-dir", tmp_path / "r", trainer=SixtyFourClasses)
    heads = [group["params"] for group in run.optimizer.param_groups if group["lr"] == pytest.approx(0.05)]
    assert [parameter for group in heads for parameter in group] == [run.model.fc.weight, run.model.fc.bias]
    # With adamw_onecycle's schedule (both: the layerwise split of its AdamW groups): each group peaks at its own lr
    # (was: every group at --lr, the backbone's tenth lost).
    both = type("Both", (trainer, trainer_class("examples.adamw_onecycle:AdamWOneCycle")), {})
    run = started(
        *SMALL, "--trainer", "examples.layerwise_lr:LayerwiseLr", "--output-dir", tmp_path / "b", trainer=both
    )
    assert isinstance(run.optimizer, torch.optim.AdamW)
    assert sorted({group["max_lr"] for group in run.optimizer.param_groups}) == pytest.approx([0.005, 0.05])

"""Today's recipe in the training loop: the EMA of the weights (--model-ema), weight-decay groups
(--norm-weight-decay, --bias-weight-decay), mixup / cutmix soft targets in train_one_epoch, --lr-scaling,
--preset tv-v2 end to end in all three scripts, an exact mid-epoch resume with all of it on (the EMA and
the repeated-augmentation sampler included), and per-step TensorBoard scalars read back with
TensorBoard's own EventAccumulator. (The data side of the recipe: tests/test_recipe_data.py.)"""
import copy
import csv
import functools
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

from common.args import UsageError
from common.ema import ModelEma, adjusted_decay
from common.engine import train_one_epoch
from common.trainer import Trainer
from common.logger import CSV_FIELDS, EMA_FIELDS, STEP_TAGS, RunLogger
from common.meters import MetricSums
from common.schedule import build_optimizer, build_scheduler, describe_optimizer, parameter_groups
from conftest import PYTHON, REPO, TINY, Job, free_port, make_image_folder, run_script, run_together, torchrun_command
from tests.tiny_models import TinyNet

# ----------------------------------------------------------------------------- the EMA


def small_bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def train_a_step(model):
    """Move the parameters and the BatchNorm statistics, as a training step does."""
    model.train()
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= 0.1 * parameter.grad
            parameter.grad = None


def test_an_ema_with_decay_0_equals_the_model():
    model = small_bn_net()
    ema = ModelEma(model, decay=0.0)
    for step in range(3):
        train_a_step(model)
        ema.after_step(step, epoch=0)
    ema_state, model_state = ema.module.state_dict(), model.state_dict()
    assert ema_state.keys() == model_state.keys()
    assert all(torch.equal(ema_state[name], model_state[name]) for name in model_state)  # buffers too
    assert ema.n_averaged == 3


def test_the_ema_decay_is_adjusted_as_torchvisions_train_py_does():
    # torchvision's references/classification/train.py, with its tv-v2 numbers: 8 GPUs x 128, 32 steps, 600 epochs.
    world_size, batch_size, model_ema_steps, epochs, model_ema_decay = 8, 128, 32, 600, 0.99998
    adjust = world_size * batch_size * model_ema_steps / epochs
    alpha = 1.0 - model_ema_decay
    alpha = min(1.0, alpha * adjust)
    assert adjusted_decay(0.99998, 1024, 32, 600) == 1.0 - alpha
    assert adjusted_decay(0.99998, 1024, 32, 600) == pytest.approx(1 - 2e-5 * 1024 * 32 / 600, rel=1e-12, abs=1e-12)
    assert adjusted_decay(0.9, 1024, 32, 600) == 0.0  # alpha capped at 1: the EMA is the weights


def test_the_ema_updates_at_torchvision_s_steps_and_restarts_from_the_weights_during_warmup():
    """4 steps an epoch, --model-ema-steps 3: updates after the steps whose index in the epoch is a multiple of 3,
    as torchvision's train_one_epoch (`if model_ema and i % args.model_ema_steps == 0`): global steps 0, 3, 4, 7,
    8, 11. One warmup epoch: the updates of epoch 0 copy the weights and leave n_averaged at 0, so the first of
    epoch 1 copies them too; then decay 0.5 averages."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    ema = ModelEma(model, decay=0.5, every=3, warmup_epochs=1)
    updated, counts, values, torchvision_updates = [], [], [], []
    for epoch in range(3):
        for i in range(4):  # torchvision's loop variable
            global_step = epoch * 4 + i
            with torch.no_grad():
                model.weight += 1  # the weight after step g is g + 1
            if i % 3 == 0:
                torchvision_updates.append(global_step)
            if ema.after_step(i, epoch=epoch):
                updated.append(global_step)
                counts.append(ema.n_averaged)
                values.append(ema.module.weight.item())
    assert updated == torchvision_updates == [0, 3, 4, 7, 8, 11]
    assert counts == [0, 0, 1, 2, 3, 4]
    assert values[:3] == [1.0, 4.0, 5.0] and values[3] == 0.5 * 5.0 + 0.5 * 8.0


def test_an_ema_saved_and_loaded_mid_run_goes_on_as_one_that_was_not():
    def train(model, ema, steps):
        for step in steps:
            train_a_step(model)
            ema.after_step(step, epoch=0)
    model = small_bn_net()
    uninterrupted = ModelEma(model, decay=0.7, every=2)
    torch.manual_seed(1)
    train(model, uninterrupted, range(6))
    model = small_bn_net()
    first = ModelEma(model, decay=0.7, every=2)
    torch.manual_seed(1)
    train(model, first, range(3))
    saved = copy.deepcopy(first.state())
    second = ModelEma(model, decay=0.7, every=2)  # made from the weights: load() must replace them
    second.load(saved)
    train(model, second, range(3, 6))
    assert second.n_averaged == uninterrupted.n_averaged == 3
    for name, value in uninterrupted.module.state_dict().items():
        assert torch.equal(second.module.state_dict()[name], value), name


def test_the_ema_state_loads_with_weights_only_into_a_plain_model(tmp_path):
    model = torchvision.models.resnet18(num_classes=3)
    ema = ModelEma(model, decay=0.5)
    train_a_step(model)
    ema.after_step(0, epoch=0)
    torch.save(ema.state(), tmp_path / "ema.pth")
    saved = torch.load(tmp_path / "ema.pth", weights_only=True)
    plain = torchvision.models.resnet18(num_classes=3)
    plain.load_state_dict(saved["model_ema"])  # strict: the bare model's keys
    assert saved["model_ema_n_averaged"] == 1
    assert torch.equal(plain.fc.weight, model.fc.weight)  # the first update copies the weights


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
    assert [(group["name"], group["weight_decay"]) for group in groups] == [("other", 1e-4), ("norm", 0.0), ("bias", 0.0)]
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
    return {names[id(parameter)]: group.get("weight_decay", weight_decay) for group in groups
            for parameter in group["params"]}


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


@pytest.mark.parametrize("norm, bias", [(None, None), (1e-4, None), (None, 1e-4), (1e-4, 1e-4)])
def test_without_other_decays_there_is_the_single_group_of_before(norm, bias):
    model = EveryNorm()
    groups = parameter_groups(model, 1e-4, norm, bias)
    assert isinstance(groups, list) and all(a is b for a, b in zip(groups, model.parameters(), strict=True))
    args = SimpleNamespace(lr=0.1, momentum=0.9, weight_decay=1e-4, norm_weight_decay=norm, bias_weight_decay=bias)
    assert len(build_optimizer(model, args).param_groups) == 1


def test_the_schedule_sets_the_lr_of_every_group():
    model = EveryNorm()
    args = SimpleNamespace(lr=0.2, momentum=0.9, weight_decay=1e-4, norm_weight_decay=0.0, bias_weight_decay=0.0,
                           lr_schedule="cosine", epochs=2, warmup_epochs=0.0, lr_step_size=30, lr_gamma=0.1)
    optimizer = build_optimizer(model, args)
    scheduler = build_scheduler(optimizer, args, steps_per_epoch=4, start_step=3)
    assert [group["initial_lr"] for group in optimizer.param_groups] == [0.2] * 3
    assert len({group["lr"] for group in optimizer.param_groups}) == 1 and optimizer.param_groups[0]["lr"] < 0.2
    assert [group["weight_decay"] for group in optimizer.param_groups] == [1e-4, 0.0, 0.0]
    assert scheduler.last_epoch == 3


def test_lr_scaling_linear_shows_the_scaled_lr_and_how(no_platform_env):
    import train_dp
    args = train_dp.parse_args(["--dummy", "--lr", "0.1", "-b", "1024", "--lr-scaling", "linear"])
    line = describe_optimizer(build_optimizer(nn.Linear(2, 2), args), args)
    assert line.startswith("optimizer: SGD, lr 0.4 (--lr 0.1 x 1024/256, --lr-scaling linear), momentum 0.9"), line
    args = train_dp.parse_args(["--dummy", "--lr", "0.1", "-b", "1024"])
    assert "lr 0.1, " in describe_optimizer(build_optimizer(nn.Linear(2, 2), args), args)



@pytest.mark.parametrize("argv, env, header", [
    # A preset's lr is scaled from the batch it was set for, not from 256.
    (["--dummy", "--preset", "tv-v2"], {}, "lr 0.5 (--preset tv-v2's lr 0.5 x 1024/1024"),
    (["--dummy", "--preset", "tv-v2", "-b", "2048"], {}, "lr 1 (--preset tv-v2's lr 0.5 x 2048/1024"),
    ([], {}, "lr 0.04 (the demo preset's lr 0.04 x 64/64"),
    (["-b", "32", "--preset", "tv-v2"], {}, "lr 0.02 (the demo preset's lr 0.04 x 32/64"),
    (["--dummy", "-b", "512"], {}, "lr 0.2 (the imagenet preset's lr 0.1 x 512/256"),
    # The user's lr, from the command line or the platform's LR, is for 256 images, over any preset.
    (["--dummy", "--preset", "tv-v2", "--lr", "0.1", "-b", "1024"], {}, "lr 0.4 (--lr 0.1 x 1024/256"),
    (["--dummy", "--preset", "tv-v2", "-b", "512"], {"LR": "0.2"}, "lr 0.4 (LR 0.2 x 512/256"),
])
def test_lr_scaling_linear_scales_an_lr_from_the_batch_it_was_given_for(no_platform_env, argv, env, header):
    for name, value in env.items():
        no_platform_env.setenv(name, value)
    import train_dp
    args = train_dp.parse_args([*argv, "--lr-scaling", "linear"])
    line = describe_optimizer(build_optimizer(nn.Linear(2, 2), args), args)
    assert line.startswith(f"optimizer: SGD, {header}, --lr-scaling linear), momentum 0.9"), line


# ----------------------------------------------------------------------------- mixing in train_one_epoch

def test_train_one_epoch_takes_the_loss_on_the_mixed_targets_and_the_accuracy_on_the_own_labels():
    """A model that always names the right class (the images are their own one-hot label), and a mix that
    gives every image the next class's label: the loss is that of the soft targets (label smoothing
    applied), the accuracy 100% against each image's own label. The mix sees the steps of the epoch."""
    classes, batches = 3, []
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        target = torch.randint(0, classes, (4,), generator=generator)
        batches.append((F.one_hot(target, classes).float(), target))
    model = nn.Linear(classes, classes, bias=False)
    with torch.no_grad():
        model.weight.copy_(10 * torch.eye(classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    mixed_steps, logged, lines = [], [], []

    def mix(images, target, step):
        mixed_steps.append(step)
        soft = F.one_hot((target + 1) % classes, classes).float()
        assert torch.equal(soft.sum(1), torch.ones(len(target)))
        return images, soft

    metrics = MetricSums(torch.device("cpu"))
    # The Trainer's own train_step and optimizer_step, on the parts they use.
    trainer = SimpleNamespace(args=SimpleNamespace(amp="none", print_freq=2, clip_grad_norm=None), model=model,
                              runtime=SimpleNamespace(device=torch.device("cpu")), log=SimpleNamespace(print=lines.append),
                              criterion=criterion, aux_weight=None, optimizer=optimizer, scheduler=scheduler,
                              scaler=torch.amp.GradScaler("cpu", enabled=False))
    trainer.train_step = functools.partial(Trainer.train_step, trainer)
    trainer.optimizer_step = functools.partial(Trainer.optimizer_step, trainer)
    summary, stopped = train_one_epoch(trainer, model, batches, 0, metrics, first_step=5, mix=mix,
                                       log_step=lambda steps_done, values: logged.append((steps_done, values)))
    expected = sum(criterion(10 * images, F.one_hot((target + 1) % classes, classes).float()).item()
                   for images, target in batches) / len(batches)
    assert not stopped and mixed_steps == [5, 6, 7]
    assert summary["acc1"] == 100.0
    assert summary["loss"] == pytest.approx(expected, rel=1e-6) and summary["loss"] > 5  # not the own labels' ~0.1
    # Per-step scalars at the progress lines (step 6 of -p 2, and the last), the values those lines show.
    assert [steps_done for steps_done, _ in logged] == [6, 8] and len(lines) == 2
    for (steps_done, values), line in zip(logged, lines):
        assert f"[{steps_done}/8]  loss {values['loss']:.4f}  acc@1 {values['acc1']:6.2f}" in line
        assert f"lr {values['lr']:.4g}" in line and f"{values['images_per_second']:8.1f} img/s" in line


# ----------------------------------------------------------------------------- log.csv

def test_log_csv_gains_the_ema_columns_on_a_resumed_run_and_keeps_them(tmp_path):
    old_fields = CSV_FIELDS[:-1]  # a run begun before the bad_images column, resumed with --model-ema
    (tmp_path / "log.csv").write_text(",".join(old_fields) + "\n" + ",".join(["0"] * len(old_fields)) + "\n")
    args = SimpleNamespace(epochs=3)
    log = RunLogger(tmp_path, prints=False, writes=True)
    log.start(args, resumed=True, ema=True, global_step=10)
    log.log_epoch({**{field: 1 for field in CSV_FIELDS}, **{field: 2 for field in EMA_FIELDS}})
    log.finish({})
    log = RunLogger(tmp_path, prints=False, writes=True)
    log.start(args, resumed=True, ema=False, global_step=20)  # resumed without it: the columns stay, empty
    log.log_epoch({field: 3 for field in CSV_FIELDS})
    log.finish({})
    with open(tmp_path / "log.csv", newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == CSV_FIELDS + EMA_FIELDS
    assert rows[1] == ["0"] * len(old_fields) + [""] * 4
    assert rows[2] == ["1"] * len(CSV_FIELDS) + ["2"] * 3
    assert rows[3] == ["3"] * len(CSV_FIELDS) + [""] * 3


# ----------------------------------------------------------------------------- the whole recipe, end to end

# 48 training images at -b 8: 6 steps an epoch. The EMA updates every 2 steps, restarting from the
# weights through the warmup epoch; a checkpoint every 4 steps (epoch 1 step 2); -p 2: progress lines
# (and per-step TensorBoard scalars) at steps 2, 4, 6 of each epoch. --data: the preset's ImageNet
# scale (600 epochs, -b 1024, 176 px...) is overridden here flag by flag.
STEPS = 6
RECIPE = ["--preset", "tv-v2", "-a", "resnet18", *TINY, "-p", "2", "-b", "8", "--epochs", "2", "--lr", "0.01",
          "--warmup-epochs", "1", "--seed", "3", "--model-ema-steps", "2", "--checkpoint-interval", "4"]
MODES = ["dp", "ddp", "spawn"]
ACC = r"^ \* {label}Acc@1 ([\d.]+)  Acc@5 ([\d.]+)  Loss ([\d.]+)  \((\d+) images\)$"
PROGRESS = re.compile(r"^Epoch: \[(\d+)\] \[(\d+)/(\d+)\]  loss (\S+)  acc@1\s+(\S+)  acc@5\s+\S+  lr (\S+)\s+(\S+) img/s",
                      re.MULTILINE)
RECIPE_LINE = "recipe: tv-v2 (torchvision's ResNet-50 V2 recipe, published 80.86% acc@1, not measured here)"


def accuracy_lines(output, label=""):
    return re.findall(ACC.format(label=label + " " if label else ""), output, re.MULTILINE)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def command(mode, data, output_dir, *extra):
    flags = [*RECIPE, "--data", data, "--output-dir", output_dir, *extra]
    if mode == "ddp":
        return torchrun_command("train_ddp.py", 2, *flags)
    if mode == "spawn":
        return [PYTHON, REPO / "train_spawn.py", *flags, "--nproc-per-node", "2", "--master-port", free_port()]
    return [PYTHON, REPO / "train_dp.py", *flags]


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory):
    """Side by side: --preset tv-v2 trained to the end by each script; a train_dp.py run of the same flags
    SIGKILLed at epoch 1 step 4 (its last checkpoint: epoch 1 step 2) and resumed with --resume auto; and,
    once DDP is done, -e (train_dp.py) on DDP's checkpoint."""
    root = tmp_path_factory.mktemp("recipe")
    data = make_image_folder(root / "data", train_per_class=16, val_per_class=4)
    jobs = {mode: Job(command(mode, data, root / mode)) for mode in MODES}
    jobs["killed"] = Job(command("dp", data, root / "resumed", "--resume", "auto"))
    try:
        jobs["killed"].wait_for(re.compile(rf"^Epoch: \[1\] \[4/{STEPS}\]"), timeout=300)
        jobs["killed"].kill()
        saved = load(root / "resumed" / "checkpoint.pth")
        killed_at = (saved["epoch"], saved["step_in_epoch"])
        jobs["resumed"] = Job(command("dp", data, root / "resumed", "--resume", "auto"))
        ended = {"ddp": jobs["ddp"].finish()}
        jobs["evaluate"] = Job([PYTHON, REPO / "train_dp.py", *RECIPE, "--data", data, "--output-dir",
                                root / "evaluate", "-e", "--resume", root / "ddp" / "checkpoint.pth"])
        ended["dp"] = jobs["dp"].finish()
        # Resumed with --norm-weight-decay as --wd: one parameter group where the checkpoint has two (and,
        # before that is found, the warning of --compile with --res-schedule).
        jobs["other-groups"] = Job([PYTHON, REPO / "train_dp.py", *RECIPE, "--data", data, "--output-dir",
                                    root / "other-groups", "--resume", root / "dp" / "checkpoint.pth",
                                    "--epochs", "3", "--norm-weight-decay", "2e-5", "--compile",
                                    "--res-schedule", "32:64:0:2"])
        ended.update({name: job.finish() for name, job in jobs.items() if name not in ended and name != "killed"})
    finally:
        for job in jobs.values():
            job.kill()
    killed_output = "".join(jobs["killed"].output)
    return SimpleNamespace(root=root, ended=ended, killed_at=killed_at, killed_output=killed_output)


def output_of(recipe_runs, name):
    returncode, output = recipe_runs.ended[name]
    assert returncode == 0, output[-4000:]
    return output


@pytest.mark.parametrize("mode", MODES)
def test_the_tv_v2_preset_trains_to_the_end_evaluating_the_ema_beside_the_weights(recipe_runs, mode):
    output = output_of(recipe_runs, mode)
    assert RECIPE_LINE in output.splitlines()  # on --data: no word about the demo set
    assert re.search(r"^optimizer: SGD, lr 0\.01, momentum 0\.9, weight decay 2e-05 \(\d+ tensors\), "
                     r"0 on norm layers \(40 tensors\)$", output, re.MULTILINE), output[:3000]
    decay = adjusted_decay(0.99998, 8, 2, 2)
    assert (f"model EMA: decay {decay:.8g} every 2 steps (--model-ema-decay 0.99998 adjusted as torchvision's "
            "train.py does for batch 8, 2 steps, 2 epochs)") in output
    assert f"Epoch: [1] [{STEPS}/{STEPS}]" in output
    assert [count for *_, count in accuracy_lines(output)] == ["12", "12"]
    assert [count for *_, count in accuracy_lines(output, "EMA")] == ["12", "12"]
    assert re.search(r"^done: best acc@1 [\d.]+, final acc@1 [\d.]+ \(EMA: best [\d.]+, final [\d.]+\)", output,
                     re.MULTILINE)


@pytest.mark.parametrize("mode", MODES)
def test_checkpoints_hold_the_ema_which_loads_with_weights_only_into_a_plain_torchvision_model(recipe_runs, mode):
    output_of(recipe_runs, mode)
    for name in ("checkpoint.pth", "model_best.pth"):
        saved = load(recipe_runs.root / mode / name)
        plain = torchvision.models.resnet18(num_classes=3)
        plain.load_state_dict(saved["model_ema"])  # strict: no prefixes, no missing or extra keys
        with torch.no_grad():
            assert plain.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    saved = load(recipe_runs.root / mode / "checkpoint.pth")
    # An average, not a copy of the weights: after the warmup epoch, updates at global steps 6 (a copy), 8, 10.
    assert saved["model_ema_n_averaged"] == 3
    assert not torch.equal(saved["model_ema"]["fc.weight"], saved["state_dict"]["fc.weight"])
    # The recipe's groups: no weight decay on BatchNorm.
    assert [group["weight_decay"] for group in saved["optimizer"]["param_groups"]] == [2e-5, 0.0]
    assert saved["args"]["ra_sampler"] and saved["args"]["mixup_alpha"] == 0.2 and saved["args"]["cutmix_alpha"] == 1.0


@pytest.mark.parametrize("mode", MODES)
def test_summary_and_log_csv_report_the_weights_and_the_ema(recipe_runs, mode):
    output = output_of(recipe_runs, mode)
    summary = json.loads((recipe_runs.root / mode / "summary.json").read_text())
    plain = [float(acc1) for acc1, *_ in accuracy_lines(output)]
    ema = [float(acc1) for acc1, *_ in accuracy_lines(output, "EMA")]
    assert summary["best_acc1"] == pytest.approx(max(plain), abs=1e-3)
    assert summary["final_acc1"] == pytest.approx(plain[-1], abs=1e-3)
    assert summary["best_ema_acc1"] == pytest.approx(max(ema), abs=1e-3)
    assert summary["final_ema_acc1"] == pytest.approx(ema[-1], abs=1e-3)
    with open(recipe_runs.root / mode / "log.csv", newline="") as file:
        header, *rows = list(csv.reader(file))
    assert header == CSV_FIELDS + EMA_FIELDS
    assert [float(row[header.index("ema_val_acc1")]) for row in rows] == pytest.approx(ema, abs=1e-3)


def test_evaluate_on_a_checkpoint_with_an_ema_evaluates_both_as_the_training_run_did(recipe_runs):
    """-e in one process on DDP's checkpoint prints what DDP printed after its last epoch, for the weights
    and for the EMA: every rank evaluated the EMA that rank 0 saved (its BatchNorm statistics broadcast)."""
    trained, evaluated = output_of(recipe_runs, "ddp"), output_of(recipe_runs, "evaluate")
    assert "Epoch:" not in evaluated
    for label in ("", "EMA"):
        (line,) = accuracy_lines(evaluated, label)
        last = accuracy_lines(trained, label)[-1]
        assert line[0] == last[0] and line[1] == last[1] and line[3] == last[3], (label, line, last)
        assert float(line[2]) == pytest.approx(float(last[2]), rel=1e-5), (label, line, last)


def test_resuming_with_other_weight_decay_groups_is_one_line_and_exit_2(recipe_runs):
    returncode, output = recipe_runs.ended["other-groups"]
    assert returncode == 2, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {recipe_runs.root / 'dp' / 'checkpoint.pth'} holds an optimizer with other weight-decay "
                      "groups than this run's: resume it as it was started, with --norm-weight-decay 0.0 and no "
                      "--bias-weight-decay"], output[-3000:]
    assert "Traceback" not in output and not (recipe_runs.root / "other-groups").exists()


def test_compile_with_a_res_schedule_warns_in_one_line(recipe_runs):
    _, output = recipe_runs.ended["other-groups"]
    warnings = [line for line in output.splitlines() if "--res-schedule" in line]
    assert warnings == ["warning: --compile with --res-schedule: each new training size compiles another graph "
                        "(seconds to minutes each)"], output[-3000:]


def assert_resumed_where_it_stopped(output, saved):
    epoch, step = saved
    assert re.search(rf"resumed from .*checkpoint\.pth \(epoch {epoch}, step {step}\)", output), output[-3000:]
    trained = [(int(e), int(s)) for e, s in re.findall(r"^Epoch: \[(\d+)\] \[ *(\d+)/", output, re.MULTILINE)]
    assert trained and min(trained) == (epoch, step + 2), trained  # -p 2: the first line printed after it


def test_a_run_killed_mid_epoch_with_the_ema_and_the_ra_sampler_resumes_bitwise_equal(recipe_runs):
    assert recipe_runs.killed_at == (1, 2), recipe_runs.killed_output[-3000:]
    output = output_of(recipe_runs, "resumed")
    assert_resumed_where_it_stopped(output, recipe_runs.killed_at)
    resumed, uninterrupted = (load(recipe_runs.root / name / "checkpoint.pth") for name in ("resumed", "dp"))
    assert resumed["args"]["ra_sampler"] and resumed["args"]["ra_reps"] == 4 and resumed["args"]["model_ema"]
    for key in ("state_dict", "model_ema"):
        assert resumed[key].keys() == uninterrupted[key].keys()
        different = [name for name in resumed[key] if not torch.equal(resumed[key][name], uninterrupted[key][name])]
        assert not different, f"{key}: {len(different)} tensors differ, e.g. {different[:3]}"
    assert resumed["model_ema_n_averaged"] == uninterrupted["model_ema_n_averaged"]
    assert [line.split(",")[0] for line in (recipe_runs.root / "resumed" / "log.csv").read_text().splitlines()[1:]] == [
        "0", "1"]


# ----------------------------------------------------------------------------- per-step TensorBoard

def scalars(output_dir):
    """{tag: [(step, value)]} of the run's event files, read by TensorBoard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    accumulator = EventAccumulator(str(Path(output_dir) / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def printed_steps(output):
    """{global step: (loss, acc1, lr, img/s)} of the progress lines."""
    return {int(epoch) * int(total) + int(done): tuple(map(float, values))
            for epoch, done, total, *values in PROGRESS.findall(output)}


def test_per_step_tensorboard_scalars_are_the_progress_lines_values_every_p_steps(recipe_runs):
    logged, printed = scalars(recipe_runs.root / "dp"), printed_steps(output_of(recipe_runs, "dp"))
    assert sorted(printed) == [2, 4, 6, 8, 10, 12]
    # Half a unit of the last digit printed (and a little: 46.875 prints as 46.88).
    tolerances = {"loss": dict(abs=5.1e-5), "acc1": dict(abs=5.1e-3), "lr": dict(rel=5.1e-4),
                  "images_per_second": dict(abs=0.051)}
    for index, (key, tag) in enumerate(STEP_TAGS.items()):
        assert [step for step, _ in logged[tag]] == sorted(printed), tag
        for step, value in logged[tag]:
            assert value == pytest.approx(printed[step][index], **tolerances[key]), (tag, step)
    # The per-epoch scalars stay, the EMA's beside them.
    for tag in ("train_loss", "val_acc1", "val_acc5", "lr", "ema_val_acc1", "ema_val_loss"):
        assert [step for step, _ in logged[tag]] == [0, 1], tag


def test_a_resumed_run_shows_each_step_once_in_tensorboard(recipe_runs):
    """The killed run had logged step 10 (epoch 1 step 4) after its checkpoint at step 8; the resumed run
    logs it again, and TensorBoard hides the first (purge_step): one value per step, the uninterrupted run's."""
    assert "Epoch: [1] [4/6]" in recipe_runs.killed_output
    resumed, uninterrupted = scalars(recipe_runs.root / "resumed"), scalars(recipe_runs.root / "dp")
    for tag in ("step/train_loss", "step/train_acc1", "step/lr"):
        assert [step for step, _ in resumed[tag]] == [2, 4, 6, 8, 10, 12], tag
        assert [value for _, value in resumed[tag]] == pytest.approx([value for _, value in uninterrupted[tag]],
                                                                      rel=1e-6), tag
    assert [step for step, _ in resumed["val_acc1"]] == [0, 1]


# ----------------------------------------------------------------------------- what stays exact across the modes

# The recipe without mixing, on a BatchNorm-free model (whose step does not depend on how the batch is split):
# per-image augmentation, the RA sampler (2 copies: on the 2 ranks), the EMA, weight-decay groups.
EXACT = ["-a", "tests.tiny_models:TinyNet", *TINY, "-p", "2", "-b", "8", "--epochs", "2", "--lr", "0.05",
         "--seed", "5", "--auto-augment", "ta_wide", "--random-erase", "0.5", "--ra-sampler", "--ra-reps", "2",
         "--model-ema", "--model-ema-steps", "2", "--model-ema-decay", "0.999", "--bias-weight-decay", "0",
         "--label-smoothing", "0.1"]


@pytest.fixture(scope="module")
def exact_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("exact")
    data = make_image_folder(root / "data", train_per_class=8, val_per_class=4)
    commands = {"dp": [PYTHON, REPO / "train_dp.py", *EXACT, "--data", data, "--output-dir", root / "dp"],
                "ddp": torchrun_command("train_ddp.py", 2, *EXACT, "--data", data, "--output-dir", root / "ddp"),
                "ddp-mixed": torchrun_command("train_ddp.py", 2, *EXACT, "--mixup-alpha", "0.2", "--cutmix-alpha",
                                              "1.0", "--data", data, "--output-dir", root / "ddp-mixed")}
    results = dict(zip(commands, run_together(list(commands.values()))))
    for name, result in results.items():
        assert result.returncode == 0, f"{name}:\n{result.stdout[-4000:]}"
    return {name: load(root / name / "checkpoint.pth") for name in commands}


def largest_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[key].double() - b[key].double()).abs().max().item() for key in a)


def test_without_mixing_the_recipe_keeps_dataparallel_equal_to_ddp(exact_runs):
    """Per-image augmentation, the RA sampler, the EMA and the weight-decay groups keep DP = DDP (the same
    weights and the same EMA to float precision); the weights moved, so the equality says something."""
    dp, ddp = exact_runs["dp"], exact_runs["ddp"]
    torch.manual_seed(5)  # the runs' seed: their initial weights
    initial = TinyNet(num_classes=3).state_dict()
    assert largest_difference(initial, dp["state_dict"]) > 1e-2
    assert largest_difference(dp["model_ema"], dp["state_dict"]) > 1e-4  # the EMA is not the weights
    assert largest_difference(dp["state_dict"], ddp["state_dict"]) <= 1e-5
    assert largest_difference(dp["model_ema"], ddp["model_ema"]) <= 1e-5
    assert [group["weight_decay"] for group in dp["optimizer"]["param_groups"]] == [1e-4, 0.0]


def test_with_mixing_ddp_mixes_within_each_rank_and_so_differs_from_the_unmixed_run(exact_runs):
    """The one difference by design (docs/recipes.md): mixing pairs images of the batch a process holds.
    DDP with mixing trains, and ends elsewhere than without it (the mixing was on)."""
    assert largest_difference(exact_runs["ddp"]["state_dict"], exact_runs["ddp-mixed"]["state_dict"]) > 1e-3
    assert exact_runs["ddp-mixed"]["args"]["mixup_alpha"] == 0.2


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


@pytest.mark.parametrize("schedule, epochs, warmup, lr_min", [("cosine", 12, 3, 0.0), ("cosine", 10, 0, 0.0),
                                                               ("cosine", 12, 3, 0.02), ("step", 70, 5, 0.0),
                                                               ("step", 65, 0, 0.0)])
def test_lr_step_unit_epoch_follows_torchvision_s_schedulers_stepped_per_epoch(schedule, epochs, warmup, lr_min):
    """--lr-min is CosineAnnealingLR's eta_min (torchvision's --lr-min)."""
    args = SimpleNamespace(lr=0.5, momentum=0.9, weight_decay=1e-4, norm_weight_decay=None, bias_weight_decay=None,
                           lr_schedule=schedule, epochs=epochs, warmup_epochs=float(warmup), lr_step_size=30,
                           lr_gamma=0.1, lr_step_unit="epoch", lr_min=lr_min)
    optimizer = build_optimizer(nn.Linear(2, 2), args)
    scheduler = build_scheduler(optimizer, args, steps_per_epoch=3)
    ours = []
    for _ in range(epochs * 3):
        ours.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [lr for lr in torchvision_epoch_lrs(0.5, schedule, epochs, warmup, lr_min=lr_min) for _ in range(3)]
    assert ours == pytest.approx(expected, rel=1e-9, abs=1e-12)
    if schedule == "step" and warmup:  # the decays come 30 epochs after the warmup's end, as there
        assert ours[3 * 34] == pytest.approx(0.5) and ours[3 * 35] == pytest.approx(0.05)


def test_the_tv_v2_preset_steps_the_lr_per_epoch_and_a_fractional_warmup_is_refused(no_platform_env):
    import train_dp
    assert train_dp.parse_args(["--dummy", "--preset", "tv-v2"]).lr_step_unit == "epoch"
    assert train_dp.parse_args(["--dummy"]).lr_step_unit == "step"
    assert train_dp.parse_args(["--dummy", "--preset", "tv-v2", "--lr-step-unit", "step"]).lr_step_unit == "step"
    with pytest.raises(UsageError, match=r"^--warmup-epochs 0\.5 with --lr-step-unit epoch: give whole epochs$"):
        train_dp.parse_args(["--dummy", "--lr-step-unit", "epoch", "--warmup-epochs", "0.5"])


def test_dummy_with_the_recipe_says_its_images_skip_the_per_image_augmentation(tmp_path):
    """--dummy images are synthetic tensors: a throughput figure of --dummy --preset tv-v2 leaves out the cost of
    TrivialAugment and erasing, and the header says so."""
    result = run_script("train_dp.py", "--dummy", "--dummy-size", "16", "--preset", "tv-v2", *TINY, "-b", "8",
                        "--epochs", "1", "-a", "tests.tiny_models:TinyNet", "--output-dir", tmp_path / "out")
    assert result.returncode == 0, result.stdout[-3000:]
    assert ("note: --dummy images are synthetic tensors: --auto-augment and --random-erase are not applied, and "
            "images/s leaves out their cost (measure it with --data)") in result.stdout.splitlines()

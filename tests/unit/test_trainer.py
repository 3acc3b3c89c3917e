"""common/trainer.py: a Trainer made and built in-process from its parts, with no side effects; its hooks get what
they use as arguments; one step of the loop, in the order it runs (mixing, loss, clipping after unscaling, the
optimizer and scheduler steps, the sums, the progress line), for the smallest model of every torchvision family."""

import copy
import os
import re
import traceback

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from torch.utils._python_dispatch import TorchDispatchMode

from common.errors import NotFinite, UsageError
from common.trainer import Trainer, trainer_class
from conftest import FAMILIES, built_trainer, cpu_runtime, parse, tensor_datasets
from examples.sam import SAM
from harness.processes import REPO

SMALL = [
    "--train-crop-size",
    "16",
    "--val-resize-size",
    "16",
    "--val-crop-size",
    "16",
    "-j",
    "0",
    "-p",
    "1",
    "--epochs",
    "1",
    "-b",
    "4",
    "--seed",
    "1",
    "--lr-schedule",
    "constant",
    "--warmup-epochs",
    "0",
]
TINY_NET = ["-a", "tests.tiny_models:TinyNet"]

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables


def open_files():
    """The paths of this process's open files."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # (the listing's own descriptor, closed by now)
            pass
    return found


def test_a_trainer_is_made_and_built_without_a_lock_a_collective_or_a_file_written(tmp_path):
    """Building is not starting: no output directory, no lock, no process group; the parts all there."""
    before = open_files()
    config = parse(*SMALL, *TINY_NET, "--output-dir", tmp_path / "out")
    trainer = Trainer(config, cpu_runtime())
    assert not (tmp_path / "out").exists() and not hasattr(trainer, "model")
    trainer.build(tensor_datasets(), seed=3)
    assert not (tmp_path / "out").exists() and not (dist.is_available() and dist.is_initialized())
    assert not {path for path in open_files() - before if str(tmp_path) in path}
    assert trainer.classes == ["dark", "mid", "light"] and trainer.steps_per_epoch == 3 and trainer.seed == 3
    for part in ("model", "criterion", "optimizer", "scheduler", "scaler", "_train_batches", "_val_batches", "_rng"):
        assert getattr(trainer, part) is not None, part
    with pytest.raises(AttributeError, match="frozen"):
        trainer.config.lr = 1.0


class Recording(Trainer):
    """Records what each hook was given."""

    def build_model(self, classes):
        self.given = {"classes": list(classes)}
        return super().build_model(classes)

    def build_optimizer(self, model):
        self.given["model"] = model
        return super().build_optimizer(model)

    def build_scheduler(self, optimizer, steps_per_epoch):
        self.given.update(optimizer=optimizer, steps_per_epoch=steps_per_epoch)
        return super().build_scheduler(optimizer, steps_per_epoch)


def test_each_hook_gets_what_it_uses_as_arguments():
    trainer = built_trainer(*SMALL, *TINY_NET, trainer=Recording, datasets=tensor_datasets(train=10))
    assert trainer.given["classes"] == ["dark", "mid", "light"]
    assert trainer.given["model"] is trainer.model and trainer.given["optimizer"] is trainer.optimizer
    assert trainer.given["steps_per_epoch"] == 3  # 10 images, batch 4


class OwnGroups(Trainer):
    """An optimizer of the researcher's own that holds the criterion's parameters already."""

    def build_criterion(self):
        from examples.learned_temperature import TemperatureLoss

        return TemperatureLoss()

    def build_optimizer(self, model):
        return torch.optim.SGD(
            [{"params": model.parameters()}, {"params": self.criterion.parameters(), "lr": 0.5}], lr=0.1
        )


def test_a_criterion_s_parameters_are_trained_in_a_group_of_their_own_unless_build_optimizer_holds_them():
    from examples.learned_temperature import LearnedTemperature

    trainer = built_trainer(
        *SMALL,
        *TINY_NET,
        "--trainer",
        "examples.learned_temperature:LearnedTemperature",
        "--temperature-warmup",
        "0",
        "--wd",
        "0.01",
        trainer=LearnedTemperature,
    )
    temperature = trainer.criterion.log_temperature
    group = trainer.optimizer.param_groups[-1]
    assert group["params"] == [temperature] and group["weight_decay"] == 0.0 and group["lr"] == trainer.config.lr
    assert all(group["weight_decay"] == 0.01 for group in trainer.optimizer.param_groups[:-1])  # (--wd: the model's)
    trainer.train_one_epoch(trainer.model, epoch=0)
    assert temperature.item() != 0.0  # trained
    own = built_trainer(*SMALL, *TINY_NET, trainer=OwnGroups)
    assert [group["lr"] for group in own.optimizer.param_groups] == [0.1, 0.5]  # no group added


class WideHead(Trainer):
    """A model whose head has 1000 outputs, for data of 3 classes."""

    def build_model(self, classes):
        if self.config.arch == "resnet18":
            return torchvision.models.resnet18(num_classes=1000)
        from tests.tiny_models import TinyNet

        return TinyNet(num_classes=5)


def test_a_head_of_another_width_than_the_classes_is_refused_in_one_line():
    """A torchvision model at build (the meta device's forward); a model of your own at its first step (cross-entropy
    would take 1000 logits for 3 classes and train on, silently)."""
    with pytest.raises(
        UsageError,
        match=r"^the model \(build_model\) gives logits of shape \(2, 1000\); the data has 3 "
        r"classes: expected \(batch, 3\)",
    ):
        built_trainer(*SMALL, "-a", "resnet18", trainer=WideHead, datasets=tensor_datasets())
    trainer = built_trainer(*SMALL, *TINY_NET, trainer=WideHead, datasets=tensor_datasets())
    with pytest.raises(UsageError, match=r"^train_step gives logits of shape \(4, 5\); the data has 3 classes"):
        trainer.train_one_epoch(trainer.model, epoch=0)
    with pytest.raises(UsageError, match=r"^evaluate_step gives logits of shape \(4, 5\)"):
        trainer.evaluate(trainer.model)


def test_micro_batches_summed_into_one_step_train_as_the_whole_batch():
    """--grad-accum-steps 4 on 11 images, -b 8: a step of 4 micro-batches of 2, then one of 2 and one of 1, each
    loss weighted by its share: the weights, losses and accuracy of -b 8 in one piece, within float rounding."""
    flags = [*SMALL, *TINY_NET, "-b", "8", "--dropout", "0", "--lr", "0.2"]
    runs = {
        accumulate: built_trainer(*flags, "--grad-accum-steps", str(accumulate), datasets=tensor_datasets(train=11))
        for accumulate in (1, 4)
    }
    assert runs[1].steps_per_epoch == runs[4].steps_per_epoch == 2 and runs[4]._data.train_loader.batch_size == 2
    initial = {name: tensor.clone() for name, tensor in runs[1].model.state_dict().items()}
    results = {
        accumulate: [trainer.train_one_epoch(trainer.model, epoch) for epoch in range(3)]
        for accumulate, trainer in runs.items()
    }
    for whole, accumulated in zip(results[1], results[4]):
        assert accumulated["loss"] == pytest.approx(whole["loss"], rel=1e-6) and accumulated["acc1"] == whole["acc1"]
    weights = [trainer.model.state_dict() for trainer in runs.values()]
    assert all(torch.allclose(weights[0][name], weights[1][name], atol=1e-6) for name in weights[0])
    assert max((weights[0][name] - initial[name]).abs().max() for name in initial) > 1e-3  # (it trained)
    with pytest.raises(
        UsageError,
        match=r"^--grad-accum-steps 3 must divide each process's share of the global batch "
        r"\(-b 8 over 1 process\(es\): 8\)$",
    ):
        built_trainer(*flags, "--grad-accum-steps", "3", datasets=tensor_datasets(train=10))


def test_ddp_syncs_the_gradients_at_each_optimizer_step_s_last_micro_batch_alone(group_of_one):
    """--grad-accum-steps 3: DDP's all-reduce, counted by a communication hook, runs once per optimizer step (its
    no_sync() must hold the forward too: DDP decides there whether the backward syncs)."""
    from torch.nn.parallel import DistributedDataParallel

    trainer = built_trainer(*SMALL, *TINY_NET, "-b", "6", "--grad-accum-steps", "3", datasets=tensor_datasets(train=12))
    model, reduced = DistributedDataParallel(trainer.model), []

    def count(state, bucket):
        reduced.append(bucket.index())
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    model.register_comm_hook(None, count)
    trainer.train_one_epoch(model, epoch=0)
    buckets = max(reduced) + 1
    assert trainer.steps_per_epoch == 2 and len(reduced) == 2 * buckets, reduced  # not 6 x buckets


class BareStep(Trainer):
    """A train_step that calls the bare model, its gradients then skipping DDP's all-reduce; `no_grad` only for it."""

    no_grad = False

    def train_step(self, model, images, labels):
        if self.no_grad:
            with torch.no_grad():
                self.model(images)  # (a forward without gradients: nothing to all-reduce)
            return super().train_step(model, images, labels)
        return super().train_step(self.model, images, labels)


def test_train_step_that_calls_the_bare_model_inside_ddp_is_refused_in_one_line(group_of_one):
    from torch.nn.parallel import DistributedDataParallel

    trainer = built_trainer(*SMALL, *TINY_NET, trainer=BareStep, datasets=tensor_datasets())
    with pytest.raises(
        UsageError,
        match=r"^train_step called the bare model \(self.model\), not the "
        r"DistributedDataParallel `model` it is given: its gradients would skip the "
        r"all-reduce over the ranks; call `model`$",
    ):
        trainer.train_one_epoch(DistributedDataParallel(trainer.model), 0)
    trainer = built_trainer(*SMALL, *TINY_NET, trainer=BareStep, datasets=tensor_datasets())
    trainer.no_grad = True
    assert trainer.train_one_epoch(DistributedDataParallel(trainer.model), 0)["count"] == 12
    with torch.no_grad():  # outside train_step: evaluation, the EMA, a researcher's own code
        trainer.model(torch.zeros(1, 3, 16, 16))
    trainer = built_trainer(*SMALL, *TINY_NET, trainer=BareStep, datasets=tensor_datasets())
    trainer.train_one_epoch(trainer.model, 0)  # one process without DDP: the bare model is the model


class Teacher(Trainer):
    """A teacher copied from the model in train_step, frozen by requires_grad_(False): not the bare model."""

    def train_step(self, model, images, labels):
        if not hasattr(self, "teacher"):
            self.teacher = copy.deepcopy(self.model).requires_grad_(False)
        self.teacher(images)
        return super().train_step(model, images, labels)


def test_a_copy_of_the_model_made_in_train_step_is_no_bare_model(group_of_one):
    from torch.nn.parallel import DistributedDataParallel

    trainer = built_trainer(*SMALL, *TINY_NET, trainer=Teacher, datasets=tensor_datasets())
    assert trainer.train_one_epoch(DistributedDataParallel(trainer.model), 0)["count"] == 12


def test_a_trainer_that_is_no_trainer_is_refused_in_one_line():
    with pytest.raises(
        UsageError, match=r"^--trainer tests.tiny_models:TinyNet is not a subclass of common.trainer.Trainer$"
    ):
        trainer_class("tests.tiny_models:TinyNet")
    assert (
        trainer_class(None) is Trainer
        and trainer_class("examples.extra_metric:WithConfidence").__name__ == "WithConfidence"
    )


def test_a_train_step_that_returns_the_wrong_thing_is_refused_in_one_line():
    trainer = built_trainer(
        *SMALL, *TINY_NET, trainer=trainer_class("tests.tiny_models:ReturnsLogitsOnly"), datasets=tensor_datasets()
    )
    with pytest.raises(
        UsageError,
        match=r"^train_step returned Tensor: return \(loss, logits\) or \(loss, logits, "
        r"\{name: scalar value\}\)$",
    ):
        trainer.train_one_epoch(trainer.model, 0)


class ReturnsWhatItShouldNot(Trainer):
    """A train_step or batch transform that returns what the loop cannot use: RETURNS says which."""

    RETURNS = None

    def train_step(self, model, images, labels):
        loss, logits = super().train_step(model, images, labels)
        if self.RETURNS == "detached":
            return loss.detach(), logits
        if self.RETURNS == "text":
            return loss, logits, {"confidence": "high"}
        return loss, logits, {"of_numpy": np.array(0.5), "numpy_scalar": np.float32(0.25)}  # (numbers: taken)

    def build_batch_transform(self, classes):
        return (lambda images, labels, key: images) if self.RETURNS == "images" else None


@pytest.mark.parametrize(
    "returns, line",
    [
        ("detached", "train_step's loss does not require grad (detached, or computed under torch.no_grad)"),
        ("text", "logged value 'confidence' is a str: log a number or a scalar tensor"),
        ("images", "build_batch_transform's transform returned a Tensor: return (images, labels), two tensors"),
    ],
)
def test_a_train_step_or_batch_transform_that_returns_what_the_loop_cannot_use_is_one_line(returns, line):
    """(were tracebacks: backward's "element 0 of tensors does not require grad", float()'s "could not convert string",
    and "too many values to unpack")"""
    ReturnsWhatItShouldNot.RETURNS = returns
    trainer = built_trainer(*SMALL, *TINY_NET, trainer=ReturnsWhatItShouldNot, datasets=tensor_datasets())
    with pytest.raises(UsageError, match="^" + re.escape(line)):
        trainer.train_one_epoch(trainer.model, 0)
    ReturnsWhatItShouldNot.RETURNS = None
    trainer = built_trainer(*SMALL, *TINY_NET, trainer=ReturnsWhatItShouldNot, datasets=tensor_datasets())
    trainer.train_one_epoch(trainer.model, 0)


class OneHot(nn.Module):
    """Names each image's class with certainty: the images of tensor_datasets are a grey level per class."""

    def __init__(self, num_classes):
        super().__init__()
        self.unused, self.num_classes = nn.Parameter(torch.zeros(1)), num_classes

    def forward(self, images):
        level = images.mean(dim=(1, 2, 3))  # normalised: dark < mid < light
        label = torch.bucketize(level, torch.tensor([-1.0, 0.3], device=images.device))
        return 10 * F.one_hot(label, self.num_classes).float() + 0 * self.unused


class WithMix(Trainer):
    """A batch transform of its own: every image given the next class's label, the keys it is called with kept."""

    def build_model(self, classes):
        return OneHot(len(classes))

    def build_batch_transform(self, classes):
        self.keys = []

        def mix(images, target, key):
            self.keys.append(key)
            return images, F.one_hot((target + 1) % len(classes), len(classes)).float()

        return mix


def test_the_loss_is_taken_on_the_mixed_targets_and_the_accuracy_on_each_image_s_own_label():
    """A model that always names the right class, and a mix that gives every image the next class's label: the loss
    is that of the soft targets (label smoothing applied), acc@1 100% against each image's own label; the mix
    (build_batch_transform's) is called at the epoch's steps, with the key of (seed, epoch, step, rank)."""
    trainer = built_trainer(*SMALL, "--label-smoothing", "0.1", trainer=WithMix, datasets=tensor_datasets())
    classes = 3
    summary = trainer.train_one_epoch(trainer.model, epoch=0)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    target = torch.arange(4) % classes
    expected = criterion(10 * F.one_hot(target, classes).float(), F.one_hot((target + 1) % classes, classes).float())
    assert summary["acc1"] == 100.0 and summary["count"] == 12
    assert summary["loss"] == pytest.approx(expected.item(), rel=1e-5) and summary["loss"] > 5  # not the own labels'
    from common.augment import batch_mix_key

    assert trainer.seed == 1 and trainer.keys == [batch_mix_key(1, 0, step, 0) for step in range(3)]
    from common.header import start_lines

    assert "batch transform: WithMix.build_batch_transform (build_batch_transform), seeded per batch" in start_lines(
        trainer
    )


def test_clipping_clips_the_unscaled_gradients_under_fp16():
    """Under --amp fp16 the gradients are those of the loss times the scale (2**16 at first): clipping them before
    unscaling would clip to a norm 65536 times too small. The loop unscales first."""

    def step_taken(scaled):
        trainer = built_trainer(
            *SMALL,
            *TINY_NET,
            "--clip-grad-norm",
            "0.5",
            "--lr",
            "1",
            "--momentum",
            "0",
            "--wd",
            "0",
            datasets=tensor_datasets(train=4),
        )
        trainer.scaler = torch.amp.GradScaler("cpu", enabled=scaled)
        before = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        trainer.train_one_epoch(trainer.model, epoch=0)
        return torch.cat([p.detach().flatten() for p in trainer.model.parameters()]) - before

    unscaled, scaled = step_taken(False), step_taken(True)
    assert unscaled.norm().item() == pytest.approx(0.5, rel=1e-4)  # clipped to 0.5, lr 1
    assert torch.allclose(scaled, unscaled, rtol=1e-4, atol=1e-6)


def test_the_families_cover_every_classification_model_torchvision_lists():
    names = torchvision.models.list_models(module=torchvision.models)
    assert [name for name in names if not name.startswith(tuple(FAMILIES))] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_the_smallest_model_of_each_family_trains_one_step_at_a_size_it_takes(family):
    """Built by the Trainer (the size check included), one step of its loop (auxiliary heads included: GoogLeNet's
    and Inception's named tuples), on 2 images."""
    arch, size = FAMILIES[family]
    size_flags = ["--train-crop-size", size, "--val-resize-size", size, "--val-crop-size", size]
    trainer = built_trainer(
        *SMALL,
        *size_flags,
        "-a",
        arch,
        "-b",
        "2",
        "--clip-grad-norm",
        "1",
        datasets=tensor_datasets(size=size, train=2, val=1),
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    summary = trainer.train_one_epoch(trainer.model, epoch=0)
    assert summary["count"] == 2 and torch.isfinite(torch.tensor(summary["loss"]))
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def one_colour_images(count=24):
    """(classes, train, val): image i filled with the grey 5 + 10 i, whatever the crop, flip and resize."""
    from tests.custom_datasets import Items

    make = lambda index: (torch.full((3, 12, 12), 5 + 10 * index, dtype=torch.uint8), index % 3)  # noqa: E731
    return ["a", "b", "c"], Items(count, make), Items(3, make)


class RecordsOrder(Trainer):
    """Records, for each step, which images it trained on."""

    def train_step(self, model, images, labels):
        grey = images[:, 0].mean(dim=(1, 2)) * 0.229 * 255 + 0.485 * 255  # back from the normalised red channel
        self.order = getattr(self, "order", []) + [[round((value - 5) / 10) for value in grey.tolist()]]
        return super().train_step(model, images, labels)


def test_each_epoch_trains_in_a_new_order_of_every_image_and_a_resumed_epoch_goes_on_in_it():
    """sampler.set_epoch(epoch) in the loop: every epoch a new shuffle of all the images; an epoch resumed at step 2
    trains the steps the uninterrupted one trained there."""
    trainer = built_trainer(*SMALL, *TINY_NET, "-b", "8", trainer=RecordsOrder, datasets=one_colour_images())
    for epoch in range(3):
        trainer.train_one_epoch(trainer.model, epoch)
    epochs = [sum(trainer.order[start : start + 3], []) for start in (0, 3, 6)]
    assert all(sorted(epoch) == list(range(24)) for epoch in epochs)
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    resumed = built_trainer(*SMALL, *TINY_NET, "-b", "8", trainer=RecordsOrder, datasets=one_colour_images())
    resumed.train_one_epoch(resumed.model, 1, first_step=2)
    assert resumed.order == trainer.order[5:6]


def weights_after(*flags):
    trainer = built_trainer(*SMALL, *TINY_NET, "--epochs", "2", *flags, datasets=tensor_datasets())
    losses = [trainer.train_one_epoch(trainer.model, epoch)["loss"] for epoch in range(2)]
    return [p.detach().float() for p in trainer.model.parameters()], losses, trainer


def test_channels_last_and_bf16_change_the_kernels_and_the_rounding_not_the_training():
    """NHWC (on by default for a CNN on the CPU) trains as NCHW to float rounding; --amp bf16 computes in bfloat16
    (autocast was on: the losses differ) and trains the same model."""
    nhwc, nhwc_losses, trainer = weights_after()
    conv = next(trainer.model.parameters())  # the first conv's weight
    assert trainer._channels_last and conv.ndim == 4 and conv.is_contiguous(memory_format=torch.channels_last)
    nchw, nchw_losses, plain = weights_after("--channels-last", "off")
    assert not plain._channels_last and not next(plain.model.parameters()).is_contiguous(
        memory_format=torch.channels_last
    )
    assert max((a - b).abs().max().item() for a, b in zip(nhwc, nchw)) < 1e-4
    assert nhwc_losses == pytest.approx(nchw_losses, abs=1e-5)
    _, bf16_losses, _ = weights_after("--amp", "bf16")
    assert bf16_losses != nhwc_losses and bf16_losses == pytest.approx(nhwc_losses, abs=0.02)


def test_a_torchvision_model_s_patch_embedding_is_built_as_a_matrix_product():
    """The Trainer's model: ConvNeXt's stem a PatchConv2d (common/models.py), its state dict torchvision's."""
    from common.models import PatchConv2d

    sizes = ["--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32"]
    trainer = built_trainer(*SMALL, *sizes, "-a", "convnext_tiny", datasets=tensor_datasets(size=32))
    assert type(trainer.model.features[0][0]) is PatchConv2d
    assert trainer.model.state_dict().keys() == torchvision.models.convnext_tiny(num_classes=3).state_dict().keys()


class OwnResNet(Trainer):
    """build_model: a torchvision resnet18 of its own, for `built_for`-channel images (None: the library's)."""

    built_for = 3

    def build_model(self, classes):
        if self.built_for is None:
            return super().build_model(classes)
        model = torchvision.models.resnet18(num_classes=len(classes))
        model.conv1 = nn.Conv2d(self.built_for, 64, 7, 2, 3, bias=False)
        return model


def test_only_a_model_the_library_built_gets_its_first_convolution_adapted_to_the_data():
    """1-channel data: a subclass's own resnet18 is left as it is, refused in one line if built for RGB, taken as it
    is if built for one channel; the library's (super().build_model) adapted, and the header's change says so."""
    flags = [*SMALL, "-a", "resnet18", "--mean", "0.5", "--std", "0.25"]
    grey = tensor_datasets(channels=1)
    OwnResNet.built_for = 3
    with pytest.raises(
        UsageError,
        match=r"^the model \(build_model\) takes 3-channel images \(its first convolution, "
        r"conv1\) and the data's are 1-channel: build it for them$",
    ):
        built_trainer(*flags, trainer=OwnResNet, datasets=grey)
    # A model of yours (-a PKG.MOD:FN): refused alike, on a copy on the meta device (was: a traceback at the first
    # step); one that takes the data as it is (grey repeated in three channels) trains.
    with pytest.raises(
        UsageError, match=r"^the model \(build_model\) takes 3-channel images \(its first convolution, 0\)"
    ):
        built_trainer(*SMALL, "-a", "tests.tiny_models:TinyNet", "--mean", "0.5", "--std", "0.25", datasets=grey)
    built_trainer(*SMALL, "-a", "tests.tiny_models:GreyAsRgbNet", "--mean", "0.5", "--std", "0.25", datasets=grey)
    OwnResNet.built_for = 1
    torch.manual_seed(0)
    own = built_trainer(*flags, trainer=OwnResNet, datasets=grey)
    assert own._model_changes == [] and own.model.conv1.in_channels == 1
    OwnResNet.built_for = None
    library = built_trainer(*flags, trainer=OwnResNet, datasets=grey)
    assert library._model_changes == ["conv1: 3 -> 1 channels, the fresh filters' first channel"]


# A researcher's hook that returns what the Trainer cannot use: one line naming the hook (each was a traceback, later).
WRONG_RETURNS = {
    "build_model": (lambda self, classes: None, "build_model(classes) returned NoneType 'None': expected an nn.Module"),
    "build_criterion": (
        lambda self: F.cross_entropy,
        "build_criterion() returned function '<function cross_entropy at",
    ),
    "build_optimizer": (
        lambda self, model: None,
        "build_optimizer(model) returned NoneType 'None': expected an optimizer",
    ),
    "build_scheduler": (
        lambda self, optimizer, steps: None,
        "build_scheduler(optimizer, steps_per_epoch) returned NoneType 'None': expected an lr scheduler",
    ),
    "build_metrics": (
        lambda self, split, classes: [],
        "build_metrics('train', classes) returned list '[]': expected a dict",
    ),
    "build_batch_transform": (
        lambda self, classes: 3,
        "build_batch_transform(classes) returned int '3': expected a callable",
    ),
    "build_transforms": (lambda self, train, val: train, "build_transforms(train, val) returned TrainPreset"),
}


@pytest.mark.parametrize("hook", WRONG_RETURNS)
def test_a_hook_that_returns_what_the_trainer_cannot_use_is_one_line_naming_it(hook):
    method, line = WRONG_RETURNS[hook]
    wrong = type("Wrong", (Trainer,), {hook: method})
    with pytest.raises(UsageError) as refused:
        built_trainer(*SMALL, trainer=wrong, datasets=tensor_datasets())
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value), str(refused.value)


def test_a_loss_per_image_or_a_scheduler_that_needs_a_metric_is_one_line_and_a_loss_of_one_value_is_taken():
    """A criterion of reduction='none' (was a traceback from backward), a loss of shape [1] (a traceback from the
    metric sums), ReduceLROnPlateau from build_scheduler (a traceback at its first step)."""
    per_image = type("PerImage", (Trainer,), {"build_criterion": lambda self: nn.CrossEntropyLoss(reduction="none")})
    trainer = built_trainer(*SMALL, *TINY_NET, trainer=per_image, datasets=tensor_datasets())
    with pytest.raises(UsageError, match=r"^train_step's loss has shape \[4\]: return the batch's mean, a scalar"):
        trainer.train_one_epoch(trainer.model, 0)
    one_value = type(
        "OneValue",
        (Trainer,),
        {
            "train_step": lambda self, model, images, labels: (
                lambda logits: (nn.functional.cross_entropy(logits, labels).reshape(1), logits)
            )(model(images))
        },
    )
    trainer = built_trainer(*SMALL, *TINY_NET, trainer=one_value, datasets=tensor_datasets())
    assert trainer.train_one_epoch(trainer.model, 0)["count"] == 12
    plateau = type(
        "Plateau",
        (Trainer,),
        {"build_scheduler": lambda self, optimizer, steps: torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)},
    )
    with pytest.raises(UsageError, match=r"^build_scheduler returned ReduceLROnPlateau, whose step\(\) needs an"):
        built_trainer(*SMALL, *TINY_NET, trainer=plateau, datasets=tensor_datasets())


def test_an_optimizer_of_none_of_the_model_s_parameters_is_one_line():
    """SGD([a parameter of its own]): trained nothing, exit 0."""
    elsewhere = type(
        "Elsewhere",
        (Trainer,),
        {"build_optimizer": lambda self, model: torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)},
    )
    with pytest.raises(UsageError, match=r"^the optimizer \(build_optimizer\) holds none of the model's parameters"):
        built_trainer(*SMALL, *TINY_NET, trainer=elsewhere, datasets=tensor_datasets())


def test_a_model_with_nothing_to_train_is_one_line():
    from tests.tiny_models import TinyNet

    frozen = type(
        "Frozen", (Trainer,), {"build_model": lambda self, classes: TinyNet(len(classes)).requires_grad_(False)}
    )
    with pytest.raises(UsageError, match=r"^the model \(build_model\) has no parameter to train"):
        built_trainer(*SMALL, *TINY_NET, trainer=frozen, datasets=tensor_datasets())


def test_the_distillation_and_csv_examples_say_their_mistakes_in_one_line_and_take_an_auxiliary_student(tmp_path):
    """Were: a teacher of another arch told to change --arch (the student's); -e needed a --teacher it never used;
    a student with auxiliary heads a TypeError (its output taken for logits); csv_dataset without --data, its
    annotations.csv or one of its columns a traceback."""
    from common.datasets import build_datasets
    from tests.tiny_models import TinyNet
    from unit.test_checkpoint import SMALL, started

    torch.save({"state_dict": TinyNet(3).state_dict(), "arch": "tests.tiny_models:TinyNet"}, tmp_path / "teacher.pth")
    distillation = trainer_class("examples.distillation:Distillation")
    argv = [*SMALL, "--trainer", "examples.distillation:Distillation", "--teacher", tmp_path / "teacher.pth"]
    with pytest.raises(UsageError, match=r"holds a tests\.tiny_models:TinyNet model: give --teacher-arch tests\.tiny"):
        started(*argv, "-a", "tests.tiny_models:TinyNet", "--output-dir", tmp_path / "a", trainer=distillation)
    argv += ["--teacher-arch", "tests.tiny_models:TinyNet"]
    run = started(
        *argv, "-a", "examples.aux_model:build", "--epochs", "1", "--output-dir", tmp_path / "b", trainer=distillation
    )
    run.fit(run.model, run.model)
    evaluating = started(
        *SMALL,
        "--trainer",
        "examples.distillation:Distillation",
        "-a",
        "examples.aux_model:build",
        "-e",
        "--resume",
        tmp_path / "b" / "checkpoint.pth",
        trainer=distillation,
    )
    assert evaluating.teacher is None
    for name, text in [
        ("columns", "file,split,label\na.jpg,train,cat\n"),
        ("short", "file,split,species\na.jpg,train,cat\n\nb.jpg,val\n"),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "annotations.csv").write_text(text)  # (were a KeyError, a TypeError)
    (tmp_path / "excel").mkdir()
    (tmp_path / "excel" / "annotations.csv").write_bytes(b"\xef\xbb\xbffile,split,species\na.jpg,train,cat\n")
    assert build_datasets(parse("--dataset", "examples.csv_dataset:build", "--data", tmp_path / "excel"))[0] == ["cat"]
    (tmp_path / "excel" / "annotations.csv").write_bytes(b"file,split,species\na.jpg,train,caf\xe9\n")  # (cp1252)
    for data, says in (
        (None, "give --data DIR"),
        (tmp_path, "cannot read \\S+annotations.csv \\(No such file"),
        (tmp_path / "columns", "annotations.csv has no column species: its header is file,split,species$"),
        (tmp_path / "short", "annotations.csv line 4: expected file,split,species$"),  # (after a blank line)
        (tmp_path / "excel", "annotations.csv is not UTF-8: save it as CSV UTF-8$"),
    ):
        config = parse("--dataset", "examples.csv_dataset:build", *(["--data", data] if data else []))
        with pytest.raises(UsageError, match=says):
            build_datasets(config)


def test_weights_gone_nan_stop_training_at_the_first_progress_line_or_save_that_sees_them(monkeypatch, tmp_path):
    """DivergingNet's second step makes the weights NaN: the progress line after it (-p 1), whose loss is NaN, stops
    the run; without one there, the save of --checkpoint-interval 2 does, and writes nothing."""
    monkeypatch.setenv("DIVERGE_AFTER", "1")
    arch, out = ["-a", "tests.tiny_models:DivergingNet"], ["--output-dir", tmp_path / "out"]
    for flags in ([], ["-p", "100", "--checkpoint-interval", "2"]):
        trainer = built_trainer(*SMALL, *arch, *out, *flags, datasets=tensor_datasets())
        with pytest.raises(NotFinite, match=r"^at epoch 0 step 2 0\.0\.weight \(and \d+ more\) is NaN or infinite"):
            trainer.train_one_epoch(trainer.model, 0)
        assert not (tmp_path / "out").exists()


class ReadBacks(TorchDispatchMode):
    """Counts what this repository's code does in torch that, on a GPU, waits for the device: a read of a tensor's
    value into Python (.item(), float(t), bool(t), .tolist()), a tensor made of Python data (torch.tensor(x,
    device=...) copies it from the host), a boolean mask's indexing or nonzero (their sizes read back). Torch's and
    torchvision's own are theirs (on a GPU, most are of CPU tensors: MixUp's draws, the optimizers' step counts; fp16's
    scaler and the EMA's count wait, docs/concepts.md says so)."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func is torch.ops.aten.index.Tensor and any(
            index is not None and index.dtype == torch.bool for index in args[1]
        )
        if masked or func in WAITS:
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(TORCH_PLUMBING)]
            self.count += frames[-1].filename.startswith(str(REPO / "common"))  # (the frame that calls it)
        return func(*args, **(kwargs or {}))


WAITS = {getattr(torch.ops.aten, name).default for name in ("_local_scalar_dense", "lift_fresh", "nonzero")}
# Between a Tensor method that reads and its caller: this mode's dispatch (run with torch.compile off), Tensor's own
# Python methods (__format__)
TORCH_PLUMBING = tuple(
    os.path.join(os.path.dirname(torch.__file__), name)
    for name in ("utils/_python_dispatch.py", "_compile.py", "_dynamo/eval_frame.py", "_tensor.py")
)


class LogsANumber(SAM):
    """SAM (its closure: the step's loss averaged over the ranks), logging a Python number."""

    def train_step(self, model, images, labels):
        loss, logits = super().train_step(model, images, labels)
        return loss, logits, {"half": 0.5}


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--model-ema", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--clip-grad-norm", "1"],
        ["--grad-accum-steps", "2", "--label-smoothing", "0.1", "--opt", "adamw", "--lr-schedule", "cosine"],
        ["--trainer", "examples.sam:SAM"],
    ],
)
def test_a_training_step_waits_for_nothing_on_the_device(flags, group_of_one):
    """No per-step host sync: what our code does that would wait for a GPU (ReadBacks) in an epoch of 6 steps is what
    it does in an epoch of 3 (its progress line, its summary), the batches made before it (the loader's transforms read
    their CPU draws). In a process group, whose collectives the closure's loss goes through."""
    counted = []
    for images in (12, 24):
        trainer = LogsANumber if "--trainer" in flags else None
        trainer = built_trainer(
            *SMALL, *TINY_NET, "-p", "100", *flags, trainer=trainer, datasets=tensor_datasets(train=images)
        )
        trainer._train_batches = list(trainer._train_batches)  # (the epoch's batches, made outside the count)
        with ReadBacks() as waits:
            trainer.train_one_epoch(trainer.model, 0)
        counted.append(waits.count)
    assert counted[0] == counted[1] and counted[0] > 0, counted

"""Small models for the tests, given to the scripts as `--arch tests.tiny_models:TinyNet`."""

import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from common.trainer import Trainer
from common.transforms import IMAGENET_MEAN, IMAGENET_STD
from examples.experiment import Experiment


def TinyNet(num_classes, dropout=0.0):
    """Three conv blocks, no BatchNorm: its training step does not depend on how the batch is split
    over processes, so DataParallel, DDP and spawn must agree to float precision. Learns the demo
    shapes in a few steps (unlike squeezenet1_1, whose last ReLU dies on data this small)."""

    def block(inputs, outputs):
        return [nn.Conv2d(inputs, outputs, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)]

    return nn.Sequential(
        *block(3, 16),
        *block(16, 32),
        *block(32, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(64, num_classes),
    )


class Diverges(nn.Module):
    """Its input times infinity from its training forward number DIVERGE_AFTER + 1 on: a loss that diverges."""

    def __init__(self):
        super().__init__()
        self.after, self.calls = int(os.environ.get("DIVERGE_AFTER", "0")), 0

    def forward(self, logits):
        self.calls += self.training
        return logits * math.inf if self.training and self.calls > self.after else logits


def DivergingNet(num_classes, dropout=0.0):
    """TinyNet whose loss diverges after DIVERGE_AFTER training steps (Diverges): its weights become NaN."""
    return nn.Sequential(TinyNet(num_classes, dropout), Diverges())


def RegroupNet(num_classes, dropout=0.0):
    """Its parameter groups under --norm-weight-decay 0 and under --bias-weight-decay 0 hold as many parameters
    (4 and 2), not the same ones: a resume that regroups them passes torch's check of the groups' lengths."""
    layers = [nn.Conv2d(3, 8, 3, bias=False), nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes, bias=False))


class AsRgb(nn.Module):
    def forward(self, images):
        return images.expand(-1, 3, -1, -1)


def GreyAsRgbNet(num_classes, dropout=0.0):
    """TinyNet for 1-channel images, which it repeats in three channels (its first convolution takes 3)."""
    return nn.Sequential(AsRgb(), TinyNet(num_classes, dropout))


class Block(nn.Module):
    def __init__(self, inputs, outputs):
        super().__init__()
        self.conv, self.relu, self.pool = (
            nn.Conv2d(inputs, outputs, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )

    def forward(self, images):
        return self.pool(self.relu(self.conv(images)))


def BlockNet(num_classes, dropout=0.0):
    """TinyNet with its three conv blocks as modules of a class of their own in its nn.Sequential: train_fsdp.py
    shards it block by block (common/fsdp.py's rule), then the root (the head). No BatchNorm, as TinyNet."""
    return nn.Sequential(
        Block(3, 16),
        Block(16, 32),
        Block(32, 64),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(64, num_classes),
    )


class NormBlock(Block):
    """Block with BatchNorm after its convolution."""

    def __init__(self, inputs, outputs):
        super().__init__(inputs, outputs)
        self.norm = nn.BatchNorm2d(outputs)

    def forward(self, images):
        return self.pool(self.relu(self.norm(self.conv(images))))


def NormBlockNet(num_classes, dropout=0.0):
    """BlockNet's units with BatchNorm: what --activation-checkpointing recomputes updates running statistics."""
    return nn.Sequential(
        NormBlock(3, 8), NormBlock(8, 8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes)
    )


def _pauses(model):
    """`model`, which sleeps for good at its Nth training forward in each process where PAUSE_AT_TRAINING_FORWARD=N
    is set: a test that kills a job at a progress line kills it there, however late the line is read (a fast
    run would otherwise end its epoch first). A hook, so the weights' names stay the model's."""
    at, calls = int(os.environ.get("PAUSE_AT_TRAINING_FORWARD", 0)), [0]

    def pause(module, inputs):
        calls[0] += module.training
        if at and calls[0] == at:
            time.sleep(3600)

    model.register_forward_pre_hook(pause)
    return model


def TinyNetThatPauses(num_classes, dropout=0.0):
    return _pauses(TinyNet(num_classes, dropout))


class ExperimentThatPauses(Experiment):
    """examples/experiment.py's Trainer, its model pausing as TinyNetThatPauses does."""

    def build_model(self, classes):
        return _pauses(super().build_model(classes))


def AuxNetThatPauses(num_classes, dropout=0.0):
    from examples.aux_model import build

    return _pauses(build(num_classes, dropout))


class _FailsAtStep(nn.Module):
    def __init__(self, model, step):
        super().__init__()
        self.model, self.step, self.calls = model, step, 0

    def forward(self, images):
        self.calls += self.training
        last_rank = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
        if self.calls == self.step and last_rank:
            raise RuntimeError(f"FailingNet: the failure this test model makes at training step {self.step}")
        return self.model(images)


def FailingNet(num_classes, dropout=0.0):
    """TinyNet that raises in its third training forward, in the last rank only (the others wait
    for it in a collective): an error of a training process itself, while its loader workers run."""
    return _FailsAtStep(TinyNet(num_classes, dropout), step=3)


_devices_reported = set()  # one line per device: DataParallel builds new replicas at every step


class _ReportsReplicas(nn.Module):
    def __init__(self, num_classes, dropout):
        super().__init__()
        self.net = TinyNet(num_classes, dropout)

    def forward(self, images):
        if self.training and images.device not in _devices_reported:
            _devices_reported.add(images.device)
            print(f"replica on {images.device}: {images.shape[0]} images", flush=True)
        return self.net(images)


def ReplicaReportNet(num_classes, dropout=0.0):
    """TinyNet that prints, once per device, where a training forward ran and on how many images:
    under nn.DataParallel over N GPUs, one line per GPU with its share of the batch."""
    return _ReportsReplicas(num_classes, dropout)


class _RecordsOrder(nn.Module):
    def __init__(self, num_classes, dropout):
        super().__init__()
        self.net = TinyNet(num_classes, dropout)
        self.log = f"{os.environ['ORDER_LOG']}.rank{os.environ.get('RANK', '0')}"

    def forward(self, images):
        if self.training:
            # Back from the normalised red channel to the pixel value each image is filled with.
            pixels = images[:, 0].mean(dim=(1, 2)) * IMAGENET_STD[0] * 255 + IMAGENET_MEAN[0] * 255
            with open(self.log, "a") as file:
                file.write(" ".join(f"{pixel:.0f}" for pixel in pixels.tolist()) + "\n")
        return self.net(images)


def OrderRecorder(num_classes, dropout=0.0):
    """TinyNet that appends, for each training step, the pixel values of its images to $ORDER_LOG.rank$RANK,
    one line per step: on a set of one-colour images (one value each) it records the order this rank trains
    in."""
    return _RecordsOrder(num_classes, dropout)


class _LeavesOneOut(nn.Module):
    def __init__(self, num_classes, dropout):
        super().__init__()
        self.net = TinyNet(num_classes, dropout)
        self.unused = nn.Linear(4, num_classes)  # never called: DDP waits for its gradient

    def forward(self, images):
        return self.net(images)


def UnusedNet(num_classes, dropout=0.0):
    """TinyNet beside a layer its forward never uses: DDP needs --find-unused-parameters for it."""
    return _LeavesOneOut(num_classes, dropout)


def _returns_logits_only():
    from common.trainer import Trainer

    class ReturnsLogitsOnly(Trainer):
        """A train_step that forgot the loss."""

        def train_step(self, model, images, labels):
            return model(images)

    return ReturnsLogitsOnly


ReturnsLogitsOnly = _returns_logits_only()


class SlowStop(Trainer):
    """A trainer whose checkpoint on a stop takes SLOW_STOP_SECONDS (40) longer: a large model's save on a slow
    network file system, longer than torchrun's default 30 s of grace. Its third training step takes 8 s longer on
    rank 0, so that a signal sent at the progress line of step 2 lands in epoch 0 on a busy test machine too (once,
    the tiny steps ran into epoch 1 before the signal came)."""

    def train_step(self, model, images, labels):
        self.steps_done = getattr(self, "steps_done", 0) + 1
        if self.steps_done == 3 and self.runtime.is_main:
            time.sleep(8)
        return super().train_step(model, images, labels)

    def save(self, epoch, step_in_epoch=0, metrics=None, is_best=False):
        if self._stop_signal.received:
            time.sleep(float(os.environ.get("SLOW_STOP_SECONDS", 40)))
        return super().save(epoch, step_in_epoch, metrics, is_best)


class SlowFourthStep(Trainer):
    """A trainer whose fourth training step (SLOW_STEP) takes 8 s longer on rank 0, in a fresh run (not in its resumed
    one): a SIGKILL sent at the progress line of step 3 lands in that step on a busy test machine too (once, side by
    side with six other jobs, the tiny steps ran on to epoch 2 before the kill came)."""

    SLOW_STEP = 4

    def train_step(self, model, images, labels):
        self.steps_done = getattr(self, "steps_done", 0) + 1
        if self.steps_done == self.SLOW_STEP and self.runtime.is_main and self.resumed_from is None:
            time.sleep(8)
        return super().train_step(model, images, labels)


class SlowSixthStep(SlowFourthStep):
    """As SlowFourthStep, its sixth step slow: with 3 steps an epoch, a SIGKILL sent at epoch 1's progress line of
    step 2 lands in epoch 1 (on an idle machine, the step, validation and the epoch's checkpoint once came first)."""

    SLOW_STEP = 6


class SlowLastStep(Trainer):
    """A trainer whose last training step of every epoch takes 8 s longer on rank 0, which says when it begins:
    a stop signal can then be sent in an epoch's last step."""

    def train_step(self, model, images, labels):
        # The steps this process has trained, the resumed ones counted: the run's step about to train.
        self.steps_done = getattr(self, "steps_done", self.start_epoch * self.steps_per_epoch + self.start_step) + 1
        if (self.steps_done - 1) % self.steps_per_epoch == self.steps_per_epoch - 1 and self.runtime.is_main:
            self.log.print("the epoch's last step begins")
            time.sleep(8)  # (long enough for a busy test machine to send a signal in it)
        return super().train_step(model, images, labels)


class SlowValidation(Trainer):
    """A trainer whose validation of epoch 0 takes 8 s longer on rank 0, which says when it begins: a stop signal
    can then be sent during validation."""

    def evaluate_step(self, model, images, target):
        if not getattr(self, "slowed", False) and self.runtime.is_main:
            self.slowed = True
            self.log.print("validation begins")
            time.sleep(8)
        return super().evaluate_step(model, images, target)


class OutOfMemoryAtStep2(Trainer):
    """A trainer whose second training step runs out of memory, as a GPU's does (torch.OutOfMemoryError)."""

    def train_step(self, model, images, labels):
        self.steps_done = getattr(self, "steps_done", 0) + 1
        if self.steps_done == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (as a test asks)")
        return super().train_step(model, images, labels)


class StallsRank1(Trainer):
    """A trainer whose rank 1 stalls for 300 s in its third step: rank 0's collectives wait for it until
    --dist-timeout (tools/gpu_check.py: NCCL's Flight Recorder dumps then)."""

    def train_step(self, model, images, labels):
        self.steps_done = getattr(self, "steps_done", 0) + 1
        if self.steps_done == 3 and self.runtime.rank == 1:
            time.sleep(300)
        return super().train_step(model, images, labels)


class LineSearch(Trainer):
    """L-BFGS with its strong-Wolfe line search, whose closure() calls branch on the loss closure() returns: every rank
    must get the step's loss over all ranks, as DataParallel's one process does (a rank's own loss: the ranks made
    different numbers of calls, and their collectives waited for each other until --dist-timeout). Its state: the
    losses closure() returned."""

    def build_optimizer(self, model):
        self.losses = []
        return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3, line_search_fn="strong_wolfe")

    def optimizer_step(self, model, closure):
        def recorded():
            loss = closure()
            self.losses.append(float(loss))
            return loss

        self.optimizer.step(recorded)

    def state_dict(self):
        return {"losses": self.losses}

    def load_state_dict(self, state):
        self.losses = list(state["losses"])


class FlagClash(Trainer):
    """Adds a flag the scripts have already (one line, was argparse's traceback)."""

    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument("--warmup-epochs", type=int)


class EmptyDefault(Trainer):
    """A flag of its own whose default is "" (the scripts' own flags refuse an empty value; a trainer's are its own)."""

    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument("--tag", default="")


class Trainer(Experiment):  # (a researcher's subclass named as the base: told from it by identity)
    def build_datasets(self):
        return super().build_datasets()


NamedTrainer, Trainer = (
    Trainer,
    Experiment.__bases__[0],
)  # (--trainer tests.tiny_models:NamedTrainer; Trainer: the base)

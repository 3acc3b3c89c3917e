"""The optimizer (--opt, with weight-decay groups) and its learning-rate schedule, a function of the optimizer step (so
a resumed run recomputes it), each optionally after a linear warmup from 1% of lr over `warmup_epochs`:

    step:     lr x gamma every `step_size` epochs
    cosine:   half a cosine from lr to --lr-min over the run
    constant: lr throughout

--lr-step-unit step (the default) changes the lr at every step; epoch keeps it constant within an epoch, as
torchvision's train.py's schedulers (LinearLR warmup, then CosineAnnealingLR or StepLR counted from its end).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

WARMUP_START = 0.01
# The layers whose parameters --norm-weight-decay covers: those of torchvision's utils.set_weight_decay
# (SyncBatchNorm is a _BatchNorm).
NORM_LAYERS = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LocalResponseNorm,
)


def parameter_groups(model, weight_decay, norm_weight_decay=None, bias_weight_decay=None):
    """The optimizer's parameter groups, as torchvision's references/classification/train.py makes them with
    utils.set_weight_decay: with --bias-weight-decay, every parameter named "bias" (a norm layer's too) has
    that decay; with --norm-weight-decay, the other parameters of normalisation layers (their weights) have
    that one; every other parameter --wd. Frozen parameters (requires_grad False) are left out, as there.
    Groups "other", "norm" and "bias", in that order, each in model.parameters() order; a kind whose decay is
    --wd's stays in "other" (the same decay in one group fewer), and empty groups are left out."""
    decay = {
        "other": weight_decay,
        "norm": weight_decay if norm_weight_decay is None else norm_weight_decay,
        "bias": weight_decay if bias_weight_decay is None else bias_weight_decay,
    }
    groups, seen = {kind: [] for kind in decay}, set()
    for module in model.modules():  # the order of model.parameters(): modules in order, each one's own
        for name, parameter in module.named_parameters(recurse=False):
            if id(parameter) in seen or not parameter.requires_grad:  # shared: in the group of the first module
                continue
            seen.add(id(parameter))
            if bias_weight_decay is not None and name == "bias":  # set_weight_decay's custom key "bias" first
                kind = "bias"
            elif norm_weight_decay is not None and isinstance(module, NORM_LAYERS):
                kind = "norm"
            else:
                kind = "other"
            groups[kind if decay[kind] != weight_decay else "other"].append(parameter)
    return [{"params": params, "weight_decay": decay[kind], "name": kind} for kind, params in groups.items() if params]


def build_optimizer(model, config):
    """--opt over `model`'s parameter groups, as torchvision's train.py builds it: sgd / sgd-nesterov (with
    --momentum), rmsprop (--momentum, alpha 0.9, eps 0.0316: torchvision's, for its EfficientNet / MobileNet
    recipes), adamw (betas and eps torch's defaults); each with --lr and --wd."""
    groups = parameter_groups(model, config.weight_decay, config.norm_weight_decay, config.bias_weight_decay)
    lr, decay = config.lr, config.weight_decay
    if config.opt.startswith("sgd"):
        return torch.optim.SGD(
            groups, lr=lr, momentum=config.momentum, weight_decay=decay, nesterov=config.opt == "sgd-nesterov"
        )
    if config.opt == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr, momentum=config.momentum, weight_decay=decay, eps=0.0316, alpha=0.9)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=decay)


@dataclass
class LrFactor:
    """The multiplier of the base lr at a given optimizer step. Plain fields only, so
    LambdaLR's state_dict (which stores them) loads with weights_only=True."""

    schedule: str
    steps_per_epoch: int
    epochs: int
    warmup_epochs: float = 0.0
    step_size: int = 30
    gamma: float = 0.1
    unit: str = "step"
    floor: float = 0.0  # --lr-min / --lr: where the cosine ends (torchvision's eta_min)

    def __call__(self, step):
        if self.unit == "epoch":
            return self.per_epoch(step // self.steps_per_epoch)
        warmup_steps = int(round(self.warmup_epochs * self.steps_per_epoch))
        if step < warmup_steps:
            return WARMUP_START + (1.0 - WARMUP_START) * step / warmup_steps
        if self.schedule == "step":
            # Decays happen at epoch boundaries, as with StepLR stepped per epoch.
            return self.gamma ** ((step // self.steps_per_epoch) // self.step_size)
        if self.schedule == "cosine":
            total = max(self.epochs * self.steps_per_epoch - warmup_steps, 1)
            return self.cosine(min((step - warmup_steps) / total, 1.0))
        return 1.0

    def cosine(self, progress):
        """Half a cosine from 1 down to the floor, at `progress` (0 to 1) of it."""
        return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def per_epoch(self, epoch):
        """The factor of `epoch` as torchvision's SequentialLR([LinearLR, main], milestones=[W]) gives it."""
        warmup = int(self.warmup_epochs)
        if epoch < warmup:
            return WARMUP_START + (1.0 - WARMUP_START) * epoch / warmup
        after = epoch - warmup
        if self.schedule == "step":
            return self.gamma ** (after // self.step_size)
        if self.schedule == "cosine":
            return self.cosine(min(after / max(self.epochs - warmup, 1), 1.0))
        return 1.0


class LrSchedule(torch.optim.lr_scheduler.LambdaLR):
    """The default schedule (--lr-schedule): each group's lr times LrFactor of the optimizer step. Its state is its
    place alone, the step and the steps of an epoch: a resumed run recomputes the schedule from its flags (it may
    change --epochs or --lr) at the same epoch and step (of data that changed its size since: the epochs' new
    length), with the lr of each of its optimizer's groups (a smaller lr for a backbone stays smaller)."""

    def state_dict(self):
        return {"last_epoch": self.last_epoch, "steps_per_epoch": self.lr_lambdas[0].steps_per_epoch}

    def load_state_dict(self, state):
        epoch, step = divmod(state["last_epoch"], state["steps_per_epoch"])
        self.last_epoch = epoch * self.lr_lambdas[0].steps_per_epoch + step
        self._last_lr = [base * factor(self.last_epoch) for base, factor in zip(self.base_lrs, self.lr_lambdas)]
        for group, base, lr in zip(self.optimizer.param_groups, self.base_lrs, self._last_lr):
            group["initial_lr"], group["lr"] = base, lr


def build_scheduler(optimizer, config, steps_per_epoch):
    """The LrSchedule of the flags over `optimizer`, at step 0: each group's lr as the optimizer was built with it."""
    factor = LrFactor(
        config.lr_schedule,
        steps_per_epoch,
        config.epochs,
        config.warmup_epochs,
        config.lr_step_size,
        config.lr_gamma,
        config.lr_step_unit,
        config.lr_min / config.lr,
    )
    return LrSchedule(optimizer, factor)

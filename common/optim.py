"""The optimizer (--opt, with weight-decay groups) and its lr schedule, a function of the optimizer step (a resumed run
recomputes it) after an optional linear warmup from 1% of lr: step (x gamma every `step_size` epochs), cosine (to
--lr-min over the run) or constant. --lr-step-unit epoch keeps the lr constant within an epoch, as torchvision's
train.py's schedulers (LinearLR warmup, then CosineAnnealingLR or StepLR counted from its end).
"""

import inspect
import math
import textwrap
from dataclasses import dataclass

import torch
import torch.nn as nn

from .errors import UsageError, wrong_return

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
    """The optimizer's parameter groups as torchvision's utils.set_weight_decay makes them, in this order: "other"
    (--wd), "norm" (normalisation layers' parameters not named "bias", with --norm-weight-decay), "bias" (with
    --bias-weight-decay). Frozen parameters are left out; a kind whose decay is --wd's stays in "other"."""
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
        if self.unit == "epoch":  # as torchvision's SequentialLR([LinearLR, main], milestones=[W]) stepped per epoch
            epoch, warmup = step // self.steps_per_epoch, int(self.warmup_epochs)
            return self._factor(epoch, warmup, self.epochs, epoch - warmup)
        warmup = int(round(self.warmup_epochs * self.steps_per_epoch))
        # The step schedule decays at epoch boundaries, as StepLR stepped per epoch.
        return self._factor(step, warmup, self.epochs * self.steps_per_epoch, step // self.steps_per_epoch)

    def _factor(self, done, warmup, total, epochs_for_decay):
        """The factor after `done` of `total` steps (or epochs), the first `warmup` of them a linear warmup."""
        if done < warmup:
            return WARMUP_START + (1.0 - WARMUP_START) * done / warmup
        if self.schedule == "step":
            return self.gamma ** (epochs_for_decay // self.step_size)
        if self.schedule == "cosine":  # half a cosine from 1 down to the floor
            progress = min((done - warmup) / max(total - warmup, 1), 1.0)
            return self.floor + (1.0 - self.floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0


class LrSchedule(torch.optim.lr_scheduler.LambdaLR):
    """Each group's lr times LrFactor of the optimizer step. Its state is its place alone (the step, the steps of an
    epoch): a resumed run recomputes the schedule from its flags at the same epoch and step, keeping each group's lr."""

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


def checked_scheduler(scheduler):
    """A Trainer's scheduler, once it has what the trainer uses: step() without arguments, once per optimizer step,
    and state_dict / load_state_dict (checkpoints). One line otherwise (ReduceLROnPlateau's step needs a metric)."""
    if not all(callable(getattr(scheduler, name, None)) for name in ("step", "state_dict", "load_state_dict")):
        raise wrong_return(
            scheduler, "build_scheduler(optimizer, steps_per_epoch)", "an lr scheduler (step, state_dict)"
        )
    try:
        inspect.signature(scheduler.step).bind()
    except TypeError:
        raise UsageError(
            f"build_scheduler returned {type(scheduler).__name__}, whose step() needs an argument: the trainer steps "
            "the scheduler once per optimizer step, without one (keep a ReduceLROnPlateau as your own, in "
            "state_dict, and step it in after_validation)"
        ) from None
    except ValueError:  # (no signature to read)
        pass
    return scheduler


# What torch's schedulers' state_dicts hold of what they were built from (the rest is their place, as T_cur).
SETTINGS = ("total_steps", "step_size", "step_size_up", "step_size_down", "T_max", "T_0", "T_mult", "milestones",
            "_milestones", "total_iters", "base_lrs", "max_lrs", "eta_min", "gamma", "start_factor", "end_factor",
            "factor", "power", "_schedule_phases")  # fmt: skip


def _settings(state, prefix=""):
    """{name: repr} of the SETTINGS in a scheduler's state, a nested scheduler's as _schedulers[i].name."""
    if not isinstance(state, dict):  # (a scheduler of one's own whose state is no dict: nothing compared)
        return {}
    found = {prefix + key: repr(value) for key, value in state.items() if key in SETTINGS}
    for index, inner in enumerate(state.get("_schedulers") or []):
        found.update(_settings(inner, f"{prefix}_schedulers[{index}]."))
    return found


def group_parameters(model, optimizer):
    """Each parameter group's parameter names in the bare `model` (another's, a criterion's: its shape): a resume's
    groups must be the checkpoint's, as torch's load_state_dict checks their lengths alone."""
    names = {id(parameter): name for name, parameter in model.named_parameters(remove_duplicate=False)}
    return [[names.get(id(p), str(tuple(p.shape))) for p in group["params"]] for group in optimizer.param_groups]


def _short(text):
    """`text` (a setting's repr) in 60 characters at most, cut between words (OneCycleLR's phases are long)."""
    return textwrap.shorten(text, 60, placeholder=" ...")


def restore_scheduler(scheduler, checkpoint, path, done, steps_per_epoch, epochs):
    """Load the scheduler's own state from `checkpoint` (None: the default schedule at step `done`), which must stand
    at the run's step `done` (stepped once per optimizer step). The default schedule's state is its place alone: it
    recomputes its lr from the flags, which a resume may change. Another scheduler's state holds what it was built
    from (OneCycleLR's total_steps, StepLR's step_size, the lrs): where this run's flags or data built it otherwise
    (another --epochs, -b, --lr, data size) and the run goes on, refused (was: the saved ones, or a traceback later)."""
    kind, going_on = type(scheduler).__name__, done < epochs * steps_per_epoch  # (else: trained, validated again)
    if checkpoint is None:
        checkpoint = {"scheduler": {"last_epoch": done, "steps_per_epoch": steps_per_epoch}, "scheduler_type": kind}
    elif checkpoint["scheduler_type"] != kind:
        raise UsageError(
            f"{path} holds no {kind} state (its scheduler: {checkpoint['scheduler_type']}): resume it "
            "with the scheduler it was trained with"
        )
    elif not isinstance(scheduler, LrSchedule) and going_on:
        saved, built = _settings(checkpoint["scheduler"]), _settings(scheduler.state_dict())
        differ = [key for key in saved if key in built and saved[key] != built[key]]
        if differ:
            said = ", ".join(f"{key} {_short(saved[key])} (this run's: {_short(built[key])})" for key in differ)
            raise UsageError(
                f"{path}'s {kind} was built with {said}, which its state_dict restores over this run's flags and "
                "data (--epochs, -b, --lr, the data's size): resume it with those it was trained with"
            )
    scheduler.load_state_dict(checkpoint["scheduler"])
    stood = getattr(scheduler, "last_epoch", done)  # (ChainedScheduler has none)
    saved_steps = checkpoint.get("samples", {}).get("steps", steps_per_epoch)
    if stood != done and going_on:
        if saved_steps != steps_per_epoch:  # (was blamed on the trainer's stepping)
            raise UsageError(
                f"{path}'s {kind} counts {saved_steps} steps an epoch, this run {steps_per_epoch} (another -b or data "
                "size), which its state does not follow: resume it with those it was trained with"
            )
        raise UsageError(
            f"{path}: its {kind} stood at step {stood}, the run at {done}: a scheduler is "
            "stepped once per optimizer step, by the trainer alone"
        )

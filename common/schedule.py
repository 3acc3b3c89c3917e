"""The optimizer (--opt, with weight-decay groups) and its learning-rate schedule, a function of the optimizer
step (so a resumed run recomputes it).

- step:     lr x gamma every `step_size` epochs (the articles' x0.1 every 30 epochs)
- cosine:   half a cosine from lr to --lr-min (0) over the run
- constant: lr throughout
each optionally after a linear warmup from 1% of lr over `warmup_epochs`.

--lr-step-unit step (the default): the lr changes at every step, warmup and cosine included, and the step
schedule decays at epochs 30, 60, ... counted from the start (pytorch/examples' StepLR). epoch: the lr is
constant within an epoch and follows torchvision's train.py, whose schedulers step once per epoch: LinearLR
warmup over the first W epochs, then CosineAnnealingLR(T_max = epochs - W) or StepLR counted from the warmup's end.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

WARMUP_START = 0.01
# The layers whose parameters --norm-weight-decay covers: those of torchvision's utils.set_weight_decay
# (SyncBatchNorm is a _BatchNorm).
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.modules.instancenorm._InstanceNorm,
               nn.LocalResponseNorm)


def parameter_groups(model, weight_decay, norm_weight_decay=None, bias_weight_decay=None):
    """The optimizer's parameter groups, as torchvision's references/classification/train.py makes them with
    utils.set_weight_decay: with --bias-weight-decay, every parameter named "bias" (a norm layer's too) has
    that decay; with --norm-weight-decay, the other parameters of normalisation layers (their weights) have
    that one; every other parameter --wd. Frozen parameters (requires_grad False) are left out, as there.
    Groups "other", "norm" and "bias", in that order, each in model.parameters() order; a kind whose decay is
    --wd's stays in "other" (the same decay in one group fewer), and empty groups are left out. Without either
    flag: the single group of model.parameters(), as before these flags (checkpoints of earlier runs resume)."""
    decay = {"other": weight_decay,
             "norm": weight_decay if norm_weight_decay is None else norm_weight_decay,
             "bias": weight_decay if bias_weight_decay is None else bias_weight_decay}
    if decay["norm"] == weight_decay and decay["bias"] == weight_decay:
        return list(model.parameters())
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


def build_optimizer(model, args):
    """--opt over `model`'s parameter groups, as torchvision's train.py builds it: sgd / sgd-nesterov (with
    --momentum), rmsprop (--momentum, alpha 0.9, eps 0.0316: torchvision's, for its EfficientNet / MobileNet
    recipes), adamw (betas and eps torch's defaults); each with --lr and --wd."""
    groups = parameter_groups(model, args.weight_decay, args.norm_weight_decay, args.bias_weight_decay)
    opt = getattr(args, "opt", None) or "sgd"
    if opt.startswith("sgd"):
        return torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                               nesterov=opt == "sgd-nesterov")
    if opt == "rmsprop":
        return torch.optim.RMSprop(groups, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                                   eps=0.0316, alpha=0.9)
    return torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay)


# The hyperparameters the header names, where an optimizer has them.
DESCRIBED = ("momentum", "nesterov", "betas", "alpha", "eps")


def describe_optimizer(optimizer, args):
    """One header line: the optimizer's class and its own settings, the lr (and how --lr-scaling got it), the
    weight decay of each group, and --clip-grad-norm."""
    lr = f"lr {optimizer.param_groups[0].get('initial_lr', optimizer.param_groups[0]['lr']):g}"
    if args.lr_scaling == "linear":
        lr += f" ({args.lr_source} {args.lr_given:g} x {args.batch_size}/{args.lr_reference_batch}, --lr-scaling linear)"
    settings = []
    for name in DESCRIBED:
        value = optimizer.defaults.get(name)
        if name == "nesterov":
            settings += ["nesterov"] if value else []
        elif value is not None and not (name == "momentum" and value == 0 and type(optimizer).__name__ != "SGD"):
            settings.append(f"{name} {', '.join(f'{v:g}' for v in value) if isinstance(value, tuple) else f'{value:g}'}")
    where = {"norm": " on norm layers" if args.bias_weight_decay is None else " on norm weights", "bias": " on biases"}
    decay = ", ".join(f"{group.get('weight_decay', 0):g}{where.get(group.get('name'), '')}"
                      + (f" ({len(group['params'])} tensors)" if len(optimizer.param_groups) > 1 else "")
                      for group in optimizer.param_groups)
    clip = f", gradients clipped to norm {args.clip_grad_norm:g}" if getattr(args, "clip_grad_norm", None) else ""
    return f"optimizer: {type(optimizer).__name__}, {', '.join([lr, *settings])}, weight decay {decay}{clip}"


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


def build_scheduler(optimizer, args, steps_per_epoch, start_step=0):
    """A LambdaLR positioned at `start_step`. The lr is a function of the step and
    the flags alone, so a resumed run recomputes it (and may change --epochs or --lr)."""
    factor = LrFactor(args.lr_schedule, steps_per_epoch, args.epochs, args.warmup_epochs,
                      args.lr_step_size, args.lr_gamma, getattr(args, "lr_step_unit", None) or "step",
                      (getattr(args, "lr_min", None) or 0.0) / args.lr)
    for group in optimizer.param_groups:
        group["initial_lr"] = args.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=start_step - 1)


def is_step_function(scheduler):
    """Whether `scheduler` is build_scheduler's: a function of the step and the flags, recomputed on resume."""
    return (isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)
            and all(isinstance(factor, LrFactor) for factor in scheduler.lr_lambdas))

"""Learning-rate schedules, stepped once per optimizer step.

- step:     lr x gamma every `step_size` epochs (the articles' x0.1 every 30 epochs)
- cosine:   half a cosine from lr to 0 over the run
- constant: lr throughout
each optionally after a linear warmup from 1% of lr over `warmup_epochs`.
"""
import math
from dataclasses import dataclass

import torch

WARMUP_START = 0.01


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

    def __call__(self, step):
        warmup_steps = int(round(self.warmup_epochs * self.steps_per_epoch))
        if step < warmup_steps:
            return WARMUP_START + (1.0 - WARMUP_START) * step / warmup_steps
        if self.schedule == "step":
            # Decays happen at epoch boundaries, as with StepLR stepped per epoch.
            return self.gamma ** ((step // self.steps_per_epoch) // self.step_size)
        if self.schedule == "cosine":
            total = max(self.epochs * self.steps_per_epoch - warmup_steps, 1)
            progress = min((step - warmup_steps) / total, 1.0)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0


def build_scheduler(optimizer, args, steps_per_epoch, start_step=0):
    """A LambdaLR positioned at `start_step`. The lr is a function of the step and
    the flags alone, so a resumed run recomputes it (and may change --epochs or --lr)."""
    factor = LrFactor(args.lr_schedule, steps_per_epoch, args.epochs, args.warmup_epochs,
                      args.lr_step_size, args.lr_gamma)
    for group in optimizer.param_groups:
        group["initial_lr"] = args.lr
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor, last_epoch=start_step - 1)

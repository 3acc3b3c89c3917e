"""A loss with a parameter of its own, and a trainer with state of its own:
`--trainer examples.learned_temperature:LearnedTemperature`.

    torchrun --standalone --nproc-per-node 2 train_ddp.py --trainer examples.learned_temperature:LearnedTemperature

A criterion's parameters are trained with the model's (a parameter group of their own, at --lr without weight decay,
unless your build_optimizer puts them in one), their gradients averaged over the ranks, and saved in every checkpoint.
What your trainer's state_dict() returns is saved too, and given back to load_state_dict() when the run resumes, a
stop mid-epoch included. Here: cross entropy on the logits divided by a learned temperature, which stays at 1 for
the first --temperature-warmup steps, counted by the trainer (a counter that must survive a resume).
"""

import torch
import torch.nn as nn

from common.trainer import Trainer


class TemperatureLoss(nn.Module):
    def __init__(self, label_smoothing=0.0):
        super().__init__()
        self.log_temperature = nn.Parameter(torch.zeros(()))
        self.cross_entropy = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.frozen = False

    def forward(self, logits, labels):
        log_temperature = self.log_temperature.detach() if self.frozen else self.log_temperature
        return self.cross_entropy(logits / log_temperature.exp(), labels)


class LearnedTemperature(Trainer):
    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument(
            "--temperature-warmup",
            type=int,
            default=4,
            metavar="STEPS",
            help="steps before the temperature is learned (%(default)s)",
        )

    def build_criterion(self):
        self.steps_taken = 0
        return TemperatureLoss(self.config.label_smoothing)

    def train_step(self, model, images, labels):
        self.criterion.frozen = self.steps_taken < self.config.temperature_warmup
        loss, logits = super().train_step(model, images, labels)
        return loss, logits, {"temperature": self.criterion.log_temperature.detach().exp()}

    def optimizer_step(self, model, closure):
        super().optimizer_step(model, closure)
        self.steps_taken += 1  # optimizer steps (train_step runs once per micro-batch with --grad-accum-steps)

    def state_dict(self):
        return {"steps_taken": self.steps_taken}

    def load_state_dict(self, state):
        self.steps_taken = state["steps_taken"]

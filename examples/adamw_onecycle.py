"""Another optimizer and schedule: `--trainer examples.adamw_onecycle:AdamWOneCycle --clip-grad-norm 1`.

    torchrun --standalone --nproc-per-node 2 train_ddp.py --trainer examples.adamw_onecycle:AdamWOneCycle \
        --lr 0.003 --wd 0.05 --clip-grad-norm 1

AdamW alone needs no code: --opt adamw --wd 0.05 --clip-grad-norm 1. This file shows the two methods to
override for anything else: build_optimizer (here AdamW without weight decay on biases and norm weights,
as timm does) and build_scheduler (here OneCycleLR over the whole run). The trainer steps the scheduler
once per optimizer step, saves its state in every checkpoint and loads it on resume (a scheduler with a
state of its own resumes where it was); --clip-grad-norm clips after unscaling under --amp fp16.
"""

import torch

from common.trainer import Trainer


class AdamWOneCycle(Trainer):
    def build_optimizer(self, model):
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.config.lr,
        )

    def build_scheduler(self, optimizer, steps_per_epoch):
        return torch.optim.lr_scheduler.OneCycleLR(  # (each group's own lr its peak: groups of their own lr keep it)
            optimizer,
            max_lr=[group["lr"] for group in optimizer.param_groups],
            total_steps=self.config.epochs * steps_per_epoch,
        )

"""Fine-tuning with the backbone at a fraction of the head's lr: `--trainer examples.layerwise_lr:LayerwiseLr`.

    torchrun --standalone --nproc-per-node 2 train_ddp.py -a resnet18 --pretrained \
        --trainer examples.layerwise_lr:LayerwiseLr --backbone-lr-factor 0.1

build_optimizer returns parameter groups with lrs of their own. The schedule (--lr-schedule, warmup included)
multiplies each group's own lr, on resume too; the header lists each group's lr and log.csv has lr (the first
group's) and lr_group1, ... for the others.
"""

import torch
import torch.nn as nn

from common.trainer import Trainer


class LayerwiseLr(Trainer):
    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument(
            "--backbone-lr-factor",
            type=float,
            default=0.1,
            metavar="F",
            help="the backbone's lr: F x --lr; the head (the last Linear layer) trains at --lr",
        )

    def build_optimizer(self, model):
        head = [module for module in model.modules() if isinstance(module, nn.Linear)][-1]
        head_ids = {id(parameter) for parameter in head.parameters()}
        backbone = [parameter for parameter in model.parameters() if id(parameter) not in head_ids]
        config = self.config
        return torch.optim.SGD(
            [{"params": list(head.parameters())}, {"params": backbone, "lr": config.lr * config.backbone_lr_factor}],
            lr=config.lr,
            momentum=config.momentum,
            weight_decay=config.weight_decay,
        )

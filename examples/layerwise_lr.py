"""Fine-tuning with the backbone at a fraction of the head's lr: `--trainer examples.layerwise_lr:LayerwiseLr`.

    torchrun --standalone --nproc-per-node 2 train_ddp.py -a resnet18 --pretrained \
        --trainer examples.layerwise_lr:LayerwiseLr --backbone-lr-factor 0.1

build_optimizer returns parameter groups with lrs of their own. Here it splits the default optimizer's groups
(--opt, --wd, --norm-weight-decay and --bias-weight-decay applied as without this trainer) into the heads' (the
layers that output the classes: an auxiliary head too) and the backbone's. The schedule (--lr-schedule, warmup
included) multiplies each group's own lr, on resume too; the header lists each group's lr and log.csv has lr (the
first group's) and lr_group1, ... for the others.
"""

from common.cli import number_in
from common.errors import UsageError
from common.models import classifiers
from common.trainer import Trainer


class LayerwiseLr(Trainer):
    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument(
            "--backbone-lr-factor",
            type=number_in(0, 1),  # (a negative lr climbs the loss)
            default=0.1,
            metavar="F",
            help="the backbone's lr: F x --lr, in [0, 1]; the heads (the layers that output the classes) train at --lr",
        )

    def build_optimizer(self, model):
        optimizer = super().build_optimizer(model)  # (--opt and its weight-decay groups, as without this trainer)
        # The heads: the last layer with an output per class, and the auxiliary heads' (a backbone's layer of as many
        # channels, a squeeze-excitation's 1x1 convolution, comes before the head and is none).
        found = classifiers(model, len(self.classes))
        heads = [layer for name, layer in found if "aux" in name.lower()]
        heads += [layer for name, layer in found if "aux" not in name.lower()][-1:]
        if not heads:
            raise UsageError(f"LayerwiseLr: {self.config.arch} has no layer with an output per class to train at --lr")
        heads = {id(parameter) for layer in heads for parameter in layer.parameters()}
        groups = []
        for head in (True, False):  # (the heads' groups first: log.csv's lr is the head's)
            for group in optimizer.param_groups:
                parameters = [parameter for parameter in group["params"] if (id(parameter) in heads) == head]
                lr = group["lr"] * (1.0 if head else self.config.backbone_lr_factor)
                groups += [{**group, "params": parameters, "lr": lr}] if parameters else []
        optimizer.param_groups.clear()  # (the same optimizer, its defaults as the header says them, regrouped)
        for group in groups:
            optimizer.add_param_group(group)
        return optimizer

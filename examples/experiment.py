"""A whole experiment in one file: grey images held in memory, resnet18 from a weights file of your own (the library
gives it a 10-way head and a 1-channel conv1, and the header says so), a focal loss, the backbone at a tenth of the
head's lr, a random rotation, a confusion matrix.

    torchrun --standalone --nproc-per-node 2 train_ddp.py -a resnet18 --init-from my_resnet18.pth --epochs 10 \
        --trainer examples.experiment:Experiment --train-crop-size 16 --val-resize-size 16 --val-crop-size 16
"""

import torch
import torch.nn.functional as F
from torchvision.transforms import v2

from common.metrics import ConfusionMatrix
from common.trainer import Trainer


class Images(list):  # (your data here) (image, label) items in memory; mean and std: the images' own
    mean, std = (0.28,), (0.3,)


def digits(count, seed):  # image i: class i % 10, a bright row at its height on noise
    images = torch.randint(0, 64, (count, 1, 16, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    for index in range(count):
        images[index, 0, 3 + index % 10, 2:14] = 255
    return Images((image, index % 10) for index, image in enumerate(images))


class FocalLoss(torch.nn.Module):  # gamma 2: the images already right weigh less
    def forward(self, logits, labels):
        cross_entropy = F.cross_entropy(logits, labels, reduction="none")
        return ((1 - (-cross_entropy).exp()) ** 2 * cross_entropy).mean()


class Experiment(Trainer):
    def build_datasets(self):
        return [str(digit) for digit in range(10)], digits(24, seed=0), digits(12, seed=1)

    def build_transforms(self, train, val):
        return train.then(v2.RandomRotation(10)), val

    def build_criterion(self):
        return FocalLoss()

    def build_optimizer(self, model):
        backbone = [parameter for name, parameter in model.named_parameters() if not name.startswith("fc.")]
        groups = [{"params": model.fc.parameters()}, {"params": backbone, "lr": self.config.lr / 10}]
        return torch.optim.SGD(groups, lr=self.config.lr, momentum=0.9, weight_decay=self.config.weight_decay)

    def build_metrics(self, split, classes):
        return {"confusion": ConfusionMatrix(len(classes))}

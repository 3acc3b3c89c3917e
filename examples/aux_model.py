"""Your own model, with an auxiliary head: `--arch examples.aux_model:build`, no other change.

    torchrun --standalone --nproc-per-node 2 train_ddp.py -a examples.aux_model:build

The scripts call build(num_classes=K) (and dropout=P with --dropout). In training, forward returns
(logits, auxiliary logits); the trainer's loss is criterion(logits) + aux_loss_weight x criterion(auxiliary
logits), as torchvision trains GoogLeNet (0.3 per head) and Inception v3 (0.4). In eval mode it returns the
logits alone, which validation and the accuracy use. A dict {"logits": ..., "aux": ...} works too.
"""

import torch.nn as nn


class AuxNet(nn.Module):
    aux_loss_weight = 0.3  # the auxiliary head's weight in the training loss (default 0.3, GoogLeNet's)

    def __init__(self, num_classes, dropout=0.0):
        super().__init__()

        def block(inputs, outputs):
            return [nn.Conv2d(inputs, outputs, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2)]

        self.stem = nn.Sequential(*block(3, 16), *block(16, 32))
        self.body = nn.Sequential(*block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(64, num_classes))
        # The auxiliary classifier reads the middle features: it gives them a gradient of their own.
        self.aux = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, num_classes))

    def forward(self, images):
        features = self.stem(images)
        logits = self.head(self.body(features))
        if self.training:
            return logits, self.aux(features)
        return logits


def build(num_classes, dropout=0.0):
    return AuxNet(num_classes, dropout)

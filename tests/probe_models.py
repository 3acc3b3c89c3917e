"""Models that report what happens inside a run, given to the scripts as `--arch tests.probe_models:...`."""

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.tiny_models import TinyNet


class _ReportsDropoutMask(nn.Module):
    def __init__(self, num_classes, dropout):
        super().__init__()
        self.net, self.reported = TinyNet(num_classes, dropout), False

    def forward(self, images):
        if self.training and not self.reported:
            # Drawn from the stream that the model's dropout draws from, at its first training step.
            mask = nn.functional.dropout(torch.ones(48), 0.5, training=True)
            rank = dist.get_rank() if dist.is_initialized() else 0
            print(f"rank {rank} dropout mask {''.join('1' if value else '0' for value in mask.tolist())}", flush=True)
            self.reported = True
        return self.net(images)


def DropoutMaskNet(num_classes, dropout=0.5):
    """TinyNet (with dropout) that prints, in every process, a dropout mask drawn at its first training step."""
    return _ReportsDropoutMask(num_classes, dropout)

"""Samplers that split an epoch over the ranks exactly. Training: the same seeded permutation (seed + epoch) on every
rank, rank r taking every world_size-th index, so batch k of all ranks together is batch k of a single process; a
resumed epoch skips the batches it had done. Validation: every index on exactly one rank, each image counted once.
"""

import math

import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can begin an epoch part-way: after a mid-epoch resume it skips the
    batches already trained on. Batch k of every rank together is batch k of the global order,
    so skipping k batches per rank skips the same k global batches whatever the world size."""

    start = 0  # samples of this rank's shard to skip in the current epoch

    def set_epoch(self, epoch, start=0):
        super().set_epoch(epoch)
        # A stop after an epoch's last step resumes at steps x batch, past the end of a last batch that is short.
        self.start = min(start, self.num_samples)

    def shard(self):
        """This rank's indices of the current epoch, from its beginning."""
        return list(super().__iter__())

    def __iter__(self):
        return iter(self.shard()[self.start :])

    def __len__(self):
        return self.num_samples - self.start


class RepeatedAugmentationSampler(ResumableSampler):
    """--ra-sampler (torchvision's RASampler, not rounded down to a multiple of 256): DistributedSampler's permutation
    with each image `repetitions` times in a row, cut to len(dataset), split as DistributedSampler splits. Copy j of
    image i is the index i + j * len(dataset) (SeededTransform augments by that seed); copy 0 as without it."""

    def __init__(self, dataset, num_replicas, rank, repetitions, seed=0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.repetitions = repetitions

    def global_order(self):
        """The epoch's indices over all ranks, before padding."""
        length = len(self.dataset)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        permutation = torch.randperm(length, generator=generator).tolist()
        return [index + copy * length for index in permutation for copy in range(self.repetitions)][:length]

    def shard(self):
        order = self.global_order()
        padding = self.total_size - len(order)  # as DistributedSampler pads: the first indices again
        order += (order * math.ceil(padding / len(order)))[:padding]
        return order[self.rank : self.total_size : self.num_replicas]


class ShardSampler(Sampler):
    """Indices rank, rank + world, ...: every index on exactly one rank, no padding.
    (DistributedSampler pads by repeating the first indices, which would count
    those images twice in validation.)"""

    def __init__(self, length, rank, world_size):
        self.length, self.rank, self.world_size = length, rank, world_size

    def __iter__(self):
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self):
        return len(range(self.rank, self.length, self.world_size))

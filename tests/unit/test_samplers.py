"""common/samplers.py: exact validation shards, the resumable training sampler and repeated augmentation (batch
k of all ranks together is batch k of one process, whatever the world size)."""

import math

import pytest

from common.samplers import RepeatedAugmentationSampler, ResumableSampler, ShardSampler


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shard_sampler_covers_every_index_exactly_once(world_size):
    shards = [list(ShardSampler(13, rank, world_size)) for rank in range(world_size)]
    assert sorted(index for shard in shards for index in shard) == list(range(13))
    assert [len(ShardSampler(13, rank, world_size)) for rank in range(world_size)] == [len(s) for s in shards]


def global_batches(samplers, per_rank_batch):
    """Batch k of all ranks together, for each k."""
    shards = [list(sampler) for sampler in samplers]
    steps = len(shards[0]) // per_rank_batch + (len(shards[0]) % per_rank_batch > 0)
    return [
        sorted(index for shard in shards for index in shard[k * per_rank_batch : (k + 1) * per_rank_batch])
        for k in range(steps)
    ]


def ra_samplers(length, world_size, repetitions=3, epoch=0, seed=5):
    samplers = [
        RepeatedAugmentationSampler(list(range(length)), world_size, rank, repetitions, seed=seed)
        for rank in range(world_size)
    ]
    for sampler in samplers:
        sampler.set_epoch(epoch)
    return samplers


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ra_sampler_ranks_batches_together_are_the_single_process_batches(world_size):
    length, batch = 13, 6  # 13 images: 2 and 3 ranks need padding
    (single,) = ra_samplers(length, 1, epoch=2)
    order = list(single)
    assert order == single.global_order() and len(order) == length
    together = global_batches(ra_samplers(length, world_size, epoch=2), batch // world_size)
    expected = [sorted(order[start : start + batch]) for start in range(0, length, batch)]
    assert together[:-1] == expected[:-1]
    padding = order[: world_size * math.ceil(length / world_size) - length]  # DistributedSampler's: the first again
    assert together[-1] == sorted(expected[-1] + padding)
    assert [len(sampler) for sampler in ra_samplers(length, world_size)] == [
        math.ceil(length / world_size)
    ] * world_size


@pytest.mark.parametrize("repetitions", [2, 3, 4])
def test_ra_sampler_repeats_each_image_k_times_in_a_row_keeping_the_epoch_length(repetitions):
    length = 14
    (sampler,) = ra_samplers(length, 1, repetitions, epoch=1)
    order = list(sampler)
    assert len(order) == length
    groups = [order[start : start + repetitions] for start in range(0, length, repetitions)]
    for group in groups:  # copy j of image i is i + j * length
        assert group == [group[0] % length + copy * length for copy in range(len(group))]
    # The images are the first of DistributedSampler's permutation of the epoch (seed + epoch).
    plain = ResumableSampler(list(range(length)), num_replicas=1, rank=0, shuffle=True, seed=5)
    plain.set_epoch(1)
    assert [group[0] for group in groups] == list(plain)[: len(groups)]
    assert list(sampler) != list(ra_samplers(length, 1, repetitions, epoch=2)[0])


@pytest.mark.parametrize("world_size, repetitions", [(2, 2), (4, 4), (4, 2), (3, 3)])
def test_ra_sampler_puts_the_copies_of_an_image_on_different_ranks(world_size, repetitions):
    length = 12 * world_size  # no padding: a padded index is an extra copy by design
    ranks_of = {}
    for rank, sampler in enumerate(ra_samplers(length, world_size, repetitions)):
        for index in sampler:
            ranks_of.setdefault(index % length, []).append(rank)
    assert all(len(set(ranks)) == len(ranks) for ranks in ranks_of.values())
    assert sum(len(ranks) == repetitions for ranks in ranks_of.values()) == length // repetitions


def test_ra_sampler_resumes_by_skipping_exactly_the_samples_done():
    for rank, sampler in enumerate(ra_samplers(29, 2, epoch=3)):
        whole = list(sampler)
        for start in (0, 4, 14, 15):
            sampler.set_epoch(3, start=start)
            assert list(sampler) == whole[start:] and len(sampler) == len(whole) - start, (rank, start)

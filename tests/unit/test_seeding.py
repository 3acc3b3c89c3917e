"""common/seeding.py: every rank starts from the same weights and draws its own dropout masks (seed + rank); a
process's random streams are a state of their own, saved and put back."""

import random

import numpy
import torch

from common.seeding import RandomStreams, seed_all, seed_this_rank
from conftest import built_trainer, cpu_runtime

SMALL = [
    "--train-crop-size",
    "16",
    "--val-resize-size",
    "16",
    "--val-crop-size",
    "16",
    "-j",
    "0",
    "-b",
    "4",
    "--seed",
    "0",
    "--dataset",
    "tests.custom_datasets:uint8_tensors",
    "-a",
    "tests.tiny_models:TinyNet",
]


def test_the_streams_of_a_process_are_saved_and_put_back(tmp_path):
    """numpy's too (a researcher's np.random in a step: was neither seeded nor saved, so no --seed repeated the run),
    through a checkpoint's torch.load(weights_only=True)."""
    streams = RandomStreams([torch.device("cpu")])
    numpy.random.standard_normal()  # (its state then holds a cached normal)
    torch.save(streams.state_dict(), tmp_path / "streams.pth")
    expected = torch.rand(3), random.random(), numpy.random.standard_normal(3)
    state = torch.load(tmp_path / "streams.pth", weights_only=True)
    assert state["cuda"] == []  # (one per GPU the process drives)
    streams.load_state_dict(state)
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
    assert numpy.array_equal(numpy.random.standard_normal(3), expected[2])


def test_ranks_start_from_the_same_weights_and_draw_their_own_dropout_masks(no_platform_env):
    """Built as ranks 0 and 1 of 2 and as a single process: one set of initial weights; rank 0 draws the masks a single
    process draws (DataParallel and world size 1 unchanged), rank 1 others."""
    masks, weights = {}, {}
    for name, runtime in (("single", cpu_runtime()), ("rank 0", cpu_runtime(0, 2)), ("rank 1", cpu_runtime(1, 2))):
        trainer = built_trainer(*SMALL, "--dropout", "0.5", runtime=runtime)
        weights[name] = [p.detach().clone() for p in trainer.model.parameters()]
        masks[name] = torch.nn.functional.dropout(torch.ones(64), 0.5, training=True)
    assert all(torch.equal(a, b) for a, b in zip(weights["rank 0"], weights["rank 1"]))
    assert all(torch.equal(a, b) for a, b in zip(weights["single"], weights["rank 1"]))
    assert torch.equal(masks["single"], masks["rank 0"]) and not torch.equal(masks["rank 0"], masks["rank 1"])


def test_seed_this_rank_moves_every_stream_by_the_rank():
    seed_all(3)
    same = torch.rand(2), numpy.random.rand(2)
    seed_this_rank(3, 0, [torch.device("cpu")])
    assert torch.equal(torch.rand(2), same[0]) and numpy.array_equal(numpy.random.rand(2), same[1])
    seed_this_rank(3, 1, [torch.device("cpu")])
    assert not torch.equal(torch.rand(2), same[0]) and not numpy.array_equal(numpy.random.rand(2), same[1])

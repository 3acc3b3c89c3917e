"""common/data.py: the data of one process assembled: the ranks' first batches together are one process's, validation
shards each image once, the recipe's flags reach the loaders, loader workers share a node's cores, the global batch
divides over the processes."""
import shutil

import pytest
import torch

from common.data import build_data, loader_workers, per_process_batch
from common.datasets import build_datasets
from common.errors import UsageError
from common.samplers import RepeatedAugmentationSampler
from conftest import cpu_runtime, parse

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables


@pytest.fixture
def folder(tiny_data, tmp_path):
    """A private, editable copy of the tiny ImageFolder."""
    return shutil.copytree(tiny_data, tmp_path / "data")


def data_of(config, rank=0, world_size=1, seed=5):
    return build_data(config, build_datasets(config), seed, cpu_runtime(rank, world_size))


def first_batch(config, rank, world_size):
    data = data_of(config, rank, world_size)
    data.train_sampler.set_epoch(0)
    images, labels, _ = next(iter(data.train_loader))
    return {(int(label), image.numpy().tobytes()) for image, label in zip(images, labels)}, data


def test_ranks_first_batches_together_are_the_single_process_first_batch(folder):
    # 13 validation images: 2 ranks cannot split them evenly, so padding (DistributedSampler's) would show.
    extra = next((folder / "val" / "circle").glob("0*.jpg"))
    shutil.copy(extra, extra.with_name("extra.jpg"))
    config = parse("--data", folder, "-j", "0", "--train-crop-size", "24", "--val-resize-size", "32",
                   "--val-crop-size", "32", "-b", "8")
    single, _ = first_batch(config, rank=0, world_size=1)
    rank0, data0 = first_batch(config, rank=0, world_size=2)
    rank1, data1 = first_batch(config, rank=1, world_size=2)
    assert len(single) == 8 and len(rank0) == len(rank1) == 4
    assert rank0.isdisjoint(rank1)
    assert rank0 | rank1 == single
    # Validation: each of the 13 images on exactly one rank, none twice.
    shards = [list(data.val_loader.sampler) for data in (data0, data1)]
    assert sorted(shards[0] + shards[1]) == list(range(13)) and len(data0.val_loader.dataset) == 13
    assert [len(data.val_loader.sampler) for data in (data0, data1)] == [len(shard) for shard in shards] == [7, 6]
    assert data0.classes == ["circle", "ring", "square"]


def test_the_global_batch_must_divide_over_the_processes():
    assert per_process_batch(8, 2) == 4
    with pytest.raises(UsageError, match="multiple of 3"):
        per_process_batch(8, 3)


def test_the_dataset_crops_at_the_size_of_the_epoch_also_when_resumed(tiny_data):
    config = parse("--data", tiny_data, "-j", "0", "--res-schedule", "16:32:0:2:8", "--train-crop-size", "20", "-b", "4")
    data = data_of(config)
    dataset, sizes, images_at = data.train_loader.dataset, [], {}
    for epoch in range(4):
        dataset.set_epoch(epoch)
        images_at[epoch] = dataset[0][0]
        sizes.append(tuple(images_at[epoch].shape[-2:]))
    assert sizes == [(16, 16), (24, 24), (32, 32), (32, 32)]
    # A resumed run builds its data anew and sets the epoch it resumes in, mid-epoch or not.
    resumed = data_of(config).train_loader.dataset
    resumed.set_epoch(1)
    assert torch.equal(resumed[0][0], images_at[1])


def test_build_data_wires_the_recipe_flags(tiny_data):
    config = parse("--data", tiny_data, "-j", "0", "--train-crop-size", "16", "--ra-sampler", "--ra-reps", "2",
                   "--auto-augment", "ta_wide", "--random-erase", "0.5", "-b", "8")
    data = data_of(config, rank=1, world_size=2)
    assert isinstance(data.train_sampler, RepeatedAugmentationSampler) and data.train_sampler.repetitions == 2
    assert data.train_loader.dataset.transform.augmentation is not None
    data.train_sampler.set_epoch(0)
    images_batch, labels, _ = next(iter(data.train_loader))
    base = data.train_loader.dataset.base
    assert images_batch.shape == (4, 3, 16, 16) and labels.tolist() == [
        base.dataset.samples[index % len(base)][1] for index in list(data.train_sampler)[:4]]


@pytest.mark.parametrize("cores, processes, expected", [
    (2, 1, 1),     # this machine, train_dp.py: one worker, the process keeps a core
    (2, 2, 0),     # this machine, 2 ranks: no core to spare
    (3, 2, 1),     # a core to spare: at least one worker each
    (16, 1, 15),   # one GPU on 16 cores: 8 workers fed an H100 half of what 15 did (make benchmark-gpu)
    (64, 1, 16),   # at most 16 per process
    (96, 8, 11),   # a GPU node: 12 cores per rank
    (16, 8, 1),
    (8, 8, 0),
])
def test_auto_loader_workers_share_the_cores_among_the_processes(cores, processes, expected):
    assert loader_workers("auto", processes, cores=cores) == expected
    assert loader_workers(3, processes, cores=cores) == 3  # a number is kept


def test_the_training_loader_fills_every_batch_and_the_validation_loader_leaves_bad_files_out(tiny_data, tmp_path):
    """A truncated and an empty training image, random bytes in validation: every training batch full (the next
    image took each one's place), each readable validation image once, each bad file named."""
    root = shutil.copytree(tiny_data, tmp_path / "data")
    whole = next((root / "train" / "circle").iterdir())
    bad = {root / "train" / "circle" / "truncated.jpg": whole.read_bytes()[:300],
           root / "train" / "square" / "empty.jpg": b"", root / "val" / "ring" / "garbage.jpg": bytes(range(256)) * 8}
    for path, content in bad.items():
        path.write_bytes(content)
    data = data_of(parse("--data", root, "-j", "0", "-b", "8", "--train-crop-size", "16", "--val-resize-size", "16",
                         "--val-crop-size", "16"))
    data.train_sampler.set_epoch(0)
    train, val = list(data.train_loader), list(data.val_loader)
    assert sum(len(target) for _, target, _ in train) == len(data.train_loader.dataset) == 26  # every slot filled
    assert sum(len(target) for _, target, _ in val if target is not None) == len(data.val_loader.dataset) - 1 == 12
    assert sorted({path for *_, found in train + val for path, _ in found}) == sorted(map(str, bad))

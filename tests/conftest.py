"""The fixtures and helpers a test uses: its configuration and Trainer built in-process, tiny datasets on disk, the
reference runs several tests compare with. The machinery that starts real processes is in tests/harness/."""

import csv
import os
import sys
from pathlib import Path

import pytest

from harness.ahead import _runs_started_ahead, ahead, ahead_of, once  # noqa: F401 (a fixture)
from harness.jobs import _no_job_outlives_its_test, _no_job_outlives_the_session, run_together  # noqa: F401
from harness.processes import PLATFORM_VARIABLES, PYTHON, REPO, clean_env, free_port

sys.path.insert(0, str(REPO))
# In-process tests compute on one thread, as every job does (OMP_NUM_THREADS=1: clean_env): the other core is the jobs'
# (started ahead, in the background), and OpenMP's threads would spin waiting for a core.
os.environ["OMP_NUM_THREADS"] = "1"
import torch

torch.set_num_threads(1)
from common import demo_data  # noqa: E402

TIERS = ("unit", "e2e", "faults", "slow", "slurm", "gpu", "quick")


def pytest_collection_modifyitems(items):
    """tests/unit/ is the unit tier; every other test file names its tier (pytestmark) and must have one. The files
    whose tests share runs started ahead (`ahead`) go last: those runs start in the background at the session's start
    and use the core that the tests before them (the unit tier, in-process, on one core) leave idle."""
    for item in items:
        if Path(item.fspath).parent.name == "unit":
            item.add_marker(pytest.mark.unit)
        elif not any(item.get_closest_marker(tier) for tier in TIERS):
            raise pytest.UsageError(
                f"{item.nodeid} has no tier marker ({', '.join(TIERS)}): give its module a pytestmark"
            )
    later = {item.module.__name__ for item in items if ahead_of(item)}
    items.sort(key=lambda item: (Path(item.fspath).parent.name != "unit", item.module.__name__ in later))


def log_rows(folder):
    """The rows of the log.csv in `folder`, by column name."""
    with open(Path(folder) / "log.csv", newline="") as file:
        return list(csv.DictReader(file))


# Small and fast on two cores: 32 px images, no loader workers, one thread per process.
TINY = ["--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32", "-j", "0", "-p", "1"]


def parse(*argv, mode="dp"):
    """The frozen Config of `argv` as a script of `mode` resolves it, in-process (the platform variables of this
    process apply: take the no_platform_env fixture)."""
    from common import cli

    return cli.parse_args(cli.build_parser("test"), [str(arg) for arg in argv], mode=mode)


def cpu_runtime(rank=0, world_size=1, mode="dp"):
    """This process as rank `rank` of `world_size` on the CPU (no process group: what a rank computes alone)."""
    import torch

    from common.distributed import Runtime

    return Runtime(mode, torch.device("cpu"), rank, rank, world_size, world_size)


# The smallest model of each classification family torchvision lists, and a crop it takes (the smallest
# that is a multiple of 32 and at least its minimum; ViT and MaxViT take 224 alone, Inception v3's
# auxiliary head needs 299 in training).
# fmt: off
FAMILIES = {"alexnet": ("alexnet", 64), "convnext": ("convnext_tiny", 32), "densenet": ("densenet121", 32),
    "efficientnet": ("efficientnet_b0", 32), "googlenet": ("googlenet", 32), "inception": ("inception_v3", 299),
    "maxvit": ("maxvit_t", 224), "mnasnet": ("mnasnet0_5", 32), "mobilenet": ("mobilenet_v3_small", 32),
    "regnet": ("regnet_x_400mf", 32), "resnet": ("resnet18", 32), "resnext": ("resnext50_32x4d", 32),
    "shufflenet": ("shufflenet_v2_x0_5", 32), "squeezenet": ("squeezenet1_1", 32), "swin": ("swin_t", 32),
    "vgg": ("vgg11", 32), "vit": ("vit_b_16", 224), "wide_resnet": ("wide_resnet50_2", 32)}
# fmt: on


def built_trainer(*argv, trainer=None, datasets=None, runtime=None):
    """A Trainer built in-process from `argv` (trainer: a Trainer subclass), on `datasets` (else what the flags
    name), as common/run.py builds one for a fresh run (seed: --seed, else 0), without the lock, the agreement or a
    checkpoint."""
    from common.trainer import Trainer

    config = parse(*argv)
    made = (trainer or Trainer)(config, runtime or cpu_runtime())
    return made.build(datasets if datasets is not None else made.build_datasets(), config.seed or 0)


@pytest.fixture
def group_of_one():
    """A process group of one in this process (gloo, in-memory store), for the in-process tests of FSDP and its
    checkpoints: fully_shard and Distributed Checkpoint need one, and a group of one shards nothing away."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_trainer(*argv, datasets=None, trainer=None):
    """A Trainer of train_fsdp.py built in-process on tiny in-memory data (inside group_of_one)."""
    from common.fsdp import Sharding
    from common.sharded_checkpoint import ShardedCheckpoints
    from common.trainer import Trainer

    small = "--train-crop-size 16 --val-resize-size 16 --val-crop-size 16 -j 0 -b 4 --seed 1".split()
    config = parse(*small, *argv, mode="fsdp")
    runtime = cpu_runtime(mode="fsdp")
    made = (trainer or Trainer)(
        config, runtime, shard=Sharding(config, runtime), checkpoints=ShardedCheckpoints(config)
    )
    return made.build(datasets or tensor_datasets(), 1)


def tensor_datasets(size=16, train=12, val=6, channels=3):
    """(classes, train set, val set) in memory: uint8 CHW images of `size` px, item i of class i % 3, a grey level of
    its own with a little noise (tests/custom_datasets.py)."""
    from tests.custom_datasets import CLASSES, Items, pixels

    def make(index):
        return pixels(index, channels, size), index % 3

    return CLASSES, Items(train, make), Items(val, make, offset=train)


def make_image_folder(root, train_per_class=8, val_per_class=4, num_classes=3):
    """A real JPEG ImageFolder (root/train, root/val) of demo shapes."""
    demo_data.generate(root, train_per_class=train_per_class, val_per_class=val_per_class, num_classes=num_classes)
    return Path(root)


def hf_copy(folder, out, form="disk"):
    """The images of the image folder `folder` (train/, val/) as a Hugging Face dataset at `out`, in the folder's own
    order with its class indices (a ClassLabel of its classes), each image's file bytes as they are: save_to_disk's
    form ("disk"), or parquet files as the Hub lays them out (data/train-00000-of-00001.parquet, "parquet")."""
    import datasets

    from common.folder_index import scan_image_folder

    datasets.disable_progress_bars()
    classes, *splits = scan_image_folder(folder)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    made = {
        name: datasets.Dataset.from_dict(
            {
                "image": [{"bytes": Path(path).read_bytes(), "path": Path(path).name} for path, _ in samples],
                "label": [label for _, label in samples],
            },
            features=features,
        )
        for name, samples in zip(("train", "validation"), ([files[i] for i in range(len(files))] for files in splits))
    }
    if form == "disk":
        datasets.DatasetDict(made).save_to_disk(str(out))
    else:
        for name, split in made.items():
            split.to_parquet(str(Path(out) / "data" / f"{name}-00000-of-00001.parquet"))
    return Path(out)


def tiny_folder(tmp_path_factory):
    """3 classes, 24 train and 12 val images."""
    return make_image_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    return once(tiny_folder, tmp_path_factory)


# BatchNorm-free and dropout-free, so that per-process statistics and masks cannot differ; today's recipe
# without mixing (which pairs the images a process holds: docs/recipes.md), whose every part keeps DP = DDP.
EXACT_MODEL = ["-a", "tests.tiny_models:TinyNet", "--dropout", "0", "--seed", "3", "--lr", "0.05"]

RECIPE = (
    "--auto-augment ta_wide --random-erase 0.5 --ra-sampler --ra-reps 2 --model-ema --model-ema-steps 2 "
    "--model-ema-decay 0.9 --bias-weight-decay 0 --label-smoothing 0.1"
).split()


def exact_folder(tmp_path_factory):
    """24 training images (3 steps of global batch 8) and 13 validation images, which neither 2 nor 3 processes
    divide: padding (DistributedSampler's) would count some twice."""
    root = make_image_folder(tmp_path_factory.mktemp("exact-data"), train_per_class=8, val_per_class=5)
    for extra in sorted((root / "val").rglob("*.jpg"))[:2]:
        extra.unlink()
    return root


@pytest.fixture(scope="session")
def exact_data(tmp_path_factory):
    return once(exact_folder, tmp_path_factory)


def exact_run(data, output_dir, *extra):
    """The flags of the compared runs: 12 steps of global batch 8, the recipe without mixing."""
    return [
        *TINY,
        *EXACT_MODEL,
        *RECIPE,
        "--data",
        data,
        "-b",
        "8",
        "--epochs",
        "4",
        "--output-dir",
        output_dir,
        *extra,
    ]


def single_node_launches(tmp_path_factory):
    """The reference runs of tests/test_distributed.py and tests/test_run_scripts.py, started together as a user
    starts them, through run_scripts/: single_node_dp.sh (train_dp.py), single_node_ddp.sh (torchrun, 2 processes)
    and single_node_spawn.sh (train_spawn.py, 2 processes). (output dir, mode -> CompletedProcess)."""
    exact_data, out = once(exact_folder, tmp_path_factory), tmp_path_factory.mktemp("single node")  # (a space)
    env = {"dp": {}, "ddp": dict(NPROC_PER_NODE=2), "spawn": dict(NPROC_PER_NODE=2, MASTER_PORT=free_port())}
    commands = [
        (
            ["bash", REPO / "run_scripts" / f"single_node_{mode}.sh", *exact_run(exact_data, out / mode)],
            clean_env(PYTHON=PYTHON, **env[mode]),
        )
        for mode in env
    ]
    return out, dict(zip(env, run_together(commands)))


single_node_runs = ahead(single_node_launches, "single_node_runs", scope="session")


@pytest.fixture
def no_platform_env(monkeypatch):
    """In-process: a shell with none of the platform variables that set defaults."""
    for name in PLATFORM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch

"""Datasets, transforms, samplers and loaders.

Two properties the scripts rely on:
- Augmentation is seeded per image from (seed, epoch, index), so an image gets
  the same crop whichever process or loader worker reads it: DP, DDP and spawn
  see the same batches for the same seed and global batch.
- Validation is sharded without padding (ShardSampler), so each image is
  counted exactly once whatever the world size.
"""
import math
import os
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms
from torchvision.datasets.folder import IMG_EXTENSIONS

from .args import UsageError
from .demo_data import ensure_demo_dataset
from .preemption import ignore_stop_signals

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class TrainPreset:
    """RandomResizedCrop + horizontal flip, then normalised tensors."""

    def __init__(self, crop_size, min_scale=0.08):
        self.transform = transforms.Compose([
            transforms.RandomResizedCrop(crop_size, scale=(min_scale, 1.0), antialias=True),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])

    def __call__(self, image):
        return self.transform(image)


class EvalPreset:
    """Resize the short side, centre crop, then normalised tensors."""

    def __init__(self, resize_size, crop_size):
        self.transform = transforms.Compose([
            transforms.Resize(resize_size, antialias=True),
            transforms.CenterCrop(crop_size),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])

    def __call__(self, image):
        return self.transform(image)


class SeededTransform(Dataset):
    """Applies `transform` to `base[index]` under a torch seed fixed by (seed, epoch, index)."""

    def __init__(self, base, transform, seed):
        self.base, self.transform, self.seed, self.epoch = base, transform, seed, 0

    def set_epoch(self, epoch):
        # Workers are re-forked every epoch (no persistent_workers), so they see this.
        self.epoch = epoch

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        image, label = self.base[index]
        sample_seed = ((self.seed * 1_000_003 + self.epoch) * 10_000_019 + index) % 2**63
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed)
            return self.transform(image), label


class SyntheticImages(Dataset):
    """--dummy: one random image repeated, labels cycling through the classes (throughput only)."""

    def __init__(self, length, image_size, num_classes=1000):
        self.length, self.num_classes = length, num_classes
        self.image = torch.randn(3, image_size, image_size, generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.image, index % self.num_classes


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can begin an epoch part-way: after a mid-epoch resume it skips the
    batches already trained on. Batch k of every rank together is batch k of the global order,
    so skipping k batches per rank skips the same k global batches whatever the world size."""

    start = 0  # samples of this rank's shard to skip in the current epoch

    def set_epoch(self, epoch, start=0):
        super().set_epoch(epoch)
        self.start = start

    def __iter__(self):
        return iter(list(super().__iter__())[self.start:])

    def __len__(self):
        return self.num_samples - self.start


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


def _has_image(folder):
    for _, _, files in os.walk(folder):
        if any(name.lower().endswith(IMG_EXTENSIONS) for name in files):
            return True
    return False


def check_image_folder(root):
    """Raise UsageError unless root/train and root/val are ImageFolders with the same, non-empty classes."""
    root = Path(root)
    if not root.is_dir():
        raise UsageError(f"--data {root}: no such directory")
    classes = {}
    for split in ("train", "val"):
        folder = root / split
        if not folder.is_dir():
            raise UsageError(f"--data {root} has no {split}/ folder: expected {root}/{{train,val}}/<class>/<image>")
        classes[split] = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
        if not classes[split]:
            raise UsageError(f"{folder} has no class folders: expected {folder}/<class>/<image>")
        empty = [name for name in classes[split] if not _has_image(folder / name)]
        if empty:
            raise UsageError(f"class folder(s) {', '.join(empty)} in {folder} hold no images "
                             f"({', '.join(IMG_EXTENSIONS[:3])}, ...): add images or remove the folder")
    if classes["train"] != classes["val"]:
        only_train = sorted(set(classes["train"]) - set(classes["val"]))
        only_val = sorted(set(classes["val"]) - set(classes["train"]))
        raise UsageError(f"train/ and val/ in {root} have different classes "
                         f"(only in train: {', '.join(only_train) or '-'}; only in val: {', '.join(only_val) or '-'})")
    return classes["train"]


class Data(NamedTuple):
    classes: list
    train_loader: DataLoader
    val_loader: DataLoader
    train_sampler: ResumableSampler


def build_data(args, seed, rank, world_size, per_process_batch, pin_memory):
    """Datasets and loaders of one process. Single process is rank 0 of world 1."""
    if args.dummy:
        val_length = math.ceil(args.dummy_size * 50_000 / 1_281_167)
        train_set = SyntheticImages(args.dummy_size, args.train_crop_size)
        val_set = SyntheticImages(val_length, args.val_crop_size)
        classes = [str(i) for i in range(train_set.num_classes)]
    else:
        root = Path(args.data) if args.data else ensure_demo_dataset()
        args.data = str(root)
        classes = check_image_folder(root)
        train_set = SeededTransform(datasets.ImageFolder(root / "train"),
                                    TrainPreset(args.train_crop_size, args.min_crop_scale), seed)
        val_set = datasets.ImageFolder(root / "val", EvalPreset(args.val_resize_size, args.val_crop_size))
    # The same permutation (seed + epoch) on every rank; rank r takes every world_size-th
    # index, so batch k of all ranks together is batch k of a single process.
    train_sampler = ResumableSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    # The loaders draw their worker seeds from generators of their own, not from the global RNG
    # (which dropout uses), so a resumed run's RNG stream stays that of an uninterrupted one.
    loader_options = dict(num_workers=args.workers, pin_memory=pin_memory, worker_init_fn=ignore_stop_signals)
    train_loader = DataLoader(train_set, batch_size=per_process_batch, sampler=train_sampler,
                              generator=torch.Generator().manual_seed(seed), **loader_options)
    val_loader = DataLoader(val_set, batch_size=per_process_batch, sampler=ShardSampler(len(val_set), rank, world_size),
                            generator=torch.Generator().manual_seed(seed), **loader_options)
    return Data(classes, train_loader, val_loader, train_sampler)

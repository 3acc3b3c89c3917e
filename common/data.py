"""The data of one process, assembled: the datasets checked and wrapped with the skipping of unreadable items and
seeded per-image transforms, sampled exactly and resumably, in DataLoaders whose batches DeviceLoader takes on.

A file that cannot be decoded is skipped and named (or ends the run: --strict-data): in training another image takes its
place, so batches keep their size; in validation it is left out. At each checkpoint the ranks pool the files into
OUTPUT/bad_images.txt. A validation that cannot read more than MAX_UNREADABLE_SHARE of its images ends the run.
"""

import functools
import hashlib
import math
import multiprocessing
import os
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

from . import device_loader, distributed
from .augment import image_augmentation
from .config import PRESETS
from .datasets import (
    HFImages,
    ImageFiles,
    ItemCheck,
    ShardedImages,
    SyntheticImages,
    describe,
    first_item,
)
from .device_loader import Collate
from .errors import PROGRAMMING_ERRORS, Preempted, UnreadableImage, UsageError, printable, say, wrong_return
from .preemption import SafeLoader, ignore_stop_signals
from .samplers import RepeatedAugmentationSampler, ResumableSampler, ShardSampler
from .transforms import EvalPreset, Normalise, SeededTransform, TrainPreset, choose_normalisation


def per_process_batch(batch_size, world_size):
    """-b is the global batch: each of the world_size processes takes an equal share."""
    if batch_size % world_size:
        raise UsageError(
            f"--batch-size {batch_size} is the global batch and must divide evenly "
            f"over {world_size} processes: use a multiple of {world_size}"
        )
    return batch_size // world_size


def micro_batch(batch_size, world_size, accumulate):
    """What one process's loader gives at a time: its share of the global batch, split into `accumulate`
    (--grad-accum-steps) micro-batches of one optimizer step."""
    share = per_process_batch(batch_size, world_size)
    if share % accumulate:
        raise UsageError(
            f"--grad-accum-steps {accumulate} must divide each process's share of the global batch "
            f"(-b {batch_size} over {world_size} process(es): {share})"
        )
    return share // accumulate


def single_image_on_a_device(images, devices):
    """Whether a batch of `images` split over `devices` as DataParallel splits it (Tensor.chunk) leaves some device a
    single image: BatchNorm fails on one where it sees 1x1 activations ("Expected more than 1 value per channel")."""
    share = math.ceil(images / devices)
    return images > 0 and (share == 1 or images % share == 1)


def last_batch_for(data, model, devices):
    """`data` with its train loader dropping the epoch's last batch where that batch would leave a device a single
    image and `model` has BatchNorm layers, which fail on one where they see 1x1 activations (not known before the
    forward: one image of the epoch left out; a model without BatchNorm keeps it). One line where no batch is left."""
    loader = data.train_loader
    if len(loader) == 0:  # (--compile drops the last partial batch: a batch of another size compiles another graph)
        raise UsageError(
            f"each process trains on {data.train_sampler.num_samples} image(s) an epoch, fewer than its batch of "
            f"{loader.batch_size}, and --compile leaves out the last partial batch: no step would run; use a smaller -b"
        )
    last = data.train_sampler.num_samples % loader.batch_size
    if loader.drop_last or not single_image_on_a_device(last, devices) or not has_batch_norm(model):
        return data
    if data.train_sampler.num_samples < loader.batch_size:  # that batch is all there is
        raise UsageError(
            f"each process trains on {data.train_sampler.num_samples} image(s) an epoch, and a device would have a "
            "single one, on which the model's BatchNorm fails where it sees 1x1 activations: use more images, or fewer "
            "processes or GPUs"
        )
    return data._replace(train_loader=data.make_train_loader(drop_last=True))


def has_batch_norm(model):
    """Whether `model` has BatchNorm layers (torch's own base class of all of them: SyncBatchNorm's and lazy ones too;
    not torchvision's FrozenBatchNorm2d)."""
    return any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules())


# -j auto's most workers per process: 8 could not feed one H100 training ResNet-50, 15 could (docs/benchmarks.md).
MAX_AUTO_WORKERS = 16


def loader_workers(requested, processes_on_node, cores=None):
    """-j: `requested`, or for 'auto' the usable cores (CPU affinity) shared among this node's processes, one kept
    for each process itself, at most MAX_AUTO_WORKERS each; at least 1 when there is a core to spare."""
    if requested != "auto":
        return requested
    cores = cores or distributed.usable_cores()
    share = cores // max(processes_on_node, 1) - 1
    spare = cores > processes_on_node
    return min(MAX_AUTO_WORKERS, max(share, 1 if spare else 0))


class Data(NamedTuple):
    classes: list
    train_loader: DataLoader
    val_loader: DataLoader
    train_sampler: ResumableSampler
    normalise: Normalise  # what makes the loaders' images the model's inputs (on the device: DeviceLoader)
    first_image: tuple  # (channels, height, width, dtype) of the first training image; None: none read
    normalisation: str  # what the header says of `normalise` and where it came from
    make_train_loader: Callable  # train_loader made again: (drop_last) -> DataLoader


def default_transforms(config, floating, mean):
    """(train, val) transforms of the flags: crop, flip and the recipe's augmentation; resize and centre crop.
    Random erasing fills with the mean pixel on the images' scale (`floating`: 0-1, else 0-255)."""
    fill = tuple(mean) if floating else tuple(round(255 * m) for m in mean)
    augmentation = image_augmentation(
        config.auto_augment,
        config.ra_magnitude,
        config.random_erase,
        config.interpolation,
        config.augmix_severity,
        fill=fill,
    )
    train = TrainPreset(
        config.train_crop_size,
        config.min_crop_scale,
        augmentation=augmentation,
        res_schedule=config.crop_schedule,
        interpolation=config.interpolation,
        hflip_prob=config.hflip_prob,
    )
    return train, EvalPreset(config.val_resize_size, config.val_crop_size, config.val_interpolation)


def given_flags(config):
    """The default training transform's flags this run gives (a preset's too), as written: {name: text}."""
    default_scale = PRESETS[config.data_preset]["min_crop_scale"]
    return {
        name: text
        for name, text, given in [
            ("auto_augment", f"--auto-augment {config.auto_augment}", config.auto_augment != "none"),
            ("random_erase", f"--random-erase {config.random_erase:g}", config.random_erase > 0),
            ("res_schedule", f"--res-schedule {config.res_schedule}", bool(config.res_schedule)),
            ("hflip_prob", f"--hflip-prob {config.hflip_prob:g}", config.hflip_prob != 0.5),
            ("min_crop_scale", f"--min-crop-scale {config.min_crop_scale:g}", config.min_crop_scale != default_scale),
        ]
        if given
    }


def from_preset(config):
    return f" (some from --preset {config.preset})" if config.preset else ""


def check_replaced(config, train):
    """A training transform that is not a TrainPreset (build_transforms replaced it) applies none of the default's
    flags: refused in one line where one is given."""
    unapplied = list(given_flags(config).values())
    if unapplied and not isinstance(train, TrainPreset):
        raise UsageError(
            f"build_transforms replaced the training transform, which does not apply {', '.join(unapplied)}"
            f"{from_preset(config)}: extend the default one instead (train.then(...)), or leave those flags out"
        )


def check_device_decode(config, datasets, train, val):
    """--decode gpu: our image sets' JPEGs, transformed on the device by the default transforms; else one line."""
    if device_loader.decode_jpeg is None:
        import torchvision

        raise UsageError(
            f"--decode gpu needs torchvision.io.decode_jpeg, which torchvision {torchvision.__version__} lacks"
        )
    _, train_set, val_set = datasets
    for split, dataset in (("train", train_set), ("val", val_set)):
        if type(dataset) not in (ImageFiles, ShardedImages, HFImages):  # (a subclass may read its files its own way)
            raise UsageError(
                f"--decode gpu decodes the image files of --data, and the {split} set is a {type(dataset).__name__}: "
                "leave --decode gpu out"
            )
    flags = given_flags(config)
    augmenting = " and ".join(flags[name] for name in ("auto_augment", "random_erase") if name in flags)
    other = (
        "build_transforms' own transform"
        if not isinstance(train, TrainPreset)
        else "the transforms added by build_transforms"
        if train.added
        else (augmenting + from_preset(config) if augmenting else "an augmentation of build_transforms' own")
        if train.augmentation is not None
        else None
    )
    if other:
        raise UsageError(
            f"--decode gpu crops and flips on the device after decoding, and runs no other transform; this run has "
            f"{other}, which the loader workers run on decoded images: leave --decode gpu out"
        )
    if not isinstance(val, EvalPreset):
        raise UsageError("--decode gpu resizes and crops on the device: build_transforms replaced the validation one")


def _wrapped(config, datasets, first, mean, seed, build_transforms):
    """The train and val sets as the loaders read them: unreadable items skipped (SkipUnreadable), a dataset's items
    checked, each image transformed with its own seed."""
    classes, train_set, val_set = datasets
    floating = bool(first and first[3].is_floating_point)
    pair = build_transforms(*default_transforms(config, floating, mean))
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise wrong_return(pair, "build_transforms(train, val)", "(train, val)")
    train_transform, val_transform = pair
    check_replaced(config, train_transform)
    if config.auto_augment != "none" and first and first[0] not in (1, 3):  # (was a traceback when an op drew colour)
        raise UsageError(
            f"--auto-augment {config.auto_augment} takes images of 1 or 3 channels, as torchvision's policies do; "
            f"the data's have {first[0]}: leave it out, or give build_transforms your own"
        )
    if config.decode == "gpu":
        check_device_decode(config, datasets, train_transform, val_transform)
        train_set.defer_jpegs = val_set.defer_jpegs = True

    def skipping(dataset, split, replace):
        check = (
            None if isinstance(dataset, ImageFiles) else ItemCheck(len(classes), split, first and first[0], floating)
        )
        return SkipUnreadable(dataset, replace, config.strict_data, check)

    return (
        SeededTransform(skipping(train_set, "train", True), train_transform, seed),
        SeededTransform(skipping(val_set, "val", False), val_transform, seed),
    )


def build_data(config, datasets, seed, runtime, build_transforms=lambda train, val: (train, val)):
    """The loaders of one process over `datasets` ((classes, train set, val set) of (image, label) items), checked,
    transformed (by what `build_transforms` makes of the defaults) and sampled. On a GPU the batches stay as decoded
    for DeviceLoader to normalise there; on the CPU the loader workers normalise them."""
    classes, train_set, val_set = datasets
    classes, synthetic = list(classes), isinstance(train_set, SyntheticImages)
    if len(classes) < 2:  # (one class would train to a loss of 0 and an accuracy of 100% that mean nothing)
        raise UsageError(
            f"the data has {len(classes)} class{'es' * (len(classes) != 1)} {classes}: a classifier needs 2 or more"
        )
    first = None if synthetic else first_item(train_set, "train", len(classes))
    if not synthetic:
        first_item(val_set, "val", len(classes))
    mean, std, source = choose_normalisation(config, train_set, first[0] if first else 3)  # (ours are RGB)
    if not synthetic:
        train_set, val_set = _wrapped(config, (classes, train_set, val_set), first, mean, seed, build_transforms)
    # The same permutation (seed + epoch) on every rank; rank r takes every world_size-th
    # index, so batch k of all ranks together is batch k of a single process.
    rank, world_size = runtime.rank, runtime.world_size
    if config.ra_sampler:
        train_sampler = RepeatedAugmentationSampler(train_set, world_size, rank, config.ra_reps, seed=seed)
    else:
        train_sampler = ResumableSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    normalise, gpu = Normalise(mean, std), runtime.device.type == "cuda"
    workers = loader_workers(config.workers, runtime.local_world_size)
    # The loaders draw their worker seeds from generators of their own, not from the global RNG
    # (which dropout uses), so a resumed run's RNG stream stays that of an uninterrupted one.
    options = dict(
        num_workers=workers,
        pin_memory=gpu,
        worker_init_fn=ignore_stop_signals,
        # On the CPU the workers also normalise; on a GPU (or decoded on the device) the batch goes there as it is.
        collate_fn=Collate(normalise=None if gpu or config.decode == "gpu" else normalise),
        batch_size=micro_batch(config.batch_size, world_size, config.grad_accum_steps),
    )
    if workers and "fork" in multiprocessing.get_all_start_methods():
        # Forked workers start in milliseconds every epoch; a process made by mp.spawn would
        # otherwise spawn them too, re-importing torch each epoch.
        options["multiprocessing_context"] = "fork"
    # Compiled, a last partial batch would cost a second graph (a recompilation) every epoch: dropped.
    train_loader = functools.partial(
        SafeLoader, train_set, sampler=train_sampler, generator=torch.Generator().manual_seed(seed), **options
    )
    val_loader = SafeLoader(
        val_set,
        sampler=ShardSampler(len(val_set), rank, world_size),
        generator=torch.Generator().manual_seed(seed),
        **options,
    )
    text = f"mean {', '.join(f'{m:.4g}' for m in mean)}, std {', '.join(f'{s:.4g}' for s in std)} ({source})"
    return Data(
        classes, train_loader(drop_last=config.compile), val_loader, train_sampler, normalise, first, text, train_loader
    )


def items_digest(loader):
    """KIND:DIGEST of the names and labels of a loader's items (a folder's files under their class folders, shards'
    keys, a CSV split's paths under their common prefix; a Hugging Face split's labels alone), computed once; None for
    a dataset of one's own. A resume mid-epoch compares it where KIND is the same (as many other files would have it
    skip other images than it trained on); a folder resumed on its shards or its CSV split is not compared."""
    dataset = loader.dataset
    while isinstance(dataset, (SeededTransform, SkipUnreadable)):
        dataset = dataset.base if isinstance(dataset, SeededTransform) else dataset.dataset
    samples = dataset.samples if isinstance(dataset, ImageFiles) else None
    if not (isinstance(samples, list) or hasattr(samples, "labels")):
        return None
    if getattr(dataset, "_items_digest", None) is None:  # (once: its items stay the run's)
        if isinstance(samples, list):  # (path, label) rows: their paths under the folder they share (it may move)
            paths = [str(path) for path, _ in samples]
            prefix = len(os.path.commonprefix(paths) if len(paths) > 1 else os.path.dirname(paths[0]))
            names = "\0".join(path[prefix:] for path in paths).encode(errors="surrogateescape")
            labels = [label for _, label in samples]
        else:
            names, labels = getattr(getattr(samples, "names", None), "blob", b""), samples.labels
        digest = hashlib.blake2b(names, digest_size=16)
        digest.update(np.asarray(labels, dtype=np.int64).tobytes())
        dataset._items_digest = f"{type(samples).__name__}:{digest.hexdigest()}"
    return dataset._items_digest


def other_items(saved, now):
    """Whether two items_digest results name other items of one kind (None, or two kinds: not compared)."""
    return None not in (saved, now) and saved.split(":")[0] == now.split(":")[0] and saved != now


# Files that cannot be decoded.

MAX_IN_A_ROW = 50  # more consecutive failures than this is no broken file but unreadable data (or a bug)
MAX_UNREADABLE_SHARE = 0.1  # of the validation set: more is no broken file but an unreadable set


class SkipUnreadable(Dataset):
    """(image, label, bad) for each item of `dataset`, `bad` the (name, reason) of the items that could not be read
    on the way (named by the dataset's name(i), else "Class[i]"); `check`: an ItemCheck. PROGRAMMING_ERRORS are
    raised. replace=True (training): the next readable item takes a bad one's place; replace=False (validation):
    image is None. strict=True: UnreadableImage instead."""

    def __init__(self, dataset, replace, strict, check=None):
        self.dataset, self.replace, self.strict, self.check = dataset, replace, strict, check

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        bad = []
        for attempt in range(MAX_IN_A_ROW):
            position = (index + attempt) % len(self.dataset)
            try:
                item = self.dataset[position]
                image, label = item if self.check is None else self.check(item, position)
                return image, label, bad
            except (MemoryError, Preempted, *PROGRAMMING_ERRORS):  # (Preempted: a stop signal while waiting for a file)
                raise
            except Exception as error:  # decoders raise OSError, ValueError, RuntimeError, SyntaxError, ...
                named = hasattr(self.dataset, "name")
                path = self.dataset.name(position) if named else f"{type(self.dataset).__name__}[{position}]"
                if self.strict:
                    raise UnreadableImage(
                        f"cannot decode {printable(path)} ({describe(error)}); without --strict-data "
                        "such files are skipped and listed in bad_images.txt"
                    ) from None
                bad.append((path, describe(error)))
                if not self.replace:
                    return None, None, bad
        raise UnreadableImage(
            f"{MAX_IN_A_ROW} files in a row cannot be decoded, from {printable(bad[0][0])} on "
            f"({bad[0][1]}): is the data set readable?"
        )


class BadImageLog:
    """What the run could not read in the epoch in progress; a warning line the first time each file is met."""

    def __init__(self, rank, world_size):
        self.prefix = f"rank {rank}: " if world_size > 1 else ""
        self.found = {}  # path -> reason, this epoch, of every rank as of the last sync and of this one since
        self.new = {}  # this process's since the last sync: all that sync() gathers
        self.warned = set()
        self.in_validation = {}  # this process's, this epoch: check_validation's example is one of them

    def report_validation(self, bad):
        self.in_validation.update(bad)
        self.report(bad)

    def report(self, bad):
        for path, reason in bad:
            if path not in self.found:
                self.found[path] = self.new[path] = reason
            if path not in self.warned:
                self.warned.add(path)
                say(f"warning: {self.prefix}skipped {printable(path)}: cannot decode it ({reason})")

    def next_epoch(self):
        """Files that could not be read are read again; the list starts afresh."""
        self.found, self.new, self.in_validation = {}, {}, {}

    def sync(self):
        """Pool every rank's findings since the last sync (a collective: all ranks call it at the same point).
        Returns the sorted [path, reason] pairs of the epoch."""
        for found in distributed.all_gather_object(self.new):
            self.found.update(found)
        self.new = {}
        return sorted([path, reason] for path, reason in self.found.items())

    def state_dict(self):
        """The epoch's files so far, of every rank (a collective: sync)."""
        return self.sync()

    def load_state_dict(self, found):
        self.found = dict(found)
        self.warned |= set(self.found)

    def check_validation(self, counted, total):
        """UsageError when a validation counted none of its `total` images, or left out more than
        MAX_UNREADABLE_SHARE of them. Call it on every rank, with the counts of all."""
        unread = total - counted
        if total and (counted == 0 or unread > MAX_UNREADABLE_SHARE * total):
            # one of validation's own unread files (the epoch's training found others), of any rank: a collective,
            # here where every rank raises
            example = next(
                filter(None, distributed.all_gather_object(next(iter(self.in_validation.items()), None))), None
            )
            raise UsageError(
                f"validation could not read {unread} of its {total} images"
                + (f" (e.g. {printable(example[0])}: {example[1]})" if example else "")
                + f", more than {MAX_UNREADABLE_SHARE:.0%}: its accuracy would mean nothing; is the data "
                "set readable? (after a transient outage, --resume auto goes on from the last checkpoint)"
            )

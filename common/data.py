"""Datasets, transforms, samplers and loaders.

Images stay uint8 from decoding to the device (DeviceLoader normalises them there).
Two properties the scripts rely on:
- Augmentation is seeded per image from (seed, epoch, index), so an image gets
  the same crop (and auto-augment, erasing) whichever process or loader worker reads it:
  DP, DDP and spawn see the same batches for the same seed and global batch.
- Validation is sharded without padding (ShardSampler), so each image is
  counted exactly once whatever the world size.
Every sample is (image, label, bad): `bad` lists the files that could not be decoded on the way
(common/bad_images.py); the loader's batches are (images, target, bad).
"""
import csv
import math
import multiprocessing
import os
import random
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate
from torch.utils.data.distributed import DistributedSampler
try:  # deprecated since torchvision 0.29 (TorchCodec takes over); PIL decodes when it is gone
    from torchvision.io import ImageReadMode, decode_image, read_file
except ImportError:
    decode_image = None
from torchvision.transforms.v2 import functional as F

from . import agreement, distributed
from .args import ResSchedule
from .augment import image_augmentation, seeded
from .bad_images import BadItem, SkipUnreadable
from .demo_data import ensure_demo_dataset
from .errors import UsageError
from .folder_index import FolderIndex, scan_image_folder
from .named import import_named
from .preemption import ignore_stop_signals, waiting_for_data

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def load_image(path):
    """An RGB image as a uint8 CHW tensor. JPEG and PNG are decoded by torchvision.io
    (libjpeg-turbo, about 2.7x faster than PIL here: docs/benchmarks.md); other formats, and
    files it cannot decode, go through PIL (whose error names a broken file)."""
    if decode_image is not None and path.lower().endswith((".jpg", ".jpeg", ".png")):
        try:
            image = decode_image(read_file(path), mode=ImageReadMode.RGB)
        except RuntimeError:
            pass
        else:  # a 16-bit PNG decodes to uint16
            return image if image.dtype == torch.uint8 else F.to_dtype(image, torch.uint8, scale=True)
    with open(path, "rb") as file:
        return F.pil_to_tensor(Image.open(file).convert("RGB"))


class TrainPreset:
    """RandomResizedCrop + horizontal flip on uint8, then `augmentation` (image_augmentation(): auto-augment,
    random erasing), in the order of torchvision's presets. Every draw comes from `rng` (a random.Random):
    crop and flip directly, the augmentation from a torch seed drawn after them (so crop and flip are
    those of a run without augmentation), so the result depends on nothing but the seed it was given.
    res_schedule (a ResSchedule): the crop size follows set_epoch."""

    def __init__(self, crop_size, min_scale=0.08, ratio=(3 / 4, 4 / 3), augmentation=None, res_schedule=None,
                 interpolation="bilinear"):
        self.crop_size, self.scale, self.log_ratio = crop_size, (min_scale, 1.0), (math.log(ratio[0]), math.log(ratio[1]))
        self.interpolation = F.InterpolationMode(interpolation)
        self.augmentation, self.res_schedule = augmentation, res_schedule
        if res_schedule is not None:
            self.set_epoch(0)

    def set_epoch(self, epoch):
        if self.res_schedule is not None:  # progressive resizing: this epoch's crop size
            self.crop_size = self.res_schedule.size(epoch)

    def crop_box(self, height, width, rng):
        """torchvision's RandomResizedCrop.get_params, drawing from `rng`."""
        area = height * width
        for _ in range(10):
            target_area = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*self.log_ratio))
            w, h = round(math.sqrt(target_area * aspect)), round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                return rng.randint(0, height - h), rng.randint(0, width - w), h, w
        ratio = width / height  # fall back to a central crop of the allowed aspect range
        if ratio < math.exp(self.log_ratio[0]):
            w, h = width, round(width / math.exp(self.log_ratio[0]))
        elif ratio > math.exp(self.log_ratio[1]):
            h, w = height, round(height * math.exp(self.log_ratio[1]))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, image, rng):
        top, left, height, width = self.crop_box(*image.shape[-2:], rng)
        image = F.resized_crop(image, top, left, height, width, [self.crop_size, self.crop_size],
                               interpolation=self.interpolation, antialias=True)
        if rng.random() < 0.5:
            image = F.horizontal_flip(image)
        if self.augmentation is not None:
            with seeded(rng):  # torchvision draws from torch's RNG: here a fork of it, seeded from rng
                image = self.augmentation(image)
        return image


class EvalPreset:
    """Resize the short side, centre crop; uint8 in, uint8 out: torchvision's weights.transforms() (ImageClassification)
    but the normalisation, which Collate or DeviceLoader applies to the batch."""

    def __init__(self, resize_size, crop_size, interpolation="bilinear"):
        self.resize_size, self.crop_size = resize_size, crop_size
        self.interpolation = F.InterpolationMode(interpolation)

    def __call__(self, image, _rng=None):
        return F.center_crop(F.resize(image, [self.resize_size], interpolation=self.interpolation, antialias=True),
                             [self.crop_size])


class SeededTransform(Dataset):
    """Applies `transform` to the image of `base[index]` (an (image, label, bad) sample; image None
    for a skipped file) with a random.Random seeded by (seed, epoch, index): an image gets the same
    augmentation whichever process or loader worker reads it, and the global RNGs (which dropout
    uses) are left alone. An index beyond len(base) (RepeatedAugmentationSampler's repeats) reads
    base[index % len(base)] and is seeded by itself: each repeat is augmented differently."""

    def __init__(self, base, transform, seed):
        self.base, self.transform, self.seed, self.epoch = base, transform, seed, 0

    def set_epoch(self, epoch):
        # Workers are re-forked every epoch (no persistent_workers), so they see this.
        self.epoch = epoch
        if hasattr(self.transform, "set_epoch"):
            self.transform.set_epoch(epoch)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        image, label, bad = self.base[index % len(self.base)]
        if image is not None:
            image = self.transform(image, random.Random(f"{self.seed}-{self.epoch}-{index}"))
        return image, label, bad


class SyntheticImages(Dataset):
    """--dummy: one random uint8 image repeated, labels cycling through the classes (throughput only).
    res_schedule (a ResSchedule): the image size follows set_epoch."""

    def __init__(self, length, image_size, num_classes=1000, res_schedule=None):
        self.length, self.num_classes, self.res_schedule = length, num_classes, res_schedule
        self.image = self._image(image_size if res_schedule is None else res_schedule.size(0))

    @staticmethod
    def _image(size):
        generator = torch.Generator().manual_seed(0)
        return torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=generator)

    def set_epoch(self, epoch):
        if self.res_schedule is not None and self.res_schedule.size(epoch) != self.image.shape[-1]:
            self.image = self._image(self.res_schedule.size(epoch))

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.image, index % self.length % self.num_classes, ()


def pixel_stats(device=None, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """mean and std on the 0-255 scale, shaped to broadcast over (N, C, H, W)."""
    def scaled(values):
        return torch.tensor(values, device=device).view(1, len(values), 1, 1) * 255
    return scaled(mean), scaled(std)


def normalise(images, mean, std):
    """uint8 images -> float, normalised: (x - 255 mean) / (255 std)."""
    return images.float().sub_(mean).div_(std)


class Normalise:
    """Images to normalised float32: (x - mean) / std per channel, for uint8 images on the 0-255 scale
    (x / 255 first), for float images as they are (0 to 1). The same arithmetic on the CPU (Collate) and
    on a GPU (DeviceLoader)."""

    def __init__(self, mean=IMAGENET_MEAN, std=IMAGENET_STD, device=None):
        self.mean, self.std = tuple(mean), tuple(std)
        self.mean255, self.std255 = pixel_stats(device, self.mean, self.std)
        self.mean1, self.std1 = self.mean255 / 255, self.std255 / 255

    def to(self, device):
        return Normalise(self.mean, self.std, device)

    def __call__(self, images):
        if images.dtype == torch.uint8:
            return normalise(images, self.mean255, self.std255)
        return (images.float() - self.mean1) / self.std1


class Collate:
    """collate_fn: (images, target, bad) from (image, label, bad) samples, leaving out skipped files
    (images None when all were). normalise (a Normalise; True: ImageNet's) turns the batch into normalised
    floats inside the loader worker: on the CPU, where the main process is the bottleneck and the workers
    have cores to spare."""

    def __init__(self, normalise):
        self.normalise = Normalise() if normalise is True else (normalise or None)

    def __call__(self, samples):
        bad = [entry for _, _, found in samples for entry in found]
        samples = [(image, label) for image, label, _ in samples if image is not None]
        if not samples:
            return None, None, bad
        images, target = default_collate(samples)
        if self.normalise is not None:
            images = self.normalise(images)
        return images, target, bad


class DeviceLoader:
    """The batches of `loader` on `device`, as normalised float images.

    On CUDA, images travel as they were decoded (uint8: a quarter of float32's bytes) and are converted,
    normalised (`normalise`, a Normalise; None: the loader's Collate did it) and made channels-last on the
    GPU, and the copy of the next batch runs on a side stream while the current one computes. On the CPU
    the loader workers have normalised them. The files skipped as undecodable go to on_bad(list of (path, reason))."""

    def __init__(self, loader, device, channels_last=False, on_bad=None, normalise=None):
        self.loader, self.device, self.channels_last, self.on_bad = loader, device, channels_last, on_bad
        self.normalise = normalise.to(device) if normalise is not None else None

    def __len__(self):
        return len(self.loader)

    def _prepare(self, images, target):
        images = images.to(self.device, non_blocking=True)
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if self.normalise is not None:
            images = self.normalise(images)
        return images, target.to(self.device, non_blocking=True)

    def _batches(self):
        """The loader's non-empty (images, target), reporting skipped files on the way."""
        batches = iter(self.loader)
        while True:
            with waiting_for_data():  # a stop signal may end a wait that never ends (a hung file system)
                try:
                    batch = next(batches, None)
                except (EOFError, ConnectionResetError) as error:
                    # A worker that died while handing over a batch (its tensors' shared memory can no longer
                    # be fetched from it): the fault torch reports as "DataLoader worker ... exited unexpectedly".
                    raise RuntimeError(f"DataLoader worker exited unexpectedly while sending a batch "
                                       f"({type(error).__name__})") from None
            if batch is None:
                return
            images, target, bad = batch
            if bad and self.on_bad is not None:
                self.on_bad(bad)
            if images is not None:
                yield images, target

    def __iter__(self):
        if self.device.type != "cuda":
            return (self._prepare(images, target) for images, target in self._batches())
        return self._prefetching()

    def _prefetching(self):
        stream, batches = torch.cuda.Stream(self.device), self._batches()
        stream.wait_stream(torch.cuda.current_stream(self.device))  # mean and std were made on that one

        def load_next():
            batch = next(batches, None)
            if batch is None:
                return None
            with torch.cuda.stream(stream):
                return self._prepare(*batch)

        upcoming = load_next()
        while upcoming is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            images, target = upcoming
            # These tensors were made on the side stream; tell the allocator the main stream uses them.
            images.record_stream(torch.cuda.current_stream(self.device))
            target.record_stream(torch.cuda.current_stream(self.device))
            upcoming = load_next()
            yield images, target


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
        return iter(self.shard()[self.start:])

    def __len__(self):
        return self.num_samples - self.start


class RepeatedAugmentationSampler(ResumableSampler):
    """--ra-sampler: repeated augmentation (Hoffer et al. 2020; torchvision's RASampler). The epoch's
    global order is the seeded permutation of DistributedSampler (seed + epoch) with each image
    `repetitions` times in a row, cut to len(dataset) images, so an epoch has as many steps as without
    it (about len / repetitions different images, each seen `repetitions` times). It is then split as
    DistributedSampler splits (padded to a multiple of the world size, rank r takes positions r, r + world,
    ...): batch k of all ranks together is batch k of a single process whatever the world size, and the
    copies of an image, being consecutive, go to different ranks when world_size >= repetitions.
    Copy j of image i is yielded as the index i + j * len(dataset), which SeededTransform reads as image i
    seeded by that number: every copy is augmented differently, and copy 0 as without this sampler.
    Unlike torchvision's RASampler the epoch is not rounded down to a multiple of 256 images."""

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
        return order[self.rank:self.total_size:self.num_replicas]


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


def loader_workers(requested, processes_on_node, cores=None):
    """-j: `requested`, or for 'auto' the usable cores (CPU affinity: what Slurm or a container allows)
    shared among the processes of this node, keeping one core for each process itself, at most 8 each;
    at least 1 when there is a core to spare (2 cores, 1 process: 1 worker; 2 cores, 2 processes: 0)."""
    if requested != "auto":
        return requested
    cores = cores or distributed.usable_cores()
    share = cores // max(processes_on_node, 1) - 1
    spare = cores > processes_on_node
    return min(8, max(share, 1 if spare else 0))


class Data(NamedTuple):
    classes: list
    train_loader: DataLoader
    val_loader: DataLoader
    train_sampler: ResumableSampler
    normalise: "Normalise"  # what makes the loaders' images the model's inputs (on the device: DeviceLoader)
    first_image: tuple  # (channels, height, width, dtype) of the first training image; None: none read


class ImageFiles(Dataset):
    """(image, label) of each (path, label) of `samples` (a FolderIndex, a list), the file decoded by
    load_image. Its files may be unreadable: SkipUnreadable skips them (common/bad_images.py)."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, label = self.samples[index]
        return load_image(path), label

    def name(self, index):
        return self.samples[index][0]


def read_split_file(path, root):
    """[(path, class name)] of a CSV or TSV split file: rows `path,label` (a first row `path,label` is a
    header), paths relative to `root` (the file's folder) unless absolute."""
    delimiter = "\t" if path.suffix == ".tsv" else ","
    rows = []
    try:
        with open(path, newline="") as file:
            for number, row in enumerate(csv.reader(file, delimiter=delimiter), start=1):
                if not row or (number == 1 and [cell.strip().lower() for cell in row] == ["path", "label"]):
                    continue
                if len(row) != 2 or not row[0].strip() or not row[1].strip():
                    raise UsageError(f"{path} line {number}: expected path{delimiter}label, got {delimiter.join(row)!r}")
                rows.append((os.path.join(root, row[0].strip()), row[1].strip()))
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None
    if not rows:
        raise UsageError(f"{path} lists no images: expected lines path{delimiter}label")
    return rows


def split_files(root):
    """{split: path} of the CSV or TSV split files in `root` (train.csv and val.csv, or .tsv), or None."""
    for suffix in (".csv", ".tsv"):
        found = {split: Path(root) / f"{split}{suffix}" for split in ("train", "val")}
        if any(path.is_file() for path in found.values()):
            missing = [path.name for path in found.values() if not path.is_file()]
            if missing:
                raise UsageError(f"--data {root} has {'train' if 'val' in missing[0] else 'val'}{suffix} but no "
                                 f"{missing[0]}: give both splits")
            return found
    return None


def scan_split_files(root):
    """The classes (sorted names of the train split's labels) and (path, label) samples of root/train.csv and
    root/val.csv (or .tsv); UsageError for a val label that training never sees."""
    rows = {split: read_split_file(path, root) for split, path in split_files(root).items()}
    classes = sorted({label for _, label in rows["train"]})
    index = {name: k for k, name in enumerate(classes)}
    unknown = sorted({label for _, label in rows["val"]} - index.keys())
    if unknown:
        raise UsageError(f"val labels {', '.join(unknown[:5])} of {root} do not occur in its train split")
    return classes, *([(path, index[label]) for path, label in rows[split]] for split in ("train", "val"))


def build_datasets(args):
    """(classes, train set, val set) of the data the flags name: --dummy's synthetic images; --dataset
    package.module:function's (called as function(args)); --data's train.csv / val.csv (or .tsv); --data's
    train/ and val/ image folders; else the built-in demo set. A set's items are (image, label)."""
    if args.dummy:
        res_schedule = ResSchedule.parse(args.res_schedule) if getattr(args, "res_schedule", None) else None
        val_length = math.ceil(args.dummy_size * 50_000 / 1_281_167)
        train_set = SyntheticImages(args.dummy_size, args.train_crop_size, res_schedule=res_schedule)
        return [str(i) for i in range(train_set.num_classes)], train_set, SyntheticImages(val_length, args.val_crop_size)
    function = import_named(getattr(args, "dataset_fn", None) or "", "--dataset")
    if function is not None:
        result = function(args)
        if not (isinstance(result, (tuple, list)) and len(result) == 3):
            raise UsageError(f"--dataset {args.dataset_fn} returned {type(result).__name__}: return "
                             "(classes, train_set, val_set)")
        return tuple(result)
    root = Path(args.data) if args.data else ensure_demo_dataset()
    args.data = str(root)
    # Rank 0 lists the folder (or reads the split files), once for the job (1.33 M files on ImageNet).
    scan = scan_split_files if root.is_dir() and split_files(root) else scan_image_folder
    classes, train_files, val_files = distributed.computed_by_rank_0(lambda: scan(root))
    train_files, val_files = this_node_s_copy(root, classes, train_files, val_files)
    return classes, ImageFiles(train_files), ImageFiles(val_files)


def _first_difference(split, classes, own, rank_0s):
    """Where this node's FolderIndex of `split` differs from rank 0's, in words; None where they list the same files."""
    if own.blob == rank_0s.blob and np.array_equal(own.labels, rank_0s.labels):
        return None
    here, there = (np.bincount(index.labels, minlength=len(classes)) for index in (own, rank_0s))
    for name, count_here, count_there in zip(classes, here, there):
        if count_here != count_there:
            return f"{split}/{name}: {count_here} images here, {count_there} on rank 0"
    return f"{split}/: the same number of images per class, of other names"


def this_node_s_copy(root, classes, train_files, val_files):
    """The samples at this rank's --data. A node may hold its copy of an image folder at another path than rank
    0's (a node-local disk): it lists its copy, which must hold the files of rank 0's, name for name, else every
    rank stops with one line naming the first difference. A collective; with one --data path for all, nothing more."""
    roots = distributed.all_gather_object(str(root))
    if all(other == roots[0] for other in roots):
        return train_files, val_files
    error = None
    if str(root) != roots[0]:
        where = f"--data {root} (rank 0: {roots[0]})"
        if not isinstance(train_files, FolderIndex):
            error = (f"{where}: with train.csv / val.csv every node gives the same --data path (the files' paths are read "
                     "from them); copies at other paths are for image folders")
        else:
            try:
                own = scan_image_folder(root)
                difference = (f"classes {', '.join(own.classes[:3])}, ... here" if own.classes != classes else
                              _first_difference("train", classes, own.train, train_files)
                              or _first_difference("val", classes, own.val, val_files))
            except UsageError as failure:
                own, difference = None, str(failure)
            if difference:
                error = f"{where} holds other files than rank 0's ({difference}): every node's copy must hold the same files"
            else:
                train_files, val_files = own.train, own.val
    agreement.raise_any(error)
    return train_files, val_files


def describe_item(item):
    return (f"a {type(item).__name__} of {len(item)}" if isinstance(item, (tuple, list)) else f"a {type(item).__name__}")


class ItemCheck:
    """A dataset item as the loaders need it: an (image, label) pair, the image a CHW tensor (a PIL image
    converted to RGB, then to uint8; a tensor uint8 or float, kept), with the channels and kind (uint8 or
    float) of the first; the label an int below num_classes. Anything else: BadItem, one line."""

    def __init__(self, num_classes, split, channels=None, floating=None):
        self.num_classes, self.split, self.channels, self.floating = num_classes, split, channels, floating

    def __call__(self, item, index):
        where = f"item {index} of the {self.split} set"
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise BadItem(f"{where} is {describe_item(item)}; items must be (image, label)")
        image, label = item
        if isinstance(image, Image.Image):
            image = F.pil_to_tensor(image.convert("RGB"))
        elif isinstance(image, torch.Tensor):
            if image.ndim != 3 or not 1 <= image.shape[0] <= 4:
                raise BadItem(f"{where}: an image of shape {list(image.shape)}; expected channels x height x width "
                              "(CHW, 1 to 4 channels): permute an HWC image with image.permute(2, 0, 1)")
            if image.is_floating_point():
                image = image.float()
            elif image.dtype != torch.uint8:
                raise BadItem(f"{where}: an image of dtype {image.dtype}; expected uint8 (0-255) or float (0-1)")
        else:
            raise BadItem(f"{where}: the image is {describe_item(image)}; expected a PIL image or a CHW tensor"
                          + (" (torch.from_numpy(array).permute(2, 0, 1) for an HWC array)"
                             if type(image).__name__ == "ndarray" else ""))
        if self.channels is not None and (image.shape[0], image.is_floating_point()) != (self.channels, self.floating):
            raise BadItem(f"{where}: a {'float' if image.is_floating_point() else 'uint8'} image of {image.shape[0]} "
                          f"channel(s), after {'float' if self.floating else 'uint8'} images of {self.channels}: "
                          "give every image the same channels and dtype")
        if isinstance(label, torch.Tensor) and label.numel() == 1 and not label.is_floating_point():
            label = label.item()
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < self.num_classes:
            raise BadItem(f"{where}: label {label!r}; expected a class index, an int in 0..{self.num_classes - 1}")
        return image, label


def first_item(dataset, split, num_classes):
    """(channels, height, width, dtype) of item 0 of a user's `dataset`, checked: one line (BadItem) naming
    what is wrong with it. None for image files (--data's), which the loader workers read and check."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise UsageError(f"the {split} set is a {type(dataset).__name__}: give a map-style dataset (len() and [i]); "
                         "the samplers index it, for shards, resume and exact validation")
    if len(dataset) == 0:
        raise UsageError(f"the {split} set is empty")
    if isinstance(dataset, ImageFiles):  # ours: not read here, where a hung file system would block the start
        return None
    image, _ = ItemCheck(num_classes, split)(dataset[0], 0)
    return (image.shape[0], *image.shape[-2:], image.dtype)


def dataset_normalisation(args, train_set, channels):
    """(mean, std, source) of normalisation: --mean/--std, else the train set's own `mean` and `std`
    attributes, else ImageNet's for 3-channel images; UsageError for other channels or a length that is not
    theirs."""
    given = {name: getattr(args, name, None) for name in ("mean", "std")}
    found = {name: given[name] or getattr(train_set, name, None) for name in given}
    if all(found.values()):
        source = "--mean/--std" if all(given.values()) else ("the dataset's mean/std" if not any(given.values())
                                                             else "--mean/--std and the dataset's")
    elif any(found.values()):
        missing = next(name for name, value in found.items() if not value)
        raise UsageError(f"--{missing} is missing: give --mean and --std together (or both as dataset attributes)")
    elif channels in (None, 3):
        return IMAGENET_MEAN, IMAGENET_STD, "ImageNet's"
    else:
        raise UsageError(f"the images have {channels} channel(s): give --mean and --std with {channels} value(s) each "
                         "(or set train_set.mean and .std), as ImageNet's are for 3")
    mean, std = (tuple(float(value) for value in found[name]) for name in ("mean", "std"))
    if len(mean) != len(std) or (channels is not None and len(mean) != channels):
        raise UsageError(f"mean {mean} and std {std} must have one value per image channel ({channels})")
    if min(std) <= 0:
        raise UsageError(f"std {std} must be positive")
    return mean, std, source


def build_data(args, seed, rank, world_size, per_process_batch, gpu, datasets=None):
    """Datasets and loaders of one process (single process is rank 0 of world 1). `datasets`: (classes, train
    set, val set) of (image, label) items (Trainer.build_datasets), else build_datasets(args). The library wraps
    them: seeded transforms, skipping of unreadable items, the resumable sampler, exact validation. With gpu=True
    the batches stay as decoded (pinned) for DeviceLoader to copy and normalise; else normalised floats."""
    # Options added after the first release: a Namespace from an older checkpoint or a direct caller may
    # lack them (or hold None).
    def option(name, default):
        value = getattr(args, name, None)
        return default if value is None else value
    res_schedule = ResSchedule.parse(args.res_schedule) if option("res_schedule", None) else None
    classes, train_set, val_set = datasets if datasets is not None else build_datasets(args)
    classes = list(classes)
    synthetic = isinstance(train_set, SyntheticImages)
    first = None if synthetic else first_item(train_set, "train", len(classes))
    if not synthetic:
        first_item(val_set, "val", len(classes))
    mean, std, source = dataset_normalisation(args, train_set, first[0] if first else None)
    args.normalisation = f"mean {', '.join(f'{m:.4g}' for m in mean)}, std {', '.join(f'{s:.4g}' for s in std)} ({source})"
    if not synthetic:
        floating = bool(first and first[3].is_floating_point)
        fill = tuple(mean) if floating else tuple(round(255 * m) for m in mean)
        # A file that cannot be decoded: in training the next one takes its place (every batch keeps its
        # size); in validation it is left out (no image is counted twice). --strict-data: an error.
        augmentation = image_augmentation(option("auto_augment", "none"), option("ra_magnitude", 9),
                                          option("random_erase", 0.0), option("interpolation", "bilinear"),
                                          option("augmix_severity", 3), fill=fill)

        def skipping(dataset, split, replace):
            if isinstance(dataset, ImageFiles):
                return SkipUnreadable(dataset.samples, load_image, replace, args.strict_data)
            return SkipUnreadable(dataset, None, replace, args.strict_data,
                                  check=ItemCheck(len(classes), split, first and first[0], floating))
        train_set = SeededTransform(skipping(train_set, "train", True),
                                    TrainPreset(args.train_crop_size, option("min_crop_scale", 0.08),
                                                augmentation=augmentation, res_schedule=res_schedule,
                                                interpolation=option("interpolation", "bilinear")), seed)
        val_set = SeededTransform(skipping(val_set, "val", False),
                                  EvalPreset(args.val_resize_size, args.val_crop_size,
                                             option("val_interpolation", "bilinear")), seed)
    # The same permutation (seed + epoch) on every rank; rank r takes every world_size-th
    # index, so batch k of all ranks together is batch k of a single process.
    if option("ra_sampler", False):
        train_sampler = RepeatedAugmentationSampler(train_set, world_size, rank, option("ra_reps", 3), seed=seed)
    else:
        train_sampler = ResumableSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    normalisation = Normalise(mean, std)
    # The loaders draw their worker seeds from generators of their own, not from the global RNG
    # (which dropout uses), so a resumed run's RNG stream stays that of an uninterrupted one.
    loader_options = dict(num_workers=args.workers, pin_memory=gpu, worker_init_fn=ignore_stop_signals,
                          # On the CPU the workers also normalise; on a GPU the batch goes there as it is.
                          collate_fn=Collate(normalise=None if gpu else normalisation))
    if args.workers and "fork" in multiprocessing.get_all_start_methods():
        # Forked workers start in milliseconds every epoch; a process made by mp.spawn would
        # otherwise spawn them too, re-importing torch each epoch.
        loader_options["multiprocessing_context"] = "fork"
    # Compiled, a last partial batch would cost a second graph (a recompilation) every epoch: dropped.
    train_loader = DataLoader(train_set, batch_size=per_process_batch, sampler=train_sampler, drop_last=args.compile,
                              generator=torch.Generator().manual_seed(seed), **loader_options)
    val_loader = DataLoader(val_set, batch_size=per_process_batch, sampler=ShardSampler(len(val_set), rank, world_size),
                            generator=torch.Generator().manual_seed(seed), **loader_options)
    return Data(classes, train_loader, val_loader, train_sampler, normalisation, first)

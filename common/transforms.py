"""Per-image transforms: the uint8 presets (crop and flip for training, resize and centre crop for validation),
seeded per image from (seed, epoch, index) so that any process or loader worker transforms an image alike, and the
normalisation that makes a batch the model's input (on the device, or in the CPU's loader workers).
"""

import copy
import inspect
import math
import random

import torch
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as F

from .augment import seeded
from .datasets import EncodedJPEG
from .errors import UsageError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class TrainPreset:
    """RandomResizedCrop + horizontal flip on uint8, then the transforms added by then(), then `augmentation`
    (auto-augment, random erasing), as torchvision's presets order them. Every draw comes from `rng`: crop and flip
    first, the rest from torch seeds drawn after them. res_schedule: the crop size follows set_epoch."""

    def __init__(
        self,
        crop_size,
        min_scale=0.08,
        ratio=(3 / 4, 4 / 3),
        augmentation=None,
        res_schedule=None,
        interpolation="bilinear",
        hflip_prob=0.5,
    ):
        self.crop_size, self.scale = crop_size, (min_scale, 1.0)
        self.log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
        self.interpolation, self.hflip_prob = F.InterpolationMode(interpolation), hflip_prob
        self.augmentation, self.res_schedule, self.added = augmentation, res_schedule, []
        if res_schedule is not None:
            self.set_epoch(0)

    def then(self, *transforms):
        """A copy that applies `transforms` (callables on the image tensor) after the crop and flip, before
        --auto-augment and --random-erase, their draws seeded per image like the crop's."""
        extended = copy.copy(self)
        extended.added = [*self.added, *transforms]
        return extended

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
        box = self.crop_box(*image.shape[-2:], rng)
        plan = (crop_and_flip, (box, self.crop_size, rng.random() < self.hflip_prob, self.interpolation))
        if isinstance(image, EncodedJPEG):  # --decode gpu: cropped and flipped where it is decoded (build_data
            return image._replace(plan=plan)  # refuses the transforms below with it)
        image = planned(image, plan)
        if self.added:
            with seeded(rng):
                for transform in self.added:
                    image = transform(image)
        if self.augmentation is not None:
            with seeded(rng):  # torchvision draws from torch's RNG: here a fork of it, seeded from rng
                image = self.augmentation(image)
        return image


class EvalPreset:
    """Resize the short side, centre crop, uint8 in and out: torchvision's ImageClassification without the
    normalisation (Collate or DeviceLoader normalises the batch)."""

    def __init__(self, resize_size, crop_size, interpolation="bilinear"):
        self.resize_size, self.crop_size = resize_size, crop_size
        self.interpolation = F.InterpolationMode(interpolation)

    def __call__(self, image, _rng=None):
        plan = (resize_and_crop, (self.resize_size, self.crop_size, self.interpolation))
        return image._replace(plan=plan) if isinstance(image, EncodedJPEG) else planned(image, plan)


def crop_and_flip(image, box, size, flip, interpolation):
    """TrainPreset's crop of `box` (top, left, height, width) resized to size x size, flipped where `flip`."""
    image = F.resized_crop(image, *box, [size, size], interpolation=interpolation, antialias=True)
    return F.horizontal_flip(image) if flip else image


def resize_and_crop(image, resize_size, crop_size, interpolation):
    """EvalPreset's: the shorter side resized to `resize_size`, the centre `crop_size` square cut out."""
    return F.center_crop(F.resize(image, [resize_size], interpolation=interpolation, antialias=True), [crop_size])


def planned(image, plan):
    """`image` transformed by a preset's plan, (function, args): in a loader worker, or on the device."""
    function, args = plan
    return function(image, *args)


def takes_rng(transform):
    """How `transform` takes a random.Random seeded per image: "positional", transform(image, rng) (the presets, a
    function of two required arguments: the scripts' earlier convention, still taken), "keyword" (a parameter named
    rng: transform(image, rng=rng)), or None: called as torchvision's, transform(image)."""
    if isinstance(transform, (TrainPreset, EvalPreset)):
        return "positional"
    try:  # (an nn.Module's __call__ that takes *args, torch's or a wrapper's: its forward says what it takes)
        signature = inspect.signature(transform)
        passes_on = {parameter.kind for parameter in signature.parameters.values()} <= {
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        }
        if isinstance(transform, torch.nn.Module) and passes_on:
            signature = inspect.signature(transform.forward)
    except (TypeError, ValueError):  # (a callable of C, no signature: torchvision's convention)
        return None
    named = signature.parameters.get("rng")
    if named is not None and named.kind != inspect.Parameter.POSITIONAL_ONLY:
        return "keyword"
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in signature.parameters.values() if p.kind in positional and p.default is p.empty]
    return "positional" if len(required) >= 2 else None


class SeededTransform(Dataset):
    """`transform` applied to the image of the (image, label, bad) `base[index]` (image None: skipped) with a
    random.Random seeded by (seed, epoch, index) (takes_rng; else torch's RNG seeded from it), leaving the global RNGs
    alone. An index beyond len(base) (a repeat of RepeatedAugmentationSampler's) reads base[index % len(base)], seeded
    by itself: each repeat differs."""

    def __init__(self, base, transform, seed):
        self.base, self.transform, self.seed, self.epoch = base, transform, seed, 0
        self.takes_rng = takes_rng(transform)

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
            rng = random.Random(f"{self.seed}-{self.epoch}-{index}")
            if self.takes_rng == "keyword":
                image = self.transform(image, rng=rng)
            elif self.takes_rng:
                image = self.transform(image, rng)
            else:  # build_transforms' own: called as torchvision's, drawing from torch's RNG seeded per image
                with seeded(rng):
                    image = self.transform(image)
        return image, label, bad


class Normalise:
    """Images to normalised float32, (x - mean) / std per channel: uint8 images on the 0-255 scale, float ones on 0-1.
    The same arithmetic on the CPU (Collate) and on a GPU (DeviceLoader)."""

    def __init__(self, mean=IMAGENET_MEAN, std=IMAGENET_STD, device=None):
        self.mean, self.std = tuple(mean), tuple(std)
        self.mean255, self.std255 = (
            torch.tensor(values, device=device).view(1, len(values), 1, 1) * 255 for values in (self.mean, self.std)
        )
        self.mean1, self.std1 = self.mean255 / 255, self.std255 / 255

    def to(self, device):
        return Normalise(self.mean, self.std, device)

    def __call__(self, images):
        if images.dtype == torch.uint8:
            return images.float().sub_(self.mean255).div_(self.std255)
        return (images.float() - self.mean1) / self.std1


def choose_normalisation(config, train_set, channels):
    """(mean, std, source) for images of `channels` channels: --mean/--std, else the train set's `mean` and `std`
    attributes, else ImageNet's for 3 channels; UsageError otherwise, or for lengths that are not `channels`."""
    given = {name: getattr(config, name) for name in ("mean", "std")}
    found = {name: given[name] or _per_channel(getattr(train_set, name, None), name) for name in given}
    if all(found.values()):
        source = (
            "--mean/--std"
            if all(given.values())
            else ("the dataset's mean/std" if not any(given.values()) else "--mean/--std and the dataset's")
        )
    elif any(found.values()):
        missing = next(name for name, value in found.items() if not value)
        raise UsageError(f"--{missing} is missing: give --mean and --std together (or both as dataset attributes)")
    elif channels == 3:
        return IMAGENET_MEAN, IMAGENET_STD, "ImageNet's"
    else:
        raise UsageError(
            f"the images have {channels} channel(s): give --mean and --std with {channels} value(s) each "
            "(or set train_set.mean and .std), as ImageNet's are for 3"
        )
    mean, std = (tuple(float(value) for value in found[name]) for name in ("mean", "std"))
    if len(mean) != channels or len(std) != channels:
        raise UsageError(f"mean {mean} and std {std} must have one value per image channel ({channels})")
    if not all(math.isfinite(value) for value in (*mean, *std)):  # (nan, inf: a traceback, or a channel zeroed)
        raise UsageError(f"mean {mean} and std {std} must be finite numbers")
    if min(std) <= 0:
        raise UsageError(f"std {std} must be positive")
    if min(mean) < 0 or max(mean) > 1 or max(std) > 1:  # (CIFAR's 125.3, ...: every input near -2, exit 0)
        raise UsageError(
            f"mean {mean} and std {std} ({source}) must lie in 0-1, the scale of the images they normalise (on the "
            "0-255 scale: divide them by 255)"
        )
    return mean, std, source


def _per_channel(value, name):
    """A train set's `mean` or `std` attribute as a tuple of numbers (a tensor's or array's too), or None."""
    if value is None:
        return None
    try:
        return tuple(float(number) for number in (value.flatten() if hasattr(value, "flatten") else value))
    except (TypeError, ValueError):
        raise UsageError(f"the train set's {name} is {value!r}: give one number per image channel") from None

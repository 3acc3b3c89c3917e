"""Datasets of a researcher's own, as --dataset tests.custom_datasets:NAME gives them to the scripts: the
kinds that must train (PIL images, float tensors, 1-channel images with their mean and std) and the
mistakes that must be refused in one line at start."""

import time

import torch
import torch.nn as nn
from PIL import Image
from torch.utils.data import Dataset, IterableDataset

CLASSES = ["dark", "mid", "light"]
TRAIN, VAL = 12, 6


def pixels(index, channels=3, size=20):
    """A uint8 CHW image of class index % 3: a grey level per class, with a little noise."""
    generator = torch.Generator().manual_seed(index)
    level = 40 + 80 * (index % 3)
    noise = torch.randint(-20, 21, (channels, size, size), generator=generator)
    return (level + noise).clamp(0, 255).to(torch.uint8)


class Items(Dataset):
    def __init__(self, count, make, offset=0):
        self.count, self.make, self.offset = count, make, offset

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return self.make(index + self.offset)


def splits(make):
    return CLASSES, Items(TRAIN, make), Items(VAL, make, offset=TRAIN)


def uint8_tensors(config):
    return splits(lambda i: (pixels(i), i % 3))


def slow_items(config):
    """96 training images, each read in 40 ms (a slow file system): a run that waits for its input."""

    def make(index):
        time.sleep(0.04)
        return pixels(index), index % 3

    return CLASSES, Items(96, make), Items(VAL, make, offset=96)


def in_memory(config):
    """48 training images held in memory: a run with nothing to wait for."""
    images = [(pixels(index), index % 3) for index in range(48 + VAL)]
    return CLASSES, Items(48, images.__getitem__), Items(VAL, images.__getitem__, offset=48)


def more_uint8_tensors(config):
    """uint8_tensors with 3 more training images."""
    return (
        CLASSES,
        Items(TRAIN + 3, lambda i: (pixels(i), i % 3)),
        Items(VAL, lambda i: (pixels(i), i % 3), offset=TRAIN),
    )


def pil_images(config):
    return splits(lambda i: (Image.fromarray(pixels(i).permute(1, 2, 0).numpy()).convert("L"), i % 3))


def float_tensors(config):
    return splits(lambda i: (pixels(i).float() / 255, torch.tensor(i % 3)))


def float_0_255(config):
    """Float images left on the 0-255 scale (a forgotten / 255): trained on, the loss ran to 1e18."""
    return splits(lambda i: (pixels(i).float(), i % 3))


def nan_images(config):
    return splits(lambda i: (torch.full((3, 20, 6), float("nan")), i % 3))


def one_nan_pixel(config):
    """Float images in 0-1, one pixel of each NaN (was said as "values nan to nan", and to divide by 255)."""

    def item(i):
        image = pixels(i).float() / 255
        image[0, 3, 3] = float("nan")
        return image, i % 3

    return splits(item)


def gray_tensors(config):
    return splits(lambda i: (pixels(i, channels=1), i % 3))


def gray_with_stats(config):
    classes, train, val = gray_tensors(config)
    train.mean, train.std = [0.47], [0.3]
    return classes, train, val


def gray_net(num_classes, dropout=0.0):
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, num_classes)
    )


# Mistakes: each is refused at start in one line.
def triples(config):
    return splits(lambda i: (pixels(i), i % 3, "extra"))


def numpy_images(config):
    return splits(lambda i: (pixels(i).permute(1, 2, 0).numpy(), i % 3))


def hwc_tensors(config):
    return splits(lambda i: (pixels(i, size=20).permute(1, 2, 0).contiguous()[:, :6], i % 3))


def length_too_large(config):
    """A __len__ that counts 4 items more than the dataset has: its last items' IndexError was taken for an unreadable
    image, skipped and replaced, exit 0."""
    images = [pixels(index) for index in range(TRAIN)]
    return CLASSES, Items(TRAIN + 4, lambda i: (images[i], i % 3)), Items(VAL, lambda i: (pixels(i), i % 3))


def unreadable_last_item(config):
    """The last training item cannot be read (a file cut short): skipped in its epoch, not a stop at start."""

    def make(index):
        if index == TRAIN - 1:
            raise OSError("image file is truncated")
        return pixels(index), index % 3

    return CLASSES, Items(TRAIN, make), Items(VAL, make, offset=TRAIN)


def unreadable_first_items(config):
    """The first two training items cannot be read: skipped in the epochs, as any other; the start reads the third."""

    def make(index):
        if index < 2:
            raise OSError("cannot identify image file")
        return pixels(index), index % 3

    return CLASSES, Items(TRAIN, make), Items(VAL, make, offset=TRAIN)


def numpy_labels(config):
    """Labels as numpy integers (a label array indexed): class indices all the same."""
    import numpy

    return splits(lambda i: (pixels(i), numpy.int64(i % 3)))


def labels_out_of_range(config):
    return splits(lambda i: (pixels(i), 3 + i % 3))


def iterable(config):
    class Stream(IterableDataset):
        def __iter__(self):
            return iter([(pixels(i), i % 3) for i in range(TRAIN)])

    return CLASSES, Stream(), Items(VAL, lambda i: (pixels(i), i % 3))


def two_things(config):
    return CLASSES, Items(TRAIN, lambda i: (pixels(i), i % 3))


def uint16_images(config):
    return splits(lambda i: (pixels(i).to(torch.int16), i % 3))


def late_bad_item(config):
    """Item 5 of the train set is a 3-tuple: found by a loader worker, not at start."""
    return splits(lambda i: (pixels(i), i % 3) if i != 5 else (pixels(i), i % 3, None))


def unreadable_items(config):
    """Training items 2 and 3 raise OSError, as a file a dataset cannot read: skipped and listed, like broken files."""

    def make(i):
        if i in (2, 3):
            raise OSError(f"cannot read sample {i}")
        return pixels(i), i % 3

    return splits(make)


def from_a_fifo(config):
    """A start-up blocked on I/O (a folder scan or a read on a hung network file system): opens the FIFO that
    env TEST_FIFO names, which blocks until a writer opens it (none does), after saying so."""
    import os
    import sys

    path = os.environ["TEST_FIFO"]
    sys.stdout.write(f"opening {path}\n")
    sys.stdout.flush()
    with open(path, "rb") as fifo:
        fifo.read()
    raise AssertionError("a writer opened the FIFO")


def training_items_never_come(config):
    """Training items that block a loader worker that reads them, as a read on a hung network file system does (a
    pipe that no one writes: its write end is held open); the start-up's look at one item, and validation's items,
    as uint8_tensors'."""
    import os

    from torch.utils.data import get_worker_info

    def never(index):
        if get_worker_info() is None:  # (the training process: the start-up's check of an item)
            return pixels(index), index % 3
        read_end, _write_end = os.pipe()
        os.read(read_end, 1)
        raise AssertionError("a pipe that no one writes was read")

    return CLASSES, Items(TRAIN, never), Items(VAL, lambda index: (pixels(index), index % 3), offset=TRAIN)


def two_classes(config):
    """uint8_tensors of two classes."""
    return (
        CLASSES[:2],
        Items(TRAIN, lambda i: (pixels(i), i % 2)),
        Items(VAL, lambda i: (pixels(i), i % 2), offset=TRAIN),
    )

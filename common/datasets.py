"""Where images come from: an image folder (train/<class>/, val/<class>/), CSV or TSV split files, webdataset shards, a
Hugging Face dataset on disk (common/hf_datasets.py; needs requirements-hf.txt), your own dataset (--dataset
package.module:function), --dummy's tensors, or the built-in demo set; and what an item must be: (image, label), a PIL
image or a CHW tensor and a class index.
"""

import io
import math
import numbers
import os
import re
import warnings
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

try:  # deprecated since torchvision 0.29 (TorchCodec takes over); PIL decodes when it is gone
    from torchvision.io import ImageReadMode, decode_image, read_file
except ImportError:
    decode_image = None
from torchvision.transforms.v2 import functional as F

from . import distributed, errors, folder_index
from .demo_data import ensure_demo_dataset
from .errors import PROGRAMMING_ERRORS, BadItem, Preempted, UnreadableFile, UsageError, check_call, import_named
from .folder_index import FolderIndex, rgb, scan_image_folder, scan_split_files, split_files
from .hf_datasets import has_hf_dataset, load_splits
from .shards import ShardIndex, ShardReader, has_shards, scan_shards

# torchvision's deprecation of its decoders warns at each decode: under -W error (PYTHONWARNINGS=error) that made
# every JPEG one that cannot be decoded.
warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision", DeprecationWarning)

# JPEGs only: torchvision's PNG decoder crashes the process on a damaged PNG (SIGSEGV: torchvision 0.29), where PIL
# raises an error that skips the file. A file is a JPEG by its first bytes.
DECODED_BY_TORCHVISION = (".jpg", ".jpeg")
JPEG_START, JPEG_END = (0xFF, 0xD8, 0xFF), (0xFF, 0xD9)
DEVICE_DECODED_MODES = ("RGB", "L")  # YCbCr and greyscale; CMYK and YCCK JPEGs are decoded by the loader worker


def load_image(path):
    """An RGB image as a uint8 CHW tensor. JPEGs are decoded by torchvision.io (faster); other formats, and files it
    cannot decode, by PIL (whose error names a broken file)."""
    if decode_image is not None and path.lower().endswith(DECODED_BY_TORCHVISION):
        try:
            image = _torchvision_decoded(read_file(path))
        except RuntimeError:  # read_file's: an empty file, a FIFO (refused below)
            image = None
        if image is not None:
            return image
    with folder_index.open_regular(path) as file:
        return _pil_rgb(Image.open(file))


def decode_bytes(data, extension):
    """The image of the encoded bytes `data` of a file named *.`extension`, decoded as load_image decodes a file."""
    if data and decode_image is not None and f".{extension.lower()}" in DECODED_BY_TORCHVISION:  # (none: PIL says why)
        image = _torchvision_decoded(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        if image is not None:
            return image
    return _pil_rgb(Image.open(io.BytesIO(data)))


class EncodedJPEG(NamedTuple):
    """--decode gpu: a JPEG read but not decoded, its size from its header. `plan` (transforms.py's (function, args))
    says how its image is cropped once the device has decoded it; `name` is what a report calls it."""

    data: torch.Tensor  # its bytes, uint8
    height: int
    width: int
    name: str
    plan: tuple = None

    @property
    def shape(self):
        return (3, self.height, self.width)


def encoded_jpeg(data, name):
    """The EncodedJPEG of the bytes `data` where they are a whole JPEG (first and last markers) of three or one
    channels; else None (a PNG under a .jpg name, CMYK, a file cut short: the loader worker's to decode)."""
    if bytes(data[:3]) != bytes(JPEG_START) or bytes(data[-2:]) != bytes(JPEG_END):
        return None
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format != "JPEG" or image.mode not in DEVICE_DECODED_MODES:
                return None
            width, height = image.size
    except Exception:  # (PIL raises OSError, ValueError, SyntaxError, ...: the worker's decoder says why)
        return None
    return EncodedJPEG(torch.frombuffer(bytearray(data), dtype=torch.uint8), height, width, name)


def describe(error):
    """The decoder's reason, on one line and without PIL's file-object repr (a file's, or the BytesIO of a shard's
    sample or a Hugging Face row)."""
    reason = re.sub(r" ?<_io\.\w+ (?:name=[^>]*|object at 0x[0-9a-fA-F]+)>", "", " ".join(str(error).split()))
    return (reason or type(error).__name__)[:200]


SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # a JPEG's frame header: its size (not DHT, JPG, DAC)


def jpeg_pixels(data):
    """Width x height from the frame header of the JPEG bytes `data` (a memoryview), or None where none is found
    (a few microseconds: Image.open's parse of the same header costs many times that)."""
    at = 2
    while at + 9 <= len(data) and data[at] == 0xFF:
        marker = data[at + 1]
        if marker == 0xFF:  # (a fill byte)
            at += 1
        elif marker in SOF_MARKERS:
            return int.from_bytes(data[at + 5 : at + 7], "big") * int.from_bytes(data[at + 7 : at + 9], "big")
        else:
            at += 2 + int.from_bytes(data[at + 2 : at + 4], "big")
    return None


def _torchvision_decoded(encoded):
    """torchvision.io's RGB uint8 image of JPEG bytes (a uint8 tensor), or None where they are no JPEG (a PNG under a
    .jpg name), it cannot decode them, or their header claims more pixels than PIL decodes (PIL then refuses them:
    a file of a few bytes whose header says 20000x20000 took 1.2 GB, where ImageFolder skips it)."""
    if tuple(encoded[:3].tolist()) != JPEG_START:
        return None
    pixels = jpeg_pixels(memoryview(encoded.numpy()))
    if pixels is not None and Image.MAX_IMAGE_PIXELS is not None and pixels > 2 * Image.MAX_IMAGE_PIXELS:
        return None
    try:
        return decode_image(encoded, mode=ImageReadMode.RGB)
    except RuntimeError:
        return None


def _pil_rgb(image):
    """A PIL image as an RGB uint8 CHW tensor (folder_index.rgb)."""
    return F.pil_to_tensor(rgb(image))


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


def decoded(read):
    """read()'s image; whatever a reader or decoder raised as UnreadableFile (a stop signal, MemoryError pass)."""
    try:
        return read()
    except (MemoryError, Preempted):  # (a stop signal raised while this process waited for the file)
        raise
    except Exception as error:  # decoders raise OSError, ValueError, RuntimeError, SyntaxError, ...
        raise UnreadableFile(" ".join(str(error).split()) or type(error).__name__) from error


class ImageFiles(Dataset):
    """(image, label) of each (path, label) of `samples` (a FolderIndex, a list), decoded by load_image. A file that
    cannot be decoded raises UnreadableFile (SkipUnreadable skips it)."""

    defer_jpegs = False  # --decode gpu (build_data sets it): a JPEG goes to the device as an EncodedJPEG

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, label = self.samples[index]
        if self.defer_jpegs and path.lower().endswith(DECODED_BY_TORCHVISION) and os.path.isfile(path):  # (a device?)
            found = decoded(lambda: encoded_jpeg(Path(path).read_bytes(), path))
            if found is not None:
                return found, label
        return decoded(lambda: load_image(path)), label

    def _decoded(self, data, extension, index):
        """The image of a sample's encoded bytes, decoded as load_image decodes a file; with defer_jpegs, a JPEG the
        device can decode is its EncodedJPEG instead."""
        if self.defer_jpegs and f".{extension.lower()}" in DECODED_BY_TORCHVISION:
            found = encoded_jpeg(data, self.name(index))
            if found is not None:
                return found
        return decode_bytes(data, extension)

    def name(self, index):
        return self.samples[index][0]


class ShardedImages(ImageFiles):
    """(image, label) of each sample of a ShardIndex, read at its offset in its shard. A sample that cannot be read or
    decoded raises UnreadableFile, named SHARD:KEY."""

    def __init__(self, samples):
        super().__init__(samples)
        self.reader = ShardReader()

    def __getitem__(self, index):
        shard, offset, size, extension = self.samples.location(index)
        member = self.samples.member(index)  # (its tar header, read with it, must name it: the index is this shard's)
        image = decoded(lambda: self._decoded(self.reader.read(shard, offset, size, member), extension, index))
        return image, int(self.samples.labels[index])


class HFImages(ImageFiles):
    """(image, label) of each row of a Hugging Face dataset's split (HFRows). A row that cannot be read or decoded
    raises UnreadableFile, named SPLIT[ROW]."""

    def __getitem__(self, index):
        return decoded(lambda: self._decoded(*self.samples.encoded(index), index)), int(self.samples.labels[index])

    def name(self, index):
        return self.samples.name(index)


def build_datasets(config):
    """(classes, train set, val set) of (image, label) items of the data the flags name: --dummy, --dataset (called
    as function(config)), or --data's Hugging Face dataset, split files, shards or image folders (the demo set's,
    generated first). A collective: rank 0 lists the files, once for the job."""
    if config.dummy:
        val_length = math.ceil(config.dummy_size * 50_000 / 1_281_167)
        train_set = SyntheticImages(config.dummy_size, config.train_crop_size, res_schedule=config.crop_schedule)
        return (
            [str(i) for i in range(train_set.num_classes)],
            train_set,
            SyntheticImages(val_length, config.val_crop_size),
        )
    if config.dataset_fn:
        function = import_named(config.dataset_fn, "--dataset", builtin=False)
        check_call(function, "--dataset", config.dataset_fn, "FN(args) -> (classes, train_set, val_set)", config)
        result = function(config)
        if not (isinstance(result, (tuple, list)) and len(result) == 3):
            raise UsageError(
                f"--dataset {config.dataset_fn} returned {type(result).__name__}: return (classes, train_set, val_set)"
            )
        return tuple(result)
    error, root, kind = None, None, None
    try:  # (what this node holds: every rank stops with a node's line, none waits in the gather below)
        if config.data is None:  # (a --trainer's build_datasets that calls this one: no demo set for its own data)
            raise UsageError(f"--trainer {config.trainer}'s build_datasets reads the data of the flags: give --data")
        root = ensure_demo_dataset(config.data) if config.dataset == "demo" else Path(config.data)
        kind = data_kind(root)
    except UsageError as failure:
        error = str(failure)
    except OSError as failure:  # (the demo set not written: a read-only checkout, a full disk)
        error = f"cannot write the demo set into {errors.printable(failure.filename)}: {failure.strerror}"
    kinds = distributed.raise_any(error, kind)  # (each node reads its own copy)
    other = next((rank for rank, found in enumerate(kinds) if found != kinds[0]), None)
    if other is not None:
        differ = sum(found != kinds[0] for found in kinds)
        raise UsageError(
            f"--data {errors.printable(root)}: rank 0's copy holds {KINDS[kinds[0]]}, rank {other}'s "
            f"{KINDS[kinds[other]]} ({differ} of {len(kinds)} ranks differ): each node's must be the same"
        )
    if kind == "hf":
        classes, train_rows, val_rows = load_splits(root)
        return classes, HFImages(train_rows), HFImages(val_rows)
    output = Path(config.output_dir) if config.output_dir else None  # (where a read-only folder's shard indexes go)
    scan = {"shards": partial(scan_shards, cache=output), "split files": scan_split_files}.get(kind, scan_image_folder)
    classes, train_files, val_files = distributed.computed_by_rank_0(lambda: scan(root))
    train_files, val_files = this_node_s_copy(root, classes, train_files, val_files)
    files = ShardedImages if isinstance(train_files, ShardIndex) else ImageFiles
    return classes, files(train_files), files(val_files)


KINDS = {
    "hf": "a Hugging Face dataset",
    "shards": "shards",
    "split files": "train.csv and val.csv",
    "folder": "an image folder",
    None: "nothing (no such path)",
}


def data_kind(root):
    """What this node's --data `root` holds: a KINDS key (None: nothing, which the scan says); one line for a path
    that cannot be read."""
    try:
        root.stat()
    except FileNotFoundError:
        return None
    except OSError as error:  # a name too long, a loop of links, no permission: before any file in it is read
        raise UsageError(f"--data {root}: {error.strerror}") from None
    try:
        folder_index.refuse_unfinished(root)
        kind = "hf" if has_hf_dataset(root) else "shards" if has_shards(root) else None
        return kind or ("split files" if root.is_dir() and split_files(root) else "folder")
    except OSError as error:  # --data not searchable (no permission), a loop of links in its train/
        raise UsageError(f"cannot list {errors.printable(error.filename)}: {error.strerror}") from None


def _first_difference(split, classes, own, rank_0s):
    """Where this node's FolderIndex of `split` differs from rank 0's, in words; None where they list the same files."""
    if own.names.blob == rank_0s.names.blob and np.array_equal(own.labels, rank_0s.labels):
        return None
    here, there = (np.bincount(index.labels, minlength=len(classes)) for index in (own, rank_0s))
    for name, count_here, count_there in zip(classes, here, there):
        if count_here != count_there:
            return f"{split}/{name}: {count_here} images here, {count_there} on rank 0"
    return f"{split}/: the same number of images per class, of other names"


def this_node_s_copy(root, classes, train_files, val_files):
    """The samples at this rank's --data. A node may hold its copy of the data at another path than rank 0's: it
    lists its copy, which must hold rank 0's files, name for name, else every rank stops with one line naming the
    first difference. A collective."""
    roots = distributed.all_gather_object(str(root))
    if all(other == roots[0] for other in roots):
        return train_files, val_files
    error = None
    if str(root) != roots[0]:
        where = f"--data {root} (rank 0: {roots[0]})"
        scan = {FolderIndex: scan_image_folder, ShardIndex: scan_shards}.get(type(train_files))
        if scan is None:
            error = (
                f"{where}: with train.csv / val.csv every node gives the same --data path (the files' paths are read "
                "from them); copies at other paths are for image folders and shards"
            )
        else:
            try:
                own_classes, own_train, own_val = scan(root)
                difference = (
                    f"classes {', '.join(own_classes[:3])}, ... here"
                    if own_classes != classes
                    else _first_difference("train", classes, own_train, train_files)
                    or _first_difference("val", classes, own_val, val_files)
                )
            except UsageError as failure:
                difference = str(failure)
            if difference:
                error = f"{where} holds other files than rank 0's ({difference}): each node's copy must be the same"
            else:
                train_files, val_files = own_train, own_val
    distributed.raise_any(error)
    return train_files, val_files


def describe_item(item):
    return f"a {type(item).__name__} of {len(item)}" if isinstance(item, (tuple, list)) else f"a {type(item).__name__}"


FLOAT_SLACK = 0.1  # how far a float image may stray outside 0-1 (a resize's overshoot), not a 0-255 or normalised one


class ItemCheck:
    """A dataset item as the loaders need it: (image, label), the image a uint8 or float CHW tensor (a PIL image
    converted to RGB uint8) with the channels and dtype of the first; the label an int below num_classes. Anything
    else: BadItem, one line."""

    def __init__(self, num_classes, split, channels=None, floating=None):
        self.num_classes, self.split, self.channels, self.floating = num_classes, split, channels, floating

    def __call__(self, item, index):
        where = f"item {index} of the {self.split} set"
        if not (isinstance(item, (tuple, list)) and len(item) == 2):
            raise BadItem(f"{where} is {describe_item(item)}; items must be (image, label)")
        image, label = item
        if isinstance(image, Image.Image):
            image = _pil_rgb(image)  # (as a file of --data: a 16-bit image its high byte)
        elif isinstance(image, torch.Tensor):
            if image.ndim != 3 or not 1 <= image.shape[0] <= 4:
                raise BadItem(
                    f"{where}: an image of shape {list(image.shape)}; expected channels x height x width "
                    "(CHW, 1 to 4 channels): permute an HWC image with image.permute(2, 0, 1)"
                )
            if image.is_floating_point():
                image = image.float()
                low, high = torch.aminmax(image) if image.numel() else (torch.tensor(0.0), torch.tensor(1.0))
                if not torch.isfinite(image).all():
                    raise BadItem(f"{where}: a float image holding NaN or infinite values; expected 0-1")
                if not (low >= -FLOAT_SLACK and high <= 1 + FLOAT_SLACK):
                    raise BadItem(
                        f"{where}: a float image of values {low:.4g} to {high:.4g}; expected 0-1: divide a 0-255 image "
                        "by 255 (or give it as uint8), and leave normalising to --mean/--std (it would be done twice)"
                    )
            elif image.dtype != torch.uint8:
                raise BadItem(f"{where}: an image of dtype {image.dtype}; expected uint8 (0-255) or float (0-1)")
        else:
            array = type(image).__name__ == "ndarray"
            hint = " (torch.from_numpy(array).permute(2, 0, 1) for an HWC array)" if array else ""
            raise BadItem(f"{where}: the image is {describe_item(image)}; expected a PIL image or a CHW tensor{hint}")
        if self.channels is not None and (image.shape[0], image.is_floating_point()) != (self.channels, self.floating):
            raise BadItem(
                f"{where}: a {'float' if image.is_floating_point() else 'uint8'} image of {image.shape[0]} "
                f"channel(s), after {'float' if self.floating else 'uint8'} images of {self.channels}: "
                "give every image the same channels and dtype"
            )
        if isinstance(label, torch.Tensor) and label.numel() == 1 and not label.is_floating_point():
            label = label.item()
        if isinstance(label, numbers.Integral) and not isinstance(label, bool):  # (numpy's int64 too)
            label = int(label)
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < self.num_classes:
            raise BadItem(f"{where}: label {label!r}; expected a class index, an int in 0..{self.num_classes - 1}")
        return image, label


FIRST_TRIES = 16  # items first_item reads before it gives up on a data set whose images cannot be read


def first_item(dataset, split, num_classes):
    """(channels, height, width, dtype) of item 0 of a user's `dataset`, checked (BadItem); None for --data's image
    files, which the loader workers read and check."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise UsageError(
            f"the {split} set is a {type(dataset).__name__}: give a map-style dataset (len() and [i]); "
            "the samplers index it, for shards, resume and exact validation"
        )
    if len(dataset) == 0:
        raise UsageError(f"the {split} set is empty")
    if isinstance(dataset, ImageFiles):  # ours: not read here, where a hung file system would block the start
        return None
    for index in range(min(len(dataset), FIRST_TRIES)):  # (an item that cannot be read: skipped, as in the epochs)
        try:
            item = dataset[index]
            break
        except (MemoryError, Preempted, *PROGRAMMING_ERRORS):
            raise
        except Exception as error:
            unread = f"{type(error).__name__}: {describe(error)}"  # (one line, as the epochs' warnings)
    else:
        raise UsageError(f"the {split} set's first {index + 1} items cannot be read (the last: {unread})")
    image, _ = ItemCheck(num_classes, split)(item, index)
    if type(dataset).__module__ != __name__:  # a researcher's: its last item too (a __len__ too large was skipped)
        try:
            dataset[len(dataset) - 1]
        except IndexError as error:
            raise UsageError(
                f"the {split} set's last item, {len(dataset) - 1}, raises IndexError ({error}): does its __len__, "
                f"{len(dataset)}, count more items than it has?"
            ) from None
        except (MemoryError, Preempted):
            raise
        except Exception:  # (an image that cannot be read: skipped in its epoch, as any other, SkipUnreadable)
            pass
    return (image.shape[0], *image.shape[-2:], image.dtype)

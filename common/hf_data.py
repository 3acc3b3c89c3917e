"""A Hugging Face dataset on disk as --data: a DatasetDict written by `datasets`' save_to_disk (dataset_dict.json,
train/, validation/), or the parquet files in which the Hub distributes one (ImageNet-1k: data/train-00000-of-00294
.parquet, ..., data/validation-*.parquet), with a column of images and one of class labels. `datasets` is optional:
requirements-hf.txt.

save_to_disk's arrow files are memory-mapped: an image is a read at its row. Parquet compresses many images per row
group, which a random read would decode whole for every image: `datasets` converts the files once into arrow files in
its cache (HF_DATASETS_CACHE, else ~/.cache/huggingface/datasets), on rank 0 first; the other ranks, and later runs,
find them there. The rows keep the order they have on disk: the data order is then the sampler's, as for a folder.
"""
import os
import re
from pathlib import Path

import numpy as np

from . import agreement, distributed
from .errors import UsageError

TRAIN_SPLITS, VAL_SPLITS = ("train",), ("validation", "val", "valid")
LABEL_NAMES = ("label", "labels", "cls")  # an integer column of one of these names, where no ClassLabel says it


def has_hf_dataset(root):
    """Whether `root` holds a dataset saved by save_to_disk, or parquet files of a train and a validation split."""
    root = Path(root)
    return (root / "dataset_dict.json").is_file() or "train" in parquet_splits(root)


def parquet_splits(root):
    """{split: [parquet files]} under `root`: a file's split is the start of its name (train-00000-of-00294.parquet)
    or the folder it is in (train/0000.parquet)."""
    found = {}
    for path in sorted(Path(root).rglob("*.parquet")):
        names = [re.split(r"[-_.]", path.name)[0], *(part for part in reversed(path.relative_to(root).parts[:-1]))]
        split = next((name for name in names if name in TRAIN_SPLITS + VAL_SPLITS), None)
        if split:
            found.setdefault(split, []).append(str(path))
    return found


def _load(root):
    """The DatasetDict at `root` (save_to_disk's, or its parquet files converted into datasets' cache)."""
    try:
        import datasets
    except ImportError:
        raise UsageError(f"--data {root} is a Hugging Face dataset, which needs the datasets package: "
                         "pip install -r requirements-hf.txt") from None
    datasets.disable_progress_bars()
    if (Path(root) / "dataset_dict.json").is_file():
        return datasets.load_from_disk(str(root))
    # (its cache read now: datasets reads HF_DATASETS_CACHE once, when imported)
    return datasets.load_dataset("parquet", data_files=parquet_splits(root), cache_dir=os.environ.get("HF_DATASETS_CACHE"))


def load_splits(root):
    """(classes, train rows, val rows) of the dataset at `root` (HFRows); one line for what it lacks. Rank 0 loads it
    first (parquet: converted once), then every rank its own --data (a node's copy at its own path), which must
    hold rank 0's classes and row counts."""
    first = []  # rank 0's, kept: it loads once
    distributed.computed_by_rank_0(lambda: first.append(_splits(root)))
    classes, train, val = first[0] if first else _splits(root)
    found = distributed.all_gather_object((classes, len(train), len(val)))
    agreement.raise_any(None if all(other == found[0] for other in found) else (
        f"--data {root} holds other classes or rows than rank 0's (classes and train / val rows by rank: "
        f"{[(len(c), t, v) for c, t, v in found]}): every node's copy must hold the same dataset"))
    return classes, train, val


def _splits(root):
    loaded = _load(root)
    names = list(loaded)
    train = next((name for name in TRAIN_SPLITS if name in loaded), None)
    val = next((name for name in VAL_SPLITS if name in loaded), None)
    if train is None or val is None:
        raise UsageError(f"--data {root}: a Hugging Face dataset needs a train and a validation split; it has "
                         f"{', '.join(names) or 'none'}")
    features = loaded[train].features
    image = next((name for name, kind in features.items() if type(kind).__name__ == "Image"), None)
    label = next((name for name, kind in features.items() if type(kind).__name__ == "ClassLabel"),
                 next((name for name in LABEL_NAMES if name in features), None))
    if image is None or label is None:
        raise UsageError(f"--data {root}: its {train} split has no {'image' if image is None else 'label'} column "
                         f"(columns: {', '.join(features)}); it needs a column of images (datasets.Image) and one of "
                         "class indices (a ClassLabel, or integers named label)")
    _check_validation(root, loaded, train, val, image, label)
    rows = {split: HFRows(loaded[split], image, label, f"{root}/{split}") for split in (train, val)}
    count = max(int(rows[train].labels.max(initial=-1)), int(rows[val].labels.max(initial=-1))) + 1
    classes = getattr(features[label], "names", None) or [str(index) for index in range(count)]
    return list(classes), rows[train], rows[val]


def _check_validation(root, loaded, train, val, image, label):
    """The validation split has the train split's image and label columns, and a ClassLabel whose class names are
    train's, in the same order (or its first ones): its label k must name train's class k (else validation scores other
    classes, without a word)."""
    theirs = loaded[val].features
    missing = [name for name in (image, label) if name not in theirs]
    if missing:
        raise UsageError(f"--data {root}: its {val} split has no column {missing[0]!r}, which its {train} split has "
                         f"(columns: {', '.join(theirs)}): the splits need the same image and label columns")
    names = [getattr(loaded[split].features[label], "names", None) for split in (train, val)]
    if None not in names and names[0][:len(names[1])] != names[1]:  # (train's first classes alone: the same labels)
        k = next((k for k, pair in enumerate(zip(*names)) if pair[0] != pair[1]), min(map(len, names)))
        said = [repr(split_names[k]) if k < len(split_names) else "none" for split_names in names]
        raise UsageError(f"--data {root}: its {val} split's class {k} is {said[1]}, its {train} split's {said[0]} "
                         f"({len(names[1])} and {len(names[0])} classes): a label must name the same class in both")


class HFRows:
    """The rows of one split: its labels (read whole, a column of integers) and each row's encoded image, read when
    asked (the image column alone, undecoded: datasets.Image(decode=False))."""

    def __init__(self, split, image, label, where):
        import datasets
        import pyarrow  # (datasets' own dependency)
        self.where, self.image = where, image
        column = split.data.column(label)
        if not pyarrow.types.is_integer(column.type):
            raise UsageError(f"--data {where}: its label column {label!r} holds {column.type}, not class indices: make it "
                             "a ClassLabel (dataset.class_encode_column) or integers")
        self.labels = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.int64)
        if len(self.labels) == 0:
            raise UsageError(f"--data {where}: the split has no rows")
        missing = np.flatnonzero(self.labels < 0)
        if len(missing):
            raise UsageError(f"--data {where}: row {missing[0]} has no label ({len(missing)} of {len(self.labels)} rows "
                             "lack one, as a test split does): train and validate on labelled splits")
        self.rows = split.select_columns([image]).cast_column(image, datasets.Image(decode=False))

    def __len__(self):
        return len(self.labels)

    def encoded(self, index):
        """(bytes, file extension) of row `index`'s image (an image stored as a path: the file's bytes); a row without
        an image raises (an unreadable row, skipped and named as one)."""
        cell = self.rows[int(index)][self.image]
        if cell is None:
            raise ValueError("the row has no image")
        path = cell.get("path") or ""
        data = cell.get("bytes") or Path(path).read_bytes()
        return data, Path(path).suffix.lstrip(".") or "jpg"

    def name(self, index):
        """SPLIT[ROW], and the image's file name where the dataset keeps one: how a row that cannot be read is named."""
        path = (self.rows[int(index)][self.image] or {}).get("path")
        return f"{self.where}[{index}]" + (f":{Path(path).name}" if path else "")

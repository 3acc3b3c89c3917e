"""A Hugging Face dataset on disk as --data: save_to_disk's folder, or the Hub's parquet files (data/train-*.parquet,
train/*.parquet), read through the datasets package (requirements-hf.txt): its splits, image and label columns, checked
in one line each, and the rows of a split (HFRows), whose encoded images datasets.HFImages decodes.
"""

import os
import re
from pathlib import Path

import numpy as np

from . import distributed
from .errors import Preempted, UsageError
from .folder_index import SPLIT_FILES, open_regular

TRAIN_SPLITS, VAL_SPLITS = ("train",), ("validation", "val", "valid")
# The columns trained on: the first of these names the split has, else its only column of the kind (timm's defaults)
IMAGE_NAMES, LABEL_NAMES = ("image", "img"), ("label", "labels", "cls", "fine_label")  # (fine_label: CIFAR-100's)


def has_hf_dataset(root):
    """Whether `root` holds a dataset saved by save_to_disk, or parquet files of a train split. Not where train/ holds
    folders, or tars and no parquet file, nor beside train.csv: parquet files kept in an image folder or beside shards
    (a user's features, say) make no dataset, and the search would walk every image."""
    root = Path(root)
    if (root / "dataset_dict.json").is_file():
        return True
    try:
        entries = list(os.scandir(root / "train"))
    except OSError:  # (none: the Hub's data/train-*.parquet)
        entries = []
    folders = any(entry.is_dir() and not entry.name.startswith(".") for entry in entries)  # (class folders)
    if folders or not any(entry.name.endswith(".parquet") for entry in entries):
        split_file = any((root / f"{split}{suffix}").is_file() for split in ("train", "val") for suffix in SPLIT_FILES)
        if folders or split_file or any(entry.name.endswith(".tar") for entry in entries):
            return False
    return "train" in parquet_splits(root)


def parquet_splits(root):
    """{split: [parquet files]} under `root`: a file's split starts its name (train-00000-of-00294.parquet) or names
    its folder (train/0000.parquet)."""
    found = {}
    for path in sorted(Path(root).rglob("*.parquet")):
        names = [re.split(r"[-_.]", path.name)[0], *(part for part in reversed(path.relative_to(root).parts[:-1]))]
        split = next((name for name in names if name in TRAIN_SPLITS + VAL_SPLITS), None)
        if split:
            found.setdefault(split, []).append(str(path))
    return found


def first_missing_part(root, files):
    """The first numbered file that the splits' `files` ({split: [paths under root]}) lack, as data/train-00001-of-00002
    (a Hub download cut short, which reads as a smaller split; older names end in a fingerprint), or None."""
    numbered = {}
    for path in (Path(path).relative_to(root) for paths in files.values() for path in paths):
        if part := re.fullmatch(r"(.+)-(\d+)-of-(\d+)(-[0-9a-f]+)?\.parquet", path.name):
            numbered.setdefault((path.parent / part[1], int(part[3])), set()).add(int(part[2]))
    gaps = [f"{stem}-{i:05d}-of-{n:05d}" for (stem, n), have in numbered.items() for i in range(n) if i not in have]
    return min(gaps, default=None)


def _load(root):
    """The DatasetDict at `root` (save_to_disk's, or its parquet files converted into datasets' cache)."""
    try:
        import datasets
    except ImportError:
        raise UsageError(
            f"--data {root} is a Hugging Face dataset, which needs the datasets package: "
            "pip install -r requirements-hf.txt"
        ) from None
    datasets.disable_progress_bars()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # (its log of a damaged file: the line below says it)
    try:
        if (Path(root) / "dataset_dict.json").is_file():  # (rows as dicts: not the format it was saved with)
            return datasets.load_from_disk(str(root)).with_format(None)
        files = parquet_splits(root)
        if missing := first_missing_part(root, files):
            raise UsageError(f"--data {root}: {missing}.parquet is missing (a download cut short?)")
        # (its cache read now: datasets reads HF_DATASETS_CACHE once, when imported)
        return datasets.load_dataset("parquet", data_files=files, cache_dir=os.environ.get("HF_DATASETS_CACHE"))
    except (Preempted, UsageError):  # (a stop; a numbered file missing)
        raise
    except Exception as error:  # damaged: a file cut short or missing, JSON or parquet that is not (pyarrow's, json's)
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise UsageError(f"--data {root}: the Hugging Face dataset cannot be loaded ({reason})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def load_splits(root):
    """(classes, train rows, val rows) of the dataset at `root` (HFRows); one line for what it lacks. Rank 0 loads it
    first (parquet: converted once), then every rank its own --data, which must hold rank 0's classes and rows."""
    first, error, facts = [], None, None  # rank 0's, kept: it loads once
    distributed.computed_by_rank_0(lambda: first.append(_splits(root)))
    try:
        classes, train, val = first[0] if first else _splits(root)
        facts = (classes, len(train), len(val))
    except UsageError as failure:  # (another node's copy, damaged: every rank stops with its line)
        error = str(failure)
    found = distributed.raise_any(error, facts)
    if any(other != found[0] for other in found):  # (found is every rank's: each raises it)
        raise UsageError(
            f"--data {root} holds other classes or rows than rank 0's (classes and train / val rows by rank: "
            f"{[(len(c), t, v) for c, t, v in found]}): every node's copy must hold the same dataset"
        )
    return classes, train, val


def _splits(root):
    loaded = _load(root)
    train = next((name for name in TRAIN_SPLITS if name in loaded), None)
    val = next((name for name in VAL_SPLITS if name in loaded), None)
    if train is None or val is None:
        raise UsageError(
            f"--data {root}: a Hugging Face dataset needs a train and a validation split; it has "
            f"{', '.join(loaded) or 'none'}"
        )
    features = loaded[train].features
    image = _column(root, train, features, IMAGE_NAMES, "Image")
    label = _column(root, train, features, LABEL_NAMES, "ClassLabel")
    if image is None or label is None:
        raise UsageError(
            f"--data {root}: its {train} split has no {'image' if image is None else 'label'} column "
            f"(columns: {', '.join(features)}); it needs a column of images (datasets.Image) and one of "
            "class indices (a ClassLabel, or integers named label)"
        )
    _check_validation(root, loaded, train, val, image, label)
    rows = {split: HFRows(loaded[split], image, label, f"{root}/{split}") for split in (train, val)}
    count = max(int(rows[train].labels.max(initial=-1)), int(rows[val].labels.max(initial=-1))) + 1
    classes = getattr(features[label], "names", None)
    unseen = np.setdiff1d(rows[val].labels, rows[train].labels) if classes is None else []
    beyond = [] if classes is None else np.unique(rows[val].labels[rows[val].labels >= len(classes)])
    if len(beyond):  # (a validation split of integers beside train's ClassLabel: an IndexError in the loss)
        raise UsageError(
            f"--data {root}: its {val} split has labels {', '.join(map(str, beyond[:5]))}, and its {train} split's "
            f"ClassLabel {len(classes)} classes: a label must name one of them"
        )
    if len(unseen):  # (as with train.csv: a class validation has and training never sees)
        raise UsageError(
            f"--data {root}: its {val} split has labels {', '.join(map(str, unseen[:5]))} that its {train} split "
            "never has (integer labels, no ClassLabel to name the classes): every class must be trained on"
        )
    return list(classes or [str(index) for index in range(count)]), rows[train], rows[val]


def _column(root, split, features, names, kind):
    """The column of `names` the split has first, else its only column of `kind` (None where it has none); several
    of `kind` and none named: one line (a dataset's other ClassLabel, a domain say, was trained on as the classes).
    A label column may be integers: named, it is taken whatever it holds (and checked later)."""
    typed = [name for name, feature in features.items() if type(feature).__name__ == kind]
    named = next((name for name in names if name in (features if kind == "ClassLabel" else typed)), None)
    if named is None and len(typed) > 1:
        raise UsageError(
            f"--data {root}: its {split} split has {len(typed)} {kind} columns ({', '.join(typed)}) and none named "
            f"{' or '.join(names)}: name the one to train on so (DatasetDict.rename_column)"
        )
    return named or next(iter(typed), None)


def _check_validation(root, loaded, train, val, image, label):
    """The validation split has the train split's image and label columns, and a ClassLabel whose class names are
    train's (or its first ones), in the same order: its label k must name train's class k."""
    theirs = loaded[val].features
    missing = [name for name in (image, label) if name not in theirs]
    if missing:
        raise UsageError(
            f"--data {root}: its {val} split has no column {missing[0]!r}, which its {train} split has "
            f"(columns: {', '.join(theirs)}): the splits need the same image and label columns"
        )
    names = [getattr(loaded[split].features[label], "names", None) for split in (train, val)]
    if None not in names and names[0][: len(names[1])] != names[1]:  # (train's first classes alone: the same labels)
        k = next((k for k, pair in enumerate(zip(*names)) if pair[0] != pair[1]), min(map(len, names)))
        said = [repr(split_names[k]) if k < len(split_names) else "none" for split_names in names]
        raise UsageError(
            f"--data {root}: its {val} split's class {k} is {said[1]}, its {train} split's {said[0]} "
            f"({len(names[1])} and {len(names[0])} classes): a label must name the same class in both"
        )


class HFRows:
    """The rows of one split: its labels (a column of integers, read whole) and each row's encoded image, read when
    asked (undecoded: datasets.Image(decode=False))."""

    def __init__(self, split, image, label, where):
        import datasets
        import pyarrow  # (datasets' own dependency)

        self.where, self.image = where, image
        column = split.data.column(label)
        if not pyarrow.types.is_integer(column.type):
            raise UsageError(
                f"--data {where}: its label column {label!r} holds {column.type}, not class indices: make it "
                "a ClassLabel (dataset.class_encode_column) or integers"
            )
        self.labels = np.array(column.fill_null(0).to_numpy(zero_copy_only=False), dtype=np.int64)
        self.labels[column.is_null().to_numpy(zero_copy_only=False)] = -1  # (a null: NaN, which a cast may make 0)
        if len(self.labels) == 0:
            raise UsageError(f"--data {where}: the split has no rows")
        missing = np.flatnonzero(self.labels < 0)
        if len(missing):
            raise UsageError(
                f"--data {where}: row {missing[0]} has no label ({len(missing)} of {len(self.labels)} rows "
                "lack one, as a test split does): train and validate on labelled splits"
            )
        self.rows = split.select_columns([image]).cast_column(image, datasets.Image(decode=False))

    def __len__(self):
        return len(self.labels)

    def encoded(self, index):
        """(bytes, file extension) of row `index`'s image (stored as a path: the file's bytes); a row without an image
        raises (an unreadable row)."""
        cell = self.rows[int(index)][self.image]
        if cell is None:
            raise ValueError("the row has no image")
        data, path = cell.get("bytes"), cell.get("path") or ""
        if data is None:  # (empty bytes are an empty image, never a path to read from the working directory)
            if not path:
                raise ValueError("the row has no image")
            with open_regular(path) as file:  # (a FIFO: refused, not waited on forever)
                data = file.read()
        return data, Path(path).suffix.lstrip(".") or "jpg"

    def name(self, index):
        """SPLIT[ROW], and the image's file name where the dataset keeps one: how a row that cannot be read is named."""
        try:  # (a row whose file was rewritten under the run: damaged in the memory map, named by its place alone)
            path = (self.rows[int(index)][self.image] or {}).get("path")
        except Exception:
            path = None
        return f"{self.where}[{index}]" + (f":{Path(path).name}" if path else "")

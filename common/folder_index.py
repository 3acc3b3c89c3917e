"""The file lists of an ImageNet-style folder (listed once per job, by rank 0) and of its train.csv and val.csv.

A folder's samples are one bytes blob of names with numpy labels, not ImageFolder's list of tuples, which forked loader
workers copy as reference counts touch it. The order is ImageFolder's: sample i is datasets.ImageFolder(root)[i].
"""

import csv
import errno
import os
import stat
import unicodedata
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .errors import UsageError

# torchvision.datasets.folder.IMG_EXTENSIONS (ImageFolder's), written out: importing torchvision imports torch, which
# tools/prepare_imagenet.py does not need (tests/unit/test_folder_index.py compares the two).
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
# Written first into the folder it writes by tools/make_shards.py and tools/prepare_imagenet.py (their command line),
# removed once it is whole: --data with it is refused (its tool was stopped part-way, or is still writing it).
UNFINISHED = ".unfinished"


class NotRegularFile(OSError):
    """open_regular's refusal of a FIFO or a device: for good (tools/make_shards.py stores it empty)."""


def open_regular(path):
    """`path` opened to read as a binary file; NotRegularFile (naming it) unless it is a regular file or a folder (a
    link to one too): a FIFO named like an image or a shard would block its reader forever, a device never end. (A
    socket's open fails by itself: ENXIO; a folder's read: IsADirectoryError, as open()'s.)"""

    def regular(name, flags):
        try:
            fd = os.open(name, flags | os.O_NONBLOCK)  # (a FIFO's open waits for a writer without it)
        except BlockingIOError:  # (a regular file under another's lease: a plain open waits for it, as before)
            return os.open(name, flags)
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            os.close(fd)
            raise NotRegularFile(errno.EINVAL, "not a regular file (a FIFO or a device)", str(name))
        os.set_blocking(fd, True)
        return fd

    return open(path, "rb", opener=regular)  # (its name the path's: PIL's errors name it)


def mark_unfinished(root, command):
    """Mark `root` unfinished by a tool run as `command`, before it writes what a run reads there."""
    from .run_dir import atomic_write

    atomic_write(Path(root) / UNFINISHED, lambda file: file.write(command.encode("utf-8", "surrogateescape")))


def mark_finished(root):
    """Unmark `root` once everything the tool wrote there is on disk (synced before its rename)."""
    from .run_dir import fsync

    (Path(root) / UNFINISHED).unlink(missing_ok=True)
    fsync(root)


def refuse_unfinished(root, what="--data", then="train"):
    """UsageError if a tool of ours has not finished writing `root` (it holds UNFINISHED), said of it as `what`."""
    marker = Path(root) / UNFINISHED
    if not os.path.lexists(marker):
        return
    try:
        command = " ".join(marker.read_text(errors="replace").split()) or "the tool that writes it"
    except OSError:
        command = "the tool that writes it"
    raise UsageError(
        f"{what} {root} is unfinished: {command if len(command) <= 1000 else command[:1000] + '...'} stopped part-way "
        f"through writing it, or is still writing it; run that command again to finish it (it carries on), then {then}"
    )


class NameTable:
    """Names held compactly: one blob of NUL-terminated names (no file name holds a NUL) and a numpy array of where
    each ends. table[i] is name i."""

    def __init__(self, blob):
        self.blob = blob
        self.ends = np.flatnonzero(np.frombuffer(blob, dtype=np.uint8) == 0)

    def __getitem__(self, index):
        start = self.ends[index - 1] + 1 if index else 0
        return os.fsdecode(self.blob[start : self.ends[index]])


class FolderIndex:
    """(path, label) of every image file under root/<class>/, as a sequence; `names[k]` lists the files of class k
    relative to its folder (held in one NameTable, `self.names`)."""

    def __init__(self, root, classes, names):
        self.root, self.classes = str(root), list(classes)
        self.names = NameTable(os.fsencode("\0".join(["\0".join(class_names) for class_names in names])) + b"\0")
        self.labels = np.repeat(np.arange(len(names), dtype=np.int32), [len(class_names) for class_names in names])

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        label = int(self.labels[index])
        return os.path.join(self.root, self.classes[label], self.names[index]), label


def image_files(class_dir):
    """Names relative to class_dir of the image files below it (links followed), in ImageFolder's order."""
    folders, pending = [], [""]
    while pending:
        folder = pending.pop()
        with os.scandir(os.path.join(class_dir, folder)) as listing:
            entries = list(listing)
        names = [entry.name for entry in entries if not entry.is_dir()]
        if len(names) < len(entries):
            pending += [os.path.join(folder, entry.name) for entry in entries if entry.is_dir()]
        names = sorted(name for name in names if name.lower().endswith(IMG_EXTENSIONS))
        folders.append((folder, [os.path.join(folder, name) for name in names] if folder else names))
    return [name for _, names in sorted(folders) for name in names]


class Scan(NamedTuple):
    classes: list
    train: FolderIndex
    val: FolderIndex


def scan_image_folder(root):
    """The classes and samples of root/train and root/val; UsageError unless both are image folders with the same,
    non-empty classes."""
    root = Path(root)
    if root.is_file():
        raise UsageError(f"--data {root}: a file; give the folder that holds train/ and val/ (or their CSV files)")
    if not root.is_dir():
        raise UsageError(f"--data {root}: no such directory")
    classes, files = {}, {}
    try:
        for split in ("train", "val"):
            folder = root / split
            if not folder.is_dir():
                raise UsageError(f"--data {root} has no {split}/ folder: expected {root}/{{train,val}}/<class>/<image>")
            classes[split] = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
            if not classes[split]:
                raise UsageError(f"{folder} has no class folders: expected {folder}/<class>/<image>")
            files[split] = {name: image_files(folder / name) for name in classes[split]}
            empty = [name for name, found in files[split].items() if not found]
            if empty:
                raise UsageError(
                    f"class folder(s) {', '.join(empty)} in {folder} hold no images "
                    f"({', '.join(IMG_EXTENSIONS[:3])}, ...): add images or remove the folder"
                )
    except OSError as error:
        raise UsageError(f"cannot list {error.filename}: {error.strerror}") from None
    if classes["train"] != classes["val"]:
        only_train = sorted(set(classes["train"]) - set(classes["val"]))
        only_val = sorted(set(classes["val"]) - set(classes["train"]))
        alike = {unicodedata.normalize("NFC", name) for name in only_train} & {
            unicodedata.normalize("NFC", name) for name in only_val
        }  # (a name typed on macOS, NFD, and elsewhere, NFC: alike on screen)
        raise UsageError(
            f"train/ and val/ in {root} have different classes "
            f"(only in train: {', '.join(only_train) or '-'}; only in val: {', '.join(only_val) or '-'})"
            + (f": {', '.join(sorted(alike))} in two Unicode forms (NFC and NFD): rename one" if alike else "")
        )

    def index(split):
        return FolderIndex(root / split, classes[split], [files[split][name] for name in classes[split]])

    return Scan(classes["train"], index("train"), index("val"))


def rgb(image):
    """A PIL image in RGB. 16-bit grayscale (a PNG's; a PGM's, which PIL opens as 32-bit "I") scaled to its high byte,
    as torchvision scales it, not clipped to white, as PIL's convert("RGB") would; another 32-bit image, whose range
    nothing says (a TIFF's), as convert("RGB") makes it (ImageFolder's), not shifted to black. (Here, beside the
    file lists: tools/ decode images without importing torch.)"""
    from PIL import Image

    if image.mode in ("I;16", "I;16B", "I;16L") or (image.mode == "I" and image.format in ("PNG", "PPM")):
        return Image.fromarray((np.asarray(image, dtype=np.int32).clip(0, 65535) >> 8).astype(np.uint8)).convert("RGB")
    return image.convert("RGB")


# The file lists of train.csv and val.csv (or .tsv).


def read_split_file(path, root):
    """[(path, class name)] of a CSV or TSV split file of rows `path,label` (a first such row is a header), paths
    relative to `root` unless absolute."""
    delimiter, rows, end = "\t" if path.suffix == ".tsv" else ",", [], 0  # end: the line the last record ended on
    try:  # (utf-8-sig: as Excel's "CSV UTF-8" saves it, its mark before the header)
        with open(path, newline="", encoding="utf-8-sig") as file:
            reader = csv.reader(file, delimiter=delimiter)
            for row in reader:
                line, end = end + 1, reader.line_num  # (a quoted field may hold line breaks: the record's first line)
                # A header: path,label (image,label, filename,label: a first row whose label is "label", no image)
                if not row or (not rows and len(row) == 2 and is_header(*row)):
                    continue
                if len(row) != 2 or not row[0].strip() or not row[1].strip():
                    got = delimiter.join(row)
                    raise UsageError(
                        f"{path} line {line}: expected path{delimiter}label, got {got[:200]!r}"
                        + (f" ({len(got):,} characters: an unbalanced quote?)" if len(got) > 200 else "")
                    )
                rows.append((os.path.join(root, row[0].strip()), row[1].strip()))
    except csv.Error as error:  # (a field past csv's limit, 128 KiB: an unbalanced quote in a large file)
        raise UsageError(f"{path} line {end + 1}: {error} (an unbalanced quote?)") from None
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError:  # (its line found in the bytes, read again: a rare error)
        data = Path(path).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as error:
            line, byte = data.count(b"\n", 0, error.start) + 1, data[error.start]
            raise UsageError(f"{path} line {line}: byte {byte:#04x} is not UTF-8: save the file as UTF-8") from None
        raise UsageError(f"cannot read {path}: it changed while it was read") from None
    if not rows:
        raise UsageError(f"{path} lists no images: expected lines path{delimiter}label")
    return rows


def is_header(path, label):
    return label.strip().lower() == "label" and not path.strip().lower().endswith(IMG_EXTENSIONS)


SPLIT_FILES = (".csv", ".tsv")  # train.csv and val.csv, or .tsv


def split_files(root):
    """{split: path} of the CSV or TSV split files in `root` (train.csv and val.csv, or .tsv), or None."""
    for suffix in SPLIT_FILES:
        found = {split: Path(root) / f"{split}{suffix}" for split in ("train", "val")}
        if any(path.is_file() for path in found.values()):
            missing = [path.name for path in found.values() if not path.is_file()]
            if missing:
                raise UsageError(
                    f"--data {root} has {'train' if 'val' in missing[0] else 'val'}{suffix} but no "
                    f"{missing[0]}: give both splits"
                )
            return found
    return None


def scan_split_files(root):
    """The classes (the train split's labels, sorted) and (path, label) samples of root/train.csv and root/val.csv
    (or .tsv); UsageError for a val label that training never sees."""
    rows = {split: read_split_file(path, root) for split, path in split_files(root).items()}
    classes = sorted({label for _, label in rows["train"]})
    index = {name: k for k, name in enumerate(classes)}
    unknown = sorted({label for _, label in rows["val"]} - index.keys())
    if unknown:
        raise UsageError(f"val labels {', '.join(unknown[:5])} of {root} do not occur in its train split")
    return classes, *([(path, index[label]) for path, label in rows[split]] for split in ("train", "val"))

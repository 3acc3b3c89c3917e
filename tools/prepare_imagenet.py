"""Turn the ImageNet (ILSVRC2012) downloads into the folders the training scripts read:
OUT_DIR/train/<wnid>/*.JPEG and OUT_DIR/val/<wnid>/*.JPEG (torchvision's ImageFolder layout).

    python tools/prepare_imagenet.py ~/downloads/imagenet /data/imagenet
    python tools/prepare_imagenet.py ~/downloads/imagenet /data/imagenet-256 --resize 256
    python tools/prepare_imagenet.py ~/kaggle/imagenet-object-localization-challenge /data/imagenet
    python tools/prepare_imagenet.py ~/downloads/imagenet /data/imagenet-shards --shards
    python train_dp.py --data /data/imagenet

ARCHIVE_DIR holds the official archives (ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar and
ILSVRC2012_devkit_t12.tar.gz; their MD5s are checked unless --skip-md5), or an extracted train/<wnid>/
and a flat val/ (also found under Kaggle's ILSVRC/Data/CLS-LOC/) labelled by Kaggle's
LOC_val_solution.csv or by the devkit, or a val/<wnid>/ already sorted into class folders (as
pytorch/examples' valprep.sh leaves it; no labels needed). Extracted images are hard-linked, not
copied. Reading the devkit needs scipy: pip install -r requirements-imagenet.txt.

--resize N stores every image with its shorter side at most N pixels, as an RGB JPEG of --quality
(90 by default; keep it at 90 or more). A loader worker reads those faster: 1.7x at --resize 256 for
224 px crops, 2.7x at --resize 160 for 160 px crops, on 500x375 photos (docs/benchmarks.md). Without
it, the bytes are copied unchanged.

--shards writes OUT_DIR as tools/make_shards.py writes it from the folders this script makes (webdataset tar
shards, each with its index; --shard-size images each), straight from the archives or folders, with no extracted
copy: the same shards, byte for byte (with --resize N: those of make_shards.py --resize N on the folders this
script makes without it).

Stopped (Ctrl-C, a kill, a crash, a power loss)? Run the same command again: it carries on where it
stopped. Every file is fsynced before it is renamed into place, and a class is marked done only once its
images are on disk; a rerun checks each marker against the files (their number and total size) and
redoes, with a warning, a class whose marker is empty, corrupt or does not match. Until every class is done,
OUT_DIR/.unfinished says so and the training scripts refuse OUT_DIR.
"""

import argparse
import contextlib
import csv
import hashlib
import io
import json
import os
import shutil
import signal
import sys
import tarfile
import time
from concurrent.futures import as_completed
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from pathlib import Path
from typing import Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.cli import Parser
from common.errors import NO_ROOM, UsageError, console_never_fails
from common.folder_index import IMG_EXTENSIONS, mark_finished, mark_unfinished
from common.run_dir import atomic_write, link_or_copy
from common.run_dir import fsync as sync
from common.shards import MANIFEST
from shared import (
    Stopped,
    command_line,
    output_lock,
    overlap,
    resize_jpeg,
    stop_on_signals,
    stop_workers,
    whole,
    worker_pool,
)

# torchvision.datasets.imagenet.ARCHIVE_META, written out: importing torchvision imports torch, which made this tool
# take 7 s of CPU to start and seconds to exit (tests/test_prepare_imagenet.py compares the two).
ARCHIVE_META = {
    "train": ("ILSVRC2012_img_train.tar", "1d675b47d978889d74fa0da5fadfb00e"),
    "val": ("ILSVRC2012_img_val.tar", "29b22e2961454d5413ddabcf34fc5622"),
    "devkit": ("ILSVRC2012_devkit_t12.tar.gz", "fa75699e90414af021442c21a62c3abf"),
}
TRAIN_TAR, VAL_TAR, DEVKIT = (ARCHIVE_META[key][0] for key in ("train", "val", "devkit"))
OFFICIAL_MD5 = dict(ARCHIVE_META.values())
KAGGLE_ROOT, KAGGLE_LABELS = "ILSVRC/Data/CLS-LOC", "LOC_val_solution.csv"
OFFICIAL_COUNTS = {"classes": 1000, "train images": 1_281_167, "val images": 50_000}
STATE = ".prepare"  # completion markers and MD5 stamps, outside the class folders
VAL_CHUNK = 500  # val images per task of the worker pool
SHARD_SIZE = 2500  # images per shard with --shards, as tools/make_shards.py's default


class Failure(Exception):
    """One line on stderr and exit code 2 (bad input), or `exit_code` (1: a full disk, as the training scripts')."""

    def __init__(self, message, exit_code=2):
        super().__init__(message)
        self.exit_code = exit_code


def unwritable(out_dir, error):
    """The Failure of the OSError `error` writing to OUT_DIR: exit code 1 and "make room" where the disk or quota is
    full, else exit code 2."""
    if error.errno in NO_ROOM:
        return Failure(f"cannot write to {out_dir} ({error.strerror}): make room, then run the same command again", 1)
    return Failure(f"cannot write to {out_dir}: {error.strerror or error}")


class Job(NamedTuple):
    """A task of the pool: one train class or a chunk of val images; done once its marker exists."""

    marker: str
    split: str
    source: str  # the archive or folder it reads
    read: Callable  # read(source, *args) yields (wnid, file name, bytes or the path of a file on disk)
    args: tuple


def say(line):
    """A warning or error on stderr, over the progress line on a terminal."""
    print(("\r\033[K" if sys.stderr.isatty() else "") + line, file=sys.stderr, flush=True)


def duration(seconds):
    if seconds < 90:
        return f"{seconds:.{1 if seconds < 10 else 0}f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


class Progress:
    """A progress line on stderr for work that takes over a second: redrawn in place on a terminal,
    a new line every 10% in a log."""

    def __init__(self, label, total):
        self.label, self.total, self.done, self.tenths = label, max(total, 1), 0, 0
        self.start = self.drawn = time.monotonic()

    def update(self, step, details=""):
        self.done += step
        now, fraction, tty = time.monotonic(), self.done / self.total, sys.stderr.isatty()
        if now - self.start < 1 or not (now - self.drawn > 0.5 if tty else int(fraction * 10) > self.tenths):
            return
        self.drawn, self.tenths = now, int(fraction * 10)
        left = (now - self.start) * (self.total - self.done) / self.done
        line = f"{self.label}: {fraction:.0%}{details}, {duration(left)} left"
        print(f"\r{line}\033[K" if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)

    def close(self):
        if sys.stderr.isatty() and self.drawn > self.start:
            print(file=sys.stderr)


def write_atomically(path, data, sync_folder=True):
    """A final path never holds half a file, even after a power loss (common/run_dir.py). Images pass
    sync_folder=False: run_job syncs their folder once, before the marker."""
    atomic_write(path, lambda file: file.write(data), sync_folder)


def class_tar_members(file, offset, size):
    """(tar, member) of each member of the class's tar at `offset` (of `size` bytes) in the open train archive `file`,
    offsets counted from the archive's start. TarError for a damaged header (tarfile takes one after an archive's
    first for its end: a class's images left out unsaid) or an image running past the class's tar."""
    file.seek(offset)
    with tarfile.open(fileobj=file, mode="r:") as inner:
        while (member := inner.next()) is not None and member.offset < offset + size:
            if member.offset_data + member.size > offset + size:
                raise tarfile.ReadError(f"{member.name} runs past the end of its class's tar (damaged)")
            yield inner, member
        check_tar_end(inner, offset + size)


def check_tar_end(tar, end=None):
    """TarError unless the read of `tar`'s members stopped at its end (its zero blocks, the file's end or `end`)."""
    if end is None or tar.offset < end:
        tar.fileobj.seek(tar.offset)
        if tar.fileobj.read(tarfile.BLOCKSIZE).strip(b"\0"):
            raise tarfile.ReadError(f"damaged tar header at byte {tar.offset:,}")


def class_tar(archive, wnid, offset, size):
    """The images of one class's tar inside the train archive, read in place: no extracted copy."""
    with open(archive, "rb") as file:
        for inner, member in class_tar_members(file, offset, size):
            if member.isfile() and member.name.lower().endswith(IMG_EXTENSIONS):  # (not a Thumbs.db)
                yield wnid, os.path.basename(member.name), inner.extractfile(member).read()


def tar_members(archive, items):
    """Images [(wnid, name, offset, size)] stored in an archive."""
    with open(archive, "rb") as file:
        for wnid, name, offset, size in items:
            file.seek(offset)
            yield wnid, name, file.read(size)


def class_folder(folder, wnid):
    """The images of an extracted class folder, as paths."""
    return [
        (wnid, name, os.path.join(folder, name))
        for name in sorted(os.listdir(folder))
        if name.lower().endswith(IMG_EXTENSIONS)
    ]


def val_files(folder, items):
    """Extracted val images [(wnid, name, path)]."""
    return items


def store(dest, source, resize, quality):
    """Put one image (bytes, or a file's path) at dest, over what is there: (False if --resize could not
    decode it, its size). An image --resize cannot decode is copied unchanged, and the training loader
    reports it."""
    decoded = True
    if resize:
        source = Path(source).read_bytes() if isinstance(source, str) else source
        try:
            source = resize_jpeg(source, resize, quality)
        except (OSError, SyntaxError, ValueError):
            decoded = False
    if isinstance(source, bytes):
        write_atomically(dest, source, sync_folder=False)
        return decoded, len(source)
    link_or_copy(source, dest)  # a hard link: no second 140 GB, the source's own bytes, nothing new to sync
    return decoded, os.stat(dest).st_size


def finished_size(dest, source, resize):
    """The size of the image at dest if a killed run finished it (not empty, and the source's size
    unless --resize), synced again (an older version of this script did not); else None."""
    try:
        fd = os.open(dest, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        expected = None if resize else len(source) if isinstance(source, bytes) else os.stat(source).st_size
        if size == 0 or (expected is not None and size != expected):
            return None
        os.fsync(fd)
        return size
    finally:
        os.close(fd)


def source_of(job):
    """What a job reads, in short, as its marker records it: a rerun redoes a job whose source changed since (images
    added to a class folder, a val image more in a chunk). A class's tar: where it lies in the train archive (its
    images' names would take a read of the archive); else a hash of the images' names."""
    if job.read is class_tar:
        return list(job.args[1:])
    items = class_folder(job.source, *job.args) if job.read is class_folder else job.args[0]
    names = "\n".join(f"{wnid}/{name}" for wnid, name, *_ in items)
    return hashlib.sha256(names.encode("utf-8", "surrogateescape")).hexdigest()


def run_job(job, out_dir, resize, quality, redo=False):
    """Put a job's images in place, keeping those a killed run finished (every one written again when
    `redo`: its marker did not match them), remove a class folder's images no longer in the source, sync their
    folders, then write its marker."""
    images, total, undecodable, folders, names, removed = 0, 0, [], {}, set(), []
    try:
        for wnid, name, source in job.read(job.source, *job.args):
            dest = out_dir / job.split / wnid / name
            names.add(name)
            if dest.parent not in folders:
                dest.parent.mkdir(exist_ok=True)
                folders[dest.parent] = True
            size = None if redo else finished_size(dest, source, resize)
            if size is None:
                decoded, size = store(dest, source, resize, quality)
                if not decoded:
                    undecodable.append(f"{job.split}/{wnid}/{name}")
            images, total = images + 1, total + size
        folder = out_dir / "train" / job.args[0] if job.split == "train" else None
        if folder is not None and folder.is_dir():
            folders[folder] = True  # (images gone from the source: not left to train on)
            with os.scandir(folder) as entries:
                for entry in entries:  # (a file of the user's own, or a folder, left as it is)
                    if stored_image(entry) and entry.name not in names:
                        os.unlink(entry.path)
                        removed.append((job.args[0], entry.name))
        for folder in [*folders, out_dir / job.split]:  # the renames (and new folders) on disk before the marker
            sync(folder)
        write_atomically(
            out_dir / STATE / job.marker,
            json.dumps(
                {"images": images, "bytes": total, "undecodable": undecodable, "source": source_of(job)}
            ).encode(),
        )
    except OSError as error:
        if error.errno in NO_ROOM:
            raise unwritable(out_dir, error) from None
        raise Failure(f"{job.source} ({job.marker.removesuffix('.done')}): {error}") from None
    except (tarfile.TarError, EOFError) as error:
        raise Failure(f"{job.source} ({job.marker.removesuffix('.done')}): {error}") from None
    return images, undecodable, removed


def read_marker(path):
    """{"images", "bytes", "undecodable", "source"} from a job's marker ("bytes" None in the [images, undecodable] of
    older versions, "source" None in theirs and in markers without it). OSError if it cannot be read, ValueError
    (why, in words) if it is not one."""
    data = path.read_bytes()
    if not data:
        raise ValueError("is empty")
    try:
        record = json.loads(data)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError("is cut short or corrupt (not JSON)") from None
    if isinstance(record, list) and len(record) == 2:
        record = {"images": record[0], "bytes": None, "undecodable": record[1]}
    if not (
        isinstance(record, dict)
        and isinstance(record.get("images"), int)
        and isinstance(record.get("bytes"), (int, type(None)))
        and isinstance(record.get("undecodable"), list)
        and isinstance(record.setdefault("source", None), (str, list, type(None)))
    ):
        raise ValueError("is not a marker this script writes")
    return record


def stored_image(entry):
    """Whether the os.scandir `entry` of a class folder in OUT_DIR is an image as this script stores one (neither a
    temporary, a link, a folder nor a file of the user's own): what a marker counts, and what a rerun may remove."""
    return (
        not entry.name.startswith(".")
        and entry.is_file(follow_symlinks=False)
        and entry.name.lower().endswith(IMG_EXTENSIONS)
    )


def image_sizes(job, out_dir):
    """The sizes of the images a job put in OUT_DIR, as they are now: those in its class folder (train),
    those of its names found (val)."""
    try:
        if job.split == "train":
            try:
                with os.scandir(out_dir / "train" / job.args[0]) as entries:  # no temporaries: open_output
                    return [entry.stat().st_size for entry in entries if stored_image(entry)]
            except FileNotFoundError:
                return []
        sizes = []
        for wnid, name, *_ in job.args[0]:
            with contextlib.suppress(FileNotFoundError):
                sizes.append(os.stat(out_dir / "val" / wnid / name).st_size)
        return sizes
    except OSError as error:
        raise Failure(f"cannot list {error.filename}: {error.strerror or error}")


def described(job):
    if job.split == "train":
        return f"train/{job.args[0]}"
    start = int(job.marker.removeprefix("val-").removesuffix(".done")) * VAL_CHUNK
    return f"val images {start + 1:,} to {start + len(job.args[0]):,} (in name order)"


def check_marker(job, out_dir):
    """(whether the job is done, a warning line or None). A marker is trusted once it reads as one and
    the images it counts are there with its total size (a stat each, no reading): after a power loss,
    writes of an older version of this script could be empty."""
    path = out_dir / STATE / job.marker
    try:
        record = read_marker(path)
    except FileNotFoundError:
        return False, None
    except ValueError as error:
        problem = str(error)
    except OSError as error:
        problem = f"cannot be read ({error.strerror or error})"
    else:
        sizes, images, size = image_sizes(job, out_dir), record["images"], record["bytes"]
        try:
            source = None if record["source"] is None else source_of(job)  # (None: a marker of an older version)
        except OSError as error:  # (a class folder of the source that cannot be listed now)
            raise Failure(f"cannot list {error.filename}: {error.strerror or error}") from None
        # size None: the marker of an older version, without it; then only no image may be empty
        if source != record["source"]:
            problem = "was written from other images than the source holds now (some added, removed or renamed)"
        elif len(sizes) == images and (0 not in sizes if size is None else sum(sizes) == size):
            return True, None
        else:
            problem = (
                f"says {images:,} images"
                + ("" if size is None else f" of {size:,} bytes")
                + f", but {len(sizes):,} of {sum(sizes):,} bytes are there"
                + (f" ({sizes.count(0):,} empty)" if 0 in sizes else "")
            )
    return False, f"warning: {path} {problem}: redoing {described(job)}"


def find_inputs(archive_dir):
    """The train images, val images and val labels: an archive or a folder each."""
    if not archive_dir.is_dir():
        raise Failure(f"{archive_dir}: no such directory")
    roots = (archive_dir, archive_dir / KAGGLE_ROOT)
    found = [
        next((path for path in candidates if path.exists()), None)
        for candidates in (
            [archive_dir / TRAIN_TAR, *(root / "train" for root in roots)],
            [archive_dir / VAL_TAR, *(root / "val" for root in roots)],
            [archive_dir / KAGGLE_LABELS, archive_dir / DEVKIT],
        )
    ]
    labelled = found[1] is not None and sorted_val(found[1])  # by its folders: no CSV, devkit or scipy needed
    missing = [
        name
        for name, path in zip((TRAIN_TAR, VAL_TAR, DEVKIT), found)
        if path is None and not (name == DEVKIT and labelled)
    ]
    if missing:
        raise Failure(
            f"{archive_dir} lacks {', '.join(missing)}: expected the official archives, or extracted "
            f"train/ and val/ (maybe under {KAGGLE_ROOT}/) with {KAGGLE_LABELS} or {DEVKIT}, "
            "or a val/ sorted into <wnid>/ folders (valprep.sh)"
        )
    return found[0], found[1], None if labelled else found[2]


def sorted_val(val):
    """Whether an extracted val/ is sorted into class folders (pytorch/examples' valprep.sh): folders,
    and no image outside them (one part-way through valprep.sh needs labels for those)."""
    if not val.is_dir():
        return False
    folders = False
    try:
        with os.scandir(val) as entries:
            for entry in entries:
                if entry.is_dir():
                    folders = True
                elif entry.name.lower().endswith(IMG_EXTENSIONS):
                    return False
    except OSError as error:
        raise Failure(f"cannot list {val}: {error.strerror or error}")
    return folders


def verify_md5(path, state):
    """Chunked MD5 against the official one. A pass is remembered with the file's size and mtime:
    a rerun does not hash 140 GB again."""
    stat, expected = path.stat(), OFFICIAL_MD5[path.name]
    stamp, key = state / f"md5-{path.name}", f"{expected} {stat.st_size} {stat.st_mtime_ns}"
    if stamp.exists() and stamp.read_bytes() == key.encode():
        return
    digest, progress = hashlib.md5(), Progress(f"MD5 of {path.name}", stat.st_size)
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
            progress.update(len(chunk), f" of {stat.st_size / 1e9:.1f} GB")
    progress.close()
    if digest.hexdigest() != expected:
        raise Failure(
            f"{path} does not have the official MD5 ({digest.hexdigest()}, not {expected}): download it "
            "again, or pass --skip-md5 if you re-packed it on purpose"
        )
    write_atomically(stamp, key.encode())


def require_scipy():
    try:
        import scipy.io  # noqa: F401  (meta.mat is a MATLAB file)
    except ImportError:
        raise Failure("reading the devkit's meta.mat needs scipy: pip install -r requirements-imagenet.txt")


DEVKIT_DATA = "ILSVRC2012_devkit_t12/data"
VAL_WNIDS = "val_wnids.json"  # the devkit's val labels, parsed once, in the state folder


def parse_devkit(archive):
    """The wnid of each val image, in image order (line i of the ground truth is ILSVRC2012_val_<i>), read from the
    devkit archive as torchvision's parse_devkit_archive reads it: meta.mat's synsets without children, by their
    ILSVRC2012_ID. (Its MD5 is verify_md5's, unless --skip-md5 said not to check it.)"""
    import scipy.io

    with tarfile.open(archive) as tar:
        meta = scipy.io.loadmat(io.BytesIO(tar.extractfile(f"{DEVKIT_DATA}/meta.mat").read()), squeeze_me=True)
        truth = tar.extractfile(f"{DEVKIT_DATA}/ILSVRC2012_validation_ground_truth.txt").read().split()
    wnid = {int(synset[0]): str(synset[1]) for synset in meta["synsets"] if synset[4] == 0}  # (ID, WNID, ..., children)
    return [wnid[int(index)] for index in truth]


def kaggle_labels(path):
    """{ImageId: the first wnid of its PredictionString, "wnid x y x y wnid x y x y ..."}."""
    labels = {}
    try:
        with open(path, newline="") as file:
            reader = csv.DictReader(file)
            if not {"ImageId", "PredictionString"} <= set(reader.fieldnames or ()):
                raise Failure(f"{path} does not start with the header ImageId,PredictionString")
            for row in reader:
                image, prediction = row["ImageId"], (row["PredictionString"] or "").split()
                if not image or not prediction:
                    raise Failure(f"{path}, line {reader.line_num}: no ImageId, or no wnid in its PredictionString")
                labels[image] = prediction[0]
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise Failure(f"cannot read {path}: {error}")
    return labels


def val_labels(labels, state):
    """{val image name without extension: wnid}, from Kaggle's CSV or the devkit."""
    if labels.name == KAGGLE_LABELS:
        return kaggle_labels(labels)
    try:
        wnids = json.loads((state / VAL_WNIDS).read_bytes())
    except (OSError, ValueError):  # none yet, or one cut short (a kill under an older version): parsed again
        try:
            wnids = parse_devkit(labels)
        except (OSError, tarfile.TarError, EOFError, KeyError, ValueError, IndexError) as error:
            raise Failure(f"cannot read the devkit {labels}: {error!r}")
        write_atomically(state / VAL_WNIDS, json.dumps(wnids).encode())
    return {f"ILSVRC2012_val_{index:08d}": wnid for index, wnid in enumerate(wnids, 1)}


def members(archive):
    try:
        with tarfile.open(archive) as tar:
            found = [member for member in tar if member.isfile()]
            check_tar_end(tar)
    except (OSError, tarfile.TarError, EOFError) as error:
        raise Failure(f"cannot read {archive}: {' '.join(str(error).split())} (download it again)")
    if found and found[-1].offset_data + found[-1].size > archive.stat().st_size:
        raise Failure(f"{archive} is truncated (download it again)")
    return found


def make_jobs(train, val, labels):
    """One job per train class, then chunks of val images. (torchvision's parse_train_archive and
    parse_val_archive are not used: they are neither resumable nor atomic per file.)"""
    try:
        if train.is_file():
            jobs = [
                Job(
                    f"train-{Path(m.name).stem}.done",
                    "train",
                    str(train),
                    class_tar,
                    (Path(m.name).stem, m.offset_data, m.size),
                )
                for m in members(train)
            ]
        else:
            jobs = [
                Job(f"train-{entry.name}.done", "train", entry.path, class_folder, (entry.name,))
                for entry in sorted(os.scandir(train), key=lambda entry: entry.name)
                if entry.is_dir()
            ]
        sorted_images = []  # (wnid, name, path) of val/<wnid>/ folders (valprep.sh's layout)
        if val.is_file():  # name: where it is (offset and size in the archive, or the file's path)
            images, read = {os.path.basename(m.name): (m.offset_data, m.size) for m in members(val)}, tar_members
        else:
            images, read = (
                {entry.name: (entry.path,) for entry in os.scandir(val) if entry.name.lower().endswith(IMG_EXTENSIONS)},
                val_files,
            )
            for entry in sorted(os.scandir(val), key=lambda entry: entry.name):
                if entry.is_dir():
                    sorted_images += class_folder(entry.path, entry.name)
    except OSError as error:  # a folder or an entry that cannot be listed (run_job reports a class folder's)
        raise Failure(f"cannot list {error.filename}: {error.strerror or error}")
    labelled = [
        (labels[Path(name).stem], name, *where) for name, where in sorted(images.items()) if Path(name).stem in labels
    ]
    if len(labelled) < len(images):
        say(f"warning: {len(images) - len(labelled)} val images have no label: left out")
    labelled = sorted(labelled + sorted_images, key=lambda image: (image[1], image[0]))  # in name order
    for start in range(0, len(labelled), VAL_CHUNK):
        jobs.append(
            Job(f"val-{start // VAL_CHUNK:04d}.done", "val", str(val), read, (labelled[start : start + VAL_CHUNK],))
        )
    return jobs


def open_output(out_dir, resize, quality):
    """OUT_DIR with no temporaries left by a killed run, refusing to mix --resize settings."""
    state, options = out_dir / STATE, json.dumps({"resize": resize, "quality": resize and quality})
    try:
        for folder in (state, out_dir / "train", out_dir / "val"):
            folder.mkdir(parents=True, exist_ok=True)
        sync(out_dir)  # .prepare, train and val on disk before what they hold
        stored = state / "options.json"
        if stored.exists():
            previous = stored.read_bytes()
            try:
                json.loads(previous)
            except ValueError:  # empty or cut short: written without fsync by an older version, then a crash
                say(
                    f"warning: {stored} is empty or corrupt: taking this run's options (if an earlier run had "
                    "another --resize or --quality, start again in a new OUT_DIR)"
                )
            else:
                if previous != options.encode():
                    raise Failure(
                        f"{out_dir} was prepared with other options ({previous.decode(errors='replace')}): "
                        "pass the same --resize and --quality to carry on, or choose a new OUT_DIR"
                    )
        write_atomically(stored, options.encode())
        for folder in [state, *(out_dir / "train").iterdir(), *(out_dir / "val").iterdir()]:
            for entry in os.scandir(folder):
                if entry.name.startswith(".") and (entry.name.endswith(".tmp") or ".tmp-" in entry.name):
                    shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
    except OSError as error:
        raise unwritable(out_dir, error) from None
    return state


def run_pool(jobs, redo, out_dir, args):
    """A worker's death (the OOM killer's SIGKILL) raises BrokenProcessPool, where a
    multiprocessing.Pool would wait for its task forever."""
    workers = min(args.workers or len(os.sched_getaffinity(0)), len(jobs))
    progress, images = Progress(f"preparing (workers: {workers})", len(jobs)), 0
    work = partial(run_job, out_dir=out_dir, resize=args.resize, quality=args.quality)
    pool = worker_pool(workers)
    try:
        for future in as_completed([pool.submit(work, job, redo=job.marker in redo) for job in jobs]):
            count, undecodable, removed = future.result()
            for name in undecodable:
                say(f"warning: cannot decode {name}: copied unchanged")
            if removed:
                say(
                    f"note: removed {len(removed)} image(s) that its source does not hold from train/"
                    f"{removed[0][0]}: {', '.join(name for _, name in removed[:3])}{', ...' * (len(removed) > 3)}"
                )
            images += count
            progress.update(1, f" ({images:,} images)")
    except BaseException:  # an error, Ctrl-C, SIGTERM or a dead worker: stop the workers now, mid-job
        stop_workers(pool)
        raise
    finally:
        pool.shutdown(cancel_futures=True)
    progress.close()


def class_members(archive, offset, size):
    """(file name, offset, size) of the images of the class's tar at `offset` (of `size` bytes) inside the train
    archive, their offsets in the archive itself: read by the shard writers in place."""
    with open(archive, "rb") as file:
        return [
            (os.path.basename(m.name), m.offset_data, m.size)
            for _, m in class_tar_members(file, offset, size)
            if m.isfile() and m.name.lower().endswith(IMG_EXTENSIONS)
        ]


def shard_samples(train, val, labels):
    """(classes, {split: [(key, extension, label, path, offset, size)]}) of the archives or folders, in the order of
    the folders this script writes (classes by wnid, each class's images by name): tools/make_shards.py's samples,
    an image inside an archive read at its offset there (offset None: a file read whole)."""
    from make_shards import sample_key

    jobs = make_jobs(train, val, labels)  # train: a job per class; val: chunks of images
    found = {"train": [], "val": []}  # (wnid, name, path, offset, size)
    for job in jobs:
        if job.read is class_tar:
            wnid, *where = job.args
            found["train"] += [
                (wnid, name, job.source, offset, size) for name, offset, size in class_members(job.source, *where)
            ]
        elif job.read is class_folder:
            found["train"] += [
                (wnid, name, path, None, None) for wnid, name, path in class_folder(job.source, *job.args)
            ]
        elif job.read is tar_members:
            found["val"] += [(wnid, name, job.source, offset, size) for wnid, name, offset, size in job.args[0]]
        elif job.read is val_files:
            found["val"] += [(wnid, name, path, None, None) for wnid, name, path in job.args[0]]
    wnids = sorted({wnid for wnid, *_ in found["train"]})
    label = {wnid: k for k, wnid in enumerate(wnids)}
    unknown = sum(wnid not in label for wnid, *_ in found["val"])
    if unknown:
        say(f"warning: {unknown} val images are of classes that train/ does not have: left out")
    return wnids, {
        split: [
            (*sample_key(Path(wnid) / name), label[wnid], path, offset, size)
            for wnid, name, path, offset, size in sorted(items)
            if wnid in label
        ]
        for split, items in found.items()
    }


def prepare_shards(args, train, val, labels):
    """--shards: OUT_DIR as tools/make_shards.py writes it from the folders this script would write, straight from
    the archives (no extracted copy): the same shards, byte for byte."""
    import make_shards

    try:
        classes, samples = shard_samples(train, val, labels)
    except (OSError, tarfile.TarError) as error:  # (a class's tar damaged, an archive unreadable)
        raise Failure(f"cannot read {train}: {error.strerror if isinstance(error, OSError) else error}") from None
    source = {"source": str(Path(args.archive_dir).resolve())}
    make_shards.write_all(Path(args.out_dir), classes, samples, source, args, locked=True)  # (its UsageError: main's)


def prepare(args):
    start, out_dir = time.monotonic(), Path(args.out_dir)
    train, val, labels = find_inputs(Path(args.archive_dir))
    crossing = overlap(
        [path for path in (train, val, labels) if path], [out_dir / "train", out_dir / "val", out_dir / STATE]
    )
    if crossing:  # (an OUT_DIR beside the inputs, ARCHIVE_DIR itself or a folder in it, is fine)
        raise Failure(
            f"OUT_DIR {out_dir} would write {crossing[1]} where it reads {crossing[0]}: give an OUT_DIR apart "
            "from the images it prepares"
        )
    holds = (
        "shards"
        if (out_dir / MANIFEST).exists()
        else "class folders"
        if any(path.is_dir() for path in (out_dir / "train").glob("*"))
        else None
    )
    if holds and holds != ("shards" if args.shards else "class folders"):
        raise Failure(
            f"{out_dir} holds {holds}: give the {'shards' if args.shards else 'class folders'} an OUT_DIR of their own"
        )
    with output_lock(out_dir):  # (a second run at once would remove this one's files in progress)
        prepare_out(args, out_dir, train, val, labels, start)


def prepare_out(args, out_dir, train, val, labels, start):
    """OUT_DIR's shards, or its folders (a job per class and per chunk of val images: those done before kept)."""
    state = out_dir / STATE if args.shards else open_output(out_dir, args.resize, args.quality)
    if labels and labels.name == DEVKIT:
        require_scipy()  # before the long MD5 check
    if args.shards:
        try:
            state.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise unwritable(out_dir, error) from None
    for path in [] if args.skip_md5 else [path for path in (train, val, labels) if path and path.name in OFFICIAL_MD5]:
        verify_md5(path, state)
    if args.shards:
        return prepare_shards(args, train, val, val_labels(labels, state) if labels else {})
    jobs = make_jobs(train, val, val_labels(labels, state) if labels else {})
    finished, redo = [], set()
    for job in jobs:
        done, warning = check_marker(job, out_dir)
        finished.append(done)
        if warning:
            say(warning)
            redo.add(job.marker)
    pending = [job for job, done in zip(jobs, finished) if not done]
    if any(finished):
        classes = [done for job, done in zip(jobs, finished) if job.split == "train"]
        say(
            f"carrying on: {sum(classes)} of {len(classes)} classes and {sum(finished) - sum(classes)} val chunks "
            "were done before"
        )
    if pending:  # marked unfinished (common/folder_index.py) until every class is done
        mark_unfinished(out_dir, args.command)
        run_pool(pending, redo, out_dir, args)
    summary(out_dir, jobs, time.monotonic() - start)
    mark_finished(out_dir)  # (last)


def summary(out_dir, jobs, seconds):
    """What OUT_DIR holds, earlier runs included (from the markers), and how it differs from ImageNet-1k."""
    records = [(job.split, read_marker(out_dir / STATE / job.marker)) for job in jobs]  # checked or just written
    found = {
        "classes": sum(split == "train" for split, _ in records),
        "train images": sum(record["images"] for split, record in records if split == "train"),
        "val images": sum(record["images"] for split, record in records if split == "val"),
    }
    undecodable = sum(len(record["undecodable"]) for _, record in records)
    print(
        f"prepared {out_dir} in {duration(seconds)}: "
        + ", ".join(f"{n:,} {what}" for what, n in found.items())
        + (f" ({undecodable} could not be decoded: copied unchanged)" if undecodable else ""),
        flush=True,
    )
    if found != OFFICIAL_COUNTS:
        say(
            "warning: ImageNet-1k has "
            + ", ".join(f"{n:,} {what}" for what, n in OFFICIAL_COUNTS.items())
            + ": is this a partial or different set?"
        )


def parse_args():
    parser = Parser(
        description=__doc__ and __doc__.split("\n\n")[0],
        epilog=__doc__ and __doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("archive_dir", metavar="ARCHIVE_DIR", help="the downloaded archives or extracted folders")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="where train/ and val/ are written")
    parser.add_argument("--resize", type=whole(1), metavar="N", help="shorter side at most N px, as RGB JPEG")
    parser.add_argument(
        "--quality",
        type=whole(1, 100),
        default=90,
        metavar="1-100",
        help="JPEG quality with --resize (%(default)s; 90 or more recommended)",
    )
    parser.add_argument("--workers", type=whole(1), metavar="N", help="processes (default: all usable cores)")
    parser.add_argument(
        "--skip-md5", action="store_true", help="do not check the official MD5s (re-packed or partial archives)"
    )
    parser.add_argument(
        "--shards",
        action="store_true",
        help="write webdataset tar shards (tools/make_shards.py's) instead of class folders",
    )
    parser.add_argument(
        "--shard-size", type=whole(1), metavar="N", help=f"images per shard with --shards ({SHARD_SIZE})"
    )
    args = parser.parse_args()
    if args.shard_size and not args.shards:  # (it would be ignored: class folders have no shards)
        parser.error(f"--shard-size {args.shard_size} is for --shards: add --shards, or leave it out")
    args.shard_size = args.shard_size or SHARD_SIZE
    args.command = command_line(__file__, sys.argv[1:])
    return args


def main():
    args = parse_args()
    before = stop_on_signals()
    try:
        prepare(args)
        return 0
    except (Failure, UsageError) as error:  # (UsageError: OUT_DIR written by another run, or not writable)
        say(f"error: {error}")
        return error.exit_code
    except BrokenProcessPool:
        say("error: a worker process died (out of memory?): run the same command again to carry on")
        return 1
    except OSError as error:  # (this process's own writes: the devkit's labels, MD5 stamps; the workers' are Failure)
        if error.errno not in NO_ROOM:
            raise
        say(f"error: {unwritable(args.out_dir, error)}")
        return 1
    except (KeyboardInterrupt, Stopped) as stopped:
        say("stopped: run the same command again to carry on")
        return 130 if isinstance(stopped, KeyboardInterrupt) else 143
    finally:  # (main() is called in-process by the tests)
        for signum, handler in before.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    console_never_fails()  # (`| head`, a full device: ends nothing)
    sys.exit(main())

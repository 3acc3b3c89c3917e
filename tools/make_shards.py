"""Write an ImageNet-style folder (or CSV split) as webdataset-format tar shards, each with its index.

    python tools/make_shards.py /data/imagenet /data/imagenet-shards
    python tools/make_shards.py /data/imagenet /data/imagenet-shards-256 --resize 256 --shard-size 5000
    python train_dp.py --data /data/imagenet-shards

SRC holds train/<class>/ and val/<class>/ (or train.csv and val.csv: path,label rows), as the training scripts read
it. OUT gets classes.txt (a class name a line: label k is line k), OUT/train/train-000000.tar, ... and OUT/val/
val-000000.tar, ...: in each shard, sample by sample in the folder's own sorted order (the order the scripts read the
folder in), KEY.EXT (the image's bytes: unchanged, or with --resize an RGB JPEG whose shorter side is at most N px,
as tools/prepare_imagenet.py --resize makes them) beside KEY.cls (its label). KEY is the image's path in its split
without the extension (dots in its name become "_"). Beside each shard, written after it, its index (.idx: each
sample's key, extension, label, byte offset and size, in numpy's .npz format), which the scripts read instead of the
shards to list the samples, and a loader worker reads each image at its offset. The same images in shards and in the
folder they came from give bitwise the same run. A file that cannot be read (a broken link) is stored empty, one
--resize cannot decode unchanged, each with a warning: training skips and names it, as on the folder.

Stopped (Ctrl-C, a kill, a crash)? Run the same command again: it carries on. A shard is written to a temporary
file, fsynced and renamed into place, then its index; a shard counts as done once its index matches it, and a
finished shard is never rewritten. Until the last shard is written, OUT/.unfinished says so and the training scripts
refuse OUT. A rerun after SRC changed (an image or a class added, removed, renamed or moved) is refused.
"""

import argparse
import contextlib
import errno
import hashlib
import io
import json
import os
import signal
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cli import Parser
from common.errors import NO_ROOM, NoRoom, UsageError, console_never_fails, printable
from common.folder_index import (
    NotRegularFile,
    mark_finished,
    mark_unfinished,
    open_regular,
    refuse_unfinished,
    scan_image_folder,
    scan_split_files,
    split_files,
)
from common.run_dir import atomic_write
from common.shards import (
    CLASSES,
    IMAGE_EXTENSIONS,
    MADE_HERE_VERSIONS,
    MANIFEST,
    index_tar,
    read_index,
    shard_stamp,
    write_index,
)
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


def sample_key(relative):
    """(key, extension) of an image at `relative` (its path in its split): the path without the extension, dots
    made "_" (a webdataset key ends at the first dot of a member's base name)."""
    relative = Path(relative)
    stem = relative.name.rsplit(".", 1)[0] if "." in relative.name else relative.name
    return "/".join([*relative.parent.parts, stem.replace(".", "_")]), relative.suffix[1:].lower()


def folder_samples(files, split_root):
    """The samples (key, extension, label, path, offset, size) of [(path, label)] files: each read whole (offset
    None), keyed by its path under `split_root`, else under SRC (split files list paths under it), else its name.
    An image whose name has no image extension is refused: the reader decodes by it, as the scripts decode a file."""
    samples = []
    for path, label in files:
        for root in (split_root, split_root.parent):
            try:  # (absolute: a CSV's absolute paths under a relative SRC)
                relative = Path(os.path.abspath(path)).relative_to(os.path.abspath(root))
                break
            except ValueError:
                relative = Path(Path(path).name)
        key, extension = sample_key(relative)
        if extension not in IMAGE_EXTENSIONS:
            raise UsageError(
                f"{path}: a name without an image extension ({', '.join(IMAGE_EXTENSIONS)}); shards store "
                "each image under its own: rename it"
            )
        samples.append((key, extension, label, str(path), None, None))
    return samples


GONE = (errno.ENOENT, errno.EACCES, errno.ELOOP, errno.EISDIR)  # a file that no rerun reads: stored empty


def read_sample(path, offset, size):
    """A sample's bytes: the file at `path`, or `size` bytes at `offset` in it (an image inside an archive)."""
    with open_regular(path) as file:  # (a FIFO named like an image: refused, not waited on forever)
        if offset is None:
            return file.read()
        file.seek(offset)
        return file.read(size)


def write_shard(shard, samples, resize, quality):
    """Write `shard` (atomically) from its samples (key, extension, label, path, offset, size), then its index; the
    warnings for the samples it could not read (stored empty) or --resize could not decode (stored unchanged): as
    on their folder, the training loader skips and names them."""
    warnings = []

    def write(file):
        with tarfile.open(fileobj=file, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for key, extension, label, *where in samples:
                try:
                    data = read_sample(*where)
                except OSError as error:
                    gone = error.errno in GONE or isinstance(error, NotRegularFile)  # (a FIFO: for good too)
                    if where[1] is not None or not gone:  # (a disk's or a mount's failure: not for good)
                        raise UsageError(
                            f"cannot read {printable(where[0])} ({error.strerror}): run the same command again once "
                            "it reads (it carries on)"
                        ) from None
                    data = b""  # (a broken link, a file without read permission: as on the folder, for good)
                    warnings.append(
                        f"cannot read {printable(where[0])} ({error.strerror}): stored empty as {key} (to read it "
                        f"again: delete {shard.name} and its index, and rerun)"
                    )
                if resize and data:
                    try:
                        data, extension = resize_jpeg(data, resize, quality), "jpg"
                    except (OSError, SyntaxError, ValueError):
                        warnings.append(f"cannot decode {key}: stored unchanged")
                for name, content in ((f"{key}.{extension}", data), (f"{key}.cls", str(label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size, info.mode = len(content), 0o644  # mtime 0, no owner: the same images, the same shard
                    tar.addfile(info, io.BytesIO(content))

    try:
        atomic_write(shard, write)
        index, cut = index_tar(shard)
        if cut is not None or [key for key, *_ in index] != [key for key, *_ in samples]:
            raise UsageError(
                f"{shard} does not read back as written ({len(index)} of its {len(samples)} samples): is the "
                "disk full or failing?"
            )
        write_index(shard, index, shard_stamp(shard))
    except OSError as error:  # (the shard or its index: a full disk, a quota; the shard's temporary removed)
        kind = NoRoom if error.errno in NO_ROOM else UsageError
        raise kind(f"cannot write {shard} ({error.strerror or error}): {REMEDY[kind]}") from None
    return warnings


REMEDY = {
    NoRoom: "make room, then run the same command again (it carries on)",
    UsageError: "run the same command again once it can be written (it carries on)",
}


def done(shard):
    """Whether `shard` and its index were written completely and still match (an index of version 1 too: this tool's
    shards are what the current version reads alike)."""
    try:
        read_index(shard, versions=MADE_HERE_VERSIONS)
        return True
    except (UsageError, FileNotFoundError):
        return False


LISTED = ("train", "val", "images")  # the manifest's record of what SRC held; the rest: the options


def open_output(out, manifest, classes, splits, command):
    """OUT, created, marked unfinished (common/folder_index.py: by `command`), with its manifest, class list and split
    folders (no temporary left by a killed run): whether an earlier run wrote it. UsageError if that run had other
    options or images, or OUT cannot be written (one line, nothing else written)."""
    path = out / MANIFEST
    try:
        out.mkdir(parents=True, exist_ok=True)
        earlier = None
        if path.exists():
            with contextlib.suppress(ValueError):  # (JSONDecodeError, UnicodeDecodeError: refused below)
                earlier = json.loads(path.read_bytes())
            if not isinstance(earlier, dict):  # (this tool writes it whole, or not at all)
                raise UsageError(
                    f"{path} is not a manifest this tool writes (empty, damaged or another's): give another OUT, or "
                    f"delete {out} to write the shards again"
                )
        changed = [name for name in manifest if name in (earlier or {}) and earlier[name] != manifest[name]]
        options = [f"{name} {earlier[name]} -> {manifest[name]}" for name in changed if name not in LISTED]
        if options:
            raise UsageError(
                f"{out} holds shards written with other options ({', '.join(options)}): give another OUT, or rerun "
                "the command that wrote them"
            )
        if changed:  # (an older version's manifest has no "images": its counts alone are compared)
            raise UsageError(
                f"{out} holds shards of other images than SRC's now (a class or an image added, removed, renamed or "
                f"moved since): give another OUT, or delete {out} to write them again"
            )
        mark_unfinished(out, command)
        if earlier is None:
            atomic_write(path, lambda file: file.write(json.dumps(manifest, indent=1).encode()))
        listed = "".join(f"{name}\n" for name in classes).encode("utf-8", "surrogateescape")  # (a name as its bytes)
        atomic_write(out / CLASSES, lambda file: file.write(listed))
        for split in splits:
            (out / split).mkdir(exist_ok=True)
            for stale in (out / split).glob(".*.tmp"):  # a killed run's unfinished shard
                stale.unlink()
    except OSError as error:  # (as tools/prepare_imagenet.py says it)
        if error.errno in NO_ROOM:
            raise NoRoom(f"cannot write to {out} ({error.strerror}): {REMEDY[NoRoom]}") from None
        raise UsageError(f"cannot write to {out}: {error.strerror or error}") from None
    return earlier is not None


def make_shards(args):
    src, out = Path(args.src), Path(args.out)
    if not src.is_dir():
        raise UsageError(f"SRC {src} is not a folder")
    # (a stopped tools/prepare_imagenet.py's OUT_DIR: its shards would look whole)
    refuse_unfinished(src, "SRC", "make the shards")
    try:
        classes, train, val = scan_split_files(src) if split_files(src) else scan_image_folder(src)
    except UsageError as error:  # said of the training scripts' --data: here it is SRC
        text = str(error)
        raise UsageError(
            f"SRC {src}{text[len(f'--data {src}') :]}" if text.startswith(f"--data {src}") else text
        ) from None
    broken = next((name for name in classes if "\n" in name or "\r" in name), None)
    if broken is not None:  # (classes.txt lists a class a line)
        raise UsageError(f"SRC {src}: class {printable(broken)} has a line break in its name: rename it")
    samples = {"train": folder_samples(train, src / "train"), "val": folder_samples(val, src / "val")}
    folders = {os.path.dirname(path) for items in samples.values() for _, _, _, path, _, _ in items}
    crossing = overlap([src / "train", src / "val", *sorted(folders)], [out / "train", out / "val"])
    if crossing:  # (an OUT beside train/ and val/, in SRC or SRC itself for an image folder, is fine)
        raise UsageError(
            f"OUT {out} would write {crossing[1]} where it reads {crossing[0]}: give an OUT apart from SRC's images"
        )
    write_all(out, classes, samples, {"source": str(src.resolve())}, args)


def write_all(out, classes, samples, source, args, locked=False):
    """OUT's class list and shards of samples {split: [(key, extension, label, path, offset, size)]}, in their order,
    args.shard_size each, the shards not done yet written by args.workers processes. OUT's lock (shared.output_lock)
    held meanwhile, unless the caller holds it (`locked`: tools/prepare_imagenet.py --shards)."""
    for split, items in samples.items():
        first = {}
        for key, _, _, path, offset, _ in items:
            where = path if offset is None else f"{path} at byte {offset}"  # (an image inside an archive)
            if key in first:
                raise UsageError(
                    f"two {split} images of {source['source']} have the same key {key} (their paths without the "
                    f"extension, dots made _): {first[key]} and {where}: rename one"
                )
            first[key] = where
    listed = [classes, {split: [sample[:3] for sample in items] for split, items in samples.items()}]
    manifest = {
        **source,
        "shard_size": args.shard_size,
        "resize": args.resize,
        "quality": args.quality if args.resize else None,
        **{split: len(samples[split]) for split in samples},
        "images": hashlib.sha256(json.dumps(listed).encode()).hexdigest(),  # each image's key, extension and label
    }
    if any(folder.is_dir() for split in samples for folder in (out / split).glob("*")):
        raise UsageError(f"{out} holds class folders: give the shards an OUT of their own")
    with contextlib.nullcontext() if locked else output_lock(out):  # (a second run at once would remove its work)
        if open_output(out, manifest, classes, samples, args.command):
            print(f"carrying on in {out}", flush=True)
        jobs = []
        for split, items in samples.items():
            for number in range((len(items) + args.shard_size - 1) // args.shard_size):
                shard = out / split / f"{split}-{number:06d}.tar"
                if not done(shard):
                    jobs.append((shard, items[number * args.shard_size : (number + 1) * args.shard_size]))
        for count, ((shard, part), warnings) in enumerate(zip(jobs, written(jobs, args)), start=1):
            for warning in warnings:
                print(f"warning: {shard.name}: {warning}", file=sys.stderr, flush=True)
            print(
                f"{shard.parent.name}/{shard.name}: {len(part)} images ({count} of {len(jobs)} shards to write)",
                flush=True,
            )
        print(
            f"wrote {out}: {len(classes)} classes, "
            + " and ".join(f"{len(items):,} {split}" for split, items in samples.items())
            + f" images in shards of {args.shard_size}",
            flush=True,
        )
        mark_finished(out)  # (last)


def written(jobs, args):
    """What write_shard returns for each (shard, samples) of `jobs`, in their order: written here with --workers 1,
    else by a pool of processes (stopped at once on an error, Ctrl-C or SIGTERM; a rerun carries on)."""
    workers = min(args.workers or len(os.sched_getaffinity(0)), len(jobs))
    if workers <= 1:
        yield from (write_shard(shard, part, args.resize, args.quality) for shard, part in jobs)
        return
    pool = worker_pool(workers)
    try:
        yield from pool.map(write_shard, *zip(*jobs), [args.resize] * len(jobs), [args.quality] * len(jobs))
    except BaseException:
        stop_workers(pool)
        raise
    finally:
        pool.shutdown(cancel_futures=True)


def parse_args(argv=None):
    parser = Parser(
        description=__doc__ and __doc__.split("\n\n")[0],
        epilog=__doc__ and __doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", metavar="SRC", help="an image folder (train/, val/) or a folder with train.csv, val.csv")
    parser.add_argument("out", metavar="OUT", help="where classes.txt, train/ and val/ are written")
    parser.add_argument(
        "--shard-size",
        type=whole(1),
        default=2500,
        metavar="N",
        help="images per shard (%(default)s: about 280 MB of ImageNet's originals)",
    )
    parser.add_argument("--resize", type=whole(1), metavar="N", help="shorter side at most N px, as RGB JPEG")
    parser.add_argument(
        "--quality", type=whole(1, 100), default=90, metavar="1-100", help="JPEG quality with --resize (%(default)s)"
    )
    parser.add_argument("--workers", type=whole(1), metavar="N", help="processes (default: all usable cores)")
    args = parser.parse_args(argv)
    args.command = command_line(__file__, sys.argv[1:] if argv is None else argv)
    return args


def main(argv=None):
    args = parse_args(argv)
    before = stop_on_signals()
    try:
        make_shards(args)
        return 0
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    except (KeyboardInterrupt, Stopped) as stopped:
        print("stopped: run the same command again to carry on", file=sys.stderr, flush=True)
        return 130 if isinstance(stopped, KeyboardInterrupt) else 143
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


if __name__ == "__main__":
    console_never_fails()  # (`| head`, a full device: ends nothing)
    sys.exit(main())

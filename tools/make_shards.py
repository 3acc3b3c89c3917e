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
sample's key, extension, label, byte offset and size, in numpy's .npz format), which the scripts read instead of the shards to list the
samples, and a loader worker reads each image at its offset. The same images in shards and in the folder they came
from give bitwise the same run.

Stopped (Ctrl-C, a kill, a crash)? Run the same command again: it carries on. A shard is written to a temporary
file, fsynced and renamed into place, then its index; a shard counts as done once its index matches it, and a
finished shard is never rewritten.
"""
import argparse
import io
import json
import signal
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.datasets import scan_split_files, split_files  # noqa: E402
from common.errors import UsageError  # noqa: E402
from common.folder_index import scan_image_folder  # noqa: E402
from common.run_dir import atomic_write  # noqa: E402
from common.shards import CLASSES, index_tar, read_index, shard_stamp, write_index  # noqa: E402
from prepare_imagenet import Parser, resize_jpeg, whole  # noqa: E402

MANIFEST = "shards.json"  # how OUT was written: a rerun with other options is refused


class Stopped(Exception):
    """SIGTERM."""


def sample_key(path, split_root):
    """The webdataset key of the image at `path`: its path under `split_root` (else its name) without the
    extension, dots made "_" (a key ends at the first dot of a member's base name)."""
    path = Path(path)
    try:
        relative = path.relative_to(split_root)
    except ValueError:
        relative = Path(path.name)
    stem = relative.name.rsplit(".", 1)[0] if "." in relative.name else relative.name
    return "/".join([*relative.parent.parts, stem.replace(".", "_")]), path.suffix[1:].lower() or "jpg"


def members(path, label, split_root, resize, quality):
    """The tar members of one sample: (name, bytes) of its image and of its label; whether --resize decoded it."""
    key, extension = sample_key(path, split_root)
    data, decoded = Path(path).read_bytes(), True
    if resize:
        try:
            data, extension = resize_jpeg(data, resize, quality), "jpg"
        except (OSError, SyntaxError, ValueError):
            decoded = False  # copied unchanged: the training loader names it as unreadable
    return [(f"{key}.{extension}", data), (f"{key}.cls", str(label).encode())], decoded


def write_shard(shard, samples, split_root, args):
    """Write `shard` (atomically) from [(path, label)], then its index; the names --resize could not decode."""
    undecodable = []

    def write(file):
        with tarfile.open(fileobj=file, mode="w", format=tarfile.GNU_FORMAT) as tar:
            for path, label in samples:
                entries, decoded = members(path, label, split_root, args.resize, args.quality)
                if not decoded:
                    undecodable.append(str(path))
                for name, data in entries:
                    info = tarfile.TarInfo(name)
                    info.size, info.mode = len(data), 0o644  # mtime 0, no owner: the same shard from the same images
                    tar.addfile(info, io.BytesIO(data))
    atomic_write(shard, write)
    write_index(shard, index_tar(shard)[0], shard_stamp(shard))
    return undecodable


def done(shard):
    """Whether `shard` and its index were written completely and still match."""
    try:
        read_index(shard)
        return True
    except (UsageError, FileNotFoundError):
        return False


def open_output(out, manifest):
    """OUT, created, with its manifest and class list; UsageError if an earlier run wrote it with other options."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / MANIFEST
    if path.exists():
        earlier = json.loads(path.read_text())
        if earlier != manifest:
            changed = [f"{name} {earlier.get(name)} -> {manifest[name]}" for name in manifest
                       if earlier.get(name) != manifest[name]]
            raise UsageError(f"{out} holds shards written with other options ({', '.join(changed)}): give another "
                             "OUT, or rerun the command that wrote them")
        return True
    atomic_write(path, lambda file: file.write(json.dumps(manifest, indent=1).encode()))
    return False


def make_shards(args):
    src, out = Path(args.src), Path(args.out)
    if not src.is_dir():
        raise UsageError(f"SRC {src} is not a folder")
    classes, train, val = scan_split_files(src) if split_files(src) else scan_image_folder(src)
    manifest = {"source": str(src.resolve()), "shard_size": args.shard_size, "resize": args.resize,
                "quality": args.quality if args.resize else None, "train": len(train), "val": len(val)}
    if open_output(out, manifest):
        print(f"carrying on in {out}", flush=True)
    atomic_write(out / CLASSES, lambda file: file.write("".join(f"{name}\n" for name in classes).encode()))
    for split, samples in (("train", train), ("val", val)):
        folder = out / split
        folder.mkdir(exist_ok=True)
        for stale in folder.glob(".*.tmp"):  # a killed run's unfinished shard
            stale.unlink()
        count = (len(samples) + args.shard_size - 1) // args.shard_size
        for number in range(count):
            shard = folder / f"{split}-{number:06d}.tar"
            if done(shard):
                continue
            part = [samples[i] for i in range(number * args.shard_size, min(len(samples), (number + 1) * args.shard_size))]
            for name in write_shard(shard, part, src / split, args):
                print(f"warning: cannot decode {name}: stored unchanged", file=sys.stderr, flush=True)
            print(f"{split}: {shard.name} ({number + 1} of {count}, {len(part)} images)", flush=True)
    print(f"wrote {out}: {len(classes)} classes, {len(train):,} train and {len(val):,} val images in shards of "
          f"{args.shard_size}", flush=True)


def parse_args(argv=None):
    parser = Parser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src", metavar="SRC", help="an image folder (train/, val/) or a folder with train.csv, val.csv")
    parser.add_argument("out", metavar="OUT", help="where classes.txt, train/ and val/ are written")
    parser.add_argument("--shard-size", type=whole(1), default=2500, metavar="N",
                        help="images per shard (%(default)s: about 280 MB of ImageNet's originals)")
    parser.add_argument("--resize", type=whole(1), metavar="N", help="shorter side at most N px, as RGB JPEG")
    parser.add_argument("--quality", type=whole(1, 100), default=90, metavar="1-100",
                        help="JPEG quality with --resize (%(default)s)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)

    def stop(signum, frame):
        raise Stopped()
    before = signal.signal(signal.SIGTERM, stop)
    try:
        make_shards(args)
        return 0
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    except (KeyboardInterrupt, Stopped) as stopped:
        print("stopped: run the same command again to carry on", file=sys.stderr, flush=True)
        return 130 if isinstance(stopped, KeyboardInterrupt) else 143
    finally:
        signal.signal(signal.SIGTERM, before)


if __name__ == "__main__":
    sys.exit(main())

"""Images in webdataset-format tar shards, read at their offsets: a map-style dataset with every guarantee a folder has.

Each shard has an index beside it (NAME.idx, written by tools/make_shards.py or at first use: each sample's key,
extension, label, offset and size), so the samplers index shards as they index a folder's files. The same images in
shards and in a folder train bitwise alike.

--data DIR: DIR/classes.txt (label k is line k), DIR/train/NAME.tar with NAME.idx, DIR/val/NAME.tar with NAME.idx.
"""

import contextlib
import hashlib
import os
import stat
import zipfile
from pathlib import Path

import numpy as np

from .errors import UsageError, say
from .folder_index import NameTable

INDEX_VERSION = 3  # 3: index_tar refuses what 1 (and 2, this one's draft) read wrong: others' shards read through again
MADE_HERE_VERSIONS = (1, INDEX_VERSION)  # the indexes of tools/make_shards.py's shards: 1 read them right
CLASSES = "classes.txt"
MANIFEST = "shards.json"  # how tools/make_shards.py wrote a folder of shards: a rerun with other options is refused
COLUMNS = {"labels": np.int32, "offsets": np.int64, "sizes": np.int64}
TAR_BLOCK = 512  # a tar member's header: the block before its data
OPEN_SHARDS = 128  # per process: 16 loader workers of 8 ranks hold 16,384 at most, under the usual limits
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff", "gif")
JSON_LABELS = ("cls", "label", "class", "class_index")  # the keys of a sample's .json that may hold its class index
COMPRESSED = (".tar.gz", ".tgz")  # shards that cannot be read at their offsets: refused, naming the fix
MAGIC = {b"\x1f\x8b": "gzip", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd"}  # (compressed; bzip2: below)
MAX_LABEL = 2**31 - 1  # (the index's int32 column)


def index_path(shard):
    return Path(shard).with_suffix(".idx")


def second_index_path(shard):
    """Where a shard's index goes beside it when another tool's NAME.idx is there (DALI's wds2idx writes one)."""
    return Path(shard).with_name(f"{Path(shard).name}.idx")


def shard_stamp(shard):
    """What an index records of its shard, to tell that it still describes it: size and modification time."""
    info = os.stat(shard)
    return np.array([info.st_size, info.st_mtime_ns], dtype=np.int64)


def columns(samples):
    """The index's arrays of [[key, extension, label, offset, size]]: names (KEY.EXTENSION, NUL-separated bytes),
    labels, offsets, sizes."""
    names = b"".join(os.fsencode(f"{key}.{extension}") + b"\0" for key, extension, *_ in samples)
    return {
        "names": np.frombuffer(names, dtype=np.uint8),
        **{
            name: np.array([sample[k] for sample in samples], dtype=dtype)
            for k, (name, dtype) in enumerate(COLUMNS.items(), start=2)
        },
    }


def write_index(shard, samples, stamp, path=None):
    """Write `shard`'s index (atomically) beside it, or at `path`: numpy's .npz of its columns, the version and the
    shard's stamp."""
    from .run_dir import atomic_write

    arrays = {"version": np.array(INDEX_VERSION), "shard": stamp, **columns(samples)}
    atomic_write(path or index_path(shard), lambda file: np.savez(file, **arrays))


def cached_index_path(shard, cache):
    """Where the output directory `cache` keeps the index of a shard in a folder it cannot write to."""
    import hashlib

    from .run_dir import SHARD_INDEXES

    digest = hashlib.sha1(os.fsencode(os.path.abspath(shard))).hexdigest()[:16]
    return Path(cache) / SHARD_INDEXES / f"{Path(shard).stem}-{digest}.idx"


def read_index(shard, path=None, versions=(INDEX_VERSION,)):
    """The columns of `shard`'s index (columns()), beside it or at `path`; UsageError naming what is wrong with it
    (missing, unreadable, of another of `versions`, or no longer matching its shard)."""
    path = path or index_path(shard)
    try:
        with np.load(path, allow_pickle=False) as index:
            arrays = {name: index[name] for name in index.files}
    except FileNotFoundError:
        raise UsageError(f"{shard} has no index ({path.name})") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:  # cut short, not ours
        raise UsageError(f"cannot read {path}: {error}") from None
    if arrays.get("version") not in versions or not {"shard", "names", *COLUMNS} <= arrays.keys():
        raise UsageError(f"{path} is no shard index of version {INDEX_VERSION}")
    if not np.array_equal(arrays["shard"], shard_stamp(shard)):
        raise UsageError(f"{path} no longer matches {Path(shard).name} (its size or modification time changed)")
    # Size and time alike, it may still be another shard's (two swapped: tar sizes round to 10 KiB, and shards written
    # in one clock tick share a time): its first and last samples must be the members the shard holds there.
    ends = {0, len(arrays["offsets"]) - 1} if len(arrays["offsets"]) else set()
    names = bytes(arrays["names"]).split(b"\0")
    try:
        with open(shard, "rb") as file:
            for k in sorted(ends):
                file.seek(int(arrays["offsets"][k]) - TAR_BLOCK)
                check_member(file.read(TAR_BLOCK), os.fsdecode(names[k]), int(arrays["sizes"][k]))
    except OSError as error:
        raise UsageError(f"{path} no longer matches {Path(shard).name} ({error})") from None
    return arrays


def check_member(header, name, size):
    """OSError unless the tar `header` (the 512 bytes before a member's data) is that of member `name` of `size` bytes.
    A name the header cannot hold as it is (not ASCII, or too long: a pax or GNU record holds it) is checked by the
    size alone. (Not tarfile.TarInfo.frombuf: this runs at every read, and that costs 14 times as much.)"""
    raw = header[0:100].split(b"\0", 1)[0]
    prefix = header[345:500].split(b"\0", 1)[0] if header[257:263] == b"ustar\0" else b""  # (POSIX ustar's field)
    found, expected = (prefix + b"/" + raw if prefix else raw), os.fsencode(name)
    field = header[124:136]
    try:  # octal text, or (GNU, for 8 GiB and more) a base-256 number
        stored = (
            int.from_bytes(field[1:], "big") if field[:1] == b"\x80" else int(field.split(b"\0")[0].strip() or b"0", 8)
        )
    except ValueError:
        stored = None
    verbatim = expected.isascii() and len(expected) <= 100  # (what every tar writer stores as it is)
    if stored != size or (verbatim and found != expected):
        raise OSError(
            f"the shard holds {os.fsdecode(found) or 'no member'!r} ({stored} bytes) where its index says "
            f"{name!r} ({size} bytes): the index is another shard's (a shard renamed or replaced after it "
            "was indexed?)"
        )


def shard_samples(shard, cache=None, versions=(INDEX_VERSION,)):
    """The columns of `shard`'s samples: its index, or, where none matches it, the shard read through (index_tar) and
    its index written beside it (atomically: two jobs that index it at once write the same), or, where its folder is
    read-only, in the output directory `cache` (when given and there)."""
    cached = cached_index_path(shard, cache) if cache is not None else None
    for path in (None, second_index_path(shard), *([cached] if cached else [])):
        try:
            return read_index(shard, path, versions)
        except UsageError:
            pass
    stamp, (samples, cut) = shard_stamp(shard), index_tar(shard)
    if cut is not None:
        lost = f"{cut} and what followed it are lost" if cut else "what followed them is lost"
        say(
            f"warning: {shard} is cut short (a crash while it was written?): its {len(samples)} samples before the "
            f"cut are read; {lost}"
        )
    if cut is not None:  # (no index: each job reads it through again, and says so)
        return columns(samples)
    try:  # (beside it as NAME.tar.idx where another tool's NAME.idx is: kept; where both are another's, elsewhere)
        beside = next((path for path in (index_path(shard), second_index_path(shard)) if not _foreign(path)), None)
        if beside is None:
            raise PermissionError  # (as a read-only folder)
        write_index(shard, samples, stamp, beside)
    except OSError:  # a read-only folder
        if cached and Path(cache).is_dir():
            try:
                cached.parent.mkdir(exist_ok=True)
                write_index(shard, samples, stamp, cached)
            except OSError:
                pass
    return columns(samples)


def _foreign(path):
    """Whether `path` holds something that is no index of ours, even one cut short (ours are zip files: npz)."""
    try:
        with open(path, "rb") as file:
            start = file.read(2)
    except FileNotFoundError:
        return False
    return start not in (b"", b"PK")


def has_shards(root):
    """Whether `root` holds shards: root/train/*.tar and no class folder beside them (an image folder with tars left
    in train/, by an interrupted extraction, stays an image folder)."""
    train = Path(root) / "train"
    try:
        entries = list(os.scandir(train))
    except OSError:
        return False
    return any(entry.name.endswith((".tar", *COMPRESSED)) for entry in entries) and not any(
        entry.is_dir() for entry in entries
    )


class ShardIndex:
    """The samples of a split's shards as a sequence of (SHARD:KEY, label), held compactly as numpy columns and a
    NameTable of KEY.EXTENSION. `location(i)` gives (shard path, offset, size, extension)."""

    def __init__(self, shards, indexes):
        self.shards = [str(shard) for shard in shards]
        self.shard_of = np.repeat(np.arange(len(indexes), dtype=np.int32), [len(index["labels"]) for index in indexes])
        for name in ("labels", "offsets", "sizes"):
            setattr(self, name, np.concatenate([index[name] for index in indexes]))
        self.names = NameTable(b"".join(index["names"].tobytes() for index in indexes))

    def __len__(self):
        return len(self.labels)

    def member(self, index):
        """KEY.EXTENSION of sample `index`."""
        return self.names[index]

    def name(self, index):
        """SHARD:KEY, as warnings and bad_images.txt name a sample."""
        return f"{self.shards[self.shard_of[index]]}:{split_member(self.member(index))[0]}"

    def __getitem__(self, index):
        return self.name(index), int(self.labels[index])

    def location(self, index):
        return (
            self.shards[self.shard_of[index]],
            int(self.offsets[index]),
            int(self.sizes[index]),
            split_member(self.member(index))[1],
        )


def read_classes(root):
    """The class names of root/classes.txt, or None where there is none."""
    path = Path(root) / CLASSES
    try:
        # (a folder's name as make_shards.py wrote it, its bytes that are not UTF-8 kept; a hand-made file's "\r\n" too)
        lines = path.read_bytes().decode("utf-8", "surrogateescape").split("\n")
        classes = [line.removesuffix("\r") for line in lines if line.removesuffix("\r")]
    except FileNotFoundError:
        return None
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror}") from None
    if not classes:
        raise UsageError(f"{path} lists no class")
    return classes


def split_index(root, split, cache=None, versions=(INDEX_VERSION,)):
    """The ShardIndex of root/split/*.tar (their indexes of `versions` trusted)."""
    shards = sorted((Path(root) / split).glob("*.tar"))
    compressed = sorted(  # (beside its .tar, as `gzip -k` leaves it: that one is read)
        path
        for suffix in COMPRESSED
        for path in (Path(root) / split).glob(f"*{suffix}")
        if not path.with_name(f"{path.name.removesuffix(suffix)}.tar").exists()
    )
    if compressed:
        raise UsageError(
            f"{compressed[0]} is compressed: shards are read at their samples' offsets, which a compressed tar has "
            "not; decompress them (gunzip, then name each NAME.tar)"
        )
    if not shards:
        raise UsageError(f"--data {root} has train/ shards but no {split}/*.tar: give both splits")
    try:
        special = next((shard for shard in shards if not stat.S_ISREG(os.stat(shard).st_mode)), None)
        if special is not None:  # (a FIFO: its reader would wait forever)
            raise UsageError(f"{special} is not a regular file: remove it from the shards")
        indexes = [shard_samples(shard, cache, versions) for shard in shards]
    except OSError as error:  # (a dangling link, no permission)
        raise UsageError(f"cannot read {error.filename}: {error.strerror}") from None
    check_no_copies(shards, indexes, root, split)
    index = ShardIndex(shards, indexes)
    if not len(index):
        raise UsageError(f"the {split} shards of --data {root} hold no sample")
    return index


def check_no_copies(shards, indexes, root, split):
    """One line where two shards hold the same samples, name, size and label alike, and the same first image: a shard
    copied under another name, whose images would be trained on, and validated, twice an epoch. (Shards whose keys
    merely repeat, a counter restarting in each, differ in their sizes, labels or bytes.)"""
    seen = {}  # names, sizes and labels -> the one shard of them, or {its first image's digest: shard}
    for shard, index in zip(shards, indexes):
        if len(index["labels"]):  # (empty shards: cut short, said so)
            columns = hashlib.sha256(b"".join(index[name].tobytes() for name in ("names", "sizes", "labels"))).digest()
            if columns not in seen:
                seen[columns] = (shard, index)  # (its first image read only if another shard has these columns)
                continue
            if isinstance(seen[columns], tuple):
                seen[columns] = {_first_image(*seen[columns]): seen[columns][0]}
            same = seen[columns].setdefault(_first_image(shard, index), shard)
            if same != shard:
                raise UsageError(
                    f"{same} and {shard} hold the same {len(index['labels'])} samples (names, sizes, labels and first "
                    f"image): a shard copied? Each image of --data {root}'s {split} shards may be in one shard only"
                )


def made_here(root):
    """Whether tools/make_shards.py (or prepare_imagenet.py --shards) wrote the shards at `root`: its manifest."""
    import json

    try:
        manifest = json.loads((Path(root) / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and {"source", "shard_size", "resize", "train", "val"} <= manifest.keys()


def _first_image(shard, index):
    with open(shard, "rb") as file:
        file.seek(int(index["offsets"][0]))
        return hashlib.sha256(file.read(int(index["sizes"][0]))).digest()


def scan_shards(root, cache=None):
    """(classes, train ShardIndex, val ShardIndex) of the shards under `root` (shard_samples; `cache`: the output
    directory). The class names are root/classes.txt's; without it, the labels' numbers."""
    classes = read_classes(root)
    versions = MADE_HERE_VERSIONS if made_here(root) else (INDEX_VERSION,)
    train, val = (split_index(root, split, cache, versions) for split in ("train", "val"))
    listed = f"{Path(root) / CLASSES} lists" if classes else f"with no {CLASSES}, the train labels make"
    unseen = np.setdiff1d(val.labels, train.labels) if classes is None else []
    if len(unseen):  # (as with CSV and Hugging Face integer labels: a class validation has and training never sees)
        raise UsageError(
            f"the val shards of --data {root} have labels {', '.join(map(str, unseen[:5]))} that its train shards "
            f"never have, and no {CLASSES} names the classes: every class must be trained on"
        )
    if classes is None:
        classes = [str(label) for label in range(int(train.labels.max()) + 1)]
    for index in (train, val):
        wrong = np.flatnonzero((index.labels < 0) | (index.labels >= len(classes)))
        if len(wrong):
            raise UsageError(
                f"{index.name(wrong[0])} has label {index.labels[wrong[0]]}, but {listed} {len(classes)} classes"
            )
    return classes, train, val


class ShardReader:
    """Reads samples' bytes at their offsets, each shard opened once per process (descriptors inherited through a
    fork are closed) and kept open, the OPEN_SHARDS most recently read at most."""

    def __init__(self):
        self.pid, self.files = None, {}

    def read(self, path, offset, size, member=None):
        """The `size` bytes at `offset` in shard `path`; with `member` (its KEY.EXTENSION), read with the tar header
        before them in the same read, which must name it (check_member)."""
        if self.pid != os.getpid():
            self.close()
            self.pid = os.getpid()
        fd = self.files.pop(path, None)
        if fd is None:
            if len(self.files) >= OPEN_SHARDS:
                os.close(self.files.pop(next(iter(self.files))))  # the least recently read
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self.files[path] = fd  # (last: the most recently read)
        header = TAR_BLOCK if member is not None else 0
        data = os.pread(fd, size + header, offset - header)
        if len(data) < size + header:
            raise OSError(f"the shard ends {size + header - len(data)} bytes before this sample does (cut short)")
        if member is not None:
            check_member(data[:header], member, size)
        return data[header:]

    def close(self):
        for fd in self.files.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.files = {}

    def __getstate__(self):  # (a dataset pickled for spawned loader workers takes no descriptor along)
        return {"pid": None, "files": {}}


def split_member(name):
    """(key, extension) of a tar member's name, as webdataset splits it: the key ends at the first dot of the base
    name (`dir/n0144_10026.jpg` -> `dir/n0144_10026`, `jpg`; `a/b.seg.png` -> `a/b`, `seg.png`)."""
    folder, _, base = name.rpartition("/")
    stem, _, extension = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), extension


def index_tar(shard):
    """([[key, extension, label, offset, size]], cut) of the samples of a webdataset tar `shard`, in its order: each
    key's image member and its label (KEY.cls, else KEY.json's: label_of_json). A shard cut short gives the samples
    before the cut, and in `cut` the key of the sample it cut, or "" (None: a whole shard). UsageError for a sample
    without a label, a label that is no class index, or one without an image."""
    import tarfile

    samples, labels, json_labels, cut, size, names = {}, {}, {}, None, os.stat(shard).st_size, set()
    last_seen = None
    with open(shard, "rb") as file:
        start = file.read(10)
    bzip2 = start[:3] == b"BZh" and start[3:4].isdigit() and start[4:10] == b"1AY&SY"  # (not a name "BZh...")
    kind = "bzip2" if bzip2 else next((kind for magic, kind in MAGIC.items() if start.startswith(magic)), None)
    if kind:  # (read as a tar: cut short at 0 samples)
        raise UsageError(f"{shard} holds {kind} data: shards are read uncompressed at their offsets; decompress it")
    try:
        with tarfile.open(shard, "r:") as tar:
            for member in tar:
                key, extension = split_member(member.name)
                last_seen = key
                if member.offset_data + member.size > size:
                    cut = key
                    break
                linked = member.issym() or member.islnk()  # (`tar cf` of a folder of links, of deduplicated files)
                if linked and (extension.lower() in IMAGE_EXTENSIONS or extension in ("cls", "json")):
                    raise UsageError(  # (not read at an offset of its own: its sample was lost, silently)
                        f"{shard}: {member.name} is a link: write the shard with the files themselves (tar -h "
                        "--hard-dereference)"
                    )
                if not member.isfile():
                    continue
                if (key, extension) in names:  # (the index keeps one sample per key)
                    raise UsageError(
                        f"{shard} holds {member.name} twice: each member's name must be unique in its shard (a writer "
                        "naming members by their file's base name?)"
                    )
                names.add((key, extension))
                if extension.lower() in IMAGE_EXTENSIONS and key in samples:  # (a photo and its mask: which?)
                    raise UsageError(
                        f"{shard}:{key} holds two images ({samples[key][1]}, {extension}): keep one image a sample "
                        "(name the other KEY.mask.png, say: not an image extension)"
                    )
                if extension.lower() in IMAGE_EXTENSIONS:
                    samples[key] = [key, extension, None, member.offset_data, member.size]
                elif extension == "cls":
                    text = tar.extractfile(member).read().decode("utf-8", "replace").strip()
                    if not (text.isascii() and text.isdigit() and int(text) <= MAX_LABEL):
                        raise UsageError(f"{shard}:{key}.cls holds {text[:20]!r}: expected a class index")
                    labels[key] = int(text)
                elif extension == "json" and key not in labels:
                    json_labels[key] = label_of_json(tar.extractfile(member).read())
            end = tar.offset  # where the end-of-archive blocks begin
    except (tarfile.ReadError, EOFError):
        cut, end = "", None
    if cut is None and (end is None or not _ends_an_archive(shard, end, size)):
        cut = ""
    last = next(reversed(samples), None)  # its label past the cut? (a .cls, where the shard has them: named as cut)
    if (
        cut is not None
        and last is not None
        and (last not in labels if labels else json_labels.get(last) is None)
        and (last == last_seen or labels.get(last, json_labels.get(last)) is None)  # (or whole, of the other kind)
    ):
        cut = samples.popitem()[0]
    for key in (*labels, *(key for key, label in json_labels.items() if label is not None)) if cut is None else ():
        if key not in samples:  # (a cut shard's: its image may lie past the cut, its members not together)
            members = ", ".join(sorted(f"{key}.{extension}" for other, extension in names if other == key))
            raise UsageError(  # (its sample was left out, silently: KEY.jpe, KEY.pnm, KEY.input.jpg)
                f"{shard}:{key} has a label but no image ({members}): an image is KEY.EXT, EXT one of "
                f"{', '.join(IMAGE_EXTENSIONS)}"
            )
    for key, sample in samples.items():
        label = labels.get(key, json_labels.get(key))
        if label is None:
            raise UsageError(
                f"{shard}:{key} has no label (no {key}.cls, no class index in a {key}.json): every sample needs one"
            )
        sample[2] = label
    return list(samples.values()), cut


def label_of_json(data):
    """The class index in a sample's .json ({"label": 3}, {"cls": 3}, ...), or None."""
    import json

    try:
        meta = json.loads(data)
    except ValueError:
        return None
    found = [  # the first of them that holds an integer ({"class": "tench", "class_index": 0})
        meta[name]
        for name in JSON_LABELS
        if isinstance(meta, dict) and type(meta.get(name)) is int and -MAX_LABEL <= meta[name] <= MAX_LABEL
    ]
    return found[0] if found else None


def _ends_an_archive(shard, end, size):
    """Whether `shard` holds the two zero blocks that end a tar at `end` (a crash leaves a shard without them)."""
    if size < end + 1024:
        return False
    with open(shard, "rb") as file:
        file.seek(end)
        return file.read(1024) == bytes(1024)

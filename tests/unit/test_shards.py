"""common/shards.py and datasets.ShardedImages: shards written by tools/make_shards.py list the folder's samples in its
order, read back bitwise the images a folder gives; indexes that do not fit their shard, samples without a label and
shards cut short are named in one line."""

import io
import os
import re
import shutil
import socket
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from common.datasets import ImageFiles, ShardedImages, build_datasets
from common.errors import UnreadableFile, UsageError
from common.folder_index import scan_image_folder
from common.shards import (
    INDEX_VERSION,
    ShardReader,
    index_path,
    index_tar,
    read_classes,
    read_index,
    scan_shards,
    shard_stamp,
    split_member,
    write_index,
)
from conftest import parse
from harness.processes import REPO, within

sys.path.insert(0, str(REPO / "tools"))
import make_shards


@pytest.fixture(scope="module")
def shards(tiny_data, tmp_path_factory):
    """tiny_data (24 train, 12 val images) in shards of 5 images."""
    out = tmp_path_factory.mktemp("shards")
    assert make_shards.main([str(tiny_data), str(out), "--shard-size", "5", "--workers", "1"]) == 0
    return out


def test_keys_end_at_the_first_dot_of_the_base_name_as_webdataset_splits_them():
    assert split_member("circle/00001.jpg") == ("circle/00001", "jpg")
    assert split_member("a.b/c.seg.png") == ("a.b/c", "seg.png")
    assert split_member("plain.cls") == ("plain", "cls")


def test_shards_list_the_folder_s_samples_in_its_order_and_read_back_the_same_images(tiny_data, shards):
    classes, train, val = scan_shards(shards)
    folder = scan_image_folder(tiny_data)
    assert classes == folder.classes
    assert [path.name for path in sorted((shards / "train").glob("*.tar"))] == [f"train-{n:06d}.tar" for n in range(5)]
    for split, sharded, files in (("train", train, folder.train), ("val", val, folder.val)):
        assert len(sharded) == len(files)
        assert [sharded.name(i).split(":", 1)[1] for i in range(len(files))] == [
            str(Path(files[i][0]).relative_to(tiny_data / split).with_suffix("")) for i in range(len(files))
        ]
        from_shards, from_files = ShardedImages(sharded), ImageFiles(files)
        for i in range(len(files)):
            (image, label), (expected, expected_label) = from_shards[i], from_files[i]
            assert label == expected_label and torch.equal(image, expected), (split, i)


def test_the_scripts_read_a_folder_of_shards_as_shards(shards, no_platform_env):
    classes, train_set, val_set = build_datasets(parse("--data", shards))
    assert isinstance(train_set, ShardedImages) and (len(train_set), len(val_set)) == (24, 12)
    assert classes == ["circle", "ring", "square"]


def test_a_shard_copied_under_another_name_is_refused_in_one_line_naming_both(shards, tmp_path):
    """val-000001.tar copied as val-000009.tar was read twice: validation counted its images twice. Shards whose keys
    restart in each (a writer's counter) are no copies: their sizes differ."""
    copy = tmp_path / "copied"
    shutil.copytree(shards, copy)
    shutil.copy(copy / "val" / "val-000001.tar", copy / "val" / "val-000009.tar")
    with pytest.raises(
        UsageError,
        match=rf"^{copy}/val/val-000001\.tar and {copy}/val/val-000009\.tar hold the same 5 samples \(names, "
        rf"sizes, labels and first image\): a shard copied\? Each image of --data {copy}'s val shards may be in one "
        r"shard only$",
    ):
        build_datasets(parse("--data", copy))
    counters = tmp_path / "counters"
    for split in ("train", "val"):
        (counters / split).mkdir(parents=True)
        for n in range(2):
            samples = [
                (f"{k:06d}.{extension}", data)
                for k in range(2)
                for extension, data in (("jpg", b"x" * (n + k + 1)), ("cls", str(k).encode()))
            ]
            webdataset_tar(counters / split / f"{split}-{n:06d}.tar", samples)
    assert [len(index) for index in scan_shards(counters)[1:]] == [4, 4]
    for n, (first, label) in enumerate(((b"x", b"0"), (b"x", b"1"), (b"y", b"0"))):  # as many bytes: PPM, BMP, CIFAR
        webdataset_tar(counters / "val" / f"val-{n:06d}.tar", [("000000.ppm", first), ("000000.cls", label)])
    assert len(scan_shards(counters)[2]) == 3  # (another label, or other bytes: no copy; was refused)
    for n, members in enumerate((("jpg", "cls"), ("cls", "jpg"))):  # a copy whose members are in another order
        data = {"jpg": b"x" * 600, "cls": b"0"}
        webdataset_tar(counters / "val" / f"val-{n:06d}.tar", [(f"000000.{ext}", data[ext]) for ext in members])
    (counters / "val" / "val-000002.tar").unlink()
    with pytest.raises(UsageError, match="a shard copied"):  # (was: its first image read at the other's offset)
        scan_shards(counters)


def test_a_file_it_cannot_read_is_stored_empty_and_named_and_odd_class_names_keep_their_bytes(
    tiny_data, tmp_path, capsys
):
    """A broken link in SRC: stored empty with a warning, so that training skips and names it as on the folder (was a
    traceback, and OUT left holding a manifest that refused the rerun). A class folder whose name is not UTF-8: the
    folder's class name (was a traceback); one with a line break, which classes.txt cannot list: one line."""
    src = tmp_path / "src"
    shutil.copytree(tiny_data, src)
    (src / "train" / "ring" / "zz-gone.jpg").symlink_to(tmp_path / "nonexistent")
    for split in ("train", "val"):
        os.rename(src / split / "square", os.fsencode(src / split) + b"/squ\xe4re")
    assert make_shards.main([str(src), str(tmp_path / "out"), "--workers", "1"]) == 0
    assert "cannot read " + str(
        src / "train" / "ring" / "zz-gone.jpg"
    ) + " (No such file or directory): stored empty" in (capsys.readouterr().err)
    classes, train, _ = scan_shards(tmp_path / "out")
    assert classes == scan_image_folder(src).classes and classes[2] == os.fsdecode(b"squ\xe4re")
    listed = (tmp_path / "out" / "classes.txt").read_bytes()
    (tmp_path / "out" / "classes.txt").write_bytes(listed.replace(b"\n", b"\r\n"))  # (written by hand elsewhere)
    assert read_classes(tmp_path / "out") == classes
    gone = next(index for index in range(len(train)) if train.name(index).endswith(":ring/zz-gone"))
    with pytest.raises(UnreadableFile, match="^cannot identify image file"):  # (was torch.frombuffer's complaint)
        ShardedImages(train)[gone]
    # A FIFO named like an image: stored empty, as a broken link (was: make_shards.py waited for a writer forever)
    os.mkfifo(src / "train" / "ring" / "zz-fifo.jpg")
    with within(30):
        assert make_shards.main([str(src), str(tmp_path / "out2"), "--workers", "1"]) == 0
    assert (
        f"cannot read {src / 'train' / 'ring' / 'zz-fifo.jpg'} (not a regular file (a FIFO or a device)): stored "
        in (capsys.readouterr().err)
    )
    os.mkfifo(tmp_path / "out2" / "train" / "train-000009.tar")  # (among shards: the scan waited forever)
    with within(30), pytest.raises(UsageError, match=r"train-000009.tar is not a regular file: remove it from the"):
        scan_shards(tmp_path / "out2")
    # A file that may read on a rerun (a socket here: ENXIO; a disk's or a mount's failure): one line, stopped.
    listening = socket.socket(socket.AF_UNIX)
    listening.bind(str(src / "val" / "ring" / "zz-socket.jpg"))
    try:
        with pytest.raises(UsageError, match=r"zz-socket.jpg \(No such device or address\): run the same command"):
            make_shards.make_shards(make_shards.parse_args([str(src), str(tmp_path / "out3"), "--workers", "1"]))
    finally:
        listening.close()
        (src / "val" / "ring" / "zz-socket.jpg").unlink()
    for split in ("train", "val"):
        os.rename(os.fsencode(src / split) + b"/squ\xe4re", src / split / "new\nline")
    with pytest.raises(UsageError, match=r"class new\\nline has a line break in its name: rename it$"):
        make_shards.make_shards(make_shards.parse_args([str(src), str(tmp_path / "out2")]))


def test_a_shard_the_disk_cannot_hold_is_one_line_and_the_same_command_carries_on(tiny_data, tmp_path, capsys):
    """A full disk while a shard is written (here a file-size limit: EFBIG, a real failed write): one line, exit code
    1 as for the training scripts' full disk, no temporary left (was: a traceback)."""
    import resource

    out, before = tmp_path / "out", resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, before[1]))  # the manifest and classes.txt fit, a shard does not
    try:
        code = make_shards.main([str(tiny_data), str(out), "--shard-size", "5", "--workers", "1"])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, before)
    assert code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: cannot write {out / 'train' / 'train-000000.tar'} (File too large): make room, then run the same "
        "command again (it carries on)"
    ]
    assert not any((out / "train").iterdir())
    assert make_shards.main([str(tiny_data), str(out), "--shard-size", "5", "--workers", "1"]) == 0
    assert [len(index) for index in scan_shards(out)[1:]] == [24, 12]


def test_resize_gives_a_16_bit_image_as_training_decodes_it(tmp_path):
    """make_shards.py and prepare_imagenet.py --resize: a 16-bit PNG's high byte, as load_image decodes the original
    (was clipped to white by PIL's convert("RGB"): every pixel 255)."""
    from PIL import Image

    from common.datasets import decode_bytes, load_image
    from shared import resize_jpeg

    Image.fromarray((np.arange(48 * 64).reshape(48, 64) * 21).astype(np.uint16)).save(tmp_path / "grey16.png")
    resized = decode_bytes(resize_jpeg((tmp_path / "grey16.png").read_bytes(), 64), "jpg")
    assert (resized.int() - load_image(str(tmp_path / "grey16.png")).int()).abs().float().mean() < 2  # (JPEG's loss)


def test_a_reader_names_a_sample_its_shard_cuts_short(shards, tmp_path):
    _, train, _ = scan_shards(shards)
    cut = tmp_path / "cut.tar"
    data = Path(train.shards[0]).read_bytes()
    cut.write_bytes(data[: train.offsets[2] + 10])  # a crash in the middle of sample 2
    with pytest.raises(OSError, match="cut short"):
        ShardReader().read(str(cut), int(train.offsets[2]), int(train.sizes[2]))


def test_an_index_that_no_longer_matches_its_shard_is_refused_in_one_line(shards, tmp_path):
    shard = tmp_path / "train-000000.tar"
    shard.write_bytes((shards / "train" / "train-000000.tar").read_bytes())
    index_path(shard).write_bytes(index_path(shards / "train" / "train-000000.tar").read_bytes())
    with pytest.raises(UsageError, match=r"train-000000\.idx no longer matches train-000000\.tar"):
        read_index(shard)
    index_path(shard).unlink()
    with pytest.raises(UsageError, match=r"train-000000\.tar has no index \(train-000000\.idx\)"):
        read_index(shard)


def webdataset_tar(path, samples):
    """A tar as the webdataset library writes one: KEY.EXT members, (name, bytes) in order."""
    with tarfile.open(path, "w") as tar:
        for name, data in samples:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_a_tar_is_indexed_by_key_with_each_image_s_offset_and_its_label(tmp_path):
    shard = tmp_path / "s.tar"
    webdataset_tar(
        shard, [("x/a.jpg", b"AAAA"), ("x/a.cls", b"2"), ("b.png", b"BB"), ("b.cls", b" 0\n"), ("b.json", b"{}")]
    )
    index, cut = index_tar(shard)
    assert cut is None
    assert [(key, extension, label, size) for key, extension, label, _, size in index] == [
        ("x/a", "jpg", 2, 4),
        ("b", "png", 0, 2),
    ]
    raw = shard.read_bytes()
    assert [raw[offset : offset + size] for *_, offset, size in index] == [b"AAAA", b"BB"]


def test_a_sample_without_a_label_is_refused_naming_it_and_a_json_label_counts(tmp_path):
    shard = tmp_path / "s.tar"
    webdataset_tar(
        shard,
        [
            ("a.jpg", b"A"),
            ("a.cls", b"1"),
            ("j.png", b"J"),
            ("j.json", b'{"label": 2, "w": 5}'),
            ("nolabel.jpg", b"B"),
            ("nolabel.json", b'{"caption": "a dog"}'),
        ],
    )
    with pytest.raises(
        UsageError,
        match=rf"{shard}:nolabel has no label \(no nolabel\.cls, no class index in a "
        r"nolabel\.json\)",
    ):
        index_tar(shard)
    webdataset_tar(shard, [("a.jpg", b"A"), ("a.cls", b"1"), ("j.png", b"J"), ("j.json", b'{"label": 2, "w": 5}')])
    assert [(key, label) for key, _, label, *_ in index_tar(shard)[0]] == [("a", 1), ("j", 2)]


def test_a_sample_that_cannot_be_decoded_is_an_unreadable_file_named_shard_key(shards, tmp_path):
    shard = tmp_path / "train-000000.tar"
    webdataset_tar(shard, [("broken.jpg", b"not a jpeg"), ("broken.cls", b"0")])
    write_index(shard, index_tar(shard)[0], shard_stamp(shard))
    from common.shards import ShardIndex

    dataset = ShardedImages(ShardIndex([shard], [read_index(shard)]))
    with pytest.raises(UnreadableFile):
        dataset[0]
    assert dataset.name(0) == f"{shard}:broken"


def test_shards_written_elsewhere_are_indexed_once_beside_them_and_a_stale_index_is_rebuilt(tmp_path, capsys):
    root = tmp_path / "foreign"
    for split, count in (("train", 3), ("val", 2)):
        (root / split).mkdir(parents=True)
        webdataset_tar(
            root / split / f"{split}-0.tar",
            [
                item
                for n in range(count)
                for item in ((f"s{n}.jpg", b"x" * (n + 1)), (f"s{n}.cls", str(n % 2).encode()))
            ],
        )
    classes, train, val = scan_shards(root)  # no classes.txt: the labels' numbers
    assert classes == ["0", "1"] and (len(train), len(val)) == (3, 2)
    index = root / "train" / "train-0.idx"
    assert index.exists() and list(read_index(root / "train" / "train-0.tar")["sizes"]) == [1, 2, 3]
    written = index.stat().st_mtime_ns
    scan_shards(root)
    assert index.stat().st_mtime_ns == written  # read, not rebuilt
    webdataset_tar(  # the shard changed
        root / "train" / "train-0.tar", [("t.png", b"yy"), ("t.cls", b"1"), ("u.png", b"u"), ("u.cls", b"0")]
    )
    _, train, _ = scan_shards(root)
    assert len(train) == 2 and train.name(0).endswith("train-0.tar:t") and capsys.readouterr().out == ""


def test_a_label_without_an_image_is_refused_naming_the_sample_s_members_and_one_cut_off_is_not(tmp_path):
    """A sample whose image has an extension not read as one (KEY.pnm, KEY.input.jpg) was left out, silently: 3 of
    8 validation images once."""
    shard = tmp_path / "s.tar"
    for member in ("b.pnm", "b.input.jpg"):
        webdataset_tar(shard, [("a.jpg", b"A"), ("a.cls", b"1"), (member, b"P"), ("b.json", b'{"label": 0}')])
        with pytest.raises(
            UsageError,
            match=rf"^{shard}:b has a label but no image \({re.escape(', '.join(sorted(['b.json', member])))}\): an "
            r"image is KEY\.EXT, EXT one of jpg, jpeg, png,",
        ):
            index_tar(shard)
    webdataset_tar(shard, [("a.jpg", b"A"), ("a.cls", b"1"), ("__meta__.json", b'{"source": "x"}')])  # (no label)
    assert [sample[0] for sample in index_tar(shard)[0]] == ["a"]
    # Cut short: a label whose image lies past the cut is no fault, its members together or not (a shard of .cls
    # labels first, as `tar cf` of a folder writes); nor is a sample cut after a whole one of the other label kind.
    for members, cut_in, read in [
        ([("k0.cls", b"0"), ("k0.jpg", b"z" * 3000), ("k1.cls", b"0"), ("k1.jpg", b"z" * 3000)], 1, ["k0"]),
        ([(f"k{n}.cls", b"0") for n in range(3)] + [(f"k{n}.jpg", b"z" * 3000) for n in range(3)], 1, ["k0"]),
        (
            [("k0.png", b"z" * 3000), ("k0.cls", b"1"), ("k1.png", b"z" * 3000), ("k1.json", b'{"label": 1}')]
            + [("k2.cls", b"0"), ("k2.png", b"z" * 3000)],
            2,
            ["k0", "k1"],
        ),
    ]:
        webdataset_tar(shard, members)
        whole = shard.read_bytes()
        shard.write_bytes(whole[: index_tar(shard)[0][cut_in][3] + 100])  # in that sample's image
        samples, cut = index_tar(shard)
        assert [sample[0] for sample in samples] == read and cut == f"k{cut_in}", members
    webdataset_tar(shard, [("k0.jpg", b"z" * 3000), ("k1.jpg", b"z" * 3000), ("k0.cls", b"0"), ("k1.cls", b"1")])
    with tarfile.open(shard) as tar:  # (`tar cf s.tar *.jpg *.cls`, cut in k1.cls's header: was "k1 has no label")
        shard.write_bytes(shard.read_bytes()[: tar.getmember("k1.cls").offset + 100])
    samples, cut = index_tar(shard)
    assert [sample[0] for sample in samples] == ["k0"] and cut == "k1"


def test_a_shard_cut_short_gives_its_samples_before_the_cut_and_names_the_one_it_cut(tmp_path, capsys):
    shard = tmp_path / "s.tar"
    webdataset_tar(shard, [item for n in range(3) for item in ((f"k{n}.jpg", b"z" * 3000), (f"k{n}.cls", b"0"))])
    raw = shard.read_bytes()
    whole, _ = index_tar(shard)
    shard.write_bytes(raw[: whole[2][3] + 100])  # in the middle of k2's image
    samples, cut = index_tar(shard)
    assert [sample[0] for sample in samples] == ["k0", "k1"] and cut == "k2"
    from common.shards import shard_samples

    assert shard_samples(shard)["names"].tobytes() == b"k0.jpg\0k1.jpg\0"
    assert capsys.readouterr().out.strip() == (
        f"warning: {shard} is cut short (a crash while it was written?): its 2 "
        "samples before the cut are read; k2 and what followed it are lost"
    )
    for cut_at, samples_left in (
        (whole[2][3] - 512, 2),
        (whole[2][3] - 300, 2),
        (whole[2][3] + 3072, 2),
        (200, 0),
        (0, 0),
    ):
        shard.write_bytes(raw[:cut_at])  # at a member's boundary, in a header, between an image and its label, ...
        samples, cut = index_tar(shard)
        assert len(samples) == samples_left and cut is not None, cut_at
    shard.write_bytes(raw[: whole[2][3] + 3072 + 1024])  # every member whole, the end-of-archive blocks lost
    assert index_tar(shard)[1] == ""


def test_a_folder_with_tars_beside_its_class_folders_stays_an_image_folder(tiny_data, tmp_path):
    from common.shards import has_shards

    folder = shutil.copytree(tiny_data, tmp_path / "data")
    (folder / "train" / "ILSVRC2012_img_train.tar").write_bytes(b"left by an interrupted extraction")
    assert not has_shards(folder)


def test_an_index_cut_short_or_of_another_kind_is_built_again(shards, tmp_path):
    copy = shutil.copytree(shards, tmp_path / "copy")
    index = copy / "train" / "train-000000.idx"
    for content in (index.read_bytes()[:100], b"PK\x03\x04 not a zip", b""):
        index.write_bytes(content)
        _, train, _ = scan_shards(copy)
        assert len(train) == 24 and read_index(copy / "train" / "train-000000.tar")


def test_a_reader_keeps_the_most_recently_read_shards_open_and_no_more(shards, monkeypatch):
    import os

    import common.shards

    _, train, _ = scan_shards(shards)
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *args: opened.append(path) or real_open(path, *args))
    monkeypatch.setattr(common.shards, "OPEN_SHARDS", 2)
    reader = ShardReader()
    for index in [0, 1, 0, 1, 5, 0]:  # shards 0, 0, 0, 0, 1, 0 (5 images a shard)
        reader.read(*train.location(index)[:3])
    assert [Path(path).name for path in opened] == ["train-000000.tar", "train-000001.tar"]
    for index in [10, 15, 0]:  # shards 2 and 3 push 0 and 1 out: 0 is opened again
        reader.read(*train.location(index)[:3])
    assert [Path(path).name for path in opened[2:]] == ["train-000002.tar", "train-000003.tar", "train-000000.tar"]
    assert len(reader.files) == 2
    reader.close()


def immutable(folder, on):
    """Make `folder` immutable (or not again), as chattr +i does (the tests may run as root, whom permissions do not
    stop); False where the file system cannot."""
    import array
    import fcntl

    get_flags, set_flags, immutable_flag = (
        0x80086601,
        0x40086602,
        0x10,
    )  # FS_IOC_GETFLAGS, FS_IOC_SETFLAGS, FS_IMMUTABLE_FL
    fd = os.open(folder, os.O_RDONLY)
    try:
        flags = array.array("l", [0])
        fcntl.ioctl(fd, get_flags, flags, True)
        flags[0] = flags[0] | immutable_flag if on else flags[0] & ~immutable_flag
        fcntl.ioctl(fd, set_flags, flags, True)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_shards_in_a_folder_that_cannot_be_written_keep_their_index_in_the_output_directory(tmp_path):
    root = tmp_path / "read-only"
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
        webdataset_tar(root / split / f"{split}-0.tar", [("a.jpg", b"AA"), ("a.cls", b"1")])
    folders = [root / "train", root / "val"]
    if not all(immutable(folder, True) for folder in folders):
        pytest.skip("this file system cannot make a folder immutable (chattr +i)")
    try:
        output = tmp_path / "run"
        output.mkdir()
        _, train, _ = scan_shards(root, cache=output)
        cached = sorted((output / "shard-indexes").iterdir())
        assert len(train) == 1 and [path.name.split("-")[0] for path in cached] == ["train", "val"]
        assert not list(root.rglob("*.idx"))
        written = [path.stat().st_mtime_ns for path in cached]
        scan_shards(root, cache=output)  # read from the output directory, not indexed again
        assert [path.stat().st_mtime_ns for path in cached] == written
    finally:
        for folder in folders:
            immutable(folder, False)


def test_two_shards_that_swapped_places_are_indexed_again_not_read_with_each_other_s_index(tmp_path):
    """Tar sizes round to 10 KiB and shards written in one clock tick share a time, so two shards renamed into each
    other's place (or an index copied with cp -p onto another shard's) passed the (size, time) stamp, and their samples
    were read under the other's names and labels. The first and last samples' tar headers must name them: else the
    shard is indexed again, and a read whose header names another member fails as an unreadable sample."""
    root = tmp_path / "swapped"
    (root / "train").mkdir(parents=True)
    (root / "val").mkdir()
    shards = [root / "train" / f"train-{n}.tar" for n in range(2)]
    for n, shard in enumerate(shards):  # the same sizes, other keys, images and labels
        webdataset_tar(
            shard,
            [
                item
                for k in range(3)
                for item in ((f"shard{n}-{k}.png", bytes([n]) * (10 + k)), (f"shard{n}-{k}.cls", str(n).encode()))
            ],
        )
        os.utime(shard, ns=(1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
    webdataset_tar(root / "val" / "val-0.tar", [("v.png", b"v"), ("v.cls", b"0")])
    _, train, _ = scan_shards(root)
    assert [train[i] for i in range(6)] == [(f"{shards[n]}:shard{n}-{k}", n) for n in range(2) for k in range(3)]
    assert shards[0].stat().st_size == shards[1].stat().st_size
    moved = root / "train" / "t"
    shards[0].rename(moved)
    shards[1].rename(shards[0])
    moved.rename(shards[1])  # the .idx files stay: each now stands beside the other shard
    with pytest.raises(
        UsageError,
        match=r"train-0\.idx no longer matches train-0\.tar \(the shard holds "
        r"'shard1-0\.png' \(10 bytes\) where its index says 'shard0-0\.png'",
    ):
        read_index(shards[0])
    import numpy as np

    from common.shards import ShardIndex

    with np.load(index_path(shards[0])) as stale:  # the index as it is, past the check: each read checks too
        misread = ShardedImages(ShardIndex([shards[0]], [{name: stale[name] for name in stale.files}]))
    with pytest.raises(
        UnreadableFile, match=r"holds 'shard1-1\.png' \(11 bytes\) where its index says 'shard0-1\.png'"
    ):
        misread[1]
    _, train, _ = scan_shards(root)  # indexed again: each sample under its own name and label
    assert [train[i] for i in range(6)] == [
        (f"{shards[n]}:shard{1 - n}-{k}", 1 - n) for n in range(2) for k in range(3)
    ]
    # A read at an offset whose header names another member (an index that passed as its shard's) is no image.
    offset, size = int(train.offsets[1]), int(train.sizes[1])
    with pytest.raises(OSError, match=r"holds 'shard1-1\.png' \(11 bytes\) where its index says 'shard0-1\.png'"):
        ShardReader().read(str(shards[0]), offset, size, "shard0-1.png")
    assert ShardReader().read(str(shards[0]), offset, size, "shard1-1.png") == bytes([1]) * 11


def test_names_a_tar_header_cannot_hold_as_they_are_are_checked_by_size(tmp_path):
    """Non-ASCII and long names live in a pax record before the member's header, which holds a stand-in ('caf?.png',
    the first 100 bytes): those samples' headers are checked by their size, and read; a short ASCII name must match."""
    shard = tmp_path / "s.tar"
    long_name = "d" * 60 + "/" + "e" * 80
    samples = [
        ("café.png", b"\x01" * 5),
        ("café.cls", b"0"),
        (f"{long_name}.png", b"\x02" * 7),
        (f"{long_name}.cls", b"1"),
        ("x" * 96 + ".png", b"\x03" * 9),
        ("x" * 96 + ".cls", b"0"),
    ]  # (a name of exactly 100 bytes)
    webdataset_tar(shard, samples)
    write_index(shard, index_tar(shard)[0], shard_stamp(shard))
    index = read_index(shard)  # its first and last samples' headers: checked, and it stays
    reader, names = ShardReader(), bytes(index["names"]).split(b"\0")
    for k, expected in enumerate((b"\x01" * 5, b"\x02" * 7, b"\x03" * 9)):
        assert (
            reader.read(str(shard), int(index["offsets"][k]), int(index["sizes"][k]), os.fsdecode(names[k])) == expected
        )
    with pytest.raises(OSError, match="where its index says 'y.png'"):
        reader.read(str(shard), int(index["offsets"][2]), int(index["sizes"][2]), "y.png")


def test_shards_of_other_writers_that_would_be_read_wrong_are_refused_or_read_right(tmp_path, capsys):
    """What other writers' shards held: each was read silently wrong, or a traceback. A key again after other samples
    (a writer keying by base name): one sample kept per key; a label past int32 or not ASCII digits; a gzip shard
    named .tar (read as cut short at 0 samples, then silently, its index written) or .tar.gz ones (ignored); a cut
    after a .json label (lost a whole sample); another tool's NAME.idx (DALI's: overwritten); a .json whose "class"
    is a name beside its "class_index"; without classes.txt, a val label train never has (taken for a class)."""
    shard = tmp_path / "s.tar"
    webdataset_tar(shard, [("0.jpg", b"a"), ("0.cls", b"0"), ("1.jpg", b"b"), ("1.cls", b"1"), ("0.jpg", b"c")])
    with pytest.raises(UsageError, match=rf"^{shard} holds 0\.jpg twice: each member's name must be unique"):
        index_tar(shard)
    webdataset_tar(shard, [("a.jpg", b"a"), ("a.cls", b"0"), ("a.jpg", b"b"), ("a.cls", b"1")])  # (one after another)
    with pytest.raises(UsageError, match=rf"^{shard} holds a\.jpg twice"):
        index_tar(shard)
    webdataset_tar(shard, [("./4.jpg", b"4"), ("./5.cls", b"1"), ("./5.jpg", b"5"), ("./4.cls", b"0")])  # `tar cf`'s
    assert [(key, label) for key, _, label, *_ in index_tar(shard)[0]] == [("./4", 0), ("./5", 1)]  # (was refused)
    for label in (b"99999999999", "\u00b2".encode()):
        webdataset_tar(shard, [("a.jpg", b"a"), ("a.cls", label)])
        with pytest.raises(UsageError, match=r"a\.cls holds .*: expected a class index"):
            index_tar(shard)
    webdataset_tar(shard, [("a.jpg", b"a"), ("a.json", b'{"class": "tench", "class_index": 3}')])
    assert index_tar(shard)[0][0][2] == 3
    webdataset_tar(shard, [item for n in range(2) for item in ((f"k{n}.jpg", b"z"), (f"k{n}.json", b'{"label": 1}'))])
    whole = shard.read_bytes()
    shard.write_bytes(whole[: whole.rindex(b'{"label": 1}') + 12])  # after k1's label: the end-of-archive blocks lost
    assert [sample[0] for sample in index_tar(shard)[0]] == ["k0", "k1"]
    webdataset_tar(
        shard,
        [(f"k{n}.{e}", d) for n in range(2) for e, d in (("jpg", b"z"), ("json", b'{"label": 7}'), ("cls", b"1"))],
    )
    shard.write_bytes(shard.read_bytes()[: shard.read_bytes().rindex(b"7}") + 2])  # before k1's .cls: lost, not 7
    assert [sample[0] for sample in index_tar(shard)[0]] == ["k0"] and index_tar(shard)[1] == "k1"
    webdataset_tar(shard, [("a.jpg", b"a"), ("a.json", b'{"label": 99999999999}')])  # (was: an OverflowError)
    with pytest.raises(UsageError, match="a has no label"):
        index_tar(shard)
    root = tmp_path / "other"
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
        webdataset_tar(root / split / "a-000.tar", [("k.jpg", b"k"), ("k.cls", b"1"), ("j.jpg", b"j"), ("j.cls", b"0")])
    dali = b"v1.2 2\ncls 1024 1 jpg 1536 1\n"
    (root / "train" / "a-000.idx").write_bytes(dali)
    assert len(scan_shards(root)[1]) == 2
    ours = root / "train" / "a-000.tar.idx"  # beside it under another name: read by the next job, not built again
    assert (root / "train" / "a-000.idx").read_bytes() == dali and read_index(root / "train" / "a-000.tar", ours)
    written = ours.stat().st_mtime_ns
    assert len(scan_shards(root)[1]) == 2 and ours.stat().st_mtime_ns == written
    for labels, unseen in (((b"2",), "2"), ((b"1", b"3"), "3")):  # past train's labels, and in a gap of them
        webdataset_tar(
            root / "val" / "a-000.tar",
            [(f"k{n}.{e}", d) for n, lb in enumerate(labels) for e, d in (("jpg", b"k"), ("cls", lb))],
        )
        with pytest.raises(
            UsageError, match=rf"val shards of --data {root} have labels {unseen} that its train shards never have"
        ):
            scan_shards(root)
    webdataset_tar(root / "val" / "a-000.tar", [("k.jpg", b"k"), ("k.cls", b"1")])
    compressed = root / "val" / "a-001.tar"
    for module, kind in (("gzip", "gzip"), ("lzma", "xz"), ("bz2", "bzip2")):  # (was: read as cut short, 0 samples)
        compressed.write_bytes(__import__(module).compress((root / "val" / "a-000.tar").read_bytes()))
        with pytest.raises(UsageError, match=rf"^{compressed} holds {kind} data: .* decompress it$"):
            scan_shards(root)
    compressed.rename(root / "val" / "a-001.tar.gz")
    with pytest.raises(UsageError, match=r"a-001\.tar\.gz is compressed: shards are read at their samples' offsets"):
        scan_shards(root)
    webdataset_tar(compressed, [("m.jpg", b"m"), ("m.cls", b"0")])  # beside its .tar, as `gzip -k` leaves it: read
    assert len(scan_shards(root)[2]) == 2
    compressed.unlink()
    (root / "val" / "a-001.tar.gz").unlink()
    only = tmp_path / "only-compressed"  # (was: "train has no class folders")
    shutil.copytree(root, only)
    for path in only.glob("*/*.tar"):
        path.rename(path.with_name(path.name + ".gz"))
    with pytest.raises(UsageError, match=r"is compressed: shards are read at their samples' offsets"):
        build_datasets(parse("--data", only))
    cut = root / "val" / "a-001.tar"
    cut.write_bytes((root / "val" / "a-000.tar").read_bytes()[:1000])  # k's label cut off
    capsys.readouterr()
    for _ in range(2):  # said by every job (was: once, then its index made the loss silent)
        assert len(scan_shards(root)[2]) == 1
        assert capsys.readouterr().out.startswith(f"warning: {cut} is cut short")


def test_an_index_of_version_1_is_built_again_and_make_shards_carries_on_over_its_own(shards, tmp_path):
    """Version 1 read some shards wrong (a name twice, gzip data, a cut after a .json): such an index of another
    writer's shards is not trusted; make_shards' own (shards.json beside them), which version 1 read right, keep theirs
    (not read through again by every job) and are not written again on a rerun."""
    copy = shutil.copytree(shards, tmp_path / "copy")
    tars = sorted(copy.glob("*/*.tar"))

    def as_version_1():
        for shard in tars:
            index = dict(np.load(index_path(shard)))
            with open(index_path(shard), "wb") as file:
                np.savez(file, **{**index, "version": np.array(1)})

    as_version_1()
    scan_shards(copy)  # make_shards' (its shards.json there): version 1 read them right, trusted
    assert all(int(np.load(index_path(shard))["version"]) == 1 for shard in tars)
    assert all(make_shards.done(shard) for shard in tars)
    (copy / "shards.json").write_text('{"files": []}')  # another writer's (a JSON list of shards): built again
    scan_shards(copy)
    assert all(int(np.load(index_path(shard))["version"]) == INDEX_VERSION for shard in tars)


def test_what_a_shard_holds_that_its_index_would_read_wrong_is_refused_and_names_like_magic_are_not(tmp_path):
    """Two images in one sample (a photo and its mask: the last was kept, silently), an image stored as a link
    (`tar cf` of a folder with links: its sample lost, silently), zstd data; a first member named BZh... is no bzip2
    data (was refused); another tool's NAME.idx and NAME.tar.idx both kept (the second was overwritten); a dangling
    link as a shard: one line (was a FileNotFoundError traceback)."""
    shard = tmp_path / "s.tar"
    webdataset_tar(shard, [("a.jpg", b"photo"), ("a.png", b"mask"), ("a.cls", b"0")])
    with pytest.raises(UsageError, match=rf"^{shard}:a holds two images \(jpg, png\): keep one image a sample"):
        index_tar(shard)
    for name, kind in (("b.jpg", tarfile.LNKTYPE), ("b.jpg", tarfile.SYMTYPE), ("b.cls", tarfile.LNKTYPE)):
        with tarfile.open(shard, "w") as tar:
            for member, data in (("a.jpg", b"photo"), ("a.cls", b"0")):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, f"a.{name.split('.')[1]}"
            tar.addfile(info)
        with pytest.raises(UsageError, match=rf"^{shard}: {name} is a link: write the shard with the files themselves"):
            index_tar(shard)  # (a .cls linked: "b has no label", untrue)
    webdataset_tar(shard, [("a.jpg", b"photo"), ("a.cls", b"0")])
    with tarfile.open(shard, "a") as tar:  # a link that is neither an image nor a label: left alone
        info = tarfile.TarInfo("a.txt")
        info.type, info.linkname = tarfile.SYMTYPE, "a.cls"
        tar.addfile(info)
    assert [sample[0] for sample in index_tar(shard)[0]] == ["a"]
    shard.write_bytes(b"\x28\xb5\x2f\xfd" + bytes(2000))
    with pytest.raises(UsageError, match=r"holds zstd data"):
        index_tar(shard)
    webdataset_tar(shard, [("BZh2023_001.jpg", b"x"), ("BZh2023_001.cls", b"0")])  # ("BZh" and a digit, as bzip2)
    assert [sample[0] for sample in index_tar(shard)[0]] == ["BZh2023_001"]
    root = tmp_path / "root"
    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
        webdataset_tar(root / split / "a.tar", [("k.jpg", b"k"), ("k.cls", b"0")])
    theirs = {root / "train" / "a.idx": b"v1.2 1\n", root / "train" / "a.tar.idx": b"another tool's"}
    for path, data in theirs.items():
        path.write_bytes(data)
    (tmp_path / "out").mkdir()
    assert len(scan_shards(root, cache=tmp_path / "out")[1]) == 1
    assert all(path.read_bytes() == data for path, data in theirs.items())
    assert list((tmp_path / "out" / "shard-indexes").iterdir())
    (root / "val" / "b.tar").symlink_to("gone.tar")
    with pytest.raises(UsageError, match=rf"^cannot read {root}/val/b\.tar: No such file or directory$"):
        scan_shards(root)

"""common/datasets.py: where images come from (folders, CSV/TSV splits, a researcher's dataset, --dummy, the demo
set), decoded by torchvision or PIL, and what an item must be: each mistake refused in one line at start (a Hugging
Face dataset: tests/unit/test_hf_datasets.py)."""

import errno
import io
import os
import re
import resource
import shutil
import subprocess
import types

import pytest
import torch
import torchvision
from PIL import Image

from common import datasets as datasets_module
from common.config import ResSchedule
from common.data import build_data
from common.datasets import (
    ImageFiles,
    ItemCheck,
    SyntheticImages,
    build_datasets,
    load_image,
)
from common.errors import BadItem, UnreadableFile, UsageError
from common.folder_index import read_split_file
from conftest import cpu_runtime, parse
from harness.processes import PYTHON, REPO, within

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables
SMALL = ["--train-crop-size", "16", "--val-resize-size", "16", "--val-crop-size", "16", "-j", "0", "-b", "4"]


def test_load_image_decodes_jpegs_with_torchvision_and_other_formats_png_too_with_pil(tmp_path, monkeypatch):
    """JPEGs (by their first bytes) by torchvision.io; PNGs by PIL, since torchvision's PNG decoder crashed the process
    on a damaged PNG (tests/test_data_faults.py); a PNG under a .jpg name too."""
    picture = Image.new("RGB", (30, 20), (200, 40, 10))
    picture.paste((10, 220, 30), (5, 5, 20, 15))
    # Which decoder ran: both, unchanged, count their calls (their pixels may agree to the bit).
    calls = []
    torchvision_decode, pil_open = datasets_module.decode_image, Image.open
    assert torchvision_decode is not None, "torchvision.io.decode_image is gone: load_image uses PIL alone"
    monkeypatch.setattr(
        datasets_module, "decode_image", lambda *a, **k: calls.append("torchvision") or torchvision_decode(*a, **k)
    )
    monkeypatch.setattr(Image, "open", lambda *a, **k: calls.append("PIL") or pil_open(*a, **k))
    for name, decoder in (("a.jpg", "torchvision"), ("a.png", "PIL"), ("png-inside.jpg", "PIL"), ("a.bmp", "PIL")):
        picture.save(tmp_path / name, format="PNG" if "png" in name else None)
        calls.clear()
        image = load_image(str(tmp_path / name))
        assert calls == [decoder], name
        assert image.dtype == torch.uint8 and image.shape == (3, 20, 30), name
        reference = torchvision.transforms.v2.functional.pil_to_tensor(pil_open(tmp_path / name).convert("RGB"))
        assert (image.int() - reference.int()).abs().max() <= 2, name  # two JPEG decoders may round apart
    Image.new("L", (8, 6), 90).save(tmp_path / "grey.png")
    assert load_image(str(tmp_path / "grey.png")).shape == (3, 6, 8)  # always RGB
    # 16-bit grayscale: scaled to 8 bits as torchvision scales it (its high byte), not clipped to white by PIL.
    Image.new("I;16", (8, 6), 40000).save(tmp_path / "grey16.png")
    assert load_image(str(tmp_path / "grey16.png")).unique().tolist() == [40000 >> 8]
    Image.new("I;16", (8, 6), 40000).save(tmp_path / "grey16.pgm")  # (PIL opens it as 32-bit "I")
    assert load_image(str(tmp_path / "grey16.pgm")).unique().tolist() == [40000 >> 8]
    # A 32-bit TIFF, whose range nothing says: as ImageFolder decodes it (was shifted to black, 0).
    Image.new("I", (8, 6), 120).save(tmp_path / "int32.tif")
    reference = torchvision.datasets.folder.pil_loader(str(tmp_path / "int32.tif"))
    # A researcher's dataset that gives the 16-bit image as PIL opens it: the same pixels as the file (was white).
    opened = Image.open(tmp_path / "grey16.png")
    assert ItemCheck(1, "train")((opened, 0), 0)[0].unique().tolist() == [40000 >> 8]
    assert torch.equal(
        load_image(str(tmp_path / "int32.tif")), torchvision.transforms.v2.functional.pil_to_tensor(reference)
    )


def test_a_trainer_of_its_own_data_that_reads_the_flags_data_without_data_is_told_to_give_it():
    """(was: a TypeError traceback of Path(None); before, the demo set, said to be the trainer's)"""
    config = parse("--trainer", "examples.experiment:Experiment")
    with pytest.raises(UsageError, match="^--trainer examples.experiment:Experiment's build_datasets reads the data "):
        datasets_module.build_datasets(config)


def test_load_image_of_a_broken_file_names_it(tmp_path):
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(Exception, match=rf"cannot identify image file .*{re.escape(str(tmp_path / 'broken.jpg'))}"):
        load_image(str(tmp_path / "broken.jpg"))


def test_a_fifo_named_like_an_image_is_an_unreadable_file_not_a_reader_blocked_forever(tmp_path):
    """(was: its open() waited for a writer forever, in a loader worker or, with -j 0, in training itself)"""
    for name in ("fifo.jpg", "fifo.png"):
        os.mkfifo(tmp_path / name)
        files = ImageFiles([(str(tmp_path / name), 0)])
        with within(10), pytest.raises(UnreadableFile, match=r"not a regular file \(a FIFO or a device\)"):
            files[0]
    (tmp_path / "folder.png").mkdir()  # (a folder: open()'s IsADirectoryError, as before)
    with pytest.raises(UnreadableFile, match=r"Is a directory"):
        ImageFiles([(str(tmp_path / "folder.png"), 0)])[0]


def test_a_jpeg_decodes_under_w_error(tmp_path):
    """python -W error (PYTHONWARNINGS=error): torchvision 0.29's deprecation of its decoders, warned at each decode,
    was an error there, and every JPEG was skipped as one that cannot be decoded."""
    Image.new("RGB", (8, 6), (200, 10, 10)).save(tmp_path / "a.jpg")
    decode = f"from common.datasets import load_image; print(tuple(load_image({str(tmp_path / 'a.jpg')!r}).shape))"
    result = subprocess.run(
        [PYTHON, "-W", "error", "-c", decode], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.stdout == "(3, 6, 8)\n", result.stderr[-2000:]


def test_a_jpeg_whose_header_claims_more_pixels_than_pil_decodes_is_refused_as_pil_refuses_it(tmp_path):
    """A file of 600 bytes whose frame header says 20000 x 20000: torchvision decoded it (1.2 GB, grey: trained on,
    unsaid), where PIL, and so ImageFolder, refuse it (DecompressionBombError). Normal JPEGs: their size as PIL's."""
    for options in ({}, {"progressive": True}, {"exif": b"x" * 60000, "icc_profile": b"y" * 70000}):
        encoded = io.BytesIO()
        Image.new("RGB", (300, 200)).save(encoded, "JPEG", **options)
        assert datasets_module.jpeg_pixels(memoryview(encoded.getvalue())) == 300 * 200, options
    plain = encoded.getvalue()  # a fill byte before a marker, and a comment holding an SOF's bytes before the frame:
    comment = b"\xff\xfe" + (2 + 9).to_bytes(2, "big") + b"\xff\xc0\x00\x11\x08\x7f\xff\x7f\xff"
    for odd in (plain[:2] + b"\xff" + plain[2:], plain[:2] + comment + plain[2:]):
        assert datasets_module.jpeg_pixels(memoryview(odd)) == 300 * 200 == Image.open(io.BytesIO(odd)).size[0] * 200
    for cut in range(len(plain) // 4):  # (a header cut short: none found, never an exception)
        datasets_module.jpeg_pixels(memoryview(plain[:cut]))
    assert datasets_module.jpeg_pixels(memoryview(plain[:20])) is None
    bomb = bytearray(encoded.getvalue())
    frame = bomb.index(b"\xff\xc0")
    bomb[frame + 5 : frame + 9] = (20000).to_bytes(2, "big") * 2
    (tmp_path / "bomb.jpg").write_bytes(bomb)
    with pytest.raises(Image.DecompressionBombError) as pil:
        Image.open(tmp_path / "bomb.jpg")
    for decode in (lambda: load_image(str(tmp_path / "bomb.jpg")), lambda: datasets_module.decode_bytes(bomb, "jpg")):
        with pytest.raises(Image.DecompressionBombError) as ours:
            decode()
        assert str(ours.value) == str(pil.value)


def test_an_image_file_that_cannot_be_decoded_is_an_unreadable_file_named_by_its_path(tmp_path):
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    files = ImageFiles([(str(tmp_path / "broken.jpg"), 0)])
    with pytest.raises(UnreadableFile, match="cannot identify image file"):
        files[0]
    assert files.name(0) == str(tmp_path / "broken.jpg")


def test_decode_gpu_reads_a_jpeg_name_that_is_no_file_as_without_it(tmp_path):
    """--decode gpu read a .jpg linked to /dev/zero whole, in a process of its own here: its memory ran out (a
    MemoryError's traceback, or the kernel's OOM kill of a loader worker). Without the flag PIL names it; now alike."""
    (tmp_path / "zero.jpg").symlink_to("/dev/zero")
    with pytest.raises(UnreadableFile) as without:
        ImageFiles([(str(tmp_path / "zero.jpg"), 0)])[0]
    code = (
        "import sys\nfrom common.datasets import ImageFiles\nfiles = ImageFiles([(sys.argv[1], 0)])\n"
        "files.defer_jpegs = True\ntry:\n    files[0]\n"
        "except Exception as error:\n    print(type(error).__name__, error)"
    )
    limit = lambda: resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.RLIM_INFINITY))  # noqa: E731
    result = subprocess.run(
        [PYTHON, "-c", code, tmp_path / "zero.jpg"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
        start_new_session=True,
    )
    assert result.stdout.strip() == f"UnreadableFile {without.value}", result.stdout + result.stderr[-2000:]


def test_synthetic_images_take_the_size_of_their_epoch():
    dummy = SyntheticImages(8, 20, res_schedule=ResSchedule.parse("16:32:0:2:8"))
    assert dummy[0][0].shape == (3, 16, 16) and dummy[3][1] == 3
    dummy.set_epoch(1)
    assert dummy[0][0].shape == (3, 24, 24)


@pytest.fixture(scope="module")
def csv_splits(tiny_data, tmp_path_factory):
    """tiny_data listed in train.csv / val.csv (paths relative to the folder, a header row), and in .tsv."""
    import csv

    root = tmp_path_factory.mktemp("splits")
    for suffix, delimiter in ((".csv", ","), (".tsv", "\t")):
        folder = root / suffix[1:]
        folder.mkdir()
        (folder / "images").symlink_to(tiny_data)
        for split in ("train", "val"):
            with open(folder / f"{split}{suffix}", "w", newline="") as file:
                writer = csv.writer(file, delimiter=delimiter)
                writer.writerow(["path", "label"])
                for path in sorted((tiny_data / split).glob("*/*.jpg")):
                    writer.writerow([f"images/{split}/{path.parent.name}/{path.name}", path.parent.name])
    return root


def test_csv_and_tsv_splits_list_the_image_folder_s_files_in_its_order(csv_splits, tiny_data, tmp_path):
    """Also a CSV that Excel saved ("CSV UTF-8": a byte order mark before the header, which was read as a row of
    class `label`: 4 classes, exit 0), and one whose header names its paths otherwise (image,label: the same)."""
    folder = build_datasets(parse("--data", tiny_data))
    shutil.copytree(csv_splits / "csv", tmp_path / "excel", symlinks=True)
    shutil.copytree(csv_splits / "csv", tmp_path / "image", symlinks=True)
    for split in ("train", "val"):
        (tmp_path / "excel" / f"{split}.csv").write_bytes(
            b"\xef\xbb\xbf" + (csv_splits / "csv" / f"{split}.csv").read_bytes()
        )
        rows = (csv_splits / "csv" / f"{split}.csv").read_text().splitlines(keepends=True)[1:]
        (tmp_path / "image" / f"{split}.csv").write_text("\n" + "image,Label\n" + "".join(rows))
    for kind in ("csv", "tsv", tmp_path / "excel", tmp_path / "image"):
        classes, train, val = build_datasets(parse("--data", csv_splits / kind))
        assert classes == folder[0] == ["circle", "ring", "square"]
        for ours, theirs in ((train, folder[1]), (val, folder[2])):
            assert [(name.split("/images/")[1], label) for name, label in ours.samples] == [
                (name.split(f"{tiny_data.name}/")[1], label) for name, label in theirs.samples
            ]


def test_csv_splits_that_do_not_fit_are_refused_in_one_line(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "train.csv").write_text("a.jpg,cat\n")
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "train.csv").write_text("a.jpg,cat\n")
    (tmp_path / "unknown" / "val.csv").write_text("b.jpg,dog\n")
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "train.csv").write_text("path,label\na.jpg\n")
    (tmp_path / "short" / "val.csv").write_text("b.jpg,cat\n")
    (tmp_path / "latin").mkdir()  # (a traceback: UnicodeDecodeError)
    (tmp_path / "latin" / "train.csv").write_bytes("path,label\na.jpg,cat\nb.jpg,caf\u00e9\n".encode("cp1252"))
    (tmp_path / "latin" / "val.csv").write_text("b.jpg,cat\n")
    shutil.copytree(tmp_path / "latin", tmp_path / "latin-marked")  # (Excel's mark before it: the same line and byte)
    (tmp_path / "latin-marked" / "train.csv").write_bytes(
        b"\xef\xbb\xbf" + (tmp_path / "latin" / "train.csv").read_bytes()
    )
    rows = "a.jpg,cat\n" * 20_000  # an unbalanced quote: the rest of the file one field (past csv's 128 KiB: an error)
    for name, first in (("quote", '"b.jpg,cat\n'), ("quote-large", '"b.jpg,cat\n' + rows)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.csv").write_text("path,label\n" + first + "c.jpg,dog\n")
        (tmp_path / name / "val.csv").write_text("b.jpg,cat\n")
    (tmp_path / "multiline").mkdir()  # (a quoted path over two lines: the line of the record after it counted)
    (tmp_path / "multiline" / "train.csv").write_text('path,label\n"a\nb.jpg",cat\nc.jpg\n')
    (tmp_path / "multiline" / "val.csv").write_text("b.jpg,cat\n")
    (tmp_path / "labelled").mkdir()  # an image of a class named "label" first: no header (was: dropped)
    (tmp_path / "labelled" / "train.csv").write_text("a.jpg,label\nb.jpg,cat\n")
    assert [label for _, label in read_split_file(tmp_path / "labelled" / "train.csv", tmp_path)] == ["label", "cat"]
    for name, line in [
        ("multiline", r"train.csv line 4: expected path,label, got 'c.jpg'$"),
        ("quote", r"train.csv line 2: expected path,label, got 'b.jpg,cat\\nc.jpg,dog\\n'$"),
        ("quote-large", r"train.csv line 2: field larger than field limit \(131072\) \(an unbalanced quote\?\)$"),
        ("one", "has train.csv but no val.csv: give both splits"),
        ("latin", r"train.csv line 3: byte 0xe9 is not UTF-8: save the file as UTF-8$"),
        ("latin-marked", r"train.csv line 3: byte 0xe9 is not UTF-8: save the file as UTF-8$"),
        ("unknown", r"val labels dog of \S+ do not occur in its train split"),
        ("short", r"train.csv line 2: expected path,label, got 'a.jpg'"),
    ]:
        with pytest.raises(UsageError, match=line):
            build_datasets(parse("--data", tmp_path / name))


def test_data_the_user_cannot_search_is_one_line(tiny_data, tmp_path, monkeypatch):
    """A --data folder of mode 000 or 644 passes its own stat, then pathlib's is_file() of a file in it raises
    PermissionError (it ignores only ENOENT-like errors): was a traceback. As root, chmod stops nothing: the error a
    user without permission gets from os.stat is raised for every path inside the folder instead."""
    data, real_stat = shutil.copytree(tiny_data, tmp_path / "data"), os.stat

    def stat(path, *args, **kwargs):
        if str(path).startswith(f"{data}/"):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(UsageError, match=rf"^cannot list {data}/\S+: Permission denied$"):
        build_datasets(parse("--data", data))


# A researcher's dataset (tests/custom_datasets.py) that breaks a rule: the one line that says so.
REFUSED = {
    "triples": "item 0 of the train set is a tuple of 3; items must be (image, label)",
    "numpy_images": "the image is a ndarray; expected a PIL image or a CHW tensor "
    "(torch.from_numpy(array).permute(2, 0, 1)",
    "hwc_tensors": "an image of shape [20, 6, 3]; expected channels x height x width",
    "labels_out_of_range": "label 3; expected a class index, an int in 0..2",
    "iterable": "the train set is a Stream: give a map-style dataset",
    "two_things": "returned tuple: return (classes, train_set, val_set)",
    "uint16_images": "an image of dtype torch.int16; expected uint8 (0-255) or float (0-1)",
    "gray_tensors": "the images have 1 channel(s): give --mean and --std with 1 value(s) each",
    "float_0_255": "a float image of values 20 to 60; expected 0-1: divide a 0-255 image by 255",
    "nan_images": "a float image holding NaN or infinite values; expected 0-1",
    "one_nan_pixel": "a float image holding NaN or infinite values; expected 0-1",
    "length_too_large": "the train set's last item, 15, raises IndexError (list index out of range): does its "
    "__len__, 16, count more items than it has?",
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_dataset_item_the_loaders_cannot_take_is_refused_in_one_line(name):
    """Checked at start on item 0 (and the last), before any training."""
    config = parse(*SMALL, "--dataset", f"tests.custom_datasets:{name}")
    with pytest.raises(UsageError) as refused:
        build_data(config, build_datasets(config), 0, cpu_runtime())
    assert REFUSED[name] in str(refused.value) and "\n" not in str(refused.value)


def test_a_last_item_that_cannot_be_read_is_no_stop_at_start():
    """The start reads the last item for a __len__ too large (IndexError): an unreadable image there is skipped in its
    epoch, as anywhere else."""
    config = parse(*SMALL, "--dataset", "tests.custom_datasets:unreadable_last_item")
    assert len(build_data(config, build_datasets(config), 0, cpu_runtime()).train_loader.dataset) == 12


def test_first_items_that_cannot_be_read_are_skipped_at_start_and_a_set_of_none_is_one_line():
    """Item 0 unreadable was a traceback (PIL's UnidentifiedImageError from the start's read of it)."""
    config = parse(*SMALL, "--dataset", "tests.custom_datasets:unreadable_first_items")
    assert len(build_data(config, build_datasets(config), 0, cpu_runtime()).train_loader.dataset) == 12
    classes, train, val = build_datasets(config)

    class Unreadable(torch.utils.data.Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, index):
            raise OSError("cannot identify image file")

    with pytest.raises(UsageError, match=r"^the train set's first 16 items cannot be read \(the last: OSError: cannot"):
        build_data(config, (classes, Unreadable(), val), 0, cpu_runtime())


def test_numpy_integer_labels_are_class_indices():
    """Were refused: `label np.int64(0); expected a class index, an int in 0..2`."""
    config = parse(*SMALL, "--dataset", "tests.custom_datasets:numpy_labels")
    _, labels, _ = next(iter(build_data(config, build_datasets(config), 0, cpu_runtime()).train_loader))
    assert labels.dtype == torch.int64 and set(labels.tolist()) <= {0, 1, 2}


def test_an_item_found_bad_later_ends_the_run_in_one_line_naming_it():
    """A loader reads item 5 (a worker, with -j 1 or more): BadItem, which is raised, never skipped."""
    config = parse(*SMALL, "--dataset", "tests.custom_datasets:late_bad_item")
    data = build_data(config, build_datasets(config), 0, cpu_runtime())
    with pytest.raises(BadItem, match=r"^item 5 of the train set is a tuple of 3; items must be \(image, label\)$"):
        data.train_loader.dataset[5]


@pytest.mark.parametrize(
    "name, normalisation",
    [
        ("pil_images", "mean 0.485, 0.456, 0.406, std 0.229, 0.224, 0.225 (ImageNet's)"),
        ("float_tensors", "mean 0.485, 0.456, 0.406, std 0.229, 0.224, 0.225 (ImageNet's)"),
        ("gray_with_stats", "mean 0.47, std 0.3 (the dataset's mean/std)"),
    ],
)
def test_pil_images_and_tensors_are_taken_normalised_as_the_header_says(name, normalisation):
    config = parse(*SMALL, "--dataset", f"tests.custom_datasets:{name}")
    data = build_data(config, build_datasets(config), 0, cpu_runtime())
    assert data.normalisation == normalisation
    images, labels, _ = next(iter(data.val_loader))
    assert images.dtype == torch.float32 and images.shape[1] == (1 if "gray" in name else 3) and len(labels) == 4
    given = parse(*SMALL, "--dataset", "tests.custom_datasets:gray_tensors", "--mean", "0.5", "--std", "0.25")
    assert (
        build_data(given, build_datasets(given), 0, cpu_runtime()).normalisation == "mean 0.5, std 0.25 (--mean/--std)"
    )


def test_a_dataset_s_mean_and_std_may_be_tensors_and_must_be_on_the_images_0_1_scale():
    """A tensor's (images.float().mean(...) / 255) was a traceback; CIFAR's 0-255 figures (125.3, ...) trained on inputs
    near -2, exit 0."""
    from common.transforms import choose_normalisation

    config, train = parse(*SMALL), types.SimpleNamespace(mean=torch.tensor([0.5, 0.4, 0.3]), std=torch.full((3,), 0.25))
    assert choose_normalisation(config, train, 3) == (
        (0.5, pytest.approx(0.4), pytest.approx(0.3)),
        (0.25, 0.25, 0.25),
        "the dataset's mean/std",
    )
    train = types.SimpleNamespace(mean=(125.3, 123.0, 113.9), std=(63.0, 62.1, 66.7))
    with pytest.raises(UsageError, match=r"must lie in 0-1, the scale of the images .* divide them by 255\)$"):
        choose_normalisation(config, train, 3)


def test_dataset_names_a_function_of_args_or_is_refused_in_one_line():
    for text, line in [
        ("tests.custom_datasets", "--dataset tests.custom_datasets: expected package.module:name"),
        ("math:pi", "--dataset math:pi is a float: expected FN(args) -> (classes, train_set, val_set)"),
        ("os:getcwd", "--dataset os:getcwd cannot be called as FN(args) -> (classes, train_set, val_set): too many "),
    ]:
        with pytest.raises(UsageError) as refused:
            build_datasets(parse(*SMALL, "--dataset", text))
        assert str(refused.value).startswith(line)


def test_our_image_sets_are_rgb_and_take_three_values_of_mean_and_std(tiny_data):
    """An image folder is not read at the start (a hung file system would block it), nor is --dummy: both are RGB,
    so --mean and --std of another length are refused in one line (they were a broadcasting traceback at step 1)."""
    for source in (["--data", tiny_data], ["--dummy"]):
        config = parse(*SMALL, *source, "--mean", "0.5,0.5", "--std", "0.2,0.2")
        with pytest.raises(
            UsageError, match=r"^mean \(0\.5, 0\.5\) and std \(0\.2, 0\.2\) must have one value per image"
        ):
            build_data(config, build_datasets(config), 0, cpu_runtime())
    for mean, std in [("nan,0,0", "1,1,1"), ("inf,0,0", "1,1,1"), ("0,0,0", "inf,1,1"), ("0,0,0", "1,1,0")]:
        config = parse(*SMALL, "--dummy", "--mean", mean, "--std", std)
        with pytest.raises(UsageError, match=r"^mean \(.*\) and std \(.*\) must be finite numbers$|must be positive$"):
            build_data(config, build_datasets(config), 0, cpu_runtime())


def test_uint8_and_float_images_of_the_same_pixels_give_the_same_inputs():
    """pil_images' items are grey PIL images (converted to RGB), float_tensors' the same pixels / 255 in 3
    channels: normalised on one scale each, they are the same model inputs."""
    inputs = []
    for name in ("pil_images", "float_tensors"):
        config = parse(
            *SMALL,
            "--val-resize-size",
            "20",
            "--val-crop-size",
            "20",
            "-b",
            "6",
            "--dataset",
            f"tests.custom_datasets:{name}",
        )
        inputs.append(next(iter(build_data(config, build_datasets(config), 0, cpu_runtime()).val_loader))[0])
    from_uint8, from_float = inputs
    assert from_uint8.dtype == from_float.dtype == torch.float32
    # pil_images is the grey (L) version of the noise: compare the channel means, which the noise barely moves.
    assert torch.allclose(from_uint8.mean(dim=(1, 2, 3)), from_float.mean(dim=(1, 2, 3)), atol=0.05)


def test_a_data_path_the_system_refuses_is_one_line(tmp_path):
    """A name longer than the file system takes (it was a traceback: OSError File name too long)."""
    with pytest.raises(UsageError, match=r"^--data \S+: a name in it is longer than 255 bytes \(x+\.\.\.\): give a "):
        build_datasets(parse("--data", tmp_path / ("x" * 300)))


def test_a_jpeg_goes_to_the_device_encoded_only_where_it_is_whole_and_of_one_or_three_channels():
    """--decode gpu: the loader worker reads a JPEG's size from its header and hands over its bytes; a CMYK JPEG, a PNG
    under a .jpg name and a file cut short (no end marker) are the worker's to decode, as without the flag."""
    from common.datasets import encoded_jpeg

    def saved(mode, fmt="JPEG"):
        buffer = io.BytesIO()
        Image.new(mode, (30, 20), {"L": 90, "CMYK": (0, 200, 200, 0)}.get(mode, (200, 30, 30))).save(buffer, fmt)
        return buffer.getvalue()

    found = encoded_jpeg(saved("RGB"), "a.jpg")
    assert (found.height, found.width, found.name, found.shape) == (20, 30, "a.jpg", (3, 20, 30))
    assert bytes(found.data.numpy()) == saved("RGB") and found.plan is None
    assert encoded_jpeg(saved("L"), "grey.jpg").shape == (3, 20, 30)
    for data in (saved("CMYK"), saved("RGB", "PNG"), saved("RGB")[:-2], b"", b"\xff\xd8\xff\xd9"):
        assert encoded_jpeg(data, "x.jpg") is None

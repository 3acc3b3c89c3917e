"""common/folder_index.py: one pass lists and checks train/ and val/, in torchvision's ImageFolder's order."""

import shutil
import unicodedata

import pytest
import torchvision

from common.errors import UsageError
from common.folder_index import IMG_EXTENSIONS, scan_image_folder


@pytest.fixture
def folder(tiny_data, tmp_path):
    """A private, editable copy of the tiny ImageFolder."""
    return shutil.copytree(tiny_data, tmp_path / "data")


def test_scan_image_folder_returns_the_sorted_classes(tiny_data):
    assert scan_image_folder(tiny_data).classes == ["circle", "ring", "square"]


def test_scan_image_folder_lists_the_samples_of_torchvisions_image_folder_in_its_order(folder):
    train = folder / "train"
    (train / "ring" / "nested" / "deeper").mkdir(parents=True)
    siblings = [f"square/sub-{name}" for name in "qcxhatme"]  # created out of order: listing order is no help
    for sibling in siblings:
        (train / sibling).mkdir()
    for path in (
        "ring/nested/b.jpg",
        "ring/nested/deeper/a.JPEG",
        "ring/nested-x.png",
        "square/UPPER.JPG",
        "square/notes.txt",
        "circle/-first.jpg",
        *[f"{sibling}/1.jpg" for sibling in siblings],
    ):
        shutil.copy(next((train / "circle").glob("0*.jpg")), train / path)
    (train / "square" / "a-dir.jpg").mkdir()  # a folder with an image's name is no image
    (train / "square" / "a-dir.jpg" / "z.jpg").write_bytes((train / "square" / "UPPER.JPG").read_bytes())
    (train / "circle" / "linked").symlink_to(train / "ring" / "nested", target_is_directory=True)
    scan = scan_image_folder(folder)
    for split, index in (("train", scan.train), ("val", scan.val)):
        expected = torchvision.datasets.ImageFolder(folder / split)
        assert scan.classes == expected.classes
        assert [index[i] for i in range(len(index))] == expected.samples


def test_the_image_extensions_are_torchvision_s():
    assert IMG_EXTENSIONS == torchvision.datasets.folder.IMG_EXTENSIONS


def test_scan_image_folder_of_a_missing_dir_says_so(tmp_path):
    with pytest.raises(UsageError, match="no such directory"):
        scan_image_folder(tmp_path / "missing")


def test_scan_image_folder_of_a_file_says_it_is_one(tmp_path):
    (tmp_path / "train.tar").write_bytes(b"")
    with pytest.raises(UsageError, match=r"^--data \S+train\.tar: a file; give the folder that holds train/ and val/"):
        scan_image_folder(tmp_path / "train.tar")


def test_scan_image_folder_without_val_says_so(folder):
    shutil.rmtree(folder / "val")
    with pytest.raises(UsageError, match=r"has no val/ folder"):
        scan_image_folder(folder)


def test_scan_image_folder_with_an_empty_class_folder_names_it(folder):
    (folder / "train" / "zebra").mkdir()
    with pytest.raises(UsageError, match=r"zebra in .*train hold no images"):
        scan_image_folder(folder)


def test_scan_image_folder_with_no_class_folders_says_so(folder):
    shutil.rmtree(folder / "val")
    (folder / "val").mkdir()
    with pytest.raises(UsageError, match="has no class folders"):
        scan_image_folder(folder)


def test_scan_image_folder_with_different_classes_names_them(folder):
    (folder / "val" / "ring").rename(folder / "val" / "donut")
    with pytest.raises(UsageError, match=r"different classes \(only in train: ring; only in val: donut\)"):
        scan_image_folder(folder)


def test_a_class_named_in_two_unicode_forms_is_said_to_be_so(folder):
    """train/café typed on macOS (NFD: e and a combining accent) and val/café elsewhere (NFC): alike on screen, the
    line said only that each split has its own."""
    for split, form in (("train", "NFD"), ("val", "NFC")):
        (folder / split / "ring").rename(folder / split / unicodedata.normalize(form, "caf\u00e9"))
    with pytest.raises(UsageError, match="\\): caf\u00e9 in two Unicode forms \\(NFC and NFD\\): rename one$"):
        scan_image_folder(folder)


def test_a_long_command_in_an_unfinished_marker_is_cut_and_says_so(tmp_path):
    from common.errors import UsageError
    from common.folder_index import UNFINISHED, refuse_unfinished

    (tmp_path / UNFINISHED).write_text("python tools/make_shards.py " + "a" * 2000)
    with pytest.raises(UsageError, match=r"a{900}\.\.\. stopped part-way through writing it"):
        refuse_unfinished(tmp_path)

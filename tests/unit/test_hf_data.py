"""common/hf_data.py: a Hugging Face dataset on disk (save_to_disk's, or the Hub's parquet files) gives the items of the
image folder it was made from, in its order; parquet is read through datasets' arrow copy, made once; what the data
lacks, and the missing `datasets` package, each get one line; a row that cannot be decoded is named SPLIT[ROW]."""
import sys

import pytest
import torch

from common.datasets import HFImages, ImageFiles, UnreadableFile, build_datasets
from common.errors import UsageError
from common.hf_data import has_hf_dataset, load_splits, parquet_splits
from conftest import hf_copy, make_image_folder, parse

pytestmark = pytest.mark.usefixtures("no_platform_env")


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))  # datasets' arrow copies of parquet files
    return make_image_folder(tmp_path / "folder", train_per_class=3, val_per_class=2)


@pytest.mark.parametrize("form", ["disk", "parquet"])
def test_a_hugging_face_dataset_gives_the_items_of_the_folder_it_was_made_from(folder, tmp_path, form):
    copy = hf_copy(folder, tmp_path / form, form)
    assert has_hf_dataset(copy) and not has_hf_dataset(folder)
    classes, train, val = build_datasets(parse("--data", copy))
    reference_classes, *reference = build_datasets(parse("--data", folder))
    assert classes == reference_classes and isinstance(train, HFImages) and isinstance(train, ImageFiles)
    for ours, theirs in zip((train, val), reference):
        assert len(ours) == len(theirs) == (9 if ours is train else 6)
        for index in range(len(ours)):
            (image, label), (expected, expected_label) = ours[index], theirs[index]
            assert torch.equal(image, expected) and label == expected_label
    assert train.name(4) == f"{copy}/train[4]:{theirs_name(reference[0], 4)}"


def theirs_name(files, index):
    return files.name(index).rsplit("/", 1)[-1]


def test_parquet_is_read_through_the_arrow_copy_datasets_makes_once(folder, tmp_path):
    copy = hf_copy(folder, tmp_path / "hub", "parquet")
    assert parquet_splits(copy) == {split: [str(copy / "data" / f"{split}-00000-of-00001.parquet")]
                                    for split in ("train", "validation")}
    _, train, _ = load_splits(copy)
    arrow = [entry["filename"] for entry in train.rows.cache_files]
    assert arrow and all(name.startswith(str(tmp_path / "hf-cache")) and name.endswith(".arrow") for name in arrow)
    made = sorted(path.stat().st_mtime_ns for path in (tmp_path / "hf-cache").rglob("*.arrow"))
    load_splits(copy)  # a second run (or rank) finds the copy
    assert sorted(path.stat().st_mtime_ns for path in (tmp_path / "hf-cache").rglob("*.arrow")) == made


def test_a_row_that_cannot_be_decoded_is_unreadable_and_named_by_split_and_row(folder, tmp_path):
    broken = next((folder / "train" / "ring").iterdir())
    broken.write_bytes(broken.read_bytes()[:40])
    classes, train, _ = build_datasets(parse("--data", hf_copy(folder, tmp_path / "disk")))
    row = next(index for index in range(len(train))  # (each class's files have the same names)
               if train.name(index).endswith(broken.name) and train.samples.labels[index] == classes.index("ring"))
    with pytest.raises(UnreadableFile):
        train[row]
    assert train.name(row) == f"{tmp_path / 'disk'}/train[{row}]:{broken.name}"


def test_what_the_data_lacks_gets_one_line(folder, tmp_path):
    import datasets
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    image = {"bytes": next((folder / "train" / "ring").iterdir()).read_bytes(), "path": "x.jpg"}
    rows = datasets.Dataset.from_dict({"image": [image] * 3, "label": [0, 1, -1]}, features=features)
    datasets.DatasetDict({"train": rows.select([0, 1]), "test": rows}).save_to_disk(str(tmp_path / "no-val"))
    with pytest.raises(UsageError, match=r"needs a train and a validation split; it has train, test$"):
        load_splits(tmp_path / "no-val")
    datasets.DatasetDict({"train": rows, "validation": rows.select([0])}).save_to_disk(str(tmp_path / "unlabelled"))
    with pytest.raises(UsageError, match=r"unlabelled/train: row 2 has no label \(1 of 3 rows lack one"):
        load_splits(tmp_path / "unlabelled")
    plain = rows.select([0, 1]).rename_column("label", "category").cast_column("category", datasets.Value("int64"))
    datasets.DatasetDict({"train": plain, "validation": plain}).save_to_disk(str(tmp_path / "no-label"))
    with pytest.raises(UsageError, match=r"its train split has no label column \(columns: image, category\)"):
        load_splits(tmp_path / "no-label")


def test_splits_that_disagree_and_labels_that_are_no_classes_get_one_line(folder, tmp_path):
    """Each was a traceback, or worse, silent: a validation split whose ClassLabel names its classes in another order
    trained on with its labels read as train's classes (val loss 45.78 instead of 44.61)."""
    import datasets
    image = {"bytes": next((folder / "train" / "ring").iterdir()).read_bytes(), "path": "x.jpg"}

    def split(names=("a", "b"), image_column="image", labels=(0, 1)):
        label = datasets.ClassLabel(names=list(names)) if names else datasets.Value("string")
        return datasets.Dataset.from_dict({image_column: [image] * len(labels), "label": list(labels)},
                                          features=datasets.Features({image_column: datasets.Image(), "label": label}))
    cases = {
        "reordered": (split(), split(names=("b", "a")),
                      r"its validation split's class 0 is 'b', its train split's 'a' \(2 and 2 classes\): a label must "
                      r"name the same class in both$"),
        "more": (split(), split(names=("a", "b", "c"), labels=(0, 2)),
                 r"its validation split's class 2 is 'c', its train split's none \(3 and 2 classes\)"),
        "renamed": (split(), split(image_column="img"),
                    r"its validation split has no column 'image', which its train split has \(columns: img, label\)"),
        "strings": (split(names=None, labels=("a", "b")), split(names=None, labels=("a", "b")),
                    r"train: its label column 'label' holds string, not class indices: make it a ClassLabel"),
    }
    for name, (train, val, line) in cases.items():
        datasets.DatasetDict({"train": train, "validation": val}).save_to_disk(str(tmp_path / name))
        with pytest.raises(UsageError, match=line):
            load_splits(tmp_path / name)
    # A validation split of train's first classes, in their order: the same labels name the same classes.
    datasets.DatasetDict({"train": split(names=("a", "b", "c"), labels=(0, 2)), "validation": split()}).save_to_disk(
        str(tmp_path / "fewer"))
    assert load_splits(tmp_path / "fewer")[0] == ["a", "b", "c"]


def test_a_row_without_an_image_is_unreadable_and_named(folder, tmp_path):
    """A row whose image is None: skipped and named SPLIT[ROW] as any unreadable row (was an AttributeError)."""
    import datasets
    image = {"bytes": next((folder / "train" / "ring").iterdir()).read_bytes(), "path": "x.jpg"}
    rows = datasets.Dataset.from_dict({"image": [image, None], "label": [0, 1]}, features=datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}))
    datasets.DatasetDict({"train": rows, "validation": rows}).save_to_disk(str(tmp_path / "holes"))
    _, train, _ = build_datasets(parse("--data", tmp_path / "holes"))
    assert train[0][1] == 0
    with pytest.raises(UnreadableFile, match="^the row has no image$"):
        train[1]
    assert train.name(1) == f"{tmp_path / 'holes'}/train[1]"


def test_an_integer_label_column_gives_classes_by_number(folder, tmp_path):
    import datasets
    image = {"bytes": next((folder / "train" / "ring").iterdir()).read_bytes(), "path": "x.jpg"}
    rows = datasets.Dataset.from_dict({"image": [image] * 3, "label": [0, 2, 1]},
                                      features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}))
    datasets.DatasetDict({"train": rows, "validation": rows}).save_to_disk(str(tmp_path / "ints"))
    classes, train, _ = load_splits(tmp_path / "ints")
    assert classes == ["0", "1", "2"] and train.labels.tolist() == [0, 2, 1]


def test_without_the_datasets_package_one_line_names_the_file_to_install(folder, tmp_path, monkeypatch):
    copy = hf_copy(folder, tmp_path / "disk")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed: `import datasets` fails
    with pytest.raises(UsageError, match=r"is a Hugging Face dataset, which needs the datasets package: "
                                         r"pip install -r requirements-hf.txt$"):
        build_datasets(parse("--data", copy))

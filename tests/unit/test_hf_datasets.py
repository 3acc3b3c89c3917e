"""common/hf_datasets.py: a Hugging Face dataset on disk (save_to_disk's, or the Hub's parquet files) gives the items
of the image folder it was made from, in its order; parquet is read through datasets' arrow copy, made once; what the
data lacks (a split, a column, a numbered file), and the missing `datasets` package, each get one line; a row that
cannot be decoded is named SPLIT[ROW]."""

import re
import shutil
import sys

import pytest
import torch

from common.datasets import (
    HFImages,
    ImageFiles,
    build_datasets,
)
from common.errors import UnreadableFile, UsageError
from common.hf_datasets import first_missing_part, has_hf_dataset, load_splits, parquet_splits
from conftest import hf_copy, make_image_folder, parse

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables


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


def test_parquet_files_inside_an_image_folder_or_shards_make_no_hugging_face_dataset(folder, tmp_path):
    """A user's features kept beside the images (extras/train-features.parquet) were read as the dataset, and the
    folder ignored; the search walked every image of the folder."""
    hf_copy(folder, tmp_path / "features", "parquet")
    shutil.copytree(tmp_path / "features" / "data", folder / "extras")
    (folder / "train" / "ring" / "train-stats.parquet").write_bytes(b"not read")
    (folder / "train" / "train-stats.parquet").write_bytes(b"not read")  # beside the class folders (was: read)
    assert not has_hf_dataset(folder)
    classes, train, _ = build_datasets(parse("--data", folder))
    assert isinstance(train, ImageFiles) and not isinstance(train, HFImages) and len(train) == 9
    shards = tmp_path / "shards"
    (shards / "train").mkdir(parents=True)
    (shards / "train" / "train-000000.tar").write_bytes(b"")
    shutil.copytree(tmp_path / "features" / "data", shards / "extras")
    assert not has_hf_dataset(shards) and has_hf_dataset(tmp_path / "features")
    listed = tmp_path / "listed"  # train.csv and val.csv, and the user's parquet files beside them
    shutil.copytree(tmp_path / "features" / "data", listed / "extras")
    (listed / "train.csv").write_text("a.jpg,0\n")
    (listed / "val.csv").write_text("b.jpg,0\n")
    assert not has_hf_dataset(listed)
    hub = tmp_path / "hub"  # the Hub's train/*.parquet, with a hidden folder beside them (a notebook's checkpoints)
    for split in ("train", "validation"):
        shutil.copy(
            next((tmp_path / "features" / "data").glob(f"{split}-*")),
            (hub / split).mkdir(parents=True) or hub / split / "0000.parquet",
        )
    (hub / "train" / ".ipynb_checkpoints").mkdir()
    assert has_hf_dataset(hub) and len(build_datasets(parse("--data", hub))[1]) == 9


def test_a_damaged_hugging_face_dataset_is_one_line(folder, tmp_path, capfd):
    disk = hf_copy(folder, tmp_path / "disk")
    arrow = next((disk / "train").glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:200])
    with pytest.raises(UsageError, match=rf"^--data {re.escape(str(disk))}: the Hugging Face dataset cannot be loaded"):
        load_splits(disk)
    (disk / "dataset_dict.json").write_text("{not json")
    with pytest.raises(UsageError, match=r"the Hugging Face dataset cannot be loaded \(.+\)$"):
        load_splits(disk)
    hub = hf_copy(folder, tmp_path / "hub", "parquet")
    # Its train split in 2 files, the second not there (a download cut short; was: trained on half, without a word)
    (hub / "data" / "train-00000-of-00001.parquet").rename(hub / "data" / "train-00000-of-00002.parquet")
    assert has_hf_dataset(hub)  # (found when the splits load, on every rank: not in the detection, by one rank alone)
    with pytest.raises(UsageError, match=r"^--data \S+: data/train-00001-of-00002.parquet is missing \(a download cut"):
        load_splits(hub)
    # The first gap of the numbered files of the splits read (parquet_splits': train and validation), older names'
    # fingerprints too
    assert first_missing_part("/d", {"train": ["/d/data/train-00001-of-00003-a1b2c3.parquet"]}) == (
        "data/train-00000-of-00003"
    )
    assert first_missing_part("/d", {"train": [f"/d/t-{i:05d}-of-00002-{i}f.parquet" for i in (0, 1)]}) is None
    (hub / "data" / "train-00000-of-00002.parquet").write_bytes(b"garbage")
    (hub / "data" / "train-00000-of-00002.parquet").rename(hub / "data" / "train-00000-of-00001.parquet")
    capfd.readouterr()
    with pytest.raises(UsageError, match=r"the Hugging Face dataset cannot be loaded \(.+\)$"):
        load_splits(hub)
    assert capfd.readouterr().err == ""  # (datasets' own log of it was a second line)


def theirs_name(files, index):
    return files.name(index).rsplit("/", 1)[-1]


def test_parquet_is_read_through_the_arrow_copy_datasets_makes_once(folder, tmp_path):
    copy = hf_copy(folder, tmp_path / "hub", "parquet")
    assert parquet_splits(copy) == {
        split: [str(copy / "data" / f"{split}-00000-of-00001.parquet")] for split in ("train", "validation")
    }
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
    row = next(
        index
        for index in range(len(train))  # (each class's files have the same names)
        if train.name(index).endswith(broken.name) and train.samples.labels[index] == classes.index("ring")
    )
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
    integers = rows.select([0, 1]).cast_column("label", datasets.Value("int64"))
    wider = datasets.Dataset.from_dict({"image": [image] * 2, "label": [1, 4]}, features=integers.features)
    datasets.DatasetDict({"train": integers, "validation": wider}).save_to_disk(str(tmp_path / "unseen"))
    with pytest.raises(UsageError, match=r"its validation split has labels 4 that its train split never has"):
        load_splits(tmp_path / "unseen")  # (it was trained on: 5 classes, class 4 never seen)
    datasets.DatasetDict({"train": integers, "validation": integers.select([1])}).save_to_disk(str(tmp_path / "ints"))
    assert load_splits(tmp_path / "ints")[0] == ["0", "1"]


def test_splits_that_disagree_and_labels_that_are_no_classes_get_one_line(folder, tmp_path):
    """Each was a traceback, or worse, silent: a validation split whose ClassLabel names its classes in another order
    trained on with its labels read as train's classes (val loss 45.78 instead of 44.61)."""
    import datasets

    image = {"bytes": next((folder / "train" / "ring").iterdir()).read_bytes(), "path": "x.jpg"}

    def split(names=("a", "b"), image_column="image", labels=(0, 1)):
        label = datasets.ClassLabel(names=list(names)) if names else datasets.Value("string")
        return datasets.Dataset.from_dict(
            {image_column: [image] * len(labels), "label": list(labels)},
            features=datasets.Features({image_column: datasets.Image(), "label": label}),
        )

    cases = {
        "reordered": (
            split(),
            split(names=("b", "a")),
            r"its validation split's class 0 is 'b', its train split's 'a' \(2 and 2 classes\): a label must "
            r"name the same class in both$",
        ),
        "more": (
            split(),
            split(names=("a", "b", "c"), labels=(0, 2)),
            r"its validation split's class 2 is 'c', its train split's none \(3 and 2 classes\)",
        ),
        "renamed": (
            split(),
            split(image_column="img"),
            r"its validation split has no column 'image', which its train split has \(columns: img, label\)",
        ),
        "strings": (
            split(names=None, labels=("a", "b")),
            split(names=None, labels=("a", "b")),
            r"train: its label column 'label' holds string, not class indices: make it a ClassLabel",
        ),
    }
    for name, (train, val, line) in cases.items():
        datasets.DatasetDict({"train": train, "validation": val}).save_to_disk(str(tmp_path / name))
        with pytest.raises(UsageError, match=line):
            load_splits(tmp_path / name)
    # A validation split of train's first classes, in their order: the same labels name the same classes.
    datasets.DatasetDict({"train": split(names=("a", "b", "c"), labels=(0, 2)), "validation": split()}).save_to_disk(
        str(tmp_path / "fewer")
    )
    assert load_splits(tmp_path / "fewer")[0] == ["a", "b", "c"]


def test_integer_labels_beyond_the_classes_or_missing_and_a_saved_format_are_taken_right(folder, tmp_path):
    """Validation labels of integers beside train's ClassLabel, past its classes: an IndexError in validation's loss
    (was); a null label: refused as a missing one (numpy made it NaN, then INT64_MIN here, 0 on ARM: class 0); a
    dataset saved with set_format (pandas, arrow, a torch format of other columns) read as dicts (was: a traceback
    in every loader worker)."""
    import datasets

    image = {"bytes": next((folder / "train" / "ring").iterdir()).read_bytes(), "path": "x.jpg"}

    def split(labels, label=datasets.Value("int64")):
        return datasets.Dataset.from_dict(
            {"image": [image] * len(labels), "label": list(labels)},
            features=datasets.Features({"image": datasets.Image(), "label": label}),
        )

    two = datasets.ClassLabel(names=["a", "b"])
    datasets.DatasetDict({"train": split((0, 1), two), "validation": split((0, 2))}).save_to_disk(tmp_path / "past")
    with pytest.raises(UsageError, match=r"validation split has labels 2, and its train split's ClassLabel 2 classes"):
        load_splits(tmp_path / "past")
    datasets.DatasetDict({"train": split((0, None, 1)), "validation": split((0, 1))}).save_to_disk(tmp_path / "null")
    with pytest.raises(UsageError, match=r"train: row 1 has no label \(1 of 3 rows lack one"):
        load_splits(tmp_path / "null")
    for name, form in {"pandas": {}, "arrow": {}, "torch": {"columns": ["label"]}}.items():
        saved = datasets.DatasetDict({"train": split((0, 1), two), "validation": split((1, 0), two)})
        saved.set_format(name, **form)
        saved.save_to_disk(tmp_path / name)
        classes, train, val = load_splits(tmp_path / name)
        assert classes == ["a", "b"] and val.labels.tolist() == [1, 0]
        assert val.encoded(1) == (image["bytes"], "jpg") and val.name(1).endswith("validation[1]:x.jpg")


def test_the_columns_named_image_and_label_are_trained_on_and_several_unnamed_are_refused(folder, tmp_path):
    """A ClassLabel before the label column (a domain, say) was trained on as the classes, exit 0: the column named
    label is; where none is named and two could be, one line (as two image columns)."""
    import datasets

    image = {"bytes": next((folder / "train" / "ring").iterdir()).read_bytes(), "path": "x.jpg"}
    kinds = {"picture": datasets.Image(), "domain": datasets.ClassLabel(names=["photo", "sketch"])}

    def saved(name, **columns):
        features = datasets.Features({column: kind or kinds[column] for column, kind in columns.items()})
        rows = {
            column: [image] * 3 if type(kind).__name__ == "Image" else [0, 1, 0] for column, kind in features.items()
        }
        split = datasets.Dataset.from_dict(rows, features=features)
        datasets.DatasetDict({"train": split, "validation": split}).save_to_disk(str(tmp_path / name))
        return tmp_path / name

    three = datasets.ClassLabel(names=["a", "b", "c"])
    found = load_splits(saved("domain first", picture=None, domain=None, image=datasets.Image(), label=three))
    assert found[0] == ["a", "b", "c"] and found[1].image == "image"
    assert load_splits(saved("ints", image=datasets.Image(), domain=None, cls=datasets.Value("int64")))[0] == ["0", "1"]
    cifar100 = saved(
        "cifar100", img=datasets.Image(), fine_label=three, coarse_label=datasets.ClassLabel(names=["x", "y"])
    )
    assert load_splits(cifar100)[0] == ["a", "b", "c"]  # (its columns, as the Hub's uoft-cs/cifar100 has them)
    with pytest.raises(UsageError, match=r"train split has 2 ClassLabel columns \(domain, kind\) and none named label"):
        load_splits(saved("two labels", image=datasets.Image(), domain=None, kind=three))
    with pytest.raises(UsageError, match=r"train split has 2 Image columns \(picture, photo\) and none named image"):
        load_splits(saved("two images", picture=None, photo=datasets.Image(), label=three))


def test_a_row_without_an_image_is_unreadable_and_named(folder, tmp_path):
    """A row whose image is None: skipped and named SPLIT[ROW] as any unreadable row (was an AttributeError)."""
    import datasets

    image = {"bytes": next((folder / "train" / "ring").iterdir()).read_bytes(), "path": "x.jpg"}
    rows = datasets.Dataset.from_dict(
        {"image": [image, None], "label": [0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}),
    )
    datasets.DatasetDict({"train": rows, "validation": rows}).save_to_disk(str(tmp_path / "holes"))
    _, train, _ = build_datasets(parse("--data", tmp_path / "holes"))
    assert train[0][1] == 0
    with pytest.raises(UnreadableFile, match="^the row has no image$"):
        train[1]
    assert train.name(1) == f"{tmp_path / 'holes'}/train[1]"


def test_a_row_damaged_under_the_run_is_named_by_its_place(folder, tmp_path, monkeypatch):
    """A save_to_disk dataset rewritten in place while a run reads it: its rows read from the memory map raise what
    pyarrow raises there (SystemError, UnicodeDecodeError), and so did the name of the row skipped (a traceback)."""

    class Rewritten:
        def __getitem__(self, index):
            raise SystemError("Negative size passed to PyBytes_FromStringAndSize")

    _, train, _ = build_datasets(parse("--data", hf_copy(folder, tmp_path / "disk")))
    monkeypatch.setattr(train.samples, "rows", Rewritten())
    with pytest.raises(UnreadableFile, match="^Negative size"):  # (skipped and named, as any unreadable row)
        train[1]
    assert train.name(1) == f"{tmp_path / 'disk'}/train[1]"


def test_a_row_of_empty_bytes_is_an_empty_image_never_a_file_of_the_working_directory(folder, tmp_path, monkeypatch):
    """Empty bytes were taken as none: the row's relative path was read from the working directory, and a file of
    that name there trained and was validated as the row (exit 0, no word)."""
    import datasets

    whole = next((folder / "train" / "ring").iterdir()).read_bytes()
    rows = datasets.Dataset.from_dict(
        {"image": [{"bytes": whole, "path": "a.jpg"}, {"bytes": b"", "path": "empty.jpg"}], "label": [0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])}),
    )
    datasets.DatasetDict({"train": rows, "validation": rows}).save_to_disk(str(tmp_path / "empty"))
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "empty.jpg").write_bytes(whole)
    monkeypatch.chdir(tmp_path / "here")
    _, train, _ = build_datasets(parse("--data", tmp_path / "empty"))
    assert train[0][1] == 0
    with pytest.raises(UnreadableFile, match="^cannot identify image file"):
        train[1]


def test_an_integer_label_column_gives_classes_by_number(folder, tmp_path):
    import datasets

    image = {"bytes": next((folder / "train" / "ring").iterdir()).read_bytes(), "path": "x.jpg"}
    rows = datasets.Dataset.from_dict(
        {"image": [image] * 3, "label": [0, 2, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    )
    datasets.DatasetDict({"train": rows, "validation": rows}).save_to_disk(str(tmp_path / "ints"))
    classes, train, _ = load_splits(tmp_path / "ints")
    assert classes == ["0", "1", "2"] and train.labels.tolist() == [0, 2, 1]


def test_without_the_datasets_package_one_line_names_the_file_to_install(folder, tmp_path, monkeypatch):
    copy = hf_copy(folder, tmp_path / "disk")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed: `import datasets` fails
    with pytest.raises(
        UsageError,
        match=r"is a Hugging Face dataset, which needs the datasets package: "
        r"pip install -r requirements-hf.txt$",
    ):
        build_datasets(parse("--data", copy))

"""common/bad_images.py: a file that cannot be decoded is skipped (training: the next one takes its place; validation:
left out) and named, or ends the run in one line with --strict-data; a dataset's own bug is never skipped; the
ranks' lists pool at each save; a validation that reads too little ends the run."""
import io
import re

import pytest
import torch
from PIL import Image

from common.bad_images import BadImageLog, SkipUnreadable, printable
from common.datasets import ImageFiles, load_image
from common.device_loader import Collate
from common.errors import UnreadableImage, UsageError
from common.preemption import StopNow
from common.transforms import Normalise
from conftest import make_image_folder


def image_bytes(mode="RGB", fmt="JPEG", size=(40, 40), color=(200, 30, 30)):
    buffer = io.BytesIO()
    Image.new(mode, size, {"L": 128, "I;16": 40000}.get(mode, color[: len(mode)])).save(buffer, fmt)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A readable JPEG, a truncated one, an empty .jpg; and valid files in odd forms: CMYK and grayscale JPEG, PNG
    content under a .jpg name, RGBA PNG, 16-bit grayscale PNG."""
    root = make_image_folder(tmp_path_factory.mktemp("faulty"), train_per_class=1, val_per_class=1, num_classes=1)
    whole = next((root / "train" / "circle").iterdir())
    bad = {root / "truncated.jpg": whole.read_bytes()[: whole.stat().st_size // 3], root / "empty.jpg": b""}
    odd = {root / "cmyk.jpg": image_bytes("CMYK", color=(0, 200, 200, 0)), root / "gray.jpg": image_bytes("L"),
           root / "png-inside.jpg": image_bytes(fmt="PNG"), root / "rgba.png": image_bytes("RGBA", fmt="PNG"),
           root / "gray16.png": image_bytes("I;16", fmt="PNG")}
    for path, content in {**bad, **odd}.items():
        path.write_bytes(content)
    return str(whole), sorted(map(str, bad)), sorted(map(str, odd))


def test_odd_but_valid_files_load_as_rgb(files):
    for path in files[2]:
        image = load_image(path)
        assert image.dtype == torch.uint8 and image.shape == (3, 40, 40), path


def test_a_bad_file_is_replaced_and_the_batch_keeps_its_size_in_training_and_left_out_in_validation(files):
    good, bad, _ = files
    samples = ImageFiles([(bad[0], 0), (good, 1), (bad[1], 2)])
    train = SkipUnreadable(samples, replace=True, strict=False)
    images, target, found = Collate()([train[0], train[1], train[2]])
    assert images.shape[0] == 3 and target.tolist() == [1, 1, 1]  # the readable file took both places
    assert sorted({path for path, _ in found}) == bad
    val = SkipUnreadable(samples, replace=False, strict=False)
    images, target, found = Collate(Normalise())([val[0], val[1], val[2]])
    assert images.shape[0] == 1 and images.dtype == torch.float32 and target.tolist() == [1]
    assert Collate(Normalise())([val[0]])[:2] == (None, None)
    with pytest.raises(UnreadableImage, match=rf"^cannot decode {re.escape(bad[0])} \(.+\); without --strict-data such "
                                              r"files are skipped and listed in bad_images.txt$"):
        SkipUnreadable(samples, replace=True, strict=True)[0]


class Failing:
    """A dataset whose items raise `error`."""

    def __init__(self, error):
        self.error = error

    def __len__(self):
        return 60

    def __getitem__(self, index):
        raise self.error


def test_a_dataset_s_own_bug_and_a_stop_are_raised_not_skipped():
    for error in (TypeError("a bug of the dataset"), AttributeError("another"), StopNow("stopped on SIGTERM")):
        with pytest.raises(type(error)):
            SkipUnreadable(Failing(error), replace=True, strict=False)[0]


def test_a_data_set_that_reads_nothing_ends_the_run_after_fifty_in_a_row():
    with pytest.raises(UnreadableImage, match=r"^50 files in a row cannot be decoded, from Failing\[3\] on \(gone\): is "
                                              r"the data set readable\?$"):
        SkipUnreadable(Failing(OSError("gone")), replace=True, strict=False)[3]


def test_the_ranks_lists_pool_at_each_sync_and_each_epoch_starts_afresh(capsys):
    log = BadImageLog(rank=1, world_size=2)
    log.report([("a.jpg", "truncated"), ("a.jpg", "truncated")])
    assert capsys.readouterr().out == "warning: rank 1: skipped a.jpg: cannot decode it (truncated)\n"  # once
    assert log.state_dict() == [["a.jpg", "truncated"]]
    resumed = BadImageLog(rank=0, world_size=1)
    resumed.load_state_dict([["a.jpg", "truncated"]])
    resumed.report([("a.jpg", "truncated")])
    assert capsys.readouterr().out == ""  # said before the stop
    resumed.next_epoch()
    assert resumed.state_dict() == []


def test_a_share_of_unreadable_validation_images_over_the_limit_is_refused():
    log = BadImageLog(0, 1)
    log.check_validation(12, 13)  # one broken file of 13: skipped
    with pytest.raises(UsageError, match=r"could not read 2 of its 13 images, more than 10%"):
        log.check_validation(11, 13)
    with pytest.raises(UsageError, match=r"could not read 1 of its 1 images"):
        log.check_validation(0, 1)


def test_the_example_of_a_refused_validation_is_one_of_validation_s_files(capsys):
    """The epoch's training skipped a file first: the example is validation's (it named a train sample)."""
    log = BadImageLog(0, 1)
    log.report([("train-000002.tar:n01/a", "truncated")])
    log.report_validation([("val-000000.tar:n01/b", "broken data stream")])
    with pytest.raises(UsageError, match=r"could not read 2 of its 3 images \(e\.g\. val-000000\.tar:n01/b: broken data "
                                         r"stream\), more than 10%"):
        log.check_validation(1, 3)
    assert log.state_dict() == [["train-000002.tar:n01/a", "truncated"], ["val-000000.tar:n01/b", "broken data stream"]]
    log.next_epoch()
    with pytest.raises(UsageError, match=r"could not read 2 of its 3 images, more than"):  # none of this epoch's
        log.check_validation(1, 3)


def test_a_file_name_that_is_not_utf8_is_printed_with_its_bytes_escaped():
    assert printable(b"broken-\xff.jpg".decode("utf-8", "surrogateescape")) == "broken-\\xff.jpg"


def test_the_reason_says_no_file_object_of_pil_s():
    """PIL names the object it read: a file's name is in the warning already, a BytesIO's address means nothing."""
    import io
    from PIL import Image, UnidentifiedImageError
    from common.bad_images import describe
    with pytest.raises(UnidentifiedImageError) as error:
        Image.open(io.BytesIO(b"not an image"))
    assert "BytesIO object at 0x" in str(error.value) and describe(error.value) == "cannot identify image file"
    assert describe(OSError("cannot identify image file <_io.BufferedReader name='/d/a.jpg'>")) == "cannot identify image file"

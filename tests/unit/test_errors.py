"""common/errors.py: the errors that end a run in one line; a console line is written whole, in one write, then
flushed; `package.module:name` names code of your own on the command line (--arch, --dataset, --trainer)."""

import pytest

from common.errors import BadItem, UsageError, import_named, say


def test_an_error_raised_in_a_loader_worker_still_reads_as_its_one_line():
    """A DataLoader worker's error arrives as "Caught BadItem in DataLoader worker process 0. Original Traceback ...":
    the line is the last one, without its class name."""
    text = (
        "Caught BadItem in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n  ...\n"
        "common.errors.BadItem: item 5 of the train set is a tuple of 3"
    )
    assert str(BadItem(text)) == "item 5 of the train set is a tuple of 3"
    assert isinstance(BadItem("x"), UsageError) and BadItem.exit_code == 2


def test_a_console_line_is_written_whole_in_one_write():
    """print() writes a line's text and its newline separately: another process's output between the two
    (a rank's warning, a library's report) would glue itself onto our line."""
    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)

        def flush(self):
            writes.append("<flush>")

    say("done: best acc@1 99.00", file=Stream())
    say("error: rank 1: two\nlines", file=Stream())
    assert writes == ["done: best acc@1 99.00\n", "<flush>", "error: rank 1: two\nlines\n", "<flush>"]


def test_a_name_with_a_colon_is_imported_and_one_without_is_a_built_in_name():
    from tests.tiny_models import TinyNet

    assert import_named("tests.tiny_models:TinyNet", "--arch") is TinyNet
    assert import_named("resnet18", "--arch") is None
    with pytest.raises(UsageError, match=r"^--dataset tests.nowhere:build: cannot import build from tests.nowhere \("):
        import_named("tests.nowhere:build", "--dataset")
    with pytest.raises(UsageError, match="cannot import Missing from tests.tiny_models"):
        import_named("tests.tiny_models:Missing", "--arch")

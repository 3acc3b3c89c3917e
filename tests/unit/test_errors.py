"""common/errors.py: the errors that end a run in one line; a console line is written whole, in one write, then
flushed; `package.module:name` names code of your own on the command line (--arch, --dataset, --trainer)."""

import io
import os
import sys

import pytest

from common.errors import (
    BadItem,
    UsageError,
    _Console,
    check_call,
    console_never_fails,
    import_named,
    lost_output,
    say,
)


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


def test_a_console_whose_reader_is_gone_takes_every_write_and_then_writes_to_dev_null(capsys):
    """A pipe whose reader closed (`| head -1`): the first failed write puts /dev/null under the stream, and what it
    buffered goes there too (Python's exit flushes it: no error then either). Quietly: the reader wanted no more."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    stream = open(write_end, "w")
    console = _Console(stream, "stdout")
    try:
        say("a line", file=console)
        say("another", file=console)
        console.write("x" * 100_000)
        stream.flush()
        assert os.path.samestat(os.fstat(write_end), os.stat(os.devnull))
        assert console.fileno() == write_end and console.encoding == stream.encoding  # (the rest is the stream's)
    finally:
        stream.close()
    console.write("after the stream closed\n")  # (ValueError: taken as well)
    console.flush()
    assert lost_output(console) is None and capsys.readouterr().err == ""


def test_a_console_on_a_full_device_goes_on_and_says_so_on_stderr(capsys):
    """stdout to a full disk (`> run.log` there): the run goes on, and says on stderr that its console is lost; a
    tool, whose output is its product, then ends with exit code 1 (tools/shared.py run_tool)."""
    with open("/dev/full", "w") as full:
        console = _Console(full, "stdout")
        say("a table", file=console)
        say("more", file=console)
    assert lost_output(console) == "No space left on device"
    assert capsys.readouterr().err == "warning: cannot write to stdout (No space left on device): going on without it\n"


def test_text_the_console_s_encoding_lacks_is_written_with_backslashes(monkeypatch):
    """A --data folder whose name is not UTF-8, printed to a console of strict UTF-8 (a UTF-8 locale but C.UTF-8,
    PYTHONIOENCODING=utf-8): its UnicodeEncodeError, a ValueError, was taken for a closed file and the console was
    lost without a word, exit code 0."""
    written = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(written, encoding="utf-8", errors="strict"))
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    console_never_fails()
    print("data: /d/lat\udce9n", flush=True)
    assert written.getvalue() == b"data: /d/lat\\udce9n\n" and lost_output() is None
    unencodable = _Console(io.TextIOWrapper(io.BytesIO(), encoding="ascii", errors="strict"), "stdout", warn=False)
    unencodable.write("caf\u00e9")  # (a stream that cannot be told to: its loss is no reader's leaving)
    assert (
        lost_output(unencodable)
        == "'ascii' codec can't encode character '\\xe9' in position 3: ordinal not in range(128)"
    )


def test_a_name_with_a_colon_is_imported_and_one_without_is_a_built_in_name():
    from tests.tiny_models import TinyNet

    assert import_named("tests.tiny_models:TinyNet", "--arch") is TinyNet
    assert import_named("resnet18", "--arch") is None
    with pytest.raises(UsageError, match=r"^--dataset tests.nowhere:build: cannot import build from tests.nowhere \("):
        import_named("tests.nowhere:build", "--dataset")
    with pytest.raises(UsageError, match="cannot import Missing from tests.tiny_models"):
        import_named("tests.tiny_models:Missing", "--arch")
    for text in [":TinyNet", "tests.tiny_models:", "tests.tiny_models::"]:  # (once a traceback, or a blank name)
        with pytest.raises(UsageError, match=rf"^--arch {text}: expected package.module:name$"):
            import_named(text, "--arch")
    with pytest.raises(UsageError, match=r"^--arch \.\.foo:bar: cannot import bar from \.\.foo \("):
        import_named("..foo:bar", "--arch")
    with pytest.raises(UsageError, match=r"^--trainer Trainr: expected package.module:name$"):  # (was ignored)
        import_named("Trainr", "--trainer", builtin=False)


def test_what_a_flag_names_must_take_the_arguments_it_will_be_called_with():
    """--arch's builder(num_classes=K), --dataset's FN(args): a value of another kind, or a function of another
    signature, is refused in one line before it is called (it was a TypeError from inside the call)."""
    import math
    import os

    from tests.tiny_models import TinyNet

    check_call(TinyNet, "--arch", "t:TinyNet", "builder(num_classes=K)", num_classes=3)
    with pytest.raises(UsageError, match=r"^--arch math:pi is a float: expected builder\(num_classes=K\)$"):
        check_call(math.pi, "--arch", "math:pi", "builder(num_classes=K)", num_classes=3)
    with pytest.raises(UsageError, match=r"^--arch os:getcwd cannot be called as builder\(num_classes=K\): got an "):
        check_call(os.getcwd, "--arch", "os:getcwd", "builder(num_classes=K)", num_classes=3)

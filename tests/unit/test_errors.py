"""common/errors.py: the errors that end a run in one line, and the stop before training starts; a console line is
written whole, in one write, then flushed; `package.module:name` names code of your own on the command line (--arch,
--dataset, --trainer)."""

import contextlib
import os
import signal

import pytest

from common.errors import BadItem, Preempted, UsageError, import_named, say, stop_at_once_until_training


def test_an_error_raised_in_a_loader_worker_still_reads_as_its_one_line():
    """A DataLoader worker's error arrives as "Caught BadItem in DataLoader worker process 0. Original Traceback ...":
    the line is the last one, without its class name."""
    text = (
        "Caught BadItem in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n  ...\n"
        "common.errors.BadItem: item 5 of the train set is a tuple of 3"
    )
    assert str(BadItem(text)) == "item 5 of the train set is a tuple of 3"
    assert isinstance(BadItem("x"), UsageError) and BadItem.exit_code == 2


def test_a_stop_signal_before_training_ends_the_process_at_once_with_preempted():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        stop_at_once_until_training()
        with pytest.raises(Preempted, match="stopped on SIGTERM before training started: nothing was trained"):
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


LAUNCHED = """import os, signal, sys, time
sys.path.insert(0, {repo!r})
from common.errors import end_with_launcher
launcher = os.getppid()
signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM, launcher gone:", os.getppid() != launcher, flush=True),
                                          sys.exit(0)))
end_with_launcher()
print("ready", os.getpid(), flush=True)
time.sleep(30)
"""

LAUNCHER = """import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)  # a session of its own, as torchrun's
time.sleep(60)
"""


def test_a_process_that_a_launcher_started_gets_sigterm_when_the_launcher_is_sigkilled(tmp_path):
    """end_with_launcher in the worker of a stand-in launcher that starts it as torchrun does (a session of its own):
    SIGKILL to the launcher alone, and the worker gets SIGTERM from the kernel, as if the launcher had sent it."""
    import subprocess
    import time

    from harness.processes import PYTHON, REPO

    output, worker = tmp_path / "worker.out", None
    with open(output, "w") as out:
        launcher = subprocess.Popen([PYTHON, "-c", LAUNCHER, LAUNCHED.format(repo=str(REPO))], stdout=out)
    try:
        deadline = time.monotonic() + 30
        while not output.read_text().endswith("\n") and time.monotonic() < deadline:
            time.sleep(0.05)
        ready, worker = output.read_text().split()
        assert ready == "ready"
        launcher.kill()
        launcher.wait()
        while output.read_text().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert output.read_text().splitlines()[1:] == ["SIGTERM, launcher gone: True"]
    finally:
        launcher.kill()
        launcher.wait()
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(worker), signal.SIGKILL)


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

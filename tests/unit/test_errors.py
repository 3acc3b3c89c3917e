"""common/errors.py: the errors that end a run in one line, and the stop before training starts."""
import contextlib
import os
import signal

import pytest

from common.errors import BadItem, Preempted, UsageError, stop_at_once_until_training


def test_an_error_raised_in_a_loader_worker_still_reads_as_its_one_line():
    """A DataLoader worker's error arrives as "Caught BadItem in DataLoader worker process 0. Original Traceback ...":
    the line is the last one, without its class name."""
    text = "Caught BadItem in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n  ...\n" \
           "common.errors.BadItem: item 5 of the train set is a tuple of 3"
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

    from conftest import PYTHON, REPO
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

"""common/errors.py: the errors that end a run in one line, and the stop before training starts."""
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

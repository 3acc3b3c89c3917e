"""common/preemption.py: a stop signal is a flag the ranks agree on at a step; a second one a few seconds later, or a
wait for data longer than its share of the grace, stops at once; the handlers are put back when the run ends."""

import os
import signal
import time

import pytest

from common import preemption
from common.preemption import StopNow, StopSignal, waiting_for_data


def test_a_stop_that_never_comes_installs_nothing():
    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignal(30, listen=False)
    assert signal.getsignal(signal.SIGTERM) is before and stop.group is None
    assert not stop.poll() and not stop.poll(now=True)
    with stop.no_stop_now():
        assert stop.saving


def test_a_stop_signal_is_a_flag_read_at_a_step_and_the_handlers_are_put_back(monkeypatch):
    monkeypatch.setattr(preemption, "SECOND_SIGNAL_AFTER", 0.2)
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopSignal(30)
    try:
        assert not stop.poll()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.poll() and stop.received == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)  # the same request again (Slurm and torchrun both pass one on): no more
        time.sleep(0.3)
        with pytest.raises(StopNow, match="stopped at once on a second SIGTERM: no checkpoint of this step"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_wait_for_data_longer_than_its_share_of_the_grace_stops_at_once():
    stop = StopSignal(stop_grace=0.3)  # a third of it: 0.1 s
    try:
        with pytest.raises(StopNow, match=r"stopped on SIGUSR1 after waiting 0\.1 s for data"):
            with waiting_for_data():
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(5)  # the alarm checks every second
    finally:
        stop.close()


def test_the_sigterm_of_a_launcher_that_ended_is_named_so_and_never_stops_at_once(monkeypatch):
    """The kernel's SIGTERM when the launcher ends (common/launch.py end_with_launcher) comes on top of the stop the
    launcher may have passed on already: it is no second request, so the stop still waits for its step and its
    checkpoint. The first signal tells on_first (the output lock's mark)."""
    from common import launch

    monkeypatch.setattr(preemption, "SECOND_SIGNAL_AFTER", 0.2)
    stop, told = StopSignal(30), []
    stop.on_first = told.append
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # passed on by the launcher, which then dies
        monkeypatch.setattr(launch, "_launcher", os.getppid() + 1)  # (not this process's parent any more)
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGTERM)  # the kernel's: no StopNow
        time.sleep(0.1)
        assert stop.poll() and stop.received == "SIGTERM" and told == ["SIGTERM"]
    finally:
        stop.close()
    stop = StopSignal(30)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == "SIGTERM (its launcher ended)"
    finally:
        stop.close()

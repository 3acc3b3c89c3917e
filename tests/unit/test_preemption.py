"""common/preemption.py: a stop signal is a flag the ranks agree on at a step; a second one a few seconds later, or a
wait for data longer than its share of the grace, stops at once; the handlers are put back when the run ends."""

import os
import signal
import time

import pytest
import torch
from torch.utils.data import Dataset

from common import preemption
from common.launch import STOP_SIGNALS
from common.preemption import StopNow, StopSignal, waiting_for_data
from harness.jobs import Job
from harness.processes import PYTHON, clean_env


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


class SignalMasks(Dataset):
    """One item: the stop signals a loader worker held back when born (at its worker_init_fn) and after
    ignore_stop_signals, and how it handles them then."""

    def __len__(self):
        return 1

    def __getitem__(self, index):
        return torch.tensor([[int(signum) in BORN_BLOCKED, int(signum) in LATER_BLOCKED] for signum in STOP_SIGNALS])


BORN_BLOCKED, LATER_BLOCKED = set(), set()


def record_masks(worker_id):
    BORN_BLOCKED.update(int(signum) for signum in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    preemption.ignore_stop_signals(worker_id)
    LATER_BLOCKED.update(int(signum) for signum in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    assert all(signal.getsignal(signum) is signal.SIG_IGN for signum in STOP_SIGNALS)


def test_loader_workers_are_born_with_the_stop_signals_held_and_the_process_keeps_its_sigchld_handler(monkeypatch):
    """A SIGTERM to the process group in a worker's first milliseconds (before it ignores it) killed it: the run ended
    in exit 1, no checkpoint. And torch's SIGCHLD handler raised for a dead worker wherever the training process was,
    once inside a queue's lock: the loader's shutdown then waited for it forever."""
    from torch.utils.data._utils import signal_handling

    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    for own, after in [(signal.SIG_DFL, signal.SIG_DFL), (signal.SIG_IGN, signal.SIG_DFL), (print, print)]:
        # (ignored, a dead worker was reaped at once, never found: the run waited forever, or a traceback)
        monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", False)  # (torch sets its own once a process)
        previous = signal.signal(signal.SIGCHLD, own)
        try:
            for _ in range(2):
                loader = preemption.SafeLoader(
                    SignalMasks(), num_workers=1, worker_init_fn=record_masks, multiprocessing_context="fork"
                )
                assert next(iter(loader)).tolist() == [[[True, False]] * len(STOP_SIGNALS)]
                assert (signal.getsignal(signal.SIGCHLD), signal.pthread_sigmask(signal.SIG_BLOCK, [])) == (after, mask)
        finally:
            signal.signal(signal.SIGCHLD, previous)


STUCK_AT_FORK = """
import os, sys, time
from common import preemption
preemption.WORKER_START_WAIT = 3
armed, block = [True], [False]
def before():
    block[0] = bool(armed) and armed.pop()
os.register_at_fork(before=before, after_in_child=lambda: block[0] and time.sleep(3600))  # the first fork's child
loader = preemption.SafeLoader(
    list(range(10)), batch_size=2, num_workers=2, worker_init_fn=preemption.ignore_stop_signals,
    multiprocessing_context="fork",
)
for _ in range(2):
    print([batch.tolist() for batch in loader], flush=True)
"""


def test_a_loader_worker_stuck_as_it_was_forked_is_killed_and_the_workers_started_again():
    """Python before 3.11.10 (CPython gh-112275) can leave a forked worker stuck before it runs any code, where another
    thread made a thread state as it forked (a gloo thread taking the GIL): a multi-process run hung without end at an
    epoch's start. Here the first fork's child blocks as that one did; the loader starts its workers again, once."""
    job = Job([PYTHON, "-c", STUCK_AT_FORK], prewarmed=False)  # (killed with its processes, a worker asleep)
    code, output = job.finish(timeout=120)
    batches = "[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]"
    warning = (
        "warning: 1 loader worker(s) hung as they started (a fork in Python before 3.11.10, while another thread "
        "started: CPython gh-112275): killed, and the loader started again"
    )
    assert code == 0 and output.splitlines() == [warning, batches, batches] and job.left_behind == [], output


def test_a_stop_signal_while_the_loader_waits_for_its_workers_to_start_stops_after_the_data_wait():
    """The wait for a stuck worker (up to 60 s) is a wait for data: a SIGTERM then stops the process after a third of
    --stop-grace, as in a batch's wait (was: not before the wait ended, past Slurm's KillWait)."""
    stop = STUCK_AT_FORK.split("for _ in range(2):")[0] + (
        "import signal, threading\npreemption.WORKER_START_WAIT = 60\n"
        "stop = preemption.StopSignal(stop_grace=3)\n"
        "threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()\n"
        "started = time.monotonic()\n"
        "try:\n    iter(loader)\nexcept preemption.StopNow as error:\n"
        "    print(f'{type(error).__name__} after {time.monotonic() - started:.0f} s', flush=True)\n"
        "preemption.before_exit()\n"  # (as the scripts end: the stuck worker killed)
    )
    job = Job([PYTHON, "-c", stop], prewarmed=False)
    code, output = job.finish(timeout=120)
    assert output.splitlines()[-1] in ("StopNow after 1 s", "StopNow after 2 s", "StopNow after 3 s"), output


KILLED_WORKERS = """
import sys
import torch
from common import preemption
loader = preemption.SafeLoader(
    [torch.zeros(4)] * 8, batch_size=2, num_workers=2, worker_init_fn=preemption.ignore_stop_signals,
    multiprocessing_context="fork",
)
batches = iter(loader)
print(next(batches).shape[0], len(preemption.multiprocessing.active_children()), flush=True)
preemption.before_exit()  # (a stop, on the way out: the workers killed)
sys.exit(75)
"""


def test_a_stop_leaves_no_temporary_folder_of_its_loader_workers(tmp_path):
    """Each worker's sockets (it sends its batches' shared memory as file descriptors) lie in the training process's
    temporary folder, which goes with it (was: one pymp-* folder of its own each, left in /tmp by its kill at a stop:
    a job of 8 GPUs and 16 workers each, 128 folders a preemption)."""
    job = Job([PYTHON, "-c", KILLED_WORKERS], env=dict(clean_env(), TMPDIR=str(tmp_path)), prewarmed=False)
    code, output = job.finish(timeout=120)
    assert (code, output.splitlines()) == (75, ["2 2"]) and job.left_behind == [], output
    assert [path.name for path in tmp_path.iterdir()] == []

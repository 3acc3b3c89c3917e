"""Stopping cleanly when the cluster asks, and never hanging on the way out. SIGTERM and SIGUSR1 set a flag; the ranks
agree on it with an all-reduce started at one step and read at the next, stop after the same step (even in an epoch's
last steps: before validation), checkpoint, and exit 75 (before training: at once, common/launch.py). Waiting for data
a third of --stop-grace after the signal, or given another signal SECOND_SIGNAL_AFTER s or more after the first
(sooner: a copy), a process stops at once, never while writing a checkpoint. SIGINT: at once, 130.
"""

import contextlib
import multiprocessing
import multiprocessing.util
import os
import select
import signal
import struct
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from . import distributed
from .errors import Preempted, say
from .launch import STOP_SIGNALS, launcher_ended, training_starts

SECOND_SIGNAL_AFTER = 5  # seconds
LAUNCHER_EXIT_WAIT = 0.5  # seconds a SIGTERM waits to tell whether it is the kernel's for an ended launcher

_waiting_since = None  # when the main thread began waiting for a batch; None while it is not waiting


@contextlib.contextmanager
def waiting_for_data():
    global _waiting_since
    waiting_since, _waiting_since = _waiting_since, _waiting_since or time.monotonic()
    try:
        yield
    finally:
        _waiting_since = waiting_since  # (None, but where one waits within another)


class StopNow(Preempted):
    """A stop signal that could not wait for the end of a step: no checkpoint of this step."""


def ignore_stop_signals(worker_id=None):
    """DataLoader workers leave stopping to the training process (as worker_init_fn): the stop signals ignored, then
    let through (a worker is born with them held back: SafeLoader); a worker then says it started (SafeLoader)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if worker_id is not None and _started_fd is not None:
        os.write(_started_fd, struct.pack("i", os.getpid()))


WORKER_START_WAIT = 60  # seconds a forked loader worker may take to start before it is taken for one stuck in fork
WORKER_STARTS = 3  # the loader's tries to start its workers
_started_fd = None  # the pipe's end a forked worker says it started on (SafeLoader's, while it forks them)


class SafeLoader(DataLoader):
    """A DataLoader whose workers start and end safely. Born with the stop signals blocked until ignore_stop_signals
    (their worker_init_fn) ignores them, so that one sent to the process group reaches the training process alone
    (torch's SIGTERM handler killed a starting worker: exit 1, no checkpoint). Torch's SIGCHLD handler replaced by
    the process's own, the default where ignored (its exception came anywhere, once inside a queue's lock: the
    shutdown waited forever): a dead worker is found where the loader waits for a batch, within 5 s, unless a
    handler of yours reaps it."""

    def __iter__(self):
        """The iterator, its workers started. A worker forked while another thread of this process made a thread
        state (a gloo thread taking the GIL) can hang in fork before it runs any code, in Python before 3.11.10
        (CPython gh-112275): it is killed and the workers started again, with a warning (was: a hang without end)."""
        if not self.num_workers or not hasattr(signal, "pthread_sigmask"):
            return super().__iter__()
        forked = (self.multiprocessing_context or multiprocessing).get_start_method() == "fork"
        if not forked or self.worker_init_fn is not ignore_stop_signals or self.persistent_workers:
            return self._started()  # (no worker of these would say it started; persistent ones start once)
        global _started_fd
        seeds = self.generator.get_state() if self.generator is not None else None  # (a retry draws the same seed)
        for _ in range(WORKER_STARTS):
            before = {child.pid for child in multiprocessing.active_children()}
            started, _started_fd = os.pipe()
            with open(started, "rb") as said:
                try:
                    iterator = self._started()
                finally:
                    os.close(_started_fd)
                    _started_fd = None
                new = [child for child in multiprocessing.active_children() if child.daemon and child.pid not in before]
                # A stop signal meanwhile: at once after the data wait, as in a batch's; the loader then left, its
                # workers killed now, not waited for (stuck ones too).
                try:
                    with waiting_for_data():
                        stuck = _stuck_workers(said, new)
                except BaseException:
                    for process in new:
                        process.kill()
                    raise
            if not stuck:
                return iterator
            for process in stuck:
                process.kill()
            del iterator  # (its other workers stopped)
            if seeds is not None:
                self.generator.set_state(seeds)
            say(
                f"warning: {len(stuck)} loader worker(s) hung as they started (a fork in Python before 3.11.10, "
                "while another thread started: CPython gh-112275): killed, and the loader started again",
                file=sys.stderr,
            )
        raise RuntimeError(f"the loader's workers hung as they started, {WORKER_STARTS} times")

    def _started(self):
        main = threading.current_thread() is threading.main_thread()
        if main:  # (ignored, a dead worker would be reaped at once, and never found; None: not set from Python)
            sigchld = signal.getsignal(signal.SIGCHLD)
            sigchld = signal.SIG_DFL if sigchld in (signal.SIG_IGN, None) else sigchld
            signal.signal(signal.SIGCHLD, sigchld)
        # Forked workers make their sockets in this process's temporary folder, which it removes as it exits (their
        # own, one each, stayed in /tmp where before_exit killed them: each stop left a pymp-* folder a worker).
        multiprocessing.util.get_temp_dir()
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # (this thread's: the one that forks them)
        try:
            return super().__iter__()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
            if main:
                signal.signal(signal.SIGCHLD, sigchld)


def _stuck_workers(said, new):
    """The loader workers `new` (the daemonic children it started) alive that did not say they started (on `said`, a
    pipe's read end) within WORKER_START_WAIT seconds; a dead one is the loader's to report."""
    ready, deadline = set(), time.monotonic() + WORKER_START_WAIT
    while True:
        left = deadline - time.monotonic()  # (past it, the pipe still read once: a process stopped for long, SIGSTOP)
        if select.select([said], [], [], max(0.0, min(1.0, left)))[0]:
            data = os.read(said.fileno(), 4 * len(new))  # (whole pids: a pipe's writes of 4 bytes are atomic)
            ready.update(struct.unpack(f"{len(data) // 4}i", data))
        waiting = [child for child in new if child.pid not in ready and child.is_alive()]
        if not waiting or left <= 0:
            return waiting


def before_exit():
    """On the way out of a training process, whatever happened: cancels a stop signal's alarm (it would kill the
    process once Python's handlers are gone) and kills the DataLoader workers still alive (they ignore SIGTERM, with
    which multiprocessing's exit handler stops daemonic children before joining them: it would wait forever)."""
    workers = [child for child in multiprocessing.active_children() if child.daemon]
    if threading.current_thread() is threading.main_thread():
        ignore_stop_signals()  # a late one (the launcher stopping the others) would set a new alarm
        signal.alarm(0)
        # DataLoader's SIGCHLD handler would raise "worker killed" here, leaving the others alive.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for worker in workers:
        worker.kill()
    for worker in workers:
        worker.join(timeout=5)


class StopSignal:
    """The stop that a signal asks for, agreed on by every rank at a step. listen=False: one that never comes (no
    handler, no process group of its own): a trainer that is not fitting."""

    def __init__(self, stop_grace=30.0, listen=True):
        self.data_wait = stop_grace / 3  # the rest of the grace: the last step, the checkpoint
        self.received = None  # name of the signal, once one came
        self.received_at = None
        self.handlers = {}  # the handlers before ours, put back by close()
        # A CPU group of its own, so the flag never waits on GPU work (made while start-up's watch still watches).
        self.group = dist.new_group(backend="gloo") if listen and distributed.is_initialized() else None
        if listen and threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self.handlers[signum] = signal.signal(signum, self._handle)
            self.handlers[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._check_data_wait)
            training_starts()  # start-up's watch ends (a stop it took that was caught on the way: raised again)
        self.pending = None
        self.saving = False
        self.on_first = None  # called with the signal's name when the first one comes (the output lock's mark)

    def close(self):
        """The handlers as they were before (a run in a process that goes on: a test, a notebook)."""
        if self.handlers:
            signal.alarm(0)
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)
        self.handlers = {}

    @contextlib.contextmanager
    def no_stop_now(self):
        """While a checkpoint is written, a second signal does not cut it short."""
        self.saving = True
        try:
            yield
        finally:
            self.saving = False

    def _handle(self, signum, _frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM and launcher_ended(wait=LAUNCHER_EXIT_WAIT):
            name += " (its launcher ended)"  # the kernel's (end_with_launcher), never a second request to stop now
            if self.received is not None:
                return
        if self.received is not None:
            if time.monotonic() - self.received_at >= SECOND_SIGNAL_AFTER and not self.saving:
                raise StopNow(
                    f"stopped at once on a second {name}: no checkpoint of this step; "
                    "--resume auto continues from the last checkpoint"
                )
            return
        self.received, self.received_at = name, time.monotonic()
        if self.on_first is not None:
            self.on_first(name)
        signal.alarm(1)  # from now on, check every second that the process is not stuck waiting for data

    def _check_data_wait(self, _signum, _frame):
        if self.received is None:
            return
        since = _waiting_since
        if since is not None and time.monotonic() - max(since, self.received_at) >= self.data_wait:
            raise StopNow(
                f"stopped on {self.received} after waiting {self.data_wait:g} s for data: no "
                "checkpoint of this step; --resume auto continues from the last checkpoint"
            )
        signal.alarm(1)

    def poll(self, now=False):
        """True when some rank had received a stop signal by the previous poll (the same answer
        on every rank). Every rank must call it at the same steps. now=True: by now, without the one-step
        delay, for the end of an epoch's training (a blocking all-reduce, once an epoch)."""
        if self.group is None:
            agreed = self.received is not None
        else:
            agreed = False
            if self.pending is not None:
                work, flag = self.pending
                work.wait()
                agreed = bool(flag.item())
            flag = torch.tensor([int(self.received is not None)])
            work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            self.pending = (work, flag)
            if now:
                work.wait()
                self.pending, agreed = None, agreed or bool(flag.item())
        if agreed and threading.current_thread() is threading.main_thread():
            signal.alarm(0)  # the step boundary came: the checkpoint is written however long it takes
        return agreed

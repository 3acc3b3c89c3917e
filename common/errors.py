"""The exceptions that end a run with one line instead of a traceback (common/launch.py reports them); that line,
written whole (say); and `package.module:name` on the command line (--arch, --dataset, --trainer), imported or refused
in one line. It imports nothing of this repository, nor torch.

say writes a line and its newline in one write: print() makes two, and another process sharing the terminal or pipe
(ranks, loader workers, torchrun) could land between them, gluing its output onto our line.
"""

import ctypes
import importlib
import multiprocessing
import os
import signal
import sys
import time


class UsageError(Exception):
    """Bad input from the user: reported as one line and exit code 2."""

    exit_code = 2


class CheckpointWriteError(UsageError):
    """A checkpoint could not be written (a full disk): one line, exit code 1."""

    exit_code = 1


class OutOfMemory(UsageError):
    """The device ran out of memory: one line naming the evidence and the levers (diagnostics.py), exit code 1."""

    exit_code = 1


class WorkerUsageError(UsageError):
    """A UsageError that may be raised in a DataLoader worker, and still reads as one line."""

    def __init__(self, message):
        # A DataLoader worker's error arrives in the main process as "Caught ... Original Traceback
        # ...: <message>": keep the one line that says what happened.
        super().__init__(message.strip().splitlines()[-1].split(f"{type(self).__name__}: ", 1)[-1])


class UnreadableImage(WorkerUsageError):
    """--strict-data met a file that cannot be decoded."""


class BadItem(WorkerUsageError):
    """A dataset's item is not what the loaders take: (image, label) of a PIL image or a CHW tensor and a
    class index."""


class Preempted(Exception):
    """Stopped on SIGTERM / SIGUSR1 after writing a checkpoint; exit code PREEMPTED_EXIT_CODE."""


PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request; continue with --resume auto

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a launcher's or scheduler's request to stop


def _stop_during_start_up(signum, _frame):
    raise Preempted(
        f"stopped on {signal.Signals(signum).name} before training started: nothing was trained, nothing "
        "written; start it again as it was started"
    )


def stop_at_once_until_training():
    """From process start to the first step (imports, the folder scan, the checkpoint load: minutes on ImageNet
    over NFS) a stop signal ends the process at once with PREEMPTED_EXIT_CODE, as a stop in training does
    (not 143, a death by SIGTERM); preemption.StopSignal takes over when training starts."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _stop_during_start_up)


PR_SET_PDEATHSIG = 1  # linux/prctl.h
_launcher = None  # the launcher's process id, once end_with_launcher ran


def end_with_launcher():
    """A process that a launcher started (torchrun's worker, spawn's child) gets SIGTERM when the launcher ends, however
    it ends (SIGKILL, the OOM killer), and stops as on the launcher's own SIGTERM, rather than train on as an orphan
    that holds the output directory; launcher_ended() tells that SIGTERM apart. Linux (prctl PR_SET_PDEATHSIG);
    elsewhere nothing. A launcher that ended before this ran: the process sends it itself."""
    global _launcher
    if not sys.platform.startswith("linux"):
        return
    spawned_by = multiprocessing.parent_process()  # a spawn child: its parent, known from before its start-up
    _launcher = spawned_by.pid if spawned_by is not None else os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        _launcher = None
        return
    if launcher_ended():  # (a launcher that is PID 1, in a container, is no sign of one that ended)
        os.kill(os.getpid(), signal.SIGTERM)


def launcher_ended(wait=0.0):
    """Whether this process's launcher (end_with_launcher) has ended, waiting up to `wait` s for it to: the kernel
    sends the SIGTERM as soon as the launcher's thread that started this process ends, which under SIGKILL comes a
    moment before the whole launcher is gone and this process re-parented."""
    deadline = time.monotonic() + wait
    while _launcher is not None:
        if os.getppid() != _launcher:
            return True
        if time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    return False


def say(message, file=None):
    """print(message, file=file, flush=True), in one write."""
    stream = sys.stdout if file is None else file
    stream.write(f"{message}\n")
    stream.flush()


def import_named(text, flag):
    """The object that `package.module:name` names (None for a text without a colon: a built-in name)."""
    if ":" not in text:
        return None
    module_name, _, name = text.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise UsageError(f"{flag} {text}: cannot import {name} from {module_name} ({error})") from None

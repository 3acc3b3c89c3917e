"""How a training process ends: one exception ladder for the three scripts; a stop signal before training starts, and
the end of the launcher that started it. It imports no torch.

Bad input (UsageError) is one line on stderr and exit code 2 (a checkpoint that could not be written: 1); a stop
on request (Preempted) exits 75; Ctrl-C 130; a failure that is not this process's own fault (a lost peer, a
killed loader worker) one line and 1. Anything else is a bug, and its traceback is the report.
"""

import ctypes
import errno
import gc
import importlib
import multiprocessing
import os
import signal
import sys
import time
import traceback

from .errors import PREEMPTED_EXIT_CODE, Preempted, UsageError, say

# A write the file system refused: full, over quota, read-only, or over the process's file size limit (RLIMIT_FSIZE).
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


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
    """A process a launcher started (torchrun's worker, spawn's child) gets SIGTERM when the launcher ends, however it
    ends (SIGKILL, the OOM killer), rather than train on as an orphan holding the output directory; launcher_ended()
    tells that SIGTERM apart. Linux only (prctl PR_SET_PDEATHSIG). A launcher already gone: the process sends it."""
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


def known_failure(error):
    """One line for the errors that are not this process's own fault (their cause is reported
    elsewhere or is the machine's), else None."""
    text = str(error)
    if text.startswith("DataLoader worker"):
        # "DataLoader worker (pid X) is killed by signal: Killed.": the kernel's OOM killer, mostly.
        return f"error: {text.splitlines()[0].strip()} (out of memory? fewer --workers use less)"
    if "Expected to have finished reduction in the prior iteration" in text:
        # DDP waited for the gradient of a parameter that the forward did not use.
        return (
            "error: DDP: the model has parameters that received no gradient: add --find-unused-parameters "
            "(or use them all in forward)"
        )
    if any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "rank 0 failed")):
        # A collective lost a process of the job: that one failed (or was stopped) first and said why.
        return "error: another process of this job ended, see its error; this one stops too"
    return None


def outcome(error):
    """(exit code, the line that says why, or None) of the error that ended a run; None for a bug."""
    if isinstance(error, UsageError):
        return error.exit_code, f"error: {error}"
    if isinstance(error, Preempted):
        return PREEMPTED_EXIT_CODE, str(error) or None  # (no text: the trainer said where its checkpoint is)
    if isinstance(error, KeyboardInterrupt):
        return 130, None
    if isinstance(error, OSError) and error.errno in DISK_FULL:  # log.csv, summary.json, ... (checkpoints: their own)
        where = f" ({error.filename})" if error.filename else ""  # (a write to an open file names none)
        return 1, (
            f"error: a write failed: {error.strerror}{where}; the checkpoints already there are intact: make "
            "room, then --resume auto goes on from the last one"
        )
    line = known_failure(error) if isinstance(error, RuntimeError) else None
    return None if line is None else (1, line)


def _clean_up():
    """On the way out, while an error still holds the data loaders (once it is handled they shut down, waiting 5 s for
    each worker stuck in a read): no loader worker left, no alarm pending, no process group. preemption not imported
    yet: nothing to clean up, and a usage error does not wait for torch to load."""
    preemption = sys.modules.get(f"{__package__}.preemption")
    if preemption is not None:
        preemption.before_exit()
        sys.modules[f"{__package__}.distributed"].destroy_process_group()


def without_collections(make):
    """make() with the garbage collector off: importing torch and torchvision (parsing the arguments checks --arch
    against torchvision; a spawned process imports them anew) makes about 340,000 objects and, collector on, five or
    six full collections of them, 0.6 s of a 2.2 s start on 2 cores. Then one collection moves them to the oldest
    generation, where they are scanned again only when it has grown by a quarter (left in the youngest, its next two
    collections would scan them all). The collector is on again after, whatever happens."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        made = make()
        gc.collect()
        return made
    finally:
        if was_enabled:
            gc.enable()


def run_main(main, parse_args):
    """main(parse_args()), its end through the ladder: the exit code (a line on stderr where there is one)."""
    try:
        try:
            stop_at_once_until_training()
            if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker of torchrun (or of the legacy launcher)
                end_with_launcher()
            main(without_collections(parse_args))
        finally:
            _clean_up()
        return 0
    except (Exception, KeyboardInterrupt) as error:
        ended = outcome(error)
        if ended is None:
            raise  # a bug: its traceback is the report
        code, line = ended
        if line:
            say(line, file=sys.stderr)
        return code


def run_worker(rank, body, usage_errors):
    """body() in a process that torch.multiprocessing.spawn started, ended through the same ladder with sys.exit.
    A usage error's line goes to `usage_errors` (a queue): the parent says the first one, once (every rank may
    raise the same one); any other line is said here, with the rank, and a bug's traceback too, so that the
    first cause is shown whichever process spawn reports."""
    try:
        try:
            stop_at_once_until_training()  # a new interpreter: a stop signal in its start-up ends it with 75 too
            end_with_launcher()
            without_collections(lambda: importlib.import_module("torchvision"))  # (body() imports it)
            body()
        finally:
            _clean_up()
    except (Exception, KeyboardInterrupt) as error:
        if isinstance(error, KeyboardInterrupt):
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches us twice: directly and from the parent
        ended = outcome(error)
        if ended is None:
            say(f"error: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
            sys.exit(1)
        code, line = ended
        if isinstance(error, UsageError):
            usage_errors.put((code, line))
        elif line:
            kind = "error: " if line.startswith("error: ") else ""
            say(f"{kind}rank {rank}: {line.removeprefix(kind)}", file=sys.stderr)
        sys.exit(code)  # spawn would report a KeyboardInterrupt as success

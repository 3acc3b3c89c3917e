"""How a training process ends: one exception ladder for the three scripts.

Bad input (UsageError) is one line on stderr and exit code 2 (a checkpoint that could not be written: 1); a stop
on request (Preempted) exits 75; Ctrl-C 130; a failure that is not this process's own fault (a lost peer, a
killed loader worker) one line and 1. Anything else is a bug, and its traceback is the report.
"""

import errno
import os
import signal
import sys
import traceback

from .errors import PREEMPTED_EXIT_CODE, Preempted, UsageError, end_with_launcher, say, stop_at_once_until_training

# A write the file system refused: full, over quota, read-only, or over the process's file size limit (RLIMIT_FSIZE).
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


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
    """On the way out, whatever happened, while an error still holds the data loaders: no loader worker left
    (once the error is handled they shut down, waiting 5 s for each worker stuck in a read), no alarm pending,
    no process group. (Not imported yet: nothing to clean up, and a usage error does not wait for torch to load.)"""
    preemption = sys.modules.get(f"{__package__}.preemption")
    if preemption is not None:
        preemption.before_exit()
        sys.modules[f"{__package__}.distributed"].destroy_process_group()


def run_main(main, parse_args):
    """main(parse_args()), its end through the ladder: the exit code (a line on stderr where there is one)."""
    try:
        try:
            stop_at_once_until_training()
            if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker of torchrun (or of the legacy launcher)
                end_with_launcher()
            main(parse_args())
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
            say(
                line.replace("error: ", f"error: rank {rank}: ", 1)
                if line.startswith("error: ")
                else f"rank {rank}: {line}",
                file=sys.stderr,
            )
        sys.exit(code)  # spawn would report a KeyboardInterrupt as success

"""The exceptions that end a run with one line instead of a traceback (common/args.py's run_main reports them).

A module of their own, importing nothing of this repository (nor torch): every part of common/ raises them,
and none needs the command line for it.
"""
import signal


class UsageError(Exception):
    """Bad input from the user: reported as one line and exit code 2."""
    exit_code = 2


class Preempted(Exception):
    """Stopped on SIGTERM / SIGUSR1 after writing a checkpoint; exit code PREEMPTED_EXIT_CODE."""


PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request; continue with --resume auto

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a launcher's or scheduler's request to stop


def _stop_during_start_up(signum, _frame):
    raise Preempted(f"stopped on {signal.Signals(signum).name} before training started: nothing was trained, nothing "
                    "written; start it again as it was started")


def stop_at_once_until_training():
    """From process start to the first step (imports, the folder scan, the checkpoint load: minutes on ImageNet
    over NFS) a stop signal ends the process at once with PREEMPTED_EXIT_CODE, as a stop in training does
    (not 143, a death by SIGTERM); preemption.StopSignal takes over when training starts."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _stop_during_start_up)

"""The exceptions that end a run with one line instead of a traceback (common/args.py's run_main reports them).

A module of their own, importing nothing: every part of common/ raises them, and none needs the
command line for it.
"""


class UsageError(Exception):
    """Bad input from the user: reported as one line and exit code 2."""
    exit_code = 2


class Preempted(Exception):
    """Stopped on SIGTERM / SIGUSR1 after writing a checkpoint; exit code PREEMPTED_EXIT_CODE."""


PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request; continue with --resume auto

"""common/launch.py: the one exception ladder of the three scripts: bad input one line and exit 2 (a checkpoint that
could not be written: 1), a stop on request 75, Ctrl-C 130, a lost peer or loader worker one line and 1, a bug its
traceback; a spawned worker ends through the same ladder, its usage line handed to the parent."""

import errno
import subprocess

import pytest

from common.errors import CheckpointWriteError, Preempted, UnreadableImage, UsageError
from common.launch import known_failure, outcome
from harness.processes import PYTHON, REPO, clean_env


@pytest.mark.parametrize(
    "error, ended",
    [
        (UsageError("--lr must be positive, got 0"), (2, "error: --lr must be positive, got 0")),
        (UnreadableImage("x\nTraceback ...\nUnreadableImage: cannot decode a.jpg"), (2, "error: cannot decode a.jpg")),
        (CheckpointWriteError("could not write a checkpoint"), (1, "error: could not write a checkpoint")),
        (Preempted("stopped on SIGTERM before training started"), (75, "stopped on SIGTERM before training started")),
        (Preempted(), (75, None)),
        (KeyboardInterrupt(), (130, None)),
        (
            RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed."),
            (
                1,
                "error: DataLoader worker (pid 7) is killed by signal: Killed. "
                "(out of memory? fewer --workers use less)",
            ),
        ),
        (
            RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"),
            (1, "error: another process of this job ended, see its error; this one stops too"),
        ),
        # A full disk while log.csv or summary.json is written (a checkpoint's is CheckpointWriteError): one line, not a
        # traceback; another OSError is a bug's.
        (
            OSError(errno.ENOSPC, "No space left on device", "/runs/x/summary.json"),
            (
                1,
                "error: a write failed: No space left on device (/runs/x/summary.json); "
                "the checkpoints already there are intact: make room, then --resume auto goes on from the last one",
            ),
        ),
        (
            OSError(errno.EFBIG, "File too large"),  # (a write to an open file: no file named)
            (
                1,
                "error: a write failed: File too large; the checkpoints already there are intact: "
                "make room, then --resume auto goes on from the last one",
            ),
        ),
        (OSError(errno.EISDIR, "Is a directory", "/runs/x/log.csv"), None),
        (RuntimeError("a bug of ours"), None),
        (TypeError("another"), None),
    ],
)
def test_every_way_a_run_ends_has_its_exit_code_and_line(error, ended):
    assert outcome(error) == ended


def test_a_parameter_ddp_never_saw_a_gradient_for_is_named_in_one_line():
    assert "add --find-unused-parameters" in known_failure(
        RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one.")
    )


# Each case runs main() as a script's __main__ does (run_main, run_worker), in one interpreter of its own (they end
# the process's loader workers and set its signal handlers on the way out).
CASES = """import queue
from common.launch import run_main, run_worker
from common.errors import UsageError, Preempted

def raising(error):
    def body(*_config):
        raise error
    return body

for name, error in [("usage", UsageError("--lr must be positive")), ("stop", Preempted()), ("bug", ValueError("oops"))]:
    try:
        code = run_main(raising(error), lambda: None)
    except ValueError:
        code = "traceback"
    print(name, code, flush=True)
lines = queue.Queue()
for name, error in [("worker-usage", UsageError("-b 9")), ("worker-lost", RuntimeError("Connection reset by peer"))]:
    try:
        run_worker(3, raising(error), lines)
    except SystemExit as end:
        print(name, end.code, lines.get_nowait() if not lines.empty() else None, flush=True)
"""


def test_run_main_and_run_worker_end_a_process_through_the_ladder():
    result = subprocess.run(
        [PYTHON, "-c", CASES], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.stdout.splitlines() == [
        "usage 2",
        "stop 75",
        "bug traceback",
        "worker-usage 2 (2, 'error: -b 9')",
        "worker-lost 1 None",
    ], result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "error: --lr must be positive",
        "error: rank 3: another process of this job ended, see its error; this one stops too",
    ], result.stderr

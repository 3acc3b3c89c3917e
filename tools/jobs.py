"""Jobs of the tools (tools/gpu_check.py, tools/benchmark_gpu.py): a command run in a session of its own with a time
limit, and everything it started (torchrun's workers, loader workers) killed when it ends, found by a marker in their
environment."""

import os
import signal
import socket
import subprocess
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class CheckFailed(Exception):
    def __init__(self, message, output=None):
        super().__init__(message)
        self.output = output  # all a run printed, where it ran past its time


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def processes_marked(marker):
    """Live processes whose environment holds GPU_CHECK_JOB=marker: a job and all it started, whatever
    session they moved to (torchrun starts each worker in a session of its own)."""
    needle, found = f"GPU_CHECK_JOB={marker}".encode(), []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def kill_marked(marker):
    for pid in processes_marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run(command, env, timeout):
    """(exit status, output) of a job. On timeout it gets a SIGTERM (torchrun passes it on, the ranks
    save and stop), 30 s later a SIGKILL; whatever of it is left when it ends is killed."""
    marker = uuid.uuid4().hex
    process = subprocess.Popen(
        [str(part) for part in command],
        cwd=REPO,
        env={**env, "GPU_CHECK_JOB": marker},
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            kill_marked(marker)
            output, _ = process.communicate()
        raise CheckFailed(f"no end after {timeout} s:\n{output[-1500:]}", output)
    finally:
        kill_marked(marker)  # loader workers, a rank stuck in a collective
    return process.returncode, output

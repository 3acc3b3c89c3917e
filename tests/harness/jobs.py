"""Jobs: the real processes a test starts (as a user starts them, or forked from the prewarm server), their output
read as it comes, and none left running after its test, or after the session."""

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from harness.ahead import in_background
from harness.prewarm import Prewarmed, PrewarmedProcess, worker_command
from harness.processes import (
    PYTHON,
    REPO,
    clean_env,
    free_port,
    lower_priority,
    process_stat,
    processes_in_session,
    processes_marked,
    session_over,
)

_jobs = []  # every Job not yet known to be over: killed at the end of the test that started it
_background_jobs = []  # those of runs started ahead (in_background): killed at the session's end if still running


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test():
    """The finaliser of every test: whatever failed, no job it started is left running."""
    before = list(_jobs)  # jobs of module or session fixtures: those fixtures finish them
    yield
    for job in [job for job in _jobs if job not in before]:
        job.kill()


@pytest.fixture(scope="session", autouse=True)
def _no_job_outlives_the_session(_runs_started_ahead):
    """At the session's end (also after -x or Ctrl-C): no run started ahead starts now, no job starts any more, and
    every job still running is killed, whichever thread waits for it."""
    yield
    session_over.set()
    _runs_started_ahead.shutdown(wait=False, cancel_futures=True)
    for job in [*_jobs, *_background_jobs]:
        try:
            job.kill()
        except Exception as error:  # (the next kill still comes)
            print(f"conftest: could not kill {job.process.args}: {error!r}", file=sys.stderr)
    Prewarmed.stop()


# How the scripts' lines begin, where a test looks for them.
OUR_LINE_STARTS = re.compile(r"(?<=\S)(?=done: best acc@1 |error: |warning: |Epoch: \[\d+\] \[| \* (?:EMA )?Acc@1 )")


def our_lines_apart(line):
    """`line` as read from a job's output, with each of our lines on a line of its own: the scripts write a
    line whole (common/errors.py: say), but a library in another process of the job may write a line of its own
    in two parts (text, then newline), and ours then lands between them, right after the other's text (a
    start of ours after a space is left alone: it is inside a line)."""
    parts = OUR_LINE_STARTS.split(line)
    return [part + "\n" for part in parts[:-1]] + [parts[-1]]


class Job:
    """A launched job whose output is read line by line as it comes. It runs in a session of its own,
    marked in its environment (JOB_MARKER) so that its descendants are found in any session;
    finish() waits for it, then kills whatever of it is left. A job still running when its test
    ends is killed then."""

    def __init__(self, command, env=None, cwd=REPO, prewarmed=True, **popen):
        if session_over.is_set():
            raise RuntimeError("the test session is over: no job starts now")
        self.marker = uuid.uuid4().hex
        env = dict(env or clean_env(), JOB_MARKER=self.marker)
        prewarmed = prewarmed and not popen and not isinstance(command, AsUser)
        command = [str(arg) for arg in command]
        if prewarmed and Prewarmed.can_run(command, env):
            self.process = Prewarmed.start(command, env, cwd)
        else:
            self.process = subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                **popen,
            )
        lower_priority(self.process.pid)
        self.lines, self.output = queue.Queue(), []
        self.left_behind = None  # processes of the job alive after it ended (set by finish)
        self.at_timeout = None  # where its processes waited when it timed out (set by finish)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.jobs = _background_jobs if in_background() else _jobs
        self.jobs.append(self)
        if session_over.is_set():  # the session ended while this one started: its end may not have seen it
            self.kill()
            raise RuntimeError("the test session is over: no job starts now")

    def _read(self):
        for raw in self.process.stdout:
            for line in our_lines_apart(raw):
                self.output.append(line)
                self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern, timeout=120):
        """The first line (from now on) that matches `pattern`; the job is killed if none comes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=deadline - time.monotonic())
            except queue.Empty:
                break
            if line is None:
                break
            if pattern.search(line):
                return line
        self.kill()
        raise AssertionError(f"no line matching {pattern.pattern!r}:\n{''.join(self.output)[-3000:]}")

    def leftovers(self):
        """The job's processes still alive: those marked as the job's and, for a prewarmed run (whose
        environment as /proc shows it is the server's), those of its session, and of the sessions of the runs
        the server forked for its torchrun workers."""
        found = processes_marked(self.marker)
        for pid in Prewarmed.runs_of(self.marker):
            found = sorted(set(found) | set(processes_in_session(pid)))
        if isinstance(self.process, PrewarmedProcess):
            found = sorted(set(found) | set(processes_in_session(self.process.pid)))
        return found

    def kill(self):
        """SIGKILL the job's process group and every process marked as the job's."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for _ in range(50):  # a process may fork while it is killed: until none is left
            pids = self.leftovers()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        self.process.wait()
        if self in self.jobs:
            self.jobs.remove(self)

    def finish(self, timeout=300, grace=5):
        """(returncode, output) once the job ended by itself within `timeout` s (else it is killed and TimedOut, a
        subprocess.TimeoutExpired, raised). The processes of the job still alive `grace` s after it ended are in
        self.left_behind, then killed."""
        try:
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.at_timeout = "(not known)"
                with contextlib.suppress(Exception):  # (the processes may end meanwhile)
                    self.at_timeout = described(self.leftovers())
            else:
                deadline = time.monotonic() + grace
                while self.leftovers() and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.left_behind = self.leftovers()
        finally:
            self.kill()
            self.reader.join(timeout=30)  # the last lines: the pipe is closed once every process is gone
        if self.at_timeout is not None:
            raise TimedOut(self.process.args, timeout, "".join(self.output), self.at_timeout)
        return self.process.returncode, "".join(self.output)


def run(args, timeout=300, env=None, cwd=REPO, prewarmed=True):
    """Run a command (a list) to completion; a hang fails the test instead of the CI run. The command
    runs as a Job: on a timeout it is killed with every process it started (torchrun's workers,
    spawn's children, loader workers), whatever session they moved to."""
    job = Job(args, env=env, cwd=cwd, prewarmed=prewarmed)
    returncode, output = job.finish(timeout=timeout)
    return subprocess.CompletedProcess(job.process.args, returncode, output)


class TimedOut(subprocess.TimeoutExpired):
    """A job that did not end in time: its message has the job's last output and where each of its processes waited
    (state, kernel wait channel, command), taken before it was killed."""

    def __init__(self, command, timeout, output, processes):
        super().__init__(command, timeout, output=output)
        self.processes = processes

    def __str__(self):
        return f"{super().__str__()}; its processes then: {self.processes}\n{self.output[-3000:]}"


def described(pids):
    """State, kernel wait channel and command line of each of `pids` that is still there."""
    found = []
    for pid in pids:
        fields = process_stat(pid)
        with contextlib.suppress(OSError):
            wchan = Path(f"/proc/{pid}/wchan").read_text()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid} ({fields[0] if fields else '?'}, in {wchan}): {command[:150]}")
    return "; ".join(found) or "none"


def run_together(commands, timeout=300):
    """[CompletedProcess] of commands (lists, or (list, env) pairs) started at once: single-process runs
    leave a core idle on this 2-core machine, and waits overlap. Each runs as a Job."""
    jobs = [Job(*command) if isinstance(command, tuple) else Job(command) for command in commands]
    results, deadline = [], time.monotonic() + timeout
    try:
        for job in jobs:
            returncode, output = job.finish(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(job.process.args, returncode, output))
    finally:
        for job in jobs:
            job.kill()
    return results


class AsUser(list):
    """A command that runs as a user starts it (a new interpreter), never prewarmed."""


def script_command(script, *args, as_user=False):
    return (AsUser if as_user else list)([PYTHON, REPO / script, *args])


def run_script(script, *args, timeout=300, env=None, as_user=False):
    return run(script_command(script, *args, as_user=as_user), timeout=timeout, env=env)


def torchrun_command(script, nproc, *args, extra=(), prewarmed=True):
    """`torchrun --nproc_per_node=N script args` on a free loopback port: the launcher and its workers prewarmed
    (Prewarmed, worker_command), or neither."""
    return (list if prewarmed else AsUser)(
        [
            PYTHON,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            *extra,
            *worker_command(script, prewarmed),
            *args,
        ]
    )


def torchrun(script, nproc, *args, timeout=300, env=None, extra=()):
    return run(torchrun_command(script, nproc, *args, extra=extra), timeout=timeout, env=env)


def no_traceback_of_ours(output):
    """No traceback through this repository's code (torchrun prints its own on a failed job, from the
    environment that runs the tests, which may be inside the repository: .venv, .venv-latest)."""
    return not re.search(rf'File "{re.escape(str(REPO))}/(?!{re.escape(os.path.relpath(sys.prefix, REPO))}/)', output)


def assert_ok(result):
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def run_prewarmed(script, runs, envs=None, timeout=180, parallel=2):
    """[CompletedProcess] of `python script *argv` for each argv in `runs`, each a process of its own
    forked from one interpreter that imported the script's modules first (tests/prewarmed.py): for
    the many runs that end before training starts, where starting Python and importing torch is
    nearly all the cost. Nothing may be printed while importing: a real run would print it."""
    with tempfile.TemporaryDirectory(prefix="prewarmed-") as folder:
        spec = Path(folder) / "spec.json"
        outputs = [str(Path(folder) / f"{index}.out") for index in range(len(runs))]
        spec.write_text(
            json.dumps(
                {
                    "script": str(REPO / script),
                    "runs": [[str(arg) for arg in argv] for argv in runs],
                    "envs": envs or [None] * len(runs),
                    "outputs": outputs,
                    "parallel": parallel,
                    "timeout": timeout,
                }
            )
        )
        driver = run([PYTHON, REPO / "tests" / "prewarmed.py", spec], timeout=timeout + 60)
        assert driver.returncode == 0, driver.stdout[-3000:]
        result = json.loads(Path(f"{spec}.result").read_text())
        assert result["import_output"] == "", result["import_output"]
        return [
            subprocess.CompletedProcess([PYTHON, script, *argv], code, Path(output).read_text())
            for argv, code, output in zip(runs, result["codes"], outputs)
        ]

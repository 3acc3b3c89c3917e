"""Runs of a script forked from a server that imported torch once (tests/prewarmed.py): a test's run without Python's
start and the imports, about 5 s of CPU each on these cores."""

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

from harness.processes import PYTHON, REPO, clean_env, lower_priority, session_over
from prewarmed import same_at_import


class PrewarmedProcess:
    """What Job needs of a subprocess.Popen, for a run forked by the prewarm server (tests/prewarmed.py
    --serve): pid, args, stdout, wait, poll, send_signal, returncode. The server is its parent; it
    reports the exit code on the run's connection."""

    def __init__(self, args, connection, pid, stdout):
        self.args, self.pid, self.stdout, self.returncode = args, pid, stdout, None
        self._connection, self._buffer, self._lock = connection, b"", threading.Lock()

    def _receive(self, timeout):
        with self._lock:  # a test's thread and the session's end may wait for one run
            return self.returncode is not None or self._receive_exit(timeout)

    def _receive_exit(self, timeout):
        self._connection.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                data = self._connection.recv(4096)
            except (socket.timeout, BlockingIOError):  # timeout 0: BlockingIOError
                return False
            if not data:
                raise RuntimeError(f"the prewarm server ended before run {self.pid} did")
            self._buffer += data
        self.returncode = json.loads(self._buffer.split(b"\n", 1)[0])["exit"]
        self._connection.close()
        return True

    def poll(self):
        if self.returncode is None:
            self._receive(0)
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None and not self._receive(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum):
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)


TORCHRUN = "torch.distributed.run"


class Prewarmed:
    """A server that imported torch, torchvision and common/ once and forks a process for each run of a
    script (`python script.py ...`): starting Python and importing torch is about 5 s of CPU on these
    cores, most of what a test's run costs. From the script's first line on, the run is the script's own:
    run as __main__, its own arguments, environment, working directory, session, output and exit code,
    signals as they come (tests/prewarmed.py). Not for runs whose environment differs from the server's in
    what is read at import time (IMPORT_TIME), nor for what a test must see started as a user starts it
    (script_command(..., as_user=True), Job(..., prewarmed=False)); PREWARMED=0 turns it off for the whole
    session."""

    server = server_env = None
    lock = threading.Lock()  # fixtures start runs from several threads

    @classmethod
    def can_run(cls, command, env):
        if os.environ.get("PREWARMED", "1") == "0" or len(command) < 2 or command[0] != PYTHON:
            return False
        if command[1:3] == ["-m", TORCHRUN]:
            return same_at_import(env, cls.server_env or clean_env())
        script = Path(command[1])
        if script.suffix != ".py" or not script.is_absolute() or REPO not in script.parents:
            return False
        return same_at_import(env, cls.server_env or clean_env())  # the server's, or the one it will start with

    @classmethod
    def socket(cls):
        """The server's socket, the server started first if it is not running (not once the session is over)."""
        with cls.lock:  # (stop() takes it too: no server starts while it stops one)
            if session_over.is_set():
                raise RuntimeError("the test session is over: no prewarm server starts now")
            if cls.server is None or cls.server.poll() is not None:
                cls.socket_path = os.path.join(tempfile.mkdtemp(prefix="prewarm-"), "socket")
                cls.server_env = clean_env()
                cls.server = subprocess.Popen(
                    [PYTHON, REPO / "tests" / "prewarmed.py", "--serve", cls.socket_path],
                    env=cls.server_env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    start_new_session=True,
                    text=True,
                )
                lower_priority(cls.server.pid)  # and every run it forks (torchrun's prewarmed workers' too)
                ready = json.loads(cls.server.stdout.readline() or "{}")
                assert ready.get("ready") and ready["import_output"] == "", ready
            return cls.socket_path

    @classmethod
    def runs_of(cls, marker):
        """The processes the server forked for the job marked `marker` (torchrun's prewarmed workers' runs)."""
        folder = Path(f"{cls.socket_path}.runs/{marker}") if cls.server is not None else None
        return [int(path.name) for path in folder.iterdir()] if folder is not None and folder.is_dir() else []

    @classmethod
    def start(cls, command, env, cwd):
        socket_path = cls.socket()
        read_end, write_end = os.pipe()
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(socket_path)
        module = command[1] == "-m"  # (torchrun's launcher: `python -m torch.distributed.run ...`)
        script, argv = (f"-m {command[2]}", command[3:]) if module else (command[1], command[2:])
        request = {"script": script, "argv": argv, "env": env, "cwd": str(cwd)}
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [write_end])
        os.close(write_end)
        reply = b""
        while not reply.endswith(b"\n"):
            data = connection.recv(1)
            assert data, "the prewarm server ended"
            reply += data
        return PrewarmedProcess(command, connection, json.loads(reply)["pid"], os.fdopen(read_end, "r"))

    @classmethod
    def stop(cls):
        with cls.lock:
            if cls.server is not None:
                cls.server.kill()
                cls.server.wait()
                cls.server = None
                shutil.rmtree(os.path.dirname(cls.socket_path), ignore_errors=True)


def worker_command(script, prewarmed=True):
    """What torchrun starts for each worker, as the end of its command line: `script` (torchrun's own `python -u
    script`), or, prewarmed, tests/prewarmed.py --worker, whose run of the script is forked from the prewarm
    server (Prewarmed): the same script, arguments, environment and output, without Python's start and the imports
    (about 5 s of CPU a worker). Not for a test that must stop a worker with SIGSTOP (the worker then is a shim that
    passes signals on), nor where PREWARMED=0."""
    if not prewarmed or os.environ.get("PREWARMED", "1") == "0":
        return [REPO / script]
    return ["--no-python", PYTHON, REPO / "tests" / "prewarmed.py", "--worker", Prewarmed.socket(), REPO / script]

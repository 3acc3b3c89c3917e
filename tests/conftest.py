"""Shared helpers: tiny datasets on disk and real processes started the way a user starts them."""
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import demo_data  # noqa: E402

PYTHON = sys.executable
# Small and fast on two cores: 32 px images, no loader workers, one thread per process.
TINY = ["--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32", "-j", "0", "-p", "1"]


def make_image_folder(root, train_per_class=8, val_per_class=4, num_classes=3):
    """A real JPEG ImageFolder (root/train, root/val) of demo shapes."""
    demo_data.generate(root, train_per_class=train_per_class, val_per_class=val_per_class,
                       num_classes=num_classes)
    return Path(root)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """3 classes, 24 train and 12 val images."""
    return make_image_folder(tmp_path_factory.mktemp("tiny"))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env(gpu=False, **extra):
    """The environment of a user's shell: no launcher or platform variables leaking in
    (and no GPU unless `gpu`: the CPU paths are tested on every machine)."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "EPOCHS", "LR",
                          "BATCH_SIZE", "DATASETS_PATH", "DATASETS", "WORKSPACE", "BACKEND", "WORKER_PER_NODE")
           and not key.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update({key: str(value) for key, value in extra.items()})
    return env


def run(args, timeout=300, env=None, cwd=REPO):
    """Run a command (a list) to completion; a hang fails the test instead of the CI run."""
    return subprocess.run([str(arg) for arg in args], cwd=cwd, env=env or clean_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


def run_script(script, *args, timeout=300, env=None):
    return run([PYTHON, REPO / script, *args], timeout=timeout, env=env)


def torchrun(script, nproc, *args, timeout=300, env=None, extra=()):
    """`torchrun --nproc_per_node=N script args` on a free loopback port."""
    return run([PYTHON, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}", *extra, REPO / script, *args],
               timeout=timeout, env=env)


def assert_ok(result):
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def processes_marked(marker):
    """Live processes whose environment holds JOB_MARKER=marker: a job and every descendant (torchrun's
    workers, spawn's children, loader workers), whatever session or process group they moved to."""
    needle = f"JOB_MARKER={marker}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


class Job:
    """A launched job whose output is read line by line as it comes. It runs in a session of its own,
    marked in its environment; finish() waits for it, then kills whatever of it is left."""

    def __init__(self, command, env=None, **popen):
        self.marker = uuid.uuid4().hex
        env = dict(env or clean_env(), JOB_MARKER=self.marker)
        self.process = subprocess.Popen([str(arg) for arg in command], cwd=REPO, env=env, start_new_session=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
        self.lines, self.output = queue.Queue(), []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
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
        return processes_marked(self.marker)

    def kill(self):
        for pid in [self.process.pid, *self.leftovers()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()

    def finish(self, timeout=300):
        """(returncode, output) once the job ended by itself within `timeout` s (else it is killed and
        subprocess.TimeoutExpired raised)."""
        try:
            self.process.wait(timeout=timeout)
        finally:
            self.kill()
        time.sleep(0.1)  # let the reader take the last lines
        return self.process.returncode, "".join(self.output)

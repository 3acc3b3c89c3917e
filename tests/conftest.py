"""Shared helpers: tiny datasets on disk and real processes started the way a user starts them."""
import os
import socket
import subprocess
import sys
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

"""Shared helpers: tiny datasets on disk and real processes started the way a user starts them, none of
which outlives its test."""

import csv
import json
import os
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# In-process tests compute on one thread, as every job does (OMP_NUM_THREADS=1: clean_env): the other core is the jobs'
# (started ahead, in the background), and OpenMP's threads would spin waiting for a core.
os.environ["OMP_NUM_THREADS"] = "1"
import torch  # noqa: E402

torch.set_num_threads(1)
from common import demo_data  # noqa: E402
from prewarmed import same_at_import  # noqa: E402

TIERS = ("unit", "e2e", "faults", "slow", "slurm", "gpu", "quick")


def pytest_collection_modifyitems(items):
    """tests/unit/ is the unit tier; every other test file names its tier (pytestmark) and must have one. The files
    whose tests share runs started ahead (`ahead`) go last: those runs start in the background at the session's start
    and use the core that the tests before them (the unit tier, in-process, on one core) leave idle."""
    for item in items:
        if Path(item.fspath).parent.name == "unit":
            item.add_marker(pytest.mark.unit)
        elif not any(item.get_closest_marker(tier) for tier in TIERS):
            raise pytest.UsageError(
                f"{item.nodeid} has no tier marker ({', '.join(TIERS)}): give its module a pytestmark"
            )
    later = {item.module.__name__ for item in items if ahead_of(item)}
    items.sort(key=lambda item: (Path(item.fspath).parent.name != "unit", item.module.__name__ in later))


PYTHON = sys.executable
# The environment the session started with: what a job inherits (clean_env), whatever an in-process test running
# at the same time sets in os.environ (monkeypatch).
SESSION_ENV = dict(os.environ)


# ----------------------------------------------------------------------------- runs started ahead of their tests


class Once:
    """A value computed once in the session, by the first thread that asks for it; the others wait for it."""

    def __init__(self, function):
        self.function, self.lock, self.done, self.value, self.error = function, threading.Lock(), False, None, None

    def get(self, tmp_path_factory):
        with self.lock:
            if not self.done:
                try:
                    self.value = self.function(tmp_path_factory)
                except Exception as error:  # each test that uses it fails with it, as a fixture's error
                    self.error = error
                self.done = True
        if self.error is not None:
            raise self.error
        return self.value


_once, _once_lock = {}, threading.Lock()


def log_rows(folder):
    """The rows of the log.csv in `folder`, by column name."""
    with open(Path(folder) / "log.csv", newline="") as file:
        return list(csv.DictReader(file))


def once(function, tmp_path_factory):
    """function(tmp_path_factory), computed once in the session (data folders, runs that tests share), whichever
    thread asks first: a fixture, or the background thread that starts runs ahead."""
    with _once_lock:
        entry = _once.setdefault(function, Once(function))
    return entry.get(tmp_path_factory)


_AHEAD = {}  # (module, or None for a session fixture; fixture name) -> function(tmp_path_factory)


def ahead(function, name, scope="module"):
    """The fixture `name` whose value is function(tmp_path_factory): real-process runs that several tests share. The
    session starts it in the background before its first test comes (in the order of the tests that use it), on the
    core that in-process tests leave idle; the fixture then waits for it (or computes it, if nothing started it).
    A module assigns it to a name of its own: `side_by_side = ahead(side_by_side_runs, "side_by_side")`."""
    _AHEAD[(None if scope == "session" else function.__module__, name)] = function

    def fixture(tmp_path_factory):
        return once(function, tmp_path_factory)

    fixture.__doc__ = function.__doc__
    return pytest.fixture(fixture, scope=scope, name=name)


def ahead_of(item):
    """The functions of the fixtures started ahead that `item` uses."""
    found = (_AHEAD.get((item.module.__name__, name)) or _AHEAD.get((None, name)) for name in item.fixturenames)
    return [function for function in found if function is not None]


_background = threading.local()  # .on: a thread that runs what was started ahead, or one such a thread started


def in_background():
    return getattr(_background, "on", False)


def _mark_background(on):
    _background.on = on


class SideBySide(ThreadPoolExecutor):
    """A ThreadPoolExecutor for runs side by side; its threads belong to the background if the thread that made it
    does (their jobs are then the session's to end, not those of the test that runs meanwhile)."""

    def __init__(self, workers):
        super().__init__(workers, initializer=_mark_background, initargs=(in_background(),))


@pytest.fixture(scope="session", autouse=True)
def _runs_started_ahead(request, tmp_path_factory):
    """Start, one after another in a background thread, the fixtures started ahead that the session's tests use, in
    the order of their first test."""
    order = []
    for item in request.session.items:
        order += [function for function in ahead_of(item) if function not in order]
    pool = ThreadPoolExecutor(1, initializer=_mark_background, initargs=(True,))
    for function in order:
        pool.submit(once, function, tmp_path_factory)
    yield pool  # shut down by _no_job_outlives_the_session, before it kills the jobs


# Small and fast on two cores: 32 px images, no loader workers, one thread per process.
TINY = ["--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32", "-j", "0", "-p", "1"]


def parse(*argv, mode="dp"):
    """The frozen Config of `argv` as a script of `mode` resolves it, in-process (the platform variables of this
    process apply: take the no_platform_env fixture)."""
    from common import cli

    return cli.parse_args(cli.build_parser("test"), [str(arg) for arg in argv], mode=mode)


def cpu_runtime(rank=0, world_size=1, mode="dp"):
    """This process as rank `rank` of `world_size` on the CPU (no process group: what a rank computes alone)."""
    import torch

    from common.distributed import Runtime

    return Runtime(mode, torch.device("cpu"), rank, rank, world_size, world_size)


# The smallest model of each classification family torchvision lists, and a crop it takes (the smallest
# that is a multiple of 32 and at least its minimum; ViT and MaxViT take 224 alone, Inception v3's
# auxiliary head needs 299 in training).
FAMILIES = {
    "alexnet": ("alexnet", 64),
    "convnext": ("convnext_tiny", 32),
    "densenet": ("densenet121", 32),
    "efficientnet": ("efficientnet_b0", 32),
    "googlenet": ("googlenet", 32),
    "inception": ("inception_v3", 299),
    "maxvit": ("maxvit_t", 224),
    "mnasnet": ("mnasnet0_5", 32),
    "mobilenet": ("mobilenet_v3_small", 32),
    "regnet": ("regnet_x_400mf", 32),
    "resnet": ("resnet18", 32),
    "resnext": ("resnext50_32x4d", 32),
    "shufflenet": ("shufflenet_v2_x0_5", 32),
    "squeezenet": ("squeezenet1_1", 32),
    "swin": ("swin_t", 32),
    "vgg": ("vgg11", 32),
    "vit": ("vit_b_16", 224),
    "wide_resnet": ("wide_resnet50_2", 32),
}


def built_trainer(*argv, trainer=None, datasets=None, runtime=None):
    """A Trainer built in-process from `argv` (trainer: a Trainer subclass), on `datasets` (else what the flags
    name), as common/run.py builds one for a fresh run (seed: --seed, else 0), without the lock, the agreement or a
    checkpoint."""
    from common.trainer import Trainer

    config = parse(*argv)
    made = (trainer or Trainer)(config, runtime or cpu_runtime())
    return made.build(datasets if datasets is not None else made.build_datasets(), config.seed or 0)


@pytest.fixture
def group_of_one():
    """A process group of one in this process (gloo, in-memory store), for the in-process tests of FSDP and its
    checkpoints: fully_shard and Distributed Checkpoint need one, and a group of one shards nothing away."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded_trainer(*argv, datasets=None, trainer=None):
    """A Trainer of train_fsdp.py built in-process on tiny in-memory data (inside group_of_one)."""
    from common.fsdp import Sharding
    from common.sharded_checkpoint import ShardedCheckpoints
    from common.trainer import Trainer

    config = parse(
        "--train-crop-size",
        "16",
        "--val-resize-size",
        "16",
        "--val-crop-size",
        "16",
        "-j",
        "0",
        "-b",
        "4",
        "--seed",
        "1",
        *argv,
        mode="fsdp",
    )
    runtime = cpu_runtime(mode="fsdp")
    made = (trainer or Trainer)(
        config, runtime, shard=Sharding(config, runtime), checkpoints=ShardedCheckpoints(config)
    )
    return made.build(datasets or tensor_datasets(), 1)


def tensor_datasets(size=16, train=12, val=6, channels=3):
    """(classes, train set, val set) in memory: uint8 CHW images of `size` px, item i of class i % 3, a grey level of
    its own with a little noise (tests/custom_datasets.py)."""
    from tests.custom_datasets import CLASSES, Items, pixels

    def make(index):
        return pixels(index, channels, size), index % 3

    return CLASSES, Items(train, make), Items(val, make, offset=train)


def make_image_folder(root, train_per_class=8, val_per_class=4, num_classes=3):
    """A real JPEG ImageFolder (root/train, root/val) of demo shapes."""
    demo_data.generate(root, train_per_class=train_per_class, val_per_class=val_per_class, num_classes=num_classes)
    return Path(root)


def hf_copy(folder, out, form="disk"):
    """The images of the image folder `folder` (train/, val/) as a Hugging Face dataset at `out`, in the folder's own
    order with its class indices (a ClassLabel of its classes), each image's file bytes as they are: save_to_disk's
    form ("disk"), or parquet files as the Hub lays them out (data/train-00000-of-00001.parquet, "parquet")."""
    import datasets

    from common.folder_index import scan_image_folder

    datasets.disable_progress_bars()
    classes, *splits = scan_image_folder(folder)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=classes)})
    made = {
        name: datasets.Dataset.from_dict(
            {
                "image": [{"bytes": Path(path).read_bytes(), "path": Path(path).name} for path, _ in samples],
                "label": [label for _, label in samples],
            },
            features=features,
        )
        for name, samples in zip(("train", "validation"), ([files[i] for i in range(len(files))] for files in splits))
    }
    if form == "disk":
        datasets.DatasetDict(made).save_to_disk(str(out))
    else:
        for name, split in made.items():
            split.to_parquet(str(Path(out) / "data" / f"{name}-00000-of-00001.parquet"))
    return Path(out)


def tiny_folder(tmp_path_factory):
    """3 classes, 24 train and 12 val images."""
    return make_image_folder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    return once(tiny_folder, tmp_path_factory)


# BatchNorm-free and dropout-free, so that per-process statistics and masks cannot differ; today's recipe
# without mixing (which pairs the images a process holds: docs/recipes.md), whose every part keeps DP = DDP.
EXACT_MODEL = ["-a", "tests.tiny_models:TinyNet", "--dropout", "0", "--seed", "3", "--lr", "0.05"]
RECIPE = [
    "--auto-augment",
    "ta_wide",
    "--random-erase",
    "0.5",
    "--ra-sampler",
    "--ra-reps",
    "2",
    "--model-ema",
    "--model-ema-steps",
    "2",
    "--model-ema-decay",
    "0.9",
    "--bias-weight-decay",
    "0",
    "--label-smoothing",
    "0.1",
]


def exact_folder(tmp_path_factory):
    """24 training images (3 steps of global batch 8) and 13 validation images, which neither 2 nor 3 processes
    divide: padding (DistributedSampler's) would count some twice."""
    root = make_image_folder(tmp_path_factory.mktemp("exact-data"), train_per_class=8, val_per_class=5)
    for extra in sorted((root / "val").rglob("*.jpg"))[:2]:
        extra.unlink()
    return root


@pytest.fixture(scope="session")
def exact_data(tmp_path_factory):
    return once(exact_folder, tmp_path_factory)


def exact_run(data, output_dir, *extra):
    """The flags of the compared runs: 12 steps of global batch 8, the recipe without mixing."""
    return [
        *TINY,
        *EXACT_MODEL,
        *RECIPE,
        "--data",
        data,
        "-b",
        "8",
        "--epochs",
        "4",
        "--output-dir",
        output_dir,
        *extra,
    ]


def single_node_launches(tmp_path_factory):
    """The reference runs of tests/test_distributed.py and tests/test_run_scripts.py, started together as a user
    starts them, through run_scripts/: single_node_dp.sh (train_dp.py), single_node_ddp.sh (torchrun, 2 processes)
    and single_node_spawn.sh (train_spawn.py, 2 processes). (output dir, mode -> CompletedProcess)."""
    exact_data, out = once(exact_folder, tmp_path_factory), tmp_path_factory.mktemp("single-node")
    env = {"dp": {}, "ddp": dict(NPROC_PER_NODE=2), "spawn": dict(NPROC_PER_NODE=2, MASTER_PORT=free_port())}
    commands = [
        (
            ["bash", REPO / "run_scripts" / f"single_node_{mode}.sh", *exact_run(exact_data, out / mode)],
            clean_env(PYTHON=PYTHON, **env[mode]),
        )
        for mode in env
    ]
    return out, dict(zip(env, run_together(commands)))


single_node_runs = ahead(single_node_launches, "single_node_runs", scope="session")


# A generator of its own (tests may seed the global one); the lock: runs are started from several threads.
_ports_given, _port_choice, _port_lock = set(), random.Random(), threading.Lock()


def free_port():
    """A free port on 127.0.0.1, below the range the kernel picks from for port 0 (the sockets gloo
    opens, outgoing connections): launches started side by side bind theirs seconds later, and no other
    process's socket can take it in the meantime. Never the same port twice in a session."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    while True:
        with _port_lock:
            port = _port_choice.randint(max(1024, low - 12000), low - 1)
            if port in _ports_given:
                continue
            _ports_given.add(port)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


# The managed platform's variables that set the scripts' defaults.
PLATFORM_VARIABLES = (
    "EPOCHS",
    "LR",
    "BATCH_SIZE",
    "DATASETS_PATH",
    "DATASETS",
    "WORKSPACE",
    "BACKEND",
    "WORKER_PER_NODE",
)


@pytest.fixture
def no_platform_env(monkeypatch):
    """In-process: a shell with none of the platform variables that set defaults."""
    for name in PLATFORM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def clean_env(gpu=False, **extra):
    """The environment of a user's shell: no launcher or platform variables leaking in
    (and no GPU unless `gpu`: the CPU paths are tested on every machine)."""
    env = {
        key: value
        for key, value in SESSION_ENV.items()
        if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", *PLATFORM_VARIABLES)
        and not key.startswith("SLURM_")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.update({key: str(value) for key, value in extra.items()})
    return env


def run(args, timeout=300, env=None, cwd=REPO, prewarmed=True):
    """Run a command (a list) to completion; a hang fails the test instead of the CI run. The command
    runs as a Job: on a timeout it is killed with every process it started (torchrun's workers,
    spawn's children, loader workers), whatever session they moved to."""
    job = Job(args, env=env, cwd=cwd, prewarmed=prewarmed)
    try:
        returncode, output = job.finish(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise subprocess.TimeoutExpired(job.process.args, timeout, output="".join(job.output)) from None
    return subprocess.CompletedProcess(job.process.args, returncode, output)


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


def worker_command(script, prewarmed=True):
    """What torchrun starts for each worker, as the end of its command line: `script` (torchrun's own `python -u
    script`), or, prewarmed, tests/prewarmed.py --worker, whose run of the script is forked from the prewarm
    server (Prewarmed): the same script, arguments, environment and output, without Python's start and the imports
    (about 5 s of CPU a worker). Not for a test that must stop a worker with SIGSTOP (the worker then is a shim that
    passes signals on), nor where PREWARMED=0."""
    if not prewarmed or os.environ.get("PREWARMED", "1") == "0":
        return [REPO / script]
    return ["--no-python", PYTHON, REPO / "tests" / "prewarmed.py", "--worker", Prewarmed.socket(), REPO / script]


def torchrun_command(script, nproc, *args, extra=(), prewarmed=True):
    """`torchrun --nproc_per_node=N script args` on a free loopback port (workers prewarmed: worker_command)."""
    return [
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


def torchrun(script, nproc, *args, timeout=300, env=None, extra=()):
    return run(torchrun_command(script, nproc, *args, extra=extra), timeout=timeout, env=env)


def no_traceback_of_ours(output):
    """No traceback through this repository's code (torchrun prints its own on a failed job, from the
    environment that runs the tests, which may be inside the repository: .venv, .venv-latest)."""
    return not re.search(rf'File "{re.escape(str(REPO))}/(?!{re.escape(os.path.relpath(sys.prefix, REPO))}/)', output)


def assert_ok(result):
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def process_stat(pid):
    """The fields of /proc/PID/stat after the command name ([0] state, [1] parent, [3] session), or None
    once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid):
    """Whether process `pid` exists and is not a zombie."""
    fields = process_stat(pid)
    return fields is not None and fields[0] != "Z"


def processes_marked(marker, name="JOB_MARKER"):
    """Live processes whose environment holds name=marker: a job and every descendant (torchrun's
    workers, spawn's children, loader workers), whatever session or process group they moved to."""
    needle = f"{name}={marker}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            marked = needle in (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marked and alive(entry.name):
            found.append(int(entry.name))
    return found


def processes_in_session(sid):
    """Live processes of the session `sid` (not zombies)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = process_stat(entry.name)
        if fields is not None and fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


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
        script = Path(command[1])
        if script.suffix != ".py" or not script.is_absolute() or REPO not in script.parents:
            return False
        return same_at_import(env, cls.server_env or clean_env())  # the server's, or the one it will start with

    @classmethod
    def socket(cls):
        """The server's socket, the server started first if it is not running (not once the session is over)."""
        with cls.lock:  # (stop() takes it too: no server starts while it stops one)
            if _session_over.is_set():
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
        request = {"script": command[1], "argv": command[2:], "env": env, "cwd": str(cwd)}
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


def lower_priority(pid):
    """Run process `pid` (and what it starts from now on) at a lower CPU priority than the tests: a test that waits
    for a job's line to signal it then reads the line and signals at once, though the cores are busy with jobs (a
    job that runs on too far meanwhile may end before its signal comes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, JOB_NICENESS)
    except OSError:  # ended already
        pass


JOB_NICENESS = 5
_jobs = []  # every Job not yet known to be over: killed at the end of the test that started it
_background_jobs = []  # those of runs started ahead (in_background): killed at the session's end if still running
_session_over = threading.Event()  # no job starts after it: a run started ahead may still be going on


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
    _session_over.set()
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
        if _session_over.is_set():
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
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.jobs = _background_jobs if in_background() else _jobs
        self.jobs.append(self)
        if _session_over.is_set():  # the session ended while this one started: its end may not have seen it
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
        """(returncode, output) once the job ended by itself within `timeout` s (else it is killed and
        subprocess.TimeoutExpired raised). The processes of the job still alive `grace` s after it
        ended are in self.left_behind, then killed."""
        try:
            self.process.wait(timeout=timeout)
            deadline = time.monotonic() + grace
            while self.leftovers() and time.monotonic() < deadline:
                time.sleep(0.05)
            self.left_behind = self.leftovers()
        finally:
            self.kill()
            self.reader.join(timeout=30)  # the last lines: the pipe is closed once every process is gone
        return self.process.returncode, "".join(self.output)


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

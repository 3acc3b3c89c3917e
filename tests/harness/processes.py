"""The processes of the tests' jobs: a user's environment, free ports, and what /proc says of a process."""

import contextlib
import os
import random
import signal
import socket
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
# The environment the session started with: what a job inherits (clean_env), whatever an in-process test running
# at the same time sets in os.environ (monkeypatch).
SESSION_ENV = dict(os.environ)
session_over = threading.Event()  # no job starts after it: a run started ahead may still be going on


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
    "STOP_GRACE",
)


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


JOB_NICENESS = 5


def lower_priority(pid):
    """Run process `pid` (and what it starts from now on) at a lower CPU priority than the tests: a test that waits
    for a job's line to signal it then reads the line and signals at once, though the cores are busy with jobs (a
    job that runs on too far meanwhile may end before its signal comes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, pid, JOB_NICENESS)
    except OSError:  # ended already
        pass


def _allocated_and_freed(blocks=10, block_bytes=8 << 20):
    held = [b"\x01" * block_bytes for _ in range(blocks)]  # (written: resident)
    del held


def refaulted_pages(rounds=3):
    """This process's page faults while it allocates and writes 10 blocks of 8 MiB, then frees them, `rounds` times
    after a first round: each round faulted in again where malloc gives the freed memory back to the kernel (glibc's
    default for 80 MB), next to none where it keeps it (distributed.keep_freed_host_memory). Transparent huge pages
    are turned off for the process first (where they are on for all memory, a fault maps 2 MiB)."""
    import ctypes
    import resource

    PR_SET_THP_DISABLE = 41  # linux/prctl.h
    ctypes.CDLL(None).prctl(PR_SET_THP_DISABLE, 1, 0, 0, 0)
    _allocated_and_freed()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        _allocated_and_freed()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def resident_bytes_returned_at_fork():
    """How much of this process's resident memory a fork gives back, after 10 blocks of 8 MiB were allocated,
    written and freed: about 80 MB where kept memory is returned before a fork (distributed.keep_freed_host_memory),
    none otherwise."""
    import warnings

    def resident():
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    _allocated_and_freed()
    before = resident()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (Python 3.12's, for a fork with threads: it exits)
        child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    return before - resident()


class Blocked(BaseException):
    """within()'s: a block that did not end in time."""


@contextlib.contextmanager
def within(seconds):
    """The block ended by Blocked after `seconds` (a reader blocked in open(): the test fails, not the suite); SIGALRM's
    timer, which the code under test must not use meanwhile."""

    def expired(_signum, _frame):  # (not an OSError, as TimeoutError: no handler of the code under test takes it)
        raise Blocked(f"still blocked after {seconds} s")

    before = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)

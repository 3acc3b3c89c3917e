"""common/launch.py: the one exception ladder of the three scripts: bad input one line and exit 2 (a checkpoint that
could not be written: 1), a stop on request 75, Ctrl-C 130, a lost peer or loader worker one line and 1, a bug its
traceback; a spawned worker ends through the same ladder, its usage line handed to the parent; a stop signal before
training ends the process at once, and a launcher's end (even SIGKILLed) reaches its workers as SIGTERM."""

import contextlib
import errno
import gc
import os
import re
import signal
import socket
import subprocess
import time

import pytest
import torch

from common.checkpoint import load_checkpoint
from common.diagnostics import forward_flops
from common.errors import CheckpointWriteError, Preempted, UnreadableImage, UsageError
from common.launch import (
    _start_up_stop_line,
    check_endpoint,
    known_failure,
    outcome,
    stop_at_once_until_training,
    training_starts,
    without_collections,
)
from common.models import check_input_size
from common.preemption import StopSignal
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
            RuntimeError("DataLoader worker (pid(s) 7) exited unexpectedly"),
            (
                1,
                "error: DataLoader worker (pid(s) 7) exited unexpectedly (killed for memory? fewer --workers use "
                "less; a crash? -j 0 decodes in the training process, where it shows)",
            ),
        ),
        (
            RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"),
            (1, "error: another process of this job ended, see its error; this one stops too"),
        ),
        (  # (the ranks met at the rendezvous store, but not on their own sockets: was a traceback)
            RuntimeError(
                "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.h:311] Connect "
                "timeout [none]"
            ),
            (
                1,
                "error: this job's processes could not connect to each other (gloo: Connect timeout [none]): a "
                "firewall between the nodes, or an interface the others cannot reach (GLOO_SOCKET_IFNAME)?",
            ),
        ),
        (  # (gloo's other forms: the peer it tried; "no error", what it says of a timeout)
            RuntimeError(
                "Gloo connectFullMesh failed with [../pair.cc:144] Connection refused, remote=[10.0.0.2]:17308"
            ),
            (
                1,
                "error: this job's processes could not connect to each other (gloo: Connection refused, "
                "remote=[10.0.0.2]:17308): a firewall between the nodes, or an interface the others cannot reach "
                "(GLOO_SOCKET_IFNAME)?",
            ),
        ),
        (
            RuntimeError(
                "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error"
            ),
            (
                1,
                "error: this job's processes could not connect to each other (gloo: a connect timed out): a firewall "
                "between the nodes, or an interface the others cannot reach (GLOO_SOCKET_IFNAME)?",
            ),
        ),
        (  # (another rank ended while they connected: its error is the cause)
            RuntimeError(
                "Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"
            ),
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
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried "
                "to allocate 40000000000 bytes. Error code 12 (Cannot allocate memory)"
            ),
            (
                1,
                "error: out of host memory: a tensor of 37.3 GiB could not be allocated; a smaller -b, crop size "
                "(--train-crop-size, --val-resize-size) or model, or fewer loader workers (-j)",
            ),
        ),
        (
            RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 52428800 bytes. Error"),
            (
                1,
                "error: out of host memory: a tensor of 50.0 MiB could not be allocated; a smaller -b, crop size "
                "(--train-crop-size, --val-resize-size) or model, or fewer loader workers (-j)",
            ),
        ),
        (  # (-b 1, or one image a micro-batch: was a traceback)
            ValueError(
                "Expected more than 1 value per channel when training, got input size torch.Size([1, 512, 1, 1])"
            ),
            (
                1,
                "error: a BatchNorm layer got one value per channel (a single image on a device, its activations 1x1 "
                "there): give each device 2 images or more (-b, --grad-accum-steps), or larger crops",
            ),
        ),
        (ValueError("a bug of ours"), None),
        (  # (a second spawn job took the port between the first one's check and its rank 0's store: a traceback)
            RuntimeError(
                "The server socket has failed to listen on any local network address. port: 29591, useIpv6: 0, code: "
                "-98, name: EADDRINUSE, message: address already in use"
            ),
            (
                1,
                "error: cannot listen on port 29591 (Address already in use): the port is in use; choose another "
                "(MASTER_PORT, --master-port)",
            ),
        ),
        (  # (a rendezvous no other node came to: torch's DistStoreError, a traceback after --dist-timeout)
            RuntimeError("Timed out after 21 seconds waiting for clients. 1/2 clients joined."),
            (
                1,
                "error: the rendezvous timed out: 1 of 2 processes joined in 21 s: start every node, each with its own "
                "node rank, and check MASTER_ADDR, the port and the node count",
            ),
        ),
        (  # (the other ranks on node 0, or every worker under torchrun: was a traceback)
            RuntimeError("wait timeout after 15000ms, keys: /default_pg/0//cpu//0/0"),
            (
                1,
                "error: the rendezvous timed out: not every process joined in 15 s: start every node, each with its "
                "own node rank, and check MASTER_ADDR, the port and the node count",
            ),
        ),
        (  # (a rank waiting in the store of a node 0 that ended: was a traceback)
            RuntimeError(
                "Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?"
            ),
            (1, "error: node 0's rendezvous store closed the connection: its processes ended (see their errors there)"),
        ),
        (
            RuntimeError(
                "The client socket has timed out after 900000ms while trying to connect to (10.0.0.1, 29500)."
            ),
            (
                1,
                "error: no rendezvous answered at 10.0.0.1:29500: start node 0 (node rank 0), and check MASTER_ADDR "
                "and the port",
            ),
        ),
    ],
)
def test_every_way_a_run_ends_has_its_exit_code_and_line(error, ended):
    assert outcome(error) == ended


def test_a_parameter_ddp_never_saw_a_gradient_for_is_named_in_one_line():
    assert "add --find-unused-parameters" in known_failure(
        RuntimeError("Expected to have finished reduction in the prior iteration before starting a new one.")
    )


def test_an_op_without_a_deterministic_kernel_under_deterministic_is_one_line_naming_it():
    """torch's own error (put_ has none on the CPU; VGG's and AlexNet's adaptive pooling backward none on a GPU),
    raised in the model's forward or backward: was a traceback."""
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError) as raised:
            torch.zeros(4).put_(torch.tensor([1, 1]), torch.tensor([1.0, 2.0]))
    finally:
        torch.use_deterministic_algorithms(False)
    assert outcome(raised.value) == (
        1,
        "error: --deterministic: torch has no deterministic kernel for put_, which this model uses on this device: "
        "run without --deterministic (docs/concepts.md, repeatable runs)",
    )
    said = " does not have a deterministic implementation, but you set 'torch.use_deterministic_algorithms(True)'."
    for kernel in ("adaptive_avg_pool2d_backward_cuda", "median CUDA with indices output"):
        assert f"kernel for {kernel}, which" in known_failure(RuntimeError(kernel + said))
    replica = "Caught RuntimeError in replica 0 on device 0.\nOriginal Traceback (most recent call last):\n  File "
    assert f"kernel for {kernel}, which" in known_failure(RuntimeError(f"{replica}...\nRuntimeError: {kernel}{said}"))


def test_a_view_that_channels_last_memory_cannot_take_keeps_its_traceback_with_a_hint():
    """L-BFGS flattens NHWC gradients with .view(-1): a traceback (the view may be the researcher's own code, which it
    locates) with a note naming --channels-last off (was: the traceback alone)."""
    model = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    model(torch.ones(1, 3, 5, 5).to(memory_format=torch.channels_last)).sum().backward()
    optimizer = torch.optim.LBFGS(model.parameters())
    with pytest.raises(RuntimeError, match="view size is not compatible") as raised:
        optimizer.step(lambda: model(torch.ones(1, 3, 5, 5)).sum())
    assert outcome(raised.value) is None  # (a traceback)
    assert "give --channels-last off" in raised.value.__notes__[0]


# Each case runs main() as a script's __main__ does (run_main, run_worker), in one interpreter of its own (they end
# the process's loader workers and set its signal handlers on the way out).
CASES = """import gc, queue, sys
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
def parse():
    print("parse: gc on", gc.isenabled())
    return 7

code = run_main(lambda config: print("main: gc on", gc.isenabled(), config), parse)
print("after: gc on", gc.isenabled(), code, flush=True)
lines = queue.Queue()
full = []  # the full collections from here on
gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2 and full.append(phase))
run_worker(0, lambda: print("worker: torchvision", "torchvision" in sys.modules, len(full), gc.isenabled()), lines)
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
        "parse: gc on False",  # (the imports without full collections: without_collections)
        "main: gc on True 7",
        "after: gc on True 0",
        "worker: torchvision True 1 True",  # imported by run_worker in one full collection; the collector on again
        "worker-usage 2 (2, 'error: -b 9')",
        "worker-lost 1 None",
    ], result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        "error: --lr must be positive",
        "error: rank 3: another process of this job ended, see its error; this one stops too",
    ], result.stderr


def test_numpy_is_imported_where_a_stop_signal_raised_inside_its_import_ends_the_process():
    """torch's C code imports numpy and catches what is raised there: a SIGTERM in that import (the start-up's
    Preempted) left numpy.linalg half imported, and the run ended in a RecursionError traceback, exit code 1. The
    start-up imports it itself, from Python, once its handlers are set: a stop there ends the process with 75."""
    spy = (
        "import os, signal, sys\nfrom common import launch\nsignal.signal(signal.SIGTERM, lambda *_: None)\n"
        "class Stop:\n    def find_spec(self, name, path, target=None):\n"
        "        if name == 'numpy.linalg': os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.meta_path.insert(0, Stop())\n"
        "def main(args): print('trained', flush=True)\n"
        "sys.exit(launch.run_main(main, lambda: print('torch' in sys.modules, flush=True)))"
    )
    result = subprocess.run([PYTHON, "-c", spy], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (75, ""), result.stdout + result.stderr
    assert result.stderr.startswith("stopped on SIGTERM before training started: nothing was trained"), result.stderr


def test_a_process_killed_at_a_fault_says_where():
    """SIGBUS (a Hugging Face dataset's memory-mapped file made shorter while -j 0 read it), SIGSEGV: Python's stack
    where it happened (faulthandler), where the process ended without a word (exit code 135)."""
    crash = (
        "import os, signal\nfrom common.launch import run_main\n"
        "def reads_a_row(args): os.kill(os.getpid(), signal.SIGBUS)\nrun_main(reads_a_row, lambda: None)"
    )
    result = subprocess.run(
        [PYTHON, "-c", crash], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == -signal.SIGBUS and "Fatal Python error: Bus error" in result.stderr, result.stderr
    assert re.search(r'File "<string>", line 3 in reads_a_row', result.stderr), result.stderr


def test_a_stop_signal_before_training_ends_the_process_at_once_with_preempted():
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM)}
    try:
        stop_at_once_until_training()
        with pytest.raises(Preempted, match="stopped on SIGTERM before training started: nothing was trained"):
            os.kill(os.getpid(), signal.SIGTERM)
        # Caught here, as an `except Exception` on the start-up's way would: training's start (its StopSignal) raises
        # it again, and ends the watch.
        with pytest.raises(Preempted, match=r"before training started: .* \(its start-up went on after it\)$"):
            StopSignal(30.0)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and signal.set_wakeup_fd(-1) == -1
    finally:
        training_starts()  # (ended: nothing more) Ctrl-C is Python's again
        for signum, handler in before.items():
            signal.signal(signum, handler)


# Start-up's watch, in interpreters of their own. WATCHED: a signal the main thread takes, one in a child forked in
# start-up, the watch's end when training starts, and a wait where Python runs no handler (a read the kernel
# restarts). SWALLOWED: a stop the main thread took but did not end on (its clean-up hung, say), the watch's thread
# late to read it.
WATCHED = """import os, signal, threading, time
from common import launch
from common.errors import Preempted
launch.STOP_UNHANDLED_AFTER, launch.STOP_HANDLED_WITHIN = 0.3, 5.0
launch.stop_at_once_until_training()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)
except Preempted:
    time.sleep(0.6)
    print("taken, still here", flush=True)
child = os.fork()
if child == 0:
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    except Preempted:
        os._exit(5)
print("child", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), flush=True)
try:
    launch.training_starts()
except Preempted as stop:
    print("raised again at training's start:", str(stop).endswith("(its start-up went on after it)"))
time.sleep(0.1)
watching = [thread.name for thread in threading.enumerate() if thread.name == "stop signals in start-up"]
print("watch ended", watching, signal.set_wakeup_fd(-1), signal.getsignal(signal.SIGINT) is signal.default_int_handler)
launch.stop_at_once_until_training()
signal.siginterrupt(signal.SIGTERM, False)  # the kernel restarts the read: Python never sees the signal
empty, _ = os.pipe()
print("waiting", flush=True)
threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
os.read(empty, 1)
"""
SWALLOWED = """import os, signal, sys, time
from common import launch
from common.errors import Preempted
launch.STOP_UNHANDLED_AFTER, launch.STOP_HANDLED_WITHIN = 0.3, 0.5
launch.stop_at_once_until_training()
sys.setswitchinterval(5.0)  # the watch's thread reads the signal's number late: once the handlers are set aside
try:
    os.kill(os.getpid(), signal.SIGTERM)
except Preempted:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # as the clean-up on the way out does (preemption.before_exit)
    print("swallowed", flush=True)
time.sleep(10)
"""
# Two stop signals at once (Slurm signals every process of a step, torchrun passes its own on): one stop, one line;
# and the watch ends with the run (a process that goes on, a notebook's, starts afresh).
TWO_AT_ONCE = """import os, signal
from common import launch
def main(_config):
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR1)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGUSR1})
print("exit", launch.run_main(main, lambda: None), "watch", launch._watch, flush=True)
"""
STOP = "stopped on SIGTERM before training started: nothing was trained, no checkpoint written; start it again as it "


def test_start_up_s_watch_ends_a_process_whose_main_thread_cannot_take_a_stop_signal_or_end_on_it():
    watched, swallowed, two = (
        subprocess.run([PYTHON, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60)
        for code in (WATCHED, SWALLOWED, TWO_AT_ONCE)
    )
    assert watched.stdout.splitlines() == [
        "taken, still here",
        "child 5",  # its signal its own: the parent's watch did not see it
        "raised again at training's start: True",
        "watch ended [] -1 True",
        "waiting",
    ], watched.stdout + watched.stderr
    assert watched.returncode == 75, watched.stderr
    assert watched.stderr.splitlines() == [
        f"{STOP}was started (waiting outside Python: a rendezvous, a collective or a read)"
    ]
    assert (swallowed.returncode, swallowed.stdout) == (75, "swallowed\n"), swallowed.stderr
    assert swallowed.stderr.splitlines() == [f"{STOP}was started (still running 0.5 s after it)"]
    assert (two.returncode, two.stdout) == (0, "exit 75 watch None\n"), two.stderr
    assert len(two.stderr.splitlines()) == 1 and two.stderr.startswith("stopped on SIG"), two.stderr


class StoppedInForward(torch.nn.Module):
    """A model whose forward is where a stop signal's handler runs (it raises Preempted there)."""

    def forward(self, *_args, **_kwargs):
        raise Preempted(_start_up_stop_line("SIGTERM"))


def test_a_stop_signal_in_start_up_is_never_taken_for_a_model_s_or_a_checkpoint_s_fault(tmp_path, monkeypatch):
    """Seen: SIGTERM during the checkpoint's load read as a damaged file (exit 2; --resume auto went on from the one
    before and trained), and in the start-up checks' forwards as the model's failure (the run went on)."""
    with pytest.raises(Preempted):
        check_input_size(StoppedInForward(), "resnet18", [32], 32, 3, 2)
    with pytest.raises(Preempted):
        forward_flops(StoppedInForward(), 32, 3)
    path = tmp_path / "checkpoint.pth"
    torch.save({"state_dict": {}}, path)
    monkeypatch.setattr(torch, "load", StoppedInForward().forward)  # (torch's load, where the handler ran)
    with pytest.raises(Preempted):
        load_checkpoint(path)


LAUNCHED = """import os, signal, sys, time
sys.path.insert(0, {repo!r})
from common.launch import end_with_launcher
launcher = os.getppid()
signal.signal(signal.SIGTERM, lambda *_: (print("SIGTERM, launcher gone:", os.getppid() != launcher, flush=True),
                                          sys.exit(0)))
end_with_launcher()
print("ready", os.getpid(), flush=True)
time.sleep(30)
"""

LAUNCHER = """import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True)  # a session of its own, as torchrun's
time.sleep(60)
"""


def test_a_process_that_a_launcher_started_gets_sigterm_when_the_launcher_is_sigkilled(tmp_path):
    """end_with_launcher in the worker of a stand-in launcher that starts it as torchrun does (a session of its own):
    SIGKILL to the launcher alone, and the worker gets SIGTERM from the kernel, as if the launcher had sent it."""
    import subprocess
    import time

    from harness.processes import PYTHON, REPO

    output, worker = tmp_path / "worker.out", None
    with open(output, "w") as out:
        launcher = subprocess.Popen([PYTHON, "-c", LAUNCHER, LAUNCHED.format(repo=str(REPO))], stdout=out)
    try:
        deadline = time.monotonic() + 30
        while not output.read_text().endswith("\n") and time.monotonic() < deadline:
            time.sleep(0.05)
        ready, worker = output.read_text().split()
        assert ready == "ready"
        launcher.kill()
        launcher.wait()
        while output.read_text().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert output.read_text().splitlines()[1:] == ["SIGTERM, launcher gone: True"]
    finally:
        launcher.kill()
        launcher.wait()
        if worker is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(worker), signal.SIGKILL)


def test_the_arguments_are_parsed_with_the_garbage_collector_off_and_it_is_on_again_after_even_on_an_error():
    seen = []
    assert without_collections(lambda: seen.append(gc.isenabled()) or "config") == "config"
    assert seen == [False] and gc.isenabled()

    def refused():
        raise UsageError("--lr must be positive")

    with pytest.raises(UsageError):
        without_collections(refused)
    assert gc.isenabled()


def test_what_the_parse_imported_is_moved_to_the_oldest_generation_in_one_collection():
    # Left in the youngest generation, the import's objects would be scanned by its next collections, then the next's.
    made = without_collections(lambda: [[index] for index in range(100_000)])
    oldest = {id(item) for item in gc.get_objects(generation=2)}
    assert id(made) in oldest and all(id(item) in oldest for item in made[::1000])
    few = without_collections(lambda: [[index] for index in range(1_000)])  # (torch imported before: no scan)
    assert id(few) not in {id(item) for item in gc.get_objects(generation=2)}


def test_a_spawned_worker_that_a_passed_on_stop_signal_killed_while_it_started_is_a_stop_before_training():
    """train_spawn.py passes a stop signal on to its workers; one still in spawn's own start-up (before its handlers)
    dies of it: exit 75 and start-up's line, as a stop before training (was 143 and "process 0 exited (SIGTERM)")."""
    import torch.multiprocessing as mp

    from common.launch import worker_ended

    def ended(code, name=None):
        return mp.ProcessExitedException("ended", 0, 123, code, name)

    assert worker_ended(ended(-signal.SIGTERM, "SIGTERM"), {signal.SIGTERM}) == (f"{STOP}was started", 75)
    assert worker_ended(ended(-signal.SIGINT, "SIGINT"), {signal.SIGINT}) == (None, 130)
    assert worker_ended(ended(-signal.SIGTERM, "SIGTERM"), set()) == (
        "error: process 0 exited (SIGTERM); see the errors above",
        143,
    )  # (killed by someone else: a crash to report)
    assert worker_ended(ended(75), {signal.SIGTERM}) == (None, 75) and worker_ended(ended(2), set())[1] == 2


def test_the_launchers_check_of_their_endpoint_waits_for_a_name_to_resolve_and_finds_a_port_in_use(capsys):
    """run_scripts/ (check_endpoint): a platform's name for node 0 may come to its DNS after the nodes start, so the
    launchers wait for it as torchrun would, saying so; then one line. Node 0's port in use on any address."""
    start = time.monotonic()
    with pytest.raises(UsageError, match=r"^the rendezvous host no-such-host\.invalid does not resolve to an address"):
        check_endpoint("no-such-host.invalid", 29999, False, 1)
    assert time.monotonic() - start >= 1
    assert capsys.readouterr().err.splitlines() == [
        "note: MASTER_ADDR no-such-host.invalid does not resolve yet: waiting up to 1 s (MASTER_ADDR_WAIT)"
    ]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        check_endpoint("[::1]", port, False, 0)  # (a node past the first: it listens nowhere)
        with pytest.raises(UsageError, match=rf"^cannot listen on port {port} \(Address already in use\): the port"):
            check_endpoint("[::1]", port, True, 0)

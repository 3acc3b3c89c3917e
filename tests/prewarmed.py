"""Run scripts, each run a process of its own forked from this interpreter after it imported torch,
torchvision, common/ and what else the script imports.

    python tests/prewarmed.py --serve SOCKET    # a run per request on a unix socket: harness.prewarm.Prewarmed
    python tests/prewarmed.py SPEC.json         # one script, several runs: harness.jobs.run_prewarmed
    torchrun ... --no-python PYTHON tests/prewarmed.py --worker SOCKET SCRIPT ARGS...   # harness.jobs.torchrun_command

The server also runs torchrun's launcher itself (a request whose script is "-m torch.distributed.run"), as
`python -m torch.distributed.run` runs it. What a run starts with multiprocessing's spawn is forked from it
(spawn_by_fork); the Python commands it starts with subprocess go through the worker shim (ThroughServer).

SPEC: {"script": path, "runs": [[argv...], ...], "envs": [{...} or null, ...], "outputs": [path, ...],
"parallel": 2, "timeout": seconds}. Each run is `python script argv` with stdout and stderr in its
output file and its own environment; the exit codes (negative: killed by that signal) are written
to SPEC.json.result. What importing printed is written there too: a real process would print it.

Starting Python and importing torch costs about 5 s of CPU here; the runs that end in a usage error
take a fraction of a second after that. Everything from the script's first line on runs in the
child as in `python script`: the script is executed as __main__ (runpy), with its own sys.argv,
environment, working directory and exit code; an uncaught exception prints its traceback and exits 1.
"""

import atexit
import contextlib
import gc
import importlib.util
import io
import json
import multiprocessing.process
import multiprocessing.util
import os
import re
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from pathlib import Path

# Variables that torch, its libraries or Python read when starting or importing: a prewarmed run must have the
# server's values (OpenMP reads OMP_NUM_THREADS once, when torch loads it). torchrun's own (TORCHELASTIC_*, the NCCL
# error handling) are read at run time.
IMPORT_TIME = re.compile(r"^(OMP_|MKL_|KMP_|GOMP_|OPENBLAS|TORCH|PYTORCH|PYTHON|LD_|CUDA_|NVIDIA|NCCL|GLOO|TF_)")
RUN_TIME = re.compile(r"^(TORCHELASTIC_|TORCH_NCCL_ASYNC_ERROR_HANDLING$)")


def same_at_import(env, reference):
    """Whether `env` holds `reference`'s values of every variable read at import time."""
    keys = {key for key in (*env, *reference) if IMPORT_TIME.match(key) and not RUN_TIME.match(key)}
    return all(env.get(key) == reference.get(key) for key in keys)


def print_traceback():
    """The exception being handled, as Python prints it at exit: from runpy's frames on (as `python -m module`
    prints it), without this file's frame before them."""
    kind, error, frames = sys.exc_info()
    while frames is not None and frames.tb_frame.f_code.co_filename == __file__:
        frames = frames.tb_next
    traceback.print_exception(kind, error, frames)


def child(script, argv, env, output, cwd=None, errors=None):
    """Run `python script argv` in this (forked) process and exit with its code, as CPython would: output
    (a path, or an open file descriptor) becomes stdout, and stderr unless `errors` (a descriptor) is given;
    a session of its own. The processes it starts with multiprocessing's spawn are forked too (spawn_by_fork)."""
    os.setsid()
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if isinstance(output, str) else output
    os.dup2(fd, 1)
    os.dup2(fd if errors is None else errors, 2)
    os.close(fd)
    if errors is not None:
        os.close(errors)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    multiprocessing.util.spawnv_passfds = spawn_by_fork
    if SERVER_SOCKET is not None:
        subprocess.Popen = ThroughServer
        launcher = sys.modules.get(TORCHRUN_POPEN)
        if getattr(launcher, "Popen", None) is POPEN:
            launcher.Popen = ThroughServer
    module = script[len("-m ") :] if script.startswith("-m ") else None  # `python -m module argv`: torchrun
    sys.argv = [script, *argv]  # (run_module makes argv[0] the module's file, as `python -m` does)
    sys.path[0] = os.getcwd() if module else os.path.dirname(script)
    if module:
        exit_as_python(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True))
    exit_as_python(lambda: runpy.run_path(script, run_name="__main__"))


def exit_as_python(run):
    """run(), then exit as CPython ends a program: its exit code, an uncaught exception's traceback and 1, killed by
    SIGINT on an uncaught KeyboardInterrupt; non-daemon threads waited for and atexit's functions run first."""
    code, interrupted = 0, False
    try:
        run()
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        print_traceback()
        interrupted = True  # CPython ends on an uncaught KeyboardInterrupt killed by SIGINT
    except BaseException:
        print_traceback()
        code = 1
    try:
        threading._shutdown()  # as at interpreter exit: non-daemon threads are waited for, then atexit
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(ValueError, OSError):  # (closed: the resource tracker closes stdout)
                stream.flush()
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


SPAWNV_PASSFDS = multiprocessing.util.spawnv_passfds


def spawn_by_fork(path, args, passfds):
    """In a prewarmed run, multiprocessing's start of `python -c CODE ...` (torch.multiprocessing.spawn's processes,
    its resource tracker): a fork of the run that runs CODE as a new interpreter would, with a __main__ of its own, the
    descriptors it would have (0-2 and `passfds`) and no Python signal handler, so that the imports are not paid
    again (about 7 s of CPU each). Still the run's child: its launcher check and PR_SET_PDEATHSIG hold."""
    if "-c" not in args[:-1]:
        return SPAWNV_PASSFDS(path, args, passfds)
    code, argv = args[args.index("-c") + 1], args[args.index("-c") + 2 :]
    sys.stdout.flush()
    sys.stderr.flush()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # (no handler of the run's in the fork)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        return pid
    try:  # (never back into the run's frames)
        gc.freeze()  # the run's garbage is not the fork's to collect (it may own descriptors closed below)
        keep = {0, 1, 2, *map(int, passfds)}
        for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
            if fd not in keep:
                with contextlib.suppress(OSError):
                    os.close(fd)
        for signum in signal.valid_signals():
            if signum == signal.SIGINT and signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, signal.default_int_handler)
            elif callable(signal.getsignal(signum)):
                signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        multiprocessing.util._finalizer_registry.clear()  # the run's, as spawn's _bootstrap clears them in a fork
        multiprocessing.process._children.clear()
        main = sys.modules["__main__"] = types.ModuleType("__main__")
        sys.argv = ["-c", *argv]
        exit_as_python(lambda: exec(compile(code, "<string>", "exec"), main.__dict__))
    finally:
        os._exit(1)


SERVER_SOCKET = None  # the server's socket, in the runs it forks
REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def through_server(args, options):
    """`args` of a Python command that a prewarmed run starts (`python /abs/script.py ...` of this repository, or
    torchrun's launcher `python -m torch.distributed.run ...`), given no option the shim would take in the run's
    place: the worker shim's command (tests/prewarmed.py --worker), which has the server fork the run; anything else
    as it is."""
    if not isinstance(args, (list, tuple)) or len(args) < 2 or str(args[0]) != sys.executable:
        return args
    if any(options.get(name) for name in ("executable", "shell", "pass_fds", "preexec_fn", "stdin")):
        return args
    rest = [str(part) for part in args[1:]]
    rest = rest[1:] if rest[0] == "-u" else rest  # (torchrun's workers; the server's output is unbuffered)
    if rest[:2] == ["-m", "torch.distributed.run"]:
        script, argv = "-m torch.distributed.run", rest[2:]
    elif rest and os.path.isabs(rest[0]) and rest[0].startswith(REPO_DIR + os.sep) and rest[0].endswith(".py"):
        script, argv = rest[0], rest[1:]
    else:
        return args
    if script == os.path.abspath(__file__):
        return args
    return [sys.executable, __file__, "--worker", SERVER_SOCKET, script, *argv]


POPEN = subprocess.Popen


class ThroughServer(POPEN):
    """subprocess.Popen in a prewarmed run (torchrun's launcher's too): its Python commands forked from the server
    (through_server), so that a tool's jobs (tools/gpu_check.py's) and torchrun's workers do not import torch again."""

    def __init__(self, args, *more, **options):
        super().__init__(through_server(args, options), *more, **options)


# Where torchrun's launcher took subprocess.Popen by name (torch 2.15); a later torch that moved it: not prewarmed
TORCHRUN_POPEN = "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"


def import_everything(script_dir):
    """Import torch, torchvision, every module of common/ (the scripts import most of them only after
    parsing their arguments) and TensorBoard's writer; returns what importing printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        for name in [
            "torch",
            "torchvision",
            "torch.utils.tensorboard",
            "torch.distributed.launcher.api",  # (what torchrun's launcher, torch.distributed.run, imports)
            *(f"common.{path.stem}" for path in sorted(Path(script_dir).glob("common/*.py"))),
        ]:
            importlib.import_module(name)
    return printed.getvalue()


def read_request(connection):
    """(request, fds) of a JSON line and the descriptors attached to it (SCM_RIGHTS), or (None, fds)."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 2)
    while message and not message.endswith(b"\n"):  # a stream: the request may come in parts
        part = connection.recv(1 << 16)
        if not part:
            break
        message += part
    try:
        return json.loads(message), fds
    except ValueError:  # the test that asked went away
        return None, fds


def serve(socket_path):
    """Fork a run for each request on the unix socket `socket_path`: a JSON line {script, argv, env, cwd} with the
    write end of the run's output pipe attached (SCM_RIGHTS; harness.prewarm.Prewarmed), or {..., "worker": true} with
    stdout and stderr of a torchrun worker (`--worker`), which falls back to a new interpreter ({"exec": true})
    when its environment differs from this one's in what is read at import. Replies {"pid": ...}, then {"exit":
    code} once the run ended (negative: killed by that signal). A run whose client goes away first (SIGKILLed) is
    killed, with its session. Each run of a job is listed as SOCKET.runs/JOB_MARKER/PID for harness.jobs.Job to find."""
    global SERVER_SOCKET
    SERVER_SOCKET = socket_path
    repo = str(Path(__file__).resolve().parents[1])
    sys.path[0] = repo
    environment = dict(os.environ)  # (importing torch sets TORCHINDUCTOR_CACHE_DIR)
    printed = import_everything(repo)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    print(json.dumps({"ready": True, "import_output": printed}), flush=True)
    runs, clients = {}, {}  # pid -> the connection that waits for its exit code; connection -> pid
    while True:
        readable, _, _ = select.select([listener, sys.stdin, *clients], [], [], 0.02)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            break  # the test session ended
        for connection in [ready for ready in readable if ready in clients]:
            with contextlib.suppress(OSError):
                if not connection.recv(1 << 12):  # the client is gone (killed): so is its run
                    os.killpg(clients.pop(connection), signal.SIGKILL)
        if listener in readable:
            connection, _ = listener.accept()
            request, fds = read_request(connection)
            if request is None or (request.get("worker") and not same_at_import(request["env"], environment)):
                if request is not None:
                    connection.sendall(json.dumps({"exec": True}).encode() + b"\n")
                for fd in fds:
                    os.close(fd)
                connection.close()
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                for other in runs.values():
                    other.close()
                child(
                    request["script"],
                    request["argv"],
                    request["env"],
                    fds[0],
                    request["cwd"],
                    fds[1] if len(fds) > 1 else None,
                )
            for fd in fds:
                os.close(fd)
            marker = request["env"].get("JOB_MARKER")
            if marker:
                os.makedirs(f"{socket_path}.runs/{marker}", exist_ok=True)
                open(f"{socket_path}.runs/{marker}/{pid}", "w").close()
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            runs[pid], clients[connection] = connection, pid
        while runs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in runs:
                connection = runs.pop(pid)
                clients.pop(connection, None)
                with contextlib.suppress(OSError):
                    connection.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
                connection.close()
    for pid in runs:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


PASSED_ON = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGHUP,
    signal.SIGQUIT,
)  # by a worker shim to its run


def worker(socket_path, script, argv):
    """A torchrun worker (or a run's Python subprocess: ThroughServer) whose run is forked from the server at
    `socket_path` (a process of its own, running `script` as __main__ with this process's arguments, environment,
    working directory, stdout and stderr): it passes on the signals it gets (torchrun signals its worker's process
    group, the run has a session of its own), and ends as the run ended (its exit code, or killed by the same
    signal). Killed (SIGKILL), the server kills the run. An environment of other import-time values: a new
    interpreter, as it would have been."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(socket_path)
    request = {"script": script, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "worker": True}
    socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [1, 2])
    replies = connection.makefile("rb")
    reply = json.loads(replies.readline())
    if reply.get("exec"):
        command = ["-m", script[len("-m ") :]] if script.startswith("-m ") else ["-u", script]
        os.execv(sys.executable, [sys.executable, *command, *argv])
    pid = reply["pid"]

    def pass_on(signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for signum in PASSED_ON:
        signal.signal(signum, pass_on)
    line = replies.readline()
    code = json.loads(line)["exit"] if line else -signal.SIGKILL
    for signum in PASSED_ON:
        # The run has ended: a late signal (torchrun stopping the other workers) must not end this process
        # otherwise than the run ended. (At exit, Python puts back the default action of a Python handler.)
        signal.signal(signum, signal.SIG_IGN)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def main(spec_path):
    with open(spec_path) as file:
        spec = json.load(file)
    script = os.path.abspath(spec["script"])
    sys.path[0] = os.path.dirname(script)
    # Import torch, torchvision and every module of common/ (the scripts import most of them only
    # after parsing their arguments), and the script as a module (its `if __name__ == "__main__"`
    # does not run): done once, here. Whatever that prints is reported.
    printed = io.StringIO(import_everything(os.path.dirname(script)))
    printed.seek(0, io.SEEK_END)
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        module_spec = importlib.util.spec_from_file_location("_prewarmed_script", script)
        module_spec.loader.exec_module(importlib.util.module_from_spec(module_spec))
    runs, envs, outputs = spec["runs"], spec["envs"], spec["outputs"]
    deadline = time.monotonic() + spec["timeout"]
    codes, running, pending = [None] * len(runs), {}, list(range(len(runs)))
    while pending or running:
        while pending and len(running) < spec["parallel"]:
            index = pending.pop(0)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                child(script, runs[index], envs[index], outputs[index])
            running[pid] = index
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                for late in running:
                    os.killpg(late, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.02)
            continue
        if pid in running:
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    with open(spec_path + ".result", "w") as file:
        json.dump({"codes": codes, "import_output": printed.getvalue()}, file)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main(sys.argv[1])

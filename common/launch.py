"""How a training process ends: one exception ladder for the three scripts; a stop signal before training starts, and
the end of the launcher that started it. It imports no torch.

Bad input (UsageError) is one line on stderr and exit code 2 (a checkpoint that could not be written: 1); a stop
on request (Preempted) exits 75; Ctrl-C 130; a failure that is not this process's own fault (a lost peer, a
killed loader worker) one line and 1. Anything else is a bug, and its traceback is the report.
"""

import contextlib
import ctypes
import errno
import faulthandler
import gc
import importlib
import multiprocessing
import os
import re
import signal
import socket
import sys
import threading
import time
import traceback

from .errors import NO_ROOM, PREEMPTED_EXIT_CODE, Preempted, UsageError, console_never_fails, say

# A write the file system refused: full, over quota, read-only, or over the process's file size limit (RLIMIT_FSIZE).
DISK_FULL = (*NO_ROOM, errno.EROFS)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a launcher's or scheduler's request to stop


STOP_UNHANDLED_AFTER = 2.0  # seconds a signal in start-up waits for the main thread before start-up's watch ends it
STOP_HANDLED_WITHIN = 30.0  # seconds after the main thread took it, for the process to end (its clean-up)
_watch = None  # start-up's watch of the stop signals (_Watch), until training starts
_FORK_HOOK = []  # registered once a process


def _start_up_stop_line(name):
    return (
        f"stopped on {name} before training started: nothing was trained, no checkpoint written; start it again as it "
        "was started"
    )


def worker_ended(error, passed):
    """(line or None, exit code) of train_spawn.py whose worker ended as `error` (spawn's ProcessExitedException)
    says, with no line of its own; `passed`: the signals it passed on to the workers. A worker that one of those
    killed was still starting (spawn's own start-up, before its handlers): stopped as start-up's stops are."""
    if error.exit_code < 0 and -error.exit_code in passed:
        interrupted = -error.exit_code == signal.SIGINT
        line = None if interrupted else _start_up_stop_line(signal.Signals(-error.exit_code).name)
        return line, 130 if interrupted else PREEMPTED_EXIT_CODE
    if error.exit_code in (PREEMPTED_EXIT_CODE, 130):  # stopped on request: the worker said so
        return None, error.exit_code
    line = f"error: process {error.error_index} exited ({error.signal_name or error.exit_code}); see the errors above"
    # A worker killed by a signal: 128 + its number, as a shell reports it (a negative code would exit 256 - N).
    return line, 128 - error.exit_code if error.exit_code < 0 else error.exit_code or 1


def _stop_during_start_up(signum, _frame):
    if _watch is not None:
        if _watch.taken:  # a second one (Slurm signals every process, torchrun passes its own on): one stop
            return
        _watch.taken = signal.Signals(signum).name
        _watch.handled.set()
    raise Preempted(_start_up_stop_line(signal.Signals(signum).name))


def _interrupted_during_start_up(_signum, _frame):
    if _watch is not None:
        _watch.handled.set()
    raise KeyboardInterrupt


def stop_at_once_until_training():
    """From process start to the first step (imports, the folder scan, the checkpoint load: minutes on ImageNet
    over NFS) a stop signal ends the process at once with PREEMPTED_EXIT_CODE, as a stop in training does
    (not 143, a death by SIGTERM), and Ctrl-C with 130, even while torch waits in C++ (start-up's watch);
    preemption.StopSignal takes over when training starts (training_starts)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _stop_during_start_up)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_during_start_up)
    _Watch.start()
    # numpy imported here, where a stop's Preempted raised inside its import reaches the caller: torch's C code imports
    # it too and catches what is raised there (numpy.linalg was left half imported: a RecursionError, exit code 1).
    with contextlib.suppress(ImportError):
        import numpy  # noqa: F401


class _Watch:
    """Start-up's watch: a thread reads each signal's number from Python's wakeup fd, and ends the process where the
    main thread has not taken the signal within STOP_UNHANDLED_AFTER s, or has not ended STOP_HANDLED_WITHIN s after
    it took it. Python runs a handler only in the main thread, between bytecodes; torch's rendezvous and collectives
    wait in C++ (for a rank that never comes: up to --dist-timeout)."""

    def __init__(self):
        self.read, self.write = os.pipe()
        os.set_blocking(self.write, False)
        self.handled, self.ended = threading.Event(), threading.Event()
        self.taken = None  # the stop signal the main thread took (its Preempted), if one did

    @classmethod
    def start(cls):
        """Once a process, in its main thread; not where the wakeup fd is another's (an event loop)."""
        global _watch
        if _watch is not None or threading.current_thread() is not threading.main_thread():
            return
        watch = cls()
        previous = signal.set_wakeup_fd(watch.write, warn_on_full_buffer=False)
        if previous != -1:
            signal.set_wakeup_fd(previous)
            return watch.close()
        _watch = watch
        if not _FORK_HOOK:
            _FORK_HOOK.append(os.register_at_fork(after_in_child=_forget_watch))
        threading.Thread(target=watch.run, name="stop signals in start-up", daemon=True).start()

    def run(self):
        try:
            while (data := os.read(self.read, 64)) and 0 not in data:  # (0: training started)
                for signum in data:
                    self._end_unless_handled(signum, signal.getsignal(signum))
        finally:
            os.close(self.read)

    def _end_unless_handled(self, signum, handler):
        if handler not in (_stop_during_start_up, _interrupted_during_start_up):
            if not (self.handled.is_set() and signum in (*STOP_SIGNALS, signal.SIGINT)):
                return  # another signal (a loader worker's SIGCHLD)
            # The main thread took it before this thread read its number, and has since set the handlers aside (the
            # clean-up on the way out ignores stop signals): it must still end.
            handler = _interrupted_during_start_up if signum == signal.SIGINT else _stop_during_start_up
        why = "waiting outside Python: a rendezvous, a collective or a read"
        if self.handled.wait(STOP_UNHANDLED_AFTER) or signal.getsignal(signum) is not handler:
            # The main thread took it (Preempted, KeyboardInterrupt) and ends the process; one that has not ended
            # within STOP_HANDLED_WITHIN s (its clean-up waiting in C++) is ended here. (Two signals at once: one
            # handler call, and the second byte waits here too.)
            if self.ended.wait(STOP_HANDLED_WITHIN):  # (its handlers may be gone: before_exit ignores stop signals)
                return
            why = f"still running {STOP_HANDLED_WITHIN:g} s after it"
        try:
            with contextlib.suppress(Exception):  # (a closed stderr, a broken pipe: the process ends all the same)
                if handler is _stop_during_start_up:
                    say(f"{_start_up_stop_line(signal.Signals(signum).name)} ({why})", file=sys.stderr)
                sys.stdout.flush()
        finally:
            os._exit(PREEMPTED_EXIT_CODE if handler is _stop_during_start_up else 130)

    def close(self):
        for fd in (self.read, self.write):
            with contextlib.suppress(OSError):
                os.close(fd)


def training_starts():
    """The end of start-up's watch (preemption.StopSignal's handlers have taken over): the wakeup fd released,
    Ctrl-C Python's KeyboardInterrupt again. A stop signal the start-up took, but whose Preempted some code caught
    (an `except Exception` of a dataset, say), is raised again here: the run stops before its first step."""
    taken = _end_watch()
    if taken:
        raise Preempted(f"{_start_up_stop_line(taken)} (its start-up went on after it)")


def _end_watch():
    """End start-up's watch (in the main thread; nothing where there is none): training started, or the run ended
    (run_main, run_worker: a process that goes on, a notebook's, starts afresh). Returns the stop it took, if any."""
    global _watch
    if _watch is None or threading.current_thread() is not threading.main_thread():
        return None
    watch, _watch = _watch, None
    if signal.getsignal(signal.SIGINT) is _interrupted_during_start_up:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    previous = signal.set_wakeup_fd(-1)
    if previous != watch.write:
        signal.set_wakeup_fd(previous)
    watch.ended.set()
    with contextlib.suppress(OSError):  # (a watch thread that ended: its end of the pipe closed)
        os.write(watch.write, b"\0")
    os.close(watch.write)
    return watch.taken


def _forget_watch():
    """In a process forked in start-up: the parent's watch is not its own (no thread here; the pipe the parent's)."""
    global _watch
    if _watch is not None:
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        _watch.close()
        _watch = None


PR_SET_PDEATHSIG = 1  # linux/prctl.h
_launcher = None  # the launcher's process id, once end_with_launcher ran


def end_with_launcher():
    """A process a launcher started (torchrun's worker, spawn's child) gets SIGTERM when the launcher ends, however it
    ends (SIGKILL, the OOM killer), rather than train on as an orphan holding the output directory; launcher_ended()
    tells that SIGTERM apart. Linux only (prctl PR_SET_PDEATHSIG). A launcher already gone: the process sends it."""
    global _launcher
    if not sys.platform.startswith("linux"):
        return
    spawned_by = multiprocessing.parent_process()  # a spawn child: its parent, known from before its start-up
    _launcher = spawned_by.pid if spawned_by is not None else os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        _launcher = None
        return
    if launcher_ended():  # (a launcher that is PID 1, in a container, is no sign of one that ended)
        os.kill(os.getpid(), signal.SIGTERM)


def launcher_ended(wait=0.0):
    """Whether this process's launcher (end_with_launcher) has ended, waiting up to `wait` s for it to: the kernel
    sends the SIGTERM as soon as the launcher's thread that started this process ends, which under SIGKILL comes a
    moment before the whole launcher is gone and this process re-parented."""
    deadline = time.monotonic() + wait
    while _launcher is not None:
        if os.getppid() != _launcher:
            return True
        if time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    return False


def check_host_resolves(host):
    """One line where the rendezvous host's name does not resolve (torchrun waits 600 s for it, saying nothing)."""
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        raise UsageError(
            f"the rendezvous host {host} does not resolve to an address: give node 0's address or name "
            "(MASTER_ADDR, --master-addr)"
        ) from None


def check_endpoint(host, port, listens, wait):
    """For the torchrun launchers of run_scripts/ (torchrun waits 600 s for its rendezvous, saying nothing, or ends in
    a traceback): UsageError unless `host` (an IPv6 address in brackets or not) resolves within `wait` seconds (a note
    while it does not: a platform's name for node 0 may come to its DNS after the nodes start) and, where this node's
    torchrun listens (`listens`: node 0 of a static rendezvous, on every address), `port` is free."""
    host, deadline, said = host.removeprefix("[").removesuffix("]"), time.monotonic() + wait, False
    while True:
        try:
            check_host_resolves(host)
            break
        except UsageError:
            if time.monotonic() >= deadline:
                raise
        if not said:  # (out of the `except`: a Ctrl-C while it sleeps is not chained to the UsageError)
            say(f"note: MASTER_ADDR {host} does not resolve yet: waiting up to {wait} s (MASTER_ADDR_WAIT)", sys.stderr)
            said = True
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
    if listens:
        check_port_free("", port, ("MASTER_ADDR", "MASTER_PORT"))


def check_port_free(address, port, names=("--master-addr", "--master-port")):
    """Fail early and clearly when the rendezvous port is taken (`names`: what gave the address and the port); on
    every address where `address` is "" (torchrun's agent listens so)."""
    try:  # (an IPv6 address listens as one)
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
    except OSError:  # (bind says why, below)
        family = socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As the store will: a port left in TIME_WAIT by the previous run is free to reuse.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as error:
            why = {
                errno.EADDRINUSE: f"the port is in use; choose another {names[1]}",
                errno.EACCES: f"{'a port below 1024 needs root; ' * (port < 1024)}choose another {names[1]}",
            }.get(error.errno, f"node 0 listens there: {names[0]} must name an address of node 0")
            where = f"{address}:{port}" if address else f"port {port}"
            raise UsageError(f"cannot listen on {where} ({error.strerror}): {why}") from None


def _size(count):
    return f"{count / 2**30:.1f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


RENDEZVOUS_HINT = "start every node, each with its own node rank, and check MASTER_ADDR, the port and the node count"


def known_failure(error):
    """One line for the errors that are not this process's own fault (their cause is reported
    elsewhere or is the machine's), else None."""
    text = str(error)
    if text.startswith("DataLoader worker"):
        # "DataLoader worker (pid(s) X) exited unexpectedly": the kernel's OOM killer, mostly; or a decoder's crash.
        return (
            f"error: {text.splitlines()[0].strip()} (killed for memory? fewer --workers use less; a crash? -j 0 "
            "decodes in the training process, where it shows)"
        )
    if "Expected to have finished reduction in the prior iteration" in text:
        # DDP waited for the gradient of a parameter that the forward did not use.
        return (
            "error: DDP: the model has parameters that received no gradient: add --find-unused-parameters "
            "(or use them all in forward)"
        )
    wanted = re.search(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes", text)
    if wanted:  # (the GPU's: diagnostics.out_of_memory)
        return (
            f"error: out of host memory: a tensor of {_size(int(wanted.group(1)))} could not be allocated; "
            "a smaller -b, crop size (--train-crop-size, --val-resize-size) or model, or fewer loader workers (-j)"
        )
    joined = re.search(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined", text)
    if joined:  # (node 0's rendezvous: torch's DistStoreError, a traceback)
        return (
            f"error: the rendezvous timed out: {joined[2]} of {joined[3]} processes joined in {joined[1]} s: "
            f"{RENDEZVOUS_HINT}"
        )
    waited = re.search(r"wait timeout after (\d+)ms, keys: ", text)
    if waited:  # (a rank that joined node 0's store, waiting there for the others: DistStoreError)
        return (
            f"error: the rendezvous timed out: not every process joined in {int(waited[1]) / 1000:g} s: "
            f"{RENDEZVOUS_HINT}"
        )
    if "Failed to recv, got 0 bytes. Connection was likely closed" in text:  # (DistNetworkError: node 0 ended)
        return "error: node 0's rendezvous store closed the connection: its processes ended (see their errors there)"
    connecting = re.search(r"client socket has timed out after \d+ms while trying to connect to \(([^)]*)\)", text)
    if connecting:  # (another node's: DistNetworkError)
        return (
            f"error: no rendezvous answered at {connecting[1].replace(', ', ':')}: start node 0 (node rank 0), and "
            "check MASTER_ADDR and the port"
        )
    listening = re.search(r"server socket has failed to listen on any local network address\. port: (\d+)", text)
    if listening and "EADDRINUSE" in text:  # (DistNetworkError: another job took the port after this one's check)
        return (
            f"error: cannot listen on port {listening[1]} (Address already in use): the port is in use; choose "
            "another (MASTER_PORT, --master-port)"
        )
    kernel = re.search(r"(?m)^(?:\w+: )?(.+?) does not have a deterministic implementation, but you set", text)
    if kernel:  # (torch.use_deterministic_algorithms: VGG's and AlexNet's adaptive pooling backward on a GPU, put_)
        return (
            f"error: --deterministic: torch has no deterministic kernel for {kernel[1]}, which this model uses on "
            "this device: run without --deterministic (docs/concepts.md, repeatable runs)"
        )
    if "Expected more than 1 value per channel when training" in text:  # (BatchNorm's ValueError; DP's wraps it)
        return (
            "error: a BatchNorm layer got one value per channel (a single image on a device, its activations 1x1 "
            "there): give each device 2 images or more (-b, --grad-accum-steps), or larger crops"
        )
    if "view size is not compatible with input tensor's size and stride" in text:  # (the traceback says where)
        error.add_note(
            "hint: under --channels-last (auto: on for convolutional networks on the CPU, and with --amp on GPUs) "
            "activations and gradients are NHWC in memory, which .view() cannot flatten (LBFGS's step does so): "
            "give --channels-last off, or use .reshape()"
        )
    if any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "rank 0 failed")):
        # A collective lost a process of the job: that one failed (or was stopped) first and said why.
        return "error: another process of this job ended, see its error; this one stops too"
    meshed = re.search(r"connectFullMesh failed with \[[^\]]*\] ?(.*)", text)
    if meshed:  # (gloo's RuntimeError: the ranks met at the store, not on their sockets; "no error": a timeout)
        reason = meshed[1].strip() if meshed[1].strip() not in ("", "no error") else "a connect timed out"
        return (
            f"error: this job's processes could not connect to each other (gloo: {reason}): a firewall between the "
            "nodes, or an interface the others cannot reach (GLOO_SOCKET_IFNAME)?"
        )
    return None


def outcome(error):
    """(exit code, the line that says why, or None) of the error that ended a run; None for a bug."""
    if isinstance(error, UsageError):
        return error.exit_code, f"error: {error}"
    if isinstance(error, Preempted):
        return PREEMPTED_EXIT_CODE, str(error) or None  # (no text: the trainer said where its checkpoint is)
    if isinstance(error, KeyboardInterrupt):
        return 130, None
    if isinstance(error, OSError) and error.errno in DISK_FULL:  # log.csv, summary.json, ... (checkpoints: their own)
        where = f" ({error.filename})" if error.filename else ""  # (a write to an open file names none)
        return 1, (
            f"error: a write failed: {error.strerror}{where}; the checkpoints already there are intact: make "
            "room, then --resume auto goes on from the last one"
        )
    line = known_failure(error) if isinstance(error, (RuntimeError, ValueError)) else None
    return None if line is None else (1, line)


def _clean_up():
    """On the way out, while an error still holds the data loaders (once it is handled they shut down, waiting 5 s for
    each worker stuck in a read): no loader worker left, no alarm pending, no process group. preemption not imported
    yet: nothing to clean up, and a usage error does not wait for torch to load."""
    preemption = sys.modules.get(f"{__package__}.preemption")
    if preemption is not None:
        preemption.before_exit()
        sys.modules[f"{__package__}.distributed"].destroy_process_group()
    _end_watch()  # (after the clean-up, which it watches: one that hangs in C++ is ended STOP_HANDLED_WITHIN s on)


MANY_NEW_OBJECTS = 50_000  # made by without_collections' make(), which then moves them to the oldest generation


def without_collections(make):
    """make() with the garbage collector off: importing torch and torchvision (parsing the arguments checks --arch
    against torchvision; a spawned process imports them anew) makes about 340,000 objects and, collector on, five or
    six full collections of them, 0.6 s of a 2.2 s start on 2 cores. Then one collection moves them to the oldest
    generation, where they are scanned again only when it has grown by a quarter (left in the youngest, its next two
    collections would scan them all). The collector is on again after, whatever happens."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        made = make()
        if gc.get_count()[0] > MANY_NEW_OBJECTS:  # (not where torch was imported before: a scan for nothing, 0.2 s)
            gc.collect()
        return made
    finally:
        if was_enabled:
            gc.enable()


def _process_starts():
    """What a training process does first: its console, whose failure ends nothing (console_never_fails); and a
    signal that kills it at a fault (SIGSEGV; SIGBUS: a memory-mapped file made shorter) says where (faulthandler)."""
    console_never_fails()
    with contextlib.suppress(OSError, ValueError, AttributeError):  # (a stderr without a descriptor)
        faulthandler.enable()


def run_main(main, parse_args):
    """main(parse_args()), its end through the ladder: the exit code (a line on stderr where there is one)."""
    _process_starts()
    try:
        try:
            stop_at_once_until_training()
            if "TORCHELASTIC_RUN_ID" in os.environ:  # a worker of torchrun (or of the legacy launcher)
                end_with_launcher()
            main(without_collections(parse_args))
        finally:
            _clean_up()
        return 0
    except (Exception, KeyboardInterrupt) as error:
        ended = outcome(error)
        if ended is None:
            raise  # a bug: its traceback is the report
        code, line = ended
        if line:
            say(line, file=sys.stderr)
        return code


def run_worker(rank, body, usage_errors):
    """body() in a process that torch.multiprocessing.spawn started, ended through the same ladder with sys.exit.
    A usage error's line goes to `usage_errors` (a queue): the parent says the first one, once (every rank may
    raise the same one); any other line is said here, with the rank, and a bug's traceback too, so that the
    first cause is shown whichever process spawn reports."""
    _process_starts()
    try:
        try:
            stop_at_once_until_training()  # a new interpreter: a stop signal in its start-up ends it with 75 too
            end_with_launcher()
            without_collections(lambda: importlib.import_module("torchvision"))  # (body() imports it)
            body()
        finally:
            _clean_up()
    except (Exception, KeyboardInterrupt) as error:
        if isinstance(error, KeyboardInterrupt):
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches us twice: directly and from the parent
        ended = outcome(error)
        if ended is None:
            say(f"error: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
            sys.exit(1)
        code, line = ended
        if isinstance(error, UsageError):
            usage_errors.put((code, line))
        elif line:
            kind = "error: " if line.startswith("error: ") else ""
            say(f"{kind}rank {rank}: {line.removeprefix(kind)}", file=sys.stderr)
        sys.exit(code)  # spawn would report a KeyboardInterrupt as success

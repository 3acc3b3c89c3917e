"""What the tools share: whole numbers, seconds, regular expressions and torchvision's model names for their
command lines, a bad input (UsageError) or a child's failure ended in one line, a table replaced whole, an image
resized as a JPEG, the check that prepare_imagenet.py and make_shards.py write nowhere they read, and the pool of
worker processes that a stop signal or an error stops at once."""

import argparse
import contextlib
import errno
import io
import math
import multiprocessing
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.errors import NO_ROOM, NoRoom, UsageError, console_never_fails, lost_output, say
from common.launch import end_with_launcher


class Stopped(BaseException):  # not an Exception, as KeyboardInterrupt: no `except Exception` takes it
    """SIGTERM: exit code 143 (128 + 15, as a shell reports it) once the workers are stopped."""


def resize_jpeg(data, size, quality=90):
    """`data` (any image Pillow reads) as RGB JPEG bytes with the shorter side at most `size`, never
    upscaled. Raises OSError (or SyntaxError, ValueError) for a file it cannot decode."""
    from PIL import Image

    from common.folder_index import rgb

    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        scale = min(1.0, size / min(width, height))
        target = (max(1, round(width * scale)), max(1, round(height * scale)))
        if scale == 1.0 and image.format == "JPEG" and image.mode == "RGB":
            image.load()  # it decodes, and is small already: re-encoding would only lose detail
            return data
        # The JPEG decoder scales by 1/2, 1/4 or 1/8 in the DCT (to no less than the target), so
        # the costly full-size decode is skipped: measured 3.9x faster on 2000x1500 photos at
        # --resize 256, 1.65x on 500x375 at --resize 160 (docs/benchmarks.md).
        image.draft("RGB", target)
        image = rgb(image)  # (a 16-bit image as training decodes it: its high byte, not clipped to white)
        if image.size != target:
            image = image.resize(target, Image.Resampling.LANCZOS)
        output = io.BytesIO()
        image.save(output, "JPEG", quality=quality)
        return output.getvalue()


def whole(low, high=None):
    """An argparse type: a whole number from low to high."""

    def parse(text):
        if not text.isdigit() or int(text) < low or (high and int(text) > high):
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a whole number " + (f"from {low} to {high}" if high else f"of at least {low}")
            )
        return int(text)

    return parse


def regex(text):
    """An argparse type: a regular expression (--only)."""
    try:
        re.compile(text)
    except re.error as error:
        raise argparse.ArgumentTypeError(f"{text!r} is no regular expression ({error})") from None
    return text


def seconds(text):
    """An argparse type: a positive, finite number of seconds (--deadline)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds above 0")
    return value


def no_row(parser, only, names):
    """argparse's error (exit code 2) for an --only that matches none of the rows `names`, naming them (was: an empty
    table, exit code 0: a check of nothing passed)."""
    parser.error(f"--only {only!r} matches no row; the rows: {'; '.join(names)}")


def folder(parser, path):
    """`path` made as a folder (--out); where it cannot be, argparse's error naming why (exit code 2)."""
    if not path:  # (was: the current directory, without a word)
        parser.error("--out is empty: give a folder")
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        parser.error(f"--out {path}: {error.strerror or error}")
    return Path(path)


def write_replacing(path, text):
    """`text` written beside `path`, then renamed over it (common.run_dir.atomic_write): a tool stopped while it
    rewrites its table (a lent machine's time spent) leaves the table of the rows before, never half a file."""
    from common.run_dir import atomic_write

    atomic_write(path, lambda file: file.write(text.encode()))


def overlap(reads, writes):
    """(read, written): the first path of `reads` that is, holds or lies inside a path of `writes` (links resolved),
    or None. A tool writing there would add its output to the images it reads (an OUT inside the source's train/)
    or read what it writes."""
    resolved = [(path, Path(path).resolve()) for path in writes]
    for read in reads:
        real = Path(read).resolve()
        for written, target in resolved:
            if real == target or target in real.parents or real in target.parents:
                return read, written
    return None


LOCK = ".lock"  # in a tool's OUT while a run writes there


@contextlib.contextmanager
def output_lock(out):
    """OUT (made if need be) written by this process alone while the block runs: a POSIX lock on OUT/.lock, which the
    kernel drops when the process ends. A second run on the same OUT meanwhile (it would remove the first one's files
    in progress as a killed run's) is refused: UsageError naming the first. Nothing is held on a file system that
    does not lock."""
    import fcntl

    from common.run_dir import NO_LOCKING

    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(out) / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as error:
        if error.errno in NO_ROOM:
            raise NoRoom(
                f"cannot write to {out} ({error.strerror}): make room, then run the same command again"
            ) from None
        raise UsageError(f"cannot write to {out}: {error.strerror or error}") from None
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EACCES, errno.EAGAIN):
                holder = " ".join(os.pread(fd, 200, 0).decode(errors="replace").split()) or "which has not said who"
                raise UsageError(
                    f"{out} is being written by another run ({holder}): wait for it to end, then run this command "
                    "again (it carries on)"
                ) from None
            if error.errno not in NO_LOCKING:
                raise UsageError(f"cannot lock {Path(out) / LOCK}: {error.strerror or error}") from None
        else:
            with contextlib.suppress(OSError):  # (who holds it, for the refusal: a full disk leaves it unsaid)
                text = f"PID {os.getpid()} on {socket.gethostname()}".encode()
                os.pwrite(fd, text, 0)
                os.ftruncate(fd, len(text))
        yield
    finally:
        os.close(fd)


def torchvision_model(text):
    """An argparse type: the name of a torchvision classification model (what the benchmarks build)."""
    import torchvision

    if text not in torchvision.models.list_models(module=torchvision.models):
        raise argparse.ArgumentTypeError(f"{text!r}: no torchvision classification model of that name")
    return text


def run_tool(main, *args):
    """main(*args)'s return value, for sys.exit; a UsageError said in one line on stderr (`error: ...`), its exit
    code returned (2: bad input), never a traceback. A console that cannot be written (`| head`, a full device) ends
    nothing (console_never_fails); output lost to a full device or a failing disk, exit code 1."""
    console_never_fails(warn=False)  # (its output lost: the error below, once)
    try:
        code = main(*args)
    except UsageError as error:
        say(f"error: {error}", file=sys.stderr)
        return error.exit_code
    sys.stdout.flush()  # (what it buffers fails here, not at the exit: after the exit code)
    if code in (0, None) and lost_output() is not None:
        say(f"error: the output could not be written to stdout ({lost_output()})", file=sys.stderr)
        return 1
    return code


def check_child(what, result):
    """Nothing, if the subprocess.run `result` (`what`: the command, in words) succeeded. Else its own line
    `error: ...` as a UsageError of ours, `what: ...`, with exit code 2 where its was 2 (bad input: ours, given on to
    it), else 1; a child that wrote no such line is a bug: RuntimeError with the end of its output."""
    if result.returncode == 0:
        return
    output = f"{result.stdout or ''}\n{result.stderr or ''}"
    line = next((line for line in output.splitlines() if line.startswith("error: ")), None)
    if line is None:
        raise RuntimeError(f"{what} failed (exit code {result.returncode}):\n{output[-4000:]}")
    error = UsageError(f"{what}: {line.removeprefix('error: ')}")
    error.exit_code = 2 if result.returncode == 2 else 1
    raise error


def worker_pool(workers):
    """A pool of `workers` processes: forked (Linux's default before Python
    3.14, whose forkserver would make them the children of a server, not of this process: ignore_interrupts ties each
    worker's life to its parent's), each started by ignore_interrupts."""
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=ignore_interrupts)


def ignore_interrupts():
    """A pool worker's start. Ctrl-C reaches the whole process group: the main process alone handles it, stopping the
    pool. A main process that ends without stopping it (SIGKILL, the OOM killer) ends its workers too: SIGTERM from the
    kernel (end_with_launcher), where they would wait on the pool's pipe forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    end_with_launcher()


def stop_workers(pool):
    """The worker processes of a ProcessPoolExecutor terminated now, mid-task (Python 3.14: terminate_workers())."""
    for process in list((pool._processes or {}).values()):
        process.terminate()


def command_line(tool, argv):
    """`tool` (its __file__) run with `argv` again, from anywhere: what an unfinished OUT's marker holds."""
    import shlex

    try:
        where = f"cd {shlex.quote(os.getcwd())} && "
    except OSError:  # (run from a folder deleted since: its relative paths name nothing now)
        where = ""
    return where + shlex.join(["python", str(Path(tool).resolve()), *map(str, argv)])


def stop_on_signals():
    """From now on, SIGTERM raises Stopped and SIGINT KeyboardInterrupt in this process. A worker of the pool forked
    before its initializer ran inherits this handler: there SIGTERM ends it at once, as after its initializer (an
    exception would print a traceback from threading's after-fork hook; ignored, the worker ran the queued jobs while
    the main process waited for it), and SIGINT does nothing (the main process stops the workers with SIGTERM).
    A second signal in the main process does nothing (it raised in the first one's cleanup: a traceback), a third of
    its kind ends it at once. Returns the handlers they replace."""
    main_pid, stopping = os.getpid(), []

    def stop(signum, frame):
        if os.getpid() == main_pid:
            if stopping:  # a second signal (timeout's after the shell's, a second Ctrl-C): the first is stopping it
                signal.signal(signum, signal.SIG_DFL)  # (a third ends it at once, its clean-up stuck or not)
                return
            stopping.append(signum)
            raise Stopped() if signum == signal.SIGTERM else KeyboardInterrupt()
        if signum == signal.SIGTERM:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    return {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}


@contextlib.contextmanager
def scratch(prefix):
    """A temporary folder (under TMPDIR), removed however its block ends: a training run's error, a stop."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def until_stopped(main):
    """`main` with SIGTERM and SIGINT raised in it (stop_on_signals) while it runs, so that its `finally` blocks run
    (the benchmarks' temporary folders removed, their jobs killed): a stop says one line and returns 143 (SIGTERM)
    or 130 (was: the folders left in /tmp, a job still writing there)."""

    def run(*args):
        before = stop_on_signals()
        try:
            return main(*args)
        except (KeyboardInterrupt, Stopped) as stopped:
            interrupted = isinstance(stopped, KeyboardInterrupt)
            say(f"stopped: {Path(sys.argv[0]).name} ended by {'SIGINT' if interrupted else 'SIGTERM'}", file=sys.stderr)
            return 130 if interrupted else 143
        finally:
            for signum, handler in before.items():
                signal.signal(signum, handler)

    return run

"""The exceptions that end a run with one line instead of a traceback (common/launch.py reports them), that line
written whole (say) to a console whose failure ends nothing (console_never_fails), and `package.module:name` on the
command line imported or refused in one line. It imports nothing of this repository, nor torch.
"""

import contextlib
import errno
import importlib
import inspect
import os
import sys
from pathlib import Path


class UsageError(Exception):
    """Bad input from the user: reported as one line and exit code 2."""

    exit_code = 2


# A full disk or quota, a file too large
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class NoRoom(UsageError):
    """The output directory has no room for a write (NO_ROOM): one line, exit code 1 (no bad input: make room)."""

    exit_code = 1


def unwritable_output(directory, error):
    """The one line for the OSError `error` of writing to the output directory: NoRoom where the disk is full (exit
    code 1, make room), else a UsageError (exit code 2: another directory is the remedy)."""
    if error.errno in NO_ROOM:
        return NoRoom(f"cannot write to --output-dir {directory} ({error.strerror}): make room, then run it again")
    return UsageError(
        f"cannot write to --output-dir {directory} ({error.strerror or error}): choose a directory you can write to"
    )


class CheckpointWriteError(UsageError):
    """A checkpoint could not be written (a full disk): one line, exit code 1."""

    exit_code = 1


class OutOfMemory(UsageError):
    """The device ran out of memory: one line naming the evidence and the levers (diagnostics.py), exit code 1."""

    exit_code = 1


class NotFinite(UsageError):
    """The weights (or the optimizer's state) became NaN or infinite: one line, exit code 1, no checkpoint of them."""

    exit_code = 1


class WorkerUsageError(UsageError):
    """A UsageError that may be raised in a DataLoader worker, and still reads as one line."""

    def __init__(self, message):
        # A DataLoader worker's error arrives in the main process as "Caught ... Original Traceback
        # ...: <message>": keep the one line that says what happened.
        super().__init__(message.strip().splitlines()[-1].split(f"{type(self).__name__}: ", 1)[-1])


class UnreadableImage(WorkerUsageError):
    """--strict-data met a file that cannot be decoded."""


class BadItem(WorkerUsageError):
    """A dataset's item is not what the loaders take: (image, label) of a PIL image or a CHW tensor and a
    class index."""


# Errors of a dataset's own code, not of an unreadable file: never skipped, their traceback is the report.
PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, ImportError, AssertionError, BadItem)


class UnreadableFile(OSError):
    """An image file that cannot be decoded (whatever its decoder raised): skipped, or --strict-data's end."""


class Preempted(Exception):
    """Stopped on SIGTERM / SIGUSR1 after writing a checkpoint; exit code PREEMPTED_EXIT_CODE."""


PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request; continue with --resume auto


# What would split or hide a line (control characters, Unicode's line separators), escaped: in bad_images.txt's fields
# and in the file names of our one-line messages (printable)
ESCAPED = str.maketrans(
    {
        **{code: f"\\x{code:02x}" for code in [*range(32), 127, 0x85]},
        **{code: f"\\u{code:04x}" for code in (0x2028, 0x2029)},
        **{"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"},
    }
)


def printable(path):
    """A file name for a one-line message: what would split or hide the line escaped (errors.ESCAPED), and the bytes
    of a name that is not UTF-8 (kept as surrogates) as \\xNN."""
    return str(path).translate(ESCAPED).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def raise_interrupt_within(error):
    """Raise KeyboardInterrupt where `error` is a library's own error around one (torch.save turns a Ctrl-C in its
    writer into a RuntimeError, "unexpected pos"): an interrupt, not a failed write."""
    if isinstance(error.__context__, KeyboardInterrupt):
        raise KeyboardInterrupt from None


SHORT_WRITE = "unexpected pos"  # torch's file writer, where a write fell short: "unexpected pos 704 vs 598"


def written_reason(error):
    """Why a write failed, in a few words: its OSError's reason, also where a library's own error holds it (torch.save
    raises "unexpected pos 704 vs 598" around "No space left on device"); that error alone (another rank's, sent
    without the OSError), what makes a write fall short; else the error's first line."""
    inner = error if isinstance(error, OSError) else error.__context__
    if isinstance(inner, OSError) and inner.strerror:
        return inner.strerror
    if SHORT_WRITE in str(error):  # (was: torch's "[enforce fail at inline_container.cc:671] . unexpected pos ...")
        return "a write fell short: no space left on the device, or a quota or file size limit reached"
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def say(message, file=None):
    """print(message, file=file, flush=True), in one write: print() makes two, and another process sharing the
    terminal or pipe (ranks, loader workers, torchrun) could land between them, gluing its output onto our line."""
    stream = sys.stdout if file is None else file
    stream.write(f"{message}\n")
    stream.flush()


class _Console:
    """sys.stdout or sys.stderr, whose writes never end the run: once one fails (a pipe whose reader is gone, as after
    `| head`; a full device; a closed file), the stream's descriptor is /dev/null's, and the run goes on without a
    console (log.csv, summary.json and the checkpoints hold what it does); stdout's loss but to a closed pipe is said
    on stderr (`warn`). Anything else is the stream's own."""

    def __init__(self, stream, name, warn=True):
        self._stream, self._name, self._warn, self.lost = stream, name, warn, None

    def write(self, text):
        try:
            return self._stream.write(text)
        except (OSError, ValueError) as error:  # (ValueError: a closed file)
            self._lose(error)
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except (OSError, ValueError) as error:
            self._lose(error)

    def _lose(self, error):
        if self.lost is not None:
            return
        self.lost = error
        try:  # (what the stream still buffers then goes there too: no error again, at exit either)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError):
            pass
        reason = lost_output(self)
        if self._warn and reason is not None:
            say(f"warning: cannot write to {self._name} ({reason}): going on without it", file=sys.stderr)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def lost_output(stream=None):
    """Why `stream` (sys.stdout) could not be written, where it was not a reader that left (a closed pipe, `| head`:
    its reader wants no more), else None."""
    error = getattr(sys.stdout if stream is None else stream, "lost", None)
    closed = isinstance(error, ValueError) and not isinstance(error, UnicodeError)  # (a file closed under it)
    if error is None or closed or isinstance(error, BrokenPipeError):
        return None
    return getattr(error, "strerror", None) or str(error)


def console_never_fails(warn=True):
    """From now on, this process's console output cannot end it (_Console; `warn`: stdout's loss said on stderr). A
    descriptor 0, 1 or 2 closed when it started (`>&-`) is /dev/null's from now on: a file this process opens never
    gets its number, where a library's C++ code could print into it. Text the console's encoding lacks (a file name
    that is not UTF-8) is written with backslashes, as on stderr (was: an error that lost the console)."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        if fd != null:
            try:
                os.fstat(fd)
            except OSError:
                os.dup2(null, fd)
    if null > 2:
        os.close(null)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(stream, _Console):
            with contextlib.suppress(AttributeError, OSError, ValueError):  # (a stream that cannot: its loss is said)
                stream.reconfigure(errors="backslashreplace")
            setattr(sys, name, _Console(stream if stream is not None else open(os.devnull, "w"), name, warn))


def replaces(cls, hook):
    """Whether the Trainer subclass `cls` replaces the library's Trainer's `hook`: the first class of its MRO that
    defines it is not that Trainer (told by its source file, trainer.py beside this one: a subclass may be named
    Trainer too, the package copied under another name)."""

    def library(kind):
        source = getattr(sys.modules.get(kind.__module__), "__file__", None)
        return (
            kind.__qualname__ == "Trainer"
            and source is not None
            and Path(source) == Path(__file__).parent / "trainer.py"
        )

    mro = getattr(cls, "__mro__", ())
    first = next((kind for kind in mro if hook in vars(kind)), None)
    return any(map(library, mro)) and first is not None and not library(first)


def import_named(text, flag, builtin=True):
    """The object that `package.module:name` names (None for a text without a colon: a built-in name, if `builtin`)."""
    if ":" not in text and builtin:
        return None
    module_name, _, name = text.partition(":")
    if not (module_name and name.isidentifier()):
        raise UsageError(f"{flag} {text}: expected package.module:name")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, TypeError) as error:  # (TypeError: a relative module name)
        raise UsageError(f"{flag} {text}: cannot import {name} from {module_name} ({error})") from None


def returned(value, kind, hook, expected):
    """`value`, what the hook `hook` returned, where it is a `kind`; else wrong_return's UsageError."""
    if not isinstance(value, kind):
        raise wrong_return(value, hook, expected)
    return value


def wrong_return(value, hook, expected):
    """The one line for a hook of a researcher's Trainer (adapting.md) that returned `value`, not `expected`."""
    return UsageError(f"{hook} returned {type(value).__name__} {str(value)[:60]!r}: expected {expected}")


def check_call(function, flag, text, call, *args, **kwargs):
    """UsageError unless `function` (what `flag` `text` named) can be called with these arguments (`call` says how)."""
    if not callable(function):
        raise UsageError(f"{flag} {text} is a {type(function).__name__}: expected {call}")
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except ValueError:  # (no signature to read)
        return
    except TypeError as error:
        raise UsageError(f"{flag} {text} cannot be called as {call}: {error}") from None

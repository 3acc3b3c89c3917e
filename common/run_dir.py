"""Files that are whole or absent: atomic writes with fsync; the output directory's lock, and a file:// rendezvous's.

A file written here is never seen half-written, even after a crash or a power loss: its bytes go to a temporary file
beside it, are fsynced (else the rename may reach the disk first: an empty file), and the temporary is renamed over the
final name, then the folder is fsynced. OutputLock (run.lock) lets one run at a time write an output directory.
"""

import contextlib
import errno
import fcntl
import itertools
import json
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

from .errors import UsageError, printable, say, unwritable_output

LOCK = "run.lock"
SHARD_INDEXES = "shard-indexes"  # where a run keeps the indexes of shards in a folder it cannot write to
LOCK_WAIT_ON_RESTART = 180  # seconds: a file system's lock outlives a lost node by its lease (NFSv4: 90 s)
# errno of a file system that does not lock (Lustre mounted without -o flock, some FUSE file systems)
NO_LOCKING = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

_UMASK = os.umask(0)
os.umask(_UMASK)


def fsync(path):
    """fsync a file, or a folder (its entries: the renames into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_beside(path):
    """(fd, path) of a new, empty, hidden file next to `path` of a name no other process holds (mkstemp: not a PID,
    which another container shares), with open()'s permissions; its name ends in .tmp, which ImageFolder skips."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_UMASK)
    return fd, Path(name)


def write_synced(path, write):
    """Run write(file) on a new temporary file beside `path` and fsync it: its bytes are on disk when this
    returns its name (removed again if anything fails)."""
    fd, tmp = temporary_beside(path)
    try:
        with open(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def replace_synced(tmp, path, sync_folder=True):
    """Rename the synced temporary `tmp` over `path` (atomic), then fsync the folder (sync_folder=False: the
    caller syncs it once for many files)."""
    try:
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_folder:
        fsync(Path(path).parent)


def atomic_write(path, write, sync_folder=True):
    """Write `path` with write(file): a reader (or a crash) sees the old file or the new one, never half of one."""
    replace_synced(write_synced(path, write), path, sync_folder)


def atomic_export(path, export):
    """`path` written by export(name) (torch's writers of a file by its name: a trace, a memory snapshot) to a
    temporary beside it, renamed over it: a run killed while it writes leaves no half of one."""
    fd, tmp = temporary_beside(path)
    try:
        os.close(fd)
        export(str(tmp))
        with open(tmp, "rb") as file:  # (its bytes on disk before the rename, as write_synced's)
            os.fsync(file.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    replace_synced(tmp, path)


# What temporary_beside (mkstemp's 8 characters) and link_or_copy (a uuid) name a temporary of the files a run writes
TEMPORARY = re.compile(r"\..+\.(pth|csv|json|txt|pickle)\.([a-z0-9_]{8}|[0-9a-f]{32})\.tmp")


def remove_leftover_temporaries(directory):
    """Remove the temporaries (TEMPORARY) in `directory` and its metrics/, profile/ and memory/ that a run killed while
    writing left there: each as large as a checkpoint, a trace or a snapshot. Only by the holder of the directory's
    lock: no other run writes there. Returns the removed files' sizes."""
    removed = []
    for folder in (Path(directory), *(Path(directory) / name for name in ("metrics", "profile", "memory"))):
        for path in folder.glob(".*.tmp") if folder.is_dir() else []:
            if TEMPORARY.fullmatch(path.name) and path.is_file() and not path.is_symlink():
                with contextlib.suppress(OSError):
                    size = path.stat().st_size
                    path.unlink()
                    removed.append(size)
    return removed


def holds(directory, path):
    """Whether `path` lies in `directory`, links followed: a checkpoint of the run there (FSDP's checkpoint link too),
    not one from elsewhere."""
    return Path(path).resolve().is_relative_to(Path(directory).resolve())


def link_or_copy(source, path):
    """`path` as a second name of `source`'s bytes (a hard link: no copy), else a synced copy; atomic either way
    (the folder is not synced), and no full-size temporary is left when the copy fails (a full disk)."""
    link = Path(path).with_name(f".{Path(path).name}.{uuid.uuid4().hex}.tmp")
    try:
        os.link(source, link)
    except OSError:  # another file system, or one without hard links
        with open(source, "rb") as file:
            link = write_synced(path, lambda out: shutil.copyfileobj(file, out))
    replace_synced(link, path, sync_folder=False)
    with contextlib.suppress(FileNotFoundError):  # (a rename over another link of the same file does nothing)
        os.unlink(link)


def _describe_holder(path):
    """(who holds the lock at `path`, in words; whether it is stopping)."""
    try:
        holder = json.loads(Path(path).read_text() or "{}")
        stopping = f", stopping on {holder['stopping']}" if holder.get("stopping") else ""
        return f"host {holder['host']}, PID {holder['pid']}, started {holder['started']}{stopping}", bool(stopping)
    except (OSError, ValueError, KeyError, TypeError):
        return "which has not written who it is yet", False


NAME_MAX = 255  # bytes of one name in a path, on Linux's file systems (a longer one: OSError, "File name too long")


def check_names(values, derived=False):
    """One line, before anything is read or written, for a path flag in `values` (the resolved flags) holding a name
    longer than NAME_MAX bytes (was: the OSError's traceback where -e or --init-from first looked at it; `derived`:
    --output-dir is the default, named after --data's folder), and for an --output-dir that is not UTF-8 text, which
    TensorBoard cannot write to (was: its traceback after args.json)."""
    for name in ("data", "resume", "init_from", "output_dir"):  # (--data's first: the default --output-dir's cause)
        parts = [part for part in Path(values.get(name) or "").parts if len(os.fsencode(part)) > NAME_MAX]
        if parts:
            default = derived and name == "output_dir"  # (the default: named after --data's folder)
            given = "the default --output-dir, after --data's folder," if default else f"--{name.replace('_', '-')}"
            raise UsageError(
                f"{given} {printable(values[name])[:80]}...: a name in it is longer than {NAME_MAX} bytes "
                f"({printable(parts[0])[:40]}...): give {'--output-dir' if default else 'a shorter one'}"
            )
    try:
        values["output_dir"].encode()
    except UnicodeEncodeError:
        raise UsageError(
            f"--output-dir {printable(values['output_dir'])}: TensorBoard cannot write to a name Python does not read "
            "as UTF-8 text (its bytes are not, or the locale is not UTF-8): choose another"
        ) from None


class OutputLock:
    """The output directory's lock (run.lock), which the kernel drops when the process ends: a second run that would
    write the directory is refused in one line naming the first. A POSIX lock (lockf): it works over NFS, and a forked
    loader worker does not inherit it. `wait`: seconds to wait for the holder (one stopping: LOCK_WAIT_ON_RESTART);
    `hint`: the end of the refusal's line."""

    def __init__(self, output_dir, wait=0.0, say=None, hint=""):
        self.directory, self.hint, made = Path(output_dir), hint, []
        self.path, self.warning = self.directory / LOCK, None
        self.started, self.stopping = None, False
        try:  # (exists() too: a name longer than 255 bytes raises there)
            made = list(
                itertools.takewhile(lambda folder: not folder.exists(), [self.directory, *self.directory.parents])
            )
            self.directory.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as error:
            for folder in made:  # (made, but not to be written: under umask 0777, say), deepest first
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise self._unwritable(error) from None
        self.made = made  # (the folders it made, deepest first: none where the output directory was there)
        if self._take(wait, say):
            self.started = time.strftime("%Y-%m-%dT%H:%M:%S%z")  # when it took the lock
            self._write_holder()
            removed = remove_leftover_temporaries(self.directory)
            if removed and say is not None:
                say(
                    f"note: removed {len(removed)} temporary file(s) of {sum(removed) / 2**20:.1f} MiB from "
                    f"{self.directory}, left by a run killed while it wrote them"
                )

    def _unwritable(self, error):
        return unwritable_output(self.directory, error)

    def _take(self, wait, say):
        """True once the lock is this process's; False on a file system that does not lock (self.warning)."""
        deadline, said = time.monotonic() + wait, False
        while True:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError as error:
                if error.errno in NO_LOCKING:
                    self.warning = (
                        f"warning: cannot lock {self.path} ({error.strerror}): this file system does not "
                        "lock files, so a second run started in this --output-dir would not be refused"
                    )
                    return False
                if error.errno not in (errno.EACCES, errno.EAGAIN):
                    os.close(self.fd)
                    raise UsageError(f"cannot lock {self.path} ({error.strerror or error})") from None
            holder, stopping = _describe_holder(self.path)
            if stopping and wait < LOCK_WAIT_ON_RESTART:  # it writes its last checkpoint and ends: wait for it
                wait, deadline = LOCK_WAIT_ON_RESTART, time.monotonic() + LOCK_WAIT_ON_RESTART
            if time.monotonic() >= deadline:
                os.close(self.fd)
                raise UsageError(
                    f"{self.directory} is in use by another run ({holder}): one run at a time writes "
                    f"an output directory; wait for that one to end, or give this one another --output-dir{self.hint}"
                ) from None
            if say is not None and not said:
                say(f"waiting up to {wait:.0f} s for the run this job replaces to release {self.path} ({holder})")
                said = True
            time.sleep(1)

    def _write_holder(self, stopping=None):
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": self.started}
        text = json.dumps({**holder, **({"stopping": stopping} if stopping else {})}) + "\n"
        try:  # never empty for a reader, and on the server for another node's (NFS: close-to-open caching)
            os.pwrite(self.fd, text.encode(), 0)
            os.ftruncate(self.fd, len(text.encode()))
            os.fsync(self.fd)
        except OSError as error:  # a full disk, say
            raise self._unwritable(error) from None

    def mark_stopping(self, reason):
        """Say in the lock that this run is stopping (on `reason`): a run started in this directory meanwhile waits
        for it to end. Once; a lock that cannot be written stays as it was."""
        if not self.stopping and not self.warning:
            self.stopping = True
            with contextlib.suppress(UsageError, OSError):  # (a full disk: NoRoom, a UsageError)
                self._write_holder(stopping=reason)

    def abandon(self):
        """A run that ended before it wrote anything (but read-only shards' indexes) leaves no directory it created."""
        if self.made and {entry.name for entry in self.directory.iterdir()} <= {LOCK, SHARD_INDEXES}:
            shutil.rmtree(self.directory / SHARD_INDEXES, ignore_errors=True)
            self.path.unlink(missing_ok=True)
            for folder in self.made:  # (and the folders above it it made: runs/ at a first run), deepest first
                with contextlib.suppress(OSError):
                    folder.rmdir()


_rendezvous_owner = None  # this node's lock on PATH.owner of its file:// rendezvous, held for the job's life


def claim_rendezvous_file(path, node_rank, nnodes=1):
    """Every node of a file:// rendezvous holds a shared POSIX lock on PATH.owner for the job's life. Node 0 first
    tries it exclusively: when no node of any job holds it, a non-empty rendezvous file is a killed job's, which would
    hand this job the dead one's addresses, so it is removed (said in a note); a job of one node refuses a file another
    job holds (was: it joined that job's store). On a file system that does not lock, a non-empty file is refused."""
    global _rendezvous_owner
    try:
        owner = os.open(f"{path}.owner", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as error:
        raise UsageError(f"--dist-url file://{path}: cannot create {path}.owner ({error.strerror})") from None
    try:
        if node_rank == 0:
            try:
                fcntl.lockf(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                if nnodes == 1:  # (with several nodes, the holder may be one of this job's, started before node 0)
                    os.close(owner)
                    raise UsageError(
                        f"rendezvous file {path} is in use by a running job (it holds {path}.owner): give this job "
                        "a --dist-url of its own"
                    ) from None
            else:
                if path.exists() and path.stat().st_size:
                    path.unlink()
                    say(f"note: removed {path}, the rendezvous file of a job that ended without removing it (killed)")
        fcntl.lockf(owner, fcntl.LOCK_SH)  # (node 0: from exclusive to shared; others wait out node 0's check)
    except OSError as error:
        os.close(owner)
        if error.errno not in NO_LOCKING:
            raise UsageError(f"cannot lock {path}.owner ({error.strerror})") from None
        if node_rank == 0 and path.exists() and path.stat().st_size:
            raise UsageError(
                f"rendezvous file {path} is left from an earlier run (or a running job's: this file "
                "system does not lock files to tell): delete it first if no job uses it"
            ) from None
        return
    _rendezvous_owner = owner

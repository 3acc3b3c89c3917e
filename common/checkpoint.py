"""Checkpoints: written atomically by one process, read with weights_only=True.

A checkpoint is a dict of plain data and tensors:
  epoch (epochs completed), step_in_epoch (steps done of the next epoch; 0 at an
  epoch's end), arch, num_classes, classes, seed, state_dict (of the bare model:
  loads into torchvision.models.<arch>(num_classes=K) as it is), optimizer,
  scheduler, scaler, best_acc1, train_totals (the partial epoch's metric sums),
  rng_states (one per rank), world_size, args (a plain dict); with --model-ema also
  model_ema (the EMA's state_dict, keys as state_dict's: it loads into the same plain model),
  model_ema_n_averaged (its updates since it last restarted) and best_ema_acc1; samples (the data's
  train and val image counts: a resume mid-epoch on other counts is refused).
checkpoint.pth is the latest; checkpoint_prev.pth the one before it. Each save has its own
checkpoint_id, by which the ranks of a resumed job check that they all loaded the same one.

One run at a time writes an output directory: OutputLock (run.lock there) refuses a second.
"""
import contextlib
import errno
import fcntl
import json
import os
import pickle
import re
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

import torch

from .errors import UsageError
from .engine import AutocastForward


class CheckpointWriteError(UsageError):
    """A checkpoint could not be written: reported as one line, exit code 1."""
    exit_code = 1

CHECKPOINT = "checkpoint.pth"
PREVIOUS = "checkpoint_prev.pth"  # the checkpoint before the latest, kept in case the latest is damaged
BEST = "model_best.pth"
# Added to parameter names by DataParallel / DistributedDataParallel and torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def unwrap(model):
    """The bare model inside DataParallel, DistributedDataParallel, AutocastForward and torch.compile wrappers."""
    while True:
        if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel, AutocastForward)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def strip_prefixes(state_dict):
    """Parameter names without wrapper prefixes (checkpoints of pytorch/examples' main.py have `module.`)."""
    clean = {}
    for name, value in state_dict.items():
        stripped = True
        while stripped:
            stripped = False
            for prefix in WRAPPER_PREFIXES:
                if name.startswith(prefix):
                    name, stripped = name[len(prefix):], True
        clean[name] = value
    return clean


def _fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_UMASK = os.umask(0)
os.umask(_UMASK)


def _temporary_beside(path):
    """A new, empty file of a name no other process can hold (mkstemp: also not one in another container
    whose PIDs are this one's), next to `path`, with the permissions of a file that open() creates."""
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_UMASK)
    return fd, Path(name)


def _write_synced(path, write):
    """Run write(file) on a new temporary file beside `path` and fsync it: its bytes are on disk when this
    returns its name."""
    fd, tmp = _temporary_beside(Path(path))
    try:
        with open(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def atomic_write(path, write):
    """Write beside `path`, then rename over it: a reader (or a crash) sees the old file or the
    new one, never half of one."""
    path = Path(path)
    tmp = _write_synced(path, write)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _keep_as_previous(latest, previous):
    """Give the current latest checkpoint the name `previous`, leaving `latest` in place."""
    link = previous.with_name(f".{previous.name}.{uuid.uuid4().hex}.tmp")
    try:
        try:
            os.link(latest, link)  # a second name for the same bytes: no copy
        except OSError:  # a file system without hard links
            shutil.copyfile(latest, link)
        os.replace(link, previous)
    except BaseException:
        link.unlink(missing_ok=True)  # (a copy cut short by a full disk: no full-size leftover)
        raise


def save_checkpoint(state, output_dir, is_best):
    """Write checkpoint.pth, keeping the one before as checkpoint_prev.pth (and copy it to
    model_best.pth when is_best). Call it from the writer rank only. On failure (a full disk, say)
    the checkpoints already there stay as they were, and CheckpointWriteError says so."""
    output_dir = Path(output_dir)
    latest, new = output_dir / CHECKPOINT, None
    state = {**state, "checkpoint_id": uuid.uuid4().hex}
    try:
        new = _write_synced(latest, lambda file: torch.save(state, file))
        if latest.exists():
            _keep_as_previous(latest, output_dir / PREVIOUS)
        os.replace(new, latest)
        _fsync_dir(output_dir)
        if is_best:
            with open(latest, "rb") as source:
                atomic_write(output_dir / BEST, lambda file: shutil.copyfileobj(source, file))
    except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
        if new is not None:
            new.unlink(missing_ok=True)
        reason = getattr(error, "strerror", None) or str(error).strip().splitlines()[0]
        raise CheckpointWriteError(f"could not write a checkpoint to {output_dir} ({reason}); "
                                   "the checkpoints already there are intact") from None
    except BaseException:  # Ctrl-C, say: no full-size temporary left behind
        if new is not None:
            new.unlink(missing_ok=True)
        raise


def resolve_resume(resume, output_dir):
    """The checkpoint path that --resume names, or None to start fresh."""
    if not resume:
        return None
    if resume == "auto":
        for name in (CHECKPOINT, PREVIOUS):
            path = Path(output_dir) / name
            if path.is_file():
                return path
        return None
    if not Path(resume).is_file():
        raise UsageError(f"--resume {resume}: no such file (give a checkpoint.pth, or --resume auto)")
    return Path(resume)


def load_resume(resume, output_dir, warn):
    """(path, checkpoint) that --resume asks for, or (None, None). With 'auto', a damaged latest
    checkpoint is reported through warn() and the previous one is used."""
    path = resolve_resume(resume, output_dir)
    if path is None:
        return None, None
    try:
        return path, load_checkpoint(path)
    except UsageError as error:
        previous = path.with_name(PREVIOUS)
        if resume != "auto" or path.name != CHECKPOINT or not previous.is_file():
            raise
        warn(f"warning: {error}; resuming from the previous checkpoint {previous}")
        return previous, load_checkpoint(previous)


def load_checkpoint(path, mmap=False):
    """The checkpoint dict at `path`, loaded with weights_only=True (nothing in it is executed).
    mmap=True maps the tensors instead of reading them (to look at the metadata alone)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
        if unsafe:
            raise UsageError(f"refusing to load {path}: it holds a Python object ({unsafe.group(1)}), "
                             "not only tensors and plain data; nothing in it was run")
        raise UsageError(f"cannot read checkpoint {path}: not a PyTorch checkpoint")
    except Exception as error:  # truncated zip, text, random bytes: the unpickler raises many kinds
        raise UsageError(f"cannot read checkpoint {path}: truncated or not a PyTorch checkpoint "
                         f"({type(error).__name__})")
    if isinstance(checkpoint, dict) and "state_dict" not in checkpoint and checkpoint and all(
            isinstance(value, torch.Tensor) for value in checkpoint.values()):
        checkpoint = {"state_dict": checkpoint}  # a bare state_dict
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise UsageError(f"{path} is not a checkpoint: expected a dict with a 'state_dict'")
    checkpoint["state_dict"] = strip_prefixes(checkpoint["state_dict"])
    if isinstance(checkpoint.get("model_ema"), dict):
        checkpoint["model_ema"] = strip_prefixes(checkpoint["model_ema"])
    return checkpoint


def load_weights(model, checkpoint, arch, classes, path):
    """Load the checkpoint's weights into the bare `model`, refusing another arch or other classes."""
    saved_arch = checkpoint.get("arch")
    if saved_arch and saved_arch != arch:
        raise UsageError(f"{path} holds a {saved_arch} model, not {arch}: pass --arch {saved_arch}")
    saved_classes = checkpoint.get("classes")
    if saved_classes and len(saved_classes) == len(classes) and list(saved_classes) != list(classes):
        raise UsageError(f"{path} was trained on other classes ({', '.join(saved_classes[:3])}, ...) "
                         f"than the data's ({', '.join(classes[:3])}, ...)")
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as error:
        detail = " ".join(str(error).split())
        raise UsageError(f"{path} does not fit {arch} with these classes: {detail[:300]}")


LOCK = "run.lock"
LOCK_WAIT_ON_RESTART = 180  # seconds: a file system's lock outlives a lost node by its lease (NFSv4: 90 s)
# errno of a file system that does not lock (Lustre mounted without -o flock, some FUSE file systems)
NO_LOCKING = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def _describe_holder(path):
    try:
        holder = json.loads(Path(path).read_text() or "{}")
        return f"host {holder['host']}, PID {holder['pid']}, started {holder['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "which has not written who it is yet"


class OutputLock:
    """The output directory's lock, held from a run's start to its process's end (the kernel drops it then,
    however the process ends: a requeued or restarted job takes it again). A second run that would write
    the same directory (a duplicate submission, a requeue while the lost node's step still runs, a fine-tune
    whose default --output-dir is its parent's) is refused in one line naming the first. A POSIX lock
    (lockf): it works over NFS, and a forked loader worker does not inherit it."""

    def __init__(self, output_dir, wait=0.0, say=None):
        self.directory = Path(output_dir)
        self.created = not self.directory.exists()
        self.path, self.warning = self.directory / LOCK, None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as error:
            raise UsageError(f"cannot write to --output-dir {self.directory} ({error.strerror or error}): "
                             "choose a directory you can write to") from None
        deadline, said = time.monotonic() + wait, False
        while True:
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as error:
                if error.errno in NO_LOCKING:
                    self.warning = (f"warning: cannot lock {self.path} ({error.strerror}): this file system does not "
                                    "lock files, so a second run started in this --output-dir would not be refused")
                    return
                if error.errno not in (errno.EACCES, errno.EAGAIN):
                    os.close(self.fd)
                    raise UsageError(f"cannot lock {self.path} ({error.strerror or error})") from None
                holder = _describe_holder(self.path)
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    raise UsageError(f"{self.directory} is in use by another run ({holder}): one run at a time writes "
                                     "an output directory; wait for that one to end, or give this one another "
                                     "--output-dir") from None
                if say is not None and not said:
                    say(f"waiting up to {wait:.0f} s for the run this job replaces to release {self.path} ({holder})")
                    said = True
                time.sleep(1)
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        text = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": started}) + "\n"
        try:
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, text.encode(), 0)
        except OSError as error:  # a full disk, say
            raise UsageError(f"cannot write to --output-dir {self.directory} ({error.strerror or error}): "
                             "choose a directory you can write to") from None

    def abandon(self):
        """A run that ended before it wrote anything leaves no directory that it created."""
        if self.created and [entry.name for entry in self.directory.iterdir()] == [LOCK]:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.directory.rmdir()

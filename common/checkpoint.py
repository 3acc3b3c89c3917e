"""Checkpoints: written atomically by one process, read with weights_only=True.

A checkpoint is a dict of plain data and tensors:
  epoch (epochs completed), arch, num_classes, classes, state_dict (of the bare
  model: loads into torchvision.models.<arch>(num_classes=K) as it is),
  optimizer, scheduler, scaler, best_acc1, args (a plain dict).
"""
import os
import pickle
import re
import shutil
from pathlib import Path

import torch

from .args import UsageError

CHECKPOINT = "checkpoint.pth"
BEST = "model_best.pth"
# Added to parameter names by DataParallel / DistributedDataParallel and torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def unwrap(model):
    """The bare model inside DataParallel, DistributedDataParallel and torch.compile wrappers."""
    while True:
        if isinstance(model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
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


def _atomic_write(path, write):
    """Run write(file) on a temp file beside `path`, fsync it, then rename it over `path`:
    a reader (or a crash) sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_checkpoint(state, output_dir, is_best):
    """Write checkpoint.pth (and model_best.pth when is_best). Call it from the writer rank only."""
    output_dir = Path(output_dir)
    _atomic_write(output_dir / CHECKPOINT, lambda file: torch.save(state, file))
    if is_best:
        with open(output_dir / CHECKPOINT, "rb") as source:
            _atomic_write(output_dir / BEST, lambda file: shutil.copyfileobj(source, file))


def resolve_resume(resume, output_dir):
    """The checkpoint path that --resume names, or None to start fresh."""
    if not resume:
        return None
    if resume == "auto":
        path = Path(output_dir) / CHECKPOINT
        return path if path.is_file() else None
    if not Path(resume).is_file():
        raise UsageError(f"--resume {resume}: no such file (give a checkpoint.pth, or --resume auto)")
    return Path(resume)


def load_checkpoint(path):
    """The checkpoint dict at `path`, loaded with weights_only=True (nothing in it is executed)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
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

"""torchvision's pretrained weights (--pretrained, --weights NAME): found by name in its registry, downloaded into
torch's hub cache where missing, and read there as weights alone (weights_only=True: nothing in the file runs); what
cannot be had is one line that says where the file goes.
"""

import pickle
import socket
from pathlib import Path

import torch
import torchvision

from .errors import UsageError, import_named


def pretrained_weights(arch, name=None):
    """torchvision's weight set `name` of `arch` ("ResNet50_Weights.IMAGENET1K_V2", "IMAGENET1K_V2"; None: its
    DEFAULT), from the registry alone (nothing is downloaded); a UsageError names the sets there are."""
    if import_named(arch, "--arch") is not None:  # (a builder of yours: -a PKG.MOD:FN)
        given = f"--weights {name}" if name else "--pretrained"
        raise UsageError(f"{given} needs a torchvision --arch, not {arch} (a file of its weights: --init-from PATH)")
    enum = torchvision.models.get_model_weights(arch)
    key = (name or "DEFAULT").removeprefix(f"{enum.__name__}.")
    try:
        return enum[key]
    except KeyError:
        raise UsageError(
            f"--weights {name}: {arch} has {', '.join(f'{enum.__name__}.{w.name}' for w in enum)} "
            "(a file of weights: --init-from PATH)"
        ) from None


DOWNLOAD_TIMEOUT = 60  # seconds a download of pretrained weights waits for bytes (a proxy that says nothing)


def offline_message(weights, error):
    """The line for torchvision's `weights` that could not be read or downloaded: the file, and where it goes."""
    name = weights.url.rsplit("/", 1)[-1]
    folder, reason = f"{torch.hub.get_dir()}/checkpoints", " ".join(str(error).split())[:200] or type(error).__name__
    if Path(folder, name).is_file():  # (a download cut short or saved from an error page, a file of code)
        return (
            f"cannot read pretrained weights {weights} from {folder}/{name} ({reason}): delete it (the next run "
            f"downloads it again), or put the file from {weights.url} there"
        )
    return (
        f"cannot get pretrained weights {weights} ({reason}): put {name} (from {weights.url}) into {folder}, or train "
        "without --pretrained"
    )


def pretrained_model(arch, weights, kwargs):
    """torchvision's `arch` with `weights`, downloaded into torch's hub cache where missing (its hash checked, as
    torchvision's builders do; a server silent for DOWNLOAD_TIMEOUT s ends it), and read once with weights_only=True
    first: a file there that is no weights, or holds code, is one line before torchvision's builder reads it with
    pickle (nothing in it runs)."""
    previous = socket.getdefaulttimeout()
    try:
        socket.setdefaulttimeout(DOWNLOAD_TIMEOUT)
        weights.get_state_dict(progress=True, check_hash=True, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:  # URLError is an OSError
        raise UsageError(offline_message(weights, error)) from None
    finally:
        socket.setdefaulttimeout(previous)
    try:
        return torchvision.models.get_model(arch, weights=weights, **kwargs)
    except RuntimeError as error:  # (another model's weights under its name; not a failure of the host: its own)
        if "Error(s) in loading state_dict" not in str(error):
            raise
        raise UsageError(offline_message(weights, error)) from None

"""Any torchvision classification model by name, or your own as `package.module:callable`."""
import importlib

import torch.nn as nn
import torchvision

from .errors import UsageError


def _replace_head(model, num_classes):
    """Swap the last classifier layer of a pretrained model for one with `num_classes` outputs."""
    for name, module in reversed(list(model.named_modules())):
        if isinstance(module, nn.Linear):
            new = nn.Linear(module.in_features, num_classes)
        elif isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1):  # squeezenet
            new = nn.Conv2d(module.in_channels, num_classes, kernel_size=1)
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        return model
    raise UsageError("cannot find the classifier layer to resize for --pretrained")


def custom_builder(arch):
    """The callable that `--arch package.module:callable` names (None for torchvision names)."""
    if ":" not in arch:
        return None
    module_name, _, name = arch.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise UsageError(f"--arch {arch}: cannot import {name} from {module_name} ({error})")


def pretrained_weights(arch, name=None):
    """torchvision's weight set `name` of `arch` ("ResNet50_Weights.IMAGENET1K_V2", "IMAGENET1K_V2"; None: its
    DEFAULT), from the registry alone (nothing is downloaded); a UsageError names the sets there are."""
    if custom_builder(arch) is not None:
        raise UsageError(f"--pretrained needs a torchvision --arch, not {arch}")
    enum = torchvision.models.get_model_weights(arch)
    key = (name or "DEFAULT").removeprefix(f"{enum.__name__}.")
    try:
        return enum[key]
    except KeyError:
        raise UsageError(f"--weights {name}: {arch} has {', '.join(f'{enum.__name__}.{w.name}' for w in enum)}") from None


def build_model(arch, num_classes, pretrained=False, dropout=None, weights=None):
    kwargs = {} if dropout is None else {"dropout": dropout}
    builder = custom_builder(arch)
    if builder is not None:  # called as builder(num_classes=K[, dropout=P])
        if pretrained:
            raise UsageError(f"--pretrained needs a torchvision --arch, not {arch}")
        return builder(num_classes=num_classes, **kwargs)
    try:
        if not pretrained:
            return torchvision.models.get_model(arch, num_classes=num_classes, **kwargs)
        weights = pretrained_weights(arch, weights)
        try:
            model = torchvision.models.get_model(arch, weights=weights, **kwargs)
        except (OSError, RuntimeError) as error:  # URLError is an OSError
            raise UsageError(f"cannot get pretrained weights {weights} ({error}): download them "
                             "into $TORCH_HOME/hub/checkpoints or train without --pretrained")
    except TypeError as error:
        if "dropout" in str(error):
            raise UsageError(f"--arch {arch} has no dropout to set: leave out --dropout")
        raise
    if len(weights.meta["categories"]) != num_classes:
        model = _replace_head(model, num_classes)
    return model

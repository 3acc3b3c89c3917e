"""Any torchvision classification model by name, or your own as `package.module:callable`."""
import torch
import torch.nn as nn
import torchvision

from .errors import UsageError
from .named import import_named


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
    return import_named(arch, "--arch")


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
            if arch in ("googlenet", "inception_v3"):  # their default init, without the warning that it may change
                kwargs["init_weights"] = True
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


def check_input_size(model, arch, train_sizes, val_size, channels=3):
    """Refuse in one line an image size that `model` (--arch `arch`) cannot take (a crop smaller than its
    layers allow, a vision transformer's fixed size), before any process trains: one forward of two images at
    each training size and one at the validation crop, on the meta device (no memory, no arithmetic). Only
    torchvision's models are checked: a forward of your own may do more than compute (print, count, write),
    and it runs first in training; nor is a model the meta device cannot run."""
    if custom_builder(arch) is not None:
        return
    meta = {name: tensor.to("meta") for name, tensor in (*model.named_parameters(), *model.named_buffers())}
    was_training = model.training
    try:
        for size, training in [*((size, True) for size in sorted(set(train_sizes))), (val_size, False)]:
            model.train(training)
            try:
                with torch.no_grad():
                    torch.func.functional_call(model, meta, (torch.empty(2, channels, size, size, device="meta"),))
            except NotImplementedError:
                return
            except Exception as error:  # the layers' own shape checks: RuntimeError, AssertionError, ValueError
                reason = " ".join(str(error).split())
                if "meta" in reason.lower():  # an operation the meta device cannot run: no answer here
                    return
                raise UsageError(f"--arch {arch} cannot take {size}x{size} px images ({reason[:200]}): "
                                 f"{_size_hint(arch)}") from None
    finally:
        model.train(was_training)


def _size_hint(arch):
    """What the crop-size flags should be for torchvision's `arch`: its minimum and trained size."""
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    return (f"choose --train-crop-size and --val-crop-size that it takes (torchvision: at least "
            f"{weights.meta['min_size'][0]} px; its weights were trained at {weights.transforms().crop_size[0]} px)")

"""Models: any torchvision classification model by name, or your own as `package.module:callable`; auxiliary heads'
losses, autocast (and the wrapper DataParallel needs), the memory format, the bare model inside its wrappers; and
--model-ema's moving average of the weights, as torchvision's train.py keeps it (ModelEma).
"""

import contextlib
import math
import weakref
from copy import deepcopy

import torch
import torch.nn as nn
import torchvision
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel
from torch.utils.flop_counter import FlopCounterMode

from .errors import Preempted, UsageError, check_call, import_named
from .pretrained import pretrained_model, pretrained_weights


def classifiers(model, outputs):
    """(name, layer) of each classifier of `model` with `outputs` outputs: the head and any auxiliary head (Inception
    v3's AuxLogits.fc, GoogLeNet's aux1/aux2.fc2), as Linear layers or 1x1 convolutions (SqueezeNet's)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if (isinstance(module, nn.Linear) and module.out_features == outputs)
        or (isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1) and module.out_channels == outputs)
    ]


def first_conv(model):
    """(name, module) of the first nn.Conv2d of `model` (the layer that takes the images), or (None, None)."""
    return next(((name, layer) for name, layer in model.named_modules() if isinstance(layer, nn.Conv2d)), (None, None))


NEW_HEAD = "classes, new weights"  # how the header's changes end for a head made anew (untrained)


def replace_heads(model, categories, num_classes):
    """Swap every classifier of a pretrained model for `categories` classes (its head and its auxiliary heads) for
    a new one of `num_classes` outputs, with new weights. Returns what it did, for the run's header."""
    found = classifiers(model, categories)
    if not found:
        raise UsageError(f"cannot find the {categories}-class classifier layer to replace for --pretrained")
    for name, module in found:
        where = dict(device=module.weight.device, dtype=module.weight.dtype)
        if isinstance(module, nn.Linear):
            new = nn.Linear(module.in_features, num_classes, **where)
        else:
            new = nn.Conv2d(module.in_channels, num_classes, kernel_size=1, **where)
        model.set_submodule(name, new)
    return [f"{name}: {categories} -> {num_classes} {NEW_HEAD}" for name, _ in found]


def adapt_first_conv(model, arch, channels, pretrained):
    """Make a torchvision model (built for RGB) take `channels`-channel images: with --pretrained its first
    convolution's filters summed over RGB for 1 channel, else repeated and scaled by 3/channels (timm's
    adapt_input_conv); without, the fresh filters cut or repeated. Returns what it did, for the run's header; a model
    of yours, or one already built for these channels, is left as it is."""
    if channels == 3 or custom_builder(arch) is not None:
        return []
    name, conv = first_conv(model)
    if conv is not None and conv.in_channels == channels:
        return []  # a model built for these channels
    if conv is None or conv.in_channels != 3 or conv.groups != 1:
        takes = f"{conv.in_channels}-channel" if conv is not None else "RGB"
        raise UsageError(
            f"--arch {arch} takes {takes} images and the data's are {channels}-channel, and its first "
            "layer is no RGB convolution to adapt: convert the images in your dataset, or build the model "
            "for their channels (build_model)"
        )
    weight = conv.weight.detach()
    if channels == 1:
        weight = weight.sum(dim=1, keepdim=True) if pretrained else weight[:, :1]
        how = "RGB filters summed" if pretrained else "the fresh filters' first channel"
    else:
        weight = weight.repeat(1, math.ceil(channels / 3), 1, 1)[:, :channels] * (3 / channels if pretrained else 1)
        how = "RGB filters repeated, scaled by 3/channels" if pretrained else "the fresh filters repeated"
    shape = (conv.kernel_size, conv.stride, conv.padding, conv.dilation)
    options = dict(bias=conv.bias is not None, padding_mode=conv.padding_mode, device=weight.device, dtype=weight.dtype)
    new = nn.Conv2d(channels, conv.out_channels, *shape, **options)
    with torch.no_grad():
        new.weight.copy_(weight)
        if conv.bias is not None:
            new.bias.copy_(conv.bias)
    model.set_submodule(name, new)
    if getattr(model, "transform_input", False):
        model.transform_input = False  # it re-normalises 3 channels from ImageNet's statistics to its own
    return [f"{name}: 3 -> {channels} channels, {how}"]


class PatchConv2d(nn.Conv2d):
    """A convolution whose kernel is its stride, without padding (a patch embedding: ViT's conv_proj, the stems of
    ConvNeXt and Swin), computed as one matrix product of the patches by the filters, faster than cuDNN's
    (docs/benchmarks.md): nn.Conv2d's parameters, state dict and result (to rounding), laid out channels-last."""

    @staticmethod
    def fits(module):
        return (
            type(module) is nn.Conv2d
            and module.kernel_size == module.stride
            and max(module.stride) > 1
            and module.padding in ((0, 0), "valid")
            and module.dilation == (1, 1)
            and module.groups == 1
        )

    def forward(self, x):
        if x.ndim != 4 or x.shape[-2] < self.kernel_size[0] or x.shape[-1] < self.kernel_size[1]:
            return super().forward(x)  # (an image smaller than a patch: nn.Conv2d's error)
        (kh, kw), (n, c, h, w) = self.kernel_size, x.shape
        rows, cols = h // kh, w // kw
        patches = (
            x[:, :, : rows * kh, : cols * kw]
            .reshape(n, c, rows, kh, cols, kw)
            .permute(0, 2, 4, 1, 3, 5)
            .reshape(n * rows * cols, c * kh * kw)
        )
        y = nn.functional.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        return y.reshape(n, rows, cols, self.out_channels).permute(0, 3, 1, 2)


def patch_embedding_as_matmul(model):
    """Make the first convolution of a torchvision model build_model made a PatchConv2d where it is a patch embedding
    (PatchConv2d.fits), in place. Only the first: ConvNeXt's 2x2 downsampling layers were slower so."""
    _, first = first_conv(model)
    if built_by_library(model) and first is not None and PatchConv2d.fits(first):
        first.__class__ = PatchConv2d


def custom_builder(arch):
    """The callable that `--arch package.module:callable` names (None for torchvision names)."""
    return import_named(arch, "--arch")


_BUILT = weakref.WeakSet()  # the torchvision models build_model made (the Trainer adapts their first convolution)


def built_by_library(model):
    """Whether build_model made `model` from a torchvision --arch (a subclass may have built it itself)."""
    return model in _BUILT


def build_model(arch, num_classes, pretrained=False, dropout=None, weights=None):
    """The model --arch `arch` names, for `num_classes` classes: your builder's, or torchvision's (--pretrained: its
    weights set `weights`, the heads replaced for these classes)."""
    kwargs = {} if dropout is None else {"dropout": dropout}
    builder = custom_builder(arch)
    if builder is not None:  # called as builder(num_classes=K[, dropout=P])
        if pretrained:
            raise UsageError(f"--pretrained needs a torchvision --arch, not {arch}")
        check_call(
            builder, "--arch", arch, "a model's builder(num_classes=K[, dropout=P])", num_classes=num_classes, **kwargs
        )
        model = builder(num_classes=num_classes, **kwargs)
        if not isinstance(model, nn.Module):
            raise UsageError(f"--arch {arch} returned a {type(model).__name__}, not a torch.nn.Module")
        return model
    if not pretrained and arch in ("googlenet", "inception_v3"):
        kwargs["init_weights"] = True  # their default init, without the warning that it may change
    try:
        if pretrained:
            weights = pretrained_weights(arch, weights)
            model = pretrained_model(arch, weights, kwargs)
        else:
            model = torchvision.models.get_model(arch, num_classes=num_classes, **kwargs)
    except TypeError as error:
        if "dropout" in str(error):
            raise UsageError(f"--arch {arch} has no dropout to set: leave out --dropout")
        raise
    dropouts = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
    if dropout is not None and not any(isinstance(layer, dropouts) and layer.p == dropout for layer in model.modules()):
        # (ConvNeXt's builder takes any keyword, and drops it)
        raise UsageError(f"--arch {arch} has no dropout to set: leave out --dropout")
    if pretrained:
        categories = len(weights.meta["categories"])
        model.adaptations = replace_heads(model, categories, num_classes) if categories != num_classes else []
    _BUILT.add(model)
    return model


def meta_copy(model):
    """A copy of `model` whose parameters and buffers are meta tensors of the same shapes (a tied weight stays one):
    nothing read or copied, and whatever its forward keeps (a cache) stays with the copy."""

    def empty(tensor):
        meta = torch.empty_like(tensor, device="meta")
        return nn.Parameter(meta, requires_grad=False) if isinstance(tensor, nn.Parameter) else meta

    return deepcopy(model, memo={id(tensor): empty(tensor) for tensor in [*model.parameters(), *model.buffers()]})


def check_input_size(model, arch, train_sizes, val_size, channels=3, classes=None):
    """Refuse in one line, before any process trains, an image size that torchvision's `model` (--arch `arch`) cannot
    take and logits of another width than `classes`: a forward at each size on the meta device (no memory). A model of
    yours (-a PKG.MOD:FN) runs on a meta_copy, for its first convolution's channels alone; one the meta device cannot
    run is not checked. Returns the FLOPs per image of its forward at `val_size` in eval mode (a batch of 2: as
    diagnostics.forward_flops's one image, but for work done once a batch, Swin V2's position bias: 0.2%), or None."""
    counter = FlopCounterMode(display=False)
    if custom_builder(arch) is not None:
        try:
            with torch.no_grad(), counter:
                meta_copy(model).eval()(torch.empty(2, channels, val_size, val_size, device="meta"))
            return counter.get_total_flops() // 2
        except Preempted:  # a stop signal in start-up (launch.py): never taken for the model's answer
            raise
        except Exception as error:  # (a model that cannot be copied, a forward the meta device cannot run: unchecked)
            if "channel" in str(error).lower():
                _refuse_other_channels(model, channels)
            return None
    meta = {name: tensor.to("meta") for name, tensor in (*model.named_parameters(), *model.named_buffers())}
    was_training = model.training

    def forward(size, counted):
        with torch.no_grad(), counter if counted else contextlib.nullcontext():
            return torch.func.functional_call(model, meta, (torch.empty(2, channels, size, size, device="meta"),))

    try:
        for size, training in [*((size, True) for size in sorted(set(train_sizes))), (val_size, False)]:
            model.train(training)
            try:
                try:
                    output = forward(size, counted=not training)
                except Exception as error:  # (the counter's own failure is no answer: the forward again without it)
                    if training or isinstance(error, Preempted):
                        raise
                    counter, output = None, forward(size, counted=False)
            except NotImplementedError:
                return None
            except Preempted:  # a stop signal in start-up (launch.py): never taken for the model's answer
                raise
            except Exception as error:  # the layers' own shape checks: RuntimeError, AssertionError, ValueError
                reason = " ".join(str(error).split())
                if "meta" in reason.lower():  # an operation the meta device cannot run: no answer here
                    return None
                _refuse_other_channels(model, channels)  # (a model a subclass built: not adapted)
                raise UsageError(
                    f"--arch {arch} cannot take {size}x{size} px images ({reason[:200]}): {_size_hint(arch)}"
                ) from None
    finally:
        model.train(was_training)
    check_logits(split_output(output)[0], classes, "the model (build_model)")
    return None if counter is None else counter.get_total_flops() // 2


def _refuse_other_channels(model, channels):
    """Refuse in one line a model whose first convolution takes other channels than `channels`."""
    name, conv = first_conv(model)
    if conv is not None and conv.in_channels != channels:
        raise UsageError(
            f"the model (build_model) takes {conv.in_channels}-channel images (its first convolution, {name}) and "
            f"the data's are {channels}-channel: build it for them"
        )


def check_logits(logits, classes, source):
    """Refuse in one line logits of another shape than (batch, `classes`) (None: not checked): a head of another
    width would train on silently (cross-entropy takes any width above the labels) or fail in a metric."""
    if classes is not None and isinstance(logits, torch.Tensor) and (logits.ndim != 2 or logits.shape[1] != classes):
        raise UsageError(
            f"{source} gives logits of shape {tuple(logits.shape)}; the data has {classes} classes: "
            f"expected (batch, {classes}) (a model's head of len(classes) outputs)"
        )


def _size_hint(arch):
    """What the crop-size flags should be for torchvision's `arch`: its minimum and trained size."""
    weights = torchvision.models.get_model_weights(arch).DEFAULT
    return (
        f"choose --train-crop-size and --val-crop-size that it takes (torchvision: at least "
        f"{weights.meta['min_size'][0]} px; its weights were trained at {weights.transforms().crop_size[0]} px)"
    )


AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device, amp):
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[amp])


class AutocastForward(nn.Module):
    """`module` whose forward runs under autocast with the --amp dtype in whichever thread calls it: nn.DataParallel's
    replica threads re-enter autocast with the device's default dtype (float16 on CUDA), so `--amp bf16` would compute
    in float16, unscaled (PyTorch's "AMP with DataParallel" recipe). No state of its own."""

    def __init__(self, module, device_type, amp):
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, AMP_DTYPES[amp]

    def forward(self, *args, **kwargs):
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


# Auxiliary heads' weights in the loss, by the type of output that carries them: torchvision's GoogLeNet and
# Inception v3 return these in training (their papers' weights: 0.3 for each of GoogLeNet's two, 0.4 for
# Inception's one). Another model's auxiliary outputs weigh its attribute `aux_loss_weight`, else AUX_WEIGHT.
AUX_WEIGHTS = {"GoogLeNetOutputs": 0.3, "InceptionOutputs": 0.4}
AUX_WEIGHT = 0.3


def split_output(output):
    """(main logits, [auxiliary logits], their weight or None) of a model's output: a tensor; a tuple or
    list (GoogLeNet's and Inception's named tuples) whose first element is the main logits; or a dict whose
    "logits" (or "out") entry is, the other tensors being auxiliary logits. None entries are skipped."""
    if isinstance(output, torch.Tensor):
        return output, [], None
    if isinstance(output, dict):
        key = next((key for key in ("logits", "out") if key in output), None)
        if key is None:
            raise UsageError(
                f"the model returned a dict without 'logits' or 'out' (keys {', '.join(map(str, output))}): "
                "name the main output 'logits'"
            )
        main, aux = output[key], [value for name, value in output.items() if name != key]
    elif isinstance(output, (tuple, list)) and output:
        main, aux = output[0], list(output[1:])
    else:
        raise UsageError(
            f"the model returned a {type(output).__name__}: return the logits as a tensor, a tuple "
            "(logits, auxiliary logits, ...) or a dict with 'logits'"
        )
    aux = [value for value in aux if value is not None]
    if not all(isinstance(value, torch.Tensor) for value in [main, *aux]):
        raise UsageError(
            f"the model's {type(output).__name__} holds {', '.join(type(v).__name__ for v in [main, *aux])}: "
            "each output must be a tensor of logits"
        )
    return main, aux, AUX_WEIGHTS.get(type(output).__name__)


def loss_with_aux(criterion, output, labels, aux_weight=None):
    """(loss, main logits): criterion on the main logits, plus each auxiliary head's criterion times its
    weight (split_output's, else `aux_weight`, else AUX_WEIGHT), as torchvision's GoogLeNet / Inception v3
    are trained."""
    if isinstance(output, torch.Tensor):  # (a plain model's step: split_output is for the models with more outputs)
        return criterion(output, labels), output
    main, aux, weight = split_output(output)
    loss = criterion(main, labels)
    weight = weight if weight is not None else (aux_weight if aux_weight is not None else AUX_WEIGHT)
    for logits in aux:
        loss = loss + weight * criterion(logits, labels)
    return loss, main


def compiled(model, static=False):
    """torch.compile(model); static=True: no dynamic shapes (a sharded model: Inductor fails on FSDP's dynamic shapes in
    backward; a batch of another size compiles another graph instead)."""
    # DDP's buckets and FSDP's hooks split the model into several graphs; Inductor's layout optimisation then predicts
    # strides that cuDNN's backward does not give (pytorch/pytorch#113740): off for these compiles only.
    split = static or isinstance(model, DistributedDataParallel)
    return torch.compile(
        model, dynamic=False if static else None, options={"layout_optimization": False} if split else None
    )


def unwrap(model):
    """The bare model inside DataParallel, DistributedDataParallel, AutocastForward and torch.compile wrappers."""
    while True:
        if isinstance(model, (torch.nn.DataParallel, DistributedDataParallel, AutocastForward)):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def warn_slow_amp(amp, device, warn):
    """One warning where --amp computes slower than float32, emulated: on a CPU without native bf16/fp16 instructions
    (docs/benchmarks.md), and bf16 on GPUs before Ampere (compute capability < 8.0)."""
    if amp == "none":
        return
    if device.type == "cpu":
        mkldnn = torch.ops.mkldnn
        native = mkldnn._is_mkldnn_bf16_supported() if amp == "bf16" else mkldnn._is_mkldnn_fp16_supported()
        if not native:
            warn(
                f"warning: --amp {amp} on this CPU ({torch.backends.cpu.get_cpu_capability()}), which has no "
                f"native {amp} instructions: it is emulated and much slower than float32; leave out --amp here"
            )
    elif amp == "bf16" and torch.cuda.get_device_capability(device) < (8, 0):
        warn(
            f"warning: --amp bf16 on {torch.cuda.get_device_name(device)} (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))} < 8.0) is emulated: "
            "use --amp fp16 on this GPU"
        )


# Convolutional networks that channels_last does not make faster on the CPU (docs/benchmarks.md): ShuffleNet's
# channel shuffle re-lays the whole activation, ConvNeXt's LayerNorms permute to NHWC and back anyway.
CHANNELS_LAST_NOT_FASTER = ("ShuffleNetV2", "ConvNeXt")


def use_channels_last(choice, device, amp, model):
    """--channels-last on/off, or for auto: on where it is measured faster (docs/benchmarks.md): for convolutional
    networks (two Conv2d layers or more; a vision transformer has one) on the CPU, and on GPUs with --amp or TF32
    convolutions (tensor cores read NHWC); off in float32 on older GPUs, for CHANNELS_LAST_NOT_FASTER, and others."""
    if choice != "auto":
        return choice == "on"
    if type(model).__name__ in CHANNELS_LAST_NOT_FASTER:
        return False
    convolutional = sum(isinstance(module, nn.Conv2d) for module in model.modules()) >= 2
    return convolutional and (device.type == "cpu" or amp != "none" or tf32_convolutions(device))


def tf32_convolutions(device):
    """Whether float32 convolutions on `device` run on tensor cores (TF32): a GPU of compute capability 8.0 or more
    with cuDNN's TF32 allowed (torch's default)."""
    return (
        device.type == "cuda" and torch.backends.cudnn.allow_tf32 and torch.cuda.get_device_capability(device) >= (8, 0)
    )


class BareModelGuard:
    """`with guard:` around train_step: a forward of the bare model with gradients, not through the
    DistributedDataParallel `wrapper` around it, is refused in one line. Its gradients would skip DDP's all-reduce, and
    each rank would step on its own gradients. Python hooks, so eager only (a compiled model has none)."""

    def __init__(self, wrapper, bare):
        self.active = self.inside = False
        self.bare = weakref.ref(bare)  # (a deepcopy of the model copies its hook: the copy is not checked)
        wrapper.register_forward_pre_hook(self._enter)
        wrapper.register_forward_hook(self._leave, always_call=True)
        bare.register_forward_pre_hook(self._check)

    @classmethod
    def around(cls, model, bare):
        """A guard where `model` is DDP (eager), else a context that does nothing."""
        return cls(model, bare) if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    def _enter(self, module, args):
        self.inside = True

    def _leave(self, module, args, output):
        self.inside = False

    def _check(self, module, args):
        if self.active and not self.inside and torch.is_grad_enabled() and module is self.bare():
            raise UsageError(
                "train_step called the bare model (self.model), not the DistributedDataParallel `model` "
                "it is given: its gradients would skip the all-reduce over the ranks; call `model`"
            )

    def __enter__(self):
        self.active = True

    def __exit__(self, *exc):
        self.active = False


def gradient_sync(model, enabled):
    """A context for a forward and its backward that sync the gradients over the ranks (`enabled`) or only sum them
    into .grad (a micro-batch before the last of an optimizer step): DDP's no_sync() (which its forward reads),
    FSDP2's set_requires_gradient_sync(False); nothing to change for one process (DataParallel, one device)."""
    from torch.distributed.fsdp import FSDPModule

    module = model
    while module is not None and not isinstance(module, (DistributedDataParallel, FSDPModule)):
        module = getattr(module, "_orig_mod", None)  # (torch.compile's wrapper)
    if enabled or module is None:
        return contextlib.nullcontext()
    return module.no_sync() if isinstance(module, DistributedDataParallel) else _fsdp_no_sync(module)


@contextlib.contextmanager
def _fsdp_no_sync(module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def step_result(result, method, classes=None):
    """(loss, output, values) of what train_step / evaluate_step returned: (loss, output) or (loss, output,
    {name: scalar}); output of shape (batch, `classes`)."""
    if isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], torch.Tensor):
        loss, output, values = (*result, {}) if len(result) == 2 else result
        if isinstance(output, torch.Tensor) and isinstance(values, dict):
            check_logits(output, classes, method)  # (a shape: no wait for the device)
            if loss.numel() != 1:  # (was a traceback from backward)
                raise UsageError(
                    f"{method}'s loss has shape {list(loss.shape)}: return the batch's mean, a scalar (a criterion of "
                    "reduction='none' gives one per image)"
                )
            if method == "train_step" and not loss.requires_grad:  # (was a traceback from backward)
                raise UsageError("train_step's loss does not require grad (detached, or computed under torch.no_grad)")
            return loss.reshape(()), output, values
    raise UsageError(
        f"{method} returned {type(result).__name__}"
        + (f" of {', '.join(type(part).__name__ for part in result)}" if isinstance(result, tuple) else "")
        + ": return (loss, logits) or (loss, logits, {name: scalar value})"
    )


# --model-ema


def adjusted_decay(decay, global_batch, every, epochs):
    """The decay per update, as torchvision's train.py adjusts --model-ema-decay (after pycls): the EMA
    spans about the same share of the run whatever the batch, the update interval and the epochs.
    torchvision's world_size x per-GPU batch is our global -b."""
    return 1.0 - min(1.0, (1.0 - decay) * (global_batch * every / epochs))


def ema_update(decay):
    """torchvision's EMA update, decay x average + (1 - decay) x weights (its ExponentialMovingAverage), as two
    foreach calls in place (float32, float64: its product of the weights fused into the add, to rounding; in half
    precision that rounding differed with a tensor's layout, so its own formula), for sharded tensors
    (DTensors) apart from plain ones (one call cannot take both). Torch's get_ema_multi_avg_fn lerps, which made an
    infinity (an attention mask's -inf) NaN; decay 0 copies the weights (0 x -inf is NaN too), 1 keeps the EMA."""

    def update(averaged, current, _count):  # (AveragedModel gives tensors of one device and dtype)
        for sharded in (True, False):
            pairs = [(a, c) for a, c in zip(averaged, current) if hasattr(a, "to_local") == sharded]
            if pairs and 0 < decay < 1 and pairs[0][0].dtype in (torch.float32, torch.float64):
                torch._foreach_mul_([a for a, _ in pairs], decay)
                torch._foreach_add_([a for a, _ in pairs], [c for _, c in pairs], alpha=1 - decay)
            elif decay < 1:
                for a, c in pairs:
                    a.copy_(c if decay == 0 else a * decay + c * (1 - decay))

    return update


class ModelEma:
    """The EMA of the bare `model` (not a DataParallel / DDP wrapper: the same parameters, without prefixes). `module`
    is a model of the same class: evaluate it, or load its state_dict into a plain model."""

    def __init__(self, model, decay, every=1, warmup_epochs=0.0):
        self.model, self.decay, self.every, self.warmup_epochs = model, decay, every, warmup_epochs
        # device=None: the copy stays where the model is, n_averaged on the CPU. An update waits for the
        # GPU once (AveragedModel copies n_averaged there), as torchvision's does: once per --model-ema-steps.
        self.averaged = AveragedModel(model, multi_avg_fn=ema_update(decay), use_buffers=True)

    @property
    def module(self):
        return self.averaged.module

    @property
    def n_averaged(self):
        return int(self.averaged.n_averaged)

    def after_step(self, step, epoch, steps_per_epoch=None):
        """After the optimizer step numbered `step` (from 0, in its epoch) of `epoch`: at steps 0, every,
        2 x every, ... of each epoch (torchvision's `i % args.model_ema_steps == 0`) the EMA moves towards the
        weights. During the warmup it restarts from them each time (torchvision resets n_averaged to 0, so the next
        update copies the weights): its epochs, or with `steps_per_epoch` its steps, as the lr's (1.2 epochs: 12 of
        10). Returns whether it updated."""
        if step % self.every:
            return False
        self.averaged.update_parameters(self.model)
        if steps_per_epoch is None:
            warming = epoch < self.warmup_epochs
        else:
            warming = epoch * steps_per_epoch + step < round(self.warmup_epochs * steps_per_epoch)
        if warming:
            self.averaged.n_averaged.fill_(0)
        return True

    def state_dict(self):
        """The EMA's weights, with the bare model's keys (they load into a plain model), and the count of its
        updates since it last restarted."""
        return {"state_dict": self.module.state_dict(), "n_averaged": self.n_averaged}

    def restart(self, n_averaged=0, copy=True):
        """Set the count of updates (a checkpoint's); copy=True: the weights' values first, as a new EMA has them
        (in place: a sharded model, which cannot be deep-copied, and its sharded copy alike)."""
        if copy:
            for mine, theirs in zip(
                [*self.module.parameters(), *self.module.buffers()], [*self.model.parameters(), *self.model.buffers()]
            ):
                mine.detach().copy_(theirs.detach())
        self.averaged.n_averaged.fill_(n_averaged)

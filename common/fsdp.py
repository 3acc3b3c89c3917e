"""FSDP2 for train_fsdp.py: which modules become shard units, and the wrap with its options.

fully_shard splits each parameter of a unit over the ranks (DTensors): a rank holds 1/N of the weights, their gradients
and the optimizer state, and a unit's parameters are gathered whole only while it computes. The units (default_units)
are a model's repeated blocks: the outermost modules that are items of an nn.Sequential or nn.ModuleList, hold
parameters, and are not torch.nn layers (ResNet's Bottleneck, ViT's EncoderBlock, ConvNeXt's CNBlock, ...); what is left
(stem, head) stays with the root. The Trainer's shard_units hook chooses others (docs/adapting.md).
"""

import contextlib
from collections import Counter
from functools import partial

import torch
import torch.nn as nn

from .errors import UsageError

# Normalisation layers that keep float32 parameters under --amp bf16: BatchNorm's running statistics stay float32,
# and its CPU and GPU kernels take bf16 inputs with float32 weights, not bf16 weights with float32 statistics.
FLOAT32_LAYERS = (nn.modules.batchnorm._BatchNorm,)


LISTS = (nn.Sequential, nn.ModuleList)


def recomputed_in_place(unit):
    """torch.utils.checkpoint's context_fn for `unit`: its forward as it is, and its recomputation in backward, after
    which the unit's buffers are as that forward left them (was: BatchNorm's running statistics updated twice)."""

    @contextlib.contextmanager
    def buffers_kept():
        kept = {name: buffer.clone() for name, buffer in unit.named_buffers()}
        try:
            yield
        finally:
            with torch.no_grad():
                for name, value in kept.items():
                    unit.get_buffer(name).copy_(value)

    return contextlib.nullcontext(), buffers_kept()


def is_layer(module):
    """Whether `module` is one of torch.nn's layers, or a subclass of one (ConvNeXt's LayerNorm2d)."""
    return any(
        base.__module__.startswith("torch.nn") and base not in (nn.Module, nn.ModuleDict, *LISTS)
        for base in type(module).__mro__
    )


def default_units(model):
    """The outermost items of the model's nn.Sequential / nn.ModuleList containers whose class is not torch.nn's
    own (blocks, not layers), that hold parameters and are no such list themselves: the module's docstring's rule."""
    units = []

    def visit(module):
        is_list = isinstance(module, LISTS)
        for child in module.children():
            block = not is_layer(child) and any(True for _ in child.parameters())
            if is_list and block and not isinstance(child, LISTS):
                units.append(child)
            else:  # a layer, or a list of blocks (RegNet's AnyStage, torchvision's Conv2dNormActivation)
                visit(child)

    visit(model)
    return units


def describe_units(units):
    """'BasicBlock x 8' for the header."""
    counts = Counter(type(unit).__name__ for unit in units)
    return ", ".join(f"{name} x {count}" for name, count in counts.items()) or "none (the root alone)"


def unit_names(model, units):
    """The names of `units` in `model`; a unit that is not a submodule, or that is inside another, refused in one
    line (each unit is sharded, and wrapped, whole)."""
    names = {module: name for name, module in model.named_modules()}
    found = []
    for unit in units:
        if not names.get(unit):
            raise UsageError(f"shard_units returned a {type(unit).__name__} that is not a submodule of the model")
        if names[unit] in found:
            raise UsageError(f"shard_units returned {names[unit]} twice: each unit once (docs/adapting.md)")
        found.append(names[unit])
    for name in found:
        outer = next((other for other in found if name.startswith(other + ".")), None)
        if outer is not None:
            raise UsageError(f"shard_units returned {name} inside {outer}: units must not nest (docs/adapting.md)")
    return found


class Sharding:
    """How train_fsdp.py shards a model: its device mesh (all ranks in one dimension) and its flags. Made once the
    process group is up; sharding(model, units) shards a bare model in place and returns it (Trainer.build calls it
    before the optimizer is made over the shards, and for the EMA's copy)."""

    def __init__(self, config, runtime):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        if config.cpu_offload and runtime.device.type != "cuda":
            raise UsageError(
                "--cpu-offload keeps parameters and optimizer state in host memory for a GPU's "
                "steps: on the CPU they are there already (leave it out)"
            )
        self.mesh = init_device_mesh(runtime.device.type, (runtime.world_size,))
        self.reshard_after_forward = config.reshard_after_forward
        self.activation_checkpointing, self.compile = config.activation_checkpointing, config.compile
        self.offload = CPUOffloadPolicy() if config.cpu_offload else None
        # --amp bf16: FSDP casts the gathered parameters to bf16 for compute, and reduces gradients in float32
        # (the sharded parameters and the optimizer stay float32). The trainer's autocast stays on over it, so that
        # the loss and softmax run in float32 as under DDP.
        self.bf16 = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if config.amp == "bf16"
            else None
        )
        self.float32 = MixedPrecisionPolicy(
            param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
        self.described = ""

    def _options(self, policy):
        options = {"mesh": self.mesh, "reshard_after_forward": self.reshard_after_forward}
        if policy is not None:
            options["mp_policy"] = policy
        if self.offload is not None:
            options["offload_policy"] = self.offload
        return options

    def __call__(self, model, units):
        """Shard `model` (on its device) unit by unit, then at the root: with --activation-checkpointing each unit
        recomputes its activations in backward instead of keeping them (torch.utils.checkpoint, wrapped around the
        unit before it is sharded, as torchtitan does); under --amp bf16 the normalisation layers are units of
        their own that compute in float32."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        units = list(units)
        names = unit_names(model, units)
        if self.activation_checkpointing and not units:  # (was: on in the header, and nothing recomputed)
            raise UsageError(
                f"--activation-checkpointing recomputes each shard unit's activations, and {type(model).__name__} "
                "has none (fsdp: units none): give it units (a --trainer's shard_units, docs/adapting.md), or leave "
                "the flag out"
            )
        self.described = describe_units(units)
        if self.activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            # preserve_rng_state: the recomputed forward draws the same dropout masks (an exact gradient); its
            # buffers restored after it: BatchNorm's running statistics are updated once a step, as without the flag
            # (compiled, the graph recomputes without updating them, and torch takes no context_fn there).
            units = [
                checkpoint_wrapper(unit, preserve_rng_state=True, context_fn=partial(recomputed_in_place, unit))
                if not self.compile
                else checkpoint_wrapper(unit, preserve_rng_state=True)
                for unit in units
            ]
            for name, wrapper in zip(names, units):
                model.set_submodule(name, wrapper)
        if self.bf16 is not None:
            for module in model.modules():
                if isinstance(module, FLOAT32_LAYERS):
                    fully_shard(module, **self._options(self.float32))
        for unit in units:
            if not isinstance(unit, FSDPModule):  # (a BatchNorm unit under bf16: sharded above, in float32)
                fully_shard(unit, **self._options(self.bf16))
        fully_shard(model, **self._options(self.bf16))
        return model

    def describe(self, model, optimizer):
        """The header's lines: the units and what a rank holds of the model's state against one replica."""
        local = state_bytes(model, optimizer)[0]
        whole = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
        slots = optimizer_slots(optimizer)
        state = f"{slots} x" if slots is not None else "an unknown multiple of"
        return [
            f"fsdp: units {self.described}, then the root; --reshard-after-forward "
            f"{'on' if self.reshard_after_forward else 'off'}, --activation-checkpointing "
            f"{'on' if self.activation_checkpointing else 'off'}, --cpu-offload {'on' if self.offload else 'off'}"
            + (", bf16 compute with float32 gradient reduction (BatchNorm in float32)" if self.bf16 else ""),
            f"fsdp memory per rank: parameters {_mib(local)} + gradients {_mib(local)} + optimizer state "
            f"{state} parameters{f' ({_mib(local * slots)})' if slots else ''}; one unsharded replica: "
            f"{_mib(whole)} + {_mib(whole)}" + (f" + {_mib(whole * slots)}" if slots else ""),
        ]


# Tensors of optimizer state per parameter, by optimizer class (SGD and RMSprop: optimizer_slots counts them).
STATE_SLOTS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "Adadelta": 2}


def optimizer_slots(optimizer):
    """How many tensors of a parameter's size the optimizer keeps per parameter, or None when not known."""

    def used(option):  # 1 if a parameter group sets it, else 0
        return int(any(group.get(option) for group in optimizer.param_groups))

    name = type(optimizer).__name__
    if name == "SGD":
        return used("momentum")
    if name == "RMSprop":
        return 1 + used("momentum") + used("centered")
    return STATE_SLOTS.get(name)


def state_bytes(model, optimizer):
    """(parameters, gradients, optimizer state) bytes this rank holds: its shards, measured."""
    gradients = (parameter.grad for parameter in model.parameters() if parameter.grad is not None)
    state = (
        value
        for per_parameter in optimizer.state.values()
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
    return _local_bytes(model.parameters()), _local_bytes(gradients), _local_bytes(state)


def _local_bytes(tensors):
    """The bytes of `tensors` on this rank (a DTensor's: its local shard's)."""
    return sum(
        (tensor.to_local() if hasattr(tensor, "to_local") else tensor).numel() * tensor.element_size()
        for tensor in tensors
    )


def _mib(size):
    return f"{size / 2**20:.1f} MiB"


def check_trained(model, criterion, optimizer):
    """train_fsdp.py trains the sharded model's parameters alone: its optimizer's checkpoint is the model's
    (get_optimizer_state_dict), which a criterion's parameters, or a tensor of the optimizer's that is no parameter of
    the model, failed at the first save (a KeyError, after an epoch): refused in one line."""
    if any(parameter.requires_grad for parameter in criterion.parameters()):
        raise UsageError(
            "train_fsdp.py: the criterion (build_criterion) has parameters, which FSDP neither shards nor checkpoints "
            "with its optimizer: make them the model's (build_model)"
        )
    own = {id(parameter) for parameter in model.parameters()}
    if any(id(tensor) not in own for group in optimizer.param_groups for tensor in group["params"]):
        raise UsageError(
            "train_fsdp.py: the optimizer (build_optimizer) holds tensors that are not the model's parameters, which "
            "FSDP's checkpoint of its state cannot save: make them the model's (build_model)"
        )

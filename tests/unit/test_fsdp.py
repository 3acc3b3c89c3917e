"""common/fsdp.py: which modules are shard units, in every family torchvision lists and in a model of one's own;
the sharding's options (bf16 with BatchNorm in float32, activation checkpointing, its refusals) and what the header
says a rank holds. In-process, in a process group of one."""

import pytest
import torch
import torch.nn as nn
import torchvision

from common import models
from common.errors import UsageError
from common.fsdp import Sharding, default_units, describe_units, optimizer_slots, state_bytes
from common.trainer import Trainer
from conftest import cpu_runtime, parse, sharded_trainer
from tests.tiny_models import BlockNet, TinyNet


@pytest.mark.parametrize(
    "arch, units",
    [
        ("resnet18", "BasicBlock x 8"),
        ("resnet50", "Bottleneck x 16"),
        ("vit_b_16", "EncoderBlock x 12"),
        ("swin_t", "SwinTransformerBlock x 12, PatchMerging x 3"),
        ("convnext_tiny", "CNBlock x 18"),
        ("efficientnet_b0", "MBConv x 16"),
        ("maxvit_t", "MaxVitBlock x 4"),
        ("densenet121", "_DenseBlock x 4"),
        ("mobilenet_v3_small", "InvertedResidual x 11"),
    ],
)
def test_the_units_of_torchvision_models_are_their_blocks(arch, units):
    """Built on the meta device: no weights are made."""
    with torch.device("meta"):
        model = torchvision.models.get_model(arch, num_classes=10)
    assert describe_units(default_units(model)) == units


def test_a_list_of_blocks_is_split_into_its_blocks_and_layers_stay_with_the_root():
    """RegNet's stages (AnyStage, an nn.Sequential) give their blocks; TinyNet's layers (torch.nn's own) and a subclass
    of one give none; a block of one's own in a list is a unit, with the blocks inside it left to it."""
    assert describe_units(default_units(torchvision.models.regnet_y_400mf(num_classes=10))) == "ResBottleneckBlock x 16"
    assert default_units(TinyNet(3)) == []

    class Norm(nn.LayerNorm):
        pass

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.ModuleList([BlockNet(3)[0]])

    model = nn.Sequential(Outer(), Norm(4), nn.ModuleList([Outer(), Outer()]))
    assert default_units(model) == [model[0], model[2][0], model[2][1]]


def test_optimizer_slots_count_the_state_tensors_per_parameter():
    parameters = [nn.Parameter(torch.zeros(2))]
    assert optimizer_slots(torch.optim.SGD(parameters, lr=0.1)) == 0
    assert optimizer_slots(torch.optim.SGD(parameters, lr=0.1, momentum=0.9)) == 1
    assert optimizer_slots(torch.optim.AdamW(parameters)) == 2
    assert optimizer_slots(torch.optim.LBFGS(parameters)) is None


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--save-on", "node"], "--save-on node: every rank writes its shard"),
        (["--amp", "fp16"], "--amp fp16 needs loss scaling"),
        (["--channels-last", "on"], "--channels-last on: FSDP shards contiguous parameters only"),
        (["--find-unused-parameters"], "--find-unused-parameters is DDP's"),
    ],
)
def test_what_fsdp_cannot_do_is_refused_in_one_line(flags, says):
    with pytest.raises(UsageError, match=f"^{says}"):
        parse(*flags, mode="fsdp")
    parse(*flags[:1], *(flags[1:] if flags[0] != "--channels-last" else ["on"]), mode="ddp")  # DDP takes them


def test_a_criterion_with_parameters_is_refused_in_one_line(group_of_one):
    from examples.learned_temperature import LearnedTemperature

    with pytest.raises(
        UsageError,
        match=r"^train_fsdp.py: the criterion \(build_criterion\) has parameters, which FSDP "
        r"neither shards nor checkpoints with its optimizer: make them the model's",
    ):
        sharded_trainer(
            "-a",
            "tests.tiny_models:BlockNet",
            "--trainer",
            "examples.learned_temperature:LearnedTemperature",
            trainer=LearnedTemperature,
        )


class HoldsAnotherModule(Trainer):
    """An optimizer over the model and another module's parameters (a learned augmentation, say)."""

    def build_optimizer(self, model):
        self.extra = nn.Linear(1, 1)
        return torch.optim.SGD([*model.parameters(), *self.extra.parameters()], lr=0.1)


def test_an_optimizer_holding_what_is_not_the_model_s_is_refused_in_one_line(group_of_one):
    """FSDP's checkpoint of the optimizer's state is the model's: another tensor failed at the first save, a KeyError
    after an epoch's training (was)."""
    with pytest.raises(UsageError, match=r"^train_fsdp.py: the optimizer \(build_optimizer\) holds tensors that are "):
        sharded_trainer("-a", "tests.tiny_models:BlockNet", trainer=HoldsAnotherModule)


def test_cpu_offload_is_refused_on_the_cpu():
    with pytest.raises(UsageError, match="^--cpu-offload keeps parameters and optimizer state in host memory"):
        Sharding(parse("--cpu-offload", mode="fsdp"), cpu_runtime(mode="fsdp"))


def test_the_header_says_what_a_rank_holds_and_the_summary_measures_it(group_of_one):
    trainer = sharded_trainer("-a", "tests.tiny_models:BlockNet", "--opt", "adamw", "--lr", "0.001")
    unit_line, memory_line = trainer.shard.describe(trainer.model, trainer.optimizer)
    assert unit_line.startswith("fsdp: units Block x 3, then the root; --reshard-after-forward on")
    whole = sum(parameter.numel() * 4 for parameter in BlockNet(3).parameters())
    assert f"parameters {whole / 2**20:.1f} MiB" in memory_line and "optimizer state 2 x parameters" in memory_line
    batch = torch.randn(2, 3, 16, 16)
    trainer.model(batch).sum().backward()
    trainer.optimizer.step()
    assert state_bytes(trainer.model, trainer.optimizer) == (whole, whole, 2 * whole)  # a group of one: all of it


@pytest.mark.parametrize("arch, parameters", [("tests.tiny_models:BlockNet", 8), ("resnet18", 62)])
def test_activation_checkpointing_gives_the_same_gradients_and_batchnorm_statistics(group_of_one, arch, parameters):
    """The recomputed forward in backward leaves the BatchNorm statistics as the forward left them (was: updated
    twice a step: num_batches_tracked 2, other running means, and so other validations and saved weights)."""
    grads, buffers = [], []
    for flags in ([], ["--activation-checkpointing"]):
        trainer = sharded_trainer("-a", arch, *flags)
        torch.manual_seed(0)
        trainer.model(torch.randn(2, 3, 16, 16)).square().sum().backward()
        grads.append([parameter.grad.full_tensor() for parameter in trainer.model.parameters()])
        buffers.append([buffer.clone() for buffer in trainer.model.buffers()])
    assert len(grads[0]) == parameters and all(torch.equal(a, b) for a, b in zip(*grads))
    assert all(torch.equal(a, b) for a, b in zip(*buffers)) and len(buffers[0]) == len(buffers[1])
    assert "--activation-checkpointing on" in trainer.shard.describe(trainer.model, trainer.optimizer)[0]


def test_compiled_activation_checkpointing_updates_batchnorm_statistics_once(group_of_one):
    """Compiled, the recomputation is the graph's, which updates no buffer (torch refuses a context_fn there: was a
    BackendCompilerFailed at the first step)."""
    buffers = []
    for flags in ([], ["--activation-checkpointing", "--compile"]):
        trainer = sharded_trainer("-a", "tests.tiny_models:NormBlockNet", *flags)
        model = models.compiled(trainer.model, static=True) if flags else trainer.model
        torch.manual_seed(0)
        model(torch.randn(2, 3, 16, 16)).square().sum().backward()
        buffers.append([buffer.clone() for buffer in trainer.model.buffers()])
    assert len(buffers[0]) == 6 and all(torch.allclose(a, b) for a, b in zip(*buffers))


def test_a_unit_that_is_not_a_submodule_or_is_inside_another_is_refused_in_one_line(group_of_one):
    """--activation-checkpointing puts each unit's wrapper where the unit is: a stray module, or a unit inside
    another, is named."""
    sharding = Sharding(parse("--activation-checkpointing", mode="fsdp"), cpu_runtime(mode="fsdp"))
    with pytest.raises(UsageError, match="^shard_units returned a Linear that is not a submodule of the model$"):
        sharding(BlockNet(3), [nn.Linear(2, 2)])
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    with pytest.raises(UsageError, match=r"^shard_units returned 0\.0 inside 0: units must not nest \(docs/adapting"):
        sharding(model, [model[0], model[0][0]])  # (wrapped, the inner one was left out; sharded, a TypeError)
    with pytest.raises(UsageError, match=r"^shard_units returned 0 twice: each unit once"):  # (was a traceback)
        sharding(model, [model[0], model[0]])
    with pytest.raises(UsageError, match=r"^--activation-checkpointing recomputes each shard unit's activations, and "):
        sharding(TinyNet(3), [])  # (vgg's, alexnet's: no units, and the flag on in the header, exit 0)


def test_a_batchnorm_unit_under_bf16_is_sharded_once_in_float32(group_of_one):
    """A shard_units that names BatchNorm layers, which bf16 shards as units of their own in float32: was sharded
    twice, a traceback."""
    sharding = Sharding(parse("--amp", "bf16", mode="fsdp"), cpu_runtime(mode="fsdp"))
    model = torchvision.models.resnet18(num_classes=3)
    norms = [module for module in model.modules() if isinstance(module, nn.BatchNorm2d)][:2]
    sharding(model, norms)
    computed_with = []
    norms[0].register_forward_hook(lambda module, inputs, output: computed_with.append(module.weight.dtype))
    model(torch.randn(2, 3, 16, 16))
    assert computed_with == [torch.float32]


def test_bf16_computes_in_bf16_with_batchnorm_in_float32(group_of_one):
    """--amp bf16 as FSDP's policy: bf16 compute, the sharded parameters float32; BatchNorm's its own unit in
    float32, which its kernels need (bf16 weights with float32 running statistics fail)."""
    trainer = sharded_trainer("-a", "resnet18", "--amp", "bf16")
    computed_with = {}
    for name in ("bn1", "layer1.0.conv1", "layer1.0.bn1", "fc"):
        trainer.model.get_submodule(name).register_forward_hook(
            lambda module, inputs, output, name=name: computed_with.update({name: module.weight.dtype})
        )
    output = trainer.model(torch.randn(2, 3, 16, 16))
    assert output.dtype == torch.bfloat16
    assert computed_with == {
        "bn1": torch.float32,
        "layer1.0.conv1": torch.bfloat16,
        "layer1.0.bn1": torch.float32,
        "fc": torch.bfloat16,
    }
    assert {parameter.dtype for parameter in trainer.model.parameters()} == {torch.float32}  # the shards


def test_cpu_offload_with_gradient_clipping_is_refused_in_one_line():
    with pytest.raises(UsageError, match="^--cpu-offload with --clip-grad-norm: the gradient norm over shards"):
        parse("--cpu-offload", "--clip-grad-norm", "1", mode="fsdp")

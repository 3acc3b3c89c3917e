"""common/models.py: torchvision's models by name (or your own), the sizes each takes (refused in one line before any
process trains), auxiliary heads' losses, autocast in DataParallel's replica threads, the memory format measured
faster, a patch embedding computed as a matrix product, the bare model inside its wrappers, and the EMA of the weights
(--model-ema) as torchvision's train.py keeps it."""

import copy
import threading

import pytest
import torch
import torch.nn as nn
import torchvision

from common.errors import UsageError
from common.models import (
    AutocastForward,
    ModelEma,
    PatchConv2d,
    adapt_first_conv,
    adjusted_decay,
    build_model,
    check_input_size,
    compiled,
    gradient_sync,
    loss_with_aux,
    patch_embedding_as_matmul,
    replace_heads,
    split_output,
    unwrap,
    use_channels_last,
    warn_slow_amp,
)
from common.optim import build_scheduler
from conftest import FAMILIES, parse


@pytest.mark.parametrize("arch", ["resnet18", "squeezenet1_1"])
def test_build_model_gives_one_output_per_class(arch):
    model = build_model(arch, num_classes=3).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_build_model_sets_dropout_where_the_arch_has_one():
    model = build_model("squeezenet1_1", num_classes=3, dropout=0.0)
    assert [module.p for module in model.modules() if isinstance(module, nn.Dropout)] == [0.0]


def test_dropout_on_an_arch_without_one_raises_usage_error():
    with pytest.raises(UsageError, match="resnet18 has no dropout"):
        build_model("resnet18", num_classes=3, dropout=0.5)
    with pytest.raises(
        UsageError, match="^--arch convnext_tiny has no dropout to set"
    ):  # (its builder took it, silently)
        build_model("convnext_tiny", num_classes=3, dropout=0.5)
    for arch in ("vit_b_16", "efficientnet_b0", "mobilenet_v3_small", "swin_t"):  # (each holds a layer of p 0.5)
        build_model(arch, num_classes=3, dropout=0.5)


def test_arch_may_name_your_own_model_as_module_and_callable():
    model = build_model("tests.tiny_models:TinyNet", num_classes=4, dropout=0.25)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 4)
    with pytest.raises(UsageError, match="cannot import Missing from tests.tiny_models"):
        build_model("tests.tiny_models:Missing", num_classes=4)
    with pytest.raises(UsageError, match="--pretrained needs a torchvision --arch"):
        build_model("tests.tiny_models:TinyNet", num_classes=4, pretrained=True)
    with pytest.raises(UsageError, match=r"^--arch tests.tiny_models:Block cannot be called as a model's builder"):
        build_model("tests.tiny_models:Block", num_classes=4)  # (a module that takes no num_classes)
    with pytest.raises(UsageError, match=r"^--arch collections:OrderedDict returned a OrderedDict, not a torch"):
        build_model("collections:OrderedDict", num_classes=4)


@pytest.mark.parametrize(
    "arch, size, line",
    [
        ("inception_v3", 32, "--arch inception_v3 cannot take 32x32 px images (Calculated padded input size"),
        (
            "vit_b_16",
            256,
            "--arch vit_b_16 cannot take 256x256 px images (Wrong image height! Expected 224 but got 256!)",
        ),
        ("alexnet", 32, "--arch alexnet cannot take 32x32 px images"),
    ],
)
def test_a_size_a_model_cannot_take_is_refused_in_one_line(arch, size, line):
    with pytest.raises(UsageError) as refused:
        check_input_size(build_model(arch, num_classes=3), arch, [size], size)
    assert str(refused.value).startswith(line)
    assert "(torchvision: at least" in str(refused.value) and "\n" not in str(refused.value)


def test_auxiliary_outputs_add_their_weighted_loss():
    criterion, labels = nn.CrossEntropyLoss(), torch.tensor([0, 1])
    main, aux1, aux2 = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    googlenet = torchvision.models.GoogLeNetOutputs(main, aux2, aux1)
    inception = torchvision.models.InceptionOutputs(main, aux1)
    loss, logits = loss_with_aux(criterion, googlenet, labels)
    assert logits is main
    assert loss == pytest.approx(criterion(main, labels) + 0.3 * (criterion(aux1, labels) + criterion(aux2, labels)))
    loss, _ = loss_with_aux(criterion, inception, labels)
    assert loss == pytest.approx(criterion(main, labels) + 0.4 * criterion(aux1, labels))
    loss, logits = loss_with_aux(criterion, {"logits": main, "aux": aux1}, labels, aux_weight=0.5)
    assert logits is main and loss == pytest.approx(criterion(main, labels) + 0.5 * criterion(aux1, labels))
    with pytest.raises(UsageError, match="a dict without 'logits' or 'out'"):
        loss_with_aux(criterion, {"main": main}, labels)


def test_autocast_forward_computes_in_the_amp_dtype_in_any_thread():
    """DataParallel runs each replica in a thread of its own, where the caller's autocast does not
    reach, and enters autocast there with the device's default dtype (parallel_apply). The wrapper
    must compute in the --amp dtype whatever the thread's own autocast says."""
    model = nn.Linear(8, 4)
    images = torch.randn(2, 8)
    results = {}

    def replica_thread():
        results["bare"] = model(images).dtype
        results["wrapped"] = AutocastForward(model, "cpu", "bf16")(images).dtype
        # What parallel_apply does in each replica's thread: autocast enabled, with no dtype (the
        # device's default: float16 on CUDA, bfloat16 on the CPU), then the replica's forward.
        with torch.autocast("cpu", enabled=True):
            results["wrapped fp16"] = AutocastForward(model, "cpu", "fp16")(images).dtype
        with torch.autocast("cpu", enabled=True):
            results["default"] = model(images).dtype

    with torch.autocast("cpu", dtype=torch.float16):  # the caller's autocast: not seen by the thread
        thread = threading.Thread(target=replica_thread)
        thread.start()
        thread.join(timeout=60)
    assert results == {
        "bare": torch.float32,
        "wrapped": torch.bfloat16,
        "default": torch.bfloat16,
        "wrapped fp16": torch.float16,
    }
    # Checkpoints hold the bare model: no wrapper prefix in its parameter names.
    assert unwrap(nn.DataParallel(AutocastForward(model, "cpu", "bf16"))) is model


def test_unwrap_removes_dataparallel_and_compile():
    model = nn.Linear(2, 2)
    assert unwrap(model) is model
    assert unwrap(nn.DataParallel(model)) is model
    assert unwrap(torch.compile(model)) is model
    assert unwrap(nn.DataParallel(torch.compile(model))) is model


def test_compile_turns_inductor_s_layout_optimisation_off_where_ddp_or_fsdp_split_the_model(monkeypatch, group_of_one):
    # On an H200 (torch 2.11) DDP's and FSDP's --compile failed in convolution_backward ("expected ... stride") with
    # it on, and trained with it off (make gpu-check's compile rows); train_dp.py's one graph keeps it. For that compile
    # only: torch.compile's options, nothing process-wide.
    from torch._inductor import config

    asked = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: asked.append(kwargs.get("options")) or model)
    model = nn.Conv2d(3, 8, 3)
    compiled(model)
    compiled(model, static=True)  # a sharded model (FSDP)
    compiled(nn.parallel.DistributedDataParallel(model))
    assert asked == [None, {"layout_optimization": False}, {"layout_optimization": False}]
    assert config.layout_optimization  # Inductor's default, untouched
    assert all(name in config.__dict__ or hasattr(config, name) for name in asked[1])  # a real option of Inductor's


def test_gradient_sync_is_off_for_the_micro_batches_before_an_optimizer_step_s_last(group_of_one):
    """DDP's no_sync() (through torch.compile's wrapper too) and FSDP2's gradient sync: off, a backward only sums into
    the unsharded gradients; the next backward with it on reduces the sum. One process: nothing to turn off."""
    from torch.distributed.fsdp import fully_shard

    ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
    for model in (ddp, torch.compile(ddp)):
        with gradient_sync(model, enabled=False):
            assert not ddp.require_backward_grad_sync
        with gradient_sync(model, enabled=True):
            assert ddp.require_backward_grad_sync
    with gradient_sync(nn.DataParallel(nn.Linear(2, 2)), enabled=False):
        pass
    torch.manual_seed(0)
    plain, inputs = nn.Linear(2, 2), torch.randn(4, 2)
    sharded = fully_shard(copy.deepcopy(plain))
    with gradient_sync(sharded, enabled=False):
        sharded(inputs).sum().backward()
    assert all(parameter.grad is None for parameter in sharded.parameters())  # not reduced yet
    sharded(inputs).sum().backward()
    plain(inputs).sum().backward()
    for mine, reference in zip(sharded.parameters(), plain.parameters()):
        assert torch.allclose(mine.grad.full_tensor(), 2 * reference.grad)  # both backwards, summed


def test_channels_last_auto_is_on_where_it_was_measured_faster(monkeypatch):
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    patches = nn.Sequential(nn.Conv2d(3, 8, 16, stride=16), nn.Flatten(), nn.Linear(8, 2))  # ViT-like: one conv
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert use_channels_last("auto", cpu, "none", cnn)
    # Float32 on a GPU: on where its convolutions use TF32 tensor cores (ResNet-50 1.35x on an H100), not before.
    for capability, expected in [((7, 0), False), ((8, 0), True), ((9, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, found=capability: found)
        assert use_channels_last("auto", cuda, "bf16", cnn)
        assert use_channels_last("auto", cuda, "none", cnn) == expected
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # TF32 turned off: no tensor cores in float32
        assert not use_channels_last("auto", cuda, "none", cnn)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert not use_channels_last("auto", cpu, "none", patches)
    assert use_channels_last("on", cuda, "none", patches) and not use_channels_last("off", cpu, "none", cnn)
    # Measured not faster with it on the CPU (docs/benchmarks.md): auto leaves them alone, "on" still applies.
    for arch in ("shufflenet_v2_x0_5", "convnext_tiny"):
        model = torchvision.models.get_model(arch)
        assert not use_channels_last("auto", cpu, "none", model) and use_channels_last("on", cpu, "none", model)
    assert use_channels_last("auto", cpu, "none", torchvision.models.get_model("mobilenet_v3_small"))


def test_amp_on_a_cpu_without_native_instructions_is_warned_of_once():
    warned = []
    warn_slow_amp("bf16", torch.device("cpu"), warned.append)
    assert bool(warned) != torch.ops.mkldnn._is_mkldnn_bf16_supported(), warned
    assert all(line.startswith("warning: --amp bf16 on this CPU") for line in warned) and len(warned) <= 1
    warn_slow_amp("none", torch.device("cpu"), warned.append)
    assert len(warned) <= 1


def meta_model(arch):
    """torchvision's `arch` for 1000 classes on the meta device (no memory, no arithmetic)."""
    options = {"init_weights": True} if arch in ("googlenet", "inception_v3") else {}
    try:
        with torch.device("meta"):
            return torchvision.models.get_model(arch, **options)
    except NotImplementedError:  # RegNet computes its widths with tensors
        return torchvision.models.get_model(arch, **options).to("meta")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_head_of_a_pretrained_model_is_replaced_and_its_first_convolution_takes_the_datas_channels(family):
    """For the smallest model of each torchvision family, built for ImageNet's 1000 classes: replace_heads swaps
    the head and every auxiliary head (Inception v3's AuxLogits, GoogLeNet's aux1 and aux2) for 10 classes, and
    adapt_first_conv makes it take 1-channel images: in training, every output it returns has 10 classes."""
    arch, size = FAMILIES[family]
    model = meta_model(arch)
    replaced = replace_heads(model, 1000, 10)
    assert len(replaced) == {"googlenet": 3, "inception": 2}.get(family, 1), replaced
    assert all(line.endswith(": 1000 -> 10 classes, new weights") for line in replaced)
    [changed] = adapt_first_conv(model, arch, 1, pretrained=True)
    assert changed.endswith(": 3 -> 1 channels, RGB filters summed")
    main, aux, _ = split_output(model.train()(torch.empty(2, 1, size, size, device="meta")))
    assert [tuple(logits.shape) for logits in [main, *aux]] == [(2, 10)] * len(replaced)


def test_an_adapted_first_convolution_sees_a_grey_image_as_the_rgb_one_saw_it_grey():
    """Pretrained: for 1 channel the RGB filters are summed, so a grey image gives what the RGB model gave for it as
    three equal channels; for 4 they are repeated and scaled by 3/4 (timm's adapt_input_conv); fresh weights keep
    their scale. The header's line for each; a model of yours built for the channels is left as it is."""
    torch.manual_seed(0)
    rgb, grey = torchvision.models.resnet18().eval(), torch.rand(2, 1, 32, 32)
    one = copy.deepcopy(rgb)
    assert adapt_first_conv(one, "resnet18", 1, pretrained=True) == ["conv1: 3 -> 1 channels, RGB filters summed"]
    with torch.no_grad():
        assert torch.allclose(one.eval()(grey), rgb(grey.repeat(1, 3, 1, 1)), atol=1e-5)
    four = copy.deepcopy(rgb)
    assert adapt_first_conv(four, "resnet18", 4, True) == [
        "conv1: 3 -> 4 channels, RGB filters repeated, scaled by 3/channels"
    ]
    assert torch.equal(four.conv1.weight, torch.cat([rgb.conv1.weight, rgb.conv1.weight[:, :1]], dim=1) * 0.75)
    fresh = copy.deepcopy(rgb)
    assert adapt_first_conv(fresh, "resnet18", 1, False) == ["conv1: 3 -> 1 channels, the fresh filters' first channel"]
    assert torch.equal(fresh.conv1.weight, rgb.conv1.weight[:, :1])
    assert adapt_first_conv(fresh, "resnet18", 1, False) == [] and adapt_first_conv(rgb, "resnet18", 3, True) == []
    with pytest.raises(
        UsageError,
        match=r"^--arch mlp takes RGB images and the data's are 1-channel, and its first "
        r"layer is no RGB convolution to adapt: convert the images in your dataset",
    ):
        adapt_first_conv(nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 3)), "mlp", 1, False)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("channels, kernel, size", [(3, 16, 32), (3, 4, 30), (5, (2, 3), 13)])
def test_a_patch_embedding_as_a_matrix_product_is_the_convolution(layout, channels, kernel, size):
    """PatchConv2d: nn.Conv2d's output and gradients (weights, bias, input), a size that leaves a remainder included,
    and its state dict."""
    torch.manual_seed(0)
    conv = nn.Conv2d(channels, 8, kernel, stride=kernel).to(memory_format=layout)
    patch = copy.deepcopy(conv)
    assert PatchConv2d.fits(patch)
    patch.__class__ = PatchConv2d
    x = torch.randn(3, channels, size, size + 1).to(memory_format=layout)
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    outputs = [module(inputs[i]) for i, module in enumerate((conv, patch))]
    torch.testing.assert_close(outputs[1], outputs[0])
    for output in outputs:
        (output * torch.arange(output.numel()).reshape(output.shape).sin()).sum().backward()
    for a, b in [
        (conv.weight.grad, patch.weight.grad),
        (conv.bias.grad, patch.bias.grad),
        (inputs[0].grad, inputs[1].grad),
    ]:
        torch.testing.assert_close(b, a)
    assert patch.state_dict().keys() == conv.state_dict().keys()
    torch.testing.assert_close(patch(x[0]), conv(x[0]))  # an unbatched image: nn.Conv2d's own path


def test_only_a_torchvision_model_s_first_convolution_becomes_a_patch_embedding_where_it_is_one():
    """ViT's conv_proj and ConvNeXt's stem (not its 2x2 downsampling layers, measured slower so), not ResNet's 7x7
    stride-2 conv1, nor a model build_model did not make (a subclass's own, yours); the state dict stays torchvision's;
    an image smaller than a patch is refused as nn.Conv2d refuses it."""
    vit = build_model("vit_b_16", 3)
    keys = vit.state_dict().keys()
    patch_embedding_as_matmul(vit)
    assert type(vit.conv_proj) is PatchConv2d and vit.state_dict().keys() == keys
    with pytest.raises(RuntimeError, match="Kernel size can't be greater than actual input size"):
        vit.conv_proj(torch.zeros(1, 3, 8, 200))
    convnext = build_model("convnext_tiny", 3)
    patch_embedding_as_matmul(convnext)
    assert [name for name, module in convnext.named_modules() if type(module) is PatchConv2d] == ["features.0.0"]
    resnet = build_model("resnet18", 3)
    patch_embedding_as_matmul(resnet)
    assert not any(type(module) is PatchConv2d for module in resnet.modules())
    for yours in (torchvision.models.vit_b_16(num_classes=3), build_model("tests.tiny_models:TinyNet", 3)):
        patch_embedding_as_matmul(yours)
        assert not any(type(module) is PatchConv2d for module in yours.modules())


def small_bn_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def train_a_step(model):
    """Move the parameters and the BatchNorm statistics, as a training step does."""
    model.train()
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= 0.1 * parameter.grad
            parameter.grad = None


def test_an_ema_with_decay_0_equals_the_model():
    model = small_bn_net()
    ema = ModelEma(model, decay=0.0)
    for step in range(3):
        train_a_step(model)
        ema.after_step(step, epoch=0)
    ema_state, model_state = ema.module.state_dict(), model.state_dict()
    assert ema_state.keys() == model_state.keys()
    assert all(torch.equal(ema_state[name], model_state[name]) for name in model_state)  # buffers too
    assert ema.n_averaged == 3


def test_the_ema_decay_is_adjusted_as_torchvisions_train_py_does():
    # torchvision's references/classification/train.py, with its tv-v2 numbers: 8 GPUs x 128, 32 steps, 600 epochs.
    world_size, batch_size, model_ema_steps, epochs, model_ema_decay = 8, 128, 32, 600, 0.99998
    adjust = world_size * batch_size * model_ema_steps / epochs
    alpha = 1.0 - model_ema_decay
    alpha = min(1.0, alpha * adjust)
    assert adjusted_decay(0.99998, 1024, 32, 600) == 1.0 - alpha
    assert adjusted_decay(0.99998, 1024, 32, 600) == pytest.approx(1 - 2e-5 * 1024 * 32 / 600, rel=1e-12, abs=1e-12)
    assert adjusted_decay(0.9, 1024, 32, 600) == 0.0  # alpha capped at 1: the EMA is the weights


def test_the_ema_updates_at_torchvision_s_steps_and_restarts_from_the_weights_during_warmup():
    """4 steps an epoch, --model-ema-steps 3: updates after the steps whose index in the epoch is a multiple of 3,
    as torchvision's train_one_epoch (`if model_ema and i % args.model_ema_steps == 0`): global steps 0, 3, 4, 7,
    8, 11. One warmup epoch: the updates of epoch 0 copy the weights and leave n_averaged at 0, so the first of
    epoch 1 copies them too; then decay 0.5 averages."""
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    ema = ModelEma(model, decay=0.5, every=3, warmup_epochs=1)
    updated, counts, values, torchvision_updates = [], [], [], []
    for epoch in range(3):
        for i in range(4):  # torchvision's loop variable
            global_step = epoch * 4 + i
            with torch.no_grad():
                model.weight += 1  # the weight after step g is g + 1
            if i % 3 == 0:
                torchvision_updates.append(global_step)
            if ema.after_step(i, epoch=epoch):
                updated.append(global_step)
                counts.append(ema.n_averaged)
                values.append(ema.module.weight.item())
    assert updated == torchvision_updates == [0, 3, 4, 7, 8, 11]
    assert counts == [0, 0, 1, 2, 3, 4]
    assert values[:3] == [1.0, 4.0, 5.0] and values[3] == 0.5 * 5.0 + 0.5 * 8.0


def test_a_fractional_warmup_restarts_the_ema_for_the_lr_s_warmup_steps_alone():
    """--warmup-epochs 1.5 of 4 steps an epoch: the lr warms up for 6 steps; the EMA restarted at each update of
    epoch 1, all 8 steps (epoch < 1.5), and averaged from step 8 on."""
    model = nn.Linear(1, 1, bias=False)
    ema, counts = ModelEma(model, decay=0.5, every=1, warmup_epochs=1.5), []
    for epoch in range(3):
        for i in range(4):
            ema.after_step(i, epoch, steps_per_epoch=4)
            counts.append(ema.n_averaged)
    assert counts == [0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6]
    config = parse("--dummy", "--epochs", "3", "--warmup-epochs", "1.5", "--lr-schedule", "constant")
    lr = build_scheduler(torch.optim.SGD(model.parameters(), lr=1.0), config, 4).lr_lambdas[0]
    assert lr(5) < 1.0 == lr(6)  # (the lr's warmup: 6 steps)


def test_an_ema_saved_and_loaded_mid_run_goes_on_as_one_that_was_not():
    def train(model, ema, steps):
        for step in steps:
            train_a_step(model)
            ema.after_step(step, epoch=0)

    model = small_bn_net()
    uninterrupted = ModelEma(model, decay=0.7, every=2)
    torch.manual_seed(1)
    train(model, uninterrupted, range(6))
    model = small_bn_net()
    first = ModelEma(model, decay=0.7, every=2)
    torch.manual_seed(1)
    train(model, first, range(3))
    saved = copy.deepcopy(first.state_dict())
    second = ModelEma(model, decay=0.7, every=2)  # made from the weights: loading must replace them
    second.module.load_state_dict(saved["state_dict"])  # as common/checkpoint.py restores it
    second.restart(saved["n_averaged"], copy=False)
    train(model, second, range(3, 6))
    assert second.n_averaged == uninterrupted.n_averaged == 3
    for name, value in uninterrupted.module.state_dict().items():
        assert torch.equal(second.module.state_dict()[name], value), name


def test_the_ema_state_loads_with_weights_only_into_a_plain_model(tmp_path):
    model = torchvision.models.resnet18(num_classes=3)
    ema = ModelEma(model, decay=0.5)
    train_a_step(model)
    ema.after_step(0, epoch=0)
    torch.save(ema.state_dict(), tmp_path / "ema.pth")
    saved = torch.load(tmp_path / "ema.pth", weights_only=True)
    plain = torchvision.models.resnet18(num_classes=3)
    plain.load_state_dict(saved["state_dict"])  # strict: the bare model's keys
    assert saved["n_averaged"] == 1
    assert torch.equal(plain.fc.weight, model.fc.weight)  # the first update copies the weights

"""common/header.py: the lines a run begins with name every part it uses and where each setting came from."""

import threading
from types import SimpleNamespace

import pytest
import torchvision

from common.diagnostics import bf16_gradient_risks
from common.header import describe_preset, start_lines, training_lines, warnings
from common.trainer import trainer_class
from conftest import built_trainer, cpu_runtime, parse, tensor_datasets

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables
TINY_NET = ["-a", "tests.tiny_models:TinyNet", "-j", "0"]


def test_data_that_is_not_imagenet_sized_hears_which_preset_applies_and_why():
    lines = start_lines(
        built_trainer(*TINY_NET, "--epochs", "1", "-b", "4", "--dataset", "tests.custom_datasets:pil_images")
    )
    assert (
        "preset: imagenet (the default for --data, --dataset, --dummy and a --trainer's build_datasets, made for "
        "ImageNet-sized images) sets "
        "lr 0.1, 224 px crops, val resize 256, val crop 224, step schedule; flags, the environment and --preset "
        "override it"
    ) in lines  # -b and --epochs given: not the preset's
    assert (
        "warning: the first training image is 20x20 px, the imagenet preset crops 224 px: for images this small "
        "give --train-crop-size, --val-resize-size and --val-crop-size near 20 (and --epochs, -b, --lr for your "
        "data)"
    ) in lines
    assert (
        "data: --dataset tests.custom_datasets:pil_images (3 classes, 12 train / 6 val images, 0 loader worker(s) per "
        "process), normalised with mean 0.485, 0.456, 0.406, std 0.229, 0.224, 0.225 (ImageNet's)"
    ) in lines


def test_dummy_with_the_recipe_says_its_images_skip_the_per_image_augmentation():
    """--dummy images are synthetic tensors: a throughput figure of --dummy --preset tv-v2 leaves out the cost of
    TrivialAugment and erasing, and the header says so."""
    trainer = built_trainer(
        *TINY_NET,
        "--dummy",
        "--dummy-size",
        "16",
        "--preset",
        "tv-v2",
        "-b",
        "8",
        "--train-crop-size",
        "16",
        "--val-resize-size",
        "16",
        "--val-crop-size",
        "16",
    )
    lines = start_lines(trainer)
    assert (
        "note: --dummy images are synthetic tensors: --auto-augment and --random-erase are not applied, and "
        "images/s leaves out their cost (measure it with --data)"
    ) in lines
    assert "recipe: tv-v2 (torchvision's ResNet-50 V2 recipe, published 80.86% acc@1, not measured here)" in lines
    # Its 5-epoch warmup in a run of 3 epochs: none, and said (was: dropped without a word)
    short = built_trainer(*TINY_NET, "--dummy", "--dummy-size", "16", "--preset", "tv-v2", "-b", "8", "--epochs", "3")
    assert short.config.warmup_epochs == 0 and (
        "recipe: tv-v2 (torchvision's ResNet-50 V2 recipe, published 80.86% acc@1, not measured here); its 5-epoch "
        "warmup does not fit --epochs 3"
    ) in start_lines(short)
    assert (
        "warning: --ra-sampler with 1 process(es) and --ra-reps 4: copies of an image share a process's batch (and "
        "its BatchNorm statistics), so a step sees fewer different images; torchvision uses it only with several "
        "processes"
    ) in warnings(trainer)
    assert any(line.startswith("model EMA: decay ") for line in training_lines(trainer))


def test_a_scheduler_of_one_s_own_and_the_compile_warnings_are_named():
    trainer = built_trainer(
        *TINY_NET,
        "--trainer",
        "examples.adamw_onecycle:AdamWOneCycle",
        "--compile",
        "--res-schedule",
        "16:32:0:2:16",
        "--epochs",
        "3",
        "-b",
        "4",
        "--val-resize-size",
        "16",
        "--val-crop-size",
        "16",
        datasets=tensor_datasets(),
        trainer=trainer_class("examples.adamw_onecycle:AdamWOneCycle"),
    )
    assert (
        "lr scheduler: OneCycleLR (build_scheduler), stepped every optimizer step, saved in the checkpoints; "
        "--lr-schedule, --warmup-epochs, --lr-min, --lr-step-unit, --lr-step-size and --lr-gamma apply only as it "
        "reads them"  # (was silent: --lr-step-unit epoch given and the schedule stepped every step)
        in training_lines(trainer)
    )
    assert (
        "warning: --compile with --res-schedule: each new training size compiles another graph (seconds to minutes "
        "each)"
    ) in warnings(trainer)
    assert "trainer: examples.adamw_onecycle:AdamWOneCycle" in start_lines(trainer)


def test_a_pretrained_evaluation_says_where_its_weights_and_preprocessing_came_from(tiny_data, tmp_path, monkeypatch):
    """-a resnet18 --pretrained -e, with a stand-in for the weights file in TORCH_HOME (torch.hub loads a file that is
    there without downloading it): the header names the weights and the validation sizes, and it evaluates."""
    import torch
    import torchvision

    weights = torchvision.models.ResNet18_Weights.DEFAULT
    cache = tmp_path / "torch-home" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(torchvision.models.resnet18().state_dict(), cache / weights.url.rsplit("/", 1)[1])
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    trainer = built_trainer(
        "--data", tiny_data, "-j", "0", "-a", "resnet18", "--pretrained", "-e", "-b", "12", "--model-ema"
    )
    lines = start_lines(trainer)
    # (was: the model's figures alone, without a word)
    assert "note: --model-ema: ResNet18_Weights.IMAGENET1K_V1 has no EMA weights these scripts read" in warnings(
        trainer
    )
    assert any(line.startswith("model: resnet18 from ResNet18_Weights.IMAGENET1K_V1, ") for line in lines), lines
    assert (
        "validation: resize 256, crop 224, bilinear, label smoothing 0 (resize, crop and interpolation from "
        "ResNet18_Weights.IMAGENET1K_V1.transforms(); their flags override)"
    ) in lines
    assert trainer.evaluate(trainer.model)["count"] == 12


def test_a_pretrained_model_on_1_channel_images_of_3_classes_says_what_was_changed_and_trains(tmp_path, monkeypatch):
    """-a resnet18 --pretrained (a stand-in weights file, as above) on 1-channel images of 3 classes: the header
    says that the 1000-class head was replaced and the first convolution adapted; a training step runs."""
    import torch
    import torchvision

    weights = torchvision.models.ResNet18_Weights.DEFAULT
    cache = tmp_path / "torch-home" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(torchvision.models.resnet18().state_dict(), cache / weights.url.rsplit("/", 1)[1])
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    trainer = built_trainer(
        "-a",
        "resnet18",
        "--pretrained",
        "-b",
        "4",
        "--mean",
        "0.5",
        "--std",
        "0.25",
        "--train-crop-size",
        "32",
        "--val-resize-size",
        "32",
        "--val-crop-size",
        "32",
        datasets=tensor_datasets(size=32, train=4, val=2, channels=1),
    )
    [line] = [line for line in start_lines(trainer) if line.startswith("model: ")]
    assert line.endswith(
        "; changed for this data: fc: 1000 -> 3 classes, new weights; conv1: 3 -> 1 channels, RGB filters summed"
    ), line
    assert trainer.train_one_epoch(trainer.model, epoch=0)["count"] == 4


def test_decode_gpu_says_where_the_jpegs_are_decoded(tiny_data):
    lines = start_lines(built_trainer(*TINY_NET, "--epochs", "1", "-b", "4", "--data", tiny_data, "--decode", "gpu"))
    data = next(line for line in lines if line.startswith("data: "))
    assert data.endswith(
        "0 loader worker(s) per process, JPEGs decoded, cropped and flipped on the CPU, by the training process: "
        "--decode gpu), normalised with mean 0.485, 0.456, 0.406, std 0.229, 0.224, 0.225 (ImageNet's)"
    )


def test_the_header_names_what_the_dataset_preset_set():
    assert describe_preset(parse("-b", "32", "--epochs", "2")) == [
        "preset: demo (the built-in demo set) sets lr 0.04, 32 px crops, val resize 36, val crop 32, cosine schedule; "
        "flags, the environment and --preset override it"
    ]
    assert describe_preset(parse("-b", "32", "--epochs", "3", "--res-schedule", "32:64:0:2:16")) == [
        "preset: demo (the built-in demo set) sets lr 0.04, val resize 36, val crop 32, cosine schedule; "
        "flags, the environment and --preset override it"
    ]  # (its "32 px crops" were the schedule's 48 and 64 px in epochs 1 and 2)
    flags = "--dummy -b 8 --epochs 1 --lr 0.1 --lr-schedule step --train-crop-size 16 --val-resize-size 16"
    assert describe_preset(parse(*flags.split(), "--val-crop-size", "16")) == []


def test_bf16_on_the_cpu_warns_of_the_convolutions_whose_weight_gradient_torch_may_get_wrong():
    """torch's CPU bf16 kernels (oneDNN) gave NaN or garbage, at times, in the weight gradient of a convolution
    strided across an input 1 pixel wide (resnet18's layer4.0.conv1 at 16 px: NaN training under FSDP's bf16); the
    run names the layers. Not at 32 px (a 2x2 input: right), nor in float32."""
    crop16 = "-a resnet18 -j 0 --train-crop-size 16 --val-resize-size 16 --val-crop-size 16".split()
    assert warnings(built_trainer(*crop16, "--amp", "bf16", datasets=tensor_datasets()))[-1] == (
        "warning: --amp bf16 on the CPU: torch's bf16 kernels may compute a wrong weight gradient (NaN or garbage, at "
        "times) for a convolution strided across an input 1 pixel wide, and the run would train on it: "
        "layer4.0.conv1 (3x3 kernel, 1x1 input at 16 px); train with --amp none, or at crops where their inputs are "
        "wider"
    )  # (after a slow-amp warning, on a CPU without bf16 instructions)
    crop32 = [*crop16[:5], "32", "--val-resize-size", "32", "--val-crop-size", "32", "--amp", "bf16"]
    for trainer in (
        built_trainer(*crop16, datasets=tensor_datasets()),
        built_trainer(*crop32, datasets=tensor_datasets(32)),
    ):
        assert not any("may compute a wrong weight gradient" in line for line in warnings(trainer))
    # Depthwise convolutions (mobilenet's, strided across 1x1 inputs at 16 px) were right: not named; a model that
    # cannot be copied is not checked
    assert bf16_gradient_risks(torchvision.models.mobilenet_v3_small(), [16], 3) == []
    uncopyable = torchvision.models.resnet18()
    uncopyable.lock = threading.Lock()
    assert bf16_gradient_risks(uncopyable, [16], 3) == []
    # A forward the meta device cannot finish (a head that reads its values) at each crop: the layers before it found
    unfinished = torchvision.models.resnet18()
    unfinished.fc.register_forward_hook(lambda layer, args, output: output.tolist())
    assert bf16_gradient_risks(unfinished, [32, 16], 3) == [("layer4.0.conv1", "3x3", "1x1", 16)]


def test_compile_with_sync_bn_and_activation_checkpointing_warns_of_the_statistics():
    """(GPU flags: --sync-bn is refused on the CPU later, at the start.) A graph break inside a checkpointed unit
    (SyncBatchNorm's) recomputes it outside the graph, which updates its running statistics again."""
    config = parse("--compile", "--sync-bn", "--activation-checkpointing", mode="fsdp")
    trainer = SimpleNamespace(
        config=config, runtime=cpu_runtime(mode="fsdp"), _diagnostics=SimpleNamespace(bf16_risks=[])
    )
    assert warnings(trainer)[0].endswith(
        "; and with --activation-checkpointing, each unit recomputed outside the graph updates its BatchNorm "
        "statistics twice a step: leave out one of the three"
    )

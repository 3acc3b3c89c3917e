"""common/config.py: the configuration resolved once (command line over the platform's environment over --preset over
the dataset's preset), checked (one line a broken rule), then frozen; the pretrained weights' own validation
preprocessing; the default output directory; the dataset presets and --preset's layers in their precedence, and the
header line that says which preset set what."""

import os

import pytest
from torchvision.models import get_model_weights

from common.config import PRESETS, RECIPE_DEFAULTS, ResSchedule, default_output_dir, preset_layers
from common.demo_data import DEFAULT_ROOT
from common.errors import UsageError
from conftest import parse

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables


def test_environment_variables_set_the_defaults(no_platform_env, tmp_path):
    no_platform_env.setenv("EPOCHS", "7")
    no_platform_env.setenv("LR", "0.5")
    no_platform_env.setenv("BATCH_SIZE", "16")
    no_platform_env.setenv("DATASETS_PATH", str(tmp_path))
    no_platform_env.setenv("DATASETS", "tiny,other")
    no_platform_env.setenv("WORKSPACE", str(tmp_path / "ws"))
    no_platform_env.setenv("STOP_GRACE", "120")
    args = parse()
    assert (args.epochs, args.lr, args.batch_size, args.stop_grace) == (7, 0.5, 16, 120.0)
    assert parse("--stop-grace", "9").stop_grace == 9.0
    assert args.data == str(tmp_path / "tiny") and args.dataset == "imagenet"
    assert args.output_dir == str(tmp_path / "ws" / "dp-resnet18-tiny")
    assert parse(mode="ddp").output_dir == str(tmp_path / "ws" / "ddp-resnet18-tiny")


def test_datasets_path_alone_is_the_data_dir(no_platform_env, tmp_path):
    no_platform_env.setenv("DATASETS_PATH", str(tmp_path))
    assert parse().data == str(tmp_path)


def test_datasets_without_datasets_path_is_refused_unless_data_is_given(no_platform_env, tmp_path):
    no_platform_env.setenv("DATASETS", "tiny")
    with pytest.raises(UsageError, match=r"^DATASETS=tiny names folders under DATASETS_PATH, which is not set: "):
        parse()
    assert parse("--data", str(tmp_path)).data == str(tmp_path)


def test_a_val_crop_larger_than_its_resize_is_refused_but_not_for_dummy_images(no_platform_env):
    with pytest.raises(UsageError, match=r"^--val-crop-size 40 is larger than --val-resize-size 36: the centre crop "):
        parse("--val-crop-size", "40")
    assert parse("--val-crop-size", "36").val_crop_size == 36
    assert parse("--dummy", "--val-crop-size", "300").val_crop_size == 300


def test_command_line_flags_win_over_environment_variables(no_platform_env, tmp_path):
    for name, value in dict(
        EPOCHS="7",
        LR="0.5",
        BATCH_SIZE="16",
        DATASETS_PATH=str(tmp_path),
        DATASETS="tiny",
        WORKSPACE=str(tmp_path / "ws"),
    ).items():
        no_platform_env.setenv(name, value)
    args = parse(
        "--epochs",
        "3",
        "--lr",
        "0.2",
        "-b",
        "4",
        "--data",
        str(tmp_path / "mine"),
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert (args.epochs, args.lr, args.batch_size) == (3, 0.2, 4)
    assert args.data == str(tmp_path / "mine")
    assert args.output_dir == str(tmp_path / "out")


def test_without_environment_the_output_dir_is_under_runs():
    assert parse("--data", "/datasets/imagenet", mode="ddp").output_dir == "runs/ddp-resnet18-imagenet"
    assert parse("--dataset", "examples.csv_dataset:build", "-a", "tests.tiny_models:TinyNet").output_dir == (
        "runs/dp-tests.tiny_models.TinyNet-examples.csv_dataset.build"
    )  # no colon: TensorBoard's --logdir reads NAME:PATH
    assert default_output_dir(vars(parse("--dummy")), "spawn") == "runs/spawn-resnet18-dummy"
    # Two folders of one --dataset function: two runs (was: one directory, the second resumed the first's run)
    assert parse("--dataset", "examples.csv_dataset:build", "--data", "/d/annotations").output_dir == (
        "runs/dp-resnet18-examples.csv_dataset.build-annotations"
    )


def test_an_output_dir_is_utf_8_text_which_tensorboard_can_write_to():
    """A --data folder whose name is not UTF-8: its run's name has the bytes as \\xNN. An --output-dir so: one line
    (both were TensorBoard's UnicodeEncodeError traceback, after the run had written args.json)."""
    data = os.fsdecode(b"/d/lat\xe9n")
    assert parse("--data", data).output_dir == "runs/dp-resnet18-lat\\xe9n"
    with pytest.raises(UsageError, match=r"^--output-dir /o/lat\\xe9n: TensorBoard cannot write to a name Python"):
        parse("--data", "/d/x", "--output-dir", os.fsdecode(b"/o/lat\xe9n"))


def test_a_path_with_a_name_longer_than_255_bytes_is_one_line_before_anything_is_read():
    """(was: the OSError's traceback where -e, which takes no lock, or --init-from first looked at it; a --data folder
    of a long name made the default run name too long too)"""
    long = "a" * 256
    for flags, flag in [
        (["--output-dir", f"/o/{long}"], "--output-dir"),
        (["-e", "--resume", f"/r/{long}.pth"], "--resume"),
        (["--init-from", f"/w/{long}"], "--init-from"),
    ]:
        with pytest.raises(UsageError, match=rf"^{flag} \S+\.\.\.: a name in it is longer than 255 bytes \(.+: give a"):
            parse(*flags)
    with pytest.raises(
        UsageError,
        match=r"^the default --output-dir, after --data's folder, runs/dp-resnet18-bbb.*"
        r": give --output-dir$",
    ):
        parse("--data", f"/d/{'b' * 250}")
    assert parse("--output-dir", f"/o/{'a' * 255}").output_dir == f"/o/{'a' * 255}"


def test_a_trainer_that_builds_its_datasets_gets_the_imagenet_preset_and_a_directory_of_its_own():
    """(was: the demo preset, said to be the built-in demo set's, and the demo run's directory, which a run of it
    then refused as another run's, or resumed)"""
    args = parse("--trainer", "examples.experiment:Experiment")
    assert (args.dataset, args.data_preset, args.data, args.epochs) == ("custom", "imagenet", None, 90)
    assert args.output_dir == "runs/dp-resnet18-examples.experiment.Experiment"
    # With --data (which its build_datasets may read), or DATASETS_PATH's (was: the data folder's name alone, as a
    # run of the default data there)
    with_data = parse("--trainer", "examples.experiment:Experiment", "--data", "/d/digits")
    assert (with_data.dataset, with_data.output_dir) == (
        "custom",
        "runs/dp-resnet18-examples.experiment.Experiment-digits",
    )
    assert parse("--trainer", "examples.distillation:Distillation").dataset == "demo"  # (the default build_datasets)
    # Told by identity: a subclass named Trainer (was taken for the base by its method's name), a mixin after the base
    from common import trainer
    from common.errors import replaces

    assert parse("--trainer", "tests.tiny_models:NamedTrainer").dataset == "custom"
    mixin = type("Mixin", (), {"build_datasets": lambda self: None})
    assert not replaces(type("Late", (trainer.Trainer, mixin), {}), "build_datasets")
    assert not replaces(type("Plain", (trainer.Trainer,), {}), "build_datasets") and not replaces(
        mixin, "build_datasets"
    )


def test_positional_data_dir_is_the_same_as_the_flag():
    assert parse("/some/imagenet").data == "/some/imagenet"
    with pytest.raises(UsageError, match="once"):
        parse("/a", "--data", "/b")


def test_an_invalid_environment_value_raises_usage_error(no_platform_env):
    no_platform_env.setenv("EPOCHS", "ten")
    with pytest.raises(UsageError, match="EPOCHS='ten'"):
        parse("--data", "/x")


@pytest.mark.parametrize(
    "argv", [["--epochs", "0"], ["--epochs", "-3"], ["-b", "0"], ["--batch-size", "-8"], ["--lr", "0"], ["--lr", "-1"]]
)
def test_non_positive_epochs_batch_or_lr_raise_usage_error(argv):
    flag = {"-b": "--batch-size"}.get(argv[0], argv[0])
    with pytest.raises(UsageError, match=f"{flag} must be positive"):
        parse("--data", "/x", *argv)


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--min-crop-scale", "0"], "--min-crop-scale must be in (0, 1], got 0.0"),
        (["--min-crop-scale", "1.5"], "--min-crop-scale must be in (0, 1], got 1.5"),
        (["--hflip-prob", "-0.1"], "--hflip-prob must be a probability in [0, 1], got -0.1"),
    ],
)
def test_the_crop_scale_and_flip_probability_are_checked(argv, line):
    with pytest.raises(UsageError) as refused:
        parse("--data", "/x", *argv)
    assert str(refused.value) == line
    assert parse("--data", "/x", "--min-crop-scale", "1", "--hflip-prob", "0").min_crop_scale == 1.0  # the bounds


@pytest.mark.parametrize(
    "argv, line",
    [  # (each was accepted as not given, or a traceback later)
        (["--output-dir", ""], "--output-dir is empty: give a value, or leave it out"),
        (["--resume", ""], "--resume is empty: give a value, or leave it out"),
        (["--weights", ""], "--weights is empty: give a value, or leave it out"),
        ([""], "DIR is empty: give a value, or leave it out"),
        (["--dist-backend", "foo"], "--dist-backend must be nccl or gloo (or another of torch's), got foo"),
        (["--dist-timeout", "1e300"], "--dist-timeout must be at most 1e9 seconds, got 1e+300"),
        (["--opt", "sgd-nesterov", "--momentum", "0"], "--opt sgd-nesterov needs a --momentum above 0, got 0"),
        (["--dummy"], "give --data or --dummy (random images), not both"),
        (  # (was: nothing recorded, without a word)
            ["-e", "--pretrained", "--profile", "0:1"],
            "--profile records training steps, and -e trains none: leave one of them out",
        ),
    ],
)
def test_an_empty_value_and_values_torch_would_refuse_later_are_one_line(argv, line):
    with pytest.raises(UsageError) as refused:
        parse(*argv) if argv == [""] else parse("--data", "/x", *argv)
    assert str(refused.value) == line
    assert parse("--data", "/x", "--no-model-ema", "--preset", "tv-v2").model_ema is False  # (a preset's, off)


def test_non_positive_environment_value_raises_usage_error(no_platform_env):
    no_platform_env.setenv("BATCH_SIZE", "0")
    with pytest.raises(UsageError, match=r"^--batch-size \(from BATCH_SIZE=0\) must be positive, got 0$"):
        parse("--data", "/x")


@pytest.mark.parametrize(
    "argv, env, line",
    [
        (["-j", "-1"], {}, "--workers must be auto or 0 or more, got -1"),
        (["--lr", "inf"], {}, "--lr must be finite, got inf"),
        ([], {"LR": "inf"}, "--lr (from LR=inf) must be finite, got inf"),
        ([], {"EPOCHS": "-2"}, "--epochs (from EPOCHS=-2) must be positive, got -2"),
        (
            [],
            {"BATCH_SIZE": str(2**63)},
            f"--batch-size (from BATCH_SIZE={2**63}) must be a whole number from 1 to 2**63 - 1, got {2**63}",
        ),
        (["--lr", "-1"], {"LR": "0.5"}, "--lr must be positive, got -1.0"),  # (the flag's value, not LR's)
        ([], {"STOP_GRACE": "0"}, "--stop-grace (from STOP_GRACE=0) must be positive, got 0.0"),
        (["--stop-grace", "nan"], {}, "--stop-grace must be positive, got nan"),
        (["--warmup-epochs", "nan"], {}, "--warmup-epochs must be in [0, --epochs), got nan"),
        (["--clip-grad-norm", "inf"], {}, "--clip-grad-norm must be finite, got inf"),
        (["--wd", "nan"], {}, "--weight-decay must be 0 or more, got nan"),
        (["--lr-gamma", "nan"], {}, "--lr-gamma must be positive, got nan"),
        (["--seed", str(2**63)], {}, f"--seed must be a whole number from 0 to 2**63 - 1, got {2**63}"),
        (
            ["--res-schedule", "1:2"],
            {},
            "--res-schedule: expected START:END:FIRST_EPOCH:LAST_EPOCH[:STEP], whole numbers, got '1:2'",
        ),
        (
            ["--res-schedule", "64:32:3:1"],
            {},
            "--res-schedule: sizes and STEP must be positive and FIRST_EPOCH <= LAST_EPOCH, got '64:32:3:1'",
        ),
    ],
)
def test_each_rule_is_checked_once_whether_the_value_came_from_a_flag_or_the_environment(
    no_platform_env, argv, env, line
):
    """argparse only converts types; every rule on a value is config.py's, so the environment's values meet it too."""
    for name, value in env.items():
        no_platform_env.setenv(name, value)
    with pytest.raises(UsageError) as refused:
        parse("--data", "/x", *argv)
    assert str(refused.value) == line


def test_unknown_arch_suggests_close_names():
    with pytest.raises(UsageError, match=r"unknown --arch 'resnet19': did you mean resnet18"):
        parse("--data", "/x", "--arch", "resnet19")


def test_demo_preset_applies_when_no_data_is_given():
    args = parse()
    assert args.data == str(DEFAULT_ROOT) and args.dataset == "demo"  # where it is generated on first use
    demo = PRESETS["demo"]
    assert (args.epochs, args.batch_size, args.lr, args.lr_schedule, args.train_crop_size, args.warmup_epochs) == (
        demo["epochs"],
        demo["batch_size"],
        demo["lr"],
        demo["lr_schedule"],
        demo["train_crop_size"],
        demo["warmup_epochs"],
    )
    imagenet = parse("--data", "/x")
    assert (imagenet.dataset, imagenet.epochs, imagenet.batch_size, imagenet.lr, imagenet.lr_schedule) == (
        "imagenet",
        90,
        256,
        0.1,
        "step",
    )
    assert parse("--dummy").dataset == "dummy"


def test_demo_preset_accepts_a_single_epoch():
    assert parse("--epochs", "1").epochs == 1


def test_warmup_given_by_the_user_must_be_shorter_than_the_run():
    with pytest.raises(UsageError, match="--warmup-epochs"):
        parse("--data", "/x", "--epochs", "2", "--warmup-epochs", "2")


def test_the_configuration_is_frozen_once_resolved():
    config = parse("--dummy", "--lr", "0.1")
    with pytest.raises(AttributeError, match="frozen: lr cannot change after it is resolved"):
        config.lr = 0.2
    with pytest.raises(AttributeError, match="frozen"):
        del config.lr
    changed = config.replace(lr=0.2)
    assert (changed.lr, config.lr) == (0.2, 0.1) and changed.replace(lr=0.1) == config


def test_the_tv_v2_preset_steps_the_lr_per_epoch_and_a_fractional_warmup_is_refused():
    assert parse("--dummy", "--preset", "tv-v2").lr_step_unit == "epoch"
    assert parse("--dummy").lr_step_unit == "step"
    assert parse("--dummy", "--preset", "tv-v2", "--lr-step-unit", "step").lr_step_unit == "step"
    with pytest.raises(UsageError, match=r"^--warmup-epochs 0\.5 with --lr-step-unit epoch: give whole epochs$"):
        parse("--dummy", "--lr-step-unit", "epoch", "--warmup-epochs", "0.5")


def test_res_schedule_gives_each_epochs_crop_size():
    schedule = ResSchedule.parse("160:224:2:6")  # FFCV-style: low resolution first, linear, multiples of 32
    assert [schedule.size(epoch) for epoch in range(9)] == [160, 160, 160, 192, 192, 192, 224, 224, 224]
    fine = ResSchedule.parse("16:32:0:2:8")
    assert [fine.size(epoch) for epoch in range(4)] == [16, 24, 32, 32] and fine.sizes() == [16, 32]


# What torchvision's metadata says today, for models whose preprocessing differs from resize 256, crop 224, bilinear.
PUBLISHED = {
    "resnet50": (232, 224, "bilinear"),
    "efficientnet_b0": (256, 224, "bicubic"),
    "swin_t": (232, 224, "bicubic"),
    "convnext_tiny": (236, 224, "bilinear"),
    "efficientnet_v2_s": (384, 384, "bilinear"),
}


@pytest.mark.parametrize("arch", PUBLISHED)
def test_pretrained_validation_takes_the_weights_own_resize_crop_and_interpolation(arch, tmp_path):
    preprocessing = get_model_weights(arch).DEFAULT.transforms()
    expected = (preprocessing.resize_size[0], preprocessing.crop_size[0], preprocessing.interpolation.value)
    assert expected == PUBLISHED[arch]
    args = parse("--data", tmp_path, "-a", arch, "--pretrained", "-e")
    assert (args.val_resize_size, args.val_crop_size, args.val_interpolation) == expected
    assert args.interpolation == "bilinear"  # training keeps --interpolation's default
    assert args.val_preprocessing == f"resize, crop and interpolation from {args.weights}.transforms()"
    assert args.weights == f"{type(get_model_weights(arch).DEFAULT).__name__}.{get_model_weights(arch).DEFAULT.name}"


def test_flags_override_the_weights_preprocessing_and_without_weights_nothing_changes(tmp_path):
    args = parse(
        "--data",
        tmp_path,
        "-a",
        "efficientnet_b0",
        "--pretrained",
        "-e",
        "--val-resize-size",
        "300",
        "--interpolation",
        "nearest",
    )
    assert (args.val_resize_size, args.val_crop_size, args.val_interpolation, args.interpolation) == (
        300,
        224,
        "nearest",
        "nearest",
    )
    assert args.val_preprocessing == "crop from EfficientNet_B0_Weights.IMAGENET1K_V1.transforms()"  # (the header's)
    args = parse(
        "--data", tmp_path, "-a", "efficientnet_b0", "--pretrained", "--val-resize-size", "32", "--val-crop-size", "32"
    )
    assert (args.val_resize_size, args.val_crop_size, args.val_interpolation) == (32, 32, "bicubic")
    assert args.val_preprocessing == "interpolation from EfficientNet_B0_Weights.IMAGENET1K_V1.transforms()"
    args = parse(
        "--data",
        tmp_path,
        "-a",
        "efficientnet_b0",
        "--pretrained",
        "--val-resize-size",
        "32",
        "--val-crop-size",
        "32",
        "--interpolation",
        "bilinear",
    )
    assert args.val_preprocessing is None and args.val_interpolation == "bilinear"
    args = parse("--data", tmp_path, "-a", "efficientnet_b0")
    assert (args.val_resize_size, args.val_crop_size, args.val_interpolation, args.weights) == (
        256,
        224,
        "bilinear",
        None,
    )
    args = parse("-a", "efficientnet_b0", "--pretrained")  # the demo set keeps its own sizes
    assert (args.val_resize_size, args.val_crop_size, args.val_interpolation, args.val_preprocessing) == (
        36,
        32,
        "bilinear",
        None,
    )


def test_weights_names_a_weight_set_as_torchvision_does(tmp_path):
    for name in ("IMAGENET1K_V1", "ResNet50_Weights.IMAGENET1K_V1"):
        args = parse("--data", tmp_path, "-a", "resnet50", "--weights", name, "-e")
        assert args.pretrained and args.weights == "ResNet50_Weights.IMAGENET1K_V1"
        assert (args.val_resize_size, args.val_crop_size) == (256, 224)  # V1's own, not V2's 232
    with pytest.raises(
        UsageError,
        match=r"^--weights IMAGENET1K_V9: resnet50 has ResNet50_Weights\.IMAGENET1K_V1, "
        r"ResNet50_Weights\.IMAGENET1K_V2 \(a file of weights: --init-from PATH\)$",
    ):
        parse("--data", tmp_path, "-a", "resnet50", "--weights", "IMAGENET1K_V9")
    with pytest.raises(UsageError, match=r"^--weights w\.pth needs a torchvision --arch, not \S+ \(a file of its"):
        parse("--data", tmp_path, "-a", "tests.tiny_models:TinyNet", "--weights", "w.pth")  # (said --pretrained)


def test_the_layers_come_lowest_precedence_first_and_the_demo_set_keeps_its_own_scale():
    names = [name for name, _ in preset_layers("imagenet", "imagenet", "tv-v2", {"lr": 0.3, "epochs": None}, 0.2)]
    assert names == ["", "the imagenet preset's lr", "", "--preset tv-v2's lr", "LR", "--lr"]
    assert preset_layers("imagenet", "imagenet", None, {}, None)[0][1] is RECIPE_DEFAULTS
    assert preset_layers("demo", "demo", "tv-v2", {}, None)[3][1] == {}  # on the demo set, no ImageNet scale
    assert preset_layers("imagenet", "imagenet", "tv-v2", {"lr": 0.3, "epochs": None}, None)[4][1] == {"lr": 0.3}


def test_the_crops_of_a_res_schedule_are_those_its_epochs_go_through_without_going_through_them():
    import random

    draw = random.Random(0)
    for _ in range(3000):
        start, end, first = draw.randint(1, 300), draw.randint(1, 300), draw.randint(0, 30)
        schedule, epochs = (
            ResSchedule(start, end, first, first + draw.randint(0, 60), draw.choice([8, 32])),
            draw.randint(1, 120),
        )
        assert schedule.crops(epochs) == sorted({schedule.size(epoch) for epoch in range(epochs)}), (schedule, epochs)
    assert ResSchedule(160, 224, 0, 9_999_999_999).crops(10**10) == [160, 192, 224]  # (at once)


def test_a_script_under_a_launcher_not_its_own_is_one_line(monkeypatch):
    """train_spawn.py under torchrun said a port was in use; train_dp.py under torchrun with 2 processes, that its
    output directory was another run's (its sibling's). Under torch.distributed.launch, which adds --local-rank=N,
    each process said argparse's "unrecognized arguments"."""
    import train_dp
    import train_spawn

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for script, line in (
        (train_spawn, "train_spawn.py starts its own processes: run it with python, not torchrun"),
        (train_dp, "train_dp.py is one process driving every GPU: run it with python, not torchrun"),
    ):
        for legacy in ([], ["--local-rank=1"], ["--local_rank=1"]):
            with pytest.raises(UsageError, match=f"^{line}"):
                script.parse_args(["--data", "/x", *legacy])
    assert parse("--data", "/x", mode="ddp").data == "/x"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert parse("--data", "/x", mode="dp").data == "/x"  # (torchrun with one process: the run DP would be)

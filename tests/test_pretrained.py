"""--pretrained and --weights as torchvision's references/classification/train.py uses weights: validation with
the weights' own transforms() (resize, crop, interpolation), unless a flag says otherwise. The weights' metadata
needs no download; the one run uses a stand-in weights file in a TORCH_HOME of its own."""
import re

import pytest
import torch
import torchvision
import torchvision.transforms.v2.functional as F
from torchvision.models import get_model_weights

from common.args import UsageError, build_parser, parse_args
from common.data import EvalPreset, normalise, pixel_stats
from conftest import TINY, assert_ok, clean_env, run_script

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables

# What torchvision's metadata says today, for models whose preprocessing differs from resize 256, crop 224, bilinear.
PUBLISHED = {"resnet50": (232, 224, "bilinear"), "efficientnet_b0": (256, 224, "bicubic"),
             "swin_t": (232, 224, "bicubic"), "convnext_tiny": (236, 224, "bilinear"),
             "efficientnet_v2_s": (384, 384, "bilinear")}


def parsed(*argv):
    return parse_args(build_parser("test"), [str(arg) for arg in argv])


@pytest.mark.parametrize("arch", PUBLISHED)
def test_pretrained_validation_takes_the_weights_own_resize_crop_and_interpolation(arch, tmp_path):
    preprocessing = get_model_weights(arch).DEFAULT.transforms()
    expected = (preprocessing.resize_size[0], preprocessing.crop_size[0], preprocessing.interpolation.value)
    assert expected == PUBLISHED[arch]
    args = parsed("--data", tmp_path, "-a", arch, "--pretrained", "-e")
    assert (args.val_resize_size, args.val_crop_size, args.val_interpolation) == expected
    assert args.interpolation == "bilinear"  # training keeps --interpolation's default
    assert args.val_preprocessing == f"{args.weights}.transforms()"
    assert args.weights == f"{type(get_model_weights(arch).DEFAULT).__name__}.{get_model_weights(arch).DEFAULT.name}"


def test_flags_override_the_weights_preprocessing_and_without_weights_nothing_changes(tmp_path):
    args = parsed("--data", tmp_path, "-a", "efficientnet_b0", "--pretrained", "-e", "--val-resize-size", "300",
                  "--interpolation", "nearest")
    assert (args.val_resize_size, args.val_crop_size, args.val_interpolation, args.interpolation) == (
        300, 224, "nearest", "nearest")
    args = parsed("--data", tmp_path, "-a", "efficientnet_b0")
    assert (args.val_resize_size, args.val_crop_size, args.val_interpolation, args.weights) == (256, 224, "bilinear", None)
    args = parsed("-a", "efficientnet_b0", "--pretrained")  # the demo set keeps its own sizes
    assert (args.val_resize_size, args.val_crop_size, args.val_interpolation, args.val_preprocessing) == (
        36, 32, "bilinear", None)


def test_weights_names_a_weight_set_as_torchvision_does(tmp_path):
    for name in ("IMAGENET1K_V1", "ResNet50_Weights.IMAGENET1K_V1"):
        args = parsed("--data", tmp_path, "-a", "resnet50", "--weights", name, "-e")
        assert args.pretrained and args.weights == "ResNet50_Weights.IMAGENET1K_V1"
        assert (args.val_resize_size, args.val_crop_size) == (256, 224)  # V1's own, not V2's 232
    with pytest.raises(UsageError, match=r"^--weights IMAGENET1K_V9: resnet50 has ResNet50_Weights\.IMAGENET1K_V1, "
                                         r"ResNet50_Weights\.IMAGENET1K_V2$"):
        parsed("--data", tmp_path, "-a", "resnet50", "--weights", "IMAGENET1K_V9")
    with pytest.raises(UsageError, match="--pretrained needs a torchvision --arch"):
        parsed("--data", tmp_path, "-a", "tests.tiny_models:TinyNet", "--weights", "IMAGENET1K_V1")


@pytest.mark.parametrize("arch", PUBLISHED)
def test_validation_images_equal_torchvision_s_transforms_of_the_weights(arch):
    """Our uint8 resize and crop, normalised as the loaders normalise the batch, against the weights' own
    transforms() on the same photo-like image: equal but for rounding (one uint8 level), as a wrong size or
    interpolation would not be."""
    preprocessing = get_model_weights(arch).DEFAULT.transforms()
    generator = torch.Generator().manual_seed(0)
    coarse = torch.randint(0, 256, (3, 48, 64), dtype=torch.uint8, generator=generator)
    image = F.resize(coarse, [300, 400], antialias=True)  # smooth, as photographs mostly are
    args = parsed("--dummy", "-a", arch, "--pretrained", "-e")
    ours = EvalPreset(args.val_resize_size, args.val_crop_size, args.val_interpolation)(image)
    ours = normalise(ours[None], *pixel_stats())[0]
    theirs = preprocessing(image)
    assert ours.shape == theirs.shape
    one_level = 1 / 255 / min(preprocessing.std)
    assert (ours - theirs).abs().max().item() <= one_level + 1e-5
    other = "bilinear" if args.val_interpolation != "bilinear" else "bicubic"
    differs = normalise(EvalPreset(args.val_resize_size, args.val_crop_size, other)(image)[None], *pixel_stats())[0]
    assert (differs - theirs).abs().max().item() > one_level + 1e-5  # the comparison sees an interpolation


def test_a_pretrained_evaluation_says_where_its_weights_and_preprocessing_came_from(tiny_data, tmp_path):
    """train_dp.py -a resnet18 --pretrained -e, with a stand-in for the weights file in TORCH_HOME (torch.hub
    loads a file that is there without downloading it): the header names the weights and the validation sizes."""
    weights = torchvision.models.ResNet18_Weights.DEFAULT
    cache = tmp_path / "torch-home" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(torchvision.models.resnet18().state_dict(), cache / weights.url.rsplit("/", 1)[1])
    output = assert_ok(run_script("train_dp.py", "--data", tiny_data, *TINY[6:], "-a", "resnet18", "--pretrained",
                                  "-e", "-b", "12", env=clean_env(TORCH_HOME=tmp_path / "torch-home")))
    assert "model: resnet18 from ResNet18_Weights.IMAGENET1K_V1, " in output, output[-3000:]
    assert ("validation: resize 256, crop 224, bilinear (from ResNet18_Weights.IMAGENET1K_V1.transforms(); "
            "--val-resize-size, --val-crop-size, --interpolation override)") in output.splitlines()
    assert re.search(r"^ \* Acc@1 \S+  Acc@5 \S+  Loss \S+  \(12 images\)$", output, re.MULTILINE), output[-3000:]

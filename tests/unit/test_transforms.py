"""common/transforms.py: the uint8 presets (against torchvision's RandomResizedCrop as it was pinned, and the
pretrained weights' own transforms()), seeded per image by (seed, epoch, index), and the normalisation."""

import math
import random

import pytest
import torch
from torchvision.models import get_model_weights
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from common.augment import image_augmentation
from common.errors import UsageError
from common.trainer import Trainer
from common.transforms import EvalPreset, Normalise, SeededTransform, TrainPreset, takes_rng
from conftest import built_trainer, parse, tensor_datasets

# Every pixel different, so that any two different crops or flips give different images.
PATTERN = (torch.arange(3 * 40 * 40) * 7919 % 251).to(torch.uint8).view(3, 40, 40)


def images(count=4):
    return [(PATTERN.roll(i, dims=2), i, []) for i in range(count)]


def seeded_dataset(seed=0):
    return SeededTransform(images(), TrainPreset(16, min_scale=0.1), seed)


def test_train_preset_crops_inside_the_image_and_returns_the_crop_size():
    import random

    preset = TrainPreset(24, min_scale=0.08)
    rng = random.Random(0)
    for height, width in [(375, 500), (500, 375), (40, 40), (30, 300)]:
        for _ in range(200):
            top, left, h, w = preset.crop_box(height, width, rng)
            assert 0 <= top and 0 <= left and top + h <= height and left + w <= width and h > 0 and w > 0
    out = preset(torch.zeros(3, 60, 80, dtype=torch.uint8), rng)
    assert out.shape == (3, 24, 24) and out.dtype == torch.uint8
    assert EvalPreset(36, 32)(torch.zeros(3, 40, 60, dtype=torch.uint8)).shape == (3, 32, 32)


def test_seeded_transform_is_a_function_of_seed_epoch_and_index():
    first, again = seeded_dataset(), seeded_dataset()
    torch.manual_seed(123)  # the global RNG state must not matter...
    image, label, _ = first[2]
    torch.manual_seed(456)
    assert torch.equal(image, again[2][0]) and label == 2
    first.set_epoch(1)
    assert not torch.equal(image, first[2][0])
    assert not torch.equal(image, seeded_dataset(seed=1)[2][0])


def test_seeded_transform_leaves_the_global_rng_alone():
    dataset = seeded_dataset()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    dataset[0]
    assert torch.equal(torch.rand(3), expected)


def todays_train_preset(image, rng, crop_size, min_scale):
    """TrainPreset before issue 12, pinned: the crop and flip of every existing run."""
    height, width = image.shape[-2:]
    area, log_ratio = height * width, (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target_area = area * rng.uniform(min_scale, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target_area * aspect)), round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            box = rng.randint(0, height - h), rng.randint(0, width - w), h, w
            break
    else:
        ratio = width / height
        if ratio < math.exp(log_ratio[0]):
            w, h = width, round(width / math.exp(log_ratio[0]))
        elif ratio > math.exp(log_ratio[1]):
            h, w = height, round(height * math.exp(log_ratio[1]))
        else:
            w, h = width, height
        box = (height - h) // 2, (width - w) // 2, h, w
    image = F.resized_crop(image, *box, [crop_size, crop_size], antialias=True)
    return F.horizontal_flip(image) if rng.random() < 0.5 else image


def test_without_augmentation_the_train_preset_is_todays_and_draws_as_much():
    preset = TrainPreset(16, min_scale=0.1, augmentation=image_augmentation("none", 9, 0.0))
    assert preset.augmentation is None
    for key in range(40):
        for image in (PATTERN, PATTERN[:, :2, :], PATTERN[:, :, :2]):  # the last two: always the centre crop
            ours, pinned = random.Random(key), random.Random(key)
            assert torch.equal(preset(image, ours), todays_train_preset(image, pinned, 16, 0.1)), key
            assert ours.random() == pinned.random()  # the same number of draws


class RecordingImages:
    """A base dataset that records the indices it is asked for."""

    def __init__(self, count):
        self.samples, self.asked = images(count), []

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        self.asked.append(index)
        return self.samples[index]


def test_repeats_are_augmented_differently_and_copy_0_as_without_the_sampler():
    base = RecordingImages(4)
    preset = TrainPreset(16, min_scale=0.1, augmentation=image_augmentation("ta_wide", 9, 0.5))
    dataset = SeededTransform(base, preset, 0)
    reference = SeededTransform(images(), preset, 0)  # as read through the plain sampler
    for index in range(4):
        copies = [dataset[index + copy * 4] for copy in range(4)]
        assert torch.equal(copies[0][0], reference[index][0])
        assert all(label == index for _, label, _ in copies)
        assert all(not torch.equal(copies[a][0], copies[b][0]) for a in range(4) for b in range(a + 1, 4))
    assert sorted(set(base.asked)) == [0, 1, 2, 3]  # the base (and bad-file skipping) sees real indices


# What torchvision's metadata says today, for models whose preprocessing differs from resize 256, crop 224, bilinear.
PUBLISHED = {
    "resnet50": (232, 224, "bilinear"),
    "efficientnet_b0": (256, 224, "bicubic"),
    "swin_t": (232, 224, "bicubic"),
    "convnext_tiny": (236, 224, "bilinear"),
    "efficientnet_v2_s": (384, 384, "bilinear"),
}


@pytest.mark.parametrize("arch", PUBLISHED)
def test_validation_images_equal_torchvision_s_transforms_of_the_weights(arch, no_platform_env):
    """Our uint8 resize and crop, normalised as the loaders normalise the batch, against the weights' own
    transforms() on the same photo-like image: equal but for rounding (one uint8 level), as a wrong size or
    interpolation would not be."""
    preprocessing = get_model_weights(arch).DEFAULT.transforms()
    generator = torch.Generator().manual_seed(0)
    coarse = torch.randint(0, 256, (3, 48, 64), dtype=torch.uint8, generator=generator)
    image = F.resize(coarse, [300, 400], antialias=True)  # smooth, as photographs mostly are
    args = parse("--dummy", "-a", arch, "--pretrained", "-e")
    ours = EvalPreset(args.val_resize_size, args.val_crop_size, args.val_interpolation)(image)
    ours = Normalise()(ours[None])[0]
    theirs = preprocessing(image)
    assert ours.shape == theirs.shape
    one_level = 1 / 255 / min(preprocessing.std)
    assert (ours - theirs).abs().max().item() <= one_level + 1e-5
    other = "bilinear" if args.val_interpolation != "bilinear" else "bicubic"
    differs = Normalise()(EvalPreset(args.val_resize_size, args.val_crop_size, other)(image)[None])[0]
    assert (differs - theirs).abs().max().item() > one_level + 1e-5  # the comparison sees an interpolation


def test_normalise_takes_uint8_on_the_0_255_scale_and_float_on_0_1_to_the_same_inputs():
    pixels = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    expected = (pixels.float() / 255 - mean) / std
    normalise = Normalise()
    assert torch.allclose(normalise(pixels), expected, atol=1e-5)
    assert torch.allclose(normalise(pixels.float() / 255), expected, atol=1e-5)
    assert normalise.to(torch.device("cpu"))(pixels).dtype == torch.float32


def test_the_flip_probability_and_the_smallest_crop_are_flags():
    """--hflip-prob and --min-crop-scale reach the preset: a crop of the whole image (scale and ratio 1) flipped
    never at 0 and always at 1."""
    image = torch.arange(3 * 8 * 8, dtype=torch.uint8).reshape(3, 8, 8)
    for prob, expected in ((0.0, image), (1.0, F.horizontal_flip(image))):
        preset = TrainPreset(8, min_scale=1.0, ratio=(1.0, 1.0), hflip_prob=prob)
        assert all(torch.equal(preset(image, random.Random(seed)), expected) for seed in range(8))
    config = parse("--hflip-prob", "0.25", "--min-crop-scale", "0.5")
    assert (config.hflip_prob, config.min_crop_scale) == (0.25, 0.5)
    assert parse().min_crop_scale == 0.7 and parse("--data", "x").min_crop_scale == 0.08  # the presets'


class Rotated(Trainer):
    """Adds a random rotation after the crop and flip."""

    def build_transforms(self, train, val):
        return train.then(v2.RandomRotation(30)), val


def test_build_transforms_extends_the_default_pipeline_seeded_per_image_as_the_rest():
    """An added torchvision transform draws from a seed of (seed, epoch, index): the same image is rotated the same
    way in another process (another build) and differently at another index or epoch; crop and flip stay those of
    the run without it, and the flags the default applies still apply."""
    flags = ("-b", "4", "--train-crop-size", "16", "--auto-augment", "ta_wide")
    plain, first, again = (
        built_trainer(*flags, trainer=trainer, datasets=tensor_datasets(size=16))
        for trainer in (Trainer, Rotated, Rotated)
    )
    train = [made._data.train_loader.dataset for made in (plain, first, again)]
    assert train[1].transform.augmentation is not None and len(train[1].transform.added) == 1
    assert all(torch.equal(train[1][index][0], train[2][index][0]) for index in range(4))
    assert not all(torch.equal(train[0][index][0], train[1][index][0]) for index in range(4))
    before = train[1][0][0]
    train[1].set_epoch(1)
    assert not torch.equal(before, train[1][0][0])


class ModuleOfRng(torch.nn.Module):
    def forward(self, image, rng):
        return image


class ModuleCallOfRng(torch.nn.Module):
    def __call__(self, image, rng):
        return image


class WrappedModuleOfRng(ModuleOfRng):  # (a __call__ of *args that passes them on: its forward says)
    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs)


class CallOfRng:
    def __call__(self, image, rng=None):
        return image


def test_a_replaced_training_transform_is_called_as_torchvision_s_seeded_and_refuses_the_flags_it_no_longer_applies():
    """(was: called as transform(image, rng): a torchvision transform failed in collate with a traceback)"""

    class Replaced(Trainer):
        def build_transforms(self, train, val):
            return v2.Compose([v2.RandomResizedCrop(12), v2.RandomRotation(30)]), (lambda image: image[:, :12, :12])

    runs = [built_trainer("-b", "4", trainer=Replaced, datasets=tensor_datasets(size=16)) for _ in range(2)]
    train, again = (run._data.train_loader.dataset for run in runs)  # no such flag: fine
    assert train[0][0].shape == (3, 12, 12) and runs[0]._data.val_loader.dataset[0][0].shape == (3, 12, 12)
    assert all(torch.equal(train[index][0], again[index][0]) for index in range(4))  # seeded per image
    assert not torch.equal(train[0][0], train[1][0])

    class TakesRng(Trainer):  # (the earlier convention, transform(image, rng): still taken)
        def build_transforms(self, train, val):
            return (lambda image, rng: F.resize(image, [16 - rng.randrange(4)] * 2)), val

    called = [ModuleOfRng(), CallOfRng(), ModuleCallOfRng(), WrappedModuleOfRng(), v2.RandomRotation(3)]
    called += [lambda *images: images]
    called += [lambda image, *, rng: image, lambda image, size=8, rng=None: image, lambda image, other: image]
    assert [takes_rng(made) for made in called] == [
        "keyword",
        "keyword",
        "keyword",
        "keyword",
        None,
        None,
        "keyword",
        "keyword",
        "positional",
    ]  # (a module's forward(image, rng), a __call__ of (image, rng=None), a keyword rng: were called without it)
    takes = built_trainer("-b", "4", trainer=TakesRng, datasets=tensor_datasets(size=16))._data.train_loader.dataset
    assert [takes[index][0].shape[-1] for index in range(6)] == [
        16 - random.Random(f"0-0-{i}").randrange(4) for i in range(6)
    ]
    with pytest.raises(UsageError) as refused:
        built_trainer(
            "-b", "4", "--preset", "tv-v2", "--hflip-prob", "0", trainer=Replaced, datasets=tensor_datasets(size=16)
        )
    assert str(refused.value) == (
        "build_transforms replaced the training transform, which does not apply --auto-augment ta_wide, "
        "--random-erase 0.1, --hflip-prob 0 (some from --preset tv-v2): "
        "extend the default one instead (train.then(...)), or leave those flags out"
    )

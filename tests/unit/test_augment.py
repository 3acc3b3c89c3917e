"""common/augment.py: the recipe's augmentations as torchvision builds them, drawn from seeds of their own: per image
(auto-augment, random erasing: by seed, epoch and index) and per batch (MixUp / CutMix: by seed, epoch, step and
rank), never pairing an image with its own copy under the repeated-augmentation sampler."""

import random
from types import SimpleNamespace

import pytest
import torch

from common.augment import IMAGENET_MEAN_UINT8, BatchMix, batch_mix_key, build_batch_mix, image_augmentation
from common.errors import UsageError
from common.samplers import RepeatedAugmentationSampler
from common.transforms import IMAGENET_MEAN, IMAGENET_STD, SeededTransform, TrainPreset

MEAN_PIXEL = torch.tensor(IMAGENET_MEAN_UINT8, dtype=torch.uint8).view(3, 1)

# Every pixel different, so that any two different crops or flips give different images.
PATTERN = (torch.arange(3 * 40 * 40) * 7919 % 251).to(torch.uint8).view(3, 40, 40)


def images(count=4):
    return [(PATTERN.roll(i, dims=2), i, []) for i in range(count)]


def augmented(auto_augment="ta_wide", random_erase=0.5, count=4, seed=0):
    preset = TrainPreset(16, min_scale=0.1, augmentation=image_augmentation(auto_augment, 9, random_erase))
    return SeededTransform(images(count), preset, seed)


def test_an_images_augmentation_depends_only_on_seed_epoch_and_index():
    first, other = augmented(), augmented()
    torch.manual_seed(1)
    forward = [first[index][0] for index in range(4)]
    torch.manual_seed(2)
    torch.rand(100)  # other draws before, and another order: nothing changes
    backward = [other[index][0] for index in reversed(range(4))][::-1]
    assert all(torch.equal(a, b) for a, b in zip(forward, backward))
    first.set_epoch(1)
    assert not torch.equal(forward[0], first[0][0])
    assert not torch.equal(forward[0], augmented(seed=1)[0][0])


def test_augmentation_leaves_the_global_rngs_alone():
    dataset = augmented(random_erase=1.0)
    torch.manual_seed(7)
    random.seed(7)
    expected = torch.rand(3), random.random()
    torch.manual_seed(7)
    random.seed(7)
    for index in range(4):
        dataset[index]
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_augmentation_keeps_the_crop_and_flip_of_a_run_without_it():
    # Its seed is drawn after crop and flip: an augmentation that does nothing changes nothing.
    plain = SeededTransform(images(), TrainPreset(16, min_scale=0.1), 0)
    identity = SeededTransform(images(), TrainPreset(16, min_scale=0.1, augmentation=lambda image: image), 0)
    assert all(torch.equal(plain[index][0], identity[index][0]) for index in range(4))


def test_trivial_augment_changes_images():
    plain = SeededTransform(images(8), TrainPreset(16, min_scale=0.1), 0)
    trivial = augmented("ta_wide", random_erase=0.0, count=8)
    changed = [not torch.equal(plain[index][0], trivial[index][0]) for index in range(8)]
    assert sum(changed) >= 6  # (one op in 14 is the identity, a few have magnitude 0)
    assert all(trivial[index][0].shape == (3, 16, 16) and trivial[index][0].dtype == torch.uint8 for index in range(8))


@pytest.mark.parametrize("auto_augment", ["ra", "aa"])
def test_randaugment_and_autoaugment_are_seeded_per_image(auto_augment):
    first, again = augmented(auto_augment, 0.0), augmented(auto_augment, 0.0)
    torch.manual_seed(3)
    outputs = [first[index][0] for index in range(4)]
    assert all(torch.equal(outputs[index], again[index][0]) for index in range(4))
    plain = SeededTransform(images(), TrainPreset(16, min_scale=0.1), 0)
    assert any(not torch.equal(outputs[index], plain[index][0]) for index in range(4))


@pytest.mark.parametrize(
    "name, interpolation",
    [("ta_wide", "bilinear"), ("ra", "nearest"), ("aa", "bilinear"), ("imagenet", "nearest"), ("augmix", "bilinear")],
)
def test_auto_augment_builds_what_torchvision_s_preset_builds_for_that_name(name, interpolation):
    """torchvision's presets.ClassificationPresetTrain: ra, ta_wide, augmix by name, any other name an
    AutoAugmentPolicy (imagenet; aa is our short name for it), with --interpolation and --augmix-severity."""
    from torchvision.transforms import v2

    mode = v2.InterpolationMode(interpolation)
    theirs = {
        "ra": v2.RandAugment(interpolation=mode, magnitude=9),
        "ta_wide": v2.TrivialAugmentWide(interpolation=mode),
        "augmix": v2.AugMix(interpolation=mode, severity=3),
    }.get(name, v2.AutoAugment(policy=v2.AutoAugmentPolicy("imagenet"), interpolation=mode))
    ours = image_augmentation(name, 9, 0.0, interpolation, 3)
    image = torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for seed in range(6):
        torch.manual_seed(seed)
        expected = theirs(image)
        torch.manual_seed(seed)
        assert torch.equal(ours(image), expected), seed
    # torchvision's ops refuse bicubic on tensors ("unsupported with Tensor input"): bicubic gives them bilinear.
    assert image_augmentation(name, 9, 0.0, "bicubic", 3)(image).shape == image.shape


def test_random_erase_one_erases_a_rectangle_of_the_mean_pixel():
    plain = SeededTransform(images(), TrainPreset(16, min_scale=0.1), 0)
    erased = augmented("none", random_erase=1.0)
    for index in range(4):
        before, after = plain[index][0], erased[index][0]
        changed = (before != after).any(dim=0)
        assert changed.any(), index
        rows, cols = changed.any(dim=1).nonzero().flatten(), changed.any(dim=0).nonzero().flatten()
        top, bottom, left, right = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
        box = after[:, top:bottom, left:right].reshape(3, -1)
        assert torch.equal(box, MEAN_PIXEL.expand_as(box)), index  # the whole rectangle is the mean pixel
        outside = torch.ones(16, 16, dtype=torch.bool)
        outside[top:bottom, left:right] = False
        assert torch.equal(before[:, outside], after[:, outside]), index  # and nothing else changed


def batch(count=6, num_classes=8):
    generator = torch.Generator().manual_seed(0)
    return torch.rand(count, 3, 8, 8, generator=generator), torch.arange(count) % num_classes


@pytest.mark.parametrize("mixup, cutmix", [(0.2, 0.0), (0.0, 1.0), (0.2, 1.0)])
def test_mixed_labels_sum_to_one_per_row(mixup, cutmix):
    mix = BatchMix(8, mixup, cutmix)
    for step in range(6):
        _, soft = mix(*batch(), batch_mix_key(0, 0, step, 0))
        assert soft.shape == (6, 8) and torch.allclose(soft.sum(dim=1), torch.ones(6))


def test_mixup_is_the_convex_combination_of_each_image_and_the_previous_one():
    images_batch, target = batch()
    mixed, soft = BatchMix(8, mixup_alpha=1.0)(images_batch, target, key=11)
    lam = soft[0, 0].item()  # image 0 is class 0, its partner (the last image) class 5
    assert 0 < lam < 1 and soft[0, 5].item() == pytest.approx(1 - lam)
    assert torch.allclose(mixed, lam * images_batch + (1 - lam) * images_batch.roll(1, dims=0), atol=1e-6)


def test_cutmix_pastes_a_box_of_the_previous_image_in_proportion_to_the_labels():
    images_batch, target = batch()
    mixed, soft = BatchMix(8, cutmix_alpha=1.0)(images_batch, target, key=3)
    kept = (mixed == images_batch).all(dim=1)  # the pixels still the image's own
    assert torch.equal(mixed.permute(1, 0, 2, 3)[:, ~kept], images_batch.roll(1, dims=0).permute(1, 0, 2, 3)[:, ~kept])
    assert (~kept).any()
    for index in range(6):
        assert soft[index, target[index]].item() == pytest.approx(kept[index].float().mean().item())


def test_batch_mix_depends_on_its_key_only_and_leaves_the_global_rng_alone():
    mix = BatchMix(8, 0.2, 1.0)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    outcomes = [mix(*batch(), batch_mix_key(0, epoch=1, step=step, rank=0)) for step in range(4)]
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(99)
    again = mix(*batch(), batch_mix_key(0, epoch=1, step=2, rank=0))
    assert torch.equal(again[0], outcomes[2][0]) and torch.equal(again[1], outcomes[2][1])
    assert not torch.equal(outcomes[0][0], outcomes[1][0])
    assert batch_mix_key(0, 1, 2, 0) != batch_mix_key(0, 1, 2, 1)


def test_batch_mix_needs_an_alpha():
    with pytest.raises(ValueError):
        BatchMix(8, 0.0, 0.0)
    assert build_batch_mix(SimpleNamespace(mixup_alpha=0.0, cutmix_alpha=0.0, ra_sampler=False), 8, 1) is None
    args = SimpleNamespace(mixup_alpha=0.2, cutmix_alpha=0.0, ra_sampler=False, batch_size=2, grad_accum_steps=1)
    assert isinstance(build_batch_mix(args, 8, 1), BatchMix)


def mixing_partners(mix, batch_size, key):
    """{position: the position it was mixed with} in a batch of `batch_size`, read off MixUp's soft labels when
    image i is class i (row i: lam at i, 1 - lam at its partner)."""
    _, soft = mix(torch.zeros(batch_size, 3, 4, 4), torch.arange(batch_size), key)
    partners = {}
    for position, row in enumerate(soft):
        others = [column for column in row.nonzero().flatten().tolist() if column != position]
        partners[position] = others[0] if others else position
    return partners


def copy_pairs(world_size, reps, copies, length=48, batch_size=16):
    """The share of the images of epoch 0 that MixUp (alpha 1) pairs with a copy of themselves, on every rank of
    `world_size` with RepeatedAugmentationSampler of `reps` repetitions (the images: their dataset indices)."""
    same = total = 0
    for rank in range(world_size):
        sampler = RepeatedAugmentationSampler(list(range(length)), world_size, rank, reps, seed=0)
        sampler.set_epoch(0)
        shard = [index % length for index in sampler]
        mix = BatchMix(batch_size, mixup_alpha=1.0, copies=copies)
        for start in range(0, len(shard), batch_size):
            images = shard[start : start + batch_size]
            partners = mixing_partners(mix, len(images), key=start)
            same += sum(images[position] == images[partner] for position, partner in partners.items())
            total += len(images)
    return same / total


@pytest.mark.parametrize("world_size, reps", [(1, 4), (2, 4), (1, 2), (2, 3), (3, 4), (4, 4), (1, 1)])
def test_mixing_never_pairs_an_image_with_its_own_copy_under_the_ra_sampler(world_size, reps):
    args = SimpleNamespace(
        mixup_alpha=1.0, cutmix_alpha=0.0, ra_sampler=True, ra_reps=reps, batch_size=16 * world_size, grad_accum_steps=1
    )
    copies = build_batch_mix(args, 16, world_size).copies
    assert copies == -(-reps // world_size)
    assert copy_pairs(world_size, reps, copies) == 0
    # A micro-batch of fewer than two runs of copies is refused (was: MixUp of 4 copies of one image, a no-op; of 5
    # images, 3 mixed with their own copy)
    if copies > 1:
        for batch, accum in (
            (copies * world_size, 1),
            (4 * copies * world_size, 4),
            ((2 * copies - 1) * world_size, 1),
        ):
            with pytest.raises(UsageError, match=r"^--mixup-alpha/--cutmix-alpha with --ra-sampler: a micro-batch "):
                build_batch_mix(
                    SimpleNamespace(**{**vars(args), "batch_size": batch, "grad_accum_steps": accum}), 16, world_size
                )
        if reps % world_size == 0:  # (runs of as many copies: two of them, each mixed with the other)
            assert copy_pairs(world_size, reps, copies, batch_size=2 * copies) == 0


def test_without_the_partner_order_mixing_pairs_copies_as_the_neighbours_they_are():
    """The fault the partner order mends: torchvision's pairing with the previous image, under train_dp.py
    with tv-v2's 4 repetitions, mixes 3 of 4 images with their own copy; 2 processes, half of them."""
    assert copy_pairs(1, 4, copies=1) == 0.75
    assert copy_pairs(2, 4, copies=1) == 0.5


def test_the_partner_order_keeps_each_image_in_its_place_with_its_own_label():
    images_batch, target = batch(count=8)
    mixed, soft = BatchMix(8, mixup_alpha=1.0, copies=2)(images_batch, target, key=11)
    partners = mixing_partners(BatchMix(8, mixup_alpha=1.0, copies=2), 8, key=11)
    lam = soft[0, 0].item()
    assert 0 < lam < 1 and all(soft[i, i].item() == pytest.approx(lam) for i in range(8))
    expected = torch.stack([lam * images_batch[i] + (1 - lam) * images_batch[partners[i]] for i in range(8)])
    assert torch.allclose(mixed, expected, atol=1e-6)
    assert sorted(partners.values()) == list(range(8)) and all(abs(i - p) >= 2 for i, p in partners.items())


def test_random_erase_fills_with_the_uint8_pixel_nearest_to_torchvision_s_zero_after_normalising():
    """torchvision erases after normalising, with value 0 (the mean); our images stay uint8 until the batch is
    normalised, so the fill is the uint8 pixel nearest the mean: within half a level of torchvision's value."""
    for fill, mean, std in zip(IMAGENET_MEAN_UINT8, IMAGENET_MEAN, IMAGENET_STD):
        assert fill == round(mean * 255)
        assert abs((fill / 255 - mean) / std) <= 0.5 / 255 / std  # torchvision's fill: exactly 0

"""The augmentations of today's ImageNet recipes (torchvision.transforms.v2), each draw inside `seeded(key)`, which
leaves torch's global RNG untouched. Per image the key is the image's own random.Random (seed, epoch, index), whatever
the world size or worker; per batch (MixUp, CutMix) it is (seed, epoch, step, rank): a resumed run draws as an
uninterrupted one did.
"""

import contextlib
import random

import torch
from torchvision.transforms import v2

from .errors import UsageError

IMAGENET_MEAN_UINT8 = (124, 116, 104)  # round(255 x ImageNet mean): erased pixels, as RandomErasing(value=0)
# after Normalize in torchvision's recipe


@contextlib.contextmanager
def seeded(key):
    """torch's CPU RNG seeded from `key` (an int, or a random.Random to draw one from) inside the block,
    and as it was before after it."""
    seed = key.getrandbits(63) if hasattr(key, "getrandbits") else int(key)
    with torch.random.fork_rng(devices=[]):
        # The CPU generator alone: torch.manual_seed also seeds every accelerator backend: 100x slower or more.
        torch.default_generator.manual_seed(seed)
        yield


def image_augmentation(
    auto_augment="none",
    ra_magnitude=9,
    random_erase=0.0,
    interpolation="bilinear",
    augmix_severity=3,
    fill=IMAGENET_MEAN_UINT8,
):
    """The per-image v2 transforms after crop and flip (torchvision's presets.ClassificationPresetTrain's, by its names)
    on a CHW tensor, or None for none. Random erasing fills with `fill`, the mean pixel on the images' scale. On tensors
    these ops resize with nearest or bilinear only: --interpolation bicubic gives them bilinear."""
    steps, interpolation = [], v2.InterpolationMode("nearest" if interpolation == "nearest" else "bilinear")
    if auto_augment == "ta_wide":
        steps.append(v2.TrivialAugmentWide(interpolation=interpolation))
    elif auto_augment == "ra":
        steps.append(v2.RandAugment(magnitude=ra_magnitude, interpolation=interpolation))
    elif auto_augment in ("aa", "imagenet"):
        steps.append(v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=interpolation))
    elif auto_augment == "augmix":
        steps.append(v2.AugMix(severity=augmix_severity, interpolation=interpolation))
    if random_erase > 0:
        steps.append(v2.RandomErasing(p=random_erase, value=list(fill)))
    return v2.Compose(steps) if steps else None


def partner_order(batch_size, copies):
    """The order in which MixUp/CutMix see a batch whose images come in runs of up to `copies` copies of one image:
    column by column (0, c, 2c, ..., 1, c + 1, ...), as those transforms pair each image with the one before it, so
    that no two neighbours are copies of one image (unless the batch holds no more than two runs)."""
    return [index for column in range(copies) for index in range(column, batch_size, copies)]


class BatchMix:
    """MixUp and/or CutMix (one of the two per batch when both are on, as torchvision's train.py does): (images,
    integer labels) -> (mixed images, soft labels), in the batch's order, drawn from `key`. `copies`: the longest run
    of copies of one image in a batch (partner_order), so that no image is mixed with its own copy."""

    def __init__(self, num_classes, mixup_alpha=0.0, cutmix_alpha=0.0, copies=1):
        choices = []
        if mixup_alpha > 0:
            choices.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
        if cutmix_alpha > 0:
            choices.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
        if not choices:
            raise ValueError("BatchMix needs --mixup-alpha or --cutmix-alpha")
        self.num_classes, self.copies, self._cache = num_classes, copies, {}
        self.transform = choices[0] if len(choices) == 1 else v2.RandomChoice(choices)

    def __call__(self, images, target, key):
        if self.copies > 1:
            order, inverse = self._orders(len(target), target.device)
            images, target = images[order], target[order]
        with seeded(key):
            images, labels = self.transform(images, target)
        if self.copies > 1:  # back to the batch's order: image i with its own label, mixed with its partner
            images, labels = images[inverse], labels[inverse]
        return images, labels

    def _orders(self, batch_size, device):
        """partner_order and its inverse as index tensors on `device`, made once per batch size: copying a
        list to a GPU waits for it, which a step must not."""
        if (batch_size, device) not in self._cache:
            order = torch.tensor(partner_order(batch_size, self.copies))
            inverse = torch.empty_like(order)
            inverse[order] = torch.arange(batch_size)
            self._cache[batch_size, device] = (order.to(device), inverse.to(device))
        return self._cache[batch_size, device]


def batch_mix_key(seed, epoch, step, rank):
    """The seed of the mixing of batch `step` of `epoch` on `rank` (the same in every process and Python)."""
    return random.Random(f"mix-{seed}-{epoch}-{step}-{rank}").getrandbits(63)


def transformed_batch(result):
    """The (images, labels) a batch transform (build_batch_transform's) returned; anything else refused in one line."""
    if isinstance(result, (tuple, list)) and len(result) == 2 and all(isinstance(t, torch.Tensor) for t in result):
        return result
    kind = type(result).__name__ + (f" of {len(result)}" if isinstance(result, (tuple, list)) else "")
    raise UsageError(f"build_batch_transform's transform returned a {kind}: return (images, labels), two tensors")


def build_batch_mix(config, num_classes, world_size):
    """A BatchMix for --mixup-alpha / --cutmix-alpha, or None when both are 0. With --ra-sampler, a process of
    `world_size` holds runs of up to ceil(--ra-reps / world_size) copies of an image (RepeatedAugmentationSampler)."""
    if config.mixup_alpha <= 0 and config.cutmix_alpha <= 0:
        return None
    copies = -(-config.ra_reps // world_size) if config.ra_sampler else 1
    micro = config.batch_size // world_size // config.grad_accum_steps
    if copies > 1 and micro < 2 * copies:  # (was: each image mixed with its own copy, or left as it was)
        raise UsageError(
            f"--mixup-alpha/--cutmix-alpha with --ra-sampler: a micro-batch of {micro} image(s) per process holds "
            f"runs of {copies} copies of one image (--ra-reps {config.ra_reps} over {world_size} process(es)), which "
            f"mixing would pair with each other: give at least {2 * copies} images per process and micro-batch (-b, "
            "--grad-accum-steps), or more processes"
        )
    return BatchMix(num_classes, config.mixup_alpha, config.cutmix_alpha, copies)

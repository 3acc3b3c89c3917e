"""Your own augmentation: `--trainer examples.own_augmentation:Rotation`.

    python train_dp.py --trainer examples.own_augmentation:Rotation --rotation 15

build_transforms gets the default training and validation transforms (crop and flip, then --auto-augment and
--random-erase; resize and centre crop) to extend or replace. train.then(...) adds torchvision transforms after
the crop and flip; each image's random draws come from a seed of (seed, epoch, index), as the crop's do, so a
resumed run and every launch mode see the same images. Replacing `train` outright refuses, in one line, the flags
only the default applies.
"""

from torchvision.transforms import v2

from common.cli import number_in
from common.trainer import Trainer


class Rotation(Trainer):
    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument(
            "--rotation",
            type=number_in(0, 180),
            default=15.0,
            metavar="DEGREES",
            help="a random rotation of up to +-DEGREES after the crop and flip (%(default)s)",
        )

    def build_transforms(self, train, val):
        return train.then(v2.RandomRotation(self.config.rotation)), val

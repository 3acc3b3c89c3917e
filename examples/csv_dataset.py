"""Your own dataset: `--dataset examples.csv_dataset:build --data DIR`, no other change.

    python train_dp.py --dataset examples.csv_dataset:build --data DIR -a resnet18

Here DIR/annotations.csv lists every image with its split and class, columns `file,split,species` (a
layout of your own; for plain `path,label` files per split, --data DIR with DIR/train.csv and DIR/val.csv
needs no code at all). build(config) returns (classes, train_set, val_set); each set is a map-style dataset
whose items are (image, label): a PIL image (or a CHW tensor, uint8 or float in 0-1) and a class index.
The trainer wraps both: seeded crops and flips, the resumable sampler, exact validation, and the skipping
of unreadable files, which name(index) names in warnings and bad_images.txt.
"""

import csv
from pathlib import Path

from PIL import Image
from torch.utils.data import Dataset

from common.errors import UsageError


class ImageList(Dataset):
    def __init__(self, items):
        self.items = items  # [(path, class index)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, index):
        path, label = self.items[index]
        return Image.open(path), label  # decoded (and converted to RGB) by the trainer's wrapper

    def name(self, index):
        return self.items[index][0]


def build(config):
    if config.data is None:  # (a UsageError is one `error:` line, exit code 2)
        raise UsageError("--dataset examples.csv_dataset:build reads DIR/annotations.csv: give --data DIR")
    root = Path(config.data)
    try:
        with open(root / "annotations.csv", newline="", encoding="utf-8-sig") as file:  # (Excel's: a byte order mark)
            reader = csv.DictReader(file)
            rows = [(reader.line_num, row) for row in reader]  # (the line each row ends on)
    except OSError as error:
        raise UsageError(
            f"cannot read {root / 'annotations.csv'} ({error.strerror}): give --data DIR of yours"
        ) from None
    except UnicodeDecodeError:  # (Excel's plain "CSV", in the system's code page)
        raise UsageError(f"{root / 'annotations.csv'} is not UTF-8: save it as CSV UTF-8") from None
    missing = [column for column in ("file", "split", "species") if column not in (reader.fieldnames or [])]
    if missing:
        raise UsageError(
            f"{root / 'annotations.csv'} has no column {', '.join(missing)}: its header is file,split,species"
        )
    short = next((line for line, row in rows if None in row.values()), None)
    if short:  # (a row of fewer fields: its missing ones are None)
        raise UsageError(f"{root / 'annotations.csv'} line {short}: expected file,split,species")
    rows = [row for _, row in rows]
    classes = sorted({row["species"] for row in rows})
    index = {name: k for k, name in enumerate(classes)}

    def split(name):
        return ImageList([(str(root / row["file"]), index[row["species"]]) for row in rows if row["split"] == name])

    return classes, split("train"), split("val")

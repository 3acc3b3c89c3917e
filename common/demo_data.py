"""The built-in demo set: a small JPEG ImageFolder of ten shapes (CLASSES) drawn with Pillow at a random position, size,
rotation and colour on a random, noisy background. Generated on first use, deterministically, and cached (DEFAULT_ROOT).
"""

import contextlib
import fcntl
import math
import os
import random
import shutil
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

DEFAULT_ROOT = Path(__file__).resolve().parents[1] / "data" / "demo-shapes-v2"
CLASSES = ["circle", "ring", "square", "diamond", "triangle", "star", "plus", "cross", "hstripes", "vstripes"]
IMAGE_SIZE = 40


def _polygon(cx, cy, radius, corners, angle, inner=None):
    """Vertices of a regular polygon (a star when `inner` is the inner radius ratio)."""
    points = []
    steps = corners * 2 if inner else corners
    for i in range(steps):
        r = radius * (inner if inner and i % 2 else 1.0)
        theta = angle + 2 * math.pi * i / steps
        points.append((cx + r * math.sin(theta), cy - r * math.cos(theta)))
    return points


def _bar(cx, cy, length, width, angle):
    """A rectangle of the given length and width centred at (cx, cy), rotated by `angle`."""
    dx, dy = math.cos(angle), math.sin(angle)
    hl, hw = length / 2, width / 2
    return [
        (cx + sx * hl * dx - sy * hw * dy, cy + sx * hl * dy + sy * hw * dx)
        for sx, sy in ((-1, -1), (1, -1), (1, 1), (-1, 1))
    ]


def _colours(rng):
    """A background and a foreground colour that differ clearly in brightness."""
    while True:
        background = tuple(rng.randrange(256) for _ in range(3))
        foreground = tuple(rng.randrange(256) for _ in range(3))
        if abs(sum(background) - sum(foreground)) > 180:
            return background, foreground


def draw_shape(label, rng, size=IMAGE_SIZE):
    background, colour = _colours(rng)
    image = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(image)
    radius = rng.uniform(0.22, 0.36) * size
    margin = radius + 2
    cx, cy = rng.uniform(margin, size - margin), rng.uniform(margin, size - margin)
    tilt = math.radians(rng.uniform(-15, 15))
    width = max(2.0, radius * 0.45)
    name = CLASSES[label]
    if name in ("circle", "ring"):
        draw.ellipse(
            [cx - radius, cy - radius, cx + radius, cy + radius],
            fill=colour if name == "circle" else None,
            outline=colour,
            width=0 if name == "circle" else max(2, int(radius * 0.3)),
        )
    elif name in ("square", "diamond"):
        angle = tilt + (math.pi / 4 if name == "square" else 0.0)
        draw.polygon(_polygon(cx, cy, radius * 1.15, 4, angle), fill=colour)
    elif name == "triangle":
        draw.polygon(_polygon(cx, cy + radius * 0.2, radius * 1.2, 3, tilt), fill=colour)
    elif name == "star":
        draw.polygon(_polygon(cx, cy, radius * 1.2, 5, tilt, inner=0.45), fill=colour)
    elif name in ("plus", "cross"):
        angle = tilt + (math.pi / 4 if name == "cross" else 0.0)
        for turn in (0.0, math.pi / 2):
            draw.polygon(_bar(cx, cy, radius * 2.2, width, angle + turn), fill=colour)
    else:  # three parallel stripes
        angle = tilt + (0.0 if name == "hstripes" else math.pi / 2)
        gap = radius * 0.75
        normal = (-math.sin(angle), math.cos(angle))
        for k in (-1, 0, 1):
            draw.polygon(
                _bar(cx + k * gap * normal[0], cy + k * gap * normal[1], radius * 2.2, width * 0.7, angle), fill=colour
            )
    # Grey noise around 128 (as PIL's effect_noise makes it, which draws from a generator no seed reaches).
    pixels = np.random.default_rng(rng.getrandbits(64)).normal(128, rng.uniform(10, 30), (size, size))
    noise = Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).convert("RGB")
    image = Image.blend(image, noise, 0.12)
    return image.filter(ImageFilter.GaussianBlur(rng.uniform(0.0, 0.6)))


def generate(root, train_per_class=300, val_per_class=50, num_classes=len(CLASSES), seed=0):
    """Write root/train/<class>/*.jpg and root/val/<class>/*.jpg."""
    root = Path(root)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for label in range(num_classes):
            folder = root / split / CLASSES[label]
            folder.mkdir(parents=True, exist_ok=True)
            # One generator per (split, class): the set does not depend on generation order.
            rng = random.Random(f"{seed}-{split}-{label}")
            for index in range(count):
                draw_shape(label, rng).save(folder / f"{index:05d}.jpg", quality=90)


def ensure_demo_dataset(root=DEFAULT_ROOT, **sizes):
    """The demo set's root, generated first if missing. Safe when many processes call it at once."""
    root = Path(root)
    if (root / "val").is_dir():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process generates; the others wait, then reuse it
        if not (root / "val").is_dir():
            tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            generate(tmp, **sizes)
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(root)
            os.replace(tmp, root)
    return root

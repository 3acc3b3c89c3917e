"""Speed benchmark: prints one table (markdown) from one run.

    python tools/benchmark.py                      # CPU: pipeline + training tables (~5 min on 2 cores)
    python tools/benchmark.py --quick              # fewer images, for a smoke test
    python tools/benchmark.py --gpu                # the GPU at steady state (make benchmark-gpu)
    python tools/benchmark.py --jpeg-dir DIR       # your own JPEGs (an ImageFolder with train/ and val/)
    python tools/benchmark.py --resize-compare     # only: original vs prepare_imagenet.py --resize copies
    python tools/benchmark.py --augment-compare    # only: crop/flip vs auto-augment + erasing, per worker
    python tools/benchmark.py --res-compare        # only: demo epoch at 24 vs 32 px (progressive resizing)
    python tools/benchmark.py --wait-compare       # only: an input-bound run, and the same after its levers

a. Input pipeline, images/s of ONE DataLoader worker on ImageNet-sized JPEGs (generated,
   500x375, when --jpeg-dir is not given): ours (torchvision.io decode, uint8 crop/flip, uint8
   batches), the articles' classic pipeline (PIL -> RandomResizedCrop -> ToTensor -> Normalize),
   and decoding alone (the bound).
b. Training images/s of train_dp.py, train_ddp.py (torchrun) and train_spawn.py on --dummy
   data and on the JPEG folder at two global batch sizes, and of the articles' classic loop
   (classic pipeline, a .item() per step) on the same model and data.
c. With a CUDA GPU: see --gpu (tools/benchmark_gpu.py, `make benchmark-gpu`): the GPU at steady state.
--resize-compare: images/s of ONE loader worker (our pipeline) on the JPEGs as they are and on copies
   made by prepare_imagenet.py's --resize 256 / 160, with their average size and the cost of making them.
--augment-compare: images/s of ONE loader worker of the training pipeline (decode, crop, flip, then
   --auto-augment / --random-erase, seeded per image) for each augmentation of today's recipes.
--res-compare: train_dp.py on the demo set, one epoch at each --train-crop-size (what --res-schedule saves).
--wait-compare: train_dp.py on the JPEGs and on prepare_imagenet.py --resize 160 copies, each with -j 0 and -j 1:
   log.csv's input wait, images/s and TFLOP/s (docs/benchmarks.md, "Why is my run slow?").
"""

import argparse
import csv
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from common.augment import image_augmentation  # noqa: E402
from common.cli import Parser  # noqa: E402
from common.config import flag  # noqa: E402
from common.data import SkipUnreadable  # noqa: E402
from common.datasets import ImageFiles, load_image  # noqa: E402
from common.device_loader import Collate  # noqa: E402
from common.errors import UsageError, printable  # noqa: E402
from common.transforms import IMAGENET_MEAN, IMAGENET_STD, SeededTransform, TrainPreset  # noqa: E402
from shared import check_child, run_tool, scratch, torchvision_model, until_stopped, whole  # noqa: E402


def crop_flags(crop):
    """The training scripts' flags of one size for training crops and validation's resize and crop."""
    return ["--train-crop-size", str(crop), "--val-resize-size", str(crop), "--val-crop-size", str(crop)]


def jpegs(folder):
    """The JPEG files under `folder`, sorted: *.jpg and *.jpeg in any case (ImageNet's are *.JPEG); not a folder or a
    link to nothing of such a name."""
    return sorted(
        path for path in Path(folder).rglob("*") if path.suffix.lower() in (".jpg", ".jpeg") and path.is_file()
    )


def decodable(paths):
    """`paths`, each decoded once, by PIL and by torchvision's decode_jpeg (the pipelines measured): a UsageError names
    the first that cannot be (a file cut short, a PNG named .JPEG), which a loader worker would end in a traceback."""
    from PIL import Image
    from torchvision.io import decode_jpeg, read_file

    for path in paths:
        try:
            with Image.open(path) as image:
                image.load()
            decode_jpeg(read_file(str(path)))
        except (OSError, SyntaxError, ValueError, RuntimeError) as error:
            reason = " ".join(str(error).split())[:200]
            raise UsageError(
                f"--jpeg-dir: cannot decode {printable(path)} ({reason}): remove it, or give another"
            ) from None
    return paths


def make_jpegs(root, per_class, classes=2, seed=0):
    """An ImageFolder of photo-like 500x375 JPEGs (smooth colour fields, edges and grain; about
    the size and decode cost of ImageNet's)."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    for split, count in (("train", per_class), ("val", max(per_class // 8, 1))):
        for label in range(classes):
            folder = Path(root) / split / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                field = rng.normal(128, 50, (6, 8, 3)).clip(0, 255).astype(np.uint8)
                image = Image.fromarray(field).resize((500, 375), Image.BICUBIC)
                draw = ImageDraw.Draw(image)
                for _ in range(12):
                    x, y = rng.integers(0, 500), rng.integers(0, 375)
                    draw.ellipse(
                        [x, y, x + rng.integers(10, 150), y + rng.integers(10, 150)],
                        fill=tuple(int(c) for c in rng.integers(0, 256, 3)),
                    )
                grain = rng.normal(0, 18, (375, 500, 3))
                pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(1.0)), dtype=float) + grain
                Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(folder / f"{index:05d}.jpg", quality=90)
    return Path(root)


def pipeline_rates(jpeg_dir, images, batch=64):
    """Images/s of one DataLoader worker for each pipeline."""
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset
    from torchvision import transforms
    from torchvision.io import decode_jpeg, read_file

    paths = [str(path) for path in decodable(jpegs(Path(jpeg_dir, "train"))[:images])]
    paths = (paths * math.ceil(images / len(paths)))[:images]
    ours = TrainPreset(224)
    classic = transforms.Compose(
        [
            transforms.RandomResizedCrop(224),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )

    class Images(Dataset):
        def __init__(self, load):
            self.load = load

        def __len__(self):
            return len(paths)

        def __getitem__(self, index):
            return self.load(index), 0

    cases = {
        "ours: torchvision.io decode, uint8 crop+flip, uint8 batch": (
            lambda i: ours(load_image(paths[i]), random.Random(i)),
            batch,
        ),
        "classic: PIL, RandomResizedCrop, ToTensor, Normalize": (
            lambda i: classic(Image.open(paths[i]).convert("RGB")),
            batch,
        ),
        # Only the size leaves the worker: this measures decoding, not moving full-size images.
        "decode alone (torchvision.io, the bound)": (lambda i: decode_jpeg(read_file(paths[i])).shape[0], batch),
    }
    rates = {}
    for name, (load, size) in cases.items():
        batches = iter(DataLoader(Images(load), batch_size=size, num_workers=1))
        next(batches)  # the worker is up and warm
        start, count = time.perf_counter(), 0
        for _ in batches:
            count += size
        rates[name] = count / (time.perf_counter() - start)
    return rates


def log_rows(out):
    """The rows of the log.csv in `out`, by column name (columns are added over time: never by position)."""
    with open(out / "log.csv", newline="") as file:
        return list(csv.DictReader(file))


def training_rate(mode, data_args, batch, epochs_args, workdir, model_args):
    """Training images/s of one real run of a script, from its log.csv."""
    out = Path(tempfile.mkdtemp(dir=workdir))
    common = [
        *data_args,
        *model_args,
        "-b",
        str(batch),
        *epochs_args,
        "--output-dir",
        str(out),
        "-p",
        "1000",
        "--seed",
        "0",
    ]
    # On CPU the processes share the cores: dp one process with all, ddp/spawn two with half each.
    threads = os.cpu_count() if mode == "dp" else max(1, os.cpu_count() // 2)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    nproc = str(max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 2)
    command = {
        "dp": [sys.executable, REPO / "train_dp.py"],
        "ddp": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            REPO / "train_ddp.py",
        ],
        "spawn": [
            sys.executable,
            REPO / "train_spawn.py",
            "--nproc-per-node",
            nproc,
            "--master-port",
            str(29500 + random.randrange(2000)),
        ],
    }[mode]
    result = subprocess.run(
        [str(part) for part in command + common], env=env, capture_output=True, text=True, timeout=1800
    )
    check_child({"dp": "train_dp.py", "ddp": "torchrun train_ddp.py", "spawn": "train_spawn.py"}[mode], result)
    # The mean over the epochs after the first: one short epoch is dominated by its start.
    rates = [float(row["images_per_second"]) for row in log_rows(out)]
    return sum(rates[1:]) / len(rates[1:]) if len(rates) > 1 else rates[0]


class AverageMeter:
    """pytorch/examples' AverageMeter: a running sum and average of a host number."""

    def __init__(self, name):
        self.name, self.sum, self.count = name, 0.0, 0

    def update(self, value, n=1):
        self.sum += value * n
        self.count += n


def accuracy(output, target, topk=(1,)):
    """pytorch/examples' accuracy(): top-k accuracy in percent, as tensors."""
    _, pred = output.topk(max(topk), dim=1)
    hits = pred.t().eq(target.view(1, -1))
    return [hits[:k].any(dim=0).float().sum() * (100.0 / target.size(0)) for k in topk]


def classic_loop_rate(jpeg_dir, batch, crop, workers, images, arch):
    """The articles' loop (pytorch/examples main.py train()): classic PIL pipeline, float batches,
    and host reads of loss and accuracy every step."""
    from torchvision import datasets, models, transforms

    torch.manual_seed(0)
    dataset = datasets.ImageFolder(
        Path(jpeg_dir) / "train",
        transforms.Compose(
            [
                transforms.RandomResizedCrop(crop),
                transforms.RandomHorizontalFlip(),
                transforms.ToTensor(),
                transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
            ]
        ),
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers)
    model = models.get_model(arch, num_classes=len(dataset.classes))
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    losses, top1 = AverageMeter("Loss"), AverageMeter("Acc@1")
    model.train()
    seen, start = 0, time.perf_counter()
    while seen < images:
        for images_batch, target in loader:
            output = model(images_batch)
            loss = criterion(output, target)
            (acc1,) = accuracy(output, target, topk=(1,))
            losses.update(loss.item(), images_batch.size(0))  # a host read every step
            top1.update(acc1.item(), images_batch.size(0))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += images_batch.size(0)
            if seen >= images:
                break
    return seen / (time.perf_counter() - start)


def resize_compare(jpeg_dir, images, batch=64):
    """One loader worker's images/s (load_image + TrainPreset) on the original JPEGs and on copies
    resized by prepare_imagenet.py (its own resize_jpeg), as markdown. Rates are per CPU-second of
    the process doing the work, so other load on the machine does not skew them."""
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset

    sys.path.insert(0, str(REPO / "tools"))
    from shared import resize_jpeg

    originals = jpegs(Path(jpeg_dir, "train"))
    sets, making = {"original": originals}, {}
    with scratch("bench-resized-") as workdir:
        for size in (256, 160):
            start, sets[f"--resize {size}"] = time.process_time(), []
            for index, path in enumerate(originals):
                sets[f"--resize {size}"].append(workdir / f"{size}-{index:06d}.jpg")
                try:
                    resized = resize_jpeg(path.read_bytes(), size, quality=90)
                except (OSError, SyntaxError, ValueError) as error:  # (a file cut short, not an image)
                    raise UsageError(
                        f"--jpeg-dir: cannot decode {path} ({error}): remove it, or give another"
                    ) from None
                sets[f"--resize {size}"][-1].write_bytes(resized)
            making[f"--resize {size}"] = len(originals) / (time.process_time() - start)

        class Crops(Dataset):
            def __init__(self, paths, crop):
                self.paths, self.preset = (paths * math.ceil(images / len(paths)))[:images], TrainPreset(crop)

            def __len__(self):
                return len(self.paths)

            def __getitem__(self, index):
                return self.preset(load_image(str(self.paths[index])), random.Random(index)), 0

        def worker_rate(paths, crop):
            before = cpu_of_children()
            count = sum(len(target) for _, target in DataLoader(Crops(paths, crop), batch_size=batch, num_workers=1))
            return count / (cpu_of_children() - before)

        print(
            "| images | crop | average file | average shorter side | images/s per worker | vs original "
            "| made at (images/s, 1 process) |\n|---|---:|---:|---:|---:|---:|---:|"
        )
        original = {}
        for name, crop in [("original", 224), ("--resize 256", 224), ("original", 160), ("--resize 160", 160)]:
            rate = worker_rate(sets[name], crop)
            original.setdefault(crop, rate)
            kilobytes = sum(path.stat().st_size for path in sets[name]) / len(sets[name]) / 1024
            side = sum(min(Image.open(path).size) for path in sets[name]) / len(sets[name])
            made = f"{making[name]:.0f}" if name in making else "-"
            print(
                f"| {name} | {crop} | {kilobytes:.0f} KB | {side:.0f} | {rate:.0f} | {rate / original[crop]:.2f}x "
                f"| {made} |",
                flush=True,
            )


AUGMENTATIONS = [
    ("crop + flip (no augmentation)", "none", 0.0),
    ("--auto-augment ta_wide --random-erase 0.1 (tv-v2)", "ta_wide", 0.1),
    ("--auto-augment ta_wide", "ta_wide", 0.0),
    ("--random-erase 0.1", "none", 0.1),
    ("--auto-augment ra --random-erase 0.1", "ra", 0.1),
    ("--auto-augment aa --random-erase 0.1", "aa", 0.1),
]


def median(values):
    """The middle value (of an odd count: the benchmarks' rounds)."""
    return sorted(values)[len(values) // 2]


def cpu_of_children():
    """CPU seconds of the joined child processes (a DataLoader's worker counts once the loader joined it)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def augment_compare(jpeg_dir, images, crop, batch=64, rounds=3):
    """Images/s of one DataLoader worker running the training pipeline as build_data makes it (SkipUnreadable
    + load_image, SeededTransform, TrainPreset with image_augmentation(), uint8 batches), per augmentation.
    The rows alternate, `rounds` times, and the median counts; rates are per CPU-second of the worker
    (so other load on the machine touches them little) and per wall-second."""
    from torch.utils.data import DataLoader

    paths = [str(path) for path in jpegs(Path(jpeg_dir, "train"))]
    samples = [(path, 0) for path in (paths * math.ceil(images / len(paths)))[:images]]
    cpu_rates, wall_rates = {name: [] for name, _, _ in AUGMENTATIONS}, {name: [] for name, _, _ in AUGMENTATIONS}
    for _ in range(rounds):
        for name, auto_augment, random_erase in AUGMENTATIONS:
            preset = TrainPreset(crop, augmentation=image_augmentation(auto_augment, 9, random_erase))
            dataset = SeededTransform(SkipUnreadable(ImageFiles(samples), True, False), preset, seed=0)
            loader = DataLoader(dataset, batch_size=batch, num_workers=1, collate_fn=Collate())
            cpu_before, wall_before = cpu_of_children(), time.perf_counter()
            count = sum(len(target) for _, target, _ in loader)
            wall_rates[name].append(count / (time.perf_counter() - wall_before))
            cpu_rates[name].append(count / (cpu_of_children() - cpu_before))
    print(
        f"| pipeline ({crop} px crops) | images/s per worker (CPU time) | wall | vs crop + flip "
        "| added ms per image |\n|---|---:|---:|---:|---:|"
    )
    base = None
    for name, _, _ in AUGMENTATIONS:
        cpu, wall = median(cpu_rates[name]), median(wall_rates[name])
        base = base or cpu
        print(f"| {name} | {cpu:.0f} | {wall:.0f} | {cpu / base:.2f}x | {1000 / cpu - 1000 / base:+.2f} |", flush=True)


def model_step_rate(size, channels_last, batch=64, steps=10, arch="resnet18", num_classes=10, device="cpu"):
    """Training images/s of forward, backward and SGD step alone, on random images of `size` px."""
    from torchvision import models as tv

    device = torch.device(device)
    torch.manual_seed(0)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = tv.get_model(arch, num_classes=num_classes, **({"image_size": size} if arch.startswith("vit") else {}))
    model = model.to(device, memory_format=memory_format).train()
    optimizer = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    images = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=memory_format)
    target = torch.randint(0, num_classes, (batch,), device=device)

    def step():
        loss = torch.nn.functional.cross_entropy(model(images), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: allocations, oneDNN primitive caches
    synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize()
    return steps * batch / (time.perf_counter() - start)


def res_compare(sizes, epochs, rounds, workdir):
    """train_dp.py on the demo set (its preset: resnet18, batch 64, validation at 32 px) at each training
    crop size, the sizes alternating `rounds` times: the last epoch's training images/s and seconds; and
    the model's training step alone (random images, batch 64, the run's memory format) at each size."""
    from common.demo_data import ensure_demo_dataset

    train_images = sum(1 for path in (ensure_demo_dataset() / "train").rglob("*") if path.is_file())
    rows, steps, channels_last = {size: [] for size in sizes}, {size: [] for size in sizes}, False
    for _ in range(rounds):
        for size in sizes:
            out = Path(tempfile.mkdtemp(dir=workdir))
            command = [
                sys.executable,
                str(REPO / "train_dp.py"),
                "--epochs",
                str(epochs),
                "--train-crop-size",
                str(size),
                "--seed",
                "0",
                "--output-dir",
                str(out),
                "-p",
                "1000",
            ]
            result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
            check_child("train_dp.py", result)
            channels_last = "channels_last memory format" in result.stdout
            last = log_rows(out)[-1]
            rows[size].append((float(last["images_per_second"]), float(last["seconds"])))
    for _ in range(rounds):
        for size in sizes:
            steps[size].append(model_step_rate(size, channels_last))
    reference = sizes[-1]
    print(
        f"| --train-crop-size | pixels vs {reference} px | training images/s | training s per epoch "
        f"({train_images} images) | epoch s with validation | training time vs {reference} px "
        f"| model step alone, images/s | model step time vs {reference} px |"
        "\n|---:|---:|---:|---:|---:|---:|---:|---:|"
    )

    for size in sizes:
        rate, seconds = median([r for r, _ in rows[size]]), median([s for _, s in rows[size]])
        reference_rate = median([r for r, _ in rows[reference]])
        step, reference_step = median(steps[size]), median(steps[reference])
        print(
            f"| {size} | {size**2 / reference**2:.2f}x | {rate:.0f} | {train_images / rate:.1f} | {seconds:.1f} "
            f"| {reference_rate / rate:.2f}x | {step:.0f} | {reference_step / step:.2f}x |",
            flush=True,
        )
    # At ImageNet's sizes (FFCV grows 160 -> 192 px) the step time follows the pixels more closely.
    large = [128, 160, 192]
    large_steps = {size: [] for size in large}
    for _ in range(rounds):
        for size in large:
            large_steps[size].append(model_step_rate(size, channels_last, batch=32, steps=3, num_classes=1000))
    print(
        "\nresnet18, 1000 classes, training step alone, batch 32, random images\n\n"
        "| crop | pixels vs 192 px | images/s | step time vs 192 px |\n|---:|---:|---:|---:|"
    )
    for size in large:
        step = median(large_steps[size])
        print(f"| {size} | {size**2 / 192**2:.2f}x | {step:.1f} | {median(large_steps[192]) / step:.2f}x |", flush=True)


def wait_compare(jpeg_dir, crop, epochs=2):
    """The worked example of "Why is my run slow?": train_dp.py (resnet18 at `crop` px, batch 32) on `jpeg_dir`
    as they are and as copies resized by prepare_imagenet.py (its resize_jpeg, --resize 160), each decoded in the
    training process (-j 0) and by one loader worker (-j 1): the last epoch's figures from log.csv, and whether the
    run said it was input-bound."""
    sys.path.insert(0, str(REPO / "tools"))
    from shared import resize_jpeg

    with scratch("bench-wait-") as workdir:
        resized = workdir / "resized"
        for path in jpegs(jpeg_dir):
            target = resized / path.relative_to(jpeg_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(resize_jpeg(path.read_bytes(), 160, quality=90))
        print(
            "| JPEGs | flags | images/s | input wait (log.csv) | TFLOP/s | said input-bound |\n"
            "|---|---|---:|---:|---:|---|"
        )
        for name, data, workers in (
            ("as they are", jpeg_dir, "0"),
            ("as they are", jpeg_dir, "1"),
            ("--resize 160 copies", resized, "0"),
            ("--resize 160 copies", resized, "1"),
        ):
            out = workdir / f"{name.split()[0].strip('-')}-j{workers}"
            command = [
                sys.executable,
                str(REPO / "train_dp.py"),
                "--data",
                str(data),
                "-a",
                "resnet18",
                "-b",
                "32",
                *crop_flags(crop),
                "-j",
                workers,
                "--epochs",
                str(epochs),
                "--seed",
                "0",
                "-p",
                "1000",
                "--output-dir",
                str(out),
            ]
            result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            check_child("train_dp.py", result)
            last = log_rows(out)[-1]
            print(
                f"| {name} | -j {workers} | {float(last['images_per_second']):.0f} | {last['input_wait_pct']}% "
                f"| {float(last['tflops_per_device']):.3f} | {'yes' if 'input-bound:' in result.stdout else 'no'} |",
                flush=True,
            )


CHANNELS_LAST_MODELS = [
    ("resnet18", 224),
    ("resnet50", 112),
    ("mobilenet_v3_small", 224),
    ("efficientnet_b0", 112),
    ("shufflenet_v2_x1_0", 224),
    ("squeezenet1_1", 224),
    ("convnext_tiny", 64),
    ("vit_b_16", 224),
]


def channels_last_compare(steps, batch=32, rounds=3, models=None):
    """Training images/s of a plain step (forward, backward, SGD) in the default memory format and in
    channels_last, on this machine's device, per model. The two formats alternate, `rounds` times, and
    the median counts: a load that comes and goes touches both alike."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print("| model | input | default img/s | channels_last img/s | gain |\n|---|---:|---:|---:|---:|", flush=True)
    for arch, size in models or CHANNELS_LAST_MODELS:
        rates = {False: [], True: []}
        for _ in range(rounds):
            for channels_last in (False, True):
                rates[channels_last].append(model_step_rate(size, channels_last, batch, steps, arch, 1000, device))
        default, nhwc = median(rates[False]), median(rates[True])
        print(f"| {arch} | {size} px | {default:.1f} | {nhwc:.1f} | {nhwc / default:.2f}x |", flush=True)


def sizes_list(text):
    """--batches, --res-compare: whole numbers of at least 1 separated by commas (an argparse type)."""
    return [whole(1)(part) for part in text.split(",")]


def model_sizes(text):
    """--models: ARCH:PX,... as [(torchvision model, input size in px)] (an argparse type)."""
    pairs = [entry.partition(":") for entry in text.split(",")]
    if not all(colon for _, colon, _ in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected ARCH:PX, separated by commas")
    return [(torchvision_model(arch), whole(1)(size)) for arch, _, size in pairs]


def jpeg_sizes(jpeg_dir):
    """The sizes of the JPEGs (jpegs) of the ImageFolder `jpeg_dir`'s train/; UsageError unless it has some, and
    a val/ (the training runs validate)."""
    paths = jpegs(Path(jpeg_dir, "train"))
    sizes = [path.stat().st_size for path in paths]
    if not sizes or not Path(jpeg_dir, "val").is_dir():
        raise UsageError(
            f"--jpeg-dir {jpeg_dir}: expected an ImageFolder of JPEGs, train/<class>/*.jpg (.jpeg, .JPEG) and val/"
        )
    if 0 in sizes:
        raise UsageError(f"--jpeg-dir {jpeg_dir}: {paths[sizes.index(0)]} is empty: remove it, or give another")
    return sizes


def main():
    parser = Parser(description=__doc__ and __doc__.splitlines()[0])
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="only the GPU at steady state: tools/benchmark_gpu.py (make benchmark-gpu), its flags after",
    )
    parser.add_argument("--jpeg-dir", help="an ImageFolder of JPEGs (train/ and val/); default: generated")
    parser.add_argument("--quick", action="store_true", help="fewer images: a smoke test, not a measurement")
    parser.add_argument(
        "--arch", type=torchvision_model, default="resnet18", help="model of the training table (%(default)s)"
    )
    parser.add_argument("--crop", type=whole(1), default=None, help="training crop (default: 224 on GPU, 112 on CPU)")
    parser.add_argument("--batches", type=sizes_list, default="32,128", help="two global batch sizes (%(default)s)")
    parser.add_argument("--workers", type=whole(0), default=1, help="loader workers per process (%(default)s)")
    parser.add_argument(
        "--resize-compare", action="store_true", help="only the table of original vs prepare_imagenet.py --resize JPEGs"
    )
    parser.add_argument(
        "--channels-last-compare",
        action="store_true",
        help="only the table of default vs channels_last training speed, per model",
    )
    parser.add_argument(
        "--augment-compare",
        action="store_true",
        help="only the table of per-worker images/s with each per-image augmentation",
    )
    parser.add_argument(
        "--res-compare",
        type=sizes_list,
        default=None,
        nargs="?",
        const=[24, 32],
        metavar="PX,PX",
        help="only the table of demo-set epochs at these training crop sizes (24,32)",
    )
    parser.add_argument(
        "--wait-compare",
        action="store_true",
        help='only the worked example of docs/benchmarks.md\'s "Why is my run slow?"',
    )
    parser.add_argument(
        "--models",
        type=model_sizes,
        default=None,
        metavar="ARCH:PX,...",
        help="models of --channels-last-compare (default: "
        + ",".join(f"{arch}:{size}" for arch, size in CHANNELS_LAST_MODELS)
        + ")",
    )
    args, rest = parser.parse_known_args()
    if args.gpu:  # tools/benchmark_gpu.py, with the flags it takes (--only, --out, ...)
        defaults = vars(parser.parse_known_args([])[0])  # (as parsed: --batches' default is a list there)
        ours = [flag(name) for name, value in vars(args).items() if name != "gpu" and value != defaults[name]]
        if ours:  # (were dropped without a word: --gpu --quick ran the whole 8 minutes)
            parser.error(f"--gpu runs tools/benchmark_gpu.py, which takes none of {', '.join(ours)}: leave them out")
        script = str(REPO / "tools" / "benchmark_gpu.py")  # (this process becomes it: a stop reaches its clean-up)
        os.execv(sys.executable, [sys.executable, script, *rest])
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.channels_last_compare:
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads\n\ndefault memory format vs channels_last, training step, batch 32\n"
        )
        channels_last_compare(steps=3 if args.quick else 6, models=args.models)
        return
    if args.res_compare:
        sizes = args.res_compare
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}\n\n"
            f"train_dp.py on the demo set, second of 2 epochs, median of 3 runs per size\n"
        )
        with scratch("bench-res-") as workdir:
            res_compare(sizes, epochs=2, rounds=1 if args.quick else 3, workdir=workdir)
        return
    gpu = torch.cuda.is_available()
    crop = args.crop or (224 if gpu else 112)
    pipeline_images, train_images = (128, 256) if args.quick else (1024, 2048 if not gpu else 8192)
    jpeg_dir = Path(args.jpeg_dir) if args.jpeg_dir else REPO / "data" / "bench-jpegs-500x375"
    if not args.jpeg_dir and not (jpeg_dir / "val").is_dir():
        make_jpegs(jpeg_dir, per_class=256)
    sizes = jpeg_sizes(jpeg_dir)

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
        + (f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if gpu else ", no GPU")
    )
    print(f"jpegs: {jpeg_dir} ({len(sizes)} train images, {sum(sizes) / len(sizes) / 1024:.0f} KB on average)\n")

    if args.resize_compare:
        print("original vs prepare_imagenet.py --resize, one DataLoader worker, our pipeline\n")
        resize_compare(jpeg_dir, pipeline_images)
        return
    if args.wait_compare:
        print(f"train_dp.py, resnet18 at {args.crop or 64} px, batch 32, the second of 2 epochs\n")
        wait_compare(jpeg_dir, args.crop or 64)
        return
    if args.augment_compare:
        print(f"per-image augmentation, one DataLoader worker, {pipeline_images} images per row, median of 3\n")
        augment_compare(jpeg_dir, pipeline_images, args.crop or 224)
        return

    print("a. input pipeline, one DataLoader worker, 224 px crops\n")
    print("| pipeline | images/s per worker | vs classic |\n|---|---:|---:|")
    rates = pipeline_rates(jpeg_dir, pipeline_images)
    classic = next(rate for name, rate in rates.items() if name.startswith("classic"))
    for name, rate in rates.items():
        print(f"| {name} | {rate:.0f} | {rate / classic:.2f}x |")

    batches = args.batches
    model_args = [
        "-a",
        args.arch,
        *crop_flags(crop),
        "-j",
        str(args.workers),
    ]
    print(
        f"\nb. training images/s, {args.arch} at {crop} px, {args.workers} loader worker(s) per process"
        f" ({'GPU' if gpu else 'CPU: 2 processes for ddp/spawn, the cores split between them'})\n"
    )
    print("| data | global batch | " + " | ".join(["dp", "ddp (torchrun)", "spawn", "classic loop"]) + " |")
    print("|---|---:|---:|---:|---:|---:|")
    with scratch("bench-") as workdir:  # (the runs' output folders, kept by no one)
        for data_name, data_args in [("dummy", []), ("jpeg", ["--data", str(jpeg_dir)])]:
            for batch in batches:
                images_per_epoch = train_images // 4 if data_name == "dummy" else len(sizes)
                epochs = ["--epochs", str(max(2, round(train_images / images_per_epoch)))]
                if data_name == "dummy":
                    data_args = ["--dummy", "--dummy-size", str(images_per_epoch)]
                cells = [
                    training_rate(mode, data_args, batch, epochs, workdir, model_args)
                    for mode in ("dp", "ddp", "spawn")
                ]
                classic_cell = (
                    f"{classic_loop_rate(jpeg_dir, batch, crop, args.workers, train_images, args.arch):.0f}"
                    if data_name == "jpeg"
                    else "-"
                )
                print(
                    f"| {data_name} | {batch} | "
                    + " | ".join(f"{cell:.0f}" for cell in cells)
                    + f" | {classic_cell} |",
                    flush=True,
                )

    print(
        "\nc. the GPU at steady state: make benchmark-gpu (python tools/benchmark.py --gpu)"
        + ("" if gpu else "\n\nskipped: no CUDA GPU on this machine")
    )


if __name__ == "__main__":
    sys.exit(run_tool(until_stopped(main)))

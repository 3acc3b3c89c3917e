"""Shards against the folder they came from: files opened per epoch, images/s per loader worker, and listing the
samples of ImageNet's size at a run's start (docs/benchmarks.md, "Shards").

    python tools/benchmark_shards.py                  # generated 500x375 JPEGs (~4 min on 2 cores)
    python tools/benchmark_shards.py --jpeg-dir DIR   # your own ImageFolder (train/, val/)

a. Files opened in one epoch of train_dp.py (-j 2), counted by strace (torchvision's read_file opens files from C++,
   out of Python's sight): every successful open of an image file or a shard, by any process of the run.
b. Images/s of ONE loader worker (decode, 224 px crop and flip, per CPU-second of the worker) reading the folder and
   its shards.
c. Listing 1,281,167 samples at a run's start: the scripts read the shards' indexes (ImageNet's count of training
   images, in 513 shards of 2,500; the shards themselves are sparse files, never read). The folder's listing of the
   same count is tools/benchmark_startup.py's.
"""

import codecs
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

import make_shards  # noqa: E402
from benchmark import cpu_of_children, jpeg_sizes, make_jpegs  # noqa: E402
from common.cli import Parser  # noqa: E402
from common.datasets import ImageFiles, ShardedImages  # noqa: E402
from common.folder_index import scan_image_folder  # noqa: E402
from common.shards import scan_shards, shard_stamp, write_index  # noqa: E402
from common.transforms import TrainPreset  # noqa: E402
from shared import run_tool, whole  # noqa: E402


def opened_paths(trace):
    """The paths that strace's `trace` (its text) shows opened, as this process names them: strace writes a byte
    outside printable ASCII as an octal escape (a folder `café`: caf\303\251)."""
    found = re.findall(r'open(?:at)?\([^"]*"((?:[^"\\]|\\.)*)"', trace)
    return [os.fsdecode(codecs.escape_decode(path.encode())[0]) for path in found]


def opened_files(data, workdir):
    """{"images": n, "shards": n} opened (successfully, by any process) in one epoch of train_dp.py -j 2."""
    trace = Path(workdir) / "strace.txt"
    command = [
        "strace",
        "-f",
        "-qq",
        "-e",
        "trace=open,openat",
        "-e",
        "status=successful",
        "-o",
        str(trace),
        sys.executable,
        str(REPO / "train_dp.py"),
        "--data",
        str(data),
        "-a",
        "mobilenet_v3_small",
        "--train-crop-size",
        "64",
        "--val-resize-size",
        "64",
        "--val-crop-size",
        "64",
        "-b",
        "32",
        "-j",
        "2",
        "--epochs",
        "1",
        "-p",
        "1000",
        "--output-dir",
        str(Path(workdir) / f"run-{Path(data).name}"),
        "--overwrite",
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    paths = opened_paths(trace.read_text())
    data = str(data)
    return {
        "images": sum(path.startswith(data) and path.lower().endswith((".jpg", ".jpeg", ".png")) for path in paths),
        "shards": sum(path.startswith(data) and path.endswith(".tar") for path in paths),
    }


def worker_rate(dataset, images, batch=64):
    """Images/s of one loader worker over `images` items of `dataset`, per CPU-second of the worker."""
    from torch.utils.data import DataLoader, Dataset

    preset = TrainPreset(224)

    class Crops(Dataset):
        def __len__(self):
            return images

        def __getitem__(self, index):
            image, label = dataset[index % len(dataset)]
            return preset(image, random.Random(index)), label

    before = cpu_of_children()
    count = sum(len(target) for _, target in DataLoader(Crops(), batch_size=batch, num_workers=1))
    return count / (cpu_of_children() - before)


def index_listing(workdir, samples=1_281_167, per_shard=2500):
    """Seconds to list `samples` samples from their shards' indexes (scan_shards, as rank 0 does at a start)."""
    root = Path(workdir) / "imagenet-sized"
    (root / "val").mkdir(parents=True)
    (root / "classes.txt").write_text("".join(f"n{k:08d}\n" for k in range(1000)))
    for split, count in (("train", samples), ("val", 50_000)):
        (root / split).mkdir(exist_ok=True)
        for number in range(math.ceil(count / per_shard)):
            shard = root / split / f"{split}-{number:06d}.tar"
            first = number * per_shard
            rows = [
                [f"n{k % 1000:08d}/n{k % 1000:08d}_{k}", "JPEG", k % 1000, 1024 + 512 * (3 * (k - first) + 1), 110_000]
                for k in range(first, min(first + per_shard, count))
            ]
            with open(shard, "wb") as file:
                file.truncate(rows[-1][3] + rows[-1][4] + 1024)  # sparse: the size an index records, nothing read
                for key, extension, _, offset, size in (rows[0], rows[-1]):  # the members read_index checks
                    member = tarfile.TarInfo(f"{key}.{extension}")
                    member.size = size
                    file.seek(offset - tarfile.BLOCKSIZE)
                    file.write(member.tobuf(tarfile.GNU_FORMAT))
            write_index(shard, rows, shard_stamp(shard))
    start = time.perf_counter()
    classes, train, val = scan_shards(root)
    seconds = time.perf_counter() - start
    if (len(classes), len(train), len(val)) != (1000, samples, 50_000):  # (not an assert: python -O drops those)
        raise RuntimeError(f"listed {len(classes)} classes, {len(train)} + {len(val)} samples: not what was written")
    return seconds, sum(path.stat().st_size for path in root.rglob("*.idx"))


def main():
    parser = Parser(description=__doc__ and __doc__.split("\n\n")[0])
    parser.add_argument("--jpeg-dir", help="an ImageFolder (train/, val/) of JPEGs (default: 2 x 400 generated)")
    parser.add_argument(
        "--images", type=whole(1), default=800, help="images per loader-worker measurement (default 800)"
    )
    args = parser.parse_args()
    if args.jpeg_dir:
        jpeg_sizes(args.jpeg_dir)  # (UsageError, before anything is made)
    workdir = Path(tempfile.mkdtemp(prefix="bench-shards-"))
    try:
        folder = Path(args.jpeg_dir) if args.jpeg_dir else make_jpegs(workdir / "jpegs", per_class=400)
        shards = workdir / "shards"
        make_shards.make_shards(
            make_shards.parse_args([str(folder), str(shards), "--shard-size", "100", "--workers", "1"])
        )
        files = {name: opened_files(data, workdir) for name, data in (("folder", folder), ("shards", shards))}
        scan, sharded = scan_image_folder(folder), scan_shards(shards)
        rates = {
            "folder": worker_rate(ImageFiles(scan.train), args.images),
            "shards": worker_rate(ShardedImages(sharded[1]), args.images),
        }
        seconds, index_bytes = index_listing(workdir)
        images = len(scan.train) + len(scan.val)
        shard_count = len(list(shards.glob("*/*.tar")))
        print(
            f"one epoch of train_dp.py -j 2 on {len(scan.train)} train and {len(scan.val)} val images "
            f"({shard_count} shards of 100):\n"
        )
        print(
            "| data | image files opened | shards opened | images/s of one loader worker (224 px crop) |\n"
            "|---|---:|---:|---:|"
        )
        for name in ("folder", "shards"):
            print(f"| {name} | {files[name]['images']} | {files[name]['shards']} | {rates[name]:.0f} |")
        print(
            f"\n({images} images in all.) Listing 1,281,167 training and 50,000 val samples from their 533 shards' "
            f"indexes ({index_bytes / 2**20:.0f} MiB): {seconds:.1f} s."
        )
        print(json.dumps({"files": files, "rates": rates, "index_seconds": seconds}))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(run_tool(main))

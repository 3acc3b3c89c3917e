"""Prove a GPU machine: every script, launch mode and GPU flag trains correctly here. `make gpu-check`.

    python tools/gpu_check.py              # everything (about 10-20 min on one GPU)
    python tools/gpu_check.py --quick      # the JPEG rows only, no synthetic ResNet-50
    python tools/gpu_check.py --only ddp   # the rows whose name matches a regular expression
    python tools/gpu_check.py --cpu        # the same harness on the CPU (gloo, a tiny model): a self-test

Each row is one real run, started as a user starts it, for a few dozen steps: train_dp.py on one
GPU and on all of them (nn.DataParallel), train_ddp.py under torchrun, train_spawn.py, train_fsdp.py, all
with NCCL; in float32, with `--amp bf16 --channels-last` (FSDP: `--amp bf16`, its mixed-precision policy),
with `--compile`, with `--sync-bn` for DDP, with `--grad-accum-steps 2 --compile` for DDP and FSDP, with
`--cpu-offload` and `--activation-checkpointing` for FSDP;
on synthetic data (--dummy, ResNet-50 at 224 px: the speed) and on JPEGs (the built-in demo set:
the learning). Every row must:
  - exit 0, with a finite training loss, that falls by 2% or more from the first epoch to the last
    on JPEGs (the synthetic set has nothing to learn: one image, cycling labels);
  - leave a checkpoint that loads with weights_only=True into a plain model of its --arch.
Then, on the JPEG data:
  - validation of one checkpoint by 1 process and by N (torchrun) counts every image once and gives
    the same acc@1 (at most one image apart: the two use different GPU batch sizes, hence kernels);
  - a run stopped after epoch 1 and resumed (--resume auto, --deterministic) ends with weights
    bitwise equal to those of the same run made in one go;
  - FSDP's training losses per epoch are DDP's (--deterministic, float32; within 1e-3 relative);
  - FSDP's --cpu-offload evaluates a single file's weights (its cpu-offload row's model_best.pth);
  - on a one-GPU machine, torchrun with 2 processes is refused with one line (two ranks, one GPU);
    on several GPUs, train_dp.py --compile is refused with one line.
What a run says of itself (common/diagnostics.py): every GPU row logs its GPU idle share (CUDA events), peak GPU
memory and TFLOP/s, and an MFU within (0, 100] on a GPU of known peak; a --profile trace holds CUDA kernels; running
out of GPU memory (a batch far too large, --memory-history) ends in one line naming an allocator snapshot with its
history; on several GPUs, a collective that times out leaves NCCL's Flight Recorder dump in the output directory.
The synthetic rows give images/s per GPU at steady state (make benchmark-gpu's window: one epoch of 80 steps of 256
per GPU, 128 or 64 on a GPU of less than 40 or 20 GiB; start-up left out) beside the rate expected of one H100 on an
H100 or H200. One table: row, flags, img/s per GPU, expected, peak GPU memory, MFU, pass/fail. Exit status 1 if
anything failed.
Without a CUDA GPU (and without --cpu) it says so in one line and exits 0.
"""

import argparse
import csv
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmark_gpu import CPU_WITHIN, STEADY_WITHIN, TARGETS, at_window_rate, dummy_size, slug, steady  # noqa: E402
from jobs import CheckFailed, free_port, run  # noqa: E402
from shared import folder, no_row, regex, run_tool, until_stopped, write_replacing  # noqa: E402

ACC_LINE = re.compile(r"^ \* Acc@1 ([\d.]+)  Acc@5 ([\d.]+)  Loss (\S+)  \((\d+) images\)$", re.MULTILINE)
LAUNCH_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "EPOCHS",
    "LR",
    "BATCH_SIZE",
    "DATASETS_PATH",
    "DATASETS",
    "WORKSPACE",
    "BACKEND",
    "WORKER_PER_NODE",
)


@dataclass
class Row:
    name: str  # dp1 / dpN / ddp / spawn, then the data
    mode: str
    data: str  # "synthetic" or "jpeg"
    flags: tuple = ()
    result: str = "not run"
    images_per_second: float = float("nan")
    peak_gib: float = float("nan")
    mfu: str = "-"
    target: str = "-"  # the images/s per GPU expected of one H100, where it applies, and whether it was reached
    output_dir: Path = None
    extra: dict = field(default_factory=dict)


class Setup:
    """Where and how the runs happen: on GPUs (nccl), or on the CPU for --cpu (gloo, tiny model)."""

    def __init__(self, cpu, workdir, extra_args):
        import torch

        self.cpu, self.workdir, self.extra_args = cpu, Path(workdir), list(extra_args)
        self.gpus = 0 if cpu else torch.cuda.device_count()
        self.world = 2 if cpu else self.gpus  # processes of ddp / spawn rows
        self.bf16 = not cpu and torch.cuda.get_device_capability(0) >= (8, 0)
        # The rates expected are one H100's (an H200 at least the same): another GPU's figures have none.
        self.targets_apply = not cpu and re.search(r"\bH(100|200)\b", torch.cuda.get_device_name(0)) is not None
        if cpu:
            from common import demo_data

            self.jpeg_dir = self.workdir / "jpegs"
            demo_data.generate(self.jpeg_dir, train_per_class=8, val_per_class=4, num_classes=3)
            tiny = ["--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32", "-j", "0"]
            self.jpeg_args = [
                "--data",
                str(self.jpeg_dir),
                *tiny,
                "-a",
                "tests.tiny_models:TinyNet",
                "--dropout",
                "0",
                "--lr",
                "0.1",
                "-b",
                "8",
                "--epochs",
                "4",
                "-p",
                "1",
            ]
            self.synthetic_args = [
                "--dummy",
                "--dummy-size",
                "64",
                *tiny,
                "-a",
                "tests.tiny_models:TinyNet",
                "-b",
                "8",
                "--epochs",
                "1",
                "-p",
                "1",
            ]
        else:
            # The built-in demo set (generated on first use) at its preset: 32 px shapes that resnet18
            # learns; two epochs of a few dozen steps at this batch.
            batch = 128 if 128 % self.world == 0 else 16 * self.world
            # A stalled rank fails its row in minutes, not after the default half hour.
            self.jpeg_args = ["-a", "resnet18", "-b", str(batch), "--epochs", "2", "-p", "10", "--dist-timeout", "300"]

    def env(self):
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in LAUNCH_VARIABLES and not key.startswith("SLURM_")
        }
        env["PYTHONUNBUFFERED"] = "1"
        if self.cpu:
            env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        return env

    def command(self, mode, nproc=None):
        nproc = nproc or self.world
        python = sys.executable
        if mode == "dp1":
            return [python, REPO / "train_dp.py", *(["--device", "cpu"] if self.cpu else ["--gpus", "0"])]
        if mode == "dpN":
            return [python, REPO / "train_dp.py"]
        if mode == "ddp":
            return [
                python,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={nproc}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                REPO / "train_ddp.py",
            ]
        if mode == "fsdp":
            return [
                python,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={nproc}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                REPO / "train_fsdp.py",
            ]
        if mode == "spawn":
            return [python, REPO / "train_spawn.py", "--nproc-per-node", str(nproc), "--master-port", str(free_port())]
        raise ValueError(mode)

    def synthetic_batch(self, mode):
        """The global batch of the synthetic rows: 256 per GPU (ResNet-50 as its anchors train it; float32 holds 27 GiB
        at 256), 128 on a GPU of less than 40 GiB, 64 under 20."""
        if self.cpu:
            return 8
        import torch

        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        return (256 if gib >= 40 else 128 if gib >= 20 else 64) * (1 if mode == "dp1" else self.world)

    def data_args(self, data, mode, compiled=False):
        if data == "jpeg" or self.cpu:
            return self.jpeg_args if data == "jpeg" else self.synthetic_args
        # ResNet-50 at 224 px, one epoch of 80 steps: the table gives the rate at steady state (make benchmark-gpu's
        # window: the start-up, cuDNN's autotuning and compiling left out).
        batch = self.synthetic_batch(mode)
        return [
            "--dummy",
            "--dummy-size",
            str(dummy_size(80, batch, compiled)),
            "-a",
            "resnet50",
            "-b",
            str(batch),
            "--epochs",
            "1",
            "-p",
            "10",
            "--dist-timeout",
            "300",
        ]


def keep_console(output_dir, output):
    """What a run printed, beside its log.csv (--keep keeps both), a run that hung included."""
    if output is not None and Path(output_dir).is_dir():
        (Path(output_dir) / "console.log").write_text(output)


def train(setup, mode, data, flags, output_dir, extra=(), timeout=None):
    command = [
        *setup.command(mode),
        *setup.data_args(data, mode, "--compile" in flags),
        *flags,
        *setup.extra_args,
        "--seed",
        "0",
        "--output-dir",
        output_dir,
        *extra,
    ]
    try:
        status, output = run(command, setup.env(), timeout or (300 if setup.cpu else 1200))
    except CheckFailed as failed:
        keep_console(output_dir, failed.output)
        raise
    keep_console(output_dir, output)
    if status != 0:
        raise CheckFailed(f"exit status {status}:\n{output[-2500:]}")
    return output


def check_training(setup, row, output):
    import torch

    from common.models import build_model

    epochs = [row for row in csv.DictReader(open(row.output_dir / "log.csv"))]
    losses = [float(epoch["train_loss"]) for epoch in epochs]
    if not losses or not all(math.isfinite(loss) for loss in losses):
        raise CheckFailed(f"training loss not finite: {losses}")
    if row.data == "jpeg" and not losses[-1] < 0.98 * losses[0]:
        raise CheckFailed(f"training loss did not fall by 2% or more: {losses}")
    summary = json.loads((row.output_dir / "summary.json").read_text())
    row.peak_gib, last = summary.get("peak_memory_gib", float("nan")), epochs[-1]
    row.images_per_second = float(last["images_per_second"])  # the last epoch's
    if not setup.cpu and not all(
        float(last[name] or 0) > 0 for name in ("gpu_peak_allocated_mib", "tflops_per_device")
    ):
        raise CheckFailed(f"log.csv lacks the GPU's figures: {last}")
    if last["mfu_pct"] and not 0 < float(last["mfu_pct"]) <= 100:
        raise CheckFailed(f"an MFU of {last['mfu_pct']}%")
    if not setup.cpu and not (0 <= float(last["gpu_idle_pct"] or -1) <= 100 and "GPU idle " in output):
        raise CheckFailed(f"no GPU idle share in log.csv ({last['gpu_idle_pct']!r}) or on the progress lines")
    row.mfu = last["mfu_pct"] or "-"
    if row.data == "synthetic":
        speed(setup, row, output, last)
    single = row.output_dir / "checkpoint.pth"
    if row.mode == "fsdp":  # its checkpoints are sharded directories: the latest one exported as a single file
        from common.sharded_checkpoint import export

        single = (
            export(row.output_dir / "checkpoint", row.output_dir / "exported.pth") and row.output_dir / "exported.pth"
        )
    state = torch.load(single, map_location="cpu", weights_only=True)
    model = build_model(state["arch"], state["num_classes"])
    model.load_state_dict(state["state_dict"])  # strict: every key, every shape


def speed(setup, row, output, last):
    """A synthetic row's images/s per GPU at steady state (make benchmark-gpu's window; else the epoch's, said so), its
    MFU at that rate, and the rate expected beside it where one applies (one GPU per process, ResNet-50)."""
    devices = 1 if row.mode == "dp1" else setup.world  # (on the CPU: per process)
    figures = steady(output, setup.synthetic_batch(row.mode), within=CPU_WITHIN if setup.cpu else STEADY_WITHIN)
    if figures is None:
        row.result = "PASS (no steady window: the epoch's rate)"
        return
    row.images_per_second = figures["images_per_second"] / devices
    row.result = (
        f"PASS (steady: {figures['measured_images']} images in {figures['measured_seconds']:.1f} s, "
        f"{figures['excluded_seconds']:.1f} s before left out)"
    )
    mfu = at_window_rate(last, figures["images_per_second"])["mfu_pct"]
    if mfu is not None:
        row.mfu = f"{mfu:.3g}"
    variant = "bf16" if "bf16" in row.flags and "--channels-last" in row.flags else "float32" if not row.flags else None
    if variant and row.mode in ("dp1", "ddp", "spawn") and not setup.cpu and setup.targets_apply:
        reached = row.images_per_second >= TARGETS[variant]
        row.target = f">= {TARGETS[variant]} ({'reached' if reached else 'NOT reached'})"


def check_row(setup, row):
    row.output_dir = setup.workdir / row.name.replace(" ", "_").replace("+", "")
    output = train(setup, row.mode, row.data, row.flags, row.output_dir)
    check_training(setup, row, output)


def evaluations(setup, checkpoint, workdir):
    """(acc@1, images) of one checkpoint evaluated by 1 process and by N."""
    results = {}
    for mode in ("dp1", "ddp"):
        output = train(setup, mode, "jpeg", (), workdir / f"eval-{mode}", extra=["-e", "--resume", checkpoint])
        found = ACC_LINE.findall(output)
        if not found:
            raise CheckFailed(f"no validation line in:\n{output[-1500:]}")
        acc1, _, loss, count = found[-1]
        results[mode] = (float(acc1), int(count), float(loss))
    return results


def check_validation_world_sizes(setup, row):
    base = setup.workdir / "ddp_jpeg"
    if not (base / "checkpoint.pth").is_file():
        raise CheckFailed("needs the 'ddp jpeg' row's checkpoint, which it did not leave")
    results = evaluations(setup, base / "checkpoint.pth", setup.workdir)
    (acc1, count, _), (acc1_n, count_n, _) = results["dp1"], results["ddp"]
    row.extra = results
    if count != count_n:
        raise CheckFailed(f"1 process counted {count} validation images, {setup.world} counted {count_n}")
    if abs(acc1 - acc1_n) > 100.0 / count + 1e-9:
        raise CheckFailed(f"acc@1 {acc1} with 1 process, {acc1_n} with {setup.world}")
    row.result = f"PASS ({count} images, acc@1 {acc1:.2f} / {acc1_n:.2f})"


def check_offload_evaluates_a_single_file(setup, row):
    """The cpu-offload row's model_best.pth evaluated under --cpu-offload: its parameters' shards in host memory, its
    BatchNorm statistics on the GPU, which torch's full-state load refuses ("Multiple devices found")."""
    best = setup.workdir / "fsdp_jpeg_cpu-offload" / "model_best.pth"
    if not best.is_file():
        raise CheckFailed("needs the 'fsdp jpeg cpu-offload' row's model_best.pth, which it did not leave")
    output = train(setup, "fsdp", "jpeg", ("--cpu-offload",), setup.workdir / "eval-offload", ["-e", "--resume", best])
    if not ACC_LINE.findall(output):
        raise CheckFailed(f"no validation line in:\n{output[-1500:]}")
    row.result = f"PASS (acc@1 {ACC_LINE.findall(output)[-1][0]})"


def check_exact_resume(setup, row):
    import torch

    # A step schedule, the lr changing every epoch: the resumed run must restore the scheduler too.
    flags = ("--deterministic", "--lr-schedule", "step", "--lr-step-size", "1", "--warmup-epochs", "0")
    # The run resumed from the uninterrupted run's checkpoint of epoch E-1 (checkpoint_prev.pth: one
    # checkpoint per epoch) must end with its weights.
    straight, resumed = setup.workdir / "resume-straight", setup.workdir / "resume-resumed"
    epochs = int(setup.jpeg_args[setup.jpeg_args.index("--epochs") + 1])
    train(setup, "ddp", "jpeg", flags, straight)
    previous = torch.load(straight / "checkpoint_prev.pth", map_location="cpu", weights_only=True)
    if (previous["epoch"], previous["step_in_epoch"]) != (epochs - 1, 0):
        raise CheckFailed(
            f"checkpoint_prev.pth holds epoch {previous['epoch']} step {previous['step_in_epoch']}, "
            f"not the end of epoch {epochs - 1}"
        )
    resumed.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(straight / "checkpoint_prev.pth", resumed / "checkpoint.pth")
    output = train(setup, "ddp", "jpeg", flags, resumed, extra=["--resume", "auto"])
    if f"(epoch {epochs - 1})" not in output:
        raise CheckFailed(f"the second run did not resume at epoch {epochs - 1}:\n{output[-1500:]}")
    a = torch.load(straight / "checkpoint.pth", map_location="cpu", weights_only=True)["state_dict"]
    b = torch.load(resumed / "checkpoint.pth", map_location="cpu", weights_only=True)["state_dict"]
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    if differ or a.keys() != b.keys():
        raise CheckFailed(f"resumed weights differ from the uninterrupted run's: {differ[:5]}")
    row.result = f"PASS ({len(a)} tensors bitwise equal)"


def check_fsdp_matches_ddp(setup, row):
    """FSDP (NCCL's reduce-scatter, the model sharded) follows DDP's trajectory: the same per-epoch training losses
    and validation acc@1 for the same seed, within what another order of summation gives (float32, deterministic)."""
    flags = ("--deterministic",)
    logs = {}
    for mode in ("ddp", "fsdp"):
        output_dir = setup.workdir / f"compare-{mode}"
        train(setup, mode, "jpeg", flags, output_dir)
        logs[mode] = [
            (float(epoch["train_loss"]), float(epoch["val_acc1"]))
            for epoch in csv.DictReader(open(output_dir / "log.csv"))
        ]
    (ddp, fsdp), tolerance = (logs["ddp"], logs["fsdp"]), (1e-5 if setup.cpu else 1e-3)
    if len(ddp) != len(fsdp) or any(abs(a[0] - b[0]) > tolerance * max(1.0, abs(a[0])) for a, b in zip(ddp, fsdp)):
        raise CheckFailed(f"training losses per epoch: ddp {ddp}, fsdp {fsdp}")
    row.result = f"PASS (losses {', '.join(f'{a[0]:.5f}/{b[0]:.5f}' for a, b in zip(ddp, fsdp))})"


def check_profile(setup, row):
    """--profile 1:2: each rank's Chrome trace holds steps 1 and 2 (within the first epoch: a window from an epoch's
    end is not recorded), and (on a GPU) CUDA kernels."""
    train(setup, "ddp", "jpeg", ("--profile", "1:2"), setup.workdir / "profile")
    events = json.loads((setup.workdir / "profile" / "profile" / "rank0.json").read_text())["traceEvents"]
    steps = {event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")}
    kernels = [event for event in events if event.get("cat") == "kernel"]
    if steps != {"ProfilerStep#1", "ProfilerStep#2"} or not (kernels or setup.cpu):
        raise CheckFailed(f"the trace holds steps {sorted(steps)} and {len(kernels)} CUDA kernels")
    row.result = f"PASS ({len(events)} events, {len(kernels)} CUDA kernels)"


# --decode gpu against the loader workers' decoding: nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's, so
# pixels differ by a few levels; a wrong crop, flip or channel order differs by tens on average.
MAX_MEAN_DECODE_DIFFERENCE = 2.0  # levels of 255


def check_decode_pixels(setup, row):
    """--decode gpu's training and validation images of 500x375 photo-like JPEGs (and a greyscale one) against those of
    the loader workers (the CPU's decoder, the same seeded crops and flips); then the rate of EncodedBatch.decode on
    a batch of 256 (the training process's share of the work; --cpu: 32)."""
    import random

    import torch
    from PIL import Image

    from benchmark import make_jpegs  # (tools/benchmark.py)
    from common.datasets import decode_bytes, encoded_jpeg
    from common.device_loader import EncodedBatch
    from common.transforms import EvalPreset, TrainPreset

    device = torch.device("cpu" if setup.cpu else "cuda")
    paths = sorted(make_jpegs(setup.workdir / "photos", per_class=24, classes=1).rglob("*.jpg"))
    Image.open(paths[0]).convert("L").save(setup.workdir / "grey.jpg", quality=90)
    paths.append(setup.workdir / "grey.jpg")
    worst, mean = 0, 0.0
    files = [path.read_bytes() for path in paths]
    encoded = [encoded_jpeg(data, path.name) for data, path in zip(files, paths)]
    if None in encoded:
        raise CheckFailed(f"{paths[encoded.index(None)].name} would be decoded by the loader workers")
    cpu_decoded = [decode_bytes(data, "jpg") for data in files]
    for preset in (TrainPreset(224), EvalPreset(256, 224)):
        samples = [(preset(jpeg, random.Random(k)), 0) for k, jpeg in enumerate(encoded)]
        expected = torch.stack([preset(image, random.Random(k)) for k, image in enumerate(cpu_decoded)])
        images, kept, bad = EncodedBatch(samples).decode(device)
        if bad or len(kept) != len(paths):
            raise CheckFailed(f"not decoded on the device: {bad}")
        difference = (images.cpu().int() - expected.int()).abs()
        worst, mean = max(worst, int(difference.max())), max(mean, float(difference.float().mean()))
    if mean > MAX_MEAN_DECODE_DIFFERENCE:
        raise CheckFailed(f"pixels differ by {mean:.2f} levels on average (at most {worst}) from the CPU's")
    size, repeats = (32, 1) if setup.cpu else (256, 5)  # (--cpu: the harness is tested, not the rate)
    batch = EncodedBatch([samples[k % len(samples)] for k in range(size)])
    batch.decode(device)
    start = time.perf_counter()
    for _ in range(repeats):
        batch.decode(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rate = repeats * size / (time.perf_counter() - start)
    row.result = f"PASS (pixels: at most {worst}, on average {mean:.2f} levels from the CPU's; decode {rate:.0f} img/s)"


def _random_jpeg(height, width, seed):
    """The bytes of a JPEG of random pixels."""
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buffer, "JPEG"
    )
    return buffer.getvalue()


def check_decode_while_busy(setup, row):
    """--decode gpu's decoding while its stream still has work queued on memory it has freed (the prefetch's crops of
    the batch before): the decoder must not write there first (pytorch/vision#9606: it did, 211 wrong sums of 240)."""
    import contextlib

    import torch

    from common.datasets import encoded_jpeg
    from common.device_loader import EncodedBatch
    from common.transforms import EvalPreset

    cuda = not setup.cpu
    device, side = torch.device("cuda" if cuda else "cpu"), torch.cuda.Stream() if cuda else None
    size = 3 * 480 * 640
    samples = [(EvalPreset(480, 480)(encoded_jpeg(_random_jpeg(480, 640, seed=0), "random.jpg")), 0)] * 8
    expected, wrong = EncodedBatch(samples).decode(device)[0], 0
    with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
        for _ in range(20):
            held = [torch.full((size,), 7, dtype=torch.uint8, device=device) for _ in range(8)]
            if cuda:
                torch.cuda.synchronize()
            product = torch.randn(4096 if cuda else 64, 4096 if cuda else 64, device=device)
            for _ in range(30):  # (work that keeps the stream busy while `held` is freed)
                product = product @ product / product.norm()
            sums = [tensor.sum() for tensor in held]
            del held
            images = EncodedBatch(samples).decode(device)[0]
            wrong += sum(int(total) != 7 * size for total in sums) + int(not torch.equal(images, expected))
    if wrong:
        raise CheckFailed(f"{wrong} of 180 results wrong: the decoder wrote into memory still in use")
    row.result = "PASS (180 results right)"


def check_decode_through_the_loader(setup, row):
    """--decode gpu through DeviceLoader, as training takes it: each batch decoded by its thread one batch ahead on the
    side stream, handed to the main stream behind an event while that stream is busy; batch for batch, the images
    EncodedBatch.decode gives directly (a missing wait would show the crops half written)."""
    import random

    import torch

    from common.datasets import encoded_jpeg
    from common.device_loader import DeviceLoader, EncodedBatch
    from common.transforms import TrainPreset

    device = torch.device("cpu" if setup.cpu else "cuda")
    count, size, side = (4, 8, 64) if setup.cpu else (12, 64, 4096)  # batches, their images, the busy work's matrix
    jpeg, preset = encoded_jpeg(_random_jpeg(375, 500, seed=1), "random.jpg"), TrainPreset(224)
    batches = [EncodedBatch([(preset(jpeg, random.Random(f"{b}-{k}")), 0) for k in range(size)]) for b in range(count)]
    expected = [batch.decode(device)[0].cpu() for batch in batches]
    product, wrong = torch.randn(side, side, device=device), 0
    for (images, _), want in zip(DeviceLoader([(b, torch.zeros(size), []) for b in batches], device), expected):
        for _ in range(10):  # (the main stream busy, the side stream's crops of the next batch queued meanwhile)
            product = product @ product / product.norm()
        wrong += int(not torch.equal(images.cpu(), want))
    if wrong:
        raise CheckFailed(f"{wrong} of {count} batches differ from their direct decode")
    row.result = f"PASS ({count} batches of {size} equal to their direct decode)"


def check_out_of_memory(setup, row):
    """A step that runs out of memory: exit 1 and one line with the levers; on a GPU, the snapshot it names holds the
    allocator's segments and (--memory-history) its history."""
    import pickle

    out = setup.workdir / "oom"
    flags = (
        ["--trainer", "tests.tiny_models:OutOfMemoryAtStep2"]
        if setup.cpu
        else ["--dummy", "--dummy-size", "8192", "-a", "resnet50", "-b", "8192", "--memory-history"]
    )
    command = [*setup.command("dp1"), *setup.jpeg_args, *flags, "--output-dir", out]
    status, output = run(command, setup.env(), 900)
    line = next((line for line in output.splitlines() if " ran out of " in line), "")
    if status != 1 or "--amp bf16" not in line or "Traceback" in output:
        raise CheckFailed(f"exit {status}, and not one line with the levers:\n{output[-2500:]}")
    if not setup.cpu:
        snapshot = pickle.loads((out / "memory" / "oom-rank0.pickle").read_bytes())
        if not snapshot["segments"] or not any(snapshot["device_traces"]):
            raise CheckFailed("the snapshot holds no segments or no history")
    row.result = "PASS (" + line.split(": ", 1)[-1][:60] + "...)"


def check_flight_recorder(setup, row):
    """Rank 1 stalls past --dist-timeout: NCCL's watchdog aborts the job, and rank 0's Flight Recorder dump is in the
    output directory, where the header said."""
    out = setup.workdir / "stalled"
    command = [
        *setup.command("ddp"),
        *setup.jpeg_args,
        "--trainer",
        "tests.tiny_models:StallsRank1",
        "--dist-timeout",
        "30",
        "--output-dir",
        out,
    ]
    status, output = run(command, setup.env(), 600)
    dump = out / "nccl_trace" / "rank_0"
    if status == 0 or f"{out}/nccl_trace/rank_" not in output or not dump.is_file() or not dump.stat().st_size:
        raise CheckFailed(f"exit {status}, dump {dump} {'found' if dump.is_file() else 'missing'}:\n{output[-2500:]}")
    row.result = f"PASS ({dump.stat().st_size} bytes in {dump})"


def check_two_ranks_one_gpu_refused(setup, row):
    command = [*setup.command("ddp", nproc=2), *setup.jpeg_args, "--output-dir", setup.workdir / "shared-gpu"]
    status, output = run(command, setup.env(), 600)
    if status == 0 or not re.search(r"^error: .*both use GPU", output, re.MULTILINE):
        raise CheckFailed(f"exit {status}, and no one-line refusal:\n{output[-2500:]}")
    # torchrun prints a traceback of its own (ChildFailedError) when a worker fails; ours must not.
    if re.search(r'^Traceback.*\n  File "' + re.escape(str(REPO)) + r"/(?!\.venv)", output, re.MULTILINE):
        raise CheckFailed(f"refused with a traceback of this repository's code, not one line:\n{output[-2500:]}")
    row.result = "PASS (refused in one line)"


def check_refused(setup, row):
    """A combination the scripts refuse, in one line and exit status 2, before training."""
    command = [*setup.command(row.mode), *setup.jpeg_args, *row.flags, "--output-dir", setup.workdir / "refused"]
    status, output = run(command, setup.env(), 600)
    if status != 2 or not re.search(row.extra["expect"], output) or "Traceback" in output:
        raise CheckFailed(f"exit {status}, and not the one line {row.extra['expect']!r}:\n{output[-2500:]}")
    row.result = "PASS (refused in one line)"


def rows_for(setup, quick):
    """The training rows for this machine: DataParallel over all GPUs only where there are several."""
    modes = ["dp1", *(["dpN"] if setup.gpus > 1 else []), "ddp", "spawn", "fsdp"]
    amp = "bf16" if setup.cpu or setup.bf16 else "fp16"  # bf16 is emulated before compute capability 8.0
    variants = (
        [("fp32", ())]
        if setup.cpu
        else [("fp32", ()), (f"{amp} cl", ("--amp", amp, "--channels-last")), ("compile", ("--compile",))]
    )
    rows = []
    for data in ["jpeg"] if quick else ["jpeg", "synthetic"]:
        for mode in modes:
            for name, flags in variants:
                if name == "compile" and mode == "dpN":
                    continue  # refused: DataParallel over several GPUs cannot be compiled
                if mode == "fsdp" and "--channels-last" in flags:  # refused: FSDP shards contiguous parameters
                    name, flags = "bf16", ("--amp", "bf16")  # FSDP's mixed-precision policy
                rows.append(Row(f"{mode} {data}" + ("" if name == "fp32" else f" {name}"), mode, data, flags))
            if mode == "ddp" and not setup.cpu:
                rows.append(Row(f"{mode} {data} sync-bn", mode, data, ("--sync-bn",)))
                # A metric whose state is summed on the GPU (index_add_ in float64) and over the ranks by NCCL.
                rows.append(
                    Row(
                        f"{mode} {data} confusion-matrix",
                        mode,
                        data,
                        ("--trainer", "examples.confusion_matrix:PerClass"),
                    )
                )
            if mode in ("dp1", "ddp") and data == "jpeg" and not setup.cpu:  # JPEGs decoded by nvJPEG, on the GPU
                rows.append(Row(f"{mode} {data} decode-gpu", mode, data, ("--decode", "gpu", "--amp", amp)))
            if mode in ("ddp", "fsdp") and data == "jpeg" and not setup.cpu:  # (the CPU's: make test)
                # Accumulation skips the sync on all but each step's last micro-batch: DDP's no_sync around a compiled
                # model, FSDP2's set_requires_gradient_sync.
                rows.append(Row(f"{mode} {data} grad-accum", mode, data, ("--grad-accum-steps", "2", "--compile")))
            if mode == "fsdp":
                if setup.cpu:
                    rows.append(Row(f"{mode} {data} bf16", mode, data, ("--amp", "bf16")))
                else:
                    rows.append(Row(f"{mode} {data} cpu-offload", mode, data, ("--cpu-offload",)))
                rows.append(Row(f"{mode} {data} activation-checkpointing", mode, data, ("--activation-checkpointing",)))
    return rows


def table(rows, failures):
    lines = [
        "| row | flags | img/s per GPU | expected | peak GPU memory (GiB) | MFU % | result |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for row in rows:
        rate = "-" if math.isnan(row.images_per_second) else f"{row.images_per_second:.0f}"
        peak = "-" if math.isnan(row.peak_gib) else f"{row.peak_gib:.2f}"
        lines.append(
            f"| {row.name} | {' '.join(row.flags) or '-'} | {rate} | {row.target} | {peak} | {row.mfu} | {row.result} |"
        )
    done = sum(row.result != "not run" for row in rows)
    return "\n".join([*lines, "", f"{done - failures} passed, {failures} failed, {len(rows) - done} not run yet"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__ and __doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="JPEG rows only (no synthetic ResNet-50)")
    parser.add_argument("--only", type=regex, metavar="REGEX", help="only the rows whose name matches")
    parser.add_argument("--cpu", action="store_true", help="self-test of this harness on the CPU (gloo, tiny model)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' output directories")
    parser.add_argument(
        "--out",
        default=str(Path(os.environ["OUT"]) / "gpu-check") if os.environ.get("OUT") else None,
        help="a folder for the table and each failed row's output, written after every row (default: $OUT/gpu-check "
        "where OUT is set, else none)",
    )
    parser.add_argument(
        "--extra-args",
        default="",
        metavar="'ARGS'",
        help="appended to every training command (e.g. '--lr 0': the learning checks must fail)",
    )
    args = parser.parse_args(argv)
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU is visible on this machine: nothing to check (make test covers the CPU)")
        return 0
    out = folder(parser, args.out) if args.out is not None else None
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        setup = Setup(args.cpu, workdir, args.extra_args.split())
        every = all_checks(setup, args.quick)
        checks = [(row, check) for row, check in every if not args.only or re.search(args.only, row.name)]
        if not checks:
            shutil.rmtree(workdir, ignore_errors=True)  # (--keep: nothing ran to keep)
            no_row(parser, args.only, [row.name for row, _ in every])
        where = (
            "CPU (self-test: gloo, 2 processes, tiny model)"
            if args.cpu
            else f"{setup.gpus} x {torch.cuda.get_device_name(0)}"
        )
        print(f"gpu-check on {where}, torch {torch.__version__}; runs in {workdir}", flush=True)
        return run_checks(setup, checks, out)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def all_checks(setup, quick):
    """(row, check) of every check this machine can run: the training rows, then the checks of one guarantee each."""
    checks = [(row, check_row) for row in rows_for(setup, quick)]
    checks += [
        (Row("validation 1 vs N processes", "ddp", "jpeg"), check_validation_world_sizes),
        (Row("exact resume (ddp --deterministic)", "ddp", "jpeg"), check_exact_resume),
        (Row("fsdp losses = ddp losses", "fsdp", "jpeg"), check_fsdp_matches_ddp),
        (Row("profile trace", "ddp", "jpeg"), check_profile),
        (Row("out of memory: snapshot", "dp1", "jpeg"), check_out_of_memory),
        (Row("decode-gpu pixels vs the CPU's", "dp1", "jpeg"), check_decode_pixels),
        (Row("decode-gpu while the stream is busy", "dp1", "jpeg"), check_decode_while_busy),
        (Row("decode-gpu through the loader's thread", "dp1", "jpeg"), check_decode_through_the_loader),
    ]
    if not setup.cpu:
        checks.append(
            (Row("fsdp cpu-offload -e of model_best.pth", "fsdp", "jpeg"), check_offload_evaluates_a_single_file)
        )
    if setup.gpus > 1:
        checks.append((Row("nccl timeout: flight recorder", "ddp", "jpeg"), check_flight_recorder))
    if setup.gpus == 1:
        checks.append((Row("two ranks on one GPU refused", "ddp", "jpeg"), check_two_ranks_one_gpu_refused))
    if setup.gpus > 1:
        checks.append(
            (
                Row(
                    "dpN compile refused",
                    "dpN",
                    "jpeg",
                    ("--compile",),
                    extra={"expect": r"^error: --compile does not work with DataParallel over"},
                ),
                check_refused,
            )
        )
    return checks


def run_checks(setup, checks, out):
    """Each check in turn, the table written to `out` (if any) after each with a failed row's output; the exit code."""
    failures = 0
    for row, check in checks:
        start = time.monotonic()
        try:
            check(setup, row)
            if row.result == "not run":
                row.result = "PASS"
        except Exception as error:  # (CheckFailed, or a CUDA error of a check run here: the next rows still run)
            failures += 1
            detail = str(error) if isinstance(error, CheckFailed) else traceback.format_exc()
            row.result = "FAIL: " + ((str(error).splitlines() or [""])[0] or type(error).__name__)
            print(f"--- {row.name}: FAIL\n{detail}", file=sys.stderr, flush=True)
            if out:
                (out / f"{slug(row.name)}.log").write_text(getattr(error, "output", None) or detail)
        print(f"{row.name}: {row.result} ({time.monotonic() - start:.0f} s)", flush=True)
        if out:
            write_replacing(out / "table.md", table([row for row, _ in checks], failures) + "\n")
    print("\n" + table([row for row, _ in checks], failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(run_tool(until_stopped(main)))

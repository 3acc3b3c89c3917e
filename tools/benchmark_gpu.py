"""The GPU's speed at steady state, in one table: `make benchmark-gpu` (or `python tools/benchmark.py --gpu`).

    python tools/benchmark_gpu.py                    # every row, on the first GPU (about 8 min on one H100 or H200)
    python tools/benchmark_gpu.py --only resnet50    # the rows whose name matches a regular expression
    python tools/benchmark_gpu.py --only '^vit_b_16 bf16($|, bare| --compile($|, ))'  # with rows run on request only
    python tools/benchmark_gpu.py --repo DIR         # the scripts of another checkout (a "before" of a change)
    python tools/benchmark_gpu.py --cpu              # the same harness on the CPU (a tiny model): a self-test

Each row is one real run of a script (train_dp.py on one GPU, or train_ddp.py under torchrun with one process) for one
epoch of a few dozen steps, with a progress line every 10 steps. A progress line gives the images/s since the epoch's
start, read after the loop synchronised, so each line tells how long the epoch had taken by then; the rate between two
lines is the rate of the steps between them. The steady window is the longest run of intervals up to the epoch's end
whose rates stay within 10% of the median of the later half; everything before it (start-up, cuDNN's autotuning,
compilation, the loader's start) is left out, and the table says how many seconds that was. Input wait and GPU idle
are the window's share of the same lines' percentages (which print whole percents: a few points). TFLOP/s and MFU are
the run's own FLOPs and peak (log.csv) at the window's rate; peak memory is the epoch's. Synthetic rows (--dummy) make
their batches on the GPU (no loader, no copy); JPEG rows read 500x375 JPEGs (about 90 KB) from local disk with -j's
default workers. The bare loop is a plain PyTorch loop (no Trainer) on the same model and data: what is left to gain in
ours.

A run whose rates never settle (each interval 10% off the later half's median) is measured over the later half of its
lines, and the table says "not steady" (no verdict). The table (markdown) and the rows' figures (JSON) go to --out
(default: $OUT/benchmark-gpu where OUT is set, else ./benchmark-gpu) after every row, with each run's console output,
log.csv, summary.json and trace (runs/ROW/): a command cut short keeps what it measured. Each row has its own time
limit (ROW_LIMIT); with --deadline S, no row starts within LEAST_FOR_A_ROW seconds of S, and a row is stopped at S
(SIGTERM, then SIGKILL 30 s later) (the exit status is 1 for a row that failed, not for one left out).
"""

import argparse
import csv
import gzip
import json
import multiprocessing
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jobs import CheckFailed, free_port, run  # noqa: E402
from shared import folder, no_row, regex, run_tool, scratch, seconds, until_stopped, write_replacing  # noqa: E402

# Epoch 0's progress lines: step count, images/s since the epoch's start, and (where said) its input wait and GPU idle.
PROGRESS = re.compile(
    r"^Epoch: \[0\] \[\s*(?P<done>\d+)/\d+\].*?(?P<rate>[\d.]+) img/s"
    r"(?: \(input wait (?P<wait>[\d.]+)%[^;)]*(?:; GPU idle (?P<idle>[\d.]+)%)?\))?",
    re.MULTILINE,
)
STEADY_WITHIN = 0.10  # an interval's rate within this of the later half's median is steady
CPU_WITHIN = (
    4.0  # --cpu's self-test: steps of milliseconds on a shared CPU, any interval counts (the plumbing is tested)
)
# The JPEG rows' epoch at -b 256: long enough that the loader's prefetched batches (2 per worker, filled while the model
# compiles or cuDNN tunes) are spent well before its end, and the window measures the decoding.
JPEG_STEPS = 160
FEWEST_INTERVALS = 3  # a window of fewer intervals is no measurement
ROW_LIMIT = 420  # seconds a row may take (--cpu: 300); with --deadline, at most what is left of it
LEAST_FOR_A_ROW = 60  # seconds: with less left before --deadline, a row is not started
PRINT_FREQ = 10
H200_BEFORE = (
    1495  # resnet50 float32 images/s, the first GPU run (H200, -b 64, start-up included): the float32 row's base
)


@dataclass
class Point:
    """A progress line: images trained since the epoch's start (all ranks), the seconds that took, and the shares
    (%) of those seconds spent waiting for input and with the GPU idle (None where not said)."""

    images: int
    seconds: float
    wait: float = None
    idle: float = None


def progress_points(output, batch):
    """The Points of epoch 0's progress lines in a run's output (`batch`: the global batch, every step full)."""
    points = []
    for match in PROGRESS.finditer(output):
        images, rate = int(match["done"]) * batch, float(match["rate"])
        if rate > 0:
            points.append(
                Point(images, images / rate, *(float(match[key]) if match[key] else None for key in ("wait", "idle")))
            )
    return points


def interval_rates(points):
    return [
        (b.images - a.images) / (b.seconds - a.seconds) if b.seconds > a.seconds else float("inf")
        for a, b in zip(points, points[1:])
    ]


def steady_start(points, within=STEADY_WITHIN, fewest=FEWEST_INTERVALS):
    """The index of the Point that starts the steady window (which ends at the last Point): the earliest from which
    every interval's rate is within `within` of the median of the later half's; None for fewer than `fewest` of them."""
    rates = interval_rates(points)
    if len(rates) < fewest:
        return None
    reference = statistics.median(rates[len(rates) // 2 :])
    first = len(rates)
    while first > 0 and abs(rates[first - 1] / reference - 1) <= within:
        first -= 1
    return first if len(rates) - first >= fewest else None


def window_figures(points, first):
    """images/s, input wait % and GPU idle % over Points[first:], the steps and seconds measured and those left out
    before, and the spread of the intervals' rates (max / min)."""
    a, b = points[first], points[-1]
    seconds = b.seconds - a.seconds
    rates = interval_rates(points[first:])

    def share(key):
        before, after = getattr(a, key), getattr(b, key)
        if before is None or after is None:
            return None
        return max(0.0, (after * b.seconds - before * a.seconds) / seconds)

    # The lines print whole percents: each is within 0.5 of its value, so the window's share within this many points.
    error = 0.5 * (a.seconds + b.seconds) / seconds
    return {
        "images_per_second": (b.images - a.images) / seconds,
        "input_wait_pct": share("wait"),
        "gpu_idle_pct": share("idle"),
        "share_error_pct": error,
        "measured_images": b.images - a.images,
        "measured_seconds": seconds,
        "excluded_seconds": a.seconds,
        "spread": max(rates) / min(rates),
    }


@dataclass
class Bench:
    name: str
    mode: str  # "dp" (train_dp.py, one GPU), "ddp" (train_ddp.py under torchrun, one process), "bare"
    args: tuple
    batch: int
    steps: int
    target: str = ""  # what the row should reach: ">= N img/s", "MFU >= N%", or a share of `versus`'s rate
    versus: str = None  # the row whose rate `target` is a share of
    share: float = None  # (that share)
    data: str = "synthetic"  # or "jpeg"
    profile: str = None  # --profile START:STEPS: the row's trace, summarised (it then measures no speed)
    on_request: bool = False  # run only where --only names it (a diagnosis, not part of the 8-minute table)
    result: dict = field(default_factory=dict)


# The rates expected of one H100 (images/s per GPU; the float32 one is 1.4x the first GPU run's 1,495 on an H200).
TARGETS = {"bf16": 3000, "bf16 compile": 3500, "float32": round(1.4 * H200_BEFORE)}


def gpu_rows(jpegs):
    r50, bf16, fp32 = ("-a", "resnet50"), ("--amp", "bf16", "--channels-last", "on"), ("--amp", "none")
    vit = ("-a", "vit_b_16", "--amp", "bf16")
    base = "resnet50 bf16 channels_last"
    decode_gpu, compiled_gpu = ("--decode", "gpu"), ("--compile", "--decode", "gpu")

    def jpeg_row(name, flags, target, versus=None, share=None, **options):
        """A resnet50 bf16 row of `flags` that reads the generated JPEGs."""
        return Bench(
            name,
            "dp",
            (*r50, *bf16, *flags, "--data", jpegs),
            256,
            JPEG_STEPS,
            target,
            versus,
            share,
            data="jpeg",
            **options,
        )

    return [
        Bench(base, "dp", (*r50, *bf16), 256, 80, f">= {TARGETS['bf16']} img/s"),
        Bench("resnet50 float32", "dp", (*r50, *fp32), 256, 50, f">= {TARGETS['float32']} img/s"),
        Bench("vit_b_16 bf16", "dp", vit, 256, 50, "MFU >= 35%"),
        Bench(f"{base}, DDP 1 process", "ddp", (*r50, *bf16), 256, 80, "within 3% of train_dp.py", base, 0.97),
        Bench(f"{base}, bare PyTorch loop", "bare", ("resnet50", "bf16", "channels_last"), 256, 60, "(a reference)"),
        Bench(f"{base}, profile", "dp", (*r50, *bf16), 256, 34, "(the trace)", profile="30:3"),
        jpeg_row(f"{base}, JPEGs, -j auto", (), ">= 90% of synthetic", base, 0.9),
        Bench(f"{base} --compile", "dp", (*r50, *bf16, "--compile"), 256, 80, f">= {TARGETS['bf16 compile']} img/s"),
        jpeg_row(
            f"{base} --compile, JPEGs, --decode gpu", compiled_gpu, ">= 90% of synthetic", f"{base} --compile", 0.9
        ),
        jpeg_row(
            f"{base} --compile, JPEGs, -j auto",
            ("--compile",),
            "(the loader workers' decoding)",
            f"{base} --compile",
            on_request=True,
        ),
        jpeg_row(f"{base}, JPEGs, --decode gpu", decode_gpu, ">= 90% of synthetic", base, 0.9, on_request=True),
        jpeg_row(f"{base}, JPEGs, --decode gpu, profile", decode_gpu, "(the trace)", profile="30:3", on_request=True),
        Bench(
            "resnet50 float32 --channels-last off",
            "dp",
            (*r50, *fp32, "--channels-last", "off"),
            256,
            50,
            "(auto's gain)",
            "resnet50 float32",
            on_request=True,
        ),
        Bench(
            "resnet50 float32, bare PyTorch loop",
            "bare",
            ("resnet50", "none", "contiguous"),
            256,
            45,
            "(a reference)",
            on_request=True,
        ),
        Bench("vit_b_16 bf16 --compile", "dp", (*vit, "--compile"), 256, 90, "MFU >= 35%"),
        Bench("vit_b_16 bf16, profile", "dp", vit, 256, 24, "(the trace)", profile="20:3"),
        Bench(
            "vit_b_16 bf16, bare PyTorch loop",
            "bare",
            ("vit_b_16", "bf16", "contiguous"),
            256,
            45,
            "(a reference)",
            on_request=True,
        ),
        Bench(
            "vit_b_16 bf16 --compile, profile",
            "dp",
            (*vit, "--compile"),
            256,
            24,
            "(the trace)",
            profile="20:3",
            on_request=True,
        ),
        Bench(
            "vit_b_16 bf16 --channels-last on",
            "dp",
            (*vit, "--channels-last", "on"),
            256,
            50,
            "MFU >= 35%",
            on_request=True,
        ),
        Bench(
            "vit_b_16 bf16 --channels-last on, profile",
            "dp",
            (*vit, "--channels-last", "on"),
            256,
            24,
            "(the trace)",
            profile="20:3",
            on_request=True,
        ),
        Bench(
            "vit_b_16 bf16 --compile --channels-last on",
            "dp",
            (*vit, "--compile", "--channels-last", "on"),
            256,
            50,
            "MFU >= 35%",
            on_request=True,
        ),
        Bench("vit_b_16 bf16 --compile, -b 512", "dp", (*vit, "--compile"), 512, 40, "MFU >= 35%", on_request=True),
        jpeg_row(f"{base}, JPEGs, -j 8", ("-j", "8"), "(-j auto's most before)", base, on_request=True),
    ]


def cpu_rows(jpegs):
    tiny = (
        "-a",
        "tests.tiny_models:TinyNet",
        "--train-crop-size",
        "32",
        "--val-resize-size",
        "32",
        "--val-crop-size",
        "32",
        "-j",
        "0",
    )
    return [
        Bench("tiny", "dp", tiny, 8, 12, ">= 1 img/s"),
        Bench("tiny, DDP 1 process", "ddp", tiny, 8, 12, "within 3% of train_dp.py", "tiny", 0.97),
        Bench("tiny, bare loop", "bare", ("tiny", "none", "contiguous"), 8, 12, "(a reference)"),
        Bench("tiny, profile", "dp", tiny, 8, 6, "(the trace)", profile="3:2"),
        Bench("tiny, JPEGs", "dp", (*tiny, "--data", jpegs), 8, 8, ">= 90% of synthetic", "tiny", 0.9, data="jpeg"),
    ]


def selected(rows, only):
    """The rows whose name matches the regular expression `only`; without one, every row not run on request only."""
    return [bench for bench in rows if (re.search(only, bench.name) if only else not bench.on_request)]


def dummy_size(steps, batch, compiled):
    """--dummy-size for about `steps` steps of `batch`. Compiled (the last partial training batch dropped), the
    validation set is a whole number of batches: a batch of another size would compile another graph."""
    images = steps * batch
    if not compiled:
        return images
    # common/datasets.py's validation length of --dummy is ceil(images * 50000 / 1281167): the most images for the
    # nearest whole number of batches.
    batches = max(1, round(images * 50_000 / 1_281_167 / batch))
    return batches * batch * 1_281_167 // 50_000


def at_window_rate(epoch, rate):
    """log.csv's TFLOP/s and MFU of the epoch row `epoch` (the run's own FLOPs and peak) at the window's `rate` instead
    of the epoch's (None where the run has none)."""
    scale = rate / float(epoch["images_per_second"])
    return {name: float(epoch[name]) * scale if epoch.get(name) else None for name in ("tflops_per_device", "mfu_pct")}


def steady(output, batch, within=STEADY_WITHIN):
    """window_figures of a run's output over its steady window, or None where it has none."""
    points = progress_points(output, batch)
    first = steady_start(points, within=within)
    return None if first is None else window_figures(points, first)


def unsteady(points):
    """window_figures over the later half of `points`, for a run with no steady window: marked not steady, with the
    rates of all its intervals (CheckFailed for fewer than two lines in that half)."""
    first = len(points) // 2
    if len(points) - first < 2:
        raise CheckFailed(f"no steady window: {len(points)} progress lines")
    rates = ", ".join(f"{rate:.0f}" for rate in interval_rates(points))
    return {**window_figures(points, first), "steady": False, "rates": rates}


def command(bench, repo, cpu):
    python = sys.executable
    common = ["-b", str(bench.batch), "--epochs", "1", "-p", str(PRINT_FREQ if not cpu else 2), "--seed", "0"]
    if bench.data == "synthetic":
        common += ["--dummy", "--dummy-size", str(dummy_size(bench.steps, bench.batch, "--compile" in bench.args))]
    devices = ["--device", "cpu"] if cpu else ["--gpus", "0"]
    if bench.mode == "dp":
        return [python, Path(repo) / "train_dp.py", *devices, *bench.args, *common]
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        Path(repo) / "train_ddp.py",
        *bench.args,
        *common,
    ]


def job_env(cpu):
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        and not key.startswith("SLURM_")
    }
    env["PYTHONUNBUFFERED"] = "1"
    if cpu:
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def measure(bench, repo, workdir, cpu, timeout):
    """Run `bench`'s script and return its figures over the steady window (CheckFailed where it fails)."""
    if bench.mode == "bare":
        return bare_loop(bench, cpu, timeout)
    out = Path(workdir) / slug(bench.name)
    profile = ["--profile", bench.profile] if bench.profile else []
    out.mkdir(parents=True, exist_ok=True)
    try:
        status, output = run([*command(bench, repo, cpu), *profile, "--output-dir", out], job_env(cpu), timeout)
    except CheckFailed as cut:  # (past its limit: what it printed is what tells why)
        (out / "console.log").write_text(cut.output or "")
        raise
    (out / "console.log").write_text(output)
    if status != 0:
        raise CheckFailed(f"exit status {status}: {output.strip().splitlines()[-1] if output.strip() else ''}")
    if bench.profile:
        return trace_summary(out / "profile" / "rank0.json")
    figures = steady(output, bench.batch, within=CPU_WITHIN if cpu else STEADY_WITHIN)
    if figures is None:  # (the rate still falling at the end: the loader's prefetched batches running out)
        figures = unsteady(progress_points(output, bench.batch))
    with open(out / "log.csv", newline="") as file:
        epoch = list(csv.DictReader(file))[-1]
    summary = json.loads((out / "summary.json").read_text())
    figures.update(at_window_rate(epoch, figures["images_per_second"]))
    figures["epoch_images_per_second"] = float(epoch["images_per_second"])
    figures["gpu_peak_allocated_gib"] = (
        float(epoch["gpu_peak_allocated_mib"]) / 1024 if epoch.get("gpu_peak_allocated_mib") else None
    )
    figures["forward_gflops_per_image"] = summary.get("forward_gflops_per_image")
    return figures


# The host waiting for the GPU: CUDA's calls, and a tensor's value read on the host (.item(), float(), a print).
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
KERNEL_FAMILIES = [  # (family, a regular expression of kernel names), the first that matches; the rest is "other"
    ("compiled (Triton)", r"^triton_"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("batch norm", r"batch_norm|batchnorm|bn_"),
    ("pooling", r"pool"),
    ("convolution (cuDNN)", r"conv|cudnn|xmma|implicit_gemm|wgrad|dgrad|fprop"),
    ("matrix product", r"gemm|cutlass|cublas|matmul|nvjet"),
    ("optimizer", r"multi_tensor|foreach|fused_sgd|fused_adam"),
    ("reduction", r"reduce|softmax|topk|sort|nll|cross_entropy"),
    ("elementwise", r"elementwise|vectorized|unrolled|copy|fill|index"),
]


def trace_summary(path):
    """What a --profile trace shows of its steps: the CPU's time per step, the GPU's busy time and idle share over
    the span of its work, the host's waits for the GPU (syncs and device-to-host copies) per step, and the GPU's
    time by kernel family and by kernel."""
    events = [event for event in json.loads(Path(path).read_text())["traceEvents"] if event.get("ph") == "X"]
    steps = [
        event
        for event in events
        if event.get("name", "").startswith("ProfilerStep#") and event.get("cat") != "gpu_user_annotation"
    ]  # (the GPU's timeline repeats the steps' ranges)
    gpu = sorted(
        (event for event in events if event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda event: event["ts"],
    )
    busy, end = 0.0, None
    for event in gpu:  # the union of the GPU's intervals
        start, stop = event["ts"], event["ts"] + event["dur"]
        if end is None or start > end:
            busy, end = busy + event["dur"], stop
        elif stop > end:
            busy, end = busy + stop - end, stop
    span = (max(e["ts"] + e["dur"] for e in gpu) - gpu[0]["ts"]) if gpu else 0.0
    count = max(len(steps), 1)
    threads = {event.get("tid") for event in steps}  # the training loop's; others: the loader's decode thread
    by_kernel, by_family = {}, {}
    for event in gpu:
        name = event["name"]
        by_kernel[name] = by_kernel.get(name, 0.0) + event["dur"]
        family = next(
            (family for family, pattern in KERNEL_FAMILIES if re.search(pattern, name, re.IGNORECASE)),
            "memory copy" if event["cat"] != "kernel" else "other",
        )
        by_family[family] = by_family.get(family, 0.0) + event["dur"]
    top = sorted(by_kernel.items(), key=lambda item: -item[1])[:12]
    return {
        "steps": len(steps),
        "cpu_ms_per_step": sum(e["dur"] for e in steps) / count / 1000,
        "gpu_busy_ms_per_step": busy / count / 1000,
        "gpu_span_ms_per_step": span / count / 1000,
        "gpu_idle_pct": 100 * (1 - busy / span) if span else None,
        "kernels_per_step": sum(event["cat"] == "kernel" for event in gpu) / count,
        "syncs_per_step": {name: sum(e["name"] == name for e in events) / count for name in SYNCS},
        "syncs_per_step_other_threads": sum(e["name"] in SYNCS and e.get("tid") not in threads for e in events) / count,
        "device_to_host_copies_per_step": sum(e["cat"] == "gpu_memcpy" and "DtoH" in e["name"] for e in gpu) / count,
        "gpu_ms_by_family_per_step": {
            family: round(ms / count / 1000, 3) for family, ms in sorted(by_family.items(), key=lambda item: -item[1])
        },
        "top_kernels_ms_per_step": [(name[:90], round(ms / count / 1000, 3)) for name, ms in top],
    }


def bare_loop(bench, cpu, timeout):
    """The bare loop's figures, from a process of its own (this file with --bare-loop): the GPU's memory its own."""
    arch, amp, layout = bench.args
    status, output = run(
        [
            sys.executable,
            Path(__file__),
            "--bare-loop",
            arch,
            amp,
            layout,
            str(bench.batch),
            str(bench.steps),
            *(["--cpu"] if cpu else []),
        ],
        job_env(cpu),
        timeout,
    )
    found = re.search(r"^bare: (\{.*\})$", output, re.MULTILINE)
    if status != 0 or not found:
        raise CheckFailed(f"exit status {status}: {output.strip().splitlines()[-1] if output.strip() else ''}")
    return json.loads(found[1])


def run_bare_loop(arch, amp, layout, batch, steps, cpu):
    """A plain PyTorch training loop (what a researcher writes in 15 lines: torchvision's model, channels_last,
    autocast, SGD with momentum, cross entropy) on a batch made on the device; images/s over the last 2/3 of the
    steps, timed by CUDA events."""
    import torch
    import torchvision

    device = torch.device("cpu" if cpu else "cuda")
    torch.backends.cudnn.benchmark = True
    model = (
        torchvision.models.get_model(arch, num_classes=1000)
        if not cpu
        else torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 1000)
        )
    )
    layout = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    model = model.to(device, memory_format=layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    size = 32 if cpu else 224
    images = torch.randn(batch, 3, size, size, device=device).contiguous(memory_format=layout)
    target = torch.randint(0, 1000, (batch,), device=device)
    dtype = {"bf16": torch.bfloat16, "none": None}[amp]

    def step():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(images), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    warm = steps // 3
    if not cpu:  # (from the first step, as the Trainer rows' peak: cuDNN's autotuning workspaces included)
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warm):
        step()
    if cpu:
        start = time.perf_counter()
        for _ in range(steps - warm):
            step()
        return {"images_per_second": (steps - warm) * batch / (time.perf_counter() - start)}
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(steps - warm):
        step()
    end.record()
    end.synchronize()
    return {
        "images_per_second": (steps - warm) * batch / (begin.elapsed_time(end) / 1000),
        "gpu_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def _jpeg_chunk(arguments):
    from benchmark import make_jpegs  # (tools/benchmark.py: its photo-like 500x375 JPEGs)

    root, per_class, seed = arguments
    make_jpegs(root, per_class=per_class, classes=1, seed=seed)


def make_jpeg_folder(root, classes, unique_per_class, copies):
    """An ImageFolder of `classes` x `unique_per_class` generated JPEGs (500x375, photo-like), each train image linked
    `copies` times under other names (decoding costs the same; the disk holds one copy); validation 1/8 as many."""
    root = Path(root)
    chunks = root / "chunks"
    with multiprocessing.get_context("fork").Pool(min(classes, os.cpu_count())) as pool:
        pool.map(_jpeg_chunk, [(chunks / str(label), unique_per_class, label) for label in range(classes)])
    for label in range(classes):
        for split in ("train", "val"):
            folder = root / split / f"class{label:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            for index, path in enumerate(sorted((chunks / str(label) / split / "class0").glob("*.jpg"))):
                for copy in range(copies if split == "train" else 1):
                    os.link(path, folder / f"{index:05d}_{copy:02d}.jpg")
    sizes = [path.stat().st_size for path in (root / "train").rglob("*.jpg")]
    return len(sizes), sum(sizes) / len(sizes) / 1024


def environment(cpu):
    import torch
    import torchvision

    facts = {
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
    }
    if not cpu and torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["cuda"] = torch.version.cuda
        facts["cudnn"] = torch.backends.cudnn.version()
        try:
            facts["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                .stdout.strip()
                .splitlines()[0]
            )
        except (OSError, IndexError, subprocess.SubprocessError):
            facts["driver"] = "unknown"
    return facts


def cell(value, form):
    return "-" if value is None else format(value, form)


def share(figures, key):
    """A window's input wait or GPU idle, with how far off the whole percents of the lines may make it."""
    value = figures.get(key)
    return "-" if value is None else f"{value:.0f} ± {figures['share_error_pct']:.1f}"


def met(bench, figures, rows):
    """Whether `bench` reached its target (None where no number decides it); a share of another row's rate is kept
    in figures["versus"]."""
    found = re.match(r"(>= (?P<rate>\d+) img/s)|(MFU >= (?P<mfu>\d+)%)", bench.target)
    if found and found["rate"]:
        return figures["images_per_second"] >= int(found["rate"])
    if found and found["mfu"]:
        return figures.get("mfu_pct") is not None and figures["mfu_pct"] >= int(found["mfu"])
    versus = next(
        (
            row.result.get("images_per_second")
            for row in rows
            if row.name == bench.versus and row.result.get("steady", 1)
        ),
        None,
    )  # (a row that never settled: no base for a share)
    if versus:
        figures["versus"] = figures["images_per_second"] / versus
        return figures["versus"] >= bench.share if bench.share else None
    return None


def table(rows, facts):
    lines = [
        f"GPU benchmark at steady state: {facts.get('gpu', 'CPU (self-test)')}, driver {facts.get('driver', '-')}, "
        f"CUDA {facts.get('cuda', '-')}, cuDNN {facts.get('cudnn', '-')}, torch {facts['torch']}, torchvision "
        f"{facts['torchvision']}, Python {facts['python']}, {facts['usable_cores']} usable CPU cores of "
        f"{facts['cpu_cores']}",
        "",
        "| row | images/s per GPU | measured | left out | TFLOP/s | MFU % | input wait % | GPU idle % | peak GiB "
        "| batch per GPU | expected | reached |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    traces = [bench for bench in rows if bench.profile and "steps" in bench.result]
    for bench in rows:
        f = bench.result
        if bench in traces or not f:  # (not run yet)
            continue
        if "error" in f:
            lines.append(f"| {bench.name} | {f['error']} | | | | | | | | {bench.batch} | {bench.target} | no |")
            continue
        measured = (
            f"{f['measured_images']} images in {f['measured_seconds']:.1f} s (spread {f['spread']:.2f})"
            if "measured_images" in f
            else "CUDA events, last 2/3 of the steps"
        )
        if f.get("steady") is False:
            measured += f"; not steady: the later half (rates {f['rates']})"
        left_out = f"{f['excluded_seconds']:.1f} s" if "excluded_seconds" in f else "-"
        verdict = {True: "yes", False: "NO", None: "-"}[f.get("met")]
        if f.get("versus"):
            verdict += f" ({100 * f['versus']:.0f}% of {bench.versus})"
        lines.append(
            f"| {bench.name} | {f['images_per_second']:.0f} | {measured} | {left_out} | "
            f"{cell(f.get('tflops_per_device'), '.1f')} | {cell(f.get('mfu_pct'), '.1f')} | "
            f"{share(f, 'input_wait_pct')} | {share(f, 'gpu_idle_pct')} | "
            f"{cell(f.get('gpu_peak_allocated_gib'), '.1f')} | {bench.batch} | {bench.target} | {verdict} |"
        )
    for bench in traces:
        f = bench.result
        lines += [
            "",
            f"{bench.name} (--profile {bench.profile}): {f['steps']} steps, CPU {f['cpu_ms_per_step']:.1f} ms "
            f"per step, GPU busy {f['gpu_busy_ms_per_step']:.1f} ms of {f['gpu_span_ms_per_step']:.1f} "
            f"(idle {cell(f['gpu_idle_pct'], '.1f')}%), {f['kernels_per_step']:.0f} kernels, host waits per step: "
            + ", ".join(f"{name} {n:g}" for name, n in f["syncs_per_step"].items())
            + f" ({f['syncs_per_step_other_threads']:g} of them on threads other than the steps': the loader's decode "
            "thread, autograd's), "
            f"device-to-host copies {f['device_to_host_copies_per_step']:g}; GPU busy counts CUDA kernels, copies "
            "and memsets (nvJPEG's hardware decoder, where it is used, is none of them)",
            "",
            "| GPU time by kind | ms per step |",
            "|---|---:|",
        ]
        lines += [f"| {family} | {ms:.2f} |" for family, ms in f["gpu_ms_by_family_per_step"].items()]
        lines += ["", "| kernel | ms per step |", "|---|---:|"]
        lines += [f"| `{name}` | {ms:.2f} |" for name, ms in f["top_kernels_ms_per_step"]]
    return "\n".join(lines)


def keep_run(bench, workdir, out):
    """`bench`'s run's console.log, log.csv, summary.json and trace (gzipped) under `out`/runs/ROW."""
    run_dir, kept = Path(workdir) / slug(bench.name), Path(out) / "runs" / slug(bench.name)
    for name in ("console.log", "log.csv", "summary.json", "profile/rank0.json"):
        if (run_dir / name).is_file():
            kept.mkdir(parents=True, exist_ok=True)
            if name.endswith(".json") and name.startswith("profile/"):
                with open(run_dir / name, "rb") as source, gzip.open(kept / "rank0.json.gz", "wb") as target:
                    shutil.copyfileobj(source, target)
            else:
                shutil.copy(run_dir / name, kept / name)


def slug(name):
    return re.sub(r"[^\w]+", "_", name)


def save(rows, facts, repo, out):
    """The table and the rows' figures so far (after every row: a command cut short keeps what it measured)."""
    write_replacing(out / "table.md", table(rows, facts) + "\n")
    write_replacing(
        out / "rows.json",
        json.dumps({"environment": facts, "repo": repo, "rows": [asdict(bench) for bench in rows]}, indent=1),
    )


def row_limit(cpu, deadline, started):
    """A row's time limit: ROW_LIMIT (--cpu: 300), or what is left before --deadline where less."""
    limit = 300 if cpu else ROW_LIMIT
    return limit if deadline is None else min(limit, round(deadline - (time.monotonic() - started)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__ and __doc__.splitlines()[0])
    parser.add_argument("--only", type=regex, metavar="REGEX", help="only the rows whose name matches")
    parser.add_argument("--repo", default=str(REPO), help="the checkout whose scripts run (default: this one)")
    parser.add_argument(
        "--out",
        default=str(Path(os.environ["OUT"]) / "benchmark-gpu") if os.environ.get("OUT") else "benchmark-gpu",
        help="where the table, the figures and the runs' outputs go (%(default)s)",
    )
    parser.add_argument(
        "--deadline",
        type=seconds,
        default=None,
        help="seconds after which no row starts or runs on (a lease of a GPU machine); default: none",
    )
    parser.add_argument("--cpu", action="store_true", help="self-test of this harness on the CPU (a tiny model)")
    parser.add_argument(
        "--bare-loop", nargs=5, metavar=("ARCH", "AMP", "LAYOUT", "BATCH", "STEPS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if not (Path(args.repo) / "train_dp.py").is_file():  # (else every row failed, the JPEGs made first)
        parser.error(f"--repo {args.repo}: no train_dp.py there: give a checkout of this repository")
    if args.bare_loop:
        arch, amp, layout, batch, steps = args.bare_loop
        print("bare: " + json.dumps(run_bare_loop(arch, amp, layout, int(batch), int(steps), args.cpu)), flush=True)
        return 0
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("benchmark-gpu: no CUDA GPU is visible on this machine: nothing to measure (--cpu tests the harness)")
        return 0
    started, out = time.monotonic(), folder(parser, args.out)
    with scratch("benchmark-gpu-") as workdir:
        every = (cpu_rows if args.cpu else gpu_rows)(str(workdir / "jpegs"))
        rows = selected(every, args.only)
        if not rows:
            no_row(parser, args.only, [bench.name for bench in every])
        return measure_rows(rows, args, started, out, workdir)


def measure_rows(rows, args, started, out, workdir):
    """Each row measured in turn, the table and figures saved to `out` after each; the exit code."""
    facts = environment(args.cpu)
    print(f"benchmark-gpu: {len(rows)} rows, runs in {workdir}, table to {out}", flush=True)
    for bench in rows:
        if bench.data == "jpeg" and not (workdir / "jpegs").is_dir():
            count, size = (
                make_jpeg_folder(workdir / "jpegs", 2, 4, 8)
                if args.cpu
                else make_jpeg_folder(workdir / "jpegs", 16, 64, JPEG_STEPS * 256 // (16 * 64))
            )
            print(
                f"jpegs: {count} train images, {size:.0f} KB on average ({time.monotonic() - started:.0f} s)",
                flush=True,
            )
        begin, limit = time.monotonic(), row_limit(args.cpu, args.deadline, started)  # (after the JPEGs were made)
        if limit < LEAST_FOR_A_ROW:
            bench.result = {"error": f"not run: too near --deadline {args.deadline:g} s", "skipped": True}
            continue
        try:
            bench.result = measure(bench, args.repo, workdir, args.cpu, limit)
            if not bench.profile:  # (a run that never settled: its share of another row said, no verdict)
                reached = met(bench, bench.result, rows)
                bench.result["met"] = reached if bench.result.get("steady", True) else None
        except Exception as error:  # (CheckFailed, or this harness's own: the next rows still run)
            bench.result = {"error": "FAIL: " + (str(error).splitlines() or [type(error).__name__])[0][:200]}
        print(f"{bench.name}: {json.dumps(bench.result)} ({time.monotonic() - begin:.0f} s)", flush=True)
        keep_run(bench, workdir, out)
        save(rows, facts, args.repo, out)
    save(rows, facts, args.repo, out)
    print("\n" + table(rows, facts))
    return 1 if any("error" in bench.result and not bench.result.get("skipped") for bench in rows) else 0


if __name__ == "__main__":
    sys.exit(run_tool(until_stopped(main)))

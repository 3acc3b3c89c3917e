"""What limits a run, said in its own output: the loop's wait for batches, the model's FLOPs, rate and utilisation,
peak memory per epoch, a profiler trace (--profile), and the evidence a GPU job leaves when it dies (an allocator
snapshot on out-of-memory, NCCL's Flight Recorder dump), and the end of a run whose weights went NaN (check_finite).
Nothing reads a value back from the device per step.
"""

import bisect
import contextlib
import os
import re
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from . import distributed
from .config import profile_steps
from .distributed import flight_recorder_files
from .errors import NotFinite, OutOfMemory, Preempted, UsageError, printable
from .models import meta_copy
from .run_dir import atomic_export

# A training epoch that waits longer than this share of its time for batches: said once, with levers.
INPUT_BOUND = 1 / 3

# Dense peak TFLOP/s of a GPU by (16-bit: bf16 or fp16, TF32, fp32) from NVIDIA's data sheets, found by the name
# that torch.cuda.get_device_name gives (the first key in it, as a word: longer names first). --peak-tflops for others.
PEAK_TFLOPS = {
    "H100 PCIe": (756, 378, 51.2),
    "H100 NVL": (835, 418, 60),
    "H100": (989, 494, 67),
    "GH200": (989, 494, 67),
    "H200 NVL": (835, 418, 60),
    "H200": (989, 494, 67),
    "A100": (312, 156, 19.5),
    "L40S": (362, 183, 91.6),
    "L4": (121, 60, 30.3),
    "A10": (125, 62.5, 31.2),
    "V100": (125, 15.7, 15.7),
    "T4": (65, 8.1, 8.1),  # no bf16 or TF32 units: fp16 tensor cores, fp32
}
_END = object()  # the end of an epoch's batches (Diagnostics.timed)
TRAINING_PER_FORWARD = 3  # a training step's FLOPs: the forward, and twice it in backward (activations and weights)
MIB = 2**-20
LEVERS = (
    "more loader workers (-j; {workers} per process now), smaller prepared JPEGs (tools/prepare_imagenet.py "
    "--resize), the data in shards on a shared file system (tools/make_shards.py), fewer or cheaper "
    "augmentations (--auto-augment, --random-erase)"
)


def forward_flops(model, size, channels):
    """FLOPs of one image's forward through `model` (eval mode) at `size` px, counted by torch's FlopCounterMode on
    a copy of it on the meta device: no weight read or copied, nothing computed, and whatever its forward keeps (a
    cache) stays with the copy. (None, why) for a model whose forward fails there."""
    from torch.utils.flop_counter import FlopCounterMode

    try:
        copy = meta_copy(model).eval()  # eval: as torchvision counts (no auxiliary heads, no SyncBN)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            copy(torch.empty(1, channels, size, size, device="meta"))
        return counter.get_total_flops(), None
    except Preempted:  # a stop signal in start-up (launch.py): never taken for the model's failure
        raise
    except Exception as error:  # any forward of a researcher's model: n/a, said once
        return None, (str(error).strip().splitlines() or [type(error).__name__])[0][:160]


def bf16_gradient_risks(model, sizes, channels):
    """[(name, kernel, input size, crop)] of the convolutions of `model` whose weight gradient torch's CPU kernels
    (oneDNN) may get wrong in bf16 at the training crops `sizes`: NaN or garbage, at times, in taps that see padding
    alone, seen for dense convolutions strided across an input 1 pixel wide, their kernel wider (resnet's
    layer4.0.conv1 at 16 px), never in float32. A meta_copy's training forward finds them."""
    inputs, crop = {}, [None]

    def seen(layer, args):  # (the first crop at which each layer takes each input size)
        inputs.setdefault((layer, tuple(args[0].shape[-2:])), crop[0])

    try:
        copy = meta_copy(model).train()
    except Preempted:  # a stop signal in start-up (launch.py): never taken for the model's answer
        raise
    except Exception:  # (a model that cannot be copied: not checked)
        return []
    layers = [layer for layer in copy.modules() if isinstance(layer, nn.Conv2d) and layer.groups == 1]
    hooks = [layer.register_forward_pre_hook(seen) for layer in layers if layer.stride[1] > 1 < layer.kernel_size[1]]
    for crop[0] in sizes:
        try:
            with torch.no_grad():
                copy(torch.empty(2, channels, crop[0], crop[0], device="meta"))
        except Preempted:
            raise
        except Exception:  # (a forward the meta device cannot finish: the layers before it checked)
            pass
    for hook in hooks:
        hook.remove()
    names = {layer: name for name, layer in copy.named_modules()}
    return [
        (names[layer], "x".join(map(str, layer.kernel_size)), "x".join(map(str, shape)), size)
        for (layer, shape), size in inputs.items()
        if shape[1] == 1
    ]


def peak_tflops(given, device, amp):
    """(TFLOP/s, what it is) of one device at this run's precision: --peak-tflops, or PEAK_TFLOPS's by the GPU's
    name; (None, why) on the CPU and unknown GPUs. Float32 runs count TF32's peak when cuDNN or matmuls may use it
    (cuDNN's convolutions do by default)."""
    if given:
        return given, "--peak-tflops"
    if device.type != "cuda":
        return None, "known on the CPU"
    name = torch.cuda.get_device_name(device)
    if "MIG" in name:  # a slice of the GPU: a share of its peak
        return None, f"known for a MIG slice ({name}): --peak-tflops gives one"
    tf32 = torch.backends.cudnn.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
    precision = amp if amp != "none" else "tf32" if tf32 else "fp32"
    peak = peak_by_name(name, precision)
    return (peak, f"{name} at {precision}") if peak else (None, f"known for {name}: --peak-tflops gives one")


def peak_by_name(name, precision):
    """PEAK_TFLOPS's figure for the GPU called `name` at `precision` (bf16, fp16, tf32, fp32), or None."""
    key = next((key for key in PEAK_TFLOPS if re.search(rf"\b{re.escape(key)}\b", name)), None)
    return PEAK_TFLOPS[key][{"bf16": 0, "fp16": 0, "tf32": 1, "fp32": 2}[precision]] if key else None


def peak_rss(pid="self"):
    """A process's peak resident memory (VmHWM) in bytes; None where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as file:
            return next((int(line.split()[1]) * 1024 for line in file if line.startswith("VmHWM:")), None)
    except (OSError, ValueError):
        return None


def reset_peak_rss():
    """Start this process's peak resident memory afresh (Linux: clear_refs 5); elsewhere it stays the lifetime's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def loader_workers():
    """The process ids of this process's loader workers: its children forked from it (the same command line; a
    torch.compile worker's differs)."""
    try:
        own = Path("/proc/self/cmdline").read_bytes()
        children = " ".join(path.read_text() for path in Path("/proc/self/task").glob("*/children")).split()
        return [pid for pid in children if Path(f"/proc/{pid}/cmdline").read_bytes() == own]
    except OSError:
        return []


def input_bound(wait, slowest, world_size, epoch, workers):
    """The line of an epoch whose slowest rank (it holds up all; the others wait in their collectives, not for input)
    waited for its batches over INPUT_BOUND of its time (`wait`: the mean over the ranks, in %), else None."""
    if slowest <= 100 * INPUT_BOUND:
        return None
    ranks = f" (slowest rank {slowest:.0f}%)" if world_size > 1 else ""
    return (
        f"input-bound: the training loop waited for its batches {wait:.0f}% of epoch {epoch}'s time{ranks}, "
        "its devices idle meanwhile; levers: " + LEVERS.format(workers=workers)
    )


class Diagnostics:
    """The figures of one process, gathered over the ranks where the loop reads its metrics: input wait at progress
    lines; per epoch, the achieved TFLOP/s per device (and the utilisation), peak memory; the profiler's steps."""

    def __init__(self, config, runtime, say):
        """Before the model is built: --memory-history records from here, the model's allocations included."""
        self.config, self.runtime, self.say = config, runtime, say
        if config.memory_history and runtime.device.type != "cuda":
            raise UsageError("--memory-history records the CUDA allocator's history: this run is on the CPU")
        if config.memory_history:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.peak, self.peak_source = peak_tflops(config.peak_tflops, runtime.device, config.amp)
        self.flops, self.flops_problem, self.profiler, self.hinted, self.bf16_risks = {}, None, None, None, []
        self.device_idle = DeviceIdle(runtime.device, say) if runtime.device.type == "cuda" else None
        self.waited, self.started, self.worker_rss, self.run_peak, self.last = 0.0, time.perf_counter(), 0, 0, {}

    def count_flops(self, model, channels, counted):
        """The forward FLOPs per image of the bare `model` at each training crop of the run (--res-schedule's);
        `counted`: {crop: FLOPs} already counted (by the size check), not counted again. On the CPU under --amp bf16,
        the convolutions whose bf16 weight gradient torch may get wrong there (bf16_gradient_risks)."""
        schedule = self.config.crop_schedule
        for size in schedule.crops(self.config.epochs) if schedule else [self.config.train_crop_size]:
            known = counted.get(size)
            self.flops[size], problem = (known, None) if known is not None else forward_flops(model, size, channels)
            self.flops_problem = self.flops_problem or problem
        if self.runtime.device.type == "cpu" and self.config.amp == "bf16" and not self.config.evaluate:
            self.bf16_risks = bf16_gradient_risks(model, list(self.flops), channels)

    def crop(self, epoch):
        """The training crop of `epoch`."""
        schedule = self.config.crop_schedule
        return schedule.size(epoch) if schedule else self.config.train_crop_size

    def describe(self, epoch_ends):
        """The header's lines: the FLOPs counted, the peak the utilisation is of, the trace asked; `epoch_ends`: the
        steps of this launch at which its epochs end, in order (where a trace's window ends too; a range)."""
        if self.flops_problem:
            lines = [
                f"FLOPs: n/a (the model's forward does not run on the meta device: {self.flops_problem}); "
                "log.csv's tflops_per_device and mfu_pct stay empty"
            ]
        else:
            counted = ", ".join(f"{flops / 1e9:.4g} G at {size} px" for size, flops in self.flops.items())
            lines = [
                f"FLOPs per image: forward {counted}, training {TRAINING_PER_FORWARD} x that; "
                + (
                    f"peak {self.peak:g} TFLOP/s ({self.peak_source}) for mfu_pct"
                    if self.peak
                    else f"no peak {self.peak_source} (no mfu_pct)"
                )
            ]
        files = self._dump_files()
        if files:
            lines.append(
                f"NCCL Flight Recorder: a collective that times out dumps each rank's last collectives to "
                f"{files}RANK (read them with: torchfrtrace {Path(files).parent})"
            )
        if self.config.profile:
            (start, steps), launch = profile_steps(self.config.profile), epoch_ends[-1]
            cut = epoch_ends[bisect.bisect_right(epoch_ends, start)] if start < launch else None  # (the next epoch end)
            lines.append(
                f"warning: --profile {self.config.profile}: this launch runs {launch} training steps (0 to "
                f"{launch - 1}): no trace will be written; give a START below {launch}"
                if start >= launch
                else f"profile: steps {start} to {min(start + steps, cut) - 1}"
                f" of this launch, one Chrome trace per rank in {self.trace_dir()}"
            )
        return lines

    @staticmethod
    def _dump_files():
        """Where NCCL's Flight Recorder of this run dumps on a timeout (distributed.flight_recorder), or None."""
        return flight_recorder_files() if distributed.backend() == "nccl" else None

    def trace_dir(self):
        return Path(self.config.output_dir) / "profile"

    @contextlib.contextmanager
    def watching(self):
        """Around the training epochs: makes the Flight Recorder's folder, profiles (--profile) from the first step,
        writes a trace still recording at the end, and ends a run out of device memory in one line (out_of_memory)."""
        files = self._dump_files()
        if files:  # (once the output directory is this run's; a dump into a folder that is not there is lost)
            with contextlib.suppress(OSError):
                Path(files).parent.mkdir(parents=True, exist_ok=True)
        if self.config.profile:
            self.profiler = StepProfiler(self.config.profile, self.trace_dir(), self.runtime, self.say)
        try:
            yield
        except torch.OutOfMemoryError as error:
            raise self.out_of_memory(error) from None
        finally:
            if self.profiler is not None:
                self.profiler.stop()
                self.profiler = None

    def start_epoch(self):
        self.waited, self.started, self.worker_rss = 0.0, time.perf_counter(), 0
        if self.device_idle is not None:
            self.device_idle.start_epoch()
        reset_peak_rss()
        if self.runtime.device.type == "cuda":
            self.run_peak = max(self.run_peak, self._gpu_peaks()[0] * MIB)  # the last validation's too
            for device in self.runtime.devices:
                torch.cuda.reset_peak_memory_stats(device)

    def _gpu_peaks(self):
        """(allocated, reserved) bytes at their peak since the last reset, the most of this process's GPUs."""
        stats = (torch.cuda.max_memory_allocated, torch.cuda.max_memory_reserved)
        return tuple(max(stat(device) for device in self.runtime.devices) for stat in stats)

    def timed(self, batches):
        """`batches`, each one's wait (the wall clock around fetching it: no device sync) added to self.waited."""
        iterator, device = iter(batches), self.device_idle
        while True:
            before = time.perf_counter()
            if device is not None:  # (GPU: the previous step's work is queued; its end marked on the GPU's clock)
                device.mark(has_batch=False)
            batch = next(iterator, _END)
            self.waited += time.perf_counter() - before
            if batch is _END:  # (not None: a batch is whatever the loader gives)
                return
            if device is not None:
                device.mark(has_batch=True)
            yield batch

    def after_step(self):
        if self.profiler is not None and self.profiler.step():
            self.profiler = None

    def input_wait(self):
        """(mean %, the progress line's text) over the ranks of the share of this epoch's time spent waiting for
        batches (a collective); the loader workers' peak memory is sampled meanwhile, while they live."""
        self._sample_workers()
        wait, slowest, idle, _ = self._shares()
        return wait, (
            f"input wait {wait:.0f}%"
            + (f", slowest rank {slowest:.0f}%" if self.runtime.world_size > 1 else "")
            + (f"; GPU idle {idle:.0f}%" if idle is not None else "")
        )

    def _sample_workers(self):
        self.worker_rss = max([self.worker_rss, *(peak_rss(pid) or 0 for pid in loader_workers())])

    def _shares(self, *more):
        """(mean, slowest) input wait and mean GPU idle share (None off a GPU) over the ranks, in %, and the largest
        over the ranks of each of `more` (numbers of this rank): one collective."""
        idle = self.device_idle.share() if self.device_idle is not None else None
        mine = [100 * self.waited / max(time.perf_counter() - self.started, 1e-9), -1.0 if idle is None else idle]
        shares = distributed.gathered([*mine, *more], self.runtime.device)
        idle = shares[:, 1].mean().item() if (shares[:, 1] >= 0).all() else None
        return shares[:, 0].mean().item(), shares[:, 0].max().item(), idle, shares[:, 2:].max(dim=0).values.tolist()

    def epoch_figures(self, epoch, images_per_second):
        """log.csv's figures of the epoch that trained at `images_per_second` (all ranks), memory the most any rank
        held (a collective); the first input-bound epoch says so, with the levers."""
        self._sample_workers()
        cuda = self.runtime.device.type == "cuda"  # memory: -1 where not measured
        wait, slowest, idle, memory = self._shares(
            *(self._gpu_peaks() if cuda else (-1, -1)), peak_rss() or -1, self.worker_rss or -1
        )
        flops = self.flops.get(self.crop(epoch))
        devices = self.runtime.world_size * self.runtime.num_devices
        figures = {"input_wait_pct": round(wait, 1), "input_wait_pct_max": round(slowest, 1)}
        if idle is not None:
            figures["gpu_idle_pct"] = round(idle, 1)
        if flops:
            tflops = TRAINING_PER_FORWARD * flops * images_per_second / devices / 1e12
            figures["tflops_per_device"] = float(f"{tflops:.4g}")
            if self.peak:
                figures["mfu_pct"] = float(f"{100 * tflops / self.peak:.4g}")
        names = ("gpu_peak_allocated_mib", "gpu_peak_reserved_mib", "host_peak_rss_mib", "worker_peak_rss_mib")
        for name, value in zip(names, memory):
            if value >= 0:
                figures[name] = round(value * MIB, 1)
        self.run_peak, self.last = max(self.run_peak, figures.get("gpu_peak_allocated_mib", 0)), figures
        if self.profiler is not None and self.profiler.recording:  # its window ends with the training epoch
            self.profiler.stop()
            self.profiler = None
        if not self.hinted and (hint := input_bound(wait, slowest, self.runtime.world_size, epoch, self.workers_now())):
            self.hinted = True
            self.say(hint)
        return figures

    def workers_now(self):
        """-j as the loaders took it: 'auto' with the number it came to (the levers' line said "auto per process")."""
        from .data import loader_workers as workers  # (data.py's: the count; this module's loader_workers: their pids)

        if self.config.workers != "auto":
            return self.config.workers
        return f"auto: {workers('auto', self.runtime.local_world_size)}"

    def summary(self):
        """summary.json's figures: the FLOPs per image (at the last epoch's crop) and the last epoch's rate and
        utilisation. (The run's GPU peak, validations included, is run_peak once this ran.)"""
        if self.runtime.device.type == "cuda":
            self.run_peak = max(self.run_peak, self._gpu_peaks()[0] * MIB)
        flops = self.flops.get(self.crop(self.config.epochs - 1))
        figures = {"forward_gflops_per_image": float(f"{flops / 1e9:.4g}") if flops else None}
        return {**figures, **{name: self.last.get(name) for name in ("tflops_per_device", "mfu_pct")}}

    def out_of_memory(self, error):
        """The one line of a run that ran out of device memory: torch's first line, the allocator's snapshot (a GPU's;
        with --memory-history its allocations' stacks) and the levers."""
        runtime, snapshot = self.runtime, ""
        if runtime.device.type == "cuda":
            path = Path(self.config.output_dir) / "memory" / f"oom-rank{runtime.rank}.pickle"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                atomic_export(path, torch.cuda.memory._dump_snapshot)
                snapshot = f"; the allocator's snapshot in {path} (open it in https://pytorch.org/memory_viz)"
            except Exception as failure:  # the evidence is a bonus: the line still says what happened
                snapshot = f"; no snapshot ({failure})"
        lines = str(error).strip().splitlines() or ["out of memory"]  # (DataParallel: "Caught ... in replica 0" first)
        first = next((line for line in lines if "out of memory" in line.lower()), lines[0])
        return OutOfMemory(
            f"rank {runtime.rank} ran out of {runtime.device.type} memory ({first}){snapshot}; levers: a "
            "smaller -b (--lr-scaling linear scales the lr with it), --amp bf16, train_fsdp.py (shards "
            "weights, gradients and optimizer state) with --activation-checkpointing"
        )


class DeviceIdle:
    """The share of a training epoch the GPU sat idle between steps, on its own clock: CUDA events recorded (never
    waited for) around fetching each batch, read where the loop has synchronised anyway. Off, after one warning, if
    the events fail."""

    def __init__(self, device, say):
        self.device, self.say, self.on = device, say, True
        self.gaps, self.idle_ms, self.begin, self.pending, self.last = [], 0.0, None, None, None

    def start_epoch(self):
        self.gaps, self.idle_ms = [], 0.0
        self.begin = self.pending = self.last = self._event()

    def mark(self, has_batch):
        event = self._event()
        if event is None:
            return
        if has_batch and self.pending is not None:  # the GPU idled from `pending` (a step's end) to here, if at all
            self.gaps.append((self.pending, event))
        self.pending, self.last = (None if has_batch else event), event

    def share(self):
        """% of the epoch's GPU time so far spent idle between steps, or None (off)."""
        if not self.on or self.begin is None:
            return None
        try:
            self.last.synchronize()  # (already done: the loop read its metrics after it)
            self.idle_ms += sum(end.elapsed_time(start) for end, start in self.gaps)
            self.gaps = []
            span = self.begin.elapsed_time(self.last)
            return 100 * self.idle_ms / span if span > 0 else 0.0
        except Exception as error:  # a GPU figure is never worth a run
            return self._off(error)

    def _event(self):
        if not self.on:
            return None
        try:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        except Exception as error:
            return self._off(error)

    def _off(self, error):
        self.on = False
        self.say(f"warning: the GPU's idle share is not measured ({error}); the input wait still is")


def all_threads():
    """profile()'s option to record every thread's operations, not only the main thread's (the loader's decode thread
    of --decode gpu); none where this torch has no such option."""
    try:
        from torch.profiler import _ExperimentalConfig

        return {"experimental_config": _ExperimentalConfig(profile_all_threads=True)}
    except (ImportError, TypeError):
        return {}


class StepProfiler:
    """--profile START:STEPS: torch.profiler (CPU and CUDA, shapes, memory) over steps START to START+STEPS-1 of this
    launch, a Chrome trace per rank. A window that reaches the end of a training epoch (or of the run) ends there."""

    def __init__(self, spec, directory, runtime, say):
        from torch.profiler import ProfilerActivity, profile, schedule

        (self.start, self.steps), self.done, self.written = profile_steps(spec), 0, False
        self.path, self.say = directory / f"rank{runtime.rank}.json", say
        cuda = runtime.device.type == "cuda"
        if not cuda:  # Kineto's "gpuGetDeviceCount failed" of a CUDA build on a machine without a GPU: not an error
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with warnings.catch_warnings():  # (START 0: "won't be using warmup", as asked)
            warnings.simplefilter("ignore")
            steps = schedule(wait=max(self.start - 1, 0), warmup=min(self.start, 1), active=self.steps, repeat=1)
        self.profile = profile(
            activities=activities,
            record_shapes=True,
            profile_memory=True,
            schedule=steps,
            on_trace_ready=self._write,
            **all_threads(),
        )
        self.profile.start()

    # Recording from step START on: once START steps are done (an epoch's end then stops it, whatever it recorded)
    recording = property(lambda self: self.start <= self.done and not self.written)

    def step(self):
        """After each training step; True once the trace is written."""
        self.done += 1
        self.profile.step()
        if self.written:
            self.profile.stop()
        return self.written

    def stop(self):
        self.profile.stop()  # a recording cut short by the run's end is written as far as it got

    def _write(self, profile):
        if self.done <= self.start:  # (stopped before the window's first step ran: an epoch's end, its validation)
            self.written = True
            self.say(
                f"profile: none written: the epoch ended after {self.done} steps of this launch, before step "
                f"{self.start}; a START within an epoch records its steps"
            )
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_export(self.path, profile.export_chrome_trace)
        self.written = True
        self.say(
            f"profile: steps {self.start} to {min(self.done, self.start + self.steps) - 1} in {self.path.parent}/"
            "rank*.json (open in https://ui.perfetto.dev); training goes on"
        )


def check_finite(trainer, epoch, step):
    """Refuse to checkpoint what training cannot mend: a NaN or an infinity in a parameter the optimizer trains (a
    frozen one may hold one on purpose), a BatchNorm statistic (the model's, the EMA's) or the optimizer's state; a
    sharded model's on any rank. The checkpoint would replace the last one. A collective, one read back."""
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    for name, p in trainer.criterion.named_parameters():  # (one the model shares keeps the model's name)
        names.setdefault(id(p), f"the criterion's {name}")
    held = [p for group in trainer.optimizer.param_groups for p in group["params"] if p.requires_grad]
    named, flags = [(names.get(id(p), "a parameter of the optimizer's"), p) for p in held], {}
    named += _statistics(trainer.model)
    if trainer.ema is not None:  # (the EMA's copies of the trained parameters, and its statistics)
        trained = {names.get(id(p)) for p in held}
        named += [(f"the EMA's {n}", p) for n, p in trainer.ema.module.named_parameters() if n in trained]
        named += _statistics(trainer.ema.module, "the EMA's ")
    for parameter, state in trainer.optimizer.state.items():
        for key, value in state.items() if isinstance(state, dict) else ():
            if (type(value) is torch.Tensor or hasattr(value, "to_local")) and value.is_floating_point():
                named.append((f"the optimizer's {key} of {names.get(id(parameter), 'a parameter')}", value))
    for name, tensor in named:  # by device (a model offloaded in part): one stack each
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # (a DTensor: this rank's shard)
        flags.setdefault(local.device, []).append((name, torch.isfinite(local).all()))
    found = []
    for pairs in flags.values():
        finite = torch.stack([flag for _, flag in pairs]).tolist()
        found += [name for (name, _), ok in zip(pairs, finite) if not ok]
    if distributed.max_over_ranks(len(found), trainer.runtime.device):
        where = f"after epoch {epoch - 1}" if not step else f"at epoch {epoch} step {step}"
        what = (found[0] + (f" (and {len(found) - 1} more)" if found[1:] else "")) if found else "another rank's state"
        clip = "" if getattr(trainer.config, "cpu_offload", False) else " or --clip-grad-norm"  # (refused with it)
        raise NotFinite(
            f"{where} {what} is NaN or infinite, which training on cannot mend: the loss diverged (too high an --lr or "
            "--wd, no warmup), or a batch held NaN or infinite values. Nothing of it is saved; the checkpoints in "
            f"{printable(trainer.config.output_dir)}, if any, stay as they were: start again, or resume one whose "
            f"log.csv loss is still sound (--resume auto, checkpoint_prev), with a lower --lr, --warmup-epochs{clip}"
        )


def _statistics(model, prefix=""):
    """(name, tensor) of `model`'s BatchNorm statistics."""
    return [
        (prefix + name, value)
        for name, value in model.named_buffers()
        if name.endswith(("running_mean", "running_var"))
    ]

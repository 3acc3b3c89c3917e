"""common/diagnostics.py: the FLOPs counted on the meta device against torchvision's own figures, the peak of a GPU
by its name, the input wait, the memory read from /proc, the profiler's trace, the out-of-memory line and NCCL's
Flight Recorder settings; and the figures a built Trainer's epoch reports."""

import copy
import json
import math
import mmap
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torchvision
from torch.utils.data import DataLoader

from common import data
from common.diagnostics import (
    INPUT_BOUND,
    Diagnostics,
    StepProfiler,
    check_finite,
    forward_flops,
    input_bound,
    loader_workers,
    peak_by_name,
    peak_rss,
    peak_tflops,
    reset_peak_rss,
)
from common.errors import NotFinite, OutOfMemory, UsageError
from common.models import ModelEma, build_model, check_input_size, ema_update
from conftest import built_trainer, cpu_runtime, parse, tensor_datasets
from tests.torchvision_reference import ExponentialMovingAverage

pytestmark = pytest.mark.usefixtures("no_platform_env")
SMALL = [
    "--train-crop-size",
    "16",
    "--val-resize-size",
    "16",
    "--val-crop-size",
    "16",
    "-j",
    "0",
    "-p",
    "1",
    "--epochs",
    "1",
    "-b",
    "4",
    "--seed",
    "1",
    "-a",
    "tests.tiny_models:TinyNet",
]


@pytest.mark.parametrize("arch", ["resnet50", "vit_b_16", "efficientnet_b0", "convnext_tiny", "swin_t"])
def test_the_forward_flops_counted_on_meta_are_torchvision_s_own_figures(arch):
    """torchvision publishes each model's multiply-adds per 224 px image (weights.meta["_ops"], GFLOPS as it calls
    them): the count here, halved, is within 2% of it (resnet50: 4.089 against 4.089)."""
    model = torchvision.models.get_model(arch)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    flops, problem = forward_flops(model.train(), 224, 3)
    published = torchvision.models.get_model_weights(arch).DEFAULT.meta["_ops"]
    assert problem is None and flops / 2e9 == pytest.approx(published, rel=0.02)
    assert model.training and all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize("arch, size", [("resnet18", 64), ("vit_b_16", 224), ("tests.tiny_models:TinyNet", 16)])
def test_the_size_check_counts_the_validation_crop_s_flops_as_forward_flops_does(arch, size):
    """check_input_size counts the FLOPs of its eval forward at the validation crop (torchvision's models and one of
    yours): the same count as forward_flops's, which a run then does not repeat for that crop."""
    model = build_model(arch, 10)
    assert check_input_size(model, arch, [size], size, 3, 10) == forward_flops(model, size, 3)[0] > 0


def test_a_flop_counter_that_fails_is_no_answer_of_the_size_check(monkeypatch):
    """The counter's own failure in the size check's eval forward: the size is checked again without it, the FLOPs
    not counted (was: --arch resnet18 cannot take 64x64 px images, exit 2); a size it cannot take is still refused."""
    import torch.utils.flop_counter

    def fails(*args, **kwargs):
        raise RuntimeError("a formula of its own that fails")

    monkeypatch.setitem(torch.utils.flop_counter.flop_registry, torch.ops.aten.addmm, fails)
    model = build_model("resnet18", 10)
    assert check_input_size(model, "resnet18", [64], 64, 3, 10) is None
    assert forward_flops(model, 64, 3) == (None, "a formula of its own that fails")
    with pytest.raises(UsageError, match=r"^--arch vit_b_16 cannot take 16x16 px images"):
        check_input_size(build_model("vit_b_16", 10), "vit_b_16", [224], 16, 3, 10)


@pytest.mark.parametrize("arch", ["resnet18", "tests.tiny_models:TinyNet"])
def test_a_run_counts_the_flops_of_the_validation_crop_in_the_size_check_s_forward_not_in_one_more(arch):
    """The size check's forwards on the meta device (torchvision's: training mode at the training crop, then eval at
    the validation crop; yours: eval at the validation crop) count the FLOPs too: a count of its own would be one
    more forward of the whole model at start-up. Another training crop is counted in a forward of its own."""
    forwards = []

    def count(module, args):  # each forward of the model calls its first convolution once
        if isinstance(module, nn.Conv2d) and module.in_channels == 3 and args[0].device.type == "meta":
            forwards.append("train" if module.training else "eval")

    for crop, expected in [("16", ["eval"]), ("8", ["eval", "eval"])]:
        forwards.clear()
        with torch.nn.modules.module.register_module_forward_pre_hook(count):
            trainer = built_trainer(*SMALL, "-a", arch, "--train-crop-size", crop, datasets=tensor_datasets(size=16))
        assert sorted(forwards) == expected + (["train"] if arch == "resnet18" else [])
        assert trainer._diagnostics.flops[int(crop)] == forward_flops(trainer.model, int(crop), 3)[0] > 0


class Tied(nn.Module):
    """Two layers that share one weight (as a language model's embedding and output layer do)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x.mean((2, 3))[:, :1].expand(-1, 8)))


def test_a_model_with_tied_weights_is_counted():
    flops, problem = forward_flops(Tied(), 4, 3)
    assert problem is None and flops == 2 * 2 * 8 * 8


class Caches(nn.Module):
    """A forward that keeps a tensor it makes (a lazily built table, as rotary embeddings keep theirs)."""

    def __init__(self):
        super().__init__()
        self.fc, self.table = nn.Linear(3, 3), None

    def forward(self, x):
        if self.table is None:
            self.table = torch.ones(3, device=x.device)
        return self.fc(x.mean((2, 3))) * self.table


def test_what_a_forward_keeps_stays_with_the_counted_copy():
    model = Caches()
    flops, problem = forward_flops(model, 4, 3)
    assert problem is None and flops == 2 * 3 * 3 and model.table is None
    assert model(torch.ones(1, 3, 4, 4)).device.type == "cpu" and model.table.device.type == "cpu"


class ReadsAValue(nn.Module):
    """A forward that reads a value back (.item()): it cannot run on the meta device."""

    def __init__(self, num_classes=3):
        super().__init__()
        self.fc = nn.Linear(3, num_classes)

    def forward(self, x):
        return self.fc(x.mean((2, 3))) * (1 + 0 * x.sum().item())


def test_a_model_that_cannot_run_on_meta_gets_n_a_said_once_and_no_rate():
    trainer = built_trainer(*SMALL, "-a", "tests.unit.test_diagnostics:ReadsAValue", datasets=tensor_datasets())
    assert trainer._diagnostics.flops == {16: None}
    (line,) = [line for line in trainer._diagnostics.describe([100]) if "FLOPs" in line]
    assert line.startswith("FLOPs: n/a (the model's forward does not run on the meta device:")
    figures = trainer.train_one_epoch(trainer.model, 0)["diagnostics"]
    assert "tflops_per_device" not in figures and "mfu_pct" not in figures and figures["input_wait_pct"] >= 0


def test_a_built_trainer_s_epoch_reports_its_wait_rate_and_memory_and_the_header_its_flops():
    """The rate is 3 x the forward's FLOPs per image at the epoch's crop times the images per second, per device;
    on the CPU no peak, no utilisation, no GPU memory; the host's peak resident memory is this process's."""
    trainer = built_trainer(
        *SMALL, "--res-schedule", "16:32:0:1:16", "--epochs", "2", datasets=tensor_datasets(size=32)
    )
    assert (
        sorted(trainer._diagnostics.flops) == [16, 32]
        and trainer._diagnostics.flops[32] > trainer._diagnostics.flops[16]
    )
    summary = trainer.train_one_epoch(trainer.model, 1)
    figures = summary["diagnostics"]
    expected = 3 * trainer._diagnostics.flops[32] * summary["images_per_second"] / 1e12
    assert figures["tflops_per_device"] == pytest.approx(expected, rel=1e-3, abs=1e-4)
    assert 0 <= figures["input_wait_pct"] <= figures["input_wait_pct_max"] <= 100
    assert figures["host_peak_rss_mib"] > 10 and not {"mfu_pct", "gpu_peak_allocated_mib"} & figures.keys()
    assert trainer._diagnostics.describe([100])[0] == (
        f"FLOPs per image: forward {trainer._diagnostics.flops[16] / 1e9:.4g} G at 16 px, "
        f"{trainer._diagnostics.flops[32] / 1e9:.4g} G at 32 px, training 3 x that; "
        "no peak known on the CPU (no mfu_pct)"
    )


def test_the_rate_is_per_device_of_the_job_and_the_summary_counts_the_last_epoch_s_crop():
    """4 devices (2 processes of 2 GPUs each, as DataParallel in each of 2 processes would be): a quarter of the job's
    rate each. A --res-schedule that ends smaller: summary.json's FLOPs are the last epoch's crop's."""
    config = parse(*SMALL, "--res-schedule", "32:16:0:1:16", "--epochs", "2")
    diagnostics = Diagnostics(config, replace(cpu_runtime(world_size=2), num_devices=2), print)
    diagnostics.count_flops(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), 3, {})
    diagnostics.start_epoch()
    figures = diagnostics.epoch_figures(0, images_per_second=1000.0)
    assert figures["tflops_per_device"] == pytest.approx(3 * diagnostics.flops[32] * 1000.0 / 4 / 1e12, rel=1e-3)
    assert diagnostics.summary()["forward_gflops_per_image"] == pytest.approx(diagnostics.flops[16] / 1e9, rel=1e-3)
    assert diagnostics.flops[16] < diagnostics.flops[32]


def test_the_peak_is_found_by_the_gpu_s_name_at_the_run_s_precision():
    assert peak_by_name("NVIDIA H100 80GB HBM3", "bf16") == 989 and peak_by_name("NVIDIA H100 PCIe", "bf16") == 756
    assert peak_by_name("NVIDIA H200", "tf32") == 494 and peak_by_name("NVIDIA GH200 480GB", "fp32") == 67
    assert peak_by_name("NVIDIA A100-SXM4-80GB", "fp16") == 312 and peak_by_name("NVIDIA A10", "bf16") == 125
    assert peak_by_name("NVIDIA L4", "bf16") == 121 and peak_by_name("NVIDIA L40S", "bf16") == 362
    assert peak_by_name("NVIDIA A10G", "bf16") is None and peak_by_name("NVIDIA GeForce RTX 4090", "bf16") is None
    assert peak_tflops(400.0, torch.device("cpu"), "bf16") == (400.0, "--peak-tflops")
    assert peak_tflops(None, torch.device("cpu"), "bf16")[0] is None


def test_the_input_bound_levers_say_the_loader_workers_auto_came_to():
    """Its line said "-j; auto per process now"; the count is data.loader_workers', as the data line says it."""
    auto = Diagnostics(parse(*SMALL, "-j", "auto"), cpu_runtime(), print).workers_now()
    assert auto == f"auto: {data.loader_workers('auto', 1)}"
    assert Diagnostics(parse(*SMALL, "-j", "3"), cpu_runtime(), print).workers_now() == 3
    assert "(-j; auto: 1 per process now)" in input_bound(60, 60, 1, 0, "auto: 1")


def test_the_wait_is_the_time_spent_fetching_batches_against_the_loop_s():
    diagnostics = Diagnostics(parse(*SMALL), cpu_runtime(), print)
    assert diagnostics.device_idle is None  # a GPU's idle share: CUDA events (make gpu-check)

    def slow(count):
        for index in range(count):
            time.sleep(0.04)
            yield index

    for batches, work, low, high in ((slow(5), 0.0, 85, 100), (range(5), 0.04, 0, 15)):
        diagnostics.start_epoch()
        for _ in diagnostics.timed(batches):
            time.sleep(work)
        wait, said = diagnostics.input_wait()
        assert low <= wait <= high and said == f"input wait {wait:.0f}%"
    assert list(diagnostics.timed([1, None, 2, 0])) == [1, None, 2, 0]  # a batch that is None does not end it


def test_the_first_input_bound_epoch_says_so_once_with_the_levers():
    said = []
    trainer = built_trainer(*SMALL, datasets=tensor_datasets())
    trainer._diagnostics.say = said.append
    for epoch in range(2):
        trainer._diagnostics.start_epoch()
        trainer._diagnostics.waited = 0.9 * (time.perf_counter() - trainer._diagnostics.started + 0.5)
        time.sleep(0.5)
        assert trainer._diagnostics.epoch_figures(epoch, 100.0)["input_wait_pct"] > 100 * INPUT_BOUND
    (line,) = said
    assert line.startswith("input-bound: the training loop waited for its batches") and "epoch 0" in line
    assert all(lever in line for lever in ("-j", "--resize", "make_shards", "--auto-augment"))


def test_peak_resident_memory_is_read_reset_and_found_for_the_loader_workers():
    reset_peak_rss()
    before = peak_rss()
    block = mmap.mmap(-1, 300 * 2**20)  # pages of its own, resident once written, returned when closed
    block[::4096] = b"x" * len(block[::4096])
    assert peak_rss() >= before + 250 * 2**20
    block.close()
    reset_peak_rss()
    assert peak_rss() < before + 250 * 2**20
    loader = iter(DataLoader(range(8), num_workers=1, multiprocessing_context="fork"))
    next(loader)
    workers = loader_workers()
    assert len(workers) == 1 and peak_rss(workers[0]) > 10 * 2**20
    del loader


def test_a_profile_window_that_reaches_an_epoch_s_end_ends_there(tmp_path):
    """--profile 1:5 over an epoch of 3 steps: steps 1 and 2 are written at the epoch's end, before validation."""
    said = []
    profiler = StepProfiler("1:5", tmp_path, cpu_runtime(), said.append)
    for _ in range(3):
        torch.randn(64, 64) @ torch.randn(64, 64)
        profiler.step()
    assert profiler.recording
    profiler.stop()
    events = json.loads((tmp_path / "rank0.json").read_text())["traceEvents"]
    steps = {event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")}
    assert {"ProfilerStep#1", "ProfilerStep#2"} <= steps and "ProfilerStep#0" not in steps
    assert said == [
        f"profile: steps 1 to 2 in {tmp_path}/rank*.json (open in https://ui.perfetto.dev); training goes on"
    ]


def test_a_profile_window_that_starts_at_an_epoch_s_end_records_no_validation_as_a_step(tmp_path):
    """--profile 3:2 over epochs of 3 steps: its step 3 was recorded from the epoch's end on (validation, the
    checkpoint: a step 20 times as long), and a run that ended there wrote a trace of no step. Now none, said."""
    said = []
    profiler = StepProfiler("3:2", tmp_path, cpu_runtime(), said.append)
    for _ in range(3):
        torch.randn(64, 64) @ torch.randn(64, 64)
        profiler.step()
    assert profiler.recording  # (as the epoch's end reads it: it stops the profiler)
    profiler.stop()
    assert not (tmp_path / "rank0.json").exists() and profiler.written
    assert said == [
        "profile: none written: the epoch ended after 3 steps of this launch, before step 3; a START "
        "within an epoch records its steps"
    ]


def test_the_header_says_the_profile_window_this_launch_reaches_or_that_none_is(tmp_path):
    """12 train items, batch 4: 3 steps an epoch, 2 epochs: 6 steps. --profile 50:5 said nothing and wrote no trace."""
    from common.header import training_lines

    for spec, line in (
        (
            "50:5",
            "warning: --profile 50:5: this launch runs 6 training steps (0 to 5): no trace will be "
            "written; give a START below 6",
        ),
        ("4:5", f"profile: steps 4 to 5 of this launch, one Chrome trace per rank in {tmp_path}/profile"),
        ("1:4", "profile: steps 1 to 2 of this launch"),
    ):  # the first epoch's end cuts it
        trainer = built_trainer(
            *SMALL, "--epochs", "2", "--profile", spec, "--output-dir", tmp_path, datasets=tensor_datasets()
        )
        assert any(said.startswith(line) for said in training_lines(trainer)), training_lines(trainer)


def test_a_run_of_ten_billion_epochs_starts_at_once(tmp_path):
    """The header's profile window and the FLOPs counted at each crop of --res-schedule went through every epoch of
    the run: --epochs 9999999999 never finished its start-up."""
    from common.header import training_lines

    trainer = built_trainer(
        *SMALL,
        *("--epochs", "9999999999", "--profile", "4:5", "--res-schedule", "16:32:0:3:16", "--output-dir", tmp_path),
        datasets=tensor_datasets(),
    )
    assert sorted(trainer._diagnostics.flops) == [16, 32]
    assert any(line.startswith("profile: steps 4 to 5 of this launch") for line in training_lines(trainer))


def test_the_profiler_writes_a_trace_of_the_asked_steps_and_the_run_goes_on(tmp_path):
    said = []
    profiler = StepProfiler("2:3", tmp_path / "profile", cpu_runtime(rank=1, world_size=2), said.append)
    written = []
    while not any(written) and len(written) < 10:  # steps 0 to 4: the trace once step 4 is done
        torch.randn(64, 64) @ torch.randn(64, 64)
        written.append(profiler.step())
    assert written == [False] * 4 + [True]
    trace = json.loads((tmp_path / "profile" / "rank1.json").read_text())
    steps = {event["name"] for event in trace["traceEvents"] if event.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"}
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    assert said and "training goes on" in said[0]


def test_the_trace_holds_the_operations_of_other_threads_the_decode_thread_s(tmp_path):
    """--decode gpu's decoding and crops run in the loader's decode thread: the trace must show them."""
    from concurrent.futures import ThreadPoolExecutor

    profiler = StepProfiler("0:2", tmp_path, cpu_runtime(), [].append)
    with ThreadPoolExecutor(1, thread_name_prefix="decode") as pool:
        for _ in range(2):
            pool.submit(lambda: nn.functional.interpolate(torch.rand(1, 3, 8, 8), size=(4, 4))).result()
            torch.randn(8, 8) @ torch.randn(8, 8)
            profiler.step()
    profiler.stop()
    events = json.loads((tmp_path / "rank0.json").read_text())["traceEvents"]
    main = {event["tid"] for event in events if event.get("name") == "aten::mm"}
    resized = {event["tid"] for event in events if event.get("name", "").startswith("aten::upsample")}
    assert resized and main and not resized & main, (resized, main)


def test_running_out_of_memory_ends_the_run_in_one_line_with_the_levers(tmp_path):
    trainer = built_trainer(*SMALL, "--output-dir", tmp_path, datasets=tensor_datasets())
    with pytest.raises(OutOfMemory) as raised:
        with trainer._diagnostics.watching():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    message = str(raised.value)
    assert raised.value.exit_code == 1 and "\n" not in message
    assert message.startswith("rank 0 ran out of cpu memory (CUDA out of memory. Tried to allocate 2.00 GiB)")
    assert all(lever in message for lever in ("-b", "--amp bf16", "train_fsdp.py", "--activation-checkpointing"))
    with pytest.raises(OutOfMemory, match=r"cpu memory \(torch.OutOfMemoryError: CUDA out of memory. Tried"):
        with trainer._diagnostics.watching():  # DataParallel's replica re-raises it with its own first line
            raise torch.OutOfMemoryError(
                "Caught OutOfMemoryError in replica 0 on device 0.\nOriginal Traceback:\n"
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
            )


def test_what_only_a_gpu_has_is_refused_on_the_cpu_and_bad_flags_in_one_line():
    with pytest.raises(UsageError, match="--memory-history records the CUDA allocator's history"):
        built_trainer(*SMALL, "--memory-history", datasets=tensor_datasets())
    for flags, line in (
        (["--profile", "3"], "--profile: expected START:STEPS, whole numbers, STEPS at least 1, got '3'"),
        (["--profile", "a:2"], "--profile: expected START:STEPS, whole numbers, STEPS at least 1, got 'a:2'"),
        (["--profile", "2:0"], "--profile: expected START:STEPS, whole numbers, STEPS at least 1, got '2:0'"),
        (["--peak-tflops", "0"], "--peak-tflops must be positive, got 0.0"),
        (["--peak-tflops", "inf"], "--peak-tflops must be finite, got inf"),
        (["--peak-tflops", "nan"], "--peak-tflops must be positive, got nan"),
    ):
        with pytest.raises(UsageError) as refused:
            parse(*flags)
        assert str(refused.value) == line


def test_one_slow_rank_among_fast_ones_is_input_bound():
    """4 ranks, one waits 80% of the epoch for its batches, the others none (they wait for it in their collectives):
    the mean, 20%, is below the bound; the slowest rank decides, as it holds up all. One rank: its own share."""
    from common.diagnostics import input_bound

    line = input_bound(20.0, 80.0, 4, 3, 8)
    assert (
        line.startswith(
            "input-bound: the training loop waited for its batches 20% of epoch 3's time (slowest rank "
            "80%), its devices idle meanwhile; levers: "
        )
        and "-j" in line
    )
    assert input_bound(30.0, 30.0, 4, 3, 8) is None
    assert input_bound(34.0, 34.0, 1, 0, 8).startswith(
        "input-bound: the training loop waited for its batches 34% of epoch 0's time, its devices idle meanwhile"
    )


def model_with_infinities():
    """A convolution, a BatchNorm, a head, a buffer of -inf (an attention mask's) and a frozen parameter of inf (a
    clamp's): neither is trained, both hold their infinity on purpose."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(36, 2))
    model[2].register_buffer("mask", torch.full((4,), -math.inf))
    model[2].limit = nn.Parameter(torch.full((1,), math.inf), requires_grad=False)
    return model


def run_of(model, ema=False, cpu_offload=False):
    """What check_finite reads of a trainer: its model (and EMA), optimizer (a step taken: its state), flags, device."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.randn(2, 3, 5, 5)).sum().backward()
    optimizer.step()
    return SimpleNamespace(
        model=model,
        ema=ModelEma(model, 0.5) if ema else None,
        optimizer=optimizer,
        criterion=nn.CrossEntropyLoss(),
        config=SimpleNamespace(output_dir="runs/x", cpu_offload=cpu_offload),
        runtime=SimpleNamespace(device=torch.device("cpu")),
    )


def test_a_state_that_training_cannot_mend_ends_the_run_in_one_line_naming_it():
    """A diverged loss leaves NaN weights (tests/test_failures.py runs it), or NaN BatchNorm statistics, EMA weights or
    optimizer state (Adam's second moment overflowed by one huge loss: every update 0 after, the run frozen). Their
    checkpoint would replace the last one. What holds an infinity on purpose, and is not trained, is left alone."""
    check_finite(run_of(model_with_infinities(), ema=True), 2, 0)  # finite where it counts: nothing said
    run = run_of(model_with_infinities())
    run.optimizer.param_groups[0]["params"].pop(0)  # (a weight the optimizer does not train: left alone)
    run.model[0].weight.data[0, 0, 0, 0] = math.inf
    check_finite(run, 2, 0)
    run.optimizer = torch.optim.SGD(run.model.parameters())  # (the frozen limit held too, as build_optimizer may)
    run.optimizer.param_groups[0]["params"].pop(0)
    check_finite(run, 2, 0)
    run = run_of(model_with_infinities(), ema=True)  # a criterion sharing a model's weight: checked by its own name
    run.criterion.scale = run.model[1].weight
    run.ema.module[1].weight.data[0] = math.nan
    with pytest.raises(NotFinite, match=r"^after epoch 1 the EMA's 1\.weight is NaN"):
        check_finite(run, 2, 0)
    for spoil, named in [
        (lambda run: run.model[0].weight.data.__setitem__((0, 0, 0, 0), math.nan), r"0\.weight"),
        (lambda run: run.model[1].running_var.__setitem__(3, math.inf), r"1\.running_var"),
        (lambda run: run.ema.module[0].bias.data.__setitem__(1, -math.inf), r"the EMA's 0\.bias"),
        (
            lambda run: run.optimizer.state[run.model[0].weight]["exp_avg_sq"].fill_(math.inf),
            r"the optimizer's exp_avg_sq of 0\.weight",
        ),
    ]:
        run = run_of(model_with_infinities(), ema=True)
        spoil(run)
        with pytest.raises(NotFinite, match=rf"^after epoch 1 {named} is NaN or infinite, which training on cannot"):
            check_finite(run, 2, 0)
    run = run_of(model_with_infinities())
    run.model[0].bias.data[1] = run.model[0].weight.data[1, 0, 0, 0] = math.nan
    with pytest.raises(NotFinite, match=r"^at epoch 2 step 5 0\.weight \(and 1 more\) .* runs/x, if any, .*--clip-gr"):
        check_finite(run, 2, 5)
    run = run_of(model_with_infinities(), cpu_offload=True)
    run.model[0].bias.data[1] = math.nan
    with pytest.raises(NotFinite, match=r"--warmup-epochs$"):  # (--cpu-offload refuses --clip-grad-norm)
        check_finite(run, 2, 5)
    assert NotFinite.exit_code == 1  # no bad input: the run's own


def test_a_sharded_model_s_state_is_checked_in_this_rank_s_shards(group_of_one):
    from torch.distributed.fsdp import fully_shard

    run = run_of(fully_shard(model_with_infinities()))
    check_finite(run, 1, 0)
    with torch.no_grad():
        run.model[0].weight.to_local()[1, 2, 0, 0] = math.nan  # (a DTensor: its shard, whose isfinite would gather it)
    with pytest.raises(NotFinite, match=r"^after epoch 0 0\.weight is NaN"):
        check_finite(run, 1, 0)


def test_the_ema_is_torchvision_s_and_keeps_an_infinity():
    """ModelEma's update is torchvision's ExponentialMovingAverage's to float rounding, buffers too (torch's lerp made
    an attention mask's -inf NaN, which the EMA's validation then gave as its loss); at decay 0 (adjusted_decay's
    floor) it is the weights, at 1 it stays, -inf kept in each."""
    torch.manual_seed(0)
    model = model_with_infinities()
    emas = {decay: ModelEma(model, decay) for decay in (0.0, 0.75, 1.0)}
    theirs = ExponentialMovingAverage(model, 0.75)
    for update in range(3):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter)) if parameter.requires_grad else None
        model(torch.randn(2, 3, 5, 5))  # (training mode: new BatchNorm statistics)
        if update == 0:  # (AveragedModel's first update copies the weights)
            first = copy.deepcopy(model.state_dict())
        for ema in emas.values():
            ema.after_step(0, epoch=0)
        theirs.update_parameters(model)
    reference = theirs.module.state_dict()
    for decay, expected, tolerance in [(0.0, model.state_dict(), 0), (0.75, reference, 1e-6), (1.0, first, 0)]:
        mine = emas[decay].module.state_dict()
        assert mine.keys() == expected.keys(), decay
        for name, value in expected.items():
            assert torch.allclose(mine[name].double(), value.double(), rtol=tolerance, atol=0), (decay, name)
        assert torch.equal(mine["2.mask"], model[2].mask)  # -inf kept
    # In half precision torchvision's own formula (a fused add rounded by where an element lies: FSDP's shards and
    # DDP's whole tensors differed)
    average, weights = (torch.randn(10007, generator=torch.Generator().manual_seed(seed)) for seed in (1, 2))
    for dtype in (torch.float16, torch.bfloat16):
        whole, pieces = average.to(dtype), list(average.to(dtype).split(7))
        ema_update(0.7)([whole], [weights.to(dtype)], None)
        ema_update(0.7)(pieces, list(weights.to(dtype).split(7)), None)
        expected = 0.7 * average.to(dtype) + (1 - 0.7) * weights.to(dtype)
        assert torch.equal(whole, torch.cat(pieces)) and torch.equal(whole, expected)

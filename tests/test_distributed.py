"""train_ddp.py and train_spawn.py under their real launchers (torchrun, torch.distributed.launch,
mp.spawn) on CPU with gloo: the same trajectory as train_dp.py, the recipe without mixing included (per-image
augmentation, repeated augmentation, the EMA, weight-decay groups); exact validation of 13 images on 1, 2 and 3
processes; one checkpoint writer; resuming under another world size; and no hangs when a rank fails."""

import re
import socket
import time

import pytest
import torch

from common.logger import DIAGNOSTICS
from conftest import EXACT_MODEL, RECIPE, TINY, exact_folder, exact_run, log_rows, single_node_launches
from harness.ahead import ahead, once
from harness.jobs import Job, assert_ok, run_prewarmed, run_script, run_together, script_command, torchrun_command
from harness.processes import PYTHON, REPO, clean_env, free_port
from tests.tiny_models import TinyNet

pytestmark = pytest.mark.e2e
VAL_LINE = re.compile(r" \* Acc@1 (\S+)  Acc@5 (\S+)  Loss (\S+)  \((\d+) images\)")
EMA_LINE = re.compile(r" \* EMA Acc@1 (\S+)  Acc@5 (\S+)  Loss (\S+)  \((\d+) images\)")


def val_lines(output):
    return VAL_LINE.findall(output)


def weights(output_dir, key="state_dict"):
    saved = torch.load(output_dir / "checkpoint.pth", weights_only=True)
    return saved[key] if key == "state_dict" else saved[key]["state_dict"]


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def parameters_moved(before, after):
    """The largest change of a trainable parameter."""
    names = [name for name, _ in TinyNet(num_classes=3).named_parameters()]
    assert names and set(names) <= before.keys() and set(names) <= after.keys()
    return max((after[name].double() - before[name].double()).abs().max().item() for name in names)


def runs_to_their_end(tmp_path_factory):
    """The module's runs that go to their end by themselves: the same run (12 steps of global batch 8, the recipe
    without mixing) in the three launch modes, started through run_scripts/ as a user starts them
    (conftest.single_node_runs, shared with tests/test_run_scripts.py); and, together, the legacy launcher, and
    torchrun and train_ddp.py given what they must refuse (prewarmed: harness.prewarm.Prewarmed). (output dir of the
    three, name -> CompletedProcess)."""
    exact_data, (out, results) = once(exact_folder, tmp_path_factory), once(single_node_launches, tmp_path_factory)
    others = tmp_path_factory.mktemp("launches")
    commands = {
        "legacy": [
            PYTHON,
            "-m",
            "torch.distributed.launch",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            REPO / "train_ddp.py",
            *TINY,
            "--data",
            exact_data,
            "-b",
            "8",
            "--epochs",
            "1",
            "--output-dir",
            others / "legacy",
        ],
        "batch-9": torchrun_command(
            "train_ddp.py", 2, *TINY, "--data", exact_data, "-b", "9", "--output-dir", others / "batch-9"
        ),
        "nccl": script_command(
            "train_ddp.py", *TINY, "--data", exact_data, "--dist-backend", "nccl", "--output-dir", others / "nccl"
        ),
        # The dp trajectory's global batch of 8 as 2 processes x 2 micro-batches of 2, summed before each step.
        "accumulated": torchrun_command(
            "train_ddp.py", 2, *exact_run(exact_data, others / "accumulated", "--grad-accum-steps", "2")
        ),
    }
    results = {**results, **dict(zip(commands, run_together(list(commands.values()))))}
    return out, results, others


launches = ahead(runs_to_their_end, "launches")


@pytest.fixture(scope="module")
def trajectories(launches):
    out, results, _ = launches
    return out, {mode: assert_ok(results[mode]) for mode in ("dp", "ddp", "spawn")}


def test_the_compared_runs_really_train(trajectories):
    """Equal weights prove nothing if training stood still: the loss falls, the weights move, the EMA is no copy of
    them."""
    out, outputs = trajectories
    losses = [float(row.split(",")[4]) for row in (out / "dp" / "log.csv").read_text().splitlines()[1:]]
    assert losses[-1] < losses[0] - 0.02, losses
    torch.manual_seed(3)  # the script's seed: its initial weights
    initial = TinyNet(num_classes=3).state_dict()
    for mode in ("dp", "ddp", "spawn"):
        assert parameters_moved(initial, weights(out / mode)) > 1e-2, mode
        assert max_difference(weights(out / mode), weights(out / mode, "model_ema")) > 1e-4, mode
    assert "spawn: world size 2" in outputs["spawn"]


def test_each_launch_mode_ends_on_its_done_line_with_nothing_after_it(trajectories):
    """The last line of the whole output (stdout and stderr, every process of the job) is ours: no library
    prints at exit (a leak report, a warning) after `done:`. Each run here started as a user starts it."""
    _, outputs = trajectories
    for mode in ("dp", "ddp", "spawn"):
        assert outputs[mode].endswith("\n") and outputs[mode].splitlines()[-1].startswith("done: best acc@1 "), (
            mode,
            outputs[mode][-3000:],
        )


def test_every_launch_mode_reports_its_input_wait_rate_and_memory_reduced_over_its_ranks(trajectories):
    """log.csv's DIAGNOSTICS (common/diagnostics.py) in each mode: the wait's mean and slowest rank, the rate from
    the FLOPs counted at start, the host's peak memory; what only a GPU has stays empty on the CPU."""
    out, outputs = trajectories
    for mode in ("dp", "ddp", "spawn"):
        rows = log_rows(out / mode)
        assert len(rows) == 4 and all(field in rows[0] for field in DIAGNOSTICS), mode
        for row in rows:
            assert 0 <= float(row["input_wait_pct"]) <= float(row["input_wait_pct_max"]) <= 100, (mode, row)
            assert float(row["tflops_per_device"]) > 0 and float(row["host_peak_rss_mib"]) > 50, (mode, row)
            assert not any(row[name] for name in ("gpu_idle_pct", "mfu_pct", "gpu_peak_allocated_mib")), (mode, row)
        assert "FLOPs per image: forward " in outputs[mode], mode
        assert bool(re.search(r"img/s \(input wait \d+%, slowest rank \d+%\)", outputs[mode])) == (mode != "dp"), mode


def test_ddp_and_spawn_end_with_the_weights_and_the_ema_of_dataparallel(trajectories):
    out, _ = trajectories
    for key in ("state_dict", "model_ema"):
        reference = weights(out / "dp", key)
        for mode in ("ddp", "spawn"):
            difference = max_difference(reference, weights(out / mode, key))
            print(f"{mode} {key}: max abs difference to dp = {difference:.3g}")
            assert difference <= 1e-5


def test_gradient_accumulation_under_torchrun_follows_the_trajectory_of_dataparallel(launches, trajectories):
    """--grad-accum-steps 2 on 2 processes (micro-batches of 2, DDP's all-reduce at the second backward alone) ends
    with dp's weights and EMA: -b 8 is the global batch of one optimizer step either way, and steps count those."""
    out, results, others = launches
    output = assert_ok(results["accumulated"])
    assert (
        "gradient accumulation: each optimizer step of global batch 8 sums 2 micro-batches of 2 per process" in output
    )
    assert re.search(r"^Epoch: \[3\] \[3/3\]", output, re.MULTILINE), output[-2000:]  # 12 optimizer steps
    for key in ("state_dict", "model_ema"):
        assert max_difference(weights(out / "dp", key), weights(others / "accumulated", key)) <= 1e-5, key


def test_ddp_and_spawn_print_the_val_metrics_of_dataparallel_each_image_counted_once(trajectories):
    """13 images on 1 and on 2 processes (7 and 6): the same lines, of the weights and of the EMA."""
    _, outputs = trajectories
    for lines_of in (val_lines, EMA_LINE.findall):
        reference = lines_of(outputs["dp"])
        assert len(reference) == 4 and {count for *_, count in reference} == {"13"}
        for mode in ("ddp", "spawn"):
            lines = lines_of(outputs[mode])
            assert [(a1, a5, n) for a1, a5, _, n in lines] == [(a1, a5, n) for a1, a5, _, n in reference]
            assert [float(loss) for *_, loss, _ in lines] == pytest.approx(
                [float(loss) for *_, loss, _ in reference], abs=1e-5
            )


STEP_LINE = re.compile(r"^Epoch: \[(\d+)\] \[ *(\d+)/\d+\]  loss (\S+)  acc@1 +(\S+)", re.M)


def test_training_metrics_are_reduced_over_ranks_and_printed_once(trajectories):
    """Every step line (the loss and acc@1 of the epoch so far, over all ranks): printed once, by rank 0,
    with the values of the single process. 4 decimals are printed: within 1e-5 means the same digits."""
    _, outputs = trajectories
    reference = STEP_LINE.findall(outputs["dp"])
    assert [(epoch, step) for epoch, step, *_ in reference] == [(str(e), str(s)) for e in range(4) for s in (1, 2, 3)]
    for mode in ("ddp", "spawn"):
        lines = STEP_LINE.findall(outputs[mode])
        assert [line[:2] for line in lines] == [line[:2] for line in reference], mode  # once per step
        assert [float(loss) for *_, loss, _ in lines] == pytest.approx(
            [float(loss) for *_, loss, _ in reference], abs=1e-5
        ), mode
        assert [acc1 for *_, acc1 in lines] == [acc1 for *_, acc1 in reference], mode


@pytest.fixture(scope="module")
def second_launches(trajectories, exact_data, tmp_path_factory):
    """From the trajectories' checkpoints, together: -e on 3 processes of DDP's last one (13 images: 5, 4 and 4), and
    its 4th epoch on 1 process from DDP's previous one (epoch 3, written by 2 processes). (output dirs, results)"""
    out, _ = trajectories
    resumed = tmp_path_factory.mktemp("resumed")
    saved = torch.load(out / "ddp" / "checkpoint_prev.pth", weights_only=True)
    assert (saved["epoch"], saved["world_size"]) == (3, 2)
    torch.save(saved, resumed / "checkpoint.pth")
    common = [*TINY, *EXACT_MODEL, *RECIPE, "--data", exact_data]
    results = run_together(
        [
            torchrun_command("train_ddp.py", 3, *common, "-b", "9", "-e", "--resume", out / "ddp" / "checkpoint.pth"),
            torchrun_command(
                "train_ddp.py", 1, *common, "-b", "8", "--output-dir", resumed, "--epochs", "4", "--resume", "auto"
            ),
        ]
    )
    return resumed, results


def test_validation_counts_each_image_once_on_three_processes_too(trajectories, second_launches):
    """-e of DDP's last checkpoint on 3 processes prints the lines DDP printed after its last epoch, for the
    weights and for the EMA: each of the 13 images counted once, the same per-image losses summed in another order."""
    _, outputs = trajectories
    _, (evaluated, _) = second_launches
    output = assert_ok(evaluated)
    assert "ddp: world size 3" in output and "Epoch:" not in output
    for lines_of in (val_lines, EMA_LINE.findall):
        ((acc1, acc5, loss, count),) = lines_of(output)
        last = lines_of(outputs["ddp"])[-1]
        assert (acc1, acc5, count) == (last[0], last[1], "13")
        assert float(loss) == pytest.approx(float(last[2]), rel=1e-6, abs=1e-6)


def test_resume_under_torchrun_with_another_world_size_continues_the_trajectory(trajectories, second_launches):
    """3 epochs on 2 processes (the ddp trajectory's previous checkpoint), then the 4th on 1 process, end where 4
    epochs of DataParallel end (the weights and the EMA)."""
    out, _ = trajectories
    resumed, (_, result) = second_launches
    output = assert_ok(result)
    assert f"resumed from {resumed / 'checkpoint.pth'} (epoch 3)" in output, output[-3000:]
    assert "Epoch: [3]" in output and "Epoch: [2]" not in output and "ddp: world size 1" in output
    assert torch.load(resumed / "checkpoint.pth", weights_only=True)["epoch"] == 4
    for key in ("state_dict", "model_ema"):
        assert max_difference(weights(out / "dp", key), weights(resumed, key)) <= 1e-5


def test_the_legacy_launcher_passes_local_rank_and_trains(launches):
    _, results, others = launches
    output = assert_ok(results["legacy"])
    assert "ddp: world size 2" in output
    assert (others / "legacy" / "checkpoint.pth").exists()


@pytest.mark.faults
@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_rank_that_raises_ends_the_whole_job_quickly(tiny_data, tmp_path, launcher):
    common = [
        *TINY,
        "--data",
        tiny_data,
        "-b",
        "4",
        "--epochs",
        "1",
        "--output-dir",
        tmp_path / "out",
        "-a",
        "tests.tiny_models:FailingNet",
        "-j",
        "2",
    ]  # rank 1 raises at its third step; rank 0 waits
    if launcher == "torchrun":
        command = torchrun_command("train_ddp.py", 2, *common)
    else:
        command = [PYTHON, REPO / "train_spawn.py", *common, "--nproc-per-node", "2", "--master-port", free_port()]
    job = Job(command)
    job.wait_for(re.compile("the failure this test model makes at training step 3"))
    failed = time.monotonic()
    returncode, output = job.finish(timeout=120)
    assert returncode != 0
    # Measured from the failure, not from the start (which takes 10-30 s on a busy 2-core machine).
    # Without the fix, rank 0 waits in its collective for --dist-timeout (30 min); 30 s is ample for
    # the launcher to see the failure and stop the others.
    assert time.monotonic() - failed < 30, output[-3000:]
    assert not job.left_behind, output[-3000:]


def assert_one_line_error(result, expected):
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout[-3000:]
    assert len(lines) == 1 and expected in lines[0], result.stdout[-3000:]
    assert "Traceback" not in result.stdout


SPAWN_REFUSALS = {  # name: (flags, the one error line's text)
    "batch": (["-b", "9", "--nproc-per-node", "2"], "--batch-size 9 is the global batch"),
    "nccl": (["--nproc-per-node", "2", "--dist-backend", "nccl"], "the nccl backend needs CUDA GPUs"),
    "sync-bn": (["--nproc-per-node", "2", "--sync-bn"], "--sync-bn needs GPUs"),
    "port-in-use": (["--nproc-per-node", "2"], "in use; choose another --master-port"),
}


@pytest.fixture(scope="module")
def spawn_refusals(tiny_data, tmp_path_factory):
    """Each refusal of train_spawn.py, each a process of its own (forked from one that imported torch:
    harness.jobs.run_prewarmed); name -> (result, output dir that must not appear)."""
    root = tmp_path_factory.mktemp("spawn-refusals")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = {name: busy.getsockname()[1] if name == "port-in-use" else free_port() for name in SPAWN_REFUSALS}
        runs = [
            [*TINY, "--data", tiny_data, "-b", "8", "--master-port", ports[name], "--output-dir", root / name, *flags]
            for name, (flags, _) in SPAWN_REFUSALS.items()
        ]
        results = run_prewarmed("train_spawn.py", runs)
    return {name: (result, root / name) for name, result in zip(SPAWN_REFUSALS, results)}


@pytest.mark.parametrize("name", SPAWN_REFUSALS)
def test_spawn_refuses_in_one_line_what_cannot_run(spawn_refusals, name):
    """A batch the world size does not divide, a --master-port in use, and what cannot run on this
    CPU machine: one line, exit 2, nothing started, no output dir."""
    result, output_dir = spawn_refusals[name]
    assert_one_line_error(result, SPAWN_REFUSALS[name][1])
    assert not output_dir.exists()


def test_torchrun_workers_reject_a_batch_the_world_size_does_not_divide(launches):
    """torchrun reports a failed worker in its own words and exit code; our line is in there."""
    _, results, out = launches
    result = results["batch-9"]
    assert result.returncode != 0
    assert "error: --batch-size 9 is the global batch and must divide evenly over 2 processes" in result.stdout
    assert 'Traceback (most recent call last):\n  File "' + str(REPO) not in result.stdout
    assert not (out / "batch-9").exists()


def test_ddp_rejects_nccl_without_gpus(launches):
    _, results, out = launches
    assert_one_line_error(results["nccl"], "the nccl backend needs CUDA GPUs")
    assert not (out / "nccl").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_spawn_rejects_more_processes_than_gpus(tiny_data, tmp_path):
    result = run_script(
        "train_spawn.py",
        *TINY,
        "--data",
        tiny_data,
        "--nproc-per-node",
        torch.cuda.device_count() + 1,
        "--output-dir",
        tmp_path / "out",
        env=clean_env(gpu=True),
    )
    assert_one_line_error(result, "needs one GPU per process")

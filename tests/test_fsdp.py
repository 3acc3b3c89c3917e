"""train_fsdp.py under torchrun on CPU with gloo: the trajectory of DDP (and of DataParallel) for the same seed and
global batch, on 2 and 3 processes, sharded block by block with activation checkpointing and asynchronous checkpoints;
validation that counts each image once where the ranks' shards of the validation set differ in length; sharded
checkpoints switched atomically, bitwise resume after a SIGKILL mid-epoch, resume on 3 processes of a 2-process
checkpoint and on 1 of a 3-process one; model_best.pth a plain file that train_dp.py -e evaluates."""

import re
import signal
from subprocess import CompletedProcess

import pytest
import torch

from common.sharded_checkpoint import export
from conftest import EXACT_MODEL, RECIPE, TINY, exact_folder, exact_run, single_node_launches
from harness.ahead import ahead, once
from harness.jobs import Job, assert_ok, script_command, torchrun_command
from harness.processes import PYTHON, REPO, clean_env

pytestmark = pytest.mark.e2e
VAL_LINE = re.compile(r"^ \* Acc@1 (\S+)  Acc@5 (\S+)  Loss (\S+)  \((\d+) images\)", re.M)
EMA_AND_VAL_LINES = re.compile(r"^ \* (?:EMA )?Acc@1 (\S+)  Acc@5 (\S+)  Loss (\S+)  \((\d+) images\)", re.M)
STEP_LINE = re.compile(r"^Epoch: \[(\d+)\] \[ *(\d+)/\d+\]  loss (\S+)", re.M)
# BlockNet (three blocks: three units and the root), global batch 12: 2 steps of the 24 images an epoch, and 13 val
# images that 3 processes hold as 5, 4 and 4, in 2, 1 and 1 batches of 4: FSDP's forward is a collective, so the
# ranks with one batch run an uncounted one beside rank 0's second. Gradient clipping takes the norm over the shards.
BLOCKS = [
    *TINY,
    "-a",
    "tests.tiny_models:BlockNet",
    "--dropout",
    "0",
    "--seed",
    "5",
    "--lr",
    "0.05",
    "-b",
    "12",
    "--model-ema",
    "--model-ema-steps",
    "1",
    "--model-ema-decay",
    "0.8",
    "--clip-grad-norm",
    "0.5",
    "--dist-timeout",
    "60",
]


def finished(jobs, stop=None):
    """name -> CompletedProcess of `jobs` (name -> Job), once each ended; first, stop = (name, line, action): the
    action on that job once it prints a line matching `line`. Every job is killed on the way out."""
    try:
        if stop is not None:
            name, line, action = stop
            jobs[name].wait_for(re.compile(line), timeout=300)
            action(jobs[name])
        return {name: CompletedProcess(job.process.args, *job.finish(timeout=300)) for name, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.kill()


def fsdp_launches(tmp_path_factory):
    """Together: train_fsdp.py on 2 processes with the flags of the DP/DDP/spawn reference runs (TinyNet: the root
    alone is a unit), and the same SIGKILLed at epoch 1 step 3 with a checkpoint every step; BlockNet for 2 epochs on
    1 process of train_dp.py, on 3 of train_fsdp.py (with --activation-checkpointing and --async-checkpoint) and on 2
    with --compile, and 1 epoch on 2 processes (through run_scripts/single_node_ddp.sh with TRAIN_SCRIPT=
    train_fsdp.py). Then together: the killed run resumed; the reference run's flags with --async-checkpoint, stopped
    by SIGTERM from epoch 1 step 1 on; the 2-process checkpoint's second epoch on 3 processes, the 3-process run's first
    checkpoint's on 1; train_dp.py -e of the reference run's model_best.pth. Last, the stopped run restarted.
    (output dir, name -> CompletedProcess, the killed run's saved (epoch, step))."""
    data, out = once(exact_folder, tmp_path_factory), tmp_path_factory.mktemp("fsdp")
    killed = exact_run(data, out / "resumed", "--checkpoint-interval", "1", "--resume", "auto")
    stopped = exact_run(data, out / "restarted", "--async-checkpoint", "--resume", "auto")
    blocks = [*BLOCKS, "--data", data, "--epochs"]
    results = finished(
        {
            "killed": Job(torchrun_command("train_fsdp.py", 2, *killed)),
            "fsdp2": Job(torchrun_command("train_fsdp.py", 2, *exact_run(data, out / "fsdp2"))),
            "dp": Job(script_command("train_dp.py", *blocks, "2", "--output-dir", out / "dp")),
            "blocks3": Job(
                torchrun_command(
                    "train_fsdp.py",
                    3,
                    *blocks,
                    "2",
                    "--activation-checkpointing",
                    "--async-checkpoint",
                    "--output-dir",
                    out / "blocks3",
                )
            ),
            "compiled": Job(
                torchrun_command("train_fsdp.py", 2, *blocks, "2", "--compile", "--output-dir", out / "compiled")
            ),
            # as a user starts it: the DDP launcher of run_scripts/, told to run train_fsdp.py
            "blocks2": Job(
                ["bash", REPO / "run_scripts" / "single_node_ddp.sh", *blocks, "1", "--output-dir", out / "blocks2"],
                clean_env(PYTHON=PYTHON, NPROC_PER_NODE=2, TRAIN_SCRIPT="train_fsdp.py"),
            ),
        },
        # SIGKILL to torchrun and its workers alike: nothing of theirs runs on
        stop=("killed", r"^Epoch: \[1\] \[3/", lambda job: job.kill()),
    )
    # Rank 0's shard of the latest checkpoint damaged (16 bytes flipped): rank 1 checks that file (each rank a share),
    # and both ranks resume from the checkpoint before.
    shard = out / "resumed" / "checkpoint" / "__0_0.distcp"
    damaged, middle = bytearray(shard.read_bytes()), shard.stat().st_size // 2
    damaged[middle : middle + 16] = bytes(byte ^ 0xFF for byte in damaged[middle : middle + 16])
    shard.write_bytes(bytes(damaged))
    saved = torch.load(out / "resumed" / "checkpoint_prev" / "state.pth", weights_only=True)
    results.update(
        finished(
            {
                "stopped": Job(torchrun_command("train_fsdp.py", 2, *stopped)),
                "resumed": Job(torchrun_command("train_fsdp.py", 2, *killed)),
                "grown": Job(
                    torchrun_command(
                        "train_fsdp.py",
                        3,
                        *blocks,
                        "2",
                        "--resume",
                        out / "blocks2" / "checkpoint",
                        "--output-dir",
                        out / "grown",
                    )
                ),
                "shrunk": Job(
                    torchrun_command(
                        "train_fsdp.py",
                        1,
                        *blocks,
                        "2",
                        "--resume",
                        out / "blocks3" / "checkpoint_prev",
                        "--output-dir",
                        out / "shrunk",
                    )
                ),
                "evaluated": Job(
                    script_command(
                        "train_dp.py",
                        *TINY,
                        *EXACT_MODEL,
                        *RECIPE,
                        "--data",
                        data,
                        "-b",
                        "8",
                        "-e",
                        "--resume",
                        out / "fsdp2" / "model_best.pth",
                        "--output-dir",
                        out / "eval",
                    )
                ),
            },
            # torchrun passes it on to its workers: a clean stop
            stop=("stopped", r"^Epoch: \[1\] \[1/", lambda job: job.process.send_signal(signal.SIGTERM)),
        )
    )
    results.update(finished({"restarted": Job(torchrun_command("train_fsdp.py", 2, *stopped))}))
    return out, results, (saved["epoch"], saved["step_in_epoch"])


fsdp_runs = ahead(fsdp_launches, "fsdp_runs")


def exported(tmp_path, checkpoint):
    """The whole weights and the EMA's of a sharded checkpoint, through the export that model_best.pth uses."""
    state = export(checkpoint, tmp_path / f"{checkpoint.parent.name}.pth")
    return state["state_dict"], state["model_ema"]["state_dict"]


def max_difference(a, b):
    assert a.keys() == b.keys() and a
    return max((a[name].double() - b[name].double()).abs().max().item() for name in a)


def log_rows(folder):
    return [row.split(",") for row in (folder / "log.csv").read_text().splitlines()[1:]]


def test_fsdp_follows_the_trajectory_of_ddp_and_ends_with_its_weights_and_ema(fsdp_runs, tmp_path, tmp_path_factory):
    """The reference runs' flags (12 steps of global batch 8, the recipe without mixing) on 2 processes: every
    progress line's loss, every validation line and the final weights and EMA are DDP's (within 1e-5)."""
    out, results, _ = fsdp_runs
    reference_dir, references = once(single_node_launches, tmp_path_factory)
    output, reference = assert_ok(results["fsdp2"]), assert_ok(references["ddp"])
    assert "fsdp: world size 2" in output and "fsdp: units none (the root alone)" in output
    steps, expected = STEP_LINE.findall(output), STEP_LINE.findall(reference)
    assert len(steps) == 12 and [line[:2] for line in steps] == [line[:2] for line in expected]
    assert [float(loss) for *_, loss in steps] == pytest.approx([float(loss) for *_, loss in expected], abs=1e-5)
    lines, expected_lines = VAL_LINE.findall(output), VAL_LINE.findall(reference)
    assert len(lines) == 4 and [line[:2] + line[3:] for line in lines] == [
        line[:2] + line[3:] for line in expected_lines
    ]
    weights, ema = exported(tmp_path, out / "fsdp2" / "checkpoint")
    ddp = torch.load(reference_dir / "ddp" / "checkpoint.pth", weights_only=True)
    assert max_difference(weights, ddp["state_dict"]) <= 1e-5
    assert max_difference(ema, ddp["model_ema"]["state_dict"]) <= 1e-5


def test_sharded_checkpoints_are_directories_behind_links_the_older_ones_removed(fsdp_runs):
    """checkpoint and checkpoint_prev link to the last two complete checkpoints, each a directory of every rank's
    shard, DCP's .metadata and state.pth; nothing else is left in sharded/; model_best.pth is a plain file of the
    weights and the EMA that loads with weights_only=True."""
    out, _, _ = fsdp_runs
    run = out / "fsdp2"
    latest, previous = (run / name for name in ("checkpoint", "checkpoint_prev"))
    assert latest.is_symlink() and previous.is_symlink()
    assert sorted(path.name for path in (run / "sharded").iterdir()) == sorted(
        [latest.resolve().name, previous.resolve().name]
    )
    assert sorted(path.name for path in latest.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pth"]
    assert torch.load(latest / "state.pth", weights_only=True)["epoch"] == 4
    assert torch.load(previous / "state.pth", weights_only=True)["epoch"] == 3
    header, *rows = (run / "log.csv").read_text().splitlines()
    column = header.split(",").index("train_sharded_state_mib")
    from tests.tiny_models import TinyNet  # rank 0's first half of each parameter's rows: weights, gradients, momentum

    held = sum(-(-parameter.shape[0] // 2) * parameter[0].numel() for parameter in TinyNet(3).parameters())
    assert {float(row.split(",")[column]) for row in rows} == {3 * 4 * held / 2**20}
    best = torch.load(run / "model_best.pth", weights_only=True)
    assert {"state_dict", "model_ema", "arch", "classes", "epoch"} <= best.keys() and "optimizer" not in best
    TinyNet(3).load_state_dict(best["state_dict"])


def test_dataparallel_evaluates_the_model_best_pth_that_fsdp_exported(fsdp_runs):
    """train_dp.py -e --resume model_best.pth prints the validation line of the best epoch (each of the 13 images
    once), of the weights and of the EMA."""
    _, results, _ = fsdp_runs
    output, evaluated = assert_ok(results["fsdp2"]), assert_ok(results["evaluated"])
    best = max(VAL_LINE.findall(output), key=lambda line: float(line[0]))
    ((acc1, acc5, loss, count),) = VAL_LINE.findall(evaluated)
    assert (acc1, acc5, count) == (best[0], best[1], "13") and float(loss) == pytest.approx(float(best[2]), abs=1e-5)
    assert re.search(r"^ \* EMA Acc@1 .*\(13 images\)", evaluated, re.M)


def test_a_sigkilled_fsdp_job_resumes_mid_epoch_bitwise(fsdp_runs, tmp_path):
    """The job SIGKILLed at epoch 1 step 3 (torchrun and its workers), its latest checkpoint then damaged (bytes
    flipped in one shard), resumed with --resume auto: the damage is said and the checkpoint before is taken; the run
    ends with bitwise the weights and log of the run that was not interrupted. (On busy cores the kill may land a
    step or an epoch later: any checkpoint will do.)"""
    out, results, (epoch, step) = fsdp_runs
    output = assert_ok(results["resumed"])
    assert 1 <= epoch < 4, (epoch, step)
    assert re.search(
        r"^warning: cannot read checkpoint \S+/checkpoint: corrupt \(its __0_0\.distcp fails its CRC-32 "
        r"check\); resuming from the previous checkpoint \S+/checkpoint_prev$",
        output,
        re.M,
    ), output[-3000:]
    at = f", step {step}" if step else ""
    assert re.search(rf"^resumed from \S+/sharded/e{epoch:04d}-s{step:06d}-\w+ \(epoch {epoch}{at}\)$", output, re.M)
    resumed, reference = (
        exported(tmp_path, out / "resumed" / "checkpoint"),
        exported(tmp_path, out / "fsdp2" / "checkpoint"),
    )
    for mine, theirs in zip(resumed, reference):
        assert all(torch.equal(mine[name], theirs[name]) for name in theirs)
    assert [row[4:7] for row in log_rows(out / "resumed")] == [row[4:7] for row in log_rows(out / "fsdp2")]


def test_a_stopped_fsdp_job_waits_for_its_asynchronous_checkpoint_and_resumes_bitwise(fsdp_runs, tmp_path):
    """SIGTERM to torchrun from epoch 1 step 1 on, with --async-checkpoint: the job stops with a checkpoint after a
    step all ranks agreed on, written before the processes end; relaunched, it starts there and ends as the run that
    was not stopped. (Where the stop lands depends on the machine's load: the test takes it where it was taken.)"""
    out, results, _ = fsdp_runs
    stopped = results["stopped"]
    found = re.search(r"^stopped on SIGTERM: checkpoint of epoch (\d) step (\d) in ", stopped.stdout, re.M)
    assert stopped.returncode != 0 and found, stopped.stdout[-3000:]
    epoch, step = int(found[1]), int(found[2])
    output = assert_ok(results["restarted"])
    assert (f"(epoch {epoch}, step {step})" if step else f"(epoch {epoch})") in output
    steps = [(int(e), int(s)) for e, s, _ in STEP_LINE.findall(output)]
    assert steps and min(steps) == ((epoch, step + 1) if step < 3 else (epoch + 1, 1)), steps  # 3 steps an epoch
    restarted, reference = (
        exported(tmp_path, out / "restarted" / "checkpoint"),
        exported(tmp_path, out / "fsdp2" / "checkpoint"),
    )
    for mine, theirs in zip(restarted, reference):
        assert all(torch.equal(mine[name], theirs[name]) for name in theirs)


def test_blocks_sharded_on_three_processes_follow_dataparallel_each_image_counted_once(fsdp_runs, tmp_path):
    """BlockNet in three units and the root, with --activation-checkpointing, --async-checkpoint and clipping, on 3
    processes whose validation shards differ in batches: DataParallel's losses, validation lines and weights."""
    out, results, _ = fsdp_runs
    output, reference = assert_ok(results["blocks3"]), assert_ok(results["dp"])
    assert "fsdp: units Block x 3, then the root" in output and "--activation-checkpointing on" in output
    lines, expected = EMA_AND_VAL_LINES.findall(output), EMA_AND_VAL_LINES.findall(reference)
    assert {count for *_, count in lines} == {"13"} and len(lines) == 4  # the weights' and the EMA's, 2 epochs
    assert [line[:2] for line in lines] == [line[:2] for line in expected]
    assert [float(line[2]) for line in lines] == pytest.approx([float(line[2]) for line in expected], abs=1e-5)
    weights, ema = exported(tmp_path, out / "blocks3" / "checkpoint")
    dp = torch.load(out / "dp" / "checkpoint.pth", weights_only=True)
    assert (
        max_difference(weights, dp["state_dict"]) <= 1e-5 and max_difference(ema, dp["model_ema"]["state_dict"]) <= 1e-5
    )


def test_a_compiled_sharded_model_trains_as_the_eager_one(fsdp_runs):
    """--compile under FSDP (without dynamic shapes: Inductor failed on FSDP's in backward, torch 2.15 on the CPU):
    DataParallel's losses per epoch and validation lines (compiled kernels round otherwise: within 1e-4)."""
    out, results, _ = fsdp_runs
    output = assert_ok(results["compiled"])
    assert re.search(r"^torch\.compile: \d+ graph\(s\) compiled$", output, re.M)
    assert [float(row[4]) for row in log_rows(out / "compiled")] == pytest.approx(
        [float(row[4]) for row in log_rows(out / "dp")], abs=1e-4
    )
    assert [line[:2] for line in EMA_AND_VAL_LINES.findall(output)] == [
        line[:2] for line in EMA_AND_VAL_LINES.findall(results["dp"].stdout)
    ]


@pytest.mark.parametrize("name, processes", [("grown", 3), ("shrunk", 1)])
def test_a_sharded_checkpoint_resumes_on_another_number_of_processes(fsdp_runs, tmp_path, name, processes):
    """Epoch 1 of BlockNet on 2 processes, then epoch 2 on 3; epoch 1 on 3 processes, then epoch 2 on 1: DCP reshards
    the weights, the EMA and the optimizer state, and each ends where 2 epochs of DataParallel end."""
    out, results, _ = fsdp_runs
    output = assert_ok(results[name])
    assert f"fsdp: world size {processes}" in output and "Epoch: [1]" in output and "Epoch: [0]" not in output
    weights, ema = exported(tmp_path, out / name / "checkpoint")
    dp = torch.load(out / "dp" / "checkpoint.pth", weights_only=True)
    assert (
        max_difference(weights, dp["state_dict"]) <= 1e-5 and max_difference(ema, dp["model_ema"]["state_dict"]) <= 1e-5
    )

"""Failures with real processes and real signals: a run killed or preempted mid-epoch goes on
from its last checkpoint and ends bitwise equal to a run that was never interrupted; torchrun's
elastic restart brings a killed worker back; a stalled rank fails the job; a damaged or unwritable
checkpoint costs nothing already saved."""
import os
import re
import resource
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import PYTHON, REPO, Job as Watched, assert_ok, free_port, make_image_folder, run_script, torchrun

# mobilenet_v3_small keeps learning here and has dropout: resuming must restore the RNG for the
# weights to match. 120 training images, global batch 8: 15 steps an epoch, a checkpoint every 5 steps.
RUN = ["-a", "mobilenet_v3_small", "--train-crop-size", "64", "--val-resize-size", "64", "--val-crop-size", "64",
       "-b", "8", "--epochs", "3", "--seed", "7", "--lr", "0.01", "-p", "1", "--checkpoint-interval", "5"]
KILL_AT = re.compile(r"^Epoch: \[1\] \[ 7/15\]")  # two steps after the checkpoint at epoch 1, step 5
PREEMPTED = 75


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data"), train_per_class=40, val_per_class=4)


def weights(output_dir):
    return torch.load(Path(output_dir) / "checkpoint.pth", weights_only=True)["state_dict"]


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def workers_of(launcher_pid):
    """Process ids of the launcher's children that run a training script."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == launcher_pid and b"train_" in cmdline:
            children.append(int(stat.parent.name))
    return sorted(children)


@pytest.fixture(scope="module")
def uninterrupted(data, tmp_path_factory):
    """The reference runs: single process, and two processes under torchrun."""
    out = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(run_script("train_dp.py", *RUN, "-j", "1", "--data", data, "--output-dir", out / "dp"))
    assert_ok(torchrun("train_ddp.py", 2, *RUN, "-j", "0", "--data", data, "--output-dir", out / "ddp"))
    return {mode: (weights(out / mode),
                   torch.load(out / mode / "checkpoint_prev.pth", weights_only=True)["state_dict"])
            for mode in ("dp", "ddp")}


def test_the_reference_runs_really_train(uninterrupted):
    """Bitwise equality proves nothing if training stood still: the last 5 steps moved the weights."""
    for mode, (final, five_steps_before) in uninterrupted.items():
        moved = max((final[k].double() - five_steps_before[k].double()).abs().max().item()
                    for k in final if final[k].is_floating_point())
        assert moved > 1e-4, mode


def test_a_run_killed_mid_epoch_resumes_and_ends_bitwise_equal(data, uninterrupted, tmp_path):
    command = [PYTHON, REPO / "train_dp.py", *RUN, "-j", "1", "--data", data, "--output-dir", tmp_path,
               "--resume", "auto"]
    first = Watched(command)
    first.wait_for(KILL_AT)
    first.process.send_signal(signal.SIGKILL)
    returncode, _ = first.finish()
    assert returncode == -signal.SIGKILL
    saved = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert saved["epoch"] == 1 and saved["step_in_epoch"] >= 5  # lost: the steps after this one
    returncode, output = Watched(command).finish()
    assert returncode == 0, output[-3000:]
    assert f"(epoch 1, step {saved['step_in_epoch']})" in output
    assert_bitwise_equal(weights(tmp_path), uninterrupted["dp"][0])
    epochs = [line.split(",")[0] for line in (tmp_path / "log.csv").read_text().splitlines()[1:]]
    assert epochs == ["0", "1", "2"]


def test_a_damaged_latest_checkpoint_is_reported_and_the_previous_one_used(data, tmp_path):
    common = [*RUN, "-j", "0", "--data", data, "--output-dir", tmp_path, "--checkpoint-interval", "0"]
    assert_ok(run_script("train_dp.py", *common, "--epochs", "2"))
    latest = tmp_path / "checkpoint.pth"
    latest.write_bytes(latest.read_bytes()[:1000])  # truncated, as by a crash of the storage
    output = assert_ok(run_script("train_dp.py", *common, "--resume", "auto"))
    assert re.search(r"warning: cannot read checkpoint .*checkpoint\.pth: truncated .*resuming from the "
                     r"previous checkpoint .*checkpoint_prev\.pth", output)
    assert "checkpoint_prev.pth (epoch 1)" in output and "Epoch: [1]" in output
    assert torch.load(latest, weights_only=True)["epoch"] == 3


def test_torchrun_restarts_a_killed_worker_and_the_run_ends_as_if_uninterrupted(data, uninterrupted, tmp_path):
    job = Watched([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", REPO / "train_ddp.py", *RUN,
                   "-j", "0", "--data", data, "--output-dir", tmp_path, "--resume", "auto"])
    job.wait_for(KILL_AT)
    workers = workers_of(job.process.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    returncode, output = job.finish()
    assert returncode == 0, output[-3000:]
    assert re.search(r"resumed from .*checkpoint\.pth \(epoch 1, step (5|10)\)", output)
    assert_bitwise_equal(weights(tmp_path), uninterrupted["ddp"][0])


def preempt_and_resume(command, signum, tmp_path, target=None):
    """Send `signum` mid-epoch (to the launcher, or to `target(pid)`), then resume to the end."""
    first = Watched(command)
    first.wait_for(KILL_AT)
    os.kill(target(first.process.pid) if target else first.process.pid, signum)
    returncode, output = first.finish()
    saved = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert saved["epoch"] == 1 and saved["step_in_epoch"] >= 7, output[-2000:]
    assert f"stopped on {signal.Signals(signum).name}: checkpoint of epoch 1 step {saved['step_in_epoch']}" in output
    returncode_after, output_after = Watched(command).finish()
    assert returncode_after == 0, output_after[-3000:]
    # Training is deterministic: a run that silently started over would end with the same weights.
    # The second run must say where it resumed, and train none of the steps done before the signal.
    assert re.search(rf"resumed from .*checkpoint\.pth \(epoch 1, step {saved['step_in_epoch']}\)", output_after), \
        output_after[-3000:]
    trained = [(int(epoch), int(step)) for epoch, step in re.findall(r"^Epoch: \[(\d+)\] \[ *(\d+)/", output_after,
                                                                    re.MULTILINE)]
    assert trained and min(trained) == (1, saved["step_in_epoch"] + 1), trained
    return returncode, output


def test_sigterm_stops_dataparallel_at_a_step_with_a_checkpoint_and_exit_code_75(data, uninterrupted, tmp_path):
    command = [PYTHON, REPO / "train_dp.py", *RUN, "-j", "1", "--data", data, "--output-dir", tmp_path,
               "--resume", "auto"]
    returncode, _ = preempt_and_resume(command, signal.SIGTERM, tmp_path)
    assert returncode == PREEMPTED
    assert_bitwise_equal(weights(tmp_path), uninterrupted["dp"][0])


def test_sigterm_to_torchrun_stops_every_rank_at_the_same_step(data, uninterrupted, tmp_path):
    command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", REPO / "train_ddp.py", *RUN, "-j", "0", "--data", data,
               "--output-dir", tmp_path, "--resume", "auto"]
    returncode, output = preempt_and_resume(command, signal.SIGTERM, tmp_path)
    assert returncode != 0  # torchrun reports its own termination by signal
    assert_bitwise_equal(weights(tmp_path), uninterrupted["ddp"][0])


def test_sigusr1_to_the_spawn_parent_reaches_the_workers(data, uninterrupted, tmp_path):
    command = [PYTHON, REPO / "train_spawn.py", *RUN, "-j", "0", "--data", data, "--output-dir", tmp_path,
               "--resume", "auto", "--nproc-per-node", "2", "--master-port", free_port()]
    returncode, _ = preempt_and_resume(command, signal.SIGUSR1, tmp_path)
    assert returncode == PREEMPTED
    assert_bitwise_equal(weights(tmp_path), uninterrupted["ddp"][0])


def test_a_stalled_rank_fails_the_job_after_the_dist_timeout(data, tmp_path):
    job = Watched([PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{free_port()}", REPO / "train_ddp.py", *RUN, "-j", "0",
                   "--data", data, "--output-dir", tmp_path, "--dist-timeout", "5"])
    job.wait_for(re.compile(r"^Epoch: \[0\] \[ 3/15\]"))
    stalled = workers_of(job.process.pid)[1]
    os.kill(stalled, signal.SIGSTOP)
    start = time.monotonic()
    try:
        returncode, output = job.finish(timeout=120)
    finally:
        for pid in (stalled,):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert returncode != 0
    assert time.monotonic() - start < 60, "the job outlived the stalled rank by more than a minute"
    assert re.search(r"[Tt]imed? ?out", output), output[-3000:]


def limit_file_size(limit):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_checkpoint_that_cannot_be_written_leaves_the_previous_one_intact(data, tmp_path):
    common = [*RUN, "-j", "0", "--data", data, "--output-dir", tmp_path, "--checkpoint-interval", "0"]
    assert_ok(run_script("train_dp.py", *common, "--epochs", "1"))
    before = (tmp_path / "checkpoint.pth").read_bytes()
    # As on a full disk: no file may grow past 64 KiB (a checkpoint is several MB).
    job = Watched([PYTHON, REPO / "train_dp.py", *common, "--resume", "auto"],
                  preexec_fn=limit_file_size(64 * 1024))
    returncode, output = job.finish()
    assert returncode == 1, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "could not write a checkpoint" in lines[0] and "intact" in lines[0], output
    assert "Traceback" not in output
    assert (tmp_path / "checkpoint.pth").read_bytes() == before
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".")]


def test_an_output_dir_of_another_run_is_refused_unless_resume_names_it(data, tmp_path):
    common = ["--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32", "-j", "0",
              "-b", "8", "--epochs", "1", "--output-dir", tmp_path]
    assert_ok(run_script("train_dp.py", *common, "-a", "squeezenet1_1", "--data", data))
    files = {path.name: path.stat().st_mtime_ns for path in tmp_path.iterdir()}
    other_data = make_image_folder(tmp_path.parent / "other", train_per_class=2, val_per_class=1, num_classes=4)
    for other in (["-a", "resnet18", "--data", data], ["-a", "squeezenet1_1", "--data", other_data]):
        result = run_script("train_dp.py", *common, *other)
        assert result.returncode == 2, result.stdout
        assert result.stdout.strip().splitlines() == [line for line in result.stdout.splitlines()
                                                      if "holds checkpoints of another run" in line]
    assert {path.name: path.stat().st_mtime_ns for path in tmp_path.iterdir()} == files


def test_an_output_dir_that_cannot_be_created_is_one_line_and_exit_2(data, tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    result = run_script("train_dp.py", "--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32",
                        "-j", "0", "-b", "8", "--epochs", "1", "--data", data, "--output-dir", tmp_path / "a-file" / "run")
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot write to --output-dir" in errors[0] and "Traceback" not in result.stdout


def test_a_relaunch_that_forgot_resume_is_refused_and_costs_the_run_nothing(data, tmp_path):
    common = ["-a", "tests.tiny_models:TinyNet", "--train-crop-size", "32", "--val-resize-size", "32",
              "--val-crop-size", "32", "-j", "0", "-b", "8", "--epochs", "1", "--data", data, "--output-dir", tmp_path]
    assert_ok(run_script("train_dp.py", *common))
    files = {path.name: path.stat().st_mtime_ns for path in tmp_path.iterdir()}
    result = run_script("train_dp.py", *common)
    assert result.returncode == 2, result.stdout
    assert result.stdout.strip().splitlines() == [
        f"error: {tmp_path} holds a run at epoch 1 step 0: continue it with --resume auto, or start over with "
        "--overwrite (its checkpoints are deleted) or another --output-dir"]
    assert {path.name: path.stat().st_mtime_ns for path in tmp_path.iterdir()} == files
    # A damaged latest checkpoint is no licence to start over: --resume auto would use the previous one.
    saved = (tmp_path / "checkpoint.pth").read_bytes()
    (tmp_path / "checkpoint.pth").write_bytes(saved[:1000])
    result = run_script("train_dp.py", *common)
    assert result.returncode == 2 and re.search(r"holds a run \(checkpoint\.pth(, model_best\.pth)?; the first is "
                                                r"damaged\): continue it with --resume auto", result.stdout), result.stdout
    (tmp_path / "checkpoint.pth").write_bytes(saved)
    # --overwrite starts afresh: nothing of the first run is left to pass for the new one's.
    (tmp_path / "bad_images.txt").write_text("left by the first run\n")
    assert_ok(run_script("train_dp.py", *common, "--overwrite"))
    assert [row.split(",")[0] for row in (tmp_path / "log.csv").read_text().splitlines()] == ["epoch", "0"]
    assert not (tmp_path / "bad_images.txt").exists()
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert (tmp_path / "checkpoint.pth").stat().st_mtime_ns > files["checkpoint.pth"]

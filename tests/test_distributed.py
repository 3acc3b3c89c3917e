"""train_ddp.py and train_spawn.py under their real launchers (torchrun, torch.distributed.launch,
mp.spawn) on CPU with gloo: the same trajectory as train_dp.py, exact validation, one checkpoint
writer, resuming under another world size, and no hangs when a rank fails."""
import re
import socket
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import (PYTHON, REPO, TINY, Job, assert_ok, clean_env, free_port, make_image_folder,
                      run_prewarmed, run_script, run_together, script_command, torchrun, torchrun_command)
from tests.tiny_models import TinyNet

# BatchNorm-free and dropout-free, so that per-process statistics and masks cannot differ.
EXACT_MODEL = ["-a", "tests.tiny_models:TinyNet", "--dropout", "0", "--seed", "3", "--lr", "0.05"]
VAL_LINE = re.compile(r" \* Acc@1 (\S+)  Acc@5 (\S+)  Loss (\S+)  \((\d+) images\)")


def val_lines(output):
    return VAL_LINE.findall(output)


def weights(output_dir):
    return torch.load(output_dir / "checkpoint.pth", weights_only=True)["state_dict"]


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def parameters_moved(before, after):
    """The largest change of a trainable parameter (BatchNorm's running statistics, which forward
    passes alone change, do not count)."""
    names = [name for name, _ in TinyNet(num_classes=3).named_parameters()]
    assert names and set(names) <= before.keys() and set(names) <= after.keys()
    return max((after[name].double() - before[name].double()).abs().max().item() for name in names)


@pytest.fixture(scope="module")
def thirteen_val_images(tmp_path_factory):
    """A val set of 13 images, which no world size of 2 or 3 divides, and weights to evaluate (a
    seeded TinyNet: per-image losses differ, which is all the sums below need)."""
    root = make_image_folder(tmp_path_factory.mktemp("val13"), train_per_class=4, val_per_class=5)
    for extra in sorted((root / "val").rglob("*.jpg"))[:2]:
        extra.unlink()
    torch.manual_seed(0)
    checkpoint = root.parent / "tinynet.pth"
    torch.save(TinyNet(num_classes=3).state_dict(), checkpoint)
    return root, checkpoint


@pytest.fixture(scope="module")
def one_colour_images(tmp_path_factory):
    """24 training images of 3 classes, each filled with a grey of its own (5, 15, ..., 235), as PNGs (lossless):
    whatever the crop, flip and resize, an image's pixels tell which image it is."""
    root = tmp_path_factory.mktemp("one-colour")
    for index in range(24):
        for split, count in (("train", 24), ("val", 3)):
            if index < count:
                folder = root / split / f"class{index % 3}"
                folder.mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (40, 40), (5 + 10 * index,) * 3).save(folder / f"{index:02d}.png")
    return root


ORDER_RUN = [*TINY, "-a", "tests.tiny_models:OrderRecorder", "-b", "8", "--seed", "5"]


@pytest.fixture(scope="module")
def launches(tiny_data, thirteen_val_images, one_colour_images, tmp_path_factory):
    """The module's runs that go to their end by themselves, started together (most of their time is
    spent starting processes): the same run (12 steps of global batch 8) in the three launch modes
    (spawn meets through a file:// rendezvous; --master-port is used by the launches of test_run_scripts
    and test_failures); -e of the 13 images by 1, 2 and 3 processes; the legacy launcher; and torchrun and
    train_ddp.py given what they must refuse. The compared runs start as a user starts them (the others
    are prewarmed: conftest.Prewarmed). (output dir, name -> CompletedProcess)."""
    out = tmp_path_factory.mktemp("launches")
    common = [*TINY, *EXACT_MODEL, "--data", tiny_data, "-b", "8", "--epochs", "4"]
    root, checkpoint = thirteen_val_images
    evaluate = [*TINY, "-a", "tests.tiny_models:TinyNet", "--data", root, "-b", "6", "-e", "--resume", checkpoint]
    commands = {
        "dp": script_command("train_dp.py", *common, "--output-dir", out / "dp", as_user=True),
        "ddp": torchrun_command("train_ddp.py", 2, *common, "--output-dir", out / "ddp"),
        "spawn": script_command("train_spawn.py", *common, "--nproc-per-node", "2",
                                "--dist-url", f"file://{out}/rendezvous", "--output-dir", out / "spawn", as_user=True),
        "evaluate-1": script_command("train_dp.py", *evaluate),
        "evaluate-2": torchrun_command("train_ddp.py", 2, *evaluate),
        "evaluate-3": torchrun_command("train_ddp.py", 3, *evaluate),
        "legacy": [PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={free_port()}",
                   REPO / "train_ddp.py", *TINY, "--data", tiny_data, "-b", "8", "--epochs", "1",
                   "--output-dir", out / "legacy"],
        "batch-9": torchrun_command("train_ddp.py", 2, *TINY, "--data", tiny_data, "-b", "9", "--output-dir",
                                    out / "batch-9"),
        "nccl": script_command("train_ddp.py", *TINY, "--data", tiny_data, "--dist-backend", "nccl", "--output-dir",
                               out / "nccl"),
        **{f"order-{epochs}": (torchrun_command("train_ddp.py", 2, *ORDER_RUN, "--data", one_colour_images,
                                                "--epochs", epochs, "--output-dir", out / f"order-{epochs}"),
                               clean_env(ORDER_LOG=out / f"order-{epochs}.log")) for epochs in (3, 1)},
    }
    return out, dict(zip(commands, run_together(list(commands.values()))))


@pytest.fixture(scope="module")
def trajectories(launches):
    out, results = launches
    return out, {mode: assert_ok(results[mode]) for mode in ("dp", "ddp", "spawn")}


def test_the_compared_runs_really_train(trajectories):
    """Equal weights prove nothing if training stood still: the loss falls and the weights move."""
    out, outputs = trajectories
    losses = [float(row.split(",")[4]) for row in (out / "dp" / "log.csv").read_text().splitlines()[1:]]
    assert losses[-1] < losses[0] - 0.02, losses
    torch.manual_seed(3)  # the script's seed: its initial weights
    initial = TinyNet(num_classes=3).state_dict()
    for mode in ("dp", "ddp", "spawn"):
        assert parameters_moved(initial, weights(out / mode)) > 1e-2, mode
    assert "spawn: world size 2" in outputs["spawn"]


def test_each_launch_mode_ends_on_its_done_line_with_nothing_after_it(trajectories):
    """The last line of the whole output (stdout and stderr, every process of the job) is ours: no library
    prints at exit (a leak report, a warning) after `done:`. Each run here started as a user starts it."""
    _, outputs = trajectories
    for mode in ("dp", "ddp", "spawn"):
        assert outputs[mode].endswith("\n") and outputs[mode].splitlines()[-1].startswith("done: best acc@1 "), (
            mode, outputs[mode][-3000:])


def test_ddp_and_spawn_end_with_the_weights_of_dataparallel(trajectories):
    out, _ = trajectories
    reference = weights(out / "dp")
    for mode in ("ddp", "spawn"):
        difference = max_difference(reference, weights(out / mode))
        print(f"{mode}: max abs weight difference to dp = {difference:.3g}")
        assert difference <= 1e-5


def test_ddp_and_spawn_print_the_val_metrics_of_dataparallel(trajectories):
    _, outputs = trajectories
    reference = val_lines(outputs["dp"])
    assert len(reference) == 4
    for mode in ("ddp", "spawn"):
        lines = val_lines(outputs[mode])
        assert [(a1, a5, n) for a1, a5, _, n in lines] == [(a1, a5, n) for a1, a5, _, n in reference]
        assert [float(loss) for *_, loss, _ in lines] == pytest.approx(
            [float(loss) for *_, loss, _ in reference], abs=1e-5)


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
            [float(loss) for *_, loss, _ in reference], abs=1e-5), mode
        assert [acc1 for *_, acc1 in lines] == [acc1 for *_, acc1 in reference], mode


def test_validation_counts_each_image_once_whatever_the_world_size(launches):
    _, results = launches
    single = val_lines(assert_ok(results["evaluate-1"]))
    assert len(single) == 1 and single[0][3] == "13"
    for world_size in (2, 3):
        lines = val_lines(assert_ok(results[f"evaluate-{world_size}"]))
        assert len(lines) == 1
        acc1, acc5, loss, count = lines[0]
        assert (acc1, acc5, count) == (single[0][0], single[0][1], "13")
        # The same per-image losses, summed in another order: equal to float precision.
        assert float(loss) == pytest.approx(float(single[0][2]), rel=1e-6, abs=1e-6)


def test_resume_under_torchrun_with_another_world_size_continues_the_trajectory(
        tiny_data, trajectories, tmp_path):
    """3 epochs on 2 processes (the ddp trajectory's previous checkpoint), then the 4th on 1 process,
    end where 4 epochs of DataParallel end."""
    out, _ = trajectories
    saved = torch.load(out / "ddp" / "checkpoint_prev.pth", weights_only=True)
    assert (saved["epoch"], saved["world_size"]) == (3, 2)
    torch.save(saved, tmp_path / "checkpoint.pth")
    output = assert_ok(torchrun("train_ddp.py", 1, *TINY, *EXACT_MODEL, "--data", tiny_data, "-b", "8",
                                "--output-dir", tmp_path, "--epochs", "4", "--resume", "auto"))
    assert f"resumed from {tmp_path / 'checkpoint.pth'} (epoch 3)" in output, output[-3000:]
    assert "Epoch: [3]" in output and "Epoch: [2]" not in output and "ddp: world size 1" in output
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"] == 4
    assert max_difference(weights(out / "dp"), weights(tmp_path)) <= 1e-5


def training_order(log_prefix, rank, steps_per_epoch=3):
    """[[image numbers of each step] of each epoch] that rank `rank` trained on (tests.tiny_models.OrderRecorder's
    log: the grey 5 + 10 i of image i)."""
    steps = [[(int(value) - 5) // 10 for value in line.split()]
             for line in Path(f"{log_prefix}.rank{rank}").read_text().splitlines()]
    return [steps[start:start + steps_per_epoch] for start in range(0, len(steps), steps_per_epoch)]


@pytest.fixture(scope="module")
def resumed_order(launches, one_colour_images):
    """The 1-epoch run of `launches` continued to 3 epochs with --resume auto (its log goes on)."""
    out, results = launches
    assert_ok(results["order-1"])
    assert_ok(torchrun("train_ddp.py", 2, *ORDER_RUN, "--data", one_colour_images, "--epochs", "3", "--resume", "auto",
                       "--output-dir", out / "order-1", env=clean_env(ORDER_LOG=out / "order-1.log")))
    return out / "order-1.log"


def test_each_epoch_trains_in_a_new_order_and_a_resumed_run_in_the_uninterrupted_one(launches, resumed_order):
    """sampler.set_epoch(epoch): every epoch is a new shuffle of all the images, the same on every rank's
    side (the ranks' shards together cover each image once); a run resumed at epoch 1 trains epochs 1 and 2
    in the order of the run that was not interrupted."""
    out, results = launches
    assert_ok(results["order-3"])
    uninterrupted = [training_order(out / "order-3.log", rank) for rank in (0, 1)]
    for rank in (0, 1):
        assert len(uninterrupted[rank]) == 3 and all(len(step) == 4 for epoch in uninterrupted[rank] for step in epoch)
    epochs = [[image for rank in (0, 1) for step in uninterrupted[rank][epoch] for image in step] for epoch in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(24)), epochs  # every image once per epoch
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2], epochs
    resumed = [training_order(resumed_order, rank) for rank in (0, 1)]
    assert resumed == uninterrupted


def test_the_legacy_launcher_passes_local_rank_and_trains(launches):
    out, results = launches
    output = assert_ok(results["legacy"])
    assert "ddp: world size 2" in output
    assert (out / "legacy" / "checkpoint.pth").exists()


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_rank_that_raises_ends_the_whole_job_quickly(tiny_data, tmp_path, launcher):
    common = [*TINY, "--data", tiny_data, "-b", "4", "--epochs", "1", "--output-dir", tmp_path / "out",
              "-a", "tests.tiny_models:FailingNet", "-j", "2"]  # rank 1 raises at its third step; rank 0 waits
    if launcher == "torchrun":
        command = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint=127.0.0.1:{free_port()}", REPO / "train_ddp.py", *common]
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
    conftest.run_prewarmed); name -> (result, output dir that must not appear)."""
    root = tmp_path_factory.mktemp("spawn-refusals")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        ports = {name: busy.getsockname()[1] if name == "port-in-use" else free_port() for name in SPAWN_REFUSALS}
        runs = [[*TINY, "--data", tiny_data, "-b", "8", "--master-port", ports[name], "--output-dir", root / name, *flags]
                for name, (flags, _) in SPAWN_REFUSALS.items()]
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
    out, results = launches
    result = results["batch-9"]
    assert result.returncode != 0
    assert "error: --batch-size 9 is the global batch and must divide evenly over 2 processes" in result.stdout
    assert "Traceback (most recent call last):\n  File \"" + str(REPO) not in result.stdout
    assert not (out / "batch-9").exists()


def test_ddp_rejects_nccl_without_gpus(launches):
    out, results = launches
    assert_one_line_error(results["nccl"], "the nccl backend needs CUDA GPUs")
    assert not (out / "nccl").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_spawn_rejects_more_processes_than_gpus(tiny_data, tmp_path):
    result = run_script("train_spawn.py", *TINY, "--data", tiny_data, "--nproc-per-node",
                        torch.cuda.device_count() + 1, "--output-dir", tmp_path / "out",
                        env=clean_env(gpu=True))
    assert_one_line_error(result, "needs one GPU per process")

"""train_ddp.py and train_spawn.py under their real launchers (torchrun, torch.distributed.launch,
mp.spawn) on CPU with gloo: the same trajectory as train_dp.py, exact validation, one checkpoint
writer, resuming under another world size, and no hangs when a rank fails."""
import re
import subprocess
import time

import pytest
import torch

from conftest import (PYTHON, REPO, TINY, assert_ok, clean_env, free_port, make_image_folder, run,
                      run_script, torchrun)

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


@pytest.fixture(scope="module")
def trajectories(tiny_data, tmp_path_factory):
    """The same run (12 steps of global batch 8) in the three launch modes."""
    out = tmp_path_factory.mktemp("trajectories")
    common = [*TINY, *EXACT_MODEL, "--data", tiny_data, "-b", "8", "--epochs", "4"]
    results = {
        "dp": run_script("train_dp.py", *common, "--output-dir", out / "dp"),
        "ddp": torchrun("train_ddp.py", 2, *common, "--output-dir", out / "ddp"),
        "spawn": run_script("train_spawn.py", *common, "--nproc-per-node", "2", "--master-port", free_port(),
                            "--output-dir", out / "spawn"),
    }
    return out, {mode: assert_ok(result) for mode, result in results.items()}


def test_the_compared_runs_really_train(trajectories):
    """Equal weights prove nothing if training stood still: the loss falls and the weights move."""
    import sys
    sys.path.insert(0, str(REPO))
    from tests.tiny_models import TinyNet
    out, _ = trajectories
    losses = [float(row.split(",")[4]) for row in (out / "dp" / "log.csv").read_text().splitlines()[1:]]
    assert losses[-1] < losses[0] - 0.02, losses
    torch.manual_seed(3)  # the script's seed: its initial weights
    initial = TinyNet(num_classes=3).state_dict()
    assert max_difference(initial, weights(out / "dp")) > 1e-2


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


def test_training_metrics_are_reduced_over_ranks_and_printed_once(trajectories):
    _, outputs = trajectories
    progress = re.compile(r"^Epoch: \[0\] \[3/3\]  loss (\S+)  acc@1 +(\S+)", re.M)
    assert len(progress.findall(outputs["ddp"])) == 1  # rank 0 alone prints
    assert progress.findall(outputs["ddp"])[0][1] == progress.findall(outputs["dp"])[0][1]


@pytest.fixture(scope="module")
def thirteen_val_images(tmp_path_factory):
    """A val set of 13 images, which no world size of 2 or 3 divides, and a trained checkpoint."""
    root = make_image_folder(tmp_path_factory.mktemp("val13"), train_per_class=4, val_per_class=5)
    for extra in sorted((root / "val").rglob("*.jpg"))[:2]:
        extra.unlink()
    out = tmp_path_factory.mktemp("val13-run")
    assert_ok(run_script("train_dp.py", *TINY, "--data", root, "-b", "6", "--epochs", "1", "--seed", "0", "--lr", "0.01",
                         "--output-dir", out))
    return root, out / "checkpoint.pth"


def test_validation_counts_each_image_once_whatever_the_world_size(thirteen_val_images):
    root, checkpoint = thirteen_val_images
    evaluate = [*TINY, "--data", root, "-b", "6", "-e", "--resume", checkpoint]
    single = val_lines(assert_ok(run_script("train_dp.py", *evaluate)))
    assert len(single) == 1 and single[0][3] == "13"
    for world_size in (2, 3):
        lines = val_lines(assert_ok(torchrun("train_ddp.py", world_size, *evaluate)))
        assert len(lines) == 1
        acc1, acc5, loss, count = lines[0]
        assert (acc1, acc5, count) == (single[0][0], single[0][1], "13")
        # The same per-image losses, summed in another order: equal to float precision.
        assert float(loss) == pytest.approx(float(single[0][2]), rel=1e-6, abs=1e-6)


def test_resume_under_torchrun_with_another_world_size_continues_the_trajectory(
        tiny_data, trajectories, tmp_path):
    """2 epochs on 2 processes, then 2 more on 1 process, end where 4 epochs of DataParallel end."""
    out, _ = trajectories
    common = [*TINY, *EXACT_MODEL, "--data", tiny_data, "-b", "8", "--output-dir", tmp_path]
    assert_ok(torchrun("train_ddp.py", 2, *common, "--epochs", "2"))
    output = assert_ok(torchrun("train_ddp.py", 1, *common, "--epochs", "4", "--resume", "auto"))
    assert "resumed from" in output and "Epoch: [2]" in output and "Epoch: [0]" not in output
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["epoch"] == 4
    assert max_difference(weights(out / "dp"), weights(tmp_path)) <= 1e-5


def two_nodes(tiny_data, tmp_path, *extra):
    """Two torchrun launches on this machine, as two nodes of one process each, each with its own
    output directory, as on nodes that share no file system."""
    endpoint = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen(
        [PYTHON, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc_per_node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", REPO / "train_ddp.py", *TINY,
         "--data", tiny_data, "-b", "8", "--epochs", "1", "--output-dir", tmp_path / f"node{node}", *extra],
        cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    for proc in procs:
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, output[-3000:]
    return [(tmp_path / f"node{node}" / "checkpoint.pth").exists() for node in (0, 1)]


def test_only_global_rank_0_writes_checkpoints_by_default(tiny_data, tmp_path):
    assert two_nodes(tiny_data, tmp_path) == [True, False]
    assert not (tmp_path / "node1").exists()


def test_save_on_node_writes_one_checkpoint_per_node(tiny_data, tmp_path):
    assert two_nodes(tiny_data, tmp_path, "--save-on", "node") == [True, True]


def test_the_legacy_launcher_passes_local_rank_and_trains(tiny_data, tmp_path):
    result = run([PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node=2", f"--master_port={free_port()}",
                  REPO / "train_ddp.py", *TINY, "--data", tiny_data, "-b", "8", "--epochs", "1",
                  "--output-dir", tmp_path])
    assert_ok(result)
    assert (tmp_path / "checkpoint.pth").exists()


@pytest.mark.parametrize("launcher", ["torchrun", "spawn"])
def test_a_rank_that_raises_ends_the_whole_job_quickly(tiny_data, tmp_path, launcher):
    common = [*TINY, "--data", tiny_data, "-b", "4", "--epochs", "1", "--output-dir", tmp_path / "out",
              "-a", "tests.tiny_models:FailingNet", "-j", "2"]  # rank 1 raises at its third step; rank 0 waits
    start = time.monotonic()
    if launcher == "torchrun":
        result = torchrun("train_ddp.py", 2, *common, timeout=120)
    else:
        result = run_script("train_spawn.py", *common, "--nproc-per-node", "2", "--master-port", free_port(),
                            timeout=120)
    assert result.returncode != 0
    assert time.monotonic() - start < 60
    assert "the failure this test model makes at training step 3" in result.stdout, result.stdout[-3000:]


def assert_one_line_error(result, expected):
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert result.returncode == 2, result.stdout[-3000:]
    assert len(lines) == 1 and expected in lines[0], result.stdout[-3000:]
    assert "Traceback" not in result.stdout


def test_spawn_rejects_a_batch_the_world_size_does_not_divide(tiny_data, tmp_path):
    result = run_script("train_spawn.py", *TINY, "--data", tiny_data, "-b", "9", "--nproc-per-node", "2",
                        "--output-dir", tmp_path / "out")
    assert_one_line_error(result, "--batch-size 9 is the global batch")
    assert not (tmp_path / "out").exists()


def test_torchrun_workers_reject_a_batch_the_world_size_does_not_divide(tiny_data, tmp_path):
    """torchrun reports a failed worker in its own words and exit code; our line is in there."""
    result = torchrun("train_ddp.py", 2, *TINY, "--data", tiny_data, "-b", "9", "--output-dir", tmp_path / "out")
    assert result.returncode != 0
    assert "error: --batch-size 9 is the global batch and must divide evenly over 2 processes" in result.stdout
    assert "Traceback (most recent call last):\n  File \"" + str(REPO) not in result.stdout
    assert not (tmp_path / "out").exists()


def test_spawn_rejects_a_master_port_in_use(tiny_data, tmp_path):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = run_script("train_spawn.py", *TINY, "--data", tiny_data, "-b", "8", "--nproc-per-node", "2",
                            "--master-port", busy.getsockname()[1], "--output-dir", tmp_path / "out")
    assert_one_line_error(result, "in use; choose another --master-port")


@pytest.mark.parametrize("flags, expected", [
    (["--dist-backend", "nccl"], "the nccl backend needs CUDA GPUs"),
    (["--sync-bn"], "--sync-bn needs GPUs"),
    ([], "--nproc-per-node is required when no GPU is used"),
])
def test_spawn_rejects_what_cannot_run_on_this_cpu_machine(tiny_data, tmp_path, flags, expected):
    nproc = ["--nproc-per-node", "2"] if flags else []
    result = run_script("train_spawn.py", *TINY, "--data", tiny_data, "-b", "8", *nproc, *flags,
                        "--master-port", free_port(), "--output-dir", tmp_path / "out")
    assert_one_line_error(result, expected)
    assert not (tmp_path / "out").exists()


def test_ddp_rejects_nccl_without_gpus(tiny_data, tmp_path):
    result = run_script("train_ddp.py", *TINY, "--data", tiny_data, "--dist-backend", "nccl",
                        "--output-dir", tmp_path / "out")
    assert_one_line_error(result, "the nccl backend needs CUDA GPUs")


def test_spawn_with_a_file_init_method_trains(tiny_data, tmp_path):
    output = assert_ok(run_script("train_spawn.py", *TINY, "--data", tiny_data, "-b", "8", "--epochs", "1",
                                  "--nproc-per-node", "2", "--dist-url", f"file://{tmp_path}/rendezvous",
                                  "--output-dir", tmp_path / "out"))
    assert "spawn: world size 2" in output


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_spawn_rejects_more_processes_than_gpus(tiny_data, tmp_path):
    result = run_script("train_spawn.py", *TINY, "--data", tiny_data, "--nproc-per-node",
                        torch.cuda.device_count() + 1, "--output-dir", tmp_path / "out",
                        env=clean_env(gpu=True))
    assert_one_line_error(result, "needs one GPU per process")

"""The defaults that depend on the machine (loader workers, memory format, spawn's process count), and a
command line that answers --help and usage errors before torch is imported."""
import sys

import pytest
import torch
import torch.nn as nn
import torchvision

from common.data import loader_workers
from common.distributed import local_world_size_from_env
from common.trainer import use_channels_last
from conftest import PYTHON, REPO, assert_ok, clean_env, run, run_script

SCRIPTS = ["train_dp.py", "train_ddp.py", "train_spawn.py"]
# Runs a script as `python SCRIPT ARGS` would, then reports whether torch was imported on the way.
PROBE = ("import runpy, sys\n"
         "sys.argv = sys.argv[1:]\n"
         "try:\n"
         "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
         "except SystemExit as end:\n"
         "    print('exit', end.code, 'torch imported:', 'torch' in sys.modules)\n")


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("args, code", [(["--help"], 0), (["--epochs", "x"], 2), (["--epochs", "0"], 2),
                                        (["-j", "-1"], 2)])
def test_help_and_usage_errors_come_before_torch_is_imported(script, args, code):
    result = run([PYTHON, "-c", PROBE, REPO / script, *args], timeout=60)
    assert result.stdout.rstrip().endswith(f"exit {code} torch imported: False"), result.stdout[-2000:]


@pytest.mark.parametrize("cores, processes, expected", [
    (2, 1, 1),     # this machine, train_dp.py: one worker, the process keeps a core
    (2, 2, 0),     # this machine, 2 ranks: no core to spare
    (3, 2, 1),     # a core to spare: at least one worker each
    (16, 1, 8),    # at most 8 per process
    (96, 8, 8),    # a GPU node: 12 cores per rank
    (16, 8, 1),
    (8, 8, 0),
])
def test_auto_loader_workers_share_the_cores_among_the_processes(cores, processes, expected):
    assert loader_workers("auto", processes, cores=cores) == expected
    assert loader_workers(3, processes, cores=cores) == 3  # a number is kept


def test_processes_on_this_node_come_from_the_launcher(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    assert local_world_size_from_env(16) == 16  # unknown: all of them here, the cautious guess
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)")
    assert local_world_size_from_env(8) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's
    assert local_world_size_from_env(8) == 2


def test_channels_last_auto_is_on_where_it_was_measured_faster():
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    patches = nn.Sequential(nn.Conv2d(3, 8, 16, stride=16), nn.Flatten(), nn.Linear(8, 2))  # ViT-like: one conv
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert use_channels_last("auto", cpu, "none", cnn)
    assert use_channels_last("auto", cuda, "bf16", cnn)
    assert not use_channels_last("auto", cuda, "none", cnn)
    assert not use_channels_last("auto", cpu, "none", patches)
    assert use_channels_last("on", cuda, "none", patches) and not use_channels_last("off", cpu, "none", cnn)
    # Measured not faster with it on the CPU (docs/benchmarks.md): auto leaves them alone, "on" still applies.
    for arch in ("shufflenet_v2_x0_5", "convnext_tiny"):
        model = torchvision.models.get_model(arch)
        assert not use_channels_last("auto", cpu, "none", model) and use_channels_last("on", cpu, "none", model)
    assert use_channels_last("auto", cpu, "none", torchvision.models.get_model("mobilenet_v3_small"))


def test_channels_last_flag_alone_means_on():
    sys.path.insert(0, str(REPO))
    import train_dp
    assert train_dp.parse_args([]).channels_last == "auto"
    assert train_dp.parse_args(["--channels-last"]).channels_last == "on"
    assert train_dp.parse_args(["--channels-last", "off"]).channels_last == "off"
    assert train_dp.parse_args([]).workers == "auto" and train_dp.parse_args(["-j", "2"]).workers == 2


def test_spawn_without_nproc_runs_two_cpu_processes_and_shows_its_defaults(tiny_data, tmp_path):
    """`python train_spawn.py` on a machine without a GPU: DDP with two CPU processes, not an error."""
    no_workers_flag = ["--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32", "-p", "1"]
    result = run_script("train_spawn.py", "--data", tiny_data, *no_workers_flag,
                        "-a", "tests.tiny_models:TinyNet", "-b", "8", "--epochs", "1", "--seed", "0",
                        "--output-dir", tmp_path / "spawn", env=clean_env())
    out = assert_ok(result)
    assert "no GPU in use: 2 processes on the CPU (--nproc-per-node N to choose)" in out
    assert "spawn: world size 2," in out
    # -j auto on this machine's cores, shared by the 2 processes
    expected = loader_workers("auto", 2)
    assert f"12 val images, {expected} loader worker(s) per process)" in out
    assert "channels_last memory format (--channels-last auto)" in out

"""The launchers in run_scripts/, run for real on CPU: one node, two "nodes" on this machine
(two launches on 127.0.0.1), and a managed platform's environment."""
import subprocess

import pytest
import torch

from conftest import PYTHON, REPO, TINY, assert_ok, clean_env, free_port, run

SCRIPTS = REPO / "run_scripts"
EXACT_MODEL = ["-a", "tests.tiny_models:TinyNet", "--dropout", "0", "--seed", "5", "--lr", "0.05"]


def launch(script, *args, timeout=300, **env):
    return run(["bash", SCRIPTS / script, *args], timeout=timeout, env=clean_env(PYTHON=PYTHON, **env))


def launch_two_nodes(script, args, node_env):
    """Run `script args` twice at once, as nodes 0 and 1 with environments node_env(0) and
    node_env(1); returns both outputs once both succeeded."""
    nodes = [subprocess.Popen(["bash", SCRIPTS / script, *args], cwd=REPO, env=clean_env(PYTHON=PYTHON, **node_env(node)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    return outputs


def train_args(data, output_dir, *extra):
    return [*TINY, "--data", data, "-b", "8", "--epochs", "2", "--output-dir", output_dir, *extra]


def weights(output_dir):
    return torch.load(output_dir / "checkpoint.pth", weights_only=True)["state_dict"]


def max_difference(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("script, world_size", [
    ("single_node_dp.sh", 1), ("single_node_ddp.sh", 2), ("single_node_spawn.sh", 2)])
def test_single_node_scripts_train_and_print_their_command(tiny_data, tmp_path, script, world_size):
    result = launch(script, *train_args(tiny_data, tmp_path / "out"), NPROC_PER_NODE=2, MASTER_PORT=free_port())
    output = assert_ok(result)
    command = next(line for line in output.splitlines() if line.startswith("+ "))
    assert script.replace("single_node_", "train_").replace(".sh", ".py") in command
    assert f"world size {world_size}" in output
    assert (tmp_path / "out" / "checkpoint.pth").exists()


@pytest.fixture(scope="module")
def one_node_of_two_processes(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-node")
    assert_ok(launch("single_node_ddp.sh", *train_args(tiny_data, out, *EXACT_MODEL), NPROC_PER_NODE=2))
    return weights(out)


@pytest.mark.parametrize("script", ["multi_node_ddp.sh", "multi_node_spawn.sh"])
def test_two_nodes_end_with_the_weights_of_one_node_at_the_same_world_size(
        tiny_data, tmp_path, one_node_of_two_processes, script):
    port = free_port()
    outputs = launch_two_nodes(script, train_args(tiny_data, tmp_path / "out", *EXACT_MODEL), lambda node: dict(
        NNODES=2, NODE_RANK=node, NPROC_PER_NODE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    assert "world size 2" in outputs[0]
    assert "world size" not in outputs[1]  # rank 1 prints nothing of its own
    assert max_difference(one_node_of_two_processes, weights(tmp_path / "out")) <= 1e-5


@pytest.mark.parametrize("script", ["multi_node_ddp.sh", "multi_node_spawn.sh"])
@pytest.mark.parametrize("missing, expected", [("MASTER_ADDR", "set MASTER_ADDR"), ("NODE_RANK", "set NODE_RANK")])
def test_multi_node_scripts_stop_when_a_required_variable_is_missing(tmp_path, script, missing, expected):
    env = {"NNODES": 2, "NODE_RANK": 0, "MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": 1}
    del env[missing]
    result = launch(script, "--output-dir", tmp_path / "out", **env)
    assert result.returncode == 2
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {script}: {expected}"), result.stdout
    assert not (tmp_path / "out").exists()


def test_scripts_without_a_gpu_ask_for_the_process_count(tmp_path):
    result = launch("single_node_ddp.sh", "--output-dir", tmp_path / "out")
    assert result.returncode == 2
    assert "no GPU visible: set NPROC_PER_NODE" in result.stdout


def test_platform_script_trains_from_the_platform_variables_alone(tiny_data, tmp_path):
    """What a managed platform sets (seed 004), and no command-line arguments at all."""
    workspace = tmp_path / "workspace"
    result = launch("platform_ddp.sh", MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), WORLD_SIZE=2,
                    WORKER_PER_NODE=2, NODE_RANK=0, RANK=0, BACKEND="gloo", DATASETS_PATH=tiny_data.parent,
                    DATASETS=f"{tiny_data.name},unused", WORKSPACE=workspace, EPOCHS=1, LR=0.01, BATCH_SIZE=8,
                    OMP_NUM_THREADS=1)
    output = assert_ok(result)
    assert "ddp: world size 2" in output
    run_dir = workspace / f"ddp-resnet18-{tiny_data.name}"
    args = (run_dir / "args.json").read_text()
    assert '"epochs": 1' in args and '"lr": 0.01' in args and '"batch_size": 8' in args
    assert '"dist_backend": "gloo"' in args
    assert len((run_dir / "log.csv").read_text().splitlines()) == 2  # header + one epoch


def test_platform_script_on_two_nodes_takes_the_node_rank_from_rank(tiny_data, tmp_path):
    """Two nodes of one process each; node 1 knows only its RANK (global rank of its first process)."""
    port, workspace = free_port(), tmp_path / "workspace"
    common = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE=2, WORKER_PER_NODE=1,
                  DATASETS_PATH=tiny_data, WORKSPACE=workspace, EPOCHS=1, BATCH_SIZE=8)
    outputs = launch_two_nodes("platform_ddp.sh", TINY, lambda node: dict(RANK=node, **common))
    assert "--node-rank=1" in outputs[1]
    assert "ddp: world size 2" in outputs[0]


def test_platform_script_names_the_missing_variable(tmp_path):
    result = launch("platform_ddp.sh", MASTER_ADDR="127.0.0.1", MASTER_PORT=29500, WORKER_PER_NODE=1)
    assert result.returncode == 2
    assert result.stdout.startswith("error: platform_ddp.sh: set WORLD_SIZE")


@pytest.mark.parametrize("script", sorted(path.name for path in SCRIPTS.glob("*.s*") if path.name != "_common.sh"))
def test_every_script_shows_its_usage_in_its_header(script):
    header = (SCRIPTS / script).read_text().splitlines()[1:6]
    assert any(script in line for line in header), header

"""The launchers in run_scripts/, run for real on CPU: one node, two "nodes" on this machine
(two launches on 127.0.0.1), and a managed platform's environment."""

import re
import shlex
import socket

import pytest
import torch

from conftest import EXACT_MODEL, exact_folder, exact_run, tiny_folder
from harness.ahead import ahead, once
from harness.jobs import assert_ok, run, run_together
from harness.processes import PYTHON, REPO, clean_env, free_port
from tests.tiny_models import TinyNet

pytestmark = pytest.mark.e2e

SCRIPTS = REPO / "run_scripts"


def launch(script, *args, timeout=300, **env):
    return run(["bash", SCRIPTS / script, *args], timeout=timeout, env=clean_env(PYTHON=PYTHON, **env))


def launch_command(script, *args, **env):
    """(command, environment) of `bash run_scripts/SCRIPT args`, for run_together."""
    return ["bash", SCRIPTS / script, *args], clean_env(PYTHON=PYTHON, **env)


def weights(output_dir):
    return torch.load(output_dir / "checkpoint.pth", weights_only=True)["state_dict"]


def max_difference(a, b):
    assert a.keys() == b.keys()  # keys only in the second count too
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def initial_weights():
    torch.manual_seed(int(EXACT_MODEL[EXACT_MODEL.index("--seed") + 1]))  # the scripts' initial weights
    return TinyNet(num_classes=3).state_dict()


def parameters_moved(before, after):
    """The largest change of a trainable parameter (not of BatchNorm's running statistics)."""
    names = [name for name, _ in TinyNet(num_classes=3).named_parameters()]
    return max((after[name].double() - before[name].double()).abs().max().item() for name in names)


def runs_of_several_nodes(tmp_path_factory):
    """The module's launches that train, started together (most of their time is spent starting processes): two
    "nodes" of one process each of multi_node_ddp.sh (the default --save-on) and of multi_node_spawn.sh (--save-on
    node), each node with an output directory of its own (as on nodes that share no file system), with the flags of
    conftest.single_node_runs (whose single_node_ddp.sh run, 2 processes on one node, they are compared with); and
    platform_ddp.sh on two nodes of one process, from the platform's variables alone. name -> (output dir, result)."""
    tiny_data, exact_data = once(tiny_folder, tmp_path_factory), once(exact_folder, tmp_path_factory)
    out = tmp_path_factory.mktemp("launches")
    ports = {name: free_port() for name in ("two-ddp", "two-spawn", "platform")}

    def node(script, name, rank, *extra):
        return launch_command(
            script,
            *exact_run(exact_data, out / name / f"node{rank}", *extra),
            NNODES=2,
            NODE_RANK=rank,
            NPROC_PER_NODE=1,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=ports[name],
        )

    # What a managed platform sets (seed 004), and no command-line arguments at all; node 1 knows only its RANK (the
    # global rank of its first process).
    platform = dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=ports["platform"],
        WORLD_SIZE=2,
        WORKER_PER_NODE=1,
        BACKEND="gloo",
        DATASETS_PATH=tiny_data.parent,
        DATASETS=f"{tiny_data.name},unused",
        WORKSPACE=out / "platform",
        EPOCHS=1,
        LR=0.01,
        BATCH_SIZE=8,
        OMP_NUM_THREADS=1,
    )
    commands = {
        "two-ddp-0": node("multi_node_ddp.sh", "two-ddp", 0),
        "two-ddp-1": node("multi_node_ddp.sh", "two-ddp", 1),
        "two-spawn-0": node("multi_node_spawn.sh", "two-spawn", 0, "--save-on", "node"),
        "two-spawn-1": node("multi_node_spawn.sh", "two-spawn", 1, "--save-on", "node"),
        "platform-0": launch_command("platform_ddp.sh", RANK=0, **platform),
        "platform-1": launch_command("platform_ddp.sh", RANK=1, **platform),
    }
    return out, dict(zip(commands, run_together(list(commands.values()))))


launches = ahead(runs_of_several_nodes, "launches")


@pytest.fixture(scope="module")
def single_nodes(single_node_runs):
    """script -> (output, output dir) of conftest.single_node_runs."""
    out, results = single_node_runs
    return {f"single_node_{mode}.sh": (assert_ok(results[mode]), out / mode) for mode in ("dp", "ddp", "spawn")}


@pytest.fixture(scope="module")
def one_node_of_two_processes(single_nodes):
    return single_nodes["single_node_ddp.sh"]


@pytest.mark.parametrize(
    "script, world_size", [("single_node_dp.sh", 1), ("single_node_ddp.sh", 2), ("single_node_spawn.sh", 2)]
)
def test_single_node_scripts_train_and_print_their_command(single_nodes, script, world_size):
    output, out = single_nodes[script]
    command = shlex.split(next(line for line in output.splitlines() if line.startswith("+ "))[2:])
    assert script.replace("single_node_", "train_").replace(".sh", ".py") in " ".join(command)
    assert command[command.index("--output-dir") + 1] == str(out)  # (quoted: its folder's name holds a space)
    assert f"world size {world_size}" in output
    assert (out / "checkpoint.pth").exists()


def two_nodes(launches, name):
    """Both nodes' outputs (each must have succeeded), and the folder of their output directories."""
    out, results = launches
    return [assert_ok(results[f"{name}-{rank}"]) for rank in (0, 1)], out / name


@pytest.fixture(scope="module")
def two_ddp_nodes(launches):
    return two_nodes(launches, "two-ddp")


@pytest.fixture(scope="module")
def two_spawn_nodes(launches):
    return two_nodes(launches, "two-spawn")


@pytest.mark.parametrize("nodes", ["two_ddp_nodes", "two_spawn_nodes"])
def test_two_nodes_end_with_the_weights_of_one_node_at_the_same_world_size(request, one_node_of_two_processes, nodes):
    outputs, out = request.getfixturevalue(nodes)
    assert "world size 2" in outputs[0]
    assert "world size" not in outputs[1]  # rank 1 prints nothing of its own
    reference = weights(one_node_of_two_processes[1])
    assert parameters_moved(initial_weights(), reference) > 1e-2  # equal weights that never moved prove nothing
    assert max_difference(reference, weights(out / "node0")) <= 1e-5


def test_only_global_rank_0_writes_checkpoints_by_default(two_ddp_nodes):
    """Node 1's process has local rank 0, and writes nothing: no checkpoint, log or TensorBoard file."""
    _, out = two_ddp_nodes
    assert (out / "node0" / "checkpoint.pth").exists()
    assert not (out / "node1").exists()


def test_save_on_node_writes_one_checkpoint_per_node(two_spawn_nodes):
    _, out = two_spawn_nodes
    node0, node1 = weights(out / "node0"), weights(out / "node1")
    assert node0.keys() == node1.keys() and all(torch.equal(node0[key], node1[key]) for key in node0)


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


PLATFORM = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "WORKER_PER_NODE": "2", "RANK": "0"}


@pytest.mark.parametrize(
    "script, env, expected",
    [  # (each was bash's error and torchrun's traceback, or a rendezvous waiting in silence for a node never to come)
        ("multi_node_ddp.sh", {"NNODES": "abc"}, "NNODES=abc is not a whole number from 1"),
        ("multi_node_ddp.sh", {"NNODES": "2", "NODE_RANK": "5"}, "NODE_RANK=5 is not a whole number from 0 to 1"),
        ("multi_node_ddp.sh", {"MASTER_PORT": "abc"}, "MASTER_PORT=abc is not a whole number from 1 to 65535"),
        ("multi_node_ddp.sh", {"TRAIN_SCRIPT": "train_fdsp.py"}, "TRAIN_SCRIPT=train_fdsp.py is not a script of"),
        ("multi_node_spawn.sh", {"NNODES": "0"}, "NNODES=0 is not a whole number from 1"),
        ("platform_ddp.sh", {**PLATFORM, "RANK": "8"}, "RANK=8 is not a whole number from 0 to 3"),
        ("platform_ddp.sh", {**PLATFORM, "WORKER_PER_NODE": "0"}, "WORKER_PER_NODE=0 is not a whole number from 1"),
        ("platform_ddp.sh", {**PLATFORM, "NODE_RANK": "2"}, "NODE_RANK=2 is not a whole number from 0 to 1"),
        # (was: bash's "value too great for base", the range check skipped and a rendezvous of 8 nodes, node 9)
        ("multi_node_ddp.sh", {"NNODES": "08", "NODE_RANK": "9"}, "NODE_RANK=9 is not a whole number from 0 to 7"),
        ("multi_node_ddp.sh", {"RDZV_BACKEND": "Static"}, "RDZV_BACKEND=Static is not static or c10d (or etcd,"),
        (
            "multi_node_ddp.sh",
            {"MASTER_ADDR": "10.0.0.1:29500"},
            "MASTER_ADDR=10.0.0.1:29500 holds a port: give the host alone, and the port in MASTER_PORT",
        ),
        ("multi_node_spawn.sh", {"MASTER_ADDR": "no such host"}, "MASTER_ADDR='no such host' is not one host's name"),
        ("platform_ddp.sh", {**PLATFORM, "MASTER_ADDR": "10.0.0.1 "}, "MASTER_ADDR='10.0.0.1 ' is not one host's name"),
        ("multi_node_ddp.sh", {"MASTER_ADDR": "node01,node02"}, "MASTER_ADDR='node01,node02' is not one host's name"),
        ("multi_node_ddp.sh", {"MASTER_ADDR": "[::1]:29500"}, "MASTER_ADDR=[::1]:29500 holds a port"),
        ("multi_node_ddp.sh", {"MASTER_ADDR": "[::1"}, "MASTER_ADDR='[::1' is not one host's name or address"),
        (  # (the first line said RANK, the next WORLD_SIZE)
            "platform_ddp.sh",
            {**PLATFORM, "WORLD_SIZE": "6", "WORKER_PER_NODE": "4", "RANK": "1"},
            "WORLD_SIZE=6 is not a multiple of WORKER_PER_NODE=4",
        ),
        (  # (was node 0, as RANK 0 was: two nodes 0, each waiting for the other in silence)
            "platform_ddp.sh",
            {**PLATFORM, "RANK": "1"},
            "RANK=1 is not a node's first process (a multiple of WORKER_PER_NODE=2): set NODE_RANK, this node's index",
        ),
        ("single_node_ddp.sh", {"NPROC_PER_NODE": "", "WORKER_PER_NODE": "0"}, "WORKER_PER_NODE=0 is not a positive"),
        ("multi_node_ddp.sh", {"MAX_RESTARTS": "abc"}, "MAX_RESTARTS=abc is not a whole number from 0"),
        (  # (was: torchrun's wait of 600 s, saying nothing but a C++ warning every few seconds)
            "multi_node_ddp.sh",
            {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "no-such-host.invalid", "MASTER_ADDR_WAIT": "0"},
            "the rendezvous host no-such-host.invalid does not resolve to an address: give node 0's address or name",
        ),
        (
            "platform_ddp.sh",
            {**PLATFORM, "MASTER_ADDR": "no-such-host.invalid", "MASTER_ADDR_WAIT": "0"},
            "the rendezvous host no-such-host.invalid does not resolve to an address",
        ),
    ],
)
def test_a_launch_variable_out_of_its_range_is_one_line(tmp_path, script, env, expected):
    env = {"MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": "1", **env}
    result = launch(script, "--output-dir", tmp_path / "out", **env)
    lines = result.stdout.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {script}: {expected}"), lines


def test_multi_node_ddp_says_torchrun_s_wait_and_passes_max_restarts_on():
    """Node 0 waited for the others in silence, up to 600 s; --max-restarts, which the docs named, had no way in
    (an extra argument goes to train_ddp.py). /bin/echo stands in for Python: the command torchrun would run."""
    for backend, host in [("c10d", "127.0.0.1"), ("etcd-v2", "[fe80::1%eth0]")]:  # (torchrun's names and hosts)
        env = dict(NNODES="2", MASTER_ADDR=host, NPROC_PER_NODE="1", RDZV_BACKEND=backend, MAX_RESTARTS="3")
        result = run(
            ["bash", SCRIPTS / "multi_node_ddp.sh", "--epochs", "1"],
            timeout=60,
            env=clean_env(PYTHON="/bin/echo", **env),
        )
        assert result.returncode == 0, result.stdout
        note, command, echoed = result.stdout.splitlines()
        assert note.startswith("note: torchrun waits up to 600 s for all 2 nodes (its rendezvous), saying nothing;")
        assert shlex.split(command[2:]) == ["/bin/echo", *echoed.split()], result.stdout  # (the line, pasted back)
        assert "--rdzv-id=imagenet --max-restarts=3 " in echoed, result.stdout
        assert f"--rdzv-backend={backend} --rdzv-endpoint={host}:29500 " in echoed, result.stdout


def test_scripts_without_a_gpu_ask_for_the_process_count(tmp_path):
    for hidden in ({}, {"CUDA_VISIBLE_DEVICES": "-1"}, {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}):  # (CUDA's: none)
        result = launch("single_node_ddp.sh", "--output-dir", tmp_path / "out", **hidden)
        assert result.returncode == 2 and "no GPU visible: set NPROC_PER_NODE" in result.stdout, (hidden, result.stdout)


def test_a_port_in_use_on_node_0_is_one_line_from_the_torchrun_launchers(tmp_path):
    """(was: torchrun's DistNetworkError traceback, EADDRINUSE: two jobs of multi_node_ddp.sh's default port)"""
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for script, env in (
            ("multi_node_ddp.sh", {"NPROC_PER_NODE": "1"}),
            ("platform_ddp.sh", {**PLATFORM, "WORLD_SIZE": "2", "WORKER_PER_NODE": "2"}),
            ("platform_ddp.sh", {**PLATFORM, "WORLD_SIZE": "2", "WORKER_PER_NODE": "2", "NODE_RANK": "00"}),
        ):
            result = launch(script, "--output-dir", tmp_path / "out", **{**env, "MASTER_PORT": str(port)})
            assert result.returncode == 2 and result.stdout.splitlines() == [
                f"error: {script}: cannot listen on port {port} (Address already in use): the port is in use; choose "
                "another MASTER_PORT"
            ], result.stdout
    assert not (tmp_path / "out").exists()


def test_a_name_that_does_not_resolve_is_waited_for_with_a_note_then_one_line(tmp_path):
    """(a platform's name for node 0 may come to its DNS after the nodes start: the wait as torchrun's, said)"""
    env = dict(NNODES="2", NODE_RANK="1", NPROC_PER_NODE="1", MASTER_ADDR="no-such-host.invalid", MASTER_ADDR_WAIT="1")
    result = launch("multi_node_ddp.sh", "--output-dir", tmp_path / "out", **env)
    assert result.returncode == 2 and result.stdout.splitlines() == [
        "note: MASTER_ADDR no-such-host.invalid does not resolve yet: waiting up to 1 s (MASTER_ADDR_WAIT)",
        "error: multi_node_ddp.sh: the rendezvous host no-such-host.invalid does not resolve to an address: give node "
        "0's address or name (MASTER_ADDR, --master-addr)",
    ], result.stdout


def test_a_link_to_a_launcher_runs_it(tmp_path):
    """(was: `_common.sh: No such file or directory` beside the link, then bash's `command not found`)"""
    (tmp_path / "ddp").symlink_to(SCRIPTS / "single_node_ddp.sh")
    result = run([tmp_path / "ddp", "--epochs", "1"], timeout=60, env=clean_env(PYTHON="/bin/echo", NPROC_PER_NODE="1"))
    assert result.returncode == 0 and f" {REPO}/train_ddp.py --epochs 1" in result.stdout, result.stdout


def test_the_slurm_job_scripts_check_what_they_are_given_in_one_line(tmp_path):
    """Run by bash with Slurm's variables, `scontrol` and `srun` stand-ins on PATH (the real ones: tests/test_slurm.py):
    a failed `scontrol` (was: an empty MASTER_ADDR, torch's traceback in every task), MASTER_PORT=abc to
    slurm_ddp.sbatch (was: torchrun's traceback), and a submitting shell's RANK and WORLD_SIZE, which sbatch passes on
    (was: they won over srun's ranks, every task rank 0)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tools = {
        "scontrol": '[ -z "${SCONTROL_FAILS:-}" ] && echo localhost || exit 1',
        "srun": 'echo "task: RANK=${RANK-unset} WORLD_SIZE=${WORLD_SIZE-unset} LOCAL_RANK=${LOCAL_RANK-unset}"',
        "scancel": "true",
    }
    for name, body in tools.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    slurm = dict(SLURM_JOB_ID="7", SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", SLURM_SUBMIT_DIR=REPO)
    path = f"{bin_dir}:{clean_env()['PATH']}"
    for script, env, line in (
        ("slurm_ddp.sbatch", {"SCONTROL_FAILS": "1"}, "scontrol show hostnames localhost named no host"),
        ("slurm_ddp_tasks.sbatch", {"SCONTROL_FAILS": "1"}, "scontrol show hostnames localhost named no host"),
        ("slurm_ddp.sbatch", {"MASTER_PORT": "abc"}, "MASTER_PORT=abc is not a whole number from 1 to 65535"),
    ):
        result = launch(script, **slurm, **env, PATH=path, NPROC_PER_NODE="1")
        assert result.returncode == 2 and result.stdout.splitlines() == [f"error: {script}: {line}"], result.stdout
    result = launch("slurm_ddp_tasks.sbatch", **slurm, PATH=path, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0")
    assert result.returncode == 0, result.stdout
    assert "task: RANK=unset WORLD_SIZE=unset LOCAL_RANK=unset" in result.stdout.splitlines(), result.stdout


def test_platform_script_trains_from_the_platform_variables_alone_and_node_1_takes_its_rank_from_rank(
    tiny_data, launches
):
    """What a managed platform sets (seed 004), and no command-line arguments at all, on two nodes of one process each:
    node 1 knows only its RANK (global rank of its first process)."""
    outputs, out = two_nodes(launches, "platform")
    assert "--node-rank=1" in outputs[1]
    assert "ddp: world size 2" in outputs[0]
    run_dir = out / f"ddp-resnet18-{tiny_data.name}"
    args = (run_dir / "args.json").read_text()
    assert '"epochs": 1' in args and '"lr": 0.01' in args and '"batch_size": 8' in args
    assert '"dist_backend": "gloo"' in args
    assert len((run_dir / "log.csv").read_text().splitlines()) == 2  # header + one epoch


def test_platform_script_names_the_missing_variable(tmp_path):
    result = launch("platform_ddp.sh", MASTER_ADDR="127.0.0.1", MASTER_PORT=29500, WORKER_PER_NODE=1)
    assert result.returncode == 2
    assert result.stdout.startswith("error: platform_ddp.sh: set WORLD_SIZE")


@pytest.mark.parametrize("script", sorted(path.name for path in SCRIPTS.glob("*.s*") if path.name != "_common.sh"))
def test_every_script_shows_its_usage_in_its_header(script):
    """A usage line: a command as typed,
    `#   [node N:] [VAR=value ...] [bash|sbatch [--flag ...]] run_scripts/SCRIPT ...`."""
    header = (SCRIPTS / script).read_text().splitlines()[1:8]
    usage = re.compile(
        rf"^#\s+(node \d+:\s+)?(\w+=\S*\s+)*((bash|sbatch)(\s+--\S+)*\s+)?"
        rf"run_scripts/{re.escape(script)}(\s|$)"
    )
    assert any(usage.match(line) for line in header), header

"""common/distributed.py: ranks from torchrun's and Slurm's variables, one process per GPU (the shared-GPU warning
works), gloo refused on a host named after loopback before the rendezvous, and helpers that are the identity
without a process group."""

import ipaddress
import os
import socket

import pytest
import torch

from common import distributed
from common.distributed import (
    FLIGHT_RECORDER,
    MALLOC_VARIABLES,
    _address_of,
    flight_recorder,
    flight_recorder_files,
    gloo_address_problem,
    local_world_size_from_env,
    shared_devices,
)
from common.errors import UsageError
from harness.jobs import run
from harness.processes import PYTHON, REPO, clean_env, free_port


def test_without_a_process_group_this_process_is_rank_0_of_1_and_reductions_are_the_identity():
    assert (distributed.get_rank(), distributed.get_world_size()) == (0, 1)
    assert distributed.all_reduce_sum(torch.tensor([2.0])).item() == 2.0
    assert distributed.all_gather_object({"a": 1}) == [{"a": 1}]
    assert distributed.computed_by_rank_0(lambda: 7) == 7 and distributed.shared_seed(5) == 5
    distributed.barrier()


def test_ranks_come_from_torchrun_or_slurm(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    assert distributed.world_info_from_env() == (0, 0, 1)
    (
        monkeypatch.setenv("SLURM_PROCID", "5"),
        monkeypatch.setenv("SLURM_NTASKS", "8"),
        monkeypatch.setenv("SLURM_LOCALID", "1"),
    )
    assert distributed.world_info_from_env() == (5, 1, 8)
    monkeypatch.setenv("RANK", "3"), monkeypatch.setenv("WORLD_SIZE", "4"), monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.world_info_from_env() == (3, 1, 4)  # torchrun's first


LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_PORT")


@pytest.mark.parametrize(
    "env, line",
    [
        (
            {"RANK": "abc", "WORLD_SIZE": "1"},
            "RANK='abc' is not a whole number (set by torchrun, srun or the job script)",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not a whole number"),
        ({"RANK": "1_0", "WORLD_SIZE": "20"}, "RANK='1_0' is not a whole number"),  # (int() would take it: 10)
        (
            {"RANK": "-1", "WORLD_SIZE": "1"},
            "RANK=-1 with WORLD_SIZE=1: the processes' ranks are 0 .. WORLD_SIZE-1, and",
        ),
        ({"RANK": "5", "WORLD_SIZE": "2"}, "RANK=5 with WORLD_SIZE=2: "),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "RANK=0 with WORLD_SIZE=0: "),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK=-1: a local rank is 0 or more"),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "2"}, "SLURM_PROCID=3 with SLURM_NTASKS=2: "),
    ],
)
def test_ranks_that_no_rendezvous_can_meet_are_refused_in_one_line(monkeypatch, env, line):
    """Seen: a traceback (int('abc')), or a rank outside the world waiting in its rendezvous until --dist-timeout."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UsageError) as refused:
        distributed.world_info_from_env()
    assert str(refused.value).startswith(line)


def test_ports_that_no_store_can_listen_on_and_addresses_not_of_node_0_are_refused_in_one_line(monkeypatch):
    import train_ddp
    import train_spawn

    assert distributed.port_number("29500", 8) == 29500
    assert distributed.port_number("0", 1) == 0  # (any free port: a group of one)
    for text, processes in [("abc", 1), ("99999", 1), ("-1", 1), ("0", 2), ("29_500", 2)]:
        with pytest.raises(UsageError, match=rf"^MASTER_PORT={text}: the rendezvous port must be a whole number in "):
            distributed.port_number(text, processes)
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    for variables, line in [({"MASTER_PORT": "abc"}, "MASTER_PORT=abc: "), ({"RANK": "0", "WORLD_SIZE": "2"}, None)]:
        monkeypatch.setenv("MASTER_PORT", "0")
        for name, value in variables.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(UsageError, match=rf"^{line or 'MASTER_PORT=0: '}the rendezvous port must be"):
            train_ddp.setup(train_ddp.parse_args(["--device", "cpu"]))
    for flags, line in [
        (["--nproc-per-node", "0"], "--nproc-per-node 0 and --nnodes 1 must be 1 or more"),
        (["--nnodes", "0"], "--nproc-per-node 2 and --nnodes 0 must be 1 or more"),
        (["--master-port", "70000"], "--master-port 70000: the rendezvous port must be"),
        (["--master-port", "0"], "--master-port 0: the rendezvous port must be"),
        (["--dist-url", "tcp://127.0.0.1:abc"], "--dist-url tcp://127.0.0.1:abc: the rendezvous port must be"),
        (["--master-addr", "no-such-host.invalid"], "cannot listen on no-such-host.invalid:"),
    ]:
        with pytest.raises(UsageError) as refused:
            train_spawn.setup(train_spawn.parse_args(["--device", "cpu", "--nproc-per-node", "2", *flags]))
        assert str(refused.value).startswith(line), refused.value
    assert str(refused.value).endswith(": node 0 listens there: --master-addr must name an address of node 0")
    # A port in use, where rank 0 listens: train_ddp.py's rank 0 without torchrun (srun's tasks), spawn's env://
    # (were: a DistNetworkError traceback after 20 s, the other ranks connected to whatever listened there).
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))
        for script, flags in [(train_ddp, []), (train_spawn, ["--nproc-per-node", "2", "--dist-url", "env://"])]:
            with pytest.raises(UsageError, match=r": the port is in use; choose another MASTER_PORT$"):
                script.setup(script.parse_args(["--device", "cpu", *flags]))
        url = ["--nproc-per-node", "2", "--dist-url", f"tcp://127.0.0.1:{busy.getsockname()[1]}"]
        with pytest.raises(UsageError, match=r": the port is in use; choose another --dist-url$"):  # (--master-port)
            train_spawn.setup(train_spawn.parse_args(["--device", "cpu", *url]))
    distributed.check_port_free("::1", 0)  # (an IPv6 address: was refused as no address of node 0)
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        free = probe.getsockname()[1]
    for flags in (["--master-addr", "::1", "--master-port", str(free)], ["--dist-url", f"tcp://[::1]:{free}"]):
        url, _ = train_spawn.setup(train_spawn.parse_args(["--device", "cpu", "--nproc-per-node", "2", *flags]))
        assert url == f"tcp://[::1]:{free}"  # (was tcp://::1:PORT, which torch cannot read: a traceback)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals where no GPU is visible")
@pytest.mark.parametrize(
    "flags, refusal",
    [
        (["--device", "cuda"], r"^--device cuda asked for, but no CUDA GPU is visible: use --device cpu$"),
        (["--node-rank", "1"], r"^--node-rank 1 must be in 0\.\.0"),
        (["--master-port", "70000"], r"^--master-port 70000: the rendezvous port must be"),
        (
            ["--master-port", "0"],
            r"^--master-port 0: .+ \(0, any free port, only for a single process; this job has 2\)$",
        ),
        (["--dist-url", "http://x"], r"^--dist-url http://x: use tcp://"),
    ],
)
def test_spawn_s_refusal_of_its_launch_is_its_one_line_alone(capsys, flags, refusal):
    """(was: "no GPU in use: 2 processes on the CPU" said first, then the refusal); said where the launch is sound."""
    import train_spawn

    with pytest.raises(UsageError, match=refusal):
        train_spawn.setup(train_spawn.parse_args(flags))
    assert capsys.readouterr() == ("", "")
    train_spawn.setup(train_spawn.parse_args(["--master-port", str(free_port())]))
    assert capsys.readouterr().out == "no GPU in use: 2 processes on the CPU (--nproc-per-node N to choose)\n"


def test_save_on_node_without_a_local_rank_or_a_master_port_alone_is_one_line(monkeypatch):
    """RANK stood in for a missing LOCAL_RANK: under --save-on node the nodes past the first wrote nothing, exit 0. A
    missing MASTER_PORT was said as both variables missing."""
    import train_ddp

    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("SLURM_LOCALID", "0")  # (in a Slurm job: RANK is what the local rank is read beside)
    config = train_ddp.parse_args(["--device", "cpu", "--save-on", "node"])
    with pytest.raises(UsageError, match=r"^--save-on node: LOCAL_RANK is not set \(torchrun and srun set it\)"):
        train_ddp.setup(config)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(UsageError, match=r"^MASTER_PORT is not set: start this script with torchrun"):
        train_ddp.setup(train_ddp.parse_args(["--device", "cpu"]))
    monkeypatch.setenv("MASTER_ADDR", "")  # (a job script's failed `scontrol`: was torch's ValueError, a traceback)
    monkeypatch.setenv("MASTER_PORT", "29500")
    with pytest.raises(UsageError, match=r"^MASTER_ADDR is not set: start this script with torchrun"):
        train_ddp.setup(train_ddp.parse_args(["--device", "cpu"]))
    import train_spawn

    monkeypatch.setenv("MASTER_PORT", "")  # (empty: unset, as to train_ddp.py; was torch's traceback in each rank)
    port = str(free_port())
    train_spawn.setup(
        train_spawn.parse_args(
            ["--device", "cpu", "--nproc-per-node", "2", "--dist-url", "env://", "--master-port", port]
        )
    )
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("127.0.0.1", port)
    assert distributed.Runtime("ddp", None, 0, 3, 1).writes_checkpoints("node")  # (one process: it writes)


def test_processes_on_this_node_come_from_the_launcher(monkeypatch):
    for name in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    assert local_world_size_from_env(16) == 16  # unknown: all of them here, the cautious guess
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "4(x2)")
    assert local_world_size_from_env(8) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun's
    assert local_world_size_from_env(8) == 2


def test_a_backend_this_torch_was_built_without_is_one_line():
    """--dist-backend mpi (or ucc, xccl; BACKEND=mpi) on a torch without it: was init_process_group's traceback."""
    assert not torch.distributed.is_mpi_available()  # (the lock's torch, as pip's wheels: built without MPI)
    for requested in ("mpi", "cpu:mpi,cuda:nccl"):
        with pytest.raises(UsageError, match=rf"^--dist-backend {requested}: this torch \(\S+\) has no mpi built in$"):
            distributed.choose_backend(requested, torch.device("cpu"))
    assert distributed.choose_backend(None, torch.device("cpu")) == "gloo"


def test_shared_devices_finds_two_ranks_on_one_gpu_of_one_host():
    assert shared_devices([("a", "gpu0"), ("a", "gpu1"), ("b", "gpu0")]) is None
    assert shared_devices([("a", "gpu0"), ("a", "gpu1"), ("a", "gpu0")]) == (0, 2, "gpu0")


def test_two_ranks_on_one_gpu_are_refused_under_nccl_and_warned_of_otherwise(capsys):
    """Once a TypeError instead of the warning: the default `warn` (console.say) was given a flush it does not take."""
    owners = [("host", "GPU-1"), ("host", "GPU-1")]
    with pytest.raises(UsageError, match=r"^ranks 0 and 1 both use GPU cuda:0 of this node: start at most one process"):
        distributed.report_shared_gpus(owners, "nccl", torch.device("cuda", 0), rank=1)
    distributed.report_shared_gpus(owners, "gloo", torch.device("cuda", 0), rank=1)  # the default warn
    assert capsys.readouterr().out.startswith("warning: ranks 0 and 1 both use GPU cuda:0 of this node")
    distributed.report_shared_gpus(owners, "gloo", torch.device("cuda", 0), rank=0)  # said by the second rank alone
    assert capsys.readouterr().out == ""


def test_which_hosts_are_refused_for_gloo():
    line = gloo_address_problem("node7", "127.0.1.1", "10.1.2.3", multi_node=True, interface="eth0")
    assert line == (
        "this host's name node7 resolves to 127.0.1.1, a loopback address: gloo (the CPU group that carries "
        "stop signals, and the main group on CPUs) would listen there, out of the other nodes' reach, and the "
        "job would fail at start after a timeout: export GLOO_SOCKET_IFNAME=eth0 on every node (eth0: the "
        "interface that reaches 10.1.2.3 here)"
    )
    assert "`ip route get 10.1.2.3` names it" in gloo_address_problem("node7", "127.0.1.1", "10.1.2.3", True)
    assert gloo_address_problem("node7", "10.1.2.7", "10.1.2.3", True) is None  # resolves to a reachable address
    assert gloo_address_problem("node7", "127.0.1.1", "127.0.0.1", True) is None  # every "node" on this host
    assert gloo_address_problem("node7", "127.0.1.1", "localhost", True) is None
    assert "`ip route get node7` names it" in gloo_address_problem("node7", "127.0.1.1", "node7", True, "lo")  # node 0
    assert gloo_address_problem("node7", "127.0.1.1", "10.1.2.3", False) is None  # one node


def test_a_multi_node_rank_on_a_host_named_after_loopback_is_refused_before_the_rendezvous(monkeypatch):
    """As srun starts a task of a two-node job on a host whose name resolves to loopback: gloo would bind there and
    the job fail at start after a timeout. The master address is one this test never reaches: the check comes first
    (a UDP socket's connect, which sends nothing, finds the interface to name)."""
    if not ipaddress.ip_address(_address_of(socket.gethostname()) or "0.0.0.0").is_loopback:
        pytest.skip(f"this host's name {socket.gethostname()} resolves to a reachable address: nothing to refuse")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.123"), monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(
        UsageError, match=rf"^this host's name {socket.gethostname()} resolves to .*export GLOO_SOCKET_IFNAME="
    ):
        distributed.init_process_group(
            "gloo", "env://", 0, 2, torch.device("cpu"), timeout_seconds=5, local_world_size=1
        )


def test_a_rendezvous_host_that_does_not_resolve_is_one_line_before_the_rendezvous(monkeypatch):
    """Was: on a host whose name resolves to loopback, advice to set GLOO_SOCKET_IFNAME (then a traceback); else a
    wait of --dist-timeout for a store no one could reach. An IPv6 literal resolves; a group of one needs no host."""
    monkeypatch.setenv("MASTER_ADDR", "no-such-host.invalid"), monkeypatch.setenv("MASTER_PORT", "29999")
    for init_method in ("env://", "tcp://no-such-host.invalid:29999"):
        with pytest.raises(UsageError, match=r"^the rendezvous host no-such-host\.invalid does not resolve to an "):
            distributed.init_process_group("gloo", init_method, 1, 2, torch.device("cpu"), 5, local_world_size=1)
    distributed.check_rendezvous_host("tcp://[::1]:29999", 2)
    distributed.check_rendezvous_host("env://", 1)


def test_nccl_s_flight_recorder_is_set_to_dump_into_the_output_dir_unless_the_user_set_it(monkeypatch, tmp_path):
    names = [name for pair in FLIGHT_RECORDER for name in pair]
    for name in names:
        monkeypatch.setenv(name, "")  # unset as far as torch and flight_recorder go; restored (removed) afterwards
    flight_recorder("gloo", tmp_path)
    assert not any(os.environ[name] for name in names) and flight_recorder_files() is None
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    flight_recorder("nccl", tmp_path)
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and not os.environ["TORCH_FR_BUFFER_SIZE"]
    assert os.environ["TORCH_FR_DUMP_ON_TIMEOUT"] == os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    # The folder waits until the output directory is this run's (a refused run leaves nothing there).
    assert flight_recorder_files() == f"{tmp_path}/nccl_trace/rank_" and not (tmp_path / "nccl_trace").exists()
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    monkeypatch.setenv("TORCH_FR_DUMP_ON_TIMEOUT", "")
    assert flight_recorder_files() is None  # no dump: the header names none


KEEPS = "import torch; from common import distributed; assert distributed.keep_freed_host_memory(torch.device('cpu'))"
FAULTS = (
    "from harness.processes import refaulted_pages, resident_bytes_returned_at_fork\n"
    "print(refaulted_pages(), resident_bytes_returned_at_fork())"
)
MALLOC_SETTINGS = ("LD_PRELOAD", "GLIBC_TUNABLES", *MALLOC_VARIABLES)


@pytest.mark.skipif(distributed.glibc_malloc() is None, reason="glibc's malloc alone has these settings")
def test_training_on_the_cpu_keeps_the_memory_a_step_frees_where_by_default_malloc_returns_it_and_faults_it_in_again():
    """Through a new interpreter each (the setting is the process's), glibc's malloc as it comes: 80 MB freed and
    allocated again three times is faulted in again, page by page, with its defaults, and not once after
    keep_freed_host_memory; the memory it keeps is returned before a fork (the child would share it copy-on-write,
    to be copied as the parent writes)."""
    env = {name: value for name, value in clean_env().items() if name not in MALLOC_SETTINGS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "tests")])
    default, kept = (
        run([PYTHON, "-c", f"{setting}\n{FAULTS}"], timeout=120, env=env, prewarmed=False) for setting in ("", KEEPS)
    )
    assert default.returncode == kept.returncode == 0, default.stdout + kept.stdout
    (default_faults, _), (kept_faults, returned) = (map(int, result.stdout.split()) for result in (default, kept))
    pages = 3 * 10 * (8 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert default_faults > pages // 2 and kept_faults < pages // 50, (default.stdout, kept.stdout)
    assert returned > 40 << 20, kept.stdout


def test_the_memory_is_kept_on_the_cpu_with_glibc_s_malloc_alone_where_the_environment_sets_no_threshold(
    monkeypatch,
):
    assert not distributed.keep_freed_host_memory(torch.device("cuda", 0))
    for name, value in [("MALLOC_TRIM_THRESHOLD_", "131072"), ("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=4096")]:
        with monkeypatch.context() as patch:
            patch.setenv(name, value)
            assert not distributed.keep_freed_host_memory(torch.device("cpu"))
    with monkeypatch.context() as patch:
        patch.setattr(os, "confstr", lambda name: "musl")  # (musl's has no such name: an error, also None)
        assert distributed.glibc_malloc() is None and not distributed.keep_freed_host_memory(torch.device("cpu"))
    if distributed.glibc_malloc() is not None:  # another tunable of malloc's is no choice of these thresholds
        monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
        assert distributed.keep_freed_host_memory(torch.device("cpu"))

"""What FSDP saves: per process, the bytes of parameters, gradients and optimizer state it holds, and its peak
memory, for a model with AdamW at 1, 2 and 4 processes (torchrun, gloo on the CPU or NCCL on GPUs: a process per GPU,
as many rows as the GPUs allow).

    python tools/benchmark_fsdp.py --arch vit_b_16 --processes 1 2 4
    python tools/benchmark_fsdp.py --arch vit_l_16 --processes 1 2 4

Each run shards the model as train_fsdp.py does (common/fsdp.py: its blocks, then the root), makes AdamW over the
shards and takes two steps on a batch of one random 224 px image per process (the optimizer state exists after the
first). It prints a markdown table: the sharded state per rank (measured: the local shards' bytes), 1/N of the whole
state, their ratio, the peak memory of the process (ru_maxrss; on a GPU, the peak allocated memory), and its resident
memory after the steps (on the CPU; each rank built the whole model before sharding it, so its peak includes that).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from common.cli import Parser  # noqa: E402
from common.errors import UsageError  # noqa: E402
from shared import check_child, run_tool, torchvision_model, until_stopped, whole  # noqa: E402


def train_steps(model, optimizer, device, steps=2):
    """`steps` training steps of `model` on one random image: its auxiliary heads' losses added (GoogLeNet's,
    Inception v3's: their outputs are tuples), as the scripts train them."""
    import torch

    from common.models import loss_with_aux

    images, labels = torch.randn(1, 3, 224, 224, device=device), torch.zeros(1, dtype=torch.long, device=device)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=False)
        loss_with_aux(torch.nn.functional.cross_entropy, model(images), labels)[0].backward()
        optimizer.step()


def worker(arch):
    """One rank under torchrun: shard, two steps, and this rank's figures as one JSON line."""
    import resource

    import torch
    import torch.distributed as dist
    import torchvision

    from common import fsdp
    from common.config import Config
    from common.distributed import Runtime

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = Config(
        cpu_offload=False, reshard_after_forward=True, activation_checkpointing=False, compile=False, amp="none"
    )
    sharding = fsdp.Sharding(config, Runtime("fsdp", device, rank, rank, world_size, world_size))
    torch.manual_seed(0)
    model = torchvision.models.get_model(arch, num_classes=1000)  # on the CPU: fully_shard moves each unit's shard
    whole = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    model = sharding(model, fsdp.default_units(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_steps(model, optimizer, device)
    parameters, gradients, state = fsdp.state_bytes(model, optimizer)
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    peak = (
        torch.cuda.max_memory_allocated(device) if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    )
    print(
        json.dumps(
            {
                "rank": rank,
                "world_size": world_size,
                "parameters": parameters,
                "gradients": gradients,
                "optimizer": state,
                "whole_parameters": whole,
                "peak": peak,
                "resident": resident,
                "units": sharding.described,
            }
        ),
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(arch, processes):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={processes}",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-backend=c10d",
        __file__,
        "--worker",
        "--arch",
        arch,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate()
    except BaseException:  # this tool stopped: torchrun stops its ranks, as on a stop of its own (killed, it
        process.terminate()  # would leave them training, or starting up, without it)
        try:
            process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        raise
    check_child(
        f"torchrun --nproc_per_node={processes}",
        subprocess.CompletedProcess(command, process.returncode, stdout, stderr),
    )
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def main():
    parser = Parser(description=__doc__ and __doc__.splitlines()[0])
    parser.add_argument("--arch", type=torchvision_model, default="vit_b_16")
    parser.add_argument("--processes", type=whole(1), nargs="+", help="default: 1 2 4 (on GPUs: up to their count)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.arch)
    import torch

    args.processes = process_counts(args.processes, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    return until_stopped(print_table)(args)


def process_counts(requested, gpus):
    """The rows' process counts: --processes, or 1, 2 and 4; on `gpus` GPUs (a rank on each) those up to their count,
    and more refused in one line (was: an invalid device ordinal in the rank past them, after the first rows)."""
    if requested is None:
        return [count for count in (1, 2, 4) if not gpus or count <= gpus]
    if gpus and max(requested) > gpus:
        raise UsageError(f"--processes {max(requested)}: this machine has {gpus} GPU(s), a process on each")
    return requested


def print_table(args):
    """The table of the measurements, a row per --processes. A stop of this tool stops the torchrun it runs, and so
    its ranks."""
    print(
        f"| {args.arch}, AdamW | per rank: parameters + gradients + optimizer state | 1/N of the whole | ratio | "
        "peak memory per process | resident after the steps |"
    )
    print("|---|---|---|---|---|---|")
    for processes in args.processes:
        ranks = measure(args.arch, processes)
        held = max(rank["parameters"] + rank["gradients"] + rank["optimizer"] for rank in ranks)
        share = 4 * ranks[0]["whole_parameters"] / processes  # weights, gradients and AdamW's two moments
        peak, resident = max(rank["peak"] for rank in ranks), max(rank["resident"] for rank in ranks)
        print(
            f"| {processes} process{'es' if processes > 1 else ''} | {held / 2**20:,.1f} MiB "
            f"| {share / 2**20:,.1f} MiB | {held / share:.3f} | {peak / 2**30:.2f} GiB | {resident / 2**30:.2f} GiB |",
            flush=True,
        )
    print(f"\nunits: {ranks[0]['units']}; torch {__import__('torch').__version__}")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))

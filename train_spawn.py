"""Train an image classifier with DistributedDataParallel: one process per device, started by this script.

    python train_spawn.py --data /path/to/imagenet -a resnet50 -b 256           # every GPU of this node
    python train_spawn.py --nproc-per-node 2                                    # no GPU: 2 CPU processes, gloo
    python train_spawn.py --nnodes 2 --node-rank 0 --master-addr HOST --master-port 29500 ...  # then node 1
    python train_spawn.py --dist-url file:///shared/dir/rendezvous ...          # or tcp://HOST:PORT, env://

torch.multiprocessing.spawn starts --nproc-per-node processes on this node and
calls worker(local_rank, ...) in each; the global rank is
node_rank * nproc_per_node + local_rank. Everything else is as in train_ddp.py:
each process holds a replica, trains on its shard of each batch, and DDP
averages the gradients during backward().
"""

import logging
import os
import signal
import sys
from pathlib import Path

from common import cli, launch  # torch is imported after the arguments are parsed: --help is instant
from common.config import env_default
from common.errors import UsageError, say

CPU_PROCESSES = 2  # without a GPU and without --nproc-per-node


def parse_args(argv=None):
    parser = cli.build_parser(__doc__ and __doc__.splitlines()[0])
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=env_default("WORKER_PER_NODE", int),
        help=f"processes on this node (default: one per visible GPU, {CPU_PROCESSES} without a GPU; "
        "env WORKER_PER_NODE)",
    )
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index, 0 .. nnodes-1")
    parser.add_argument(
        "--master-addr", default=env_default("MASTER_ADDR") or "127.0.0.1", help="address of node 0 (env MASTER_ADDR)"
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=env_default("MASTER_PORT", int) or 29500,
        help="free port on node 0 (env MASTER_PORT)",
    )
    parser.add_argument(
        "--dist-url",
        default=None,
        help="tcp://HOST:PORT, file:///shared/path or env:// (default: tcp://MASTER_ADDR:MASTER_PORT)",
    )
    return cli.parse_args(parser, argv, mode="spawn")


def setup(config):
    """Check the launch before starting anything; returns the init_method URL and the processes on this node."""
    import torch

    from common import distributed
    from common.data import micro_batch
    from common.distributed import check_sync_bn, choose_backend, port_number, select_device
    from common.launch import check_port_free
    from common.run_dir import claim_rendezvous_file

    gpus = torch.cuda.device_count() if config.device != "cpu" else 0
    nproc = config.nproc_per_node
    if nproc is None:
        # No GPU: 2 CPU processes, so that `python train_spawn.py` shows DDP at work (two ranks, gloo,
        # the global batch split in two) on any machine.
        nproc = gpus or CPU_PROCESSES
    if nproc < 1 or config.nnodes < 1:
        raise UsageError(f"--nproc-per-node {nproc} and --nnodes {config.nnodes} must be 1 or more")
    if gpus and nproc > gpus:
        raise UsageError(f"--nproc-per-node {nproc} needs one GPU per process, but {gpus} are visible")
    if not 0 <= config.node_rank < config.nnodes:
        raise UsageError(f"--node-rank {config.node_rank} must be in 0..{config.nnodes - 1} (--nnodes {config.nnodes})")
    micro_batch(config.batch_size, config.nnodes * nproc, config.grad_accum_steps)
    device = select_device(config.device)
    choose_backend(config.dist_backend, device)
    check_sync_bn(config.sync_bn, device)
    url = config.dist_url or distributed.tcp_url(config.master_addr, config.master_port)
    if url.startswith("tcp://"):
        port = url.rpartition(":")[2]
        shown = f"--dist-url {url}" if config.dist_url else f"--master-port {port}"
        port = port_number(port, config.nnodes * nproc, shown)
        if config.node_rank == 0:  # (rank 0 will listen there)
            names = ("--dist-url",) * 2 if config.dist_url else ("--master-addr", "--master-port")
            check_port_free(distributed.rendezvous_host(url), port, names)
    elif url.startswith("file://"):
        claim_rendezvous_file(Path(url[len("file://") :]), config.node_rank, config.nnodes)
    elif url == "env://":
        for name, value in (("MASTER_ADDR", config.master_addr), ("MASTER_PORT", str(config.master_port))):
            os.environ[name] = os.environ.get(name) or value  # (an empty one as unset)
        distributed.check_env_rendezvous(config.nnodes * nproc, config.node_rank == 0)
    else:
        raise UsageError(f"--dist-url {url}: use tcp://HOST:PORT, file:///path or env://")
    if config.nproc_per_node is None and not gpus:  # (said once the launch is checked: an error comes alone)
        say(f"no GPU in use: {CPU_PROCESSES} processes on the CPU (--nproc-per-node N to choose)")
    return url, nproc


def worker(local_rank, config, init_method, nproc, usage_errors):
    """Runs in each spawned process, ended by common/launch.py's ladder (a usage error's line goes to the parent)."""
    # Global rank: the processes of node 0 come first, then those of node 1, ...
    rank = config.node_rank * nproc + local_rank
    launch.run_worker(rank, lambda: train(config, init_method, nproc, local_rank, rank), usage_errors)


def train(config, init_method, nproc, local_rank, rank):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from common.distributed import (
        Runtime,
        choose_backend,
        destroy_process_group,
        init_process_group,
        select_device,
        usable_cores,
    )
    from common.run import start_run
    from common.trainer import trainer_class

    world_size = config.nnodes * nproc
    device = select_device(config.device, local_rank)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # The processes share this node's cores (as torchrun does with OMP_NUM_THREADS=1).
        torch.set_num_threads(max(1, usable_cores() // nproc))
    backend = choose_backend(config.dist_backend, device)
    init_process_group(backend, init_method, rank, world_size, device, config.dist_timeout, nproc, config.output_dir)
    runtime = Runtime("spawn", device, rank, local_rank, world_size, nproc)
    trainer = start_run(trainer_class(config.trainer)(config, runtime))
    device_ids = [device.index] if device.type == "cuda" else None
    # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, saving a copy per step.
    model = DistributedDataParallel(
        trainer.model,
        device_ids=device_ids,
        gradient_as_bucket_view=True,
        find_unused_parameters=config.find_unused_parameters,
    )
    trainer.fit(train_model=model, eval_model=trainer.model)
    model = None  # DDP's reducer holds the process group: freed first (see train_ddp.py)
    destroy_process_group(finished=True)


def main(config):
    import torch.multiprocessing as mp

    init_method, nproc = setup(config)
    # When a worker fails, spawn stops the others and logs each; our error line says what failed.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # A scheduler's stop signal reaches this process only: pass it to the workers, which
    # agree on a step, save a checkpoint and exit (SIGINT: which stop at once). One that comes while they
    # are being started is passed on once they are.
    processes, early, passed = [], [], set()

    def pass_on(signum, _frame):
        passed.add(signum)
        if not processes:
            early.append(signum)
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    stops = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    for signum in stops:
        signal.signal(signum, pass_on)
    usage_errors = mp.get_context("spawn").SimpleQueue()
    context = mp.start_processes(
        worker, args=(config, init_method, nproc, usage_errors), nprocs=nproc, join=False, start_method="spawn"
    )
    processes.extend(context.processes)
    for signum in early:
        pass_on(signum, None)
    try:
        try:
            while not context.join():
                pass
        finally:
            # Every worker has ended: a late signal must not change how this process ends (at exit, Python
            # puts back the default action where it had a handler).
            for signum in stops:
                signal.signal(signum, signal.SIG_IGN)
    except mp.ProcessExitedException as error:
        if not usage_errors.empty():  # a worker's bad input, or a checkpoint it could not write: its one line
            code, line = usage_errors.get()
            say(line, file=sys.stderr)
            raise SystemExit(code) from None
        line, code = launch.worker_ended(error, passed)
        if line:
            say(line, file=sys.stderr)
        raise SystemExit(code) from None


if __name__ == "__main__":
    sys.exit(launch.run_main(main, parse_args))

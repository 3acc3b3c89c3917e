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
import errno
import fcntl
import logging
import os
import re
import signal
import sys
import traceback
from pathlib import Path

from common import args as cli  # torch is imported after the arguments are parsed: --help is instant
from common.console import say


CPU_PROCESSES = 2  # without a GPU and without --nproc-per-node


def parse_args(argv=None):
    parser = cli.build_parser(__doc__.splitlines()[0])
    parser.add_argument("--nproc-per-node", type=int, default=cli.env_default("WORKER_PER_NODE", int),
                        help=f"processes on this node (default: one per visible GPU, {CPU_PROCESSES} without a GPU; "
                             "env WORKER_PER_NODE)")
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index, 0 .. nnodes-1")
    parser.add_argument("--master-addr", default=cli.env_default("MASTER_ADDR") or "127.0.0.1",
                        help="address of node 0 (env MASTER_ADDR)")
    parser.add_argument("--master-port", type=int, default=cli.env_default("MASTER_PORT", int) or 29500,
                        help="free port on node 0 (env MASTER_PORT)")
    parser.add_argument("--dist-url", default=None,
                        help="tcp://HOST:PORT, file:///shared/path or env:// (default: tcp://MASTER_ADDR:MASTER_PORT)")
    return cli.parse_args(parser, argv)


def setup(args):
    """Check the launch before starting anything; returns the init_method URL."""
    import torch
    from common.distributed import check_port_free, check_sync_bn, choose_backend, select_device
    from common.trainer import per_process_batch
    gpus = torch.cuda.device_count() if args.device != "cpu" else 0
    if args.nproc_per_node is None:
        # No GPU: 2 CPU processes, so that `python train_spawn.py` shows DDP at work (two ranks, gloo,
        # the global batch split in two) on any machine.
        args.nproc_per_node = gpus or CPU_PROCESSES
        if not gpus:
            say(f"no GPU in use: {CPU_PROCESSES} processes on the CPU (--nproc-per-node N to choose)")
    if args.nproc_per_node < 1 or (gpus and args.nproc_per_node > gpus):
        raise cli.UsageError(f"--nproc-per-node {args.nproc_per_node} needs one GPU per process, "
                             f"but {gpus} are visible")
    if not 0 <= args.node_rank < args.nnodes:
        raise cli.UsageError(f"--node-rank {args.node_rank} must be in 0..{args.nnodes - 1} (--nnodes {args.nnodes})")
    per_process_batch(args.batch_size, args.nnodes * args.nproc_per_node)
    device = select_device(args.device)
    choose_backend(args.dist_backend, device)
    check_sync_bn(args.sync_bn, device)
    url = args.dist_url or f"tcp://{args.master_addr}:{args.master_port}"
    if url.startswith("tcp://") and args.node_rank == 0:
        host, _, port = url[len("tcp://"):].rpartition(":")
        check_port_free(host, int(port))  # rank 0 will listen there
    elif url.startswith("file://"):
        claim_rendezvous_file(Path(url[len("file://"):]), args.node_rank)
    elif url == "env://":
        os.environ.setdefault("MASTER_ADDR", args.master_addr)
        os.environ.setdefault("MASTER_PORT", str(args.master_port))
    elif not url.startswith("tcp://"):
        raise cli.UsageError(f"--dist-url {url}: use tcp://HOST:PORT, file:///path or env://")
    return url


_rendezvous_owner = None  # this node's lock on PATH.owner of its file:// rendezvous, held for the job's life


def claim_rendezvous_file(path, node_rank):
    """Every node of a file:// rendezvous holds a shared POSIX lock on PATH.owner for the job's life. Node 0 first
    tries it exclusively: when no node of any job holds it, a non-empty rendezvous file is a killed job's (SIGKILL,
    a lost node: nothing removed it), which would hand this job the dead one's addresses, so it is removed (said
    in a note). Held by others (this job's nodes that started first), the file is left as it is. On a file system
    that does not lock, a non-empty file is refused as before."""
    global _rendezvous_owner
    from common.checkpoint import NO_LOCKING
    try:
        owner = os.open(f"{path}.owner", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as error:
        raise cli.UsageError(f"--dist-url file://{path}: cannot create {path}.owner ({error.strerror})") from None
    try:
        if node_rank == 0:
            try:
                fcntl.lockf(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
            else:
                if path.exists() and path.stat().st_size:
                    path.unlink()
                    say(f"note: removed {path}, the rendezvous file of a job that ended without removing it (killed)")
        fcntl.lockf(owner, fcntl.LOCK_SH)  # (node 0: from exclusive to shared; others wait out node 0's check)
    except OSError as error:
        os.close(owner)
        if error.errno not in NO_LOCKING:
            raise cli.UsageError(f"cannot lock {path}.owner ({error.strerror})") from None
        if node_rank == 0 and path.exists() and path.stat().st_size:
            raise cli.UsageError(f"rendezvous file {path} is left from an earlier run (or a running job's: this file "
                                 "system does not lock files to tell): delete it first if no job uses it") from None
        return
    _rendezvous_owner = owner


def worker(local_rank, args, init_method):
    """Runs in each spawned process."""
    cli.stop_at_once_until_training()  # a new interpreter: a stop signal in its start-up ends it with 75 too
    # Global rank: the processes of node 0 come first, then those of node 1, ...
    rank = args.node_rank * args.nproc_per_node + local_rank
    world_size = args.nnodes * args.nproc_per_node
    try:
        import torch
        from torch.nn.parallel import DistributedDataParallel
        from common.distributed import Runtime, choose_backend, init_process_group, select_device, usable_cores
        from common.trainer import trainer_class
        device = select_device(args.device, local_rank)
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # The processes share this node's cores (as torchrun does with OMP_NUM_THREADS=1).
            torch.set_num_threads(max(1, usable_cores() // args.nproc_per_node))
        backend = choose_backend(args.dist_backend, device)
        init_process_group(backend, init_method, rank, world_size, device, args.dist_timeout, args.nproc_per_node)
        runtime = Runtime("spawn", device, rank, local_rank, world_size, args.nproc_per_node)
        trainer = trainer_class(args.trainer)(args, runtime)
        device_ids = [device.index] if device.type == "cuda" else None
        # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, saving a copy per step.
        model = DistributedDataParallel(trainer.model, device_ids=device_ids, gradient_as_bucket_view=True,
                                        find_unused_parameters=args.find_unused_parameters)
        trainer.fit(train_model=model, eval_model=trainer.model)
    except cli.UsageError:
        raise  # reported by main() as one line
    except cli.Preempted as stop:
        if str(stop):  # else rank 0 saved and said so
            say(f"rank {rank}: {stop}", file=sys.stderr)
        sys.exit(cli.PREEMPTED_EXIT_CODE)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches us twice: directly and from the parent
        sys.exit(130)  # (spawn would report a KeyboardInterrupt as success)
    except Exception as error:
        # spawn re-raises one failed process's error, often a rank that merely lost its
        # peer; print each rank's own report so the first cause is always shown.
        report = cli.known_failure(error) or f"rank {rank} failed:\n{traceback.format_exc()}"
        say(report.replace("error: ", f"error: rank {rank}: ", 1), file=sys.stderr)
        sys.exit(1)
    finally:
        if "common.preemption" in sys.modules:  # (not imported yet: nothing to clean up)
            sys.modules["common.preemption"].before_exit()  # no loader worker left, no alarm pending
            sys.modules["common.distributed"].destroy_process_group()


def main(args):
    import torch.multiprocessing as mp
    init_method = setup(args)
    # When a worker fails, spawn stops the others and logs each; our error line says what failed.
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    # A scheduler's stop signal reaches this process only: pass it to the workers, which
    # agree on a step, save a checkpoint and exit (SIGINT: which stop at once). One that comes while they
    # are being started is passed on once they are.
    processes, early = [], []

    def pass_on(signum, _frame):
        if not processes:
            early.append(signum)
        for process in processes:
            if process.is_alive():
                os.kill(process.pid, signum)
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(signum, pass_on)
    context = mp.start_processes(worker, args=(args, init_method), nprocs=args.nproc_per_node,
                                 join=False, start_method="spawn")
    processes.extend(context.processes)
    for signum in early:
        pass_on(signum, None)
    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException as error:
        # A bad-input error in a worker arrives as its traceback text: report its one line, with its exit code
        # (a checkpoint that could not be written: 1).
        usage = re.search(r"(UsageError|UnreadableImage|BadItem|CheckpointWriteError): (.*)\s*$", str(error))
        if usage:
            failure = cli.UsageError(usage.group(2))
            failure.exit_code = 1 if usage.group(1) == "CheckpointWriteError" else cli.UsageError.exit_code
            raise failure from None
        raise
    except mp.ProcessExitedException as error:
        if error.exit_code not in (cli.PREEMPTED_EXIT_CODE, 130):  # stopped on request
            say(f"error: process {error.error_index} exited ({error.signal_name or error.exit_code}); "
                "see the errors above", file=sys.stderr)
        # A worker killed by a signal: 128 + its number, as a shell reports it (a negative code would exit 256 - N).
        raise SystemExit(128 - error.exit_code if error.exit_code < 0 else error.exit_code or 1) from None


if __name__ == "__main__":
    sys.exit(cli.run_main(main, parse_args))

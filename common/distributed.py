"""Ranks, devices, backends and reductions. Every helper works without a process group: then rank is 0, world size is
1 and reductions return their input, so the training code has no `if distributed:` branches.
"""

import ctypes
import datetime
import fcntl
import ipaddress
import os
import random
import re
import socket
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import UsageError, say
from .launch import check_host_resolves, check_port_free


@dataclass
class Runtime:
    """Where this process runs and who it is among the others."""

    mode: str  # "dp", "ddp" or "spawn"
    device: torch.device
    rank: int = 0  # global rank, 0 .. world_size-1
    local_rank: int = 0  # rank on this node = which local GPU
    world_size: int = 1  # processes in the job
    local_world_size: int = 1  # processes on this node (they share its cores)
    num_devices: int = 1  # devices this process drives (several under DataParallel)
    device_ids: tuple = ()  # their indices, when several; else just `device`
    host_memory_kept: bool = False  # malloc keeps freed memory for the next step (keep_freed_host_memory)

    @property
    def devices(self):
        return [torch.device(self.device.type, i) for i in self.device_ids] or [self.device]

    @property
    def is_main(self):
        return self.rank == 0

    def writes_checkpoints(self, save_on):
        # One writer for the whole job on a shared file system; with
        # --save-on node, one per node, for nodes that share no file system.
        return (self.local_rank == 0 or self.world_size == 1) if save_on == "node" else self.rank == 0


TORCHRUN_JOB = []  # this torchrun job's id, once init_process_group has it from the agent's store


def job_ids():
    """The ids of this job, the same in its restarts and on every rank: torchrun's (one its agent's store holds; a new
    torchrun has a new store) and Slurm's job id (a requeue keeps it). torchrun's --rdzv-id is no such id: "none" by
    default, and a fixed one is the same for every job."""
    return TORCHRUN_JOB + ([f"slurm {os.environ['SLURM_JOB_ID']}"] if os.environ.get("SLURM_JOB_ID") else [])


def _torchrun_job(timeout):
    """An id of this torchrun job: the first rank to ask, in its first attempt, stores one in the agent's store."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return "torchrun " + store.compare_set("imagenet-training/job", "", uuid.uuid4().hex).decode()


def world_info_from_env():
    """(rank, local_rank, world_size) set by torchrun / torch.distributed.launch or by Slurm; a value that is no
    whole number, or a rank outside 0..world_size-1, refused in one line (it was a traceback, or a rendezvous
    waiting for a rank that never comes)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        names = ("RANK", "LOCAL_RANK" if "LOCAL_RANK" in env else "RANK", "WORLD_SIZE")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:  # srun, one task per device
        names = ("SLURM_PROCID", "SLURM_LOCALID" if "SLURM_LOCALID" in env else None, "SLURM_NTASKS")
    else:
        return 0, 0, 1
    rank, local_rank, world_size = (_whole_number(name) if name else 0 for name in names)
    if world_size < 1 or not 0 <= rank < world_size:
        raise UsageError(
            f"{names[0]}={rank} with {names[2]}={world_size}: the processes' ranks are 0 .. {names[2]}-1, and "
            f"{names[2]} 1 or more (set by torchrun, srun or the job script)"
        )
    if local_rank < 0:
        raise UsageError(
            f"{names[1]}={local_rank}: a local rank is 0 or more (set by torchrun, srun or the job script)"
        )
    return rank, local_rank, world_size


def _whole_number(name):
    text = os.environ[name]
    if not re.fullmatch(r"-?[0-9]+", text):  # (int() takes "1_0", spaces and other scripts' digits)
        raise UsageError(f"{name}={text!r} is not a whole number (set by torchrun, srun or the job script)")
    return int(text)


def port_number(text, processes, shown=None):
    """The rendezvous port `text` (`shown`: the flag that gave it, as the user wrote it; else MASTER_PORT=text), one
    line refusing what no store can listen on: not a whole number in 0..65535, or 0 (any free port) for more than one
    process, which the others cannot know."""
    shown = shown or f"MASTER_PORT={text}"
    port = int(text) if re.fullmatch(r"[0-9]+", str(text)) else -1  # (int() takes "29_500" and spaces)
    if not 0 <= port <= 65535 or (port == 0 and processes > 1):
        raise UsageError(
            f"{shown}: the rendezvous port must be a whole number in 1..65535 (0, any free port, only for a "
            f"single process; this job has {processes})"
        )
    return port


def usable_cores():
    """The cores this process may run on (its CPU affinity: what Slurm or a container allows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_world_size_from_env(world_size):
    """Processes on this node, as torchrun (LOCAL_WORLD_SIZE) or Slurm (SLURM_STEP_TASKS_PER_NODE, e.g.
    "4(x2)") say; else world_size (every process on this node: the cautious guess)."""
    env = os.environ
    if env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return int(env["LOCAL_WORLD_SIZE"])
    per_node = re.match(r"\d+", env.get("SLURM_STEP_TASKS_PER_NODE", "") or env.get("SLURM_NTASKS_PER_NODE", ""))
    return int(per_node.group()) if per_node else world_size


# glibc's malloc (mallopt, malloc.h): blocks up to 32 MiB (the largest threshold its manual documents) from the heap,
# not mmap; the heap's free top kept while under 2 GiB (the setting is a C int; above it, all of it is returned)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT_HOST_MEMORY = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 2**31 - 1}
# The user's own choice of these thresholds: variables, or glibc's tunables of the same names
MALLOC_THRESHOLDS = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")
MALLOC_VARIABLES = tuple(f"MALLOC_{name.upper()}_" for name in MALLOC_THRESHOLDS)
_trims_before_fork = False  # (registered once a process: os.register_at_fork has no undo)


def glibc_malloc():
    """glibc (a ctypes library) where its malloc is this process's, else None: another C library (musl, macOS), or
    another allocator preloaded (jemalloc, tcmalloc), whose memory glibc's settings would not reach."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
        process, libc = ctypes.CDLL(None), ctypes.CDLL("libc.so.6")
        address = [ctypes.cast(library.malloc, ctypes.c_void_p).value for library in (process, libc)]
    except (AttributeError, OSError, ValueError):  # no confstr (macOS), no such name, no libc.so.6
        return None
    return libc if address[0] == address[1] else None


def keep_freed_host_memory(device):
    """Training on the CPU: glibc's malloc keeps the memory a step frees for the next step, where by default it gives
    most of it back to the kernel and every step faults it in again (docs/benchmarks.md); before a fork, the main
    heap's kept memory is returned. For this process and the loader workers it forks; True where set. Not on GPUs,
    without glibc's malloc, nor where the environment sets malloc's thresholds (--no-keep-freed-memory: not called)."""
    env, tunables = os.environ, os.environ.get("GLIBC_TUNABLES", "")
    chosen = any(name in env for name in MALLOC_VARIABLES)
    chosen = chosen or any(f"glibc.malloc.{name}" in tunables for name in MALLOC_THRESHOLDS)
    libc = glibc_malloc() if device.type == "cpu" and not chosen else None
    if libc is None:
        return False
    global _trims_before_fork
    if not _trims_before_fork:
        # A forked process (a loader worker) shares the kept memory copy-on-write: each page the step after writes
        # would be copied, a fault 5 times as long as a fresh page's. Returned first, it is faulted in fresh.
        os.register_at_fork(before=lambda: libc.malloc_trim(0))
        _trims_before_fork = True
    return all([libc.mallopt(option, value) == 1 for option, value in KEPT_HOST_MEMORY.items()])


def select_device(choice, local_rank=0):
    """The device of the process with this node-local rank (cuda:LOCAL_RANK on GPUs)."""
    has_cuda = torch.cuda.is_available()
    if choice == "cuda" and not has_cuda:
        raise UsageError("--device cuda asked for, but no CUDA GPU is visible: use --device cpu")
    if choice == "cpu" or not has_cuda:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank < count:
        return torch.device("cuda", local_rank)
    if count == 1:  # the launcher gave each process its own GPU via CUDA_VISIBLE_DEVICES
        return torch.device("cuda", 0)
    raise UsageError(
        f"local rank {local_rank} needs GPU {local_rank}, but only {count} are visible: "
        "start at most one process per GPU"
    )


def choose_backend(requested, device):
    backend = requested or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise UsageError(
            "the nccl backend needs CUDA GPUs and this process runs on the CPU: "
            "use --dist-backend gloo (or unset BACKEND)"
        )
    for name in {part.split(":")[-1] for part in backend.split(",")} & {"mpi", "ucc", "xccl"}:  # (was a traceback)
        if not getattr(dist, f"is_{name}_available", lambda: False)():
            raise UsageError(f"--dist-backend {backend}: this torch ({torch.__version__}) has no {name} built in")
    return backend


def check_sync_bn(sync_bn, device):
    if sync_bn and device.type != "cuda":
        raise UsageError("--sync-bn needs GPUs: SyncBatchNorm does not run on the CPU")


def _address_of(name):
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def _interface_towards(address):
    """The name of this host's network interface whose address is the one it would reach `address` from (a UDP
    socket's connect sends nothing), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, 9))
            local, interfaces = probe.getsockname()[0], socket.if_nameindex()
        except OSError:
            return None
        for _, name in interfaces:
            try:
                request = struct.pack("256s", name.encode()[:15])
                if socket.inet_ntoa(fcntl.ioctl(probe.fileno(), 0x8915, request)[20:24]) == local:  # SIOCGIFADDR
                    return name
            except OSError:  # an interface without an IPv4 address
                continue
    return None


def gloo_address_problem(host, host_address, master_address, multi_node, interface=None):
    """One line when gloo would listen where other nodes cannot reach it: a job of several nodes (its rendezvous
    address no loopback address) on a host whose name resolves to a loopback address (Debian's 127.0.1.1 line in
    /etc/hosts, Kubernetes' hostNetwork); else None."""
    try:  # a loopback address given as the rendezvous: every "node" is this host (a rehearsal on one machine)
        all_here = master_address == "localhost" or ipaddress.ip_address(master_address).is_loopback
    except ValueError:  # a name: maybe node 0's own, which resolves to loopback on node 0 too
        all_here = False
    if not multi_node or host_address is None or not ipaddress.ip_address(host_address).is_loopback:
        return None
    if master_address is None or all_here:
        return None
    interface = None if interface == "lo" else interface
    fix = f"export GLOO_SOCKET_IFNAME={interface or '<interface>'} on every node" + (
        f" ({interface}: the interface that reaches {master_address} here)"
        if interface
        else f" (the interface that reaches {master_address}: `ip route get {master_address}` names it)"
    )
    return (
        f"this host's name {host} resolves to {host_address}, a loopback address: gloo (the CPU group that carries "
        "stop signals, and the main group on CPUs) would listen there, out of the other nodes' reach, and the job "
        f"would fail at start after a timeout: {fix}"
    )


def tcp_url(host, port):
    """tcp://HOST:PORT, an IPv6 address in brackets (tcp://::1:29500 is no URL torch reads)."""
    return f"tcp://[{host}]:{port}" if ":" in host and not host.startswith("[") else f"tcp://{host}:{port}"


def rendezvous_host(init_method):
    """The host of an env:// (MASTER_ADDR) or tcp:// rendezvous; None for file://."""
    if init_method == "env://":
        return os.environ.get("MASTER_ADDR")
    return init_method[len("tcp://") :].rpartition(":")[0].strip("[]") if init_method.startswith("tcp://") else None


def check_rendezvous_host(init_method, world_size):
    """One line where the rendezvous host's name does not resolve (was: on a node past the first, advice to set
    GLOO_SOCKET_IFNAME, or a wait of --dist-timeout for a store no one could reach)."""
    host = rendezvous_host(init_method)
    if world_size > 1 and host:
        check_host_resolves(host)


def check_gloo_address(init_method, world_size, local_world_size):
    """gloo_address_problem for this process: raised as a UsageError before the rendezvous."""
    if os.environ.get("GLOO_SOCKET_IFNAME") or local_world_size is None or world_size <= local_world_size:
        return
    master = rendezvous_host(init_method)
    host = socket.gethostname()
    problem = gloo_address_problem(
        host,
        _address_of(host),
        master,
        multi_node=True,
        interface=_interface_towards(_address_of(master) or master) if master else None,
    )
    if problem:
        raise UsageError(problem)


def init_process_group(
    backend, init_method, rank, world_size, device, timeout_seconds=1800, local_world_size=None, output_dir=None
):
    """Join the group: a collective that waits longer than timeout_seconds fails instead of hanging. A rendezvous host
    that does not resolve is refused first; with local_world_size, a host whose name resolves to a loopback address
    too (check_gloo_address); with output_dir, NCCL's Flight Recorder dumps there on a timeout (flight_recorder)."""
    check_rendezvous_host(init_method, world_size)
    check_gloo_address(init_method, world_size, local_world_size)
    if output_dir is not None:
        flight_recorder(backend, output_dir)
    device_id = None
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any collective, so NCCL uses this GPU
        if backend == "nccl":
            device_id = device  # binds the group to this GPU (and barrier() knows which one to use)
    timeout = datetime.timedelta(seconds=timeout_seconds)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    options = dict(rank=rank, world_size=world_size, timeout=timeout, device_id=device_id)
    try:
        if init_method == "env://" and attempt != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # After torchrun restarts the workers, its store still holds the addresses that the
            # dead workers published; meet under a fresh prefix so no rank connects to those.
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
            )
            dist.init_process_group(backend, store=dist.PrefixStore(f"/restart_{attempt}", store), **options)
        else:
            dist.init_process_group(backend, init_method=init_method, **options)
        if init_method == "env://" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            TORCHRUN_JOB[:] = [_torchrun_job(timeout)]
    except dist.DistBackendError as error:
        # NCCL, connecting eagerly (device_id) two ranks that share a GPU: "Multiple Ranks are using the
        # same GPU" since NCCL 2.2x, "Duplicate GPU detected" before.
        if re.search(r"Duplicate GPU|Multiple Ranks are using the same GPU", str(error)):
            raise UsageError(_shared_gpu_message(f"rank {rank} and another rank", device)) from None
        raise
    check_one_process_per_gpu(device, backend)


def _shared_gpu_message(who, device):
    return (
        f"{who} both use GPU {device} of this node: start at most one process per GPU "
        f"(--nproc_per_node <= {torch.cuda.device_count()}), or give each its own with CUDA_VISIBLE_DEVICES"
    )


def shared_devices(owners):
    """The first pair of ranks in `owners` (a list of (host, GPU id), one per rank) that use the same
    GPU of the same host, as (rank, rank, GPU id); else None."""
    first = {}
    for rank, owner in enumerate(owners):
        if owner in first:
            return first[owner], rank, owner[1]
        first[owner] = rank
    return None


def check_one_process_per_gpu(device, backend):
    """Two ranks on one GPU: `torchrun --nproc_per_node=2` on a one-GPU node, or one CUDA_VISIBLE_DEVICES exported
    to every task (a collective: every rank says which GPU of which host it uses)."""
    if device.type == "cuda":
        owners = all_gather_object((socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid)))
        report_shared_gpus(owners, backend, device, get_rank())


def report_shared_gpus(owners, backend, device, rank, warn=say):
    """`owners`: each rank's (host, GPU id). NCCL refuses two ranks on one GPU unless NCCL_MULTI_RANK_GPU_ENABLE=1
    (init_process_group above turns its error into this line). Asked for (that variable, or a backend other than
    NCCL), it runs, slowly: a warning, from the second rank of the pair."""
    shared = shared_devices(owners)
    if shared is None:
        return
    rank_a, rank_b, _ = shared
    message = _shared_gpu_message(f"ranks {rank_a} and {rank_b}", device)
    if backend == "nccl" and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
        raise UsageError(message)
    if rank == rank_b:
        warn(f"warning: {message}")


_fence = None  # the last collective's Work, held for the process's life (destroy_process_group)


def destroy_process_group(finished=False):
    """End this process's groups. finished=True (every rank ends normally, never on an error's way out): one last
    all-reduce first, its Work held for the process's life, so that gloo's thread never frees its tensors: that needs
    Python's lock, which the group's destructor holds while it waits for the thread (a hang at exit:
    docs/development.md), and which Python shutting down refuses it (an abort, `terminate called without an active
    exception`: FSDP's device mesh keeps the groups and their threads alive past this call). A stop's barrier does as
    well."""
    global _fence
    if not is_initialized():
        return
    if finished:
        nccl = dist.get_backend() == "nccl"
        fence = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu")
        _fence = dist.all_reduce(fence, async_op=True)  # (its store and connections stay open till the process ends)
        _fence.wait()
    dist.destroy_process_group()


def is_initialized():
    return dist.is_available() and dist.is_initialized()


def get_rank():
    return dist.get_rank() if is_initialized() else 0


def get_world_size():
    return dist.get_world_size() if is_initialized() else 1


def backend():
    """The default group's backend ("nccl", "gloo"), or None without a group."""
    return dist.get_backend() if is_initialized() else None


def barrier():
    if is_initialized():
        dist.barrier()


def all_reduce_sum(tensor):
    """Sum of `tensor` over all ranks (in place, returned)."""
    if is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def weighted_mean(value, weight):
    """The mean of the scalar tensor `value` over all ranks, each weighted by its `weight` (images): the same on every
    rank, as DataParallel's one process computes it. `value` itself without a process group."""
    if not is_initialized():
        return value
    both = all_reduce_sum(torch.stack([value.float() * weight, value.new_full((), weight, dtype=torch.float32)]))
    return both[0] / both[1]


def average_gradients(parameters):
    """Average the gradients of `parameters` over all ranks, in one all-reduce: for parameters outside DDP's
    buckets (a criterion's), whose gradients are each rank's own. Those without a gradient (on every rank alike)
    are left as they are."""
    grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
    if not grads or not is_initialized():
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= get_world_size()
    for grad, part in zip(grads, flat.split([grad.numel() for grad in grads])):
        grad.copy_(part.view_as(grad))


def max_over_ranks(value, device):
    """The largest of the ranks' integer `value`s (a collective, through `device`: NCCL reduces GPU tensors)."""
    if not is_initialized():
        return value
    found = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return int(found.item())


def gathered(values, device):
    """Every rank's list of numbers `values` (as many on each), as a (world size, len(values)) float64 tensor on the
    CPU: one collective, through `device` (NCCL gathers GPU tensors)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    if not is_initialized():
        return mine.cpu().unsqueeze(0)
    parts = [torch.empty_like(mine) for _ in range(get_world_size())]
    dist.all_gather(parts, mine)
    return torch.stack(parts).cpu()


def all_gather_object(obj):
    """[obj of rank 0, obj of rank 1, ...] on every rank."""
    if not is_initialized():
        return [obj]
    gathered = [None] * get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_buffers(module):
    """Give every rank rank 0's buffers (BatchNorm running statistics), so all
    ranks evaluate exactly the weights that rank 0 saves."""
    if is_initialized():
        for buffer in module.buffers():
            dist.broadcast(buffer.data, src=0)


def computed_by_rank_0(compute):
    """compute() run by rank 0 alone, its result given to every rank (a collective). A UsageError
    it raises is raised on every rank; any other error fails the others too, rather than leaving
    them waiting."""
    if not is_initialized():
        return compute()
    outcome = [None]
    if get_rank() == 0:
        try:
            outcome[0] = ("done", compute())
        except UsageError as error:
            outcome[0] = ("usage", str(error))
        except BaseException:
            dist.broadcast_object_list([("failed", None)], src=0)
            raise
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "usage":
        raise UsageError(value)
    if kind == "failed":
        raise RuntimeError("rank 0 failed (its error says why)")
    return value


def shared_seed(seed):
    """`seed`, or when None a random one drawn by rank 0 and given to every rank."""
    return seed if seed is not None else computed_by_rank_0(lambda: random.SystemRandom().randrange(2**31))


def check_env_rendezvous(processes, listens):
    """An env:// rendezvous's MASTER_PORT checked (port_number), and free on MASTER_ADDR where this process's rank 0
    will listen (`listens`); its port."""
    port = port_number(os.environ["MASTER_PORT"], processes)
    if listens and port:
        check_port_free(os.environ["MASTER_ADDR"], port, ("MASTER_ADDR", "MASTER_PORT"))
    return port


FLIGHT_RECORDER = (
    ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
    ("TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT"),
    ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
)


def flight_recorder(backend, output_dir):
    """NCCL's Flight Recorder (each rank's last 2000 collectives) dumped to OUTPUT/nccl_trace/rank_N when a collective
    times out (NCCL's watchdog then aborts the process): each variable set before the group starts, unless the user
    set it by either of torch's names. Nothing for other backends."""
    if backend != "nccl":
        return
    directory = Path(output_dir) / "nccl_trace"
    for names, value in zip(FLIGHT_RECORDER, ("2000", "1", f"{directory}/rank_")):
        if not any(os.environ.get(name) for name in names):
            os.environ.update(dict.fromkeys(names, value))


def flight_recorder_files():
    """Where NCCL's Flight Recorder dumps on a timeout (the prefix of its files, the rank after it), or None when it
    records nothing or does not dump."""
    size, dump, files = ([os.environ.get(name) for name in names if os.environ.get(name)] for names in FLIGHT_RECORDER)
    on = (size or ["2000"])[0] != "0" and (dump or ["1"])[0] not in ("0", "false")
    return (files or [None])[0] if on else None


def first_error(gathered):
    """The first rank's error line (prefixed with its rank on the others), or None."""
    for rank, facts in enumerate(gathered):
        if facts["error"] is not None:
            return facts["error"] if rank == get_rank() else f"rank {rank}: {facts['error']}"
    return None


def raise_any(error, value=None):
    """A collective: every rank gives the error (a line) that stops it, or None, and a `value`; the first rank's error
    is raised on every rank, so none is left waiting for another; else every rank's value, in rank order."""
    gathered = all_gather_object({"error": error, "value": value})
    line = first_error(gathered)
    if line is not None:
        raise UsageError(line)
    return [facts["value"] for facts in gathered]

"""Startup at ImageNet scale: listing the folder the old way and the new way, and launch to the first step.

    python tools/benchmark_startup.py --repeats 2 --nproc 8    # full scale: 1,281,167 + 50,000 files
    python tools/benchmark_startup.py --scale 0.1              # a 10% sample (builds in a few seconds)

A fake ImageNet is built once under --root and kept: 1000 class folders in train/ and val/, one real
64x64 JPEG per class, every other file a hard link to it. Each row of the table is a fresh process, with
a warm page cache (a cold cache or a network file system is slower, and is not measured): `import torch`
(the floor); torchvision's ImageFolder(train) + ImageFolder(val) (the old way, in every process);
common.folder_index.scan_image_folder(root) (the new way, on rank 0 once per job), with the size of each
one's result pickled; train_dp.py and torchrun --nproc_per_node=N train_ddp.py (CPU, gloo,
OMP_NUM_THREADS=1), launch to the `data:` line and to the first step, with the CPU seconds of all their
processes and the peak RSS of the training processes then. Every subprocess has a timeout and is then
killed (SIGKILL) with its process group and every process that carries its marker in the environment
(torchrun starts its workers in sessions of their own).
"""

import contextlib
import json
import os
import queue
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from common.cli import Parser  # noqa: E402
from common.errors import UsageError  # noqa: E402
from shared import check_child, run_tool, seconds, until_stopped, whole  # noqa: E402

FULL_TRAIN, VAL_PER_CLASS, CLASSES = 1_281_167, 50, 1000
MARK, STEP = "_BENCHMARK_STARTUP_MARK", "Epoch: [0] ["
BATCH = 16  # the training runs' global batch
DROP = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "EPOCHS",
    "LR",
    "BATCH_SIZE",
    "DATASETS_PATH",
    "DATASETS",
    "WORKSPACE",
    "BACKEND",
    "WORKER_PER_NODE",
}

CHILD = r"""
import json, pickle, sys, time
def peak_rss():
    return int(dict(line.split(":", 1) for line in open("/proc/self/status"))["VmHWM"].split()[0]) / 1024
what, root = sys.argv[1], sys.argv[2]
if what == "torch":
    import torch
    print(json.dumps({"cpu": time.process_time(), "hwm": peak_rss()}))  # the whole process
else:
    import torchvision.datasets  # imported by both ways: not timed
    from common.folder_index import scan_image_folder
    wall, cpu = time.perf_counter(), time.process_time()
    if what == "imagefolder":
        found = [torchvision.datasets.ImageFolder(f"{root}/{split}").samples for split in ("train", "val")]
    else:
        found = scan_image_folder(root)
    result = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu, "hwm": peak_rss()}
    print(json.dumps({**result, "pickled": len(pickle.dumps(found)) / 2**20}))
"""


def build_tree(root, scale):
    """The fake tree at `scale` under root, built unless the marker file says it is there."""
    train_total, val_per_class = round(FULL_TRAIN * scale), max(1, round(VAL_PER_CLASS * scale))
    marker = os.path.join(root, ".fake_imagenet.json")
    want = {"train_files": train_total, "val_per_class": val_per_class}
    if want.items() <= json.loads(read(marker) or "{}").items():
        return
    start = time.perf_counter()
    if os.path.exists(root):
        raise UsageError(f"--root {root} exists and is not a tree of this scale built by this script: pass another")
    try:
        os.makedirs(root)
        print(
            f"building {root}: {train_total} train + {val_per_class * CLASSES} val files (hard links)", file=sys.stderr
        )
        write_tree(root, train_total, val_per_class)
        with open(marker, "w") as file:
            json.dump({**want, "scale": scale, "build_seconds": round(time.perf_counter() - start, 1)}, file)
    except BaseException as error:  # a tree part-way (a full disk, Ctrl-C): none, not one a rerun refuses
        shutil.rmtree(root, ignore_errors=True)
        if isinstance(error, OSError):
            raise UsageError(f"cannot write to --root {root}: {error.strerror or error}") from None
        raise


def write_tree(root, train_total, val_per_class):
    """The fake tree's folders and files under root (an empty folder)."""
    from PIL import Image

    val_index = 0
    for i in range(CLASSES):
        name = f"n{1440764 + 7919 * i:08d}"
        train_dir, val_dir, source = f"{root}/train/{name}", f"{root}/val/{name}", f"{root}/train/{name}/{name}_1.JPEG"
        os.makedirs(train_dir)
        os.makedirs(val_dir)
        Image.new("RGB", (64, 64), (i * 37 % 256, i * 91 % 256, i * 173 % 256)).save(source, format="JPEG")
        for k in range(2, train_total // CLASSES + (i < train_total % CLASSES) + 1):
            os.link(source, f"{train_dir}/{name}_{k}.JPEG")
        for _ in range(val_per_class):
            val_index += 1
            os.link(source, f"{val_dir}/ILSVRC2012_val_{val_index:08d}.JPEG")


def read(path):
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError:  # the process has gone, or is not ours
        return b""


def marked(token):
    """{pid: environment} of the processes whose environment carries MARK=token."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        environ = read(f"/proc/{pid}/environ").decode(errors="replace").split("\0")
        if f"{MARK}={token}" in environ:
            found[int(pid)] = dict(item.partition("=")[::2] for item in environ)
    return found


def snapshot(token):
    """CPU seconds of the marked processes together; VmHWM (MiB) of each training process, by rank."""
    cpu, hwm = 0.0, {}
    for pid, environ in marked(token).items():
        stat = read(f"/proc/{pid}/stat").decode().rpartition(")")[2].split()
        cpu += sum(map(int, stat[11:15])) / os.sysconf("SC_CLK_TCK")  # utime, stime, cutime, cstime
        cmdline = read(f"/proc/{pid}/cmdline")
        # Not torchrun's agent, nor a loader worker (forked: its parent's command line).
        if (
            b"train_d" in cmdline
            and b"torch.distributed.run" not in cmdline
            and read(f"/proc/{stat[1]}/cmdline") != cmdline
        ):
            status = dict(line.split(":", 1) for line in read(f"/proc/{pid}/status").decode().splitlines())
            hwm[int(environ.get("RANK", 0))] = int(status["VmHWM"].split()[0]) / 1024
    return cpu, hwm


def run(command, timeout, stop_at=None, **env):
    """Run command in a new session until it exits, or prints a line starting with stop_at; then kill it and
    everything it started. Returns ({"data:"/stop_at/"exit": seconds from launch}, output lines, snapshot)."""
    token = uuid.uuid4().hex
    what = shlex.join(["python", *(["-c", "CHILD", *command[3:]] if command[1] == "-c" else command[1:])])
    environ = {k: v for k, v in os.environ.items() if k not in DROP and not k.startswith(("TORCHELASTIC_", "SLURM_"))}
    environ.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO, **env, **{MARK: token})
    lines, seen, output, start = queue.Queue(), {}, [], time.perf_counter()
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )

    def reader():  # lines as they come, then None at the end of the output
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    try:
        while stop_at not in seen and "exit" not in seen:
            try:
                line = lines.get(timeout=max(0.01, start + timeout - time.perf_counter()))
            except queue.Empty:  # (a slow machine, or a --timeout too short for this scale)
                error = UsageError(f"{what} did not end within --timeout {timeout:g} s: give it more")
                error.exit_code = 1
                raise error from None
            if line is None:
                if proc.wait(timeout=30) != 0 or stop_at:
                    check_child(what, subprocess.CompletedProcess(command, proc.returncode or 1, "".join(output)))
                seen["exit"] = time.perf_counter() - start
                continue
            output.append(line)
            for prefix in filter(line.startswith, filter(None, ("data:", stop_at))):
                seen.setdefault(prefix, time.perf_counter() - start)
        return seen, output, snapshot(token) if stop_at else None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for _ in range(3):  # and the marked processes outside the group (torchrun's workers have their own)
            for pid in marked(token):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        proc.wait(timeout=30)


def measure(root, opts, index):
    """One round: {row: {column: value}}."""
    rows = {}
    for what in ("torch", "imagefolder", "scan"):
        load = os.getloadavg()[0]
        seen, output, _ = run([sys.executable, "-c", CHILD, what, root], opts.timeout)
        rows[what] = {"wall": seen["exit"], **json.loads(output[-1]), "load": load}
    train = [
        "--data",
        root,
        "-a",
        "resnet18",
        "-b",
        str(BATCH),
        "-j",
        "1",
        "--train-crop-size",
        "32",
        "--val-resize-size",
        "32",
        "--val-crop-size",
        "32",
        "-p",
        "1",
        "--epochs",
        "1",
        "--output-dir",
    ]
    torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={opts.nproc}", "train_ddp.py"]
    for mode, launch, env in (("dp", ["train_dp.py"], {}), ("ddp", torchrun, {"OMP_NUM_THREADS": "1"})):
        if mode == "ddp" and opts.ddp_rounds is not None and index >= opts.ddp_rounds:
            continue
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="startup-") as scratch:
            seen, _, (cpu, hwm) = run([sys.executable, *launch, *train, scratch + "/out"], opts.timeout, STEP, **env)
        others = [value for rank, value in hwm.items() if rank != 0]
        rows[mode] = {
            "wall": seen[STEP],
            "data": seen.get("data:"),
            "cpu": cpu,
            "load": load,
            "hwm": hwm[0],
            "others": f"{min(others):.0f}-{max(others):.0f}" if others else None,
        }
    return rows


def table(rounds, nproc):
    def cells(row, key, digits=1):
        values = [r[row].get(key) for r in rounds if row in r]
        if all(v is None for v in values):
            return "-"
        return " / ".join("-" if v is None else v if isinstance(v, str) else f"{v:.{digits}f}" for v in values)

    labels = {
        "torch": "`import torch`, launch to exit: the floor of every process",
        "imagefolder": "old: `ImageFolder(train)` + `ImageFolder(val)`, in every process",
        "scan": "new: `scan_image_folder(root)`, on rank 0 once per job",
        "dp": "`train_dp.py`: launch to first step",
        "ddp": f"`torchrun --nproc_per_node={nproc} train_ddp.py`: launch to first step",
    }
    lines = [
        "| measurement | processes | CPU s | wall s | wall to `data:` line s | pickled MiB | peak RSS MiB "
        "(rank 0) | others' peak RSS MiB | load (1 min) |",
        "|---" * 9 + "|",
    ]
    for row, label in labels.items():
        if any(row in r for r in rounds):
            lines.append(
                f"| {label} | {nproc if row == 'ddp' else 1} | "
                + " | ".join(
                    cells(row, key, digits)
                    for key, digits in (
                        ("cpu", 1),
                        ("wall", 1),
                        ("data", 1),
                        ("pickled", 1),
                        ("hwm", 0),
                        ("others", 0),
                        ("load", 2),
                    )
                )
                + " |"
            )
    return "\n".join(lines)


def main():
    parser = Parser(description=__doc__ and __doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        help="where the fake tree is built and kept (default /tmp/fake-imagenet, "
        "or /tmp/fake-imagenet-SCALE below full scale)",
    )
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of ImageNet's files (default 1)")
    parser.add_argument("--repeats", type=whole(1), default=2, help="rounds of measurements (default 2)")
    parser.add_argument("--nproc", type=whole(1), default=8, help="torchrun --nproc_per_node (default 8)")
    parser.add_argument("--ddp-rounds", type=whole(0), help="rounds with the torchrun run (default: all; 0: none)")
    parser.add_argument("--timeout", type=seconds, default=600, help="seconds per subprocess (default 600)")
    opts = parser.parse_args()
    if not 0 < opts.scale <= 1:
        parser.error("--scale must be in (0, 1]")
    if BATCH % opts.nproc:  # (was: a traceback of torchrun's run after the scans, at full scale minutes later)
        parser.error(f"--nproc {opts.nproc} does not divide the training runs' batch of {BATCH}")
    root = os.path.abspath(
        opts.root or ("/tmp/fake-imagenet" if opts.scale == 1 else f"/tmp/fake-imagenet-{opts.scale:g}")
    )
    build_tree(root, opts.scale)
    rounds = []
    for index in range(opts.repeats):
        print(f"round {index + 1} of {opts.repeats} (load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
        rounds.append(measure(root, opts, index))
    import torch

    print(
        f"{os.cpu_count()} CPU cores, no GPU (CUDA_VISIBLE_DEVICES=''), torch {torch.__version__}; {root}: "
        f"{round(FULL_TRAIN * opts.scale):,} train + {max(1, round(VAL_PER_CLASS * opts.scale)) * CLASSES:,} val "
        f"files, warm page cache; rounds separated by ' / '.\n"
    )
    print(table(rounds, opts.nproc))
    print(
        "\nCPU s: of the whole process (import torch), of the call (scans), of all the job's processes until the "
        "first step (training: torchrun's agent and loader workers included). Wall s: launch to exit, the call, "
        "launch to the first step. Peak RSS: VmHWM at exit, or of the training processes at the first step."
    )
    if opts.scale < 1:
        print(
            f"\nScale {opts.scale:g}: the scans grow about linearly with the file count (x{1 / opts.scale:g} "
            "estimates full scale, a little high: per-class costs do not grow), and a launch grows by its scan "
            "only; none of the figures above is extrapolated."
        )


if __name__ == "__main__":
    sys.exit(run_tool(until_stopped(main)))

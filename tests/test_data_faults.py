"""Broken data and the faults it brings, with real files, processes and signals: an undecodable
image is skipped and reported (or, with --strict-data, ends the run in one line); and no fault
leaves a process hanging: an error while loader workers run, a loader worker killed, a stop
signal while the main process waits for data that never comes (a FIFO named like a JPEG, as a
hung network file system). Every job is checked to have ended with all its processes."""

import contextlib
import io
import json
import os
import random
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from conftest import hf_copy, make_image_folder, tiny_folder
from harness.ahead import SideBySide, ahead, once
from harness.jobs import Job, no_traceback_of_ours, run, torchrun_command
from harness.processes import PYTHON, REPO, clean_env, free_port

RUN = [
    "-a",
    "tests.tiny_models:TinyNet",
    "--train-crop-size",
    "32",
    "--val-resize-size",
    "32",
    "--val-crop-size",
    "32",
    "-p",
    "1",
    "--seed",
    "0",
]
PREEMPTED = 75
pytestmark = pytest.mark.faults


def launch(mode, *args):
    """The command that starts `mode` with 2 processes (dp: one), as a user types it."""
    if mode == "dp":
        return [PYTHON, REPO / "train_dp.py", *args]
    if mode == "ddp":
        return torchrun_command("train_ddp.py", 2, *args)
    return [PYTHON, REPO / "train_spawn.py", "--nproc-per-node", "2", "--master-port", free_port(), *args]


def finish(job, timeout=120):
    """Wait for the job; it must end by itself, and leave no process behind (none alive 5 s after the
    launcher ended; Job.finish kills those, after noting them)."""
    returncode, output = job.finish(timeout=timeout)
    assert not job.left_behind, f"processes left behind: {job.left_behind}\n{output[-3000:]}"
    return returncode, output


def finish_all(jobs, timeout=240):
    """{name: (returncode, output, processes left behind)} of jobs started together; each must end by
    itself (else it is killed, and its test fails on its output)."""
    ended = {}
    for name, job in jobs.items():
        try:
            returncode, output = job.finish(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode, output = None, "".join(job.output) + f"\n[did not end within {timeout} s]"
        ended[name] = (returncode, output, job.left_behind)
    return ended


@contextlib.contextmanager
def killed_on_error(jobs):
    """Jobs started together by a fixture: if one fails to do its part, none is left running."""
    try:
        yield
    except BaseException:
        for job in jobs.values():
            job.kill()
        raise


def ended_cleanly(runs, name):
    """(returncode, output) of the run `name`, which left no process behind."""
    returncode, output, left_behind = runs[name]
    assert returncode is not None and not left_behind, f"left behind: {left_behind}\n{output[-3000:]}"
    return returncode, output


def jpeg_bytes(mode="RGB", fmt="JPEG", size=(40, 40), color=(200, 30, 30)):
    buffer = io.BytesIO()
    Image.new(mode, size, {"L": 128, "I;16": 40000}.get(mode, color[: len(mode)])).save(buffer, fmt)
    return buffer.getvalue()


def damaged_png():
    """A PNG of digits and lines whose compressed image data (IDAT) has 64 bytes flipped from offset 720: PIL raises
    "broken data stream"; torchvision's decoder crashed the process on it (libpng's "IDAT: invalid distance too far
    back", then SIGSEGV)."""
    image, rng = Image.new("RGB", (64, 64), (255, 255, 255)), random.Random(0)
    draw = ImageDraw.Draw(image)
    for k in range(30):
        x, y = rng.randrange(64), rng.randrange(64)
        draw.text((x, y), str(k % 10), fill=(rng.randrange(256), 0, 0))
        draw.line((x, y, rng.randrange(64), rng.randrange(64)), fill=(0, rng.randrange(256), 0), width=2)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    data[720:784] = bytes(byte ^ 0xFF for byte in data[720:784])
    return bytes(data)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    return once(faulty_folder, tmp_path_factory)


def faulty_folder(tmp_path_factory):
    """The tiny shapes set, plus in train/ a truncated JPEG, an empty .jpg and a PNG with damaged data, in val/ random
    bytes named .jpg, and valid files in odd forms: CMYK and grayscale JPEG, PNG content under a .jpg name, RGBA PNG,
    16-bit grayscale PNG."""
    root = make_image_folder(tmp_path_factory.mktemp("faulty"), train_per_class=8, val_per_class=4)
    whole = next((root / "train" / "circle").iterdir()).read_bytes()
    bad = {
        root / "train" / "circle" / "truncated.jpg": whole[: len(whole) // 3],
        root / "train" / "square" / "empty.jpg": b"",
        root / "train" / "square" / "damaged.png": damaged_png(),
        root / "val" / "ring" / "garbage.jpg": os.urandom(2000),
    }
    odd = {
        root / "train" / "ring" / "cmyk.jpg": jpeg_bytes("CMYK", color=(0, 200, 200, 0)),
        root / "train" / "ring" / "gray.jpg": jpeg_bytes("L"),
        root / "train" / "square" / "png-inside.jpg": jpeg_bytes(fmt="PNG"),
        root / "train" / "circle" / "rgba.png": jpeg_bytes("RGBA", fmt="PNG", color=(0, 0, 255, 100)),
        root / "train" / "circle" / "gray16.png": jpeg_bytes("I;16", fmt="PNG"),
    }
    for path, content in {**bad, **odd}.items():
        path.write_bytes(content)
    return root, sorted(str(path) for path in bad), sorted(str(path) for path in odd)


# ----------------------------------------------------------------------------- skipped and reported


def runs_on_faulty_data(faulty, tiny_data, out):
    """The runs on broken data that go to their end by themselves, started together (name -> (returncode,
    output, left behind), and their output directories): DataParallel and DDP on the faulty set; each
    launch mode with --strict-data; an error in training (FailingNet) while loader workers run; and a
    bad file whose name is not UTF-8."""
    root, _, _ = faulty
    odd_name = make_image_folder(out / "odd-name-data", train_per_class=4, val_per_class=2)
    (odd_name / "train" / "ring" / os.fsdecode(b"broken-\xff.jpg")).write_bytes(b"not an image")
    commands = {
        "skipped-dp": launch(
            "dp", *RUN, "--data", root, "-b", "8", "-j", "2", "--epochs", "2", "--output-dir", out / "skipped-dp"
        ),
        "skipped-ddp": launch(
            "ddp", *RUN, "--data", root, "-b", "8", "-j", "1", "--epochs", "1", "--output-dir", out / "skipped-ddp"
        ),
        **{
            f"strict-{mode}": launch(
                mode,
                *RUN,
                "--data",
                root,
                "-b",
                "8",
                "-j",
                "1",
                "--strict-data",
                "--output-dir",
                out / f"strict-{mode}",
            )
            for mode in ("dp", "ddp", "spawn")
        },
        "error-dp": launch(
            "dp",
            *RUN,
            "--data",
            tiny_data,
            "-b",
            "4",
            "-j",
            "2",
            "-a",
            "tests.tiny_models:FailingNet",
            "--output-dir",
            out / "error-dp",
        ),
        "odd-name-dp": launch(
            "dp", *RUN, "--data", odd_name, "-b", "4", "-j", "1", "--epochs", "2", "--output-dir", out / "odd-name-dp"
        ),
    }
    return finish_all({name: Job(command) for name, command in commands.items()})


def test_undecodable_images_are_skipped_warned_once_listed_and_counted(faulty, faulty_runs):
    _, bad, _ = faulty
    runs, out = faulty_runs
    returncode, output = ended_cleanly(runs, "skipped-dp")
    assert returncode == 0, output[-3000:]
    warned = re.findall(r"^warning: skipped (\S+): cannot decode it \(.+\)$", output, re.MULTILINE)
    assert sorted(warned) == bad, output  # once each, in two epochs
    listed = (out / "skipped-dp" / "bad_images.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in listed] == bad
    rows = (out / "skipped-dp" / "log.csv").read_text().splitlines()
    column = rows[0].split(",").index("bad_images")
    assert [row.split(",")[column] for row in rows[1:]] == ["4", "4"]
    assert json.loads((out / "skipped-dp" / "summary.json").read_text())["bad_images"] == 4
    assert re.findall(r"\((\d+) images\)", output) == ["12", "12"]  # 13 files in val/, one unreadable
    assert "Traceback" not in output


def test_ddp_ranks_pool_the_files_they_skipped(faulty, faulty_runs):
    _, bad, _ = faulty
    runs, out = faulty_runs
    returncode, output = ended_cleanly(runs, "skipped-ddp")
    assert returncode == 0, output[-3000:]
    assert sorted(set(re.findall(r"warning: rank [01]: skipped (\S+): cannot decode it", output))) == bad
    assert [line.split("\t")[0] for line in (out / "skipped-ddp" / "bad_images.txt").read_text().splitlines()] == bad
    assert json.loads((out / "skipped-ddp" / "summary.json").read_text())["bad_images"] == 4
    assert re.findall(r"\((\d+) images\)", output) == ["12"]


@pytest.mark.parametrize("mode", ["dp", "ddp", "spawn"])
def test_strict_data_ends_the_run_at_the_first_bad_file_in_one_line(faulty, faulty_runs, mode):
    _, bad, _ = faulty
    returncode, output = ended_cleanly(faulty_runs[0], f"strict-{mode}")
    assert returncode != 0
    named = re.findall(r"^error: (?:rank \d: )?cannot decode (\S+) \(.*\); without --strict-data", output, re.MULTILINE)
    assert named and set(named) <= set(bad), output[-3000:]
    # Every other error line is a rank that lost its peer to it, saying so in one line.
    others = [line for line in output.splitlines() if line.startswith("error:") and "cannot decode" not in line]
    assert all(re.match(r"error: (rank \d: )?another process of this job ended", line) for line in others), others
    assert no_traceback_of_ours(output), output[-3000:]


def test_a_damaged_png_is_an_unreadable_file_in_a_process_that_goes_on(tmp_path):
    """A file (ImageFiles) and bytes (a shard's sample, a Hugging Face row: decode_bytes) alike, under its own name or
    a .jpg one: the decoder's error, which the loaders skip and name; never the process killed (SIGSEGV: exit -11)."""
    path = tmp_path / "damaged.png"
    path.write_bytes(damaged_png())
    (tmp_path / "damaged-png.jpg").write_bytes(damaged_png())
    script = f"""
from common.datasets import decode_bytes, decoded, load_image
from common.errors import UnreadableFile
data = open({str(path)!r}, "rb").read()
for name, read in [("file", lambda: load_image({str(path)!r})),
                   ("file named .jpg", lambda: load_image({str(tmp_path / "damaged-png.jpg")!r})),
                   ("bytes", lambda: decode_bytes(data, "png")),
                   ("bytes named .jpg", lambda: decode_bytes(data, "jpg"))]:
    try:
        decoded(read)
    except UnreadableFile as error:
        print(f"{{name}}: {{error}}")
"""
    result = run([PYTHON, "-c", script], env=clean_env(), timeout=120)
    assert result.returncode == 0, result.stdout[-2000:]
    lines = [line for line in result.stdout.splitlines() if not line.startswith("libpng")]
    assert lines == [
        f"{name}: broken data stream when reading image file"
        for name in ("file", "file named .jpg", "bytes", "bytes named .jpg")
    ], result.stdout


# ----------------------------------------------------------------------------- no fault hangs


def test_an_error_in_training_ends_the_run_and_its_loader_workers(faulty_runs):
    """DataParallel; torchrun and spawn: test_distributed.py, a rank that raises."""
    returncode, output = ended_cleanly(faulty_runs[0], "error-dp")
    assert returncode != 0 and "the failure this test model makes at training step 3" in output, output[-3000:]


def loader_workers(job):
    """The job's DataLoader workers: the processes that torch names pt_data_worker."""
    workers = []
    for pid in job.leftovers():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == "pt_data_worker":
                workers.append(pid)
    return workers


@pytest.fixture(scope="module")
def long_epoch_data(tmp_path_factory):
    return once(long_epoch_data_folder, tmp_path_factory)


def long_epoch_data_folder(tmp_path_factory):
    """180 training images: an epoch of 45 steps of batch 4, time enough to kill a loader worker in it."""
    return make_image_folder(tmp_path_factory.mktemp("long-epoch"), train_per_class=60, val_per_class=2)


LOADER_WORKERS = {"dp": 2, "ddp": 4, "spawn": 4}  # -j 2 in each process


def wait_for_loader_workers(job, count, timeout=60):
    """The job's `count` loader workers, once they all exist (on a busy machine a step may be printed before the
    last one shows in /proc); fails saying how many there were if they do not come within `timeout` s."""
    deadline = time.monotonic() + timeout
    while len(workers := loader_workers(job)) < count:
        assert time.monotonic() < deadline, f"{len(workers)} of {count} loader workers after {timeout} s"
        time.sleep(0.1)
    return workers


def runs_with_a_killed_loader_worker(long_epoch_data, out):
    """A run of each launch mode, started together, each with one of its loader workers SIGKILLed at
    step 3: mode -> (loader workers found, (returncode, output, left behind)). One epoch: a run whose fault
    went unnoticed ends in seconds, not at a time limit. Step 4 takes 8 s longer on rank 0 (SlowFourthStep): once, in
    a fresh clone's suite, a DDP run's epoch of 45 steps ended before its loader workers were looked for."""
    jobs = {
        mode: Job(
            launch(
                mode,
                *RUN,
                "--data",
                long_epoch_data,
                "-b",
                "4",
                "-j",
                "2",
                "--epochs",
                "1",
                "--trainer",
                "tests.tiny_models:SlowFourthStep",
                "--output-dir",
                out / mode,
            )
        )
        for mode in ("dp", "ddp", "spawn")
    }

    def kill_a_loader_worker(mode):
        jobs[mode].wait_for(re.compile(r"^Epoch: \[0\] \[ *3/"), timeout=240)
        workers = wait_for_loader_workers(jobs[mode], LOADER_WORKERS[mode])
        os.kill(workers[0], signal.SIGKILL)
        return workers

    # Each job watched from a thread of its own: the one epoch of a job that started first must not end
    # while another is waited for.
    with SideBySide(len(jobs)) as pool, killed_on_error(jobs):
        found = dict(zip(jobs, pool.map(kill_a_loader_worker, jobs)))
    ended = finish_all(jobs)
    return {mode: (found[mode], ended[mode]) for mode in jobs}


@pytest.mark.parametrize("mode", ["dp", "ddp", "spawn"])
def test_a_loader_worker_killed_ends_the_run(killed_loader_workers, mode):
    workers, _ = killed_loader_workers[mode]
    assert len(workers) == LOADER_WORKERS[mode], workers
    returncode, output = ended_cleanly({mode: killed_loader_workers[mode][1]}, mode)
    assert returncode != 0
    # As the kernel's OOM killer would: the loader reports the dead worker, in one line of ours (also when it
    # died while sending a batch: DeviceLoader turns the broken hand-over into the same report).
    assert re.search(
        r"^error: (rank \d: )?DataLoader worker (\(pids?\(?s?\)? ?[\d, ]+\)? )?(is killed by signal|exited "
        r"unexpectedly)",
        output,
        re.MULTILINE,
    ), output[-3000:]
    assert no_traceback_of_ours(output), output[-3000:]


def side_by_side_runs(tmp_path_factory):
    """The module's runs, side by side, a thread each (most of their time is spent starting processes,
    and waiting): the runs on faulty data, the runs whose loader worker is killed, and the runs stopped
    while blocked on data. name -> what they gave, or the exception raised."""
    faulty, tiny_data, long_epoch_data = (
        once(folder, tmp_path_factory) for folder in (faulty_folder, tiny_folder, long_epoch_data_folder)
    )
    groups = {
        "faulty": lambda out: runs_on_faulty_data(faulty, tiny_data, out),
        "killed": lambda out: runs_with_a_killed_loader_worker(long_epoch_data, out),
        "blocked": lambda out: runs_stopped_while_blocked(out),
    }
    folders = {name: tmp_path_factory.mktemp(name) for name in groups}
    with SideBySide(len(groups)) as pool:
        futures = {name: pool.submit(group, folders[name]) for name, group in groups.items()}
    return {name: (futures[name].exception() or futures[name].result(), folders[name]) for name in groups}


side_by_side = ahead(side_by_side_runs, "side_by_side")


def outcome(side_by_side, name):
    result, folder = side_by_side[name]
    if isinstance(result, BaseException):
        raise result
    return result, folder


@pytest.fixture(scope="module")
def faulty_runs(side_by_side):
    return outcome(side_by_side, "faulty")


@pytest.fixture(scope="module")
def killed_loader_workers(side_by_side):
    return outcome(side_by_side, "killed")[0]


@pytest.fixture(scope="module")
def stopped_while_blocked(side_by_side):
    return outcome(side_by_side, "blocked")[0]


HUNG = "tests.custom_datasets:training_items_never_come"  # (a hung network file system's reads)

# name: (mode, signals); each signal is sent 3 s after the job said it asks for its first batch, a second
# one 6 s after the first (copies of one request come within milliseconds: see the next test).
BLOCKED = {
    "sigterm-dp": ("dp", [signal.SIGTERM]),
    "sigterm-ddp": ("ddp", [signal.SIGTERM]),
    "sigterm-spawn": ("spawn", [signal.SIGTERM]),
    "second-sigterm-dp": ("dp", [signal.SIGTERM, signal.SIGTERM]),
    "sigint-dp": ("dp", [signal.SIGINT]),
    "sigint-spawn": ("spawn", [signal.SIGINT]),
}


def runs_stopped_while_blocked(root):
    """Every job of BLOCKED, each waiting for data that never comes, stopped by its signals; started
    together, so that their waits (10 s of grace after a SIGTERM) overlap. name -> (returncode, output,
    processes left behind)."""
    jobs = {
        name: Job(launch(mode, *RUN, "--dataset", HUNG, "-b", "2", "-j", "1", "--output-dir", root / name))
        for name, (mode, _) in BLOCKED.items()
    }
    with killed_on_error(jobs):
        for job in jobs.values():
            job.wait_for(re.compile(r"^output: "), timeout=240)  # printed just before the first batch is asked for
        time.sleep(3)
        for name, (_, signals) in BLOCKED.items():
            jobs[name].process.send_signal(signals[0])
        time.sleep(6)
        for name, (_, signals) in BLOCKED.items():
            for signum in signals[1:]:
                jobs[name].process.send_signal(signum)
    return finish_all(jobs)


@pytest.mark.parametrize("mode", ["dp", "ddp", "spawn"])
def test_sigterm_while_waiting_for_data_that_never_comes_ends_the_run(stopped_while_blocked, mode):
    returncode, output = ended_cleanly(stopped_while_blocked, f"sigterm-{mode}")
    assert "stopped on SIGTERM after waiting 10 s for data: no checkpoint of this step" in output, output[-3000:]
    assert returncode == PREEMPTED if mode != "ddp" else returncode != 0  # torchrun: its own code
    assert no_traceback_of_ours(output), output[-3000:]


def test_a_second_sigterm_stops_at_once(stopped_while_blocked):
    returncode, output = ended_cleanly(stopped_while_blocked, "second-sigterm-dp")
    assert returncode == PREEMPTED
    assert "stopped at once on a second SIGTERM: no checkpoint of this step" in output, output[-3000:]
    assert "after waiting" not in output


@pytest.mark.parametrize("mode", ["dp", "spawn"])
def test_sigint_while_waiting_for_data_stops_at_once(stopped_while_blocked, mode):
    returncode, output = ended_cleanly(stopped_while_blocked, f"sigint-{mode}")
    assert returncode == 130, output[-3000:]
    assert no_traceback_of_ours(output), output[-3000:]


def test_the_same_sigterm_twice_still_stops_at_a_step_with_a_checkpoint(tiny_data, tmp_path):
    """Slurm signals every process of a step and torchrun passes its own SIGTERM on: copies of one
    request arrive together, and must not cut the clean stop short."""
    job = Job(launch("dp", *RUN, "--data", tiny_data, "-b", "4", "-j", "1", "--epochs", "5", "--output-dir", tmp_path))
    job.wait_for(re.compile(r"^Epoch: \[1\] \[ *2/"))
    job.process.send_signal(signal.SIGTERM)
    job.process.send_signal(signal.SIGTERM)
    returncode, output = finish(job)
    assert returncode == PREEMPTED and re.search(r"stopped on SIGTERM: checkpoint of epoch 1 step \d", output), output[
        -3000:
    ]
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["step_in_epoch"] >= 2


def test_a_bad_file_whose_name_is_not_utf8_is_listed_by_its_bytes(faulty_runs):
    runs, out = faulty_runs
    returncode, output = ended_cleanly(runs, "odd-name-dp")
    assert returncode == 0, output[-3000:]
    assert re.search(r"^warning: skipped \S+/broken-\\xff\.jpg: cannot decode it", output, re.MULTILINE), output
    path = out / "odd-name-data" / "train" / "ring" / os.fsdecode(b"broken-\xff.jpg")
    assert (out / "odd-name-dp" / "bad_images.txt").read_bytes().startswith(os.fsencode(str(path)))


NODE_COPIES = """
import os, sys, types
import torch.distributed as dist
from common.datasets import build_datasets
from common.errors import UsageError
from common.hf_datasets import load_splits
dist.init_process_group("gloo")
rank, said = int(os.environ["RANK"]), []
for first in range(1, len(sys.argv), 2):  # each rank its own node's copy: the pairs of paths in turn
    config = types.SimpleNamespace(dummy=False, dataset_fn=None, data=sys.argv[first + rank], dataset=None)
    try:
        (load_splits(config.data) if first == 1 else build_datasets(config))
        said.append("loaded")
    except UsageError as error:
        said.append(f"refused: {error}")
dist.destroy_process_group()
with open(os.path.join(os.environ["OUT"], f"rank{rank}.txt"), "w") as file:  # (not stdout: the ranks' lines mix)
    file.write("\\n".join(said))
"""


def test_nodes_whose_copies_of_the_data_differ_stop_every_rank_in_one_line(tiny_data, tmp_path):
    """Each rank its own copy (torchrun, 2 processes, gloo), every rank stops with one line, the other's prefixed:
    - rank 1's copy of the Hub's parquet files lacks the second of its train files (a download cut short; was, with
      the check in the detection: rank 1 alone, the other in gloo's traceback or, on NCCL, waiting);
    - rank 0's a Hugging Face dataset, rank 1's an image folder (was: rank 1 unpacked rank 0's None);
    - rank 1's train.csv without val.csv (was: refused on rank 1 alone, rank 0 left in the gather)."""
    whole = hf_copy(tiny_data, tmp_path / "whole", "parquet")
    cut = hf_copy(tiny_data, tmp_path / "cut", "parquet")
    (cut / "data" / "train-00000-of-00001.parquet").rename(cut / "data" / "train-00000-of-00002.parquet")
    half = tmp_path / "half"
    half.mkdir()
    (half / "train.csv").write_text("a.jpg,0\n")
    script = tmp_path / "load.py"
    script.write_text(NODE_COPIES)
    env = clean_env(PYTHONPATH=REPO, HF_DATASETS_CACHE=tmp_path / "hf-cache", OUT=tmp_path)
    job = Job(torchrun_command(script, 2, whole, cut, whole, tiny_data, tiny_data, half, prewarmed=False), env=env)
    returncode, output = job.finish(timeout=120)
    missing = f"--data {cut}: data/train-00001-of-00002.parquet is missing (a download cut short?)"
    kinds = "rank 0's copy holds a Hugging Face dataset, rank 1's an image folder (1 of 2 ranks differ): each node's"
    half_line = f"--data {half} has train.csv but no val.csv: give both splits"
    assert returncode == 0, output[-3000:]
    said = sorted(line for rank in (0, 1) for line in (tmp_path / f"rank{rank}.txt").read_text().splitlines())
    expected = [f"refused: {missing}", f"refused: rank 1: {missing}", f"refused: {half_line}"]
    expected += [f"refused: rank 1: {half_line}"]
    expected += [f"refused: --data {path}: {kinds} must be the same" for path in (whole, tiny_data)]
    assert said == sorted(expected), said

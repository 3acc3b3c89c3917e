"""The benchmarks of tools/ (benchmark.py, benchmark_shards.py, benchmark_startup.py, benchmark_fsdp.py) on bad input:
one line, `error: ...` (argparse's `PROG: error: ...`), exit code 2, never a traceback, nothing left half-built. Each
main() is run in-process as its `__main__` runs it (shared.run_tool), and one run of each error path as a real
process; a training script's own error line, given on by a benchmark that started it."""

import os
import re
import shlex
import signal
import socket
import sys
import time
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from harness.jobs import Job, no_traceback_of_ours, run
from harness.processes import PYTHON, REPO, clean_env

sys.path.insert(0, str(REPO / "tools"))
import benchmark  # noqa: E402
import benchmark_fsdp  # noqa: E402
import benchmark_shards  # noqa: E402
import benchmark_startup  # noqa: E402
import make_shards  # noqa: E402
import prepare_imagenet  # noqa: E402
from common.errors import UsageError  # noqa: E402
from shared import check_child, run_tool  # noqa: E402

pytestmark = pytest.mark.e2e

TOOLS = {
    "benchmark.py": benchmark,
    "benchmark_shards.py": benchmark_shards,
    "benchmark_startup.py": benchmark_startup,
    "benchmark_fsdp.py": benchmark_fsdp,
}


def one_error_line(capsys, tool, *args):
    """`tool`'s main() with these arguments, in this process, as its __main__ runs it: exit code 2 and one line,
    no traceback; this process's signal handlers untouched."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", [str(REPO / "tools" / tool), *map(str, args)])
        # (benchmark.py --gpu becomes benchmark_gpu.py: here it would replace the test process)
        patch.setattr(os, "execv", lambda *exec_args: pytest.fail(f"os.execv{exec_args[1][1:]}: another program"))
        try:
            code = run_tool(TOOLS[tool].main)
        except SystemExit as exit:  # argparse's
            code = exit.code
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    out, err = capsys.readouterr()
    lines = (out + err).strip().splitlines()
    assert code == 2 and len(lines) == 1 and re.match(rf"({re.escape(tool)}: )?error: ", lines[0]), out + err
    return lines[0]


@pytest.mark.parametrize(
    "tool, args, expected",
    [
        ("benchmark.py", ["--quick", "--batches", "0"], "argument --batches: '0': expected a whole number"),
        ("benchmark.py", ["--gpu", "--quick"], "--gpu runs tools/benchmark_gpu.py, which takes none of --quick: leave"),
        ("benchmark.py", ["--quick", "--batches", "32,x"], "argument --batches: 'x': expected a whole number"),
        ("benchmark.py", ["--quick", "--workers", "-1"], "argument --workers: '-1': expected a whole number"),
        ("benchmark.py", ["--quick", "--arch", "nonexist"], "'nonexist': no torchvision classification model"),
        ("benchmark.py", ["--crop", "0"], "argument --crop: '0': expected a whole number of at least 1"),
        ("benchmark.py", ["--res-compare", "24,x"], "argument --res-compare: 'x': expected a whole number"),
        ("benchmark.py", ["--channels-last-compare", "--models", "resnet18"], "'resnet18': expected ARCH:PX"),
        ("benchmark.py", ["--channels-last-compare", "--models", "nope:64"], "'nope': no torchvision classification"),
        ("benchmark.py", ["--quick", "--jpeg-dir", "{tmp}/nowhere"], "--jpeg-dir {tmp}/nowhere: expected an Image"),
        ("benchmark_shards.py", ["--images", "0"], "argument --images: '0': expected a whole number"),
        ("benchmark_shards.py", ["--jpeg-dir", "{tmp}/nowhere"], "--jpeg-dir {tmp}/nowhere: expected an ImageFolder"),
        ("benchmark_startup.py", ["--root", "/proc/no-such-tree"], "cannot write to --root /proc/no-such-tree: No "),
        ("benchmark_startup.py", ["--root", "{tmp}/a-file/tree"], "cannot write to --root {tmp}/a-file/tree: Not a "),
        ("benchmark_startup.py", ["--root", "{tmp}", "--scale", "0.001"], "--root {tmp} exists and is not a tree"),
        ("benchmark_startup.py", ["--nproc", "0"], "argument --nproc: '0': expected a whole number"),
        ("benchmark_startup.py", ["--nproc", "3"], "--nproc 3 does not divide the training runs' batch of 16"),
        ("benchmark_startup.py", ["--timeout", "nan"], "argument --timeout: 'nan': expected a number of seconds"),
        ("benchmark_fsdp.py", ["--processes", "0"], "argument --processes: '0': expected a whole number"),
        ("benchmark_fsdp.py", ["--arch", "nonexist"], "'nonexist': no torchvision classification model"),
    ],
)
def test_bad_input_to_a_benchmark_is_one_line_and_exit_code_2(capsys, tmp_path, tool, args, expected):
    (tmp_path / "a-file").write_text("")
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    assert expected.replace("{tmp}", str(tmp_path)) in one_error_line(capsys, tool, *args)
    assert [path.name for path in tmp_path.iterdir()] == ["a-file"]  # nothing made, nothing left


def test_each_benchmark_s_main_ends_a_bad_input_in_one_line_as_a_process(tmp_path):
    """What the in-process runs cannot see: the scripts' `__main__` (sys.exit(run_tool(main))), the exit code and
    the line as a process ends with them."""
    for tool, args in (
        ("benchmark.py", ["--quick", "--jpeg-dir", tmp_path / "nowhere"]),
        ("benchmark_shards.py", ["--jpeg-dir", tmp_path / "nowhere"]),
        ("benchmark_startup.py", ["--root", "/proc/no-such-tree"]),
        ("benchmark_fsdp.py", ["--processes", "0"]),
    ):
        result = run([PYTHON, REPO / "tools" / tool, *args], timeout=120)
        lines = result.stdout.splitlines()
        assert result.returncode == 2 and len(lines) == 1 and "error: " in lines[0], (tool, result.stdout[-3000:])
        assert no_traceback_of_ours(result.stdout)


def test_a_training_script_s_error_line_is_given_on_as_the_benchmark_s_own(tmp_path):
    """benchmark.py starts the training scripts: one that refuses its input ends the benchmark with its line, said of
    it, exit code 2 (1 where the script's was 1); one that wrote no such line is a bug, reported with its output."""
    result = run([PYTHON, REPO / "train_dp.py", "--dummy", "-b", "0", "--output-dir", tmp_path / "out"], timeout=120)
    with pytest.raises(UsageError) as refused:
        check_child("train_dp.py", result)
    assert (str(refused.value), refused.value.exit_code) == ("train_dp.py: --batch-size must be positive, got 0", 2)
    with pytest.raises(UsageError) as failed:
        check_child("torchrun train_ddp.py", CompletedProcess([], 1, "...\nerror: rank 1 failed\n", ""))
    assert (str(failed.value), failed.value.exit_code) == ("torchrun train_ddp.py: rank 1 failed", 1)
    with pytest.raises(RuntimeError, match=r"(?s)spawn failed \(exit code 1\):.*Traceback"):
        check_child("spawn", CompletedProcess([], 1, "Traceback (most recent call last):\n", ""))
    check_child("train_dp.py", CompletedProcess([], 0, "error: in a line of a run that succeeded\n", ""))


def test_the_benchmarks_take_an_imagenet_folder_of_jpeg_files(tmp_path):
    """(was: refused, "expected an ImageFolder of JPEGs": *.jpg alone were looked for, and ImageNet's are *.JPEG)"""
    for name in ("train/n01440764/a.JPEG", "train/n01440764/b.jpeg", "train/n01440764/c.txt", "val/n01440764/d.JPEG"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * len(name))
    assert benchmark.jpeg_sizes(tmp_path) == [len("train/n01440764/a.JPEG"), len("train/n01440764/b.jpeg")]
    (tmp_path / "train/n01440764/e.JPEG").mkdir()  # a folder, and a link to nothing: not images (were tracebacks)
    (tmp_path / "train/n01440764/f.jpg").symlink_to(tmp_path / "nowhere.jpg")
    assert benchmark.jpeg_sizes(tmp_path) == [len("train/n01440764/a.JPEG"), len("train/n01440764/b.jpeg")]
    (tmp_path / "train/n01440764/g.jpg").write_bytes(b"")  # (was: a PIL traceback from a loader worker)
    with pytest.raises(UsageError, match=rf"^--jpeg-dir {tmp_path}: {tmp_path}/train/n01440764/g.jpg is empty: "):
        benchmark.jpeg_sizes(tmp_path)
    with pytest.raises(UsageError, match=rf"^--jpeg-dir: cannot decode {tmp_path}/train/n01440764/a.JPEG \("):
        benchmark.resize_compare(tmp_path, 8)  # (its files are not images: was a PIL traceback)
    with pytest.raises(UsageError, match=rf"^--jpeg-dir: cannot decode {tmp_path}/train/n01440764/a.JPEG \("):
        benchmark.pipeline_rates(tmp_path, 8)  # (was: a loader worker's traceback)
    from PIL import Image  # a PNG named .JPEG (ImageNet's train set holds one): PIL reads it, decode_jpeg does not

    for name in ("a.JPEG", "b.jpeg"):
        Image.new("RGB", (8, 8)).save(tmp_path / "train/n01440764" / name, format="JPEG" if name == "a.JPEG" else "PNG")
    (tmp_path / "train/n01440764/g.jpg").unlink()
    with pytest.raises(UsageError, match=rf"^--jpeg-dir: cannot decode {tmp_path}/train/n01440764/b.jpeg \(.*JPEG"):
        benchmark.pipeline_rates(tmp_path, 8)


def test_benchmark_fsdp_trains_a_model_with_auxiliary_heads():
    """(was: GoogLeNet's and Inception v3's tuples given to cross_entropy, a traceback in each rank)"""
    import torch
    import torchvision

    model = torchvision.models.get_model("googlenet", num_classes=10, aux_logits=True, init_weights=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.aux1.fc2.weight.detach().clone()
    benchmark_fsdp.train_steps(model, optimizer, torch.device("cpu"), steps=1)
    assert not torch.equal(before, model.aux1.fc2.weight)  # (its auxiliary head trained too)


def test_benchmark_fsdp_runs_a_rank_per_gpu_and_no_more():
    """Its default rows, 1, 2 and 4 processes, on a machine of one GPU: the row of 1 alone (was: an invalid device
    ordinal in rank 1 of the second row); more processes than GPUs asked for, one line."""
    assert benchmark_fsdp.process_counts(None, 0) == [1, 2, 4]  # (the CPU: as many as asked)
    assert benchmark_fsdp.process_counts(None, 1) == [1] and benchmark_fsdp.process_counts(None, 8) == [1, 2, 4]
    assert benchmark_fsdp.process_counts([3, 1], 0) == [3, 1] and benchmark_fsdp.process_counts([2], 2) == [2]
    with pytest.raises(UsageError, match=r"^--processes 4: this machine has 2 GPU\(s\), a process on each$"):
        benchmark_fsdp.process_counts([1, 4], 2)


def test_benchmark_shards_lists_its_imagenet_sized_indexes(tmp_path):
    """Its sparse shards hold their first and last members' tar headers, which read_index checks (without them, every
    index was refused and the listing ended in `UsageError: ... hold no sample`)."""
    seconds, index_bytes = benchmark_shards.index_listing(tmp_path, samples=5000, per_shard=2500)
    assert seconds > 0 and index_bytes > 0


def test_benchmark_s_training_table_ends_in_the_script_s_line_and_leaves_no_folder(tmp_path, tiny_data):
    """A training run that refuses its input (here LR from the environment, which the scripts read) ends
    benchmark.py with its line, said of it; the runs' folder (under TMPDIR) is removed, as after a table."""
    (tmp_path / "tmp").mkdir()
    for only in (["--quick", "--batches", "8"], ["--wait-compare"]):  # (--wait-compare's folder was left)
        command = [PYTHON, REPO / "tools" / "benchmark.py", *only, "--jpeg-dir", tiny_data]
        # (a new interpreter: the prewarm server has read TMPDIR already)
        result = run(command, env=clean_env(LR="x", TMPDIR=tmp_path / "tmp"), timeout=300, prewarmed=False)
        assert result.returncode == 2 and result.stdout.splitlines()[-1] == (
            "error: train_dp.py: environment variable LR='x' is not a valid float"
        ), result.stdout[-3000:]
        assert no_traceback_of_ours(result.stdout) and list((tmp_path / "tmp").glob("bench-*")) == [], only


def test_a_second_stop_signal_while_a_tool_stops_does_nothing():
    """tools/make_shards.py and tools/prepare_imagenet.py: `timeout` sends its SIGTERM on after the shell's, and the
    second one landed in main()'s cleanup of the first (a `shared.Stopped` traceback after the `stopped:` line)."""
    from shared import Stopped, stop_on_signals

    before = stop_on_signals()
    try:
        with pytest.raises(Stopped):
            signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # in the cleanup: nothing raised
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # (a third ends it at once)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_a_tool_whose_output_a_full_device_lost_ends_with_exit_code_1(capsys, monkeypatch):
    """A benchmark's table to a full device (`> table.md` there) was lost with exit code 0 (console_never_fails);
    to a pipe whose reader left (`| head`), the reader wanted no more: exit code 0."""
    from common.errors import _Console

    with open("/dev/full", "w") as full:
        monkeypatch.setattr(sys, "stdout", _Console(full, "stdout"))
        assert run_tool(lambda: print("| a | table |")) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: the output could not be written to stdout (No space left on device)"
    )


def test_a_tool_whose_console_cannot_be_written_finishes_its_work(tiny_data, tmp_path):
    """tools/make_shards.py with stdout to a full device: its shards written, OUT marked finished, exit code 0 (was:
    OSError's traceback at its first line of progress, OUT left unfinished)."""
    out = tmp_path / "shards"
    tool = shlex.join(map(str, [PYTHON, REPO / "tools" / "make_shards.py", tiny_data, out, "--workers", "1"]))
    result = run(["bash", "-c", f"{tool} >/dev/full 2>&1"], prewarmed=False, timeout=120)
    assert result.returncode == 0 and result.stdout == ""
    assert (out / "shards.json").is_file() and not list(out.glob(".unfinished*")), sorted(out.iterdir())


def test_the_command_a_tool_marks_its_output_with_runs_again_from_anywhere(tmp_path, monkeypatch):
    """`cd DIR && python /abs/tools/TOOL ARGS` (was `python tools/TOOL ARGS`: relative to where it ran); from a folder
    deleted since, without the `cd` (was: a FileNotFoundError traceback from os.getcwd)."""
    from shared import command_line

    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    tool = REPO / "tools" / "make_shards.py"
    assert command_line(tool, ["a b", "out"]) == f"cd {gone} && python {tool} 'a b' out"
    gone.rmdir()
    assert command_line(tool, ["a b", "out"]) == f"python {tool} 'a b' out"


def test_a_second_run_of_a_tool_on_an_out_being_written_is_refused_in_one_line_naming_the_first(
    tmp_path, tiny_data, capsys, monkeypatch
):
    """tools/make_shards.py and tools/prepare_imagenet.py: the second run removed the first one's files in progress
    (as a killed run's temporaries: the first ended on `cannot write ... No such file`), and whichever ended first
    marked OUT finished while the other still wrote it. The first here: another process in the tools' lock."""
    out = tmp_path / "out"
    holder = Job(
        [
            PYTHON,
            "-c",
            f"import sys, time; sys.path.insert(0, {str(REPO / 'tools')!r}); from shared import output_lock\n"
            f"with output_lock({str(out)!r}): print('held', flush=True); time.sleep(120)",
        ],
        prewarmed=False,
    )
    try:
        holder.wait_for(re.compile("^held"), timeout=60)
        refused = [
            f"error: {out} is being written by another run (PID {holder.process.pid} on {socket.gethostname()}): "
            "wait for it to end, then run this command again (it carries on)"
        ]
        assert make_shards.main([str(tiny_data), str(out), "--workers", "1"]) == 2
        assert capsys.readouterr().err.splitlines() == refused
        monkeypatch.setattr(sys, "argv", ["prepare_imagenet.py", str(tiny_data), str(out), "--workers", "1"])
        assert prepare_imagenet.main() == 2
        assert capsys.readouterr().err.splitlines() == refused
        assert sorted(path.name for path in out.iterdir()) == [".lock"]
    finally:
        holder.kill()
    assert holder.process.wait(timeout=30) is not None
    assert make_shards.main([str(tiny_data), str(out), "--workers", "1"]) == 0


def test_benchmark_shards_reads_the_paths_strace_escapes_as_the_files_names():
    """A byte outside printable ASCII is an octal escape in strace's output: a --jpeg-dir named café counted no image
    opened (0 in the table, nothing said)."""
    trace = '12 openat(AT_FDCWD, "/d/caf\\303\\251/a.jpg", O_RDONLY) = 3\n13 open("/d/x\\"y.tar", O_RDONLY) = 4\n'
    assert benchmark_shards.opened_paths(trace) == ["/d/café/a.jpg", '/d/x"y.tar']


def test_benchmark_startup_s_child_that_times_out_or_fails_is_one_line():
    """(was: a RuntimeError traceback with the child's whole script in it)"""
    with pytest.raises(UsageError) as timed_out:
        benchmark_startup.run([PYTHON, "-c", "import time; time.sleep(30)", "torch", "/root"], 1)
    assert (str(timed_out.value), timed_out.value.exit_code) == (
        "python -c CHILD torch /root did not end within --timeout 1 s: give it more",
        1,
    )
    with pytest.raises(UsageError, match=r"^python -c CHILD: RANK='x' is not a whole number$"):
        benchmark_startup.run([PYTHON, "-c", "print(\"error: RANK='x' is not a whole number\"); exit(2)"], 60)


def test_benchmark_startup_stopped_while_it_builds_its_tree_leaves_none(tmp_path):
    """SIGTERM to the tool alone, while it builds: the tree part-way was left, and every rerun refused it."""
    root = tmp_path / "tree"
    command = [PYTHON, REPO / "tools" / "benchmark_startup.py", "--root", root, "--scale", "0.1", "--nproc", "1"]
    job = Job(command, prewarmed=False)
    try:
        job.wait_for(re.compile("^building "), timeout=120)
        os.kill(job.process.pid, signal.SIGTERM)
        code, output = job.finish(timeout=60)
    finally:
        job.kill()
    assert code == 143 and output.splitlines()[-1] == "stopped: benchmark_startup.py ended by SIGTERM", output
    assert not root.exists() and no_traceback_of_ours(output)


def test_benchmark_fsdp_measures_and_a_stop_ends_its_torchrun_and_ranks(tmp_path):
    """A row of the table, measured by torchrun's ranks (was: each failed, since fsdp.Sharding read a flag the tool's
    Config lacked). Then SIGTERM to the tool alone, once torchrun started the next row's ranks: torchrun and the ranks
    trained on without it."""
    command = [PYTHON, REPO / "tools" / "benchmark_fsdp.py", "--arch", "resnet18", "--processes", "1", "2"]
    job = Job(command, prewarmed=False)
    try:
        row = job.wait_for(re.compile(r"^\| 1 process \|"), timeout=180).split("|")
        held, share, ratio = (float(cell.split()[0].replace(",", "")) for cell in row[2:5])
        assert 0.95 < ratio < 1.2 and share == pytest.approx(4 * 11_689_512 * 4 / 2**20, rel=1e-3), row
        deadline = time.monotonic() + 120
        while len(ranks_of(job)) < 2:  # (all: a stop while torchrun starts them leaves those started, in torch 2.15)
            assert time.monotonic() < deadline and job.process.poll() is None, "".join(job.output)
            time.sleep(0.05)
        os.kill(job.process.pid, signal.SIGTERM)
        code, output = job.finish(timeout=60, grace=3)
    finally:
        job.kill()
    assert code == 143 and output.splitlines()[-1] == "stopped: benchmark_fsdp.py ended by SIGTERM", output
    assert job.left_behind == [] and no_traceback_of_ours(output)


def ranks_of(job):
    """The processes of `job` that are benchmark_fsdp.py's ranks (not the torchrun that started them)."""
    ranks = []
    for pid in job.leftovers():
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:  # (ended meanwhile)
            continue
        if b"--worker" in command and b"torch.distributed.run" not in command:
            ranks.append(pid)
    return ranks

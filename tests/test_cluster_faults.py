"""Faults of a real cluster, with real processes: two runs given one output directory; the ranks of a job
started with different arguments, resuming from different checkpoints or reading copies of the data; stops
that need longer than torchrun's default grace, or come in an epoch's last steps, during validation or before
training; an unreadable validation set; a changed data set; spawn's rendezvous file after a kill; a host named
after loopback. Each ends in one line that names what differs, or completes."""

import fcntl
import os
import re
import shutil
import signal
import socket
import time

import pytest
import torch

from conftest import TINY, make_image_folder
from harness.ahead import SideBySide, ahead, once
from harness.jobs import Job, assert_ok, no_traceback_of_ours, run_prewarmed, torchrun_command
from harness.prewarm import worker_command
from harness.processes import PYTHON, REPO, clean_env, free_port

pytestmark = pytest.mark.faults

TINY_NET = ["-a", "tests.tiny_models:TinyNet", *TINY, "-b", "8", "--seed", "7"]
WAIT = 300


def data_folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data"), train_per_class=16, val_per_class=4)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return once(data_folder, tmp_path_factory)


def error_lines(output):
    return [line for line in output.splitlines() if line.startswith("error:")]


# ----------------------------------------------------------------------------- one run per output directory


def test_a_second_run_in_the_same_output_dir_is_refused_naming_the_first(data, tmp_path):
    """Seen: two `--resume auto` runs of one --output-dir (a duplicate submission, a requeue while the lost
    node's step still ran) both trained, interleaving log.csv rows and checkpoints, and both exited 0."""
    out = tmp_path / "run"
    common = [*TINY_NET, "--data", data, "--resume", "auto", "--output-dir", out, "--checkpoint-interval", "2"]
    first = Job([PYTHON, REPO / "train_dp.py", *common, "--epochs", "3"])
    try:
        first.wait_for(re.compile(r"^Epoch: \[0\] \[ *2/"), timeout=WAIT)
        (second,) = run_prewarmed("train_dp.py", [[*common, "--epochs", "3", "--seed", "8"]])
        assert second.returncode == 2, second.stdout[-3000:]
        lines = error_lines(second.stdout)
        assert len(lines) == 1 and re.fullmatch(
            rf"error: {re.escape(str(out))} is in use by another run \(host \S+, PID \d+, started \S+\): one run at a "
            r"time writes an output directory; wait for that one to end, or give this one another --output-dir",
            lines[0],
        ), second.stdout
        assert no_traceback_of_ours(second.stdout)
        returncode, output = first.finish(timeout=WAIT)
    finally:
        first.kill()
    assert returncode == 0, output[-3000:]
    epochs = [line.split(",")[0] for line in (out / "log.csv").read_text().splitlines()[1:]]
    assert epochs == ["0", "1", "2"]  # one run's rows, each epoch once
    assert torch.load(out / "checkpoint.pth", weights_only=True)["seed"] == 7


def test_a_killed_run_releases_its_output_dir_and_the_relaunch_resumes(data, tmp_path):
    """The lock dies with the process however it ends: a requeued (or torchrun-restarted) job goes on."""
    out = tmp_path / "run"
    common = [
        *TINY_NET,
        "--data",
        data,
        "--resume",
        "auto",
        "--output-dir",
        out,
        "--checkpoint-interval",
        "2",
        "--epochs",
        "1",
    ]
    job = Job([PYTHON, REPO / "train_dp.py", *common])
    job.wait_for(re.compile(r"^Epoch: \[0\] \[ *3/"), timeout=WAIT)
    job.kill()  # SIGKILL: no exit handler runs
    (relaunch,) = run_prewarmed("train_dp.py", [common])
    output = assert_ok(relaunch)
    assert re.search(r"^resumed from \S+checkpoint\.pth \(epoch \d+", output, re.MULTILINE), output[-3000:]


# ----------------------------------------------------------------------------- the ranks of one job agree


def two_nodes(port, node_args):
    """torchrun on two "nodes" of one process each (loopback), node k started with node_args[k]."""
    return [
        Job(
            [
                PYTHON,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={rank}",
                "--nproc-per-node=1",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                *worker_command("train_ddp.py"),
                *args,
            ]
        )
        for rank, args in enumerate(node_args)
    ]


def finish_all(jobs):
    try:
        return [job.finish(timeout=WAIT) for job in jobs]
    finally:
        for job in jobs:
            job.kill()


def disagreeing_runs(data, out):
    """Two two-node jobs side by side: one whose node 1 was given another batch size; one whose nodes (with
    --save-on node, a directory each) hold checkpoints of different steps. (out, name -> [(returncode, output)])."""
    common = [*TINY_NET, "--data", data, "--epochs", "2"]
    saved = out / "saved"
    assert_ok(
        run_prewarmed("train_dp.py", [[*common, "--epochs", "1", "--checkpoint-interval", "2", "--output-dir", saved]])[
            0
        ]
    )
    (out / "node0").mkdir(), (out / "node1").mkdir()
    shutil.copy(saved / "checkpoint.pth", out / "node0" / "checkpoint.pth")  # epoch 1
    shutil.copy(saved / "checkpoint_prev.pth", out / "node1" / "checkpoint.pth")  # epoch 0, step 4: an older copy
    jobs = {
        "batch": two_nodes(
            free_port(),
            [[*common, "-b", "8", "--output-dir", out / "batch"], [*common, "-b", "16", "--output-dir", out / "batch"]],
        ),
        "resume": two_nodes(
            free_port(),
            [
                [*common, "--save-on", "node", "--resume", "auto", "--output-dir", out / f"node{rank}"]
                for rank in (0, 1)
            ],
        ),
    }
    with SideBySide(len(jobs)) as pool:
        results = dict(zip(jobs, pool.map(finish_all, jobs.values())))
    return out, results


@pytest.fixture(scope="module")
def disagreeing_jobs(side_by_side):
    return side_by_side["disagree"][0].result()


def test_ranks_started_with_different_arguments_end_in_one_line_naming_the_difference(disagreeing_jobs):
    """Seen: -b 8 on node 0 and -b 16 on node 1 aborted rank 1 in gloo ("Received data size doesn't match
    expected size") with two torchrun tracebacks, and rank 0 said only that another process ended."""
    out, results = disagreeing_jobs
    expected = (
        "error: the processes of this job were started with different arguments: --batch-size is 8 on rank 0, "
        "16 on rank 1; every process takes the same ones (only --workers, --data and --output-dir may differ "
        "between nodes)"
    )
    for returncode, output in results["batch"]:
        assert returncode != 0
        assert error_lines(output) == [expected], output[-3000:]
        assert "EnforceNotMet" not in output and no_traceback_of_ours(output)
        assert re.search(r"exitcode\s*:\s*2\b", output), output[-3000:]  # torchrun reports the worker's exit code 2
    assert not (out / "batch" / "checkpoint.pth").exists()


def test_ranks_that_loaded_different_checkpoints_refuse_to_train(disagreeing_jobs):
    out, results = disagreeing_jobs
    for returncode, output in results["resume"]:
        assert returncode != 0
        lines = error_lines(output)
        assert len(lines) == 1 and re.fullmatch(
            r"error: the processes of this job would resume from different checkpoints: \S+node0/checkpoint\.pth "
            r"\(epoch 1, seed 7\) on rank 0, \S+node1/checkpoint\.pth \(epoch 0 step 4, seed 7\) on rank 1; a job "
            r"resumes from one checkpoint: give every node a copy of the same one \(--save-on node\), or name it with "
            r"--resume PATH",
            lines[0],
        ), output[-3000:]
        assert "Epoch: [" not in output and no_traceback_of_ours(output)
    for rank, epoch in ((0, 1), (1, 0)):  # untouched
        assert torch.load(out / f"node{rank}" / "checkpoint.pth", weights_only=True)["epoch"] == epoch


def test_a_requeued_job_waits_for_the_lock_of_the_step_it_replaces(data, tmp_path):
    """On a requeue (SLURM_RESTART_COUNT > 0) the lost node's lock may outlive it by the file system's lease:
    the run waits for it (up to checkpoint.LOCK_WAIT_ON_RESTART s), then goes on."""
    out = tmp_path / "run"
    out.mkdir()
    held = os.open(out / "run.lock", os.O_RDWR | os.O_CREAT)
    fcntl.lockf(held, fcntl.LOCK_EX)
    os.write(held, b'{"host": "lost-node", "pid": 4242, "started": "2026-11-24T00:00:00+0000"}\n')
    job = Job(
        [
            PYTHON,
            REPO / "train_dp.py",
            *TINY_NET,
            "--data",
            data,
            "--resume",
            "auto",
            "--output-dir",
            out,
            "--epochs",
            "1",
        ],
        env=clean_env(SLURM_RESTART_COUNT=1),
    )
    try:
        job.wait_for(
            re.compile(
                r"^waiting up to 180 s for the run this job replaces to release \S+run\.lock "
                r"\(host lost-node, PID 4242, started 2026-11-24T00:00:00\+0000\)$"
            ),
            timeout=WAIT,
        )
        assert not (out / "log.csv").exists()
        os.close(held)  # the lost node's lease ends
        returncode, output = job.finish(timeout=WAIT)
    finally:
        job.kill()
    assert returncode == 0, output[-3000:]
    assert "lost-node" not in (out / "run.lock").read_text()


# ----------------------------------------------------------------------------- stops that fit the launcher's grace


def slow_stop_run(data, out):
    """single_node_ddp.sh (torchrun, 2 processes) whose stop's checkpoint takes 40 s (tests.tiny_models:SlowStop),
    SIGTERMed at epoch 0 step 2: (returncode, output, seconds from the signal to the end)."""
    job = Job(
        [
            "bash",
            REPO / "run_scripts" / "single_node_ddp.sh",
            *TINY_NET,
            "--data",
            data,
            "--output-dir",
            out,
            "--epochs",
            "3",
            "--trainer",
            "tests.tiny_models:SlowStop",
        ],
        env=clean_env(PYTHON=PYTHON, NPROC_PER_NODE=2),
    )
    try:
        job.wait_for(re.compile(r"^Epoch: \[0\] \[ *2/"), timeout=WAIT)
        signalled = time.monotonic()
        job.process.send_signal(signal.SIGTERM)  # the script became torchrun (exec)
        returncode, output = job.finish(timeout=WAIT)
        return returncode, output, time.monotonic() - signalled
    finally:
        job.kill()


def last_step_runs(data, out):
    """torchrun, 2 processes, SIGTERM in epoch 0's last step (tests.tiny_models:SlowLastStep says when it begins),
    then the same command again: [(returncode, output)] of both."""
    # -b 10: 5 steps of 5 images per rank over its 24, the last batch short (a resume at 5 x 5 once failed there)
    command = torchrun_command(
        "train_ddp.py",
        2,
        *TINY_NET,
        "-b",
        "10",
        "--data",
        data,
        "--output-dir",
        out,
        "--epochs",
        "2",
        "--resume",
        "auto",
        "--trainer",
        "tests.tiny_models:SlowLastStep",
    )
    job = Job(command)
    try:
        job.wait_for(re.compile(r"^the epoch's last step begins"), timeout=WAIT)
        job.process.send_signal(signal.SIGTERM)
        stopped = job.finish(timeout=WAIT)
    finally:
        job.kill()
    return [stopped, Job(command).finish(timeout=WAIT)]


def killed_rendezvous_runs(data, out):
    """train_spawn.py through a file:// rendezvous, SIGKILLed at epoch 0 step 3 (its step 4 slow: SlowFourthStep), then
    relaunched with --resume auto: (whether the rendezvous file was left, not empty; the step of the checkpoint it left
    (2, or 4 when the kill came after step 4's save: the job runs ahead of the reading of its lines); (returncode,
    output) of the relaunch)."""
    rendezvous = out / "rendezvous"
    command = [
        PYTHON,
        REPO / "train_spawn.py",
        *TINY_NET,
        "--data",
        data,
        "--output-dir",
        out,
        "--nproc-per-node",
        "2",
        "--dist-url",
        f"file://{rendezvous}",
        "--resume",
        "auto",
        "--checkpoint-interval",
        "2",
        "--trainer",
        "tests.tiny_models:SlowFourthStep",
        "--epochs",
    ]
    job = Job([*command, "30"])
    try:
        job.wait_for(re.compile(r"^Epoch: \[0\] \[ *3/"), timeout=WAIT)
    finally:
        job.kill()
    left_behind = rendezvous.exists() and rendezvous.stat().st_size > 0
    saved = torch.load(out / "checkpoint.pth", weights_only=True)
    return left_behind, (saved["epoch"], saved["step_in_epoch"]), Job([*command, "1"]).finish(timeout=WAIT)


def node_1_first_runs(data, out):
    """Two train_spawn.py nodes of one process through a file:// rendezvous, node 1 started first: node 0 starts once
    node 1 wrote the file. [(returncode, output)] of nodes 0 and 1."""
    rendezvous = out / "rendezvous"

    def node(rank):
        return Job(
            [
                PYTHON,
                REPO / "train_spawn.py",
                *TINY_NET,
                "--data",
                data,
                "--output-dir",
                out / f"node{rank}",
                "--nnodes",
                "2",
                "--node-rank",
                rank,
                "--nproc-per-node",
                "1",
                "--epochs",
                "1",
                "--dist-url",
                f"file://{rendezvous}",
            ]
        )

    node1 = node(1)
    try:
        deadline = time.monotonic() + WAIT
        while not (rendezvous.exists() and rendezvous.stat().st_size) and time.monotonic() < deadline:
            time.sleep(0.2)
        return finish_all([node(0), node1])
    finally:
        node1.kill()


def during_validation_run(data, out):
    """torchrun, 2 processes, SIGTERM while epoch 0 is validated (tests.tiny_models:SlowValidation): (returncode,
    output)."""
    job = Job(
        torchrun_command(
            "train_ddp.py",
            2,
            *TINY_NET,
            "--data",
            data,
            "--output-dir",
            out,
            "--epochs",
            "3",
            "--trainer",
            "tests.tiny_models:SlowValidation",
        )
    )
    try:
        job.wait_for(re.compile(r"^validation begins"), timeout=WAIT)
        job.process.send_signal(signal.SIGTERM)
        return job.finish(timeout=WAIT)
    finally:
        job.kill()


def side_by_side_runs(tmp_path_factory):
    """The module's runs that wait for lines, send signals or sleep, side by side (most of their time is a wait):
    name -> (future of its result, output dir)."""
    data, out = once(data_folder, tmp_path_factory), tmp_path_factory.mktemp("side-by-side")
    runs = {
        "slow-stop": slow_stop_run,
        "last-step": last_step_runs,
        "killed-rendezvous": killed_rendezvous_runs,
        "node-1-first": node_1_first_runs,
        "disagree": disagreeing_runs,
        "per-node": per_node_runs,
        "during-validation": during_validation_run,
    }
    for name in runs:
        (out / name).mkdir()
    with SideBySide(len(runs)) as pool:
        futures = {name: (pool.submit(run, data, out / name), out / name) for name, run in runs.items()}
    return futures


side_by_side = ahead(side_by_side_runs, "side_by_side")


@pytest.mark.slow
def test_a_stop_that_needs_40_s_completes_under_the_torchrun_of_run_scripts(side_by_side):
    """torchrun SIGKILLs its workers 30 s after passing a stop on, unless TORCH_ELASTIC_SHUTDOWN_TIMEOUT (its
    --shutdown-timeout) says otherwise: the launchers give it STOP_GRACE (120 s). Here the stop's checkpoint takes
    40 s (tests.tiny_models:SlowStop)."""
    future, out = side_by_side["slow-stop"]
    returncode, output, seconds = future.result()
    stopped = re.search(r"^stopped on SIGTERM: checkpoint of epoch 0 step (\d) in ", output, re.MULTILINE)
    assert stopped and seconds >= 40, output[-3000:]
    saved = torch.load(out / "checkpoint.pth", weights_only=True)
    assert (saved["epoch"], saved["step_in_epoch"]) == (0, int(stopped.group(1)))


def test_a_stop_in_an_epoch_s_last_step_saves_the_epoch_before_validating_it(side_by_side):
    """Once, a stop in the last step waited for the whole validation (twice with --model-ema), the epoch's save,
    the next epoch's loader and 1-2 steps: a slow validation batch then cost the finished epoch. Now the trained
    epoch is saved first (at its last step), and the resumed run validates it."""
    future, out = side_by_side["last-step"]
    (returncode, output), (resumed_returncode, resumed) = future.result()
    assert returncode != 0 and "stopped on SIGTERM: checkpoint of epoch 0 step 5 in" in output, output[-3000:]
    assert " * Acc@1" not in output  # not validated
    assert resumed_returncode == 0, resumed[-3000:]
    assert re.search(r"^resumed from \S+checkpoint\.pth \(epoch 0, step 5\)", resumed, re.MULTILINE), resumed[-3000:]
    assert not re.search(r"^Epoch: \[0\]", resumed, re.MULTILINE)  # nothing of epoch 0 trained again
    assert len(re.findall(r"^ \* Acc@1 .*\(12 images\)$", resumed, re.MULTILINE)) == 2  # epochs 0 and 1 validated
    epochs = [line.split(",")[0] for line in (out / "log.csv").read_text().splitlines()[1:]]
    assert epochs == ["0", "1"]


def test_a_stop_during_validation_ends_after_the_epoch_s_checkpoint_before_the_next_epoch(side_by_side):
    """Once, it went on into the next epoch's loader start and 1-2 steps before it stopped."""
    future, out = side_by_side["during-validation"]
    returncode, output = future.result()
    assert returncode != 0 and "stopped on SIGTERM: checkpoint of epoch 1 step 0 in" in output, output[-3000:]
    assert " * Acc@1" in output and not re.search(r"^Epoch: \[1\]", output, re.MULTILINE), output[-3000:]
    saved = torch.load(out / "checkpoint.pth", weights_only=True)
    assert (saved["epoch"], saved["step_in_epoch"]) == (1, 0)


def stopped_in_start_up(launcher, out):
    """`launcher`'s run whose start-up is blocked in an open() of a FIFO that nothing writes
    (tests.custom_datasets:from_a_fifo), sent SIGTERM there: (returncode, output, processes left behind)."""
    fifo = out / "fifo"
    os.mkfifo(fifo)
    args = [*TINY_NET, "--dataset", "tests.custom_datasets:from_a_fifo", "--output-dir", out / "out"]
    command = {
        "dp": [PYTHON, REPO / "train_dp.py", *args],
        "torchrun": torchrun_command("train_ddp.py", 2, *args, prewarmed=False),
        "spawn": [PYTHON, REPO / "train_spawn.py", *args, "--nproc-per-node", "2", "--master-port", free_port()],
    }
    job = Job(command[launcher], env=clean_env(TEST_FIFO=fifo), prewarmed=False)
    try:
        job.wait_for(re.compile(r"^opening "), timeout=WAIT)
        if launcher != "dp":
            job.wait_for(re.compile(r"^opening "), timeout=WAIT)  # both ranks
        time.sleep(0.5)  # in open() by now
        if launcher != "torchrun":  # spawn's parent passes it on
            job.process.send_signal(signal.SIGTERM)
        else:  # to the workers, as Slurm signals every process of a step: torchrun then reports their exit codes
            from test_failures import training_processes

            workers = training_processes(job)
            assert sorted(workers) == [0, 1], workers
            for pid in workers.values():
                os.kill(pid, signal.SIGTERM)
        returncode, output = job.finish(timeout=60)
    finally:
        job.kill()
    return returncode, output, job.left_behind


def stopped_in_start_up_launches(tmp_path_factory):
    """stopped_in_start_up of each launch mode, side by side: launcher -> (its result, its folder)."""
    folders = {launcher: tmp_path_factory.mktemp(f"start-up-{launcher}") for launcher in ("dp", "torchrun", "spawn")}
    with SideBySide(len(folders)) as pool:
        futures = {launcher: pool.submit(stopped_in_start_up, launcher, folder) for launcher, folder in folders.items()}
    return {launcher: (future.result(), folders[launcher]) for launcher, future in futures.items()}


stopped_in_start_up_runs = ahead(stopped_in_start_up_launches, "stopped_in_start_up_runs")


@pytest.mark.parametrize("launcher", ["dp", "torchrun", "spawn"])
def test_a_stop_signal_before_training_ends_the_run_with_75_not_143(stopped_in_start_up_runs, launcher):
    """Seen in the code: a SIGTERM in the start-up (rank 0's folder scan, the checkpoint load: minutes on ImageNet
    over NFS) killed the process: 143, which a requeue logic reads as a crash."""
    (returncode, output, left_behind), folder = stopped_in_start_up_runs[launcher]
    stop = (
        "stopped on SIGTERM before training started: nothing was trained, no checkpoint written; start it again as it "
        "was started"
    )
    if launcher == "dp":
        assert returncode == 75, output[-3000:]
        assert [line for line in output.splitlines() if "SIGTERM" in line] == [stop], output[-3000:]
    elif launcher == "spawn":
        assert returncode == 75, output[-3000:]
        assert sorted(line for line in output.splitlines() if "SIGTERM" in line) == [
            f"rank {rank}: {stop}" for rank in (0, 1)
        ], output[-3000:]
    else:
        from test_failures import torchrun_exit_codes

        assert torchrun_exit_codes(output) == {"0": "75", "1": "75"}, output[-3000:]
        assert output.count(stop) == 2, output[-3000:]
    assert no_traceback_of_ours(output) and not (folder / "out").exists()
    assert not left_behind


def test_a_stop_signal_while_a_rank_waits_in_its_rendezvous_ends_it_at_once_with_75(data, tmp_path):
    """Seen: a rank whose rank 0 never came (a lost node, a wrong MASTER_ADDR) ignored SIGTERM, and with it its
    launcher's end, until --dist-timeout (30 min): torch's rendezvous waits in C++, where Python runs no handler."""
    port = free_port()
    with socket.create_server(("127.0.0.1", port)) as rank_0:  # a store that takes the connection, never answers
        env = clean_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        job = Job([PYTHON, REPO / "train_ddp.py", *TINY_NET, "--data", data, "--output-dir", tmp_path / "out"], env=env)
        try:
            rank_0.settimeout(WAIT)
            connection, _ = rank_0.accept()  # rank 1 is in its rendezvous
            time.sleep(0.5)
            job.process.send_signal(signal.SIGTERM)
            returncode, output = job.finish(timeout=30)
            connection.close()
        finally:
            job.kill()
    assert returncode == 75, output[-3000:]
    assert output.splitlines()[-1] == (
        "stopped on SIGTERM before training started: nothing was trained, no checkpoint written; start it again as it "
        "was started (waiting outside Python: a rendezvous, a collective or a read)"
    ), output[-3000:]
    assert no_traceback_of_ours(output) and not job.left_behind


def test_a_rendezvous_a_node_never_comes_to_ends_every_rank_that_came_in_one_line(data, tmp_path):
    """Node 0 of two (train_spawn.py, 2 processes) whose node 1 never starts: rank 0, which holds the store, said so
    in one line; rank 1, waiting in the store for the others, ended in a DistStoreError traceback (torchrun's
    workers too, every one of them)."""
    job = Job(
        [
            *(PYTHON, REPO / "train_spawn.py", *TINY_NET, "--data", data, "--output-dir", tmp_path / "out"),
            *("--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"),
            *("--master-port", str(free_port()), "--dist-timeout", "5"),
        ]
    )
    returncode, output = job.finish(timeout=WAIT)
    assert returncode != 0 and no_traceback_of_ours(output) and "Traceback" not in output, output[-3000:]
    *timed_out, ended = error_lines(output)  # (the rank that timed out first; the others are stopped then)
    assert timed_out and all(
        re.fullmatch(
            r"error: rank [01]: the rendezvous timed out: (2 of 4 processes|not every process) joined in 5 s: start "
            "every node, each with its own node rank, and check MASTER_ADDR, the port and the node count",
            line,
        )
        for line in timed_out
    ), output[-3000:]
    assert re.fullmatch(r"error: process [01] exited \(1\); see the errors above", ended), output[-3000:]
    assert not job.left_behind


# ----------------------------------------------------------------------------- no silent zero


def test_a_validation_set_it_cannot_read_ends_the_run_in_one_line(data, tmp_path):
    """Seen: every val file empty trained to the end with ` * Acc@1 0.000 ... (0 images)`, `done: best acc@1 0.00`
    and exit 0."""
    root = tmp_path / "data"
    shutil.copytree(data, root)
    for image in (root / "val").rglob("*.*"):
        image.write_bytes(b"")
    out = tmp_path / "out"
    (result,) = run_prewarmed("train_dp.py", [[*TINY_NET, "--data", root, "--output-dir", out, "--epochs", "2"]])
    assert result.returncode == 2, result.stdout[-3000:]
    assert error_lines(result.stdout) == [
        f"error: validation could not read 12 of its 12 images (e.g. {root}/val/circle/00000.jpg: cannot identify "
        "image file), more than 10%: its accuracy would mean nothing; is the data set readable? (after a transient "
        "outage, --resume auto goes on from the last checkpoint)"
    ], result.stdout[-3000:]
    assert "done:" not in result.stdout and no_traceback_of_ours(result.stdout)
    assert len((out / "bad_images.txt").read_text().splitlines()) == 12


def test_a_file_unreadable_in_one_epoch_is_read_again_in_the_next(data, tmp_path):
    """A transient outage once entered its files in the bad list for good (and every rank gathered the whole list at
    each save). Here one training image is unreadable until the run has met it once."""
    root = tmp_path / "data"
    shutil.copytree(data, root)
    victim = sorted((root / "train" / "square").iterdir())[0]
    kept = victim.read_bytes()
    victim.write_bytes(b"not an image")
    out = tmp_path / "out"
    job = Job([PYTHON, REPO / "train_dp.py", *TINY_NET, "--data", root, "--output-dir", out, "--epochs", "2"])
    try:
        job.wait_for(re.compile(rf"^warning: skipped {re.escape(str(victim))}: cannot decode it"), timeout=WAIT)
        victim.write_bytes(kept)  # the outage ends
        returncode, output = job.finish(timeout=WAIT)
    finally:
        job.kill()
    assert returncode == 0, output[-3000:]
    rows = (out / "log.csv").read_text().splitlines()
    column = rows[0].split(",").index("bad_images")
    assert [row.split(",")[column] for row in rows[1:]] == ["1", "0"]
    assert not (out / "bad_images.txt").exists() or victim.name not in (out / "bad_images.txt").read_text()


def per_node_runs(data, out):
    """Two-node jobs whose node 1 reads its own copy of the image folder, at another path: a complete copy whose
    three `00000.jpg` training images are broken (their names are rank 0's: only reading them tells the copies
    apart), and a copy that lacks a training image. name -> ([(returncode, output)], node 1's copy)."""
    copies = {name: shutil.copytree(data, out / f"copy-{name}") for name in ("complete", "incomplete")}
    for image in copies["complete"].glob("train/*/00000.jpg"):
        image.write_bytes(b"broken on node 1 alone")
    sorted((copies["incomplete"] / "train" / "ring").iterdir())[-1].unlink()
    common = [*TINY_NET, "--epochs", "2", "--save-on", "node"]
    jobs = {
        name: two_nodes(
            free_port(),
            [
                [*common, "--data", data, "--output-dir", out / name / "node0"],
                [*common, "--data", copy, "--output-dir", out / name / "node1"],
            ],
        )
        for name, copy in copies.items()
    }
    with SideBySide(len(jobs)) as pool:
        results = dict(zip(jobs, pool.map(finish_all, jobs.values())))
    return {name: (results[name], copies[name]) for name in jobs}


@pytest.fixture(scope="module")
def per_node_copies(side_by_side):
    return side_by_side["per-node"][0].result()


def test_each_node_reads_its_own_copy_of_the_data_at_its_own_path(per_node_copies, data):
    """Once every rank read rank 0's --data path (the folder's index came from rank 0): a node-local copy at
    another path was never read, or failed on every file."""
    results, copy = per_node_copies["complete"]
    outputs = [output for returncode, output in results]
    assert [returncode for returncode, _ in results] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    skipped = re.findall(r"^warning: (rank \d): skipped (\S+): cannot decode it", "".join(outputs), re.MULTILINE)
    assert skipped and all(rank == "rank 1" and path.startswith(f"{copy}/train/") for rank, path in skipped), skipped
    assert "12 images" in outputs[0]


def test_a_node_whose_copy_of_the_data_differs_stops_every_rank_in_one_line(per_node_copies, data):
    results, copy = per_node_copies["incomplete"]
    expected = (
        f"--data {copy} (rank 0: {data}) holds other files than rank 0's (train/ring: 15 images here, 16 on "
        "rank 0): each node's copy must be the same"
    )
    for rank, (returncode, output) in enumerate(results):
        assert returncode != 0 and error_lines(output) == [f"error: {'rank 1: ' if rank == 0 else ''}{expected}"], (
            output[-3000:]
        )
        assert no_traceback_of_ours(output) and "Epoch: [" not in output


# ----------------------------------------------------------------------------- spawn's file:// rendezvous


def test_a_spawn_job_killed_with_a_file_rendezvous_is_relaunched_with_resume_auto(side_by_side):
    """Once the rendezvous file a SIGKILLed job left behind refused the relaunch (exit 2, "delete it first")."""
    future, out = side_by_side["killed-rendezvous"]
    left_behind, (epoch, step), (returncode, output) = future.result()
    assert left_behind  # the killed job's rendezvous file, not empty
    assert returncode == 0, output[-3000:]
    assert (
        f"note: removed {out / 'rendezvous'}, the rendezvous file of a job that ended without removing it (killed)"
        in output.splitlines()
    )
    assert (epoch, step) in ((0, 2), (0, 4))
    assert re.search(rf"^resumed from \S+checkpoint\.pth \(epoch 0, step {step}\)", output, re.MULTILINE), output[
        -3000:
    ]


def test_a_file_rendezvous_whose_node_1_starts_first_is_not_taken_for_a_killed_job_s(side_by_side):
    """Node 1's processes write the rendezvous file as they wait: node 0, started after, must not remove it."""
    future, _ = side_by_side["node-1-first"]
    results = future.result()
    assert [returncode for returncode, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    assert "note: removed" not in results[0][1]

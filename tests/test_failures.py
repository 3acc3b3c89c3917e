"""Failures with real processes and real signals: a run killed or preempted mid-epoch goes on
from its last checkpoint and ends bitwise equal to a run that was never interrupted; torchrun's
elastic restart brings a killed worker back; a stalled rank fails the job; a damaged or unwritable
checkpoint costs nothing already saved; and a test that fails leaves no process behind."""

import json
import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torchvision

from conftest import TINY, make_image_folder
from harness.ahead import SideBySide, ahead, once
from harness.jobs import Job, assert_ok, no_traceback_of_ours, run, run_prewarmed, run_script, torchrun_command
from harness.prewarm import PrewarmedProcess
from harness.processes import PYTHON, REPO, alive, clean_env, free_port, process_stat, processes_marked

# mobilenet_v3_small keeps learning here and has dropout and BatchNorm: resuming must restore the RNG
# for the weights to match. 120 training images, global batch 8: 15 steps an epoch, a checkpoint every
# 5 steps.
RUN = [
    "-a",
    "mobilenet_v3_small",
    "--train-crop-size",
    "32",
    "--val-resize-size",
    "32",
    "--val-crop-size",
    "32",
    "-b",
    "8",
    "--epochs",
    "3",
    "--seed",
    "7",
    "--lr",
    "0.01",
    "-p",
    "1",
    "--checkpoint-interval",
    "5",
]
TINY_NET = ["-a", "tests.tiny_models:TinyNet", *TINY, "-b", "8"]
PREEMPTED = 75
pytestmark = pytest.mark.faults


def at(epoch, step):
    """The progress line of `step` (1-based) of `epoch`."""
    return re.compile(rf"^Epoch: \[{epoch}\] \[ *{step}/15\]")


def data_folder(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data"), train_per_class=40, val_per_class=4)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return once(data_folder, tmp_path_factory)


def weights(output_dir):
    return torch.load(Path(output_dir) / "checkpoint.pth", weights_only=True)["state_dict"]


def position(output_dir):
    """(epoch, step_in_epoch) of the latest checkpoint."""
    saved = torch.load(Path(output_dir) / "checkpoint.pth", weights_only=True)
    return saved["epoch"], saved["step_in_epoch"]


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


def training_processes(job):
    """{rank: pid} of the job's processes that run a training script (not the launcher, not loader workers)."""
    ranks = {}
    for pid in job.leftovers():
        fields = process_stat(pid)
        if fields is None:
            continue
        parent = int(fields[1])
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        rank = [entry[5:] for entry in environ if entry.startswith(b"RANK=")]
        if rank and b"train_" in cmdline and Path(f"/proc/{parent}/cmdline").read_bytes() != cmdline:
            ranks[int(rank[0])] = pid
    return ranks


def assert_resumed_where_it_stopped(output, saved):
    """Training is deterministic: a run that silently started over would end with the same weights.
    The run must say where it resumed, and train none of the steps done before."""
    epoch, step = saved
    assert re.search(rf"resumed from .*checkpoint\.pth \(epoch {epoch}, step {step}\)", output), output[-3000:]
    trained = [(int(e), int(s)) for e, s in re.findall(r"^Epoch: \[(\d+)\] \[ *(\d+)/", output, re.MULTILINE)]
    if trained and min(trained) == (epoch, step + 1):
        return
    # Stopped after the epoch's last step (a stop that came late, on loaded cores): the resumed run validates that
    # epoch before any step, then trains the next one from its first step, if there is one.
    assert not trained or min(trained) == (epoch + 1, 1), trained
    first_step = re.search(r"^Epoch: \[", output, re.MULTILINE)
    validation = re.search(r"^ \* Acc@1 ", output, re.MULTILINE)
    assert validation and (first_step is None or validation.start() < first_step.start()), output[-3000:]


def side_by_side_runs(tmp_path_factory):
    """The runs of this module that wait for lines and send signals, side by side, a thread each (they
    spend most of their time starting processes and waiting; the stalled rank's job waits 35 s for
    nothing): name -> what the run gave, or the exception it raised."""
    data = once(data_folder, tmp_path_factory)
    folders = {name: tmp_path_factory.mktemp(name) for name in SIDE_BY_SIDE}
    with SideBySide(len(SIDE_BY_SIDE)) as pool:
        futures = {name: pool.submit(runs, data, folders[name]) for name, runs in SIDE_BY_SIDE.items()}
    return {name: future.exception() or future.result() for name, future in futures.items()}


side_by_side = ahead(side_by_side_runs, "side_by_side")


def outcome(side_by_side, name):
    if isinstance(side_by_side[name], BaseException):
        raise side_by_side[name]
    return side_by_side[name]


WAIT = 300  # s for a line to come: the runs start side by side, on 2 cores


def interrupt(command, when, send):
    """Start `command`; at the line `when`, send(job) a signal; (returncode, output) once it ended."""
    job = Job(command)
    job.wait_for(when, timeout=WAIT)
    send(job)
    return job.finish()


def uninterrupted_runs(data, out):
    """The reference runs: single process, and two processes under torchrun."""
    jobs = {
        "dp": Job([PYTHON, REPO / "train_dp.py", *RUN, "-j", "1", "--data", data, "--output-dir", out / "dp"]),
        "ddp": Job(torchrun_command("train_ddp.py", 2, *RUN, "-j", "0", "--data", data, "--output-dir", out / "ddp")),
    }
    for job in jobs.values():
        returncode, output = job.finish()
        assert returncode == 0, output[-3000:]
    return {
        mode: (weights(out / mode), torch.load(out / mode / "checkpoint_prev.pth", weights_only=True)["state_dict"])
        for mode in ("dp", "ddp")
    }


def dp_interrupted_runs(data, out):
    """One train_dp.py run, `--resume auto` every time: SIGTERM at epoch 1 step 7 (a clean stop), then
    SIGKILL at epoch 2 step 7 (no warning), then on to the end."""
    command = [PYTHON, REPO / "train_dp.py", *RUN, "-j", "1", "--data", data, "--output-dir", out, "--resume", "auto"]
    stages = SimpleNamespace()
    stages.sigterm = interrupt(command, at(1, 7), lambda job: job.process.send_signal(signal.SIGTERM))
    stages.after_sigterm = position(out)
    stages.sigkill = interrupt(command, at(2, 7), lambda job: job.process.send_signal(signal.SIGKILL))
    stages.after_sigkill = position(out)
    stages.end = Job(command).finish()
    stages.weights = weights(out)
    stages.epochs = [line.split(",")[0] for line in (out / "log.csv").read_text().splitlines()[1:]]
    return stages


def torchrun_interrupted_runs(data, out):
    """One train_ddp.py run under torchrun, started with `--overwrite`, then `--resume auto`: a worker SIGKILLed at
    epoch 0 step 7 (torchrun restarts both, --max-restarts=1: the restart goes on from the job's checkpoint, where it
    had begun again at epoch 0 with --overwrite), SIGTERM to torchrun at epoch 1 step 7, then
    (relaunched) SIGTERM to the worker of rank 1 alone at epoch 2 step 3, then (relaunched, real workers)
    SIGKILL to torchrun alone three steps after its resume and at once a relaunch, which goes on to the end. (The
    steps take 0.07 s here: a signal sent as a progress line is read may land steps later, under load.)"""

    def command(*extra, prewarmed=True, resume=("--resume", "auto")):
        return torchrun_command(
            "train_ddp.py",
            2,
            *RUN,
            "-j",
            "0",
            "--data",
            data,
            "--output-dir",
            out,
            *resume,
            extra=extra,
            prewarmed=prewarmed,
        )

    stages = SimpleNamespace()
    job = Job(command("--max-restarts=1", resume=["--overwrite"]))
    job.wait_for(at(0, 7), timeout=WAIT)
    stages.killed_workers = training_processes(job)
    assert sorted(stages.killed_workers) == [0, 1], stages.killed_workers
    os.kill(stages.killed_workers[1], signal.SIGKILL)
    job.wait_for(re.compile(r"^resumed from "), timeout=WAIT)
    stages.restarted_workers = training_processes(job)
    job.wait_for(at(1, 7), timeout=WAIT)
    job.process.send_signal(signal.SIGTERM)
    stages.sigterm = job.finish()
    stages.after_sigterm = position(out)
    stages.worker_sigterm = interrupt(
        command(), at(2, 3), lambda job: os.kill(training_processes(job)[1], signal.SIGTERM)
    )
    stages.after_worker_sigterm = position(out)
    stages.kill_at = min(stages.after_worker_sigterm[1] + 3, 14)
    # Workers whose torchrun is SIGKILLed (no signal passed on): their own processes (a prewarmed worker's run is
    # the prewarm server's child, not torchrun's), which the kernel signals when their parent ends.
    orphaned = Job(command(prewarmed=False))
    orphaned.wait_for(at(2, stages.kill_at), timeout=WAIT)
    stages.orphans = list(training_processes(orphaned).values())
    orphaned.process.kill()  # torchrun alone: its workers run in sessions of their own
    killed_at = time.monotonic()
    relaunch = Job(command())  # at once, as a user or a requeue would: it finds the directory free or waits
    stages.orphans_alive_after = orphans_alive(stages.orphans, deadline=killed_at + 30) - killed_at
    stages.orphaned_output = orphaned.finish()[1]
    stages.after_orphaned, stages.end = position(out), relaunch.finish()
    stages.weights = weights(out)
    return stages


def orphans_alive(pids, deadline):
    """When the last of `pids` ended (or `deadline`, time.monotonic())."""
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.1)
    return time.monotonic()


def spawn_interrupted_runs(data, out):
    """train_spawn.py with its default process count (2 without a GPU): SIGUSR1 to the spawn parent at epoch 1 step
    7, then `--resume auto` to the end."""
    command = [
        PYTHON,
        REPO / "train_spawn.py",
        *RUN,
        "-j",
        "0",
        "--data",
        data,
        "--output-dir",
        out,
        "--resume",
        "auto",
        "--master-port",
        free_port(),
    ]  # 2 processes: its default without a GPU
    stages = SimpleNamespace()
    stages.sigusr1 = interrupt(command, at(1, 7), lambda job: job.process.send_signal(signal.SIGUSR1))
    stages.after_sigusr1 = position(out)
    stages.end = Job(command).finish()
    stages.weights = weights(out)
    return stages


def stalled_rank_run(data, out):
    """torchrun with --dist-timeout 5, the worker of rank 1 stopped (SIGSTOP) at epoch 0 step 3: seconds
    from the stall to the first timeout message, from that message to the end of the job, and the job's
    (returncode, output)."""
    job = Job(
        torchrun_command(
            "train_ddp.py",
            2,
            *TINY_NET,
            "--data",
            data,
            "--output-dir",
            out,
            "--dist-timeout",
            "5",
            "--epochs",
            "50",
            prewarmed=False,
        )
    )
    job.wait_for(at(0, 3), timeout=WAIT)
    os.kill(training_processes(job)[1], signal.SIGSTOP)
    stalled = time.monotonic()
    job.wait_for(re.compile(r"[Tt]imed? ?out"), timeout=120)
    timed_out = time.monotonic()
    result = job.finish(timeout=180)
    return SimpleNamespace(to_timeout=timed_out - stalled, to_end=time.monotonic() - timed_out, result=result)


SIDE_BY_SIDE = {
    "uninterrupted": uninterrupted_runs,
    "dp": dp_interrupted_runs,
    "torchrun": torchrun_interrupted_runs,
    "spawn": spawn_interrupted_runs,
    "stalled": stalled_rank_run,
    "finished": lambda data, out: finished_runs(data, out),
}


@pytest.fixture(scope="module")
def uninterrupted(side_by_side):
    return outcome(side_by_side, "uninterrupted")


def test_the_reference_runs_really_train(uninterrupted):
    """Bitwise equality proves nothing if training stood still: the last 5 steps moved the weights
    (the trainable parameters: BatchNorm's running statistics change from forward passes alone)."""
    names = [name for name, _ in torchvision.models.mobilenet_v3_small(num_classes=3).named_parameters()]
    for mode, (final, five_steps_before) in uninterrupted.items():
        assert set(names) < final.keys()
        moved = max((final[k].double() - five_steps_before[k].double()).abs().max().item() for k in names)
        assert moved > 1e-4, mode


@pytest.fixture(scope="module")
def dp_interrupted(side_by_side):
    return outcome(side_by_side, "dp")


def test_sigterm_stops_dataparallel_at_a_step_with_a_checkpoint_and_exit_code_75(dp_interrupted):
    returncode, output = dp_interrupted.sigterm
    epoch, step = dp_interrupted.after_sigterm
    assert returncode == PREEMPTED, output[-3000:]
    assert epoch == 1 and 7 <= step < 15, output[-3000:]  # the step the signal came in, or the next
    assert f"stopped on SIGTERM: checkpoint of epoch 1 step {step}" in output
    assert_resumed_where_it_stopped(dp_interrupted.sigkill[1], (epoch, step))


def test_a_run_killed_mid_epoch_resumes_and_ends_bitwise_equal(dp_interrupted, uninterrupted):
    returncode, _ = dp_interrupted.sigkill
    assert returncode == -signal.SIGKILL
    epoch, step = dp_interrupted.after_sigkill
    assert epoch == 2 and 5 <= step < 15  # lost: the steps after the last periodic checkpoint
    returncode, output = dp_interrupted.end
    assert returncode == 0, output[-3000:]
    assert_resumed_where_it_stopped(output, (epoch, step))
    assert_bitwise_equal(dp_interrupted.weights, uninterrupted["dp"][0])
    assert dp_interrupted.epochs == ["0", "1", "2"]


@pytest.fixture(scope="module")
def torchrun_interrupted(side_by_side):
    return outcome(side_by_side, "torchrun")


def test_torchrun_restarts_a_killed_worker_and_the_run_resumes_from_its_checkpoint(torchrun_interrupted):
    stages = torchrun_interrupted
    killed = stages.killed_workers
    assert sorted(stages.restarted_workers) == [0, 1] and not set(stages.restarted_workers.values()) & set(
        killed.values()
    )  # new processes, both ranks
    _, output = stages.sigterm
    note = r"^note: a restart of this job \(torchrun \w+\): it goes on from its checkpoint in .* \(as --resume auto\); "
    assert re.search(note + r"--overwrite was for its first start$", output, re.M), output[-3000:]
    after_restart = output[output.index("resumed from ") :]
    resumed = re.match(r"resumed from .*checkpoint\.pth \(epoch 0, step (5|10)\)", after_restart)
    assert resumed, after_restart[:3000]  # the last checkpoint before the kill (at step 7, seen by the test)
    assert_resumed_where_it_stopped(after_restart, (0, int(resumed.group(1))))


def test_sigterm_to_torchrun_stops_every_rank_at_the_same_step(torchrun_interrupted):
    """torchrun passes SIGTERM on to every worker: the ranks agree on the step to stop after, and
    save one checkpoint there (a collective: no rank may be missing). torchrun then ends with its
    own exit status (it was signalled; it reports no worker's)."""
    stages = torchrun_interrupted
    returncode, output = stages.sigterm
    epoch, step = stages.after_sigterm
    assert returncode != 0 and re.search(r"Received (15|SIGTERM) death signal", output), output[-3000:]
    assert epoch == 1 and 7 <= step < 15, output[-3000:]
    assert f"stopped on SIGTERM: checkpoint of epoch 1 step {step}" in output
    assert_resumed_where_it_stopped(stages.worker_sigterm[1], (epoch, step))


def torchrun_exit_codes(output):
    """{rank: exit code} from torchrun's failure report ("  rank      : 1 (local_rank: 1)", then
    "  exitcode  : 75"), read line by line: another process's line may land between the two."""
    exit_codes, rank = {}, None
    for line in output.splitlines():
        if found := re.match(r"\s+rank\s+: (\d+) \(local_rank: \d+\)", line):
            rank = found.group(1)
        elif rank is not None and (found := re.match(r"\s+exitcode\s+: (-?\d+)", line)):
            exit_codes[rank], rank = found.group(1), None
    return exit_codes


def test_sigterm_to_one_worker_stops_every_rank_with_exit_code_75_as_torchrun_reports(torchrun_interrupted):
    """As Slurm or a node agent may signal the training processes: rank 1 alone gets SIGTERM, every rank
    stops after the same step, and torchrun reports each worker's exit code: 75."""
    stages = torchrun_interrupted
    returncode, output = stages.worker_sigterm
    epoch, step = stages.after_worker_sigterm
    assert returncode != 0
    assert torchrun_exit_codes(output) == {"0": str(PREEMPTED), "1": str(PREEMPTED)}, output[-3000:]
    assert epoch == 2 and 3 <= step < 15, output[-3000:]
    assert f"stopped on a signal to another rank: checkpoint of epoch 2 step {step}" in output
    assert_resumed_where_it_stopped(stages.orphaned_output, (epoch, step))  # the next launch


def test_workers_whose_torchrun_is_sigkilled_stop_at_a_step_with_their_checkpoint_and_the_relaunch_goes_on(
    torchrun_interrupted,
):
    """torchrun SIGKILLed three steps into epoch 2's rest cannot pass a signal on: its workers get SIGTERM from the
    kernel as their parent ends (common/launch.py end_with_launcher), agree on a step, save its checkpoint and end
    within seconds instead of training on as orphans; a relaunch started at once resumes from that step (bitwise
    equal at the end: the test below)."""
    stages = torchrun_interrupted
    assert len(stages.orphans) == 2 and stages.orphans_alive_after < 20, stages.orphaned_output[-3000:]
    epoch, step = stages.after_orphaned
    assert (epoch, stages.kill_at <= step) == (2, True), stages.orphaned_output[-3000:]
    assert f"stopped on SIGTERM (its launcher ended): checkpoint of epoch 2 step {step}" in stages.orphaned_output
    returncode, output = stages.end
    assert returncode == 0, output[-3000:]
    assert_resumed_where_it_stopped(output, (epoch, step))


def test_the_interrupted_torchrun_run_ends_bitwise_equal_to_the_uninterrupted_one(torchrun_interrupted, uninterrupted):
    stages = torchrun_interrupted
    returncode, output = stages.end
    assert returncode == 0, output[-3000:]
    assert_bitwise_equal(stages.weights, uninterrupted["ddp"][0])


def test_sigusr1_to_the_spawn_parent_reaches_the_workers(side_by_side, uninterrupted):
    stages = outcome(side_by_side, "spawn")
    returncode, output = stages.sigusr1
    assert "no GPU in use: 2 processes on the CPU (--nproc-per-node N to choose)" in output
    assert "spawn: world size 2" in output
    epoch, step = stages.after_sigusr1
    assert returncode == PREEMPTED, output[-3000:]
    assert epoch == 1 and 7 <= step < 15, output[-3000:]
    assert f"stopped on SIGUSR1: checkpoint of epoch 1 step {step}" in output
    returncode, output = stages.end
    assert returncode == 0, output[-3000:]
    assert_resumed_where_it_stopped(output, (epoch, step))
    assert_bitwise_equal(stages.weights, uninterrupted["ddp"][0])


def test_a_stalled_rank_fails_the_job_after_the_dist_timeout(side_by_side):
    stalled = outcome(side_by_side, "stalled")
    returncode, output = stalled.result
    assert returncode != 0
    # Measured from the stall and from the first timeout message, not from the start (10-30 s on a busy
    # 2-core machine, more with the other runs side by side): the ranks that wait for the stalled one
    # give up after --dist-timeout (5 s)...
    assert stalled.to_timeout < 30, f"no rank gave up within 30 s of a 5 s --dist-timeout:\n{output[-3000:]}"
    # ...and torchrun ends the job: it sends SIGTERM to the stalled (stopped) rank, waits 30 s for it to
    # exit (torchrun's fixed grace), then kills it. Without the timeout the job would wait for 30 minutes.
    assert stalled.to_end < 90, f"the job outlived the rank's timeout by {stalled.to_end:.0f} s:\n{output[-3000:]}"


def test_a_line_of_ours_written_into_another_process_s_unfinished_line_is_read_apart():
    """A library that writes a line in two parts (text, then newline), ours landing between them: the job's
    output has our line on a line of its own, found by its start (harness.jobs.our_lines_apart)."""
    other = "See https://nanobind.readthedocs.io/en/latest/refleaks.html"
    writes = [
        other,
        "error: cannot decode a.jpg (x); without --strict-data ...\n",
        "\n",
        "abc error: inside\n",
        "x * Acc@1 50.000  Acc@5 100.000  Loss 1.0  (12 images)\n",
        f"{other}done: best acc@1 50.00\n",
    ]
    script = f"import os\nfor text in {writes!r}:\n    os.write(1, text.encode())"
    returncode, output = Job([PYTHON, "-c", script]).finish(timeout=60)
    assert returncode == 0
    assert output.splitlines() == [
        other,
        "error: cannot decode a.jpg (x); without --strict-data ...",
        "",
        "abc error: inside",
        "x",
        " * Acc@1 50.000  Acc@5 100.000  Loss 1.0  (12 images)",
        other,
        "done: best acc@1 50.00",
    ]


def job_processes(job, count, timeout=30):
    """The job's live processes, once `count` of them are (or at the timeout): loader workers live while their
    loader does, not at an epoch's end (validation, the checkpoint), where a test that read the line late may be."""
    deadline = time.monotonic() + timeout
    while len(running := job.leftovers()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return running


def test_a_test_that_fails_leaves_no_process_of_its_jobs(data, tmp_path):
    """Fails on purpose, three times, and shows that nothing of the failed jobs is left. A job whose line
    never comes: torchrun, its two workers (each in a session of its own) and their loader workers."""
    job = Job(
        torchrun_command(
            "train_ddp.py", 2, *TINY_NET, "-j", "1", "--data", data, "--output-dir", tmp_path / "out", "--epochs", "50"
        )
    )
    # (torchrun's launcher forked by the prewarm server: found by its session; its workers by theirs)
    assert isinstance(job.process, PrewarmedProcess) or os.environ.get("PREWARMED") == "0"
    job.wait_for(at(0, 2))
    running = job_processes(job, 5)
    assert len(running) >= 5, running  # torchrun, 2 workers, a loader worker each
    with pytest.raises(AssertionError, match="no line matching 'a line this job never prints'"):
        job.wait_for(re.compile("a line this job never prints"), timeout=1)
    assert not job.leftovers()
    # A prewarmed run (forked by the prewarm server, so /proc shows the server's environment, without the
    # marker) and its two loader workers: found by their session.
    job = Job(
        [
            PYTHON,
            REPO / "train_dp.py",
            *TINY_NET,
            "-j",
            "2",
            "--data",
            data,
            "--output-dir",
            tmp_path / "dp",
            "--epochs",
            "50",
        ]
    )
    assert isinstance(job.process, PrewarmedProcess) or os.environ.get("PREWARMED") == "0"  # (then a plain one)
    job.wait_for(at(0, 2))
    running = job_processes(job, 3)
    assert len(running) >= 3 and job.process.pid in running, running
    with pytest.raises(AssertionError, match="no line matching 'a line this job never prints'"):
        job.wait_for(re.compile("a line this job never prints"), timeout=1)
    assert not [pid for pid in running if alive(pid)]
    # A run() that times out: a launcher that was exec'd (as the run_scripts exec torchrun) and a child of
    # it in a session of its own (as torchrun's workers). Found by a variable in their environment.
    probe, seen = uuid.uuid4().hex, []
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            seen.append(len(processes_marked(probe, name="LEAK_PROBE")))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            run(
                [
                    "bash",
                    "-c",
                    f"\"{PYTHON}\" -c \"import subprocess; subprocess.Popen(['sleep', '600'], "
                    f'start_new_session=True)"; exec sleep 600',
                ],
                env=clean_env(LEAK_PROBE=probe),
                timeout=3,
            )
    finally:
        watching.set()
        watcher.join()
    assert max(seen) >= 2, seen  # both sleeps were running
    assert not processes_marked(probe, name="LEAK_PROBE")


# ----------------------------------------------------------------------------- what a run leaves to the next


def limit_file_size(limit):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def mtimes(folder):
    """When each file of a run was last written (run.lock aside: a refused relaunch held it, and wrote who it was)."""
    return {path.name: path.stat().st_mtime_ns for path in folder.iterdir() if path.name != "run.lock"}


def finished_runs(data, root):
    """TinyNet trained 2 epochs (a checkpoint per epoch: checkpoint.pth and checkpoint_prev.pth), then, side
    by side: the relaunches that must be refused, each a process of its own (forked from one that imported
    torch already: harness.jobs.run_prewarmed): the same command without --resume; the same with the latest
    checkpoint damaged; another --arch; other data; an --output-dir that cannot be created. And, on copies
    of the run's directory: --resume auto with the latest checkpoint damaged; --resume auto where no file
    may grow past 64 KiB (as on a full disk); and --overwrite."""
    run_dir = root / "run"
    common = [*TINY_NET, "--epochs", "2", "--checkpoint-interval", "0"]
    assert_ok(run_script("train_dp.py", *common, "--data", data, "--output-dir", run_dir))
    copies = {
        name: shutil.copytree(run_dir, root / name)
        for name in ("damaged", "damaged-resumed", "full-disk", "full-disk-spawn", "overwritten", "summary-lost")
    }
    (copies["summary-lost"] / "summary.json").unlink()  # as a failed write of it leaves the run (written atomically)
    for name in ("damaged", "damaged-resumed"):
        saved = (copies[name] / "checkpoint.pth").read_bytes()
        (copies[name] / "checkpoint.pth").write_bytes(saved[:1000])  # truncated, as by a crash of the storage
    (copies["overwritten"] / "bad_images.txt").write_text("left by the first run\n")
    before = {
        "run": mtimes(run_dir),
        "damaged": mtimes(copies["damaged"]),
        "full-disk": {
            name: (copies["full-disk"] / name).read_bytes() for name in ("checkpoint.pth", "checkpoint_prev.pth")
        },
        "overwritten": (copies["overwritten"] / "checkpoint.pth").stat().st_mtime_ns,
    }
    other_data = make_image_folder(root / "other-data", train_per_class=2, val_per_class=1, num_classes=4)
    (root / "a-file").write_text("not a directory")

    def train_dp(output_dir, *flags, **popen):
        return Job([PYTHON, REPO / "train_dp.py", *common, "--data", data, "--output-dir", output_dir, *flags], **popen)

    jobs = {
        "damaged-resumed": train_dp(copies["damaged-resumed"], "--resume", "auto", "--epochs", "3"),
        "full-disk": train_dp(
            copies["full-disk"], "--resume", "auto", "--epochs", "3", preexec_fn=limit_file_size(64 * 1024)
        ),
        "overwritten": train_dp(copies["overwritten"], "--epochs", "1", "--overwrite"),
        "summary-lost": train_dp(copies["summary-lost"], "--resume", "auto"),
        "full-disk-spawn": Job(
            [
                PYTHON,
                REPO / "train_spawn.py",
                *common,
                "--data",
                data,
                "--output-dir",
                copies["full-disk-spawn"],
                "--resume",
                "auto",
                "--epochs",
                "3",
                "--nproc-per-node",
                "2",
                "-j",
                "0",
                "--master-port",
                free_port(),
            ],
            preexec_fn=limit_file_size(64 * 1024),
        ),
    }
    relaunches = {
        "forgot-resume": ["--data", data, "--output-dir", run_dir],
        "forgot-resume-damaged": ["--data", data, "--output-dir", copies["damaged"]],
        "other-arch": ["--data", data, "--output-dir", run_dir, "-a", "resnet18"],
        "other-data": ["--data", other_data, "--output-dir", run_dir],
        "uncreatable-output-dir": ["--data", data, "--output-dir", root / "a-file" / "run"],
    }
    try:
        refused = dict(
            zip(
                relaunches,
                run_prewarmed("train_dp.py", [[*common, *flags] for flags in relaunches.values()], parallel=1),
            )
        )  # one at a time: a second would find run_dir locked
    except BaseException:
        for job in jobs.values():
            job.kill()
        raise
    ended = {name: job.finish() for name, job in jobs.items()}
    after = {
        "run": mtimes(run_dir),
        "damaged": mtimes(copies["damaged"]),
        "full-disk": {name: (copies["full-disk"] / name).read_bytes() for name in before["full-disk"]},
        "full-disk-listing": sorted(path.name for path in copies["full-disk"].iterdir()),
    }
    # The disk has room again: the run goes on from the checkpoint its failed save left whole.
    ended["full-disk-resumed"] = train_dp(copies["full-disk"], "--resume", "auto", "--epochs", "3").finish()
    return SimpleNamespace(run_dir=run_dir, copies=copies, before=before, refused=refused, ended=ended, after=after)


@pytest.fixture(scope="module")
def finished_run(side_by_side):
    return outcome(side_by_side, "finished")


def test_a_damaged_latest_checkpoint_is_reported_and_the_previous_one_used(finished_run):
    output = assert_ok(subprocess.CompletedProcess("train_dp.py", *finished_run.ended["damaged-resumed"]))
    assert re.search(
        r"^warning: cannot read checkpoint \S+/checkpoint\.pth: truncated or not a PyTorch checkpoint "
        r"\(\w+\); resuming from the previous checkpoint \S+/checkpoint_prev\.pth$",
        output,
        re.MULTILINE,
    ), output[-3000:]
    assert "checkpoint_prev.pth (epoch 1)" in output and "Epoch: [1]" in output and "Epoch: [0]" not in output
    assert torch.load(finished_run.copies["damaged-resumed"] / "checkpoint.pth", weights_only=True)["epoch"] == 3


def test_a_checkpoint_that_cannot_be_written_half_way_leaves_the_one_before_it_whole(finished_run):
    """A save that fails half-way (no file may grow past 64 KiB: a full disk) must leave the checkpoint before it
    whole, which --resume auto then goes on from: written in place, the new one would have cut it short."""
    before = finished_run.before["full-disk"]
    assert len(before["checkpoint.pth"]) > 128 * 1024  # a TinyNet checkpoint, with its optimizer: ~200 KiB
    returncode, output = finished_run.ended["full-disk"]
    assert returncode == 1, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "could not write a checkpoint" in lines[0] and "intact" in lines[0], output
    assert "Traceback" not in output
    assert finished_run.after["full-disk"] == before
    assert not [name for name in finished_run.after["full-disk-listing"] if name.startswith(".")]


def test_after_a_failed_save_resume_auto_goes_on_from_the_checkpoint_before_it(finished_run):
    run_dir = finished_run.copies["full-disk"]
    output = assert_ok(subprocess.CompletedProcess("train_dp.py", *finished_run.ended["full-disk-resumed"]))
    assert f"resumed from {run_dir / 'checkpoint.pth'} (epoch 2)" in output and "warning: cannot read" not in output
    assert_bitwise_equal(weights(run_dir), weights(finished_run.copies["damaged-resumed"]))


def test_a_final_summary_json_that_a_failed_write_lost_is_written_again_on_resume(finished_run):
    """The run trained to --epochs, its summary.json lost (a full disk at its write): --resume auto has nothing to
    train, validates the final weights and writes it, the figures of the run's own (it stayed missing for good)."""
    run_dir = finished_run.copies["summary-lost"]
    output = assert_ok(subprocess.CompletedProcess("train_dp.py", *finished_run.ended["summary-lost"]))
    assert "already trained 2 of --epochs 2: nothing to do" in output, output[-3000:]
    assert f"{run_dir / 'summary.json'} is missing: the final weights are validated" in output
    written, original = (
        json.loads((folder / "summary.json").read_text()) for folder in (run_dir, finished_run.run_dir)
    )
    for key in (
        "arch",
        "epochs",
        "best_acc1",
        "final_acc1",
        "final_acc5",
        "bad_images",
        "tflops_per_device",
        "mfu_pct",
    ):
        assert written[key] == original[key], key
    assert written["final_val_loss"] == pytest.approx(original["final_val_loss"], abs=1e-6)
    assert written["train_images_per_second"] == pytest.approx(original["train_images_per_second"], abs=0.051)


def test_weights_gone_nan_end_the_run_in_one_line_and_the_checkpoint_before_them_stays(data, tmp_path):
    """A loss that diverges in epoch 1 (DivergingNet: its logits infinite from the 16th step on) leaves NaN weights:
    at the progress line that shows the loss NaN every rank stops in one line, exit code 1, and checkpoint.pth stays
    epoch 0's (was: trained on, and saved NaN over the last good weights)."""
    out, env = tmp_path / "run", dict(clean_env(), DIVERGE_AFTER="15")
    command = torchrun_command("train_ddp.py", 2, *TINY, "-a", "tests.tiny_models:DivergingNet", "-b", "8")
    result = run([*command, "--epochs", "3", "--data", data, "--output-dir", out], env=env)
    returncode, output = result.returncode, result.stdout
    assert returncode == 1, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 2 and len(set(lines)) == 1, output[-3000:]  # (one a rank)
    assert re.match(
        r"error: at epoch 1 step 1 0\.0\.weight \(and \d+ more\) is NaN or infinite, which training", lines[0]
    )
    assert re.search(r"^Epoch: \[1\] \[ 1/15\]  loss nan ", output, re.MULTILINE), output[-3000:]
    assert no_traceback_of_ours(output), output[-3000:]
    saved = torch.load(out / "checkpoint.pth", weights_only=True)
    assert saved["epoch"] == 1 and all(tensor.isfinite().all() for tensor in saved["state_dict"].values())
    assert [row.split(",")[0] for row in (out / "log.csv").read_text().splitlines()[1:]] == ["0"]


def test_a_checkpoint_that_cannot_be_written_under_spawn_ends_in_its_one_line_too(finished_run):
    """Once a traceback: spawn passed the worker's CheckpointWriteError up as its text."""
    returncode, output = finished_run.ended["full-disk-spawn"]
    assert returncode == 1, output[-3000:]
    assert re.search(
        r"^error: could not write a checkpoint to \S+ \(.+\); the checkpoints already there are intact$",
        output,
        re.MULTILINE,
    ), output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_an_output_dir_of_another_run_is_refused_unless_resume_names_it(finished_run):
    for name in ("other-arch", "other-data"):
        result = finished_run.refused[name]
        assert result.returncode == 2, result.stdout
        assert result.stdout.strip().splitlines() == [
            line for line in result.stdout.splitlines() if "holds checkpoints of another run" in line
        ], result.stdout
    assert finished_run.after["run"] == finished_run.before["run"]


def test_an_output_dir_that_cannot_be_created_is_one_line_and_exit_2(finished_run):
    result = finished_run.refused["uncreatable-output-dir"]
    assert result.returncode == 2, result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "cannot write to --output-dir" in errors[0] and "Traceback" not in result.stdout


def test_a_relaunch_that_forgot_resume_is_refused_and_costs_the_run_nothing(finished_run):
    result = finished_run.refused["forgot-resume"]
    assert result.returncode == 2, result.stdout
    assert result.stdout.strip().splitlines() == [
        f"error: {finished_run.run_dir} holds a run at epoch 2 step 0: continue it with --resume auto, or start over "
        "with --overwrite (its checkpoints are deleted) or another --output-dir"
    ]
    assert finished_run.after["run"] == finished_run.before["run"]
    # A damaged latest checkpoint is no licence to start over: --resume auto would use the previous one.
    result = finished_run.refused["forgot-resume-damaged"]
    assert result.returncode == 2 and re.search(
        r"holds a run \(checkpoint\.pth(, checkpoint_prev\.pth)?(, model_best\.pth)?; "
        r"the first is damaged\): continue it with --resume auto",
        result.stdout,
    ), result.stdout
    assert finished_run.after["damaged"] == finished_run.before["damaged"]
    # --overwrite starts afresh: nothing of the first run is left to pass for the new one's.
    run_dir = finished_run.copies["overwritten"]
    assert_ok(subprocess.CompletedProcess("train_dp.py", *finished_run.ended["overwritten"]))
    assert [row.split(",")[0] for row in (run_dir / "log.csv").read_text().splitlines()] == ["epoch", "0"]
    assert not (run_dir / "bad_images.txt").exists() and not (run_dir / "checkpoint_prev.pth").exists()
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert (run_dir / "checkpoint.pth").stat().st_mtime_ns > finished_run.before["overwritten"]


# ----------------------------------------------------------------------------- exit codes


def test_a_spawn_worker_killed_by_a_signal_ends_the_job_with_128_plus_its_number(data, tmp_path):
    """Once 247 for SIGKILL: spawn's negative exit code passed to SystemExit."""
    job = Job(
        [
            PYTHON,
            REPO / "train_spawn.py",
            *TINY_NET,
            "--data",
            data,
            "--output-dir",
            tmp_path,
            "--epochs",
            "5",
            "--nproc-per-node",
            "2",
            "-j",
            "0",
            "--master-port",
            free_port(),
        ],
        prewarmed=False,  # spawn's processes as a user sees them: `python -c "...spawn_main..."`
    )
    job.wait_for(re.compile(r"^Epoch: \[0\] \[ *3/"), timeout=WAIT)
    workers = [
        pid
        for pid in job.leftovers()
        if process_stat(pid)
        and int(process_stat(pid)[1]) == job.process.pid
        and b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]  # not spawn's resource tracker
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    returncode, output = job.finish(timeout=120)
    assert returncode == 128 + signal.SIGKILL, output[-3000:]
    assert re.search(r"^error: process \d exited \(SIGKILL\); see the errors above$", output, re.MULTILINE), output[
        -3000:
    ]


def test_a_console_that_cannot_be_written_ends_nothing(tiny_data, tmp_path):
    """stdout to a pipe whose reader is gone after the first line (`| head -1`), stderr to a full device: the run
    trains to its end (was: a BrokenPipeError's traceback at its next line, the epoch lost). Bad input, stdout closed
    and stderr so: exit code 2 still (was 1: the error line's own write failed)."""
    out = tmp_path / "run"
    train = shlex.join(
        map(str, [PYTHON, REPO / "train_dp.py", "--data", tiny_data, *TINY_NET, "--epochs", "2", "-p", "1"])
    )
    result = run(
        ["bash", "-c", f"{train} --output-dir {out} 2>/dev/full | head -1; exit ${{PIPESTATUS[0]}}"], prewarmed=False
    )
    assert result.returncode == 0 and len(result.stdout.splitlines()) == 1, result.stdout
    assert json.loads((out / "summary.json").read_text())["epochs"] == 2
    refused = run(["bash", "-c", f"{train} --data {tmp_path / 'nowhere'} >&- 2>/dev/full"], prewarmed=False)
    assert refused.returncode == 2 and refused.stdout == ""

"""The Slurm job scripts under a real Slurm: `sbatch --wait` on a one-node cluster of this machine, and a
job stopped by the signal Slurm sends before its time limit, which requeues itself and finishes.

`make test-slurm` installs, starts and afterwards stops that cluster (tools/slurm_local_cluster.sh).
Without a responsive Slurm node these tests are skipped, unless REQUIRE_SLURM=1 (which `make test-slurm`
sets, and nothing else): then each of them fails, so that a cluster that is down, or stops responding
during the run, fails the target instead of passing it with everything skipped."""

import os
import re
import shutil
import subprocess
import time
import uuid

import pytest
import torch

from conftest import TINY, make_image_folder
from harness.jobs import assert_ok, torchrun
from harness.processes import PYTHON, REPO, clean_env, free_port

pytestmark = pytest.mark.slurm


def _slurm_unavailable():
    """Why the tests cannot run here, or None."""
    missing = [tool for tool in ("sbatch", "sinfo", "scontrol", "scancel") if shutil.which(tool) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} not on PATH): "
            "run `make test-slurm`, which installs and starts a one-node cluster"
        )
    try:  # `scontrol ping` answers at once when slurmctld is down; sinfo retries for about 10 s
        ping = subprocess.run(
            ["scontrol", "ping"], text=True, timeout=30, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        if ping.returncode != 0:
            answer = (ping.stdout.strip().splitlines() or ["no output"])[0][:200]
            return (
                f"the Slurm controller does not respond (scontrol ping: {answer}): start a one-node "
                "cluster with tools/slurm_local_cluster.sh start, or run `make test-slurm`"
            )
        result = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"],
            text=True,
            timeout=30,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    except subprocess.TimeoutExpired:
        return "scontrol/sinfo did not answer within 30 s: is slurmctld running? (tools/slurm_local_cluster.sh start)"
    # A state ending in '*' means the node does not respond; idle/mix/alloc can run jobs.
    states = [line.split()[-1] for line in result.stdout.splitlines() if line.strip()]
    if result.returncode != 0 or not any(state in ("idle", "mix", "alloc") for state in states):
        answer = " ".join(result.stdout.split())[:300] or "no output"
        return f"no responsive Slurm node (sinfo: {answer}): start one with tools/slurm_local_cluster.sh start"
    return None


REQUIRED = os.environ.get("REQUIRE_SLURM") == "1"
_reason = _slurm_unavailable()
if _reason and not REQUIRED:
    pytest.skip(_reason, allow_module_level=True)


def _check_slurm():
    """A Slurm node that responds, or a failure (REQUIRE_SLURM=1) or skip saying why not."""
    reason = _slurm_unavailable()
    if reason and REQUIRED:
        pytest.fail(f"REQUIRE_SLURM=1, but {reason}", pytrace=False)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module", autouse=True)
def responsive_slurm_first():
    """Before the module's fixtures start their runs."""
    _check_slurm()


@pytest.fixture(autouse=True)
def responsive_slurm():
    """Before each test: the node may have stopped responding during an earlier one."""
    _check_slurm()


JOB_TIMEOUT = 300  # seconds for a whole job; Slurm's own limit (--time) is 5 minutes too


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """3 classes, 8 train and 4 val JPEGs per class."""
    return make_image_folder(tmp_path_factory.mktemp("slurm_data"), train_per_class=8, val_per_class=4, num_classes=3)


def sbatch_command(script, sbatch_args, train_args, job_out, name, exports):
    export = ",".join(
        [
            "ALL",
            f"MASTER_PORT={free_port()}",
            f"PYTHON={PYTHON}",
            "OMP_NUM_THREADS=1",
            "CUDA_VISIBLE_DEVICES=",
            *(f"{key}={value}" for key, value in exports.items()),
        ]
    )
    return [
        "sbatch",
        "--nodes=1",
        f"--job-name={name}",
        "--time=5",
        f"--output={job_out}",
        f"--export={export}",
        *sbatch_args,
        f"run_scripts/{script}",
        *map(str, train_args),
    ]


def sbatch(script, sbatch_args, train_args, tmp_path, **exports):
    """`sbatch --wait script train_args` from the repository root; (exit status, job output)."""
    job_out = tmp_path / "job.out"
    name = f"pytest-{uuid.uuid4().hex[:12]}"
    command = sbatch_command(script, ["--wait", *sbatch_args], train_args, job_out, name, exports)
    finished = False
    try:
        result = subprocess.run(
            command,
            cwd=REPO,
            env=clean_env(),
            text=True,
            timeout=JOB_TIMEOUT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        finished = True
    finally:
        if not finished:  # a hang (or an interrupt): do not leave the job running
            subprocess.run(["scancel", f"--name={name}"], timeout=30)
    output = job_out.read_text() if job_out.exists() else ""
    return result.returncode, f"--- sbatch:\n{result.stdout}\n--- job output:\n{output}", output


def command_line(output):
    """The command the job script ran, as printed by _common.sh's `run` ('+ ...')."""
    lines = [line for line in output.splitlines() if line.startswith("+ ")]
    assert len(lines) == 1, output[-4000:]
    return lines[0]


def train_args(data, out):
    return [*TINY, "--data", data, "-b", "8", "--epochs", "1", "--output-dir", out]


def check_training(output, out, report):
    assert output.count("ddp: world size 2") == 1, report[-4000:]  # printed by rank 0 only
    assert (out / "checkpoint.pth").exists(), report[-4000:]
    # One writer: the only checkpoint anywhere under the output directory.
    assert sorted(out.rglob("checkpoint*.pth")) == [out / "checkpoint.pth"], report[-4000:]


def test_slurm_ddp_sbatch_runs_torchrun_under_srun(data, tmp_path):
    out = tmp_path / "run"
    status, report, output = sbatch("slurm_ddp.sbatch", [], train_args(data, out), tmp_path, NPROC_PER_NODE=2)
    assert status == 0, report[-4000:]
    line = command_line(output)
    assert "srun" in line and "torch.distributed.run" in line, line
    assert "--nproc-per-node=2" in line, line
    check_training(output, out, report)


def test_slurm_ddp_tasks_sbatch_takes_world_size_from_slurm_ntasks(data, tmp_path):
    out = tmp_path / "run"
    status, report, output = sbatch("slurm_ddp_tasks.sbatch", ["--ntasks-per-node=2"], train_args(data, out), tmp_path)
    assert status == 0, report[-4000:]
    line = command_line(output)
    assert "srun" in line and "torch.distributed.run" not in line, line
    check_training(output, out, report)


# Preemption: the signal Slurm sends before the time limit (`#SBATCH --signal=B:USR1@120`) stops every
# rank after the same step with a checkpoint, the job requeues itself, and the requeued job (same job
# id, output appended) resumes from that step and ends bitwise equal to a run never interrupted.
# mobilenet_v3_small (dropout, BatchNorm) still learns in every epoch of this run; 240 training
# images, global batch 8: 30 steps an epoch, a checkpoint every 5 steps.
PREEMPT_RUN = [
    "-a",
    "mobilenet_v3_small",
    "--train-crop-size",
    "64",
    "--val-resize-size",
    "64",
    "--val-crop-size",
    "64",
    "-j",
    "0",
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
SIGNAL_AT = re.compile(r"^Epoch: \[1\] \[ 7/30\]", re.MULTILINE)
REQUEUE_TIMEOUT = 240  # seconds from the signal to the end of the requeued job
# A job in one of these states will not run again (squeue forgets a finished job; scontrol keeps it).
ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "REQUEUE_HOLD",
    "SPECIAL_EXIT",
)


@pytest.fixture(scope="module")
def preempt_data(tmp_path_factory):
    """3 classes, 80 train and 4 val JPEGs per class."""
    return make_image_folder(
        tmp_path_factory.mktemp("slurm_preempt_data"), train_per_class=80, val_per_class=4, num_classes=3
    )


@pytest.fixture(scope="module")
def uninterrupted(preempt_data, tmp_path_factory):
    """The final weights of the same training as two processes under torchrun, not interrupted."""
    out = tmp_path_factory.mktemp("slurm_uninterrupted")
    assert_ok(torchrun("train_ddp.py", 2, *PREEMPT_RUN, "--data", preempt_data, "--output-dir", out))
    return torch.load(out / "checkpoint.pth", weights_only=True)["state_dict"]


def job_info(job_id):
    """scontrol's fields of the job (JobState, Reason, Restarts, ExitCode, ...), {} once it is forgotten."""
    result = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id],
        text=True,
        timeout=30,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    if result.returncode != 0:
        return {}
    return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)


def read(path):
    return path.read_text() if path.exists() else ""


def submit(script, sbatch_args, train_args, job_out, exports):
    """`sbatch --parsable ...` without waiting: the job id."""
    command = sbatch_command(
        script, ["--parsable", *sbatch_args], train_args, job_out, f"pytest-{uuid.uuid4().hex[:12]}", exports
    )
    submitted = subprocess.run(
        command, cwd=REPO, env=clean_env(), text=True, timeout=60, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert submitted.returncode == 0, submitted.stdout
    return submitted.stdout.strip().split(";")[0]


def wait_for_output(job_id, job_out, pattern):
    deadline = time.monotonic() + JOB_TIMEOUT
    while not pattern.search(read(job_out)):
        state = job_info(job_id).get("JobState")
        assert state not in ENDED and time.monotonic() < deadline, (
            f"job {job_id} ({state}) printed no line matching {pattern.pattern!r}:\n{read(job_out)[-4000:]}"
        )
        time.sleep(0.2)


def follow(job_id, job_out, until, timeout=REQUEUE_TIMEOUT):
    """Poll the job until until(JobState); its last fields, and [(seconds, JobState, Reason, Restarts)]
    each time these changed."""
    start, states = time.monotonic(), []
    while True:
        info = job_info(job_id)
        state = (info.get("JobState"), info.get("Reason"), info.get("Restarts"))
        if not states or states[-1][1:] != state:
            states.append((round(time.monotonic() - start, 1), *state))
        if not info or until(state[0]):
            return info, states
        assert time.monotonic() - start < timeout, (
            f"job {job_id} still not done after {timeout} s: {states}\n{read(job_out)[-4000:]}"
        )
        time.sleep(1)


@pytest.mark.parametrize(
    "script, sbatch_args, exports",
    [
        ("slurm_ddp.sbatch", [], {"NPROC_PER_NODE": 2}),
        ("slurm_ddp_tasks.sbatch", ["--ntasks-per-node=2"], {}),
    ],
    ids=["torchrun", "tasks"],
)
def test_a_stop_signal_checkpoints_the_job_which_requeues_itself_and_finishes_bitwise_equal(
    script, sbatch_args, exports, preempt_data, uninterrupted, tmp_path
):
    out, job_out = tmp_path / "run", tmp_path / "job.out"
    job_id = submit(script, sbatch_args, [*PREEMPT_RUN, "--data", preempt_data, "--output-dir", out], job_out, exports)
    try:
        wait_for_output(job_id, job_out, SIGNAL_AT)
        signalled = subprocess.run(
            ["scancel", "--batch", "--signal=USR1", job_id],
            text=True,
            timeout=30,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert signalled.returncode == 0, signalled.stdout
        info, states = follow(job_id, job_out, until=lambda state: state in ENDED)
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
    output = read(job_out)
    print(f"job {job_id}, states after the signal: {states}")  # shown with pytest -s
    report = f"job {job_id}, states after the signal: {states}\n--- job output:\n{output[-6000:]}"
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", report
    assert info.get("Restarts") == "1", report  # requeued once
    assert output.count("+ srun ") == 2, report  # the script ran twice, the second run appended
    stopped = re.search(r"^stopped on SIGTERM: checkpoint of epoch 1 step (\d+) ", output, re.MULTILINE)
    assert stopped, report
    step = int(stopped.group(1))
    assert 7 <= step < 30, report  # after the step the signal came in, before the end of the epoch
    requeueing = output.index(f"requeueing job {job_id}")
    resumed = output.index(f"resumed from {out / 'checkpoint.pth'} (epoch 1, step {step})")
    assert requeueing < stopped.start() < resumed, report
    assert output.count("resumed from") == 1 and output.count("done: best acc@1") == 1, report
    final = torch.load(out / "checkpoint.pth", weights_only=True)
    assert (final["epoch"], final["step_in_epoch"]) == (3, 0), report
    epochs = [line.split(",")[0] for line in (out / "log.csv").read_text().splitlines()[1:]]
    assert epochs == ["0", "1", "2"], report
    different = [name for name in uninterrupted if not torch.equal(uninterrupted[name], final["state_dict"][name])]
    assert final["state_dict"].keys() == uninterrupted.keys() and not different, (
        f"{len(different)} tensors differ from the uninterrupted run, e.g. {different[:3]}"
    )


def test_scancel_of_the_job_cancels_it_instead_of_requeueing_it(preempt_data, tmp_path):
    # `scancel JOBID` sends SIGTERM to the job script too: the script must not requeue the job then.
    out, job_out = tmp_path / "run", tmp_path / "job.out"
    job_id = submit(
        "slurm_ddp_tasks.sbatch",
        ["--ntasks-per-node=2"],
        [*PREEMPT_RUN, "--data", preempt_data, "--output-dir", out],
        job_out,
        {},
    )
    try:
        wait_for_output(job_id, job_out, SIGNAL_AT)
        subprocess.run(["scancel", job_id], timeout=30)
        # A requeued job would be PENDING again (Restarts=1) before it could end.
        info, states = follow(job_id, job_out, until=lambda state: state in ENDED or state == "PENDING")
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
    output = read(job_out)
    report = f"job {job_id}, states after scancel: {states}\n--- job output:\n{output[-4000:]}"
    assert info.get("JobState") == "CANCELLED" and info.get("Restarts") == "0", report
    assert f"job {job_id} ends: waiting for its checkpoint; not requeueing" in output, report
    assert output.count("+ srun ") == 1, report

"""The Slurm job scripts under a real Slurm: `sbatch --wait` on a one-node cluster of this machine.

`make test-slurm` installs, starts and afterwards stops that cluster (run_scripts/slurm_local_cluster.sh);
without a responsive Slurm node these tests are skipped."""
import shutil
import subprocess
import uuid

import pytest

from conftest import PYTHON, REPO, TINY, clean_env, free_port, make_image_folder


def _slurm_unavailable():
    """Why the tests cannot run here, or None."""
    missing = [tool for tool in ("sbatch", "sinfo", "scontrol", "scancel") if shutil.which(tool) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not on PATH): "
                "run `make test-slurm`, which installs and starts a one-node cluster")
    try:  # `scontrol ping` answers at once when slurmctld is down; sinfo retries for about 10 s
        ping = subprocess.run(["scontrol", "ping"], text=True, timeout=30,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if ping.returncode != 0:
            answer = (ping.stdout.strip().splitlines() or ["no output"])[0][:200]
            return (f"the Slurm controller does not respond (scontrol ping: {answer}): start a one-node "
                    "cluster with run_scripts/slurm_local_cluster.sh start, or run `make test-slurm`")
        result = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], text=True, timeout=30,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired:
        return "scontrol/sinfo did not answer within 30 s: is slurmctld running? (run_scripts/slurm_local_cluster.sh start)"
    # A state ending in '*' means the node does not respond; idle/mix/alloc can run jobs.
    states = [line.split()[-1] for line in result.stdout.splitlines() if line.strip()]
    if result.returncode != 0 or not any(state in ("idle", "mix", "alloc") for state in states):
        answer = " ".join(result.stdout.split())[:300] or "no output"
        return (f"no responsive Slurm node (sinfo: {answer}): start one with "
                "run_scripts/slurm_local_cluster.sh start")
    return None


_reason = _slurm_unavailable()
if _reason:
    pytest.skip(_reason, allow_module_level=True)

JOB_TIMEOUT = 300  # seconds for a whole job; Slurm's own limit (--time) is 5 minutes too


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """3 classes, 8 train and 4 val JPEGs per class."""
    return make_image_folder(tmp_path_factory.mktemp("slurm_data"), train_per_class=8, val_per_class=4,
                             num_classes=3)


def sbatch(script, sbatch_args, train_args, tmp_path, **exports):
    """`sbatch --wait script train_args` from the repository root; (exit status, job output)."""
    job_out = tmp_path / "job.out"
    name = f"pytest-{uuid.uuid4().hex[:12]}"
    export = ",".join(["ALL", f"MASTER_PORT={free_port()}", f"PYTHON={PYTHON}", "OMP_NUM_THREADS=1",
                       "CUDA_VISIBLE_DEVICES=", *(f"{key}={value}" for key, value in exports.items())])
    command = ["sbatch", "--wait", "--nodes=1", f"--job-name={name}", "--time=5", f"--output={job_out}",
               f"--export={export}", *sbatch_args, f"run_scripts/{script}", *map(str, train_args)]
    finished = False
    try:
        result = subprocess.run(command, cwd=REPO, env=clean_env(), text=True, timeout=JOB_TIMEOUT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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
    status, report, output = sbatch("slurm_ddp_tasks.sbatch", ["--ntasks-per-node=2"], train_args(data, out),
                                     tmp_path)
    assert status == 0, report[-4000:]
    line = command_line(output)
    assert "srun" in line and "torch.distributed.run" not in line, line
    check_training(output, out, report)

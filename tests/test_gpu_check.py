"""tools/gpu_check.py (`make gpu-check`): its checks pass on a GPU machine, its harness is proven
on the CPU (the same code with gloo and a tiny model), and it fails when training does not learn."""

import re

import pytest
import torch

from harness.ahead import ahead
from harness.jobs import assert_ok, run, run_together
from harness.processes import PYTHON, REPO, clean_env

pytestmark = pytest.mark.e2e

CHECK = REPO / "tools" / "gpu_check.py"
TABLE_ROW = re.compile(
    r"^\| (?P<row>[^|]+?) \| (?P<flags>[^|]+?) \| (?P<rate>[^|]+?) \| (?P<target>[^|]+?) "
    r"\| (?P<peak>[^|]+?) \| (?P<mfu>[^|]+?) \| (?P<result>[^|]+?) \|$",
    re.MULTILINE,
)


def table(output):
    return {match["row"]: match for match in TABLE_ROW.finditer(output) if match["row"] != "row"}


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    result = run([PYTHON, CHECK], env=clean_env(), timeout=120)
    assert result.returncode == 0
    assert result.stdout == (
        "gpu-check: no CUDA GPU is visible on this machine: nothing to check (make test covers the CPU)\n"
    )


def cpu_harness_runs(tmp_path_factory):
    """The harness on the CPU, three times side by side (each starts one job at a time): the checks that must
    pass (the diagnostics' too); a row whose lr is too small to learn anything; FSDP's bf16 row and its comparison
    with DDP."""
    out = tmp_path_factory.mktemp("gpu-check-out")
    return out, run_together(
        [
            [PYTHON, CHECK, "--cpu", "--only", "ddp jpeg|dp1 synthetic|validation|resume|profile|memory|decode-gpu"],
            [*(PYTHON, CHECK, "--cpu", "--quick", "--only", "dp1 jpeg", "--extra-args", "--lr 1e-30"), "--out", out],
            [PYTHON, CHECK, "--cpu", "--quick", "--only", "fsdp jpeg bf16|fsdp losses"],
        ],
        timeout=600,
    )


cpu_runs = ahead(cpu_harness_runs, "cpu_runs")


def test_its_checks_pass_on_the_cpu(cpu_runs):
    """The harness itself, on the CPU: a DDP row (trains, loss falls, the checkpoint loads into a plain
    model), a synthetic row's rate at steady state (make benchmark-gpu's window), validation by 1 and by 2 processes,
    the exact-resume check, a --profile trace of the asked steps, a step out of memory ending the run in one line, and
    --decode gpu's rows (here their code on the CPU, where the CPU's decoder is compared with itself)."""
    result = cpu_runs[1][0]
    rows = table(assert_ok(result))
    assert set(rows) == {
        "ddp jpeg",
        "dp1 synthetic",
        "validation 1 vs N processes",
        "exact resume (ddp --deterministic)",
        "profile trace",
        "out of memory: snapshot",
        "decode-gpu pixels vs the CPU's",
        "decode-gpu while the stream is busy",
        "decode-gpu through the loader's thread",
    }
    assert all(row["result"].startswith("PASS") for row in rows.values()), result.stdout[-3000:]
    assert float(rows["ddp jpeg"]["rate"]) > 0
    # Its rate over a steady window (make benchmark-gpu's), not the epoch's; no target on the CPU.
    assert re.fullmatch(
        r"PASS \(steady: \d+ images in [\d.]+ s, [\d.]+ s before left out\)", rows["dp1 synthetic"]["result"]
    )
    assert float(rows["dp1 synthetic"]["rate"]) > 0
    assert rows["dp1 synthetic"]["target"] == "-"
    assert re.search(r"PASS \(12 images, acc@1 ([\d.]+) / \1\)", rows["validation 1 vs N processes"]["result"])
    assert rows["ddp jpeg"]["mfu"] == "-" and "0 CUDA kernels" in rows["profile trace"]["result"]
    assert "9 passed, 0 failed" in result.stdout


def test_its_fsdp_checks_pass_on_the_cpu(cpu_runs):
    """The FSDP rows of the harness on the CPU: the bf16 policy trains and its model_best.pth loads into a plain
    model; FSDP's losses per epoch are DDP's (here within 1e-5)."""
    result = cpu_runs[1][2]
    rows = table(assert_ok(result))
    assert set(rows) == {"fsdp jpeg bf16", "fsdp losses = ddp losses"}, result.stdout[-3000:]
    assert all(row["result"].startswith("PASS") for row in rows.values()), result.stdout[-3000:]
    assert re.fullmatch(
        r"PASS \(losses (\d\.\d{5})/\1(, (\d\.\d{5})/\3){3}\)", rows["fsdp losses = ddp losses"]["result"]
    )


def test_it_fails_when_training_does_not_learn(cpu_runs):
    """And --out keeps the table and the failed row's output (a GPU machine's $OUT, which comes back)."""
    out, (_, result, _) = cpu_runs
    assert result.returncode == 1, result.stdout[-3000:]
    assert table(result.stdout)["dp1 jpeg"]["result"].startswith("FAIL: training loss did not fall")
    assert "0 passed, 1 failed" in result.stdout
    assert table((out / "table.md").read_text())["dp1 jpeg"]["result"].startswith("FAIL: training loss did not fall")
    assert "training loss did not fall" in (out / "dp1_jpeg.log").read_text()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check runs the full set)")
def test_gpu_check_passes_on_this_gpu_machine():
    """Every launch mode and GPU flag on the JPEG data (`make gpu-check` adds synthetic ResNet-50)."""
    result = run([PYTHON, CHECK, "--quick"], env=clean_env(gpu=True), timeout=3600)
    rows = table(assert_ok(result))
    assert rows and all(row["result"].startswith("PASS") for row in rows.values()), result.stdout[-4000:]

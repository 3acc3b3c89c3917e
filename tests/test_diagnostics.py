"""What limits a run, in its own output (common/diagnostics.py), from real runs: a 2-process run whose dataset reads
slowly says it is input-bound (above half its time waiting, once, with the levers) and writes the --profile trace of
each rank while it goes on; a run on data in memory says neither; a run that runs out of memory ends in one line.
(A DP, a DDP and a spawn run report the columns: tests/test_distributed.py.)"""

import json
import re

import pytest

from common.diagnostics import INPUT_BOUND
from common.logger import DIAGNOSTICS
from conftest import TINY, log_rows
from harness.ahead import ahead
from harness.jobs import assert_ok, no_traceback_of_ours, run_together, script_command, torchrun_command
from tests.unit.test_logger import scalars

pytestmark = pytest.mark.e2e
WAIT = re.compile(r"^Epoch: \[0\] \[ *\d+/\d+\] .* img/s \(input wait (\d+)%(?:, slowest rank (\d+)%)?\)", re.M)


def diagnosed_runs(tmp_path_factory):
    """Together: train_ddp.py on 2 processes over tests.custom_datasets:slow_items (40 ms an image, batch 16 of
    TinyNet) with --profile 1:2; train_dp.py over in_memory (resnet18 at 64 px, -j 0); train_dp.py whose second step
    runs out of memory. (output dir, name -> CompletedProcess)."""
    out = tmp_path_factory.mktemp("diagnostics")
    tiny = [*TINY, "-a", "tests.tiny_models:TinyNet", "-b", "16", "--epochs", "1", "--seed", "0"]
    commands = {
        "slow": torchrun_command(
            "train_ddp.py",
            2,
            *tiny,
            "--dataset",
            "tests.custom_datasets:slow_items",
            "--profile",
            "1:2",
            "--output-dir",
            out / "slow",
        ),
        "fast": script_command(
            "train_dp.py",
            *TINY,
            "--train-crop-size",
            "64",
            "-a",
            "resnet18",
            "-b",
            "16",
            "--epochs",
            "1",
            "--dataset",
            "tests.custom_datasets:in_memory",
            "--output-dir",
            out / "fast",
        ),
        "oom": script_command(
            "train_dp.py",
            *tiny,
            "--dataset",
            "tests.custom_datasets:in_memory",
            "--trainer",
            "tests.tiny_models:OutOfMemoryAtStep2",
            "--output-dir",
            out / "oom",
        ),
    }
    return out, dict(zip(commands, run_together(list(commands.values()))))


diagnosed = ahead(diagnosed_runs, "diagnosed")


def test_a_run_that_waits_for_its_data_says_so_once_with_the_levers(diagnosed):
    out, results = diagnosed
    output = assert_ok(results["slow"])
    waits = WAIT.findall(output)
    assert len(waits) == 6 and all(slowest for _, slowest in waits)  # 96 images, global batch 16: 6 steps
    assert int(waits[-1][0]) > 50 and int(waits[-1][1]) >= int(waits[-1][0])
    row = log_rows(out / "slow")[-1]
    assert float(row["input_wait_pct"]) > 50 and float(row["input_wait_pct_max"]) >= float(row["input_wait_pct"])
    hints = [line for line in output.splitlines() if line.startswith("input-bound:")]
    assert len(hints) == 1 and "epoch 0" in hints[0] and "-j" in hints[0] and "make_shards" in hints[0]
    tags = scalars(out / "slow")
    assert {"step/input_wait_pct", *(name for name in DIAGNOSTICS if row[name])} <= tags.keys()
    assert [value for _, value in tags["input_wait_pct"]] == [pytest.approx(float(row["input_wait_pct"]))]


def test_the_profile_of_each_rank_holds_the_asked_steps_and_the_run_goes_on(diagnosed):
    out, results = diagnosed
    output = assert_ok(results["slow"])
    assert output.count("profile: ") == 2 and "training goes on" in output  # the header's line, and the written one
    for rank in (0, 1):
        events = json.loads((out / "slow" / "profile" / f"rank{rank}.json").read_text())["traceEvents"]
        steps = {event["name"] for event in events if event.get("name", "").startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#1", "ProfilerStep#2"}
        assert {"aten::convolution_backward", "gloo:all_reduce"} <= {event.get("name") for event in events}
    assert "done: best acc@1" in output


def test_a_run_on_data_in_memory_is_not_said_to_wait(diagnosed):
    out, results = diagnosed
    output = assert_ok(results["fast"])
    waits = WAIT.findall(output)
    assert len(waits) == 3 and not any(slowest for _, slowest in waits)  # one process: no slowest rank
    assert float(log_rows(out / "fast")[-1]["input_wait_pct"]) < 100 * INPUT_BOUND and "input-bound" not in output
    assert float(log_rows(out / "fast")[-1]["tflops_per_device"]) > 0


def test_running_out_of_memory_ends_the_run_in_one_line_naming_the_levers(diagnosed):
    result = diagnosed[1]["oom"]
    assert result.returncode == 1 and no_traceback_of_ours(result.stdout)
    (line,) = [line for line in result.stdout.splitlines() if "ran out of" in line]
    assert "rank 0 ran out of cpu memory (CUDA out of memory. Tried to allocate 20.00 GiB" in line
    assert "--amp bf16" in line and "train_fsdp.py" in line

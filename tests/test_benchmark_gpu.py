"""tools/benchmark_gpu.py (`make benchmark-gpu`): the steady window read from the scripts' own progress lines, the
trace's summary, and the harness run on the CPU (a tiny model) as it runs on a GPU."""

import json
import os
import re
import signal
import sys
import time

import pytest

from common.metrics import ProgressMeter
from harness.jobs import Job, assert_ok, run
from harness.processes import PYTHON, REPO, clean_env

sys.path.insert(0, str(REPO / "tools"))
from benchmark_gpu import (
    command,
    cpu_rows,
    gpu_rows,
    measure,
    met,
    progress_points,
    row_limit,
    selected,
    steady,
    steady_start,
    trace_summary,
    unsteady,
    window_figures,
)
from jobs import CheckFailed

pytestmark = pytest.mark.e2e

BENCH = REPO / "tools" / "benchmark_gpu.py"


def progress_output(seconds_per_interval, batch=256, every=10, waits=None):
    """What a run prints: the scripts' own progress lines (ProgressMeter) of one epoch, a line every `every` steps,
    the k-th after seconds_per_interval[:k+1] have passed, each with the images/s since the epoch's start and (waits:
    the input wait and GPU idle % since then)."""
    lines, elapsed = ["a library's warning", "Epoch: [1] [ 10/60]  ... 1.0 img/s"], 0.0  # (another epoch: ignored)
    steps = every * len(seconds_per_interval)
    meter = ProgressMeter(steps, "Epoch: [0]", lines.append)
    for k, seconds in enumerate(seconds_per_interval):
        elapsed += seconds
        done = every * (k + 1)
        wait = f"input wait {waits[k][0]}%; GPU idle {waits[k][1]}%" if waits else "input wait 0%; GPU idle 0%"
        meter.display(
            done - 1,
            {"loss": 1.0, "acc1": 0.0, "acc5": 0.0},
            lr=0.1,
            speed=(done * batch / elapsed, "0:00:01"),
            wait=wait,
        )
    return "\n".join(lines)


def test_the_steady_window_leaves_out_the_start_and_the_slow_steps_after_it():
    """Start-up (the first line) and cuDNN's autotuning or compiling (a slow interval) are left out: the rate is that
    of the steps after them, read from the cumulative rates the progress lines print (to 0.1 img/s)."""
    output = progress_output([9.0, 3.0, 0.64, 0.65, 0.64, 0.66, 0.65])
    points = progress_points(output, 256)
    assert [point.images for point in points] == [2560 * k for k in range(1, 8)]
    first = steady_start(points)
    assert first == 1  # the line after the slow interval (the first line's 9 s are no interval: the start)
    figures = window_figures(points, first)
    assert figures["images_per_second"] == pytest.approx(5 * 2560 / 3.24, rel=5e-4)  # (lines print 0.1 img/s)
    assert figures["excluded_seconds"] == pytest.approx(12.0, rel=1e-4)
    assert figures["measured_images"] == 5 * 2560 and figures["spread"] == pytest.approx(0.66 / 0.64, rel=1e-3)
    assert steady(output, 256)["images_per_second"] == figures["images_per_second"]


def test_a_run_that_never_settles_has_no_steady_window_and_is_measured_over_its_later_half_marked_so():
    """The H100's JPEG run with 8 loader workers: the rate fell with every interval as the prefetched batches ran out
    (3926, 3059, 2655, 2447, 2407, 1903 images/s): no steady figure is given for it, rather than one of a moment; its
    later half's rate, input wait and GPU idle are, marked not steady (the table gives no verdict)."""
    intervals = [2560 / rate for rate in (3926, 3059, 2655, 2447, 2407, 1903)]
    output = progress_output([2.0, *intervals], waits=[(k, 2 * k) for k in range(7)])
    assert steady(output, 256) is None
    points = progress_points(output, 256)
    figures = unsteady(points)
    assert figures["steady"] is False and figures["rates"] == "3926, 3059, 2655, 2447, 2407, 1903"
    assert figures["images_per_second"] == pytest.approx(3 * 2560 / sum(intervals[3:]), rel=1e-3)
    assert figures["input_wait_pct"] is not None and figures["gpu_idle_pct"] is not None
    assert steady_start(progress_points(progress_output([2.0, 1.0, 1.0]), 256)) is None  # too few intervals
    with pytest.raises(CheckFailed, match="no steady window: 2 progress lines"):
        unsteady(points[:2])


def test_input_wait_and_gpu_idle_are_the_windows_share():
    """The lines' percentages are of the time since the epoch's start: the window's share is what was added in it."""
    # Waited 5 s of the first 10, then 0.2 s a second; idle 9 s, then 0.1 s a second: 20% and 10% in the window.
    seconds = [10, 11, 12, 13, 14]
    waits = [(round(100 * (5 + 0.2 * (t - 10)) / t), round(100 * (9 + 0.1 * (t - 10)) / t)) for t in seconds]
    output = progress_output([10.0, 1.0, 1.0, 1.0, 1.0], waits=waits)
    figures = window_figures(progress_points(output, 256), 1)
    bound = 0.5 * (14 + 11) / 3  # the lines print whole percents
    assert figures["share_error_pct"] == pytest.approx(bound, rel=1e-3)  # said beside the figures in the table
    assert figures["input_wait_pct"] == pytest.approx(20, abs=bound) and figures["input_wait_pct"] != 41
    assert figures["gpu_idle_pct"] == pytest.approx(10, abs=bound) and figures["gpu_idle_pct"] != 67


def test_the_trace_summary_counts_steps_busy_time_waits_and_kernel_kinds(tmp_path):
    """The CPU's steps (not the GPU's copies of their ranges), the GPU's busy time as the union of its overlapping
    kernels, its idle share over their span, the host's waits and device-to-host copies, and kernels by kind."""

    def event(name, cat, ts, dur):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}

    events = [
        event("ProfilerStep#3", "user_annotation", 0, 100),
        event("ProfilerStep#4", "user_annotation", 100, 60),
        event("ProfilerStep#3", "gpu_user_annotation", 5, 100),
        event("ProfilerStep#4", "gpu_user_annotation", 105, 90),
        event("sm90_xmma_fprop_implicit_gemm_bf16", "kernel", 10, 40),
        event("void at::native::batch_norm_collect_statistics_channels_last_kernel", "kernel", 30, 40),  # overlaps
        event("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "kernel", 100, 20),  # attention, not cuDNN conv
        event("void at::native::max_pool_backward_nhwc<c10::BFloat16>", "kernel", 120, 4),  # not a convolution
        event("triton_poi_fused_add_relu_3", "kernel", 124, 2),  # compiled, not the optimizer
        event("void at::native::multi_tensor_apply_kernel<FusedSgdMathFunctor>", "kernel", 126, 4),
        event("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 150, 10),
        event("cudaStreamSynchronize", "cuda_runtime", 140, 25),
        event("aten::_local_scalar_dense", "cpu_op", 139, 27),
        {**event("cudaStreamSynchronize", "cuda_runtime", 20, 5), "tid": 2},  # the decode thread's own wait
    ]
    for item in events[:2] + events[-3:-1]:
        item["tid"] = 1  # the training loop's thread
    path = tmp_path / "rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    summary = trace_summary(path)
    assert summary["steps"] == 2 and summary["cpu_ms_per_step"] == pytest.approx(0.080)
    assert summary["gpu_busy_ms_per_step"] == pytest.approx((60 + 30 + 10) / 2 / 1000)  # 10-70, 100-130, 150-160
    assert summary["gpu_idle_pct"] == pytest.approx(100 * (1 - 100 / 150))
    assert summary["syncs_per_step"]["cudaStreamSynchronize"] == 1.0
    assert summary["syncs_per_step_other_threads"] == 0.5
    assert summary["syncs_per_step"]["aten::_local_scalar_dense"] == 0.5
    assert summary["device_to_host_copies_per_step"] == 0.5 and summary["kernels_per_step"] == 3
    assert summary["gpu_ms_by_family_per_step"] == {
        "convolution (cuDNN)": 0.02,
        "batch norm": 0.02,
        "attention": 0.01,
        "memory copy": 0.005,
        "pooling": 0.002,
        "optimizer": 0.002,
        "compiled (Triton)": 0.001,
    }


def test_rows_on_request_run_only_where_only_names_them():
    rows = gpu_rows("jpegs")
    by_default = {bench.name for bench in selected(rows, None)}
    assert "vit_b_16 bf16 --compile" in by_default and "vit_b_16 bf16, bare PyTorch loop" not in by_default
    assert {bench.name for bench in selected(rows, "^vit_b_16 bf16($|, bare)")} == {
        "vit_b_16 bf16",
        "vit_b_16 bf16, bare PyTorch loop",
    }


def test_a_share_of_a_row_that_never_settled_gets_no_verdict():
    rows = gpu_rows("jpegs")
    base, jpegs = rows[0], next(bench for bench in rows if bench.versus == rows[0].name and bench.share)
    figures = {"images_per_second": 2000.0}
    base.result = {"images_per_second": 4000.0}
    assert met(jpegs, figures, rows) is False and figures["versus"] == 0.5
    base.result, figures = {"images_per_second": 4000.0, "steady": False}, {"images_per_second": 2000.0}
    assert met(jpegs, figures, rows) is None and "versus" not in figures


def test_a_row_cut_at_its_limit_keeps_what_it_printed(tmp_path):
    tiny = cpu_rows("jpegs")[0]
    with pytest.raises(CheckFailed, match=r"no end after 0\.3 s"):
        measure(tiny, REPO, tmp_path, True, 0.3)
    assert (tmp_path / "tiny" / "console.log").is_file()


def test_a_row_s_limit_is_what_is_left_before_the_deadline_where_less():
    import time

    assert row_limit(False, None, time.monotonic()) == 420 and row_limit(True, None, time.monotonic()) == 300
    assert row_limit(False, 600, time.monotonic() - 500) == 100
    assert row_limit(False, 600, time.monotonic() - 570) < 60  # (too near: not started)


def test_every_gpu_row_s_command_parses_with_its_script_s_parser(monkeypatch):
    """A lent GPU's minutes are not spent on a flag renamed since: each row's train_dp.py or train_ddp.py arguments
    are taken by that script's own parser here (a bare loop's row runs no script)."""
    import train_ddp
    import train_dp

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "EPOCHS", "LR", "BATCH_SIZE"):
        monkeypatch.delenv(key, raising=False)
    parsed = []
    for bench in gpu_rows("/data/jpegs"):
        if bench.mode != "bare":
            line = [str(arg) for arg in command(bench, REPO, cpu=False)]
            script = next(arg for arg in line if arg.endswith(".py"))
            args = {"train_dp.py": train_dp, "train_ddp.py": train_ddp}[os.path.basename(script)].parse_args(
                line[line.index(script) + 1 :]
            )
            assert args.batch_size == bench.batch and args.compile == ("--compile" in bench.args), bench.name
            parsed.append(bench.name)
    assert "resnet50 bf16 channels_last --compile, JPEGs, --decode gpu" in parsed and len(parsed) >= 15


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    result = run([PYTHON, BENCH], env=clean_env(), timeout=120)
    assert result.returncode == 0
    assert result.stdout == (
        "benchmark-gpu: no CUDA GPU is visible on this machine: nothing to measure (--cpu tests the harness)\n"
    )


def test_the_harness_measures_real_runs_of_the_scripts_on_the_cpu(tmp_path):
    """--cpu: the same harness on a tiny model, each row a real run of train_dp.py (one with a --profile trace); the
    table, the rows' figures and the runs' outputs written to --out. (Its other rows run the same code with another
    command: train_ddp.py under torchrun, a bare loop.)"""
    result = run(
        [PYTHON, BENCH, "--cpu", "--only", "^tiny$|profile"], env={**clean_env(), "OUT": str(tmp_path)}, timeout=600
    )
    tmp_path = tmp_path / "benchmark-gpu"  # (--out's default where OUT is set: a GPU machine's folder that comes back)
    output = assert_ok(result)
    rows = {match[1]: match[2] for match in re.finditer(r"^\| (tiny[^|]*?) \| ([^|]+?) \|", output, re.MULTILINE)}
    assert set(rows) == {"tiny"} and float(rows["tiny"]) > 0, output[-3000:]
    assert re.search(r"^tiny, profile \(--profile 3:2\): 2 steps, CPU [\d.]+ ms per step", output, re.MULTILINE)
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert [row["name"] for row in saved["rows"]] == ["tiny", "tiny, profile"]
    first = saved["rows"][0]["result"]
    assert first["measured_images"] > 0 and first["excluded_seconds"] > 0 and first["met"] is True
    assert (tmp_path / "table.md").read_text().strip() in output
    kept = {path.relative_to(tmp_path / "runs").as_posix() for path in (tmp_path / "runs").rglob("*.*")}
    assert kept >= {"tiny/console.log", "tiny/log.csv", "tiny/summary.json", "tiny_profile/rank0.json.gz"}, kept


@pytest.mark.parametrize("tool", ["benchmark_gpu", "gpu_check"])
def test_the_gpu_tools_bad_input_is_argparse_s_one_line_with_nothing_left_behind(tool, tmp_path, monkeypatch, capsys):
    """(was: re.error, ValueError and NotADirectoryError tracebacks, each leaving its /tmp folder; an --only that
    matched no row an empty table and exit code 0, a check of nothing passed)"""
    import importlib
    import tempfile

    main = importlib.import_module(tool).main
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "a_file").write_text("")
    bad = {
        "--only (": "argument --only: '(' is no regular expression (missing ), unterminated subpattern at position 0)",
        "--only zzz": "--only 'zzz' matches no row; the rows: ",
        f"--out {tmp_path}/a_file/out": f"--out {tmp_path}/a_file/out: Not a directory",
    }
    if tool == "benchmark_gpu":
        bad |= {
            f"--deadline {value}": f"argument --deadline: '{value}': expected a number of seconds above 0"
            for value in ("nan", "inf", "-5", "0")
        }
        bad[f"--repo {tmp_path}"] = (
            f"--repo {tmp_path}: no train_dp.py there"  # (was: every row failed, after the JPEGs)
        )
    for argv, said in bad.items():
        with pytest.raises(SystemExit) as ended:
            main(["--cpu", *argv.split()])
        error = capsys.readouterr().err.splitlines()[-1]
        assert ended.value.code == 2 and error.partition(": error: ")[2].startswith(said), (argv, error)
        assert [path.name for path in tmp_path.iterdir()] == ["a_file"], argv  # (no runs' folder left)


@pytest.mark.parametrize("command", [[BENCH], [REPO / "tools" / "benchmark.py", "--gpu"]])
def test_a_gpu_tool_stopped_mid_row_removes_its_folder_and_its_job(tmp_path, command):
    """SIGTERM (a lent machine's `timeout`) while a row's run trains: exit code 143, one line, the runs' folder in
    TMPDIR removed and the row's job killed (were: both left, the job still writing in /tmp; benchmark.py --gpu, which
    ran it as a child, killed it before its clean-up)."""
    (tmp_path / "tmp").mkdir()
    job = Job(
        [PYTHON, *command, "--cpu", "--only", "^tiny$", "--out", tmp_path / "out"],
        env=clean_env(TMPDIR=tmp_path / "tmp"),
        prewarmed=False,
    )
    job.wait_for(re.compile(r"^benchmark-gpu: 1 rows, runs in "), timeout=120)
    time.sleep(3)  # (its run under way)
    os.kill(job.process.pid, signal.SIGTERM)
    code, output = job.finish(timeout=120)
    assert code == 143 and output.splitlines()[-1] == "stopped: benchmark_gpu.py ended by SIGTERM"
    assert list((tmp_path / "tmp").glob("benchmark-gpu-*")) == [] and not job.left_behind, job.left_behind

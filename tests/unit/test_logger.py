"""common/logger.py: log.csv (one row per epoch, named values and the EMA's as columns of their own, kept across a
resume), TensorBoard's per-step scalars equal to the progress lines and shown once each after a resume, bad_images.txt
and summary.json; only the writer rank writes."""

import csv
import datetime
import json
import math
import re
import resource
import signal
import time
from pathlib import Path

import pytest

from common.errors import NoRoom, UsageError
from common.logger import CSV_FIELDS, DIAGNOSTICS, EMA_FIELDS, STEP_TAGS, RunLogger, epoch_row, strict_json
from common.run import start_run
from common.trainer import Trainer
from conftest import cpu_runtime, parse
from unit.test_checkpoint import Crash, StopsAt

SMALL = [
    "--train-crop-size",
    "16",
    "--val-resize-size",
    "16",
    "--val-crop-size",
    "16",
    "-j",
    "0",
    "-p",
    "2",
    "-b",
    "2",
    "--seed",
    "1",
    "--lr",
    "0.05",
    "--dataset",
    "tests.custom_datasets:uint8_tensors",
    "-a",
    "tests.tiny_models:TinyNet",
    "--epochs",
    "2",
    "--checkpoint-interval",
    "4",
    "--model-ema",
]
PROGRESS = re.compile(
    r"^Epoch: \[(\d+)\] \[(\d+)/(\d+)\]  loss (\S+)  acc@1\s+(\S+)  acc@5\s+\S+  lr (\S+)\s+(\S+) img/s "
    r"\(input wait (\d+)%\)",
    re.MULTILINE,
)

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables


def test_an_output_directory_on_a_full_disk_is_the_write_s_error_and_a_read_only_one_bad_input(tmp_path):
    """The first write of a run (args.json) on a full disk was "choose a directory you can write to", exit code 2: now
    "make room", exit code 1 (NoRoom). A real failed write: a file size limit (EFBIG, as a quota)."""
    config = parse(*SMALL)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    before = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (else the kernel ends this process)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16, limits[1]))
    try:
        with pytest.raises(NoRoom, match=r"^cannot write to --output-dir \S+full \(File too large\): make room, then"):
            RunLogger(tmp_path / "full", prints=False, writes=True).start(config, resumed=True)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, before)
    assert NoRoom.exit_code == 1
    (tmp_path / "file").write_text("")
    with pytest.raises(
        UsageError, match=r"cannot write to --output-dir \S+ \(Not a directory\): choose a directory you can write to"
    ):
        RunLogger(tmp_path / "file" / "out", prints=False, writes=True).start(config, resumed=True)


def test_log_csv_gains_the_ema_columns_on_a_resumed_run_and_keeps_them(tmp_path):
    (tmp_path / "log.csv").write_text(",".join(CSV_FIELDS) + "\n" + ",".join(["0"] * len(CSV_FIELDS)) + "\n")
    config = parse("--dummy")
    log = RunLogger(tmp_path, prints=False, writes=True)
    log.start(config, resumed=True, ema=True, global_step=10)
    log.log_epoch({**{field: 1 for field in CSV_FIELDS}, **{field: 2 for field in EMA_FIELDS}})
    log.finish({})
    log = RunLogger(tmp_path, prints=False, writes=True)
    log.start(config, resumed=True, ema=False, global_step=20)  # resumed without it: the columns stay, empty
    log.log_epoch({**{field: 3 for field in CSV_FIELDS}, "train_margin": 4})  # a named value: a column of its own
    log.finish({})
    with open(tmp_path / "log.csv", newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == CSV_FIELDS + EMA_FIELDS + ["train_margin"]
    assert rows[1:] == [
        ["0"] * len(CSV_FIELDS) + [""] * 4,
        ["1"] * len(CSV_FIELDS) + ["2"] * 3 + [""],
        ["3"] * len(CSV_FIELDS) + [""] * 3 + ["4"],
    ]


def test_an_epoch_s_row_holds_the_run_s_columns_then_the_ema_s_then_the_named_values():
    train = {
        "loss": 1.0,
        "acc1": 50.0,
        "images_per_second": 12.34,
        "margin": 0.5,
        "diagnostics": {name: float(index) for index, name in enumerate(DIAGNOSTICS)},
    }
    val = {"loss": 0.9, "acc1": 60.0, "acc5": 100.0, "count": 6, "margin": 0.6}
    row = epoch_row(3, 0.0, [0.1, 0.1], train, val, {**val, "acc1": 70.0}, [["a.jpg", "x"]])
    assert list(row) == [*CSV_FIELDS, *EMA_FIELDS, "ema_val_margin", "train_margin", "val_margin"]
    assert (row["epoch"], row["lr"], row["images_per_second"], row["bad_images"], row["ema_val_acc1"]) == (
        3,
        0.1,
        12.3,
        1,
        70.0,
    )
    assert [row[name] for name in DIAGNOSTICS] == list(range(len(DIAGNOSTICS)))
    # With its zone's offset, as run.lock's times: a run resumed on a node of another zone (was: epoch 1 began 8 h
    # before epoch 0, without a word)
    assert datetime.datetime.strptime(row["start_time"], "%Y-%m-%dT%H:%M:%S%z").timestamp() == 0.0
    assert "ema_val_loss" not in epoch_row(3, 0.0, [0.1], train, val, None, [])
    by_group = epoch_row(3, 0.0, [0.1, 0.01, 0.1], train, val, None, [])  # lr_groupN: each group's, where they differ
    assert (by_group["lr"], by_group["lr_group1"], by_group["lr_group2"]) == (0.1, 0.01, 0.1)


def test_a_fresh_run_leaves_nothing_of_an_earlier_one_in_its_directory_and_a_resumed_one_keeps_it(tmp_path):
    """--overwrite kept the earlier run's --profile traces (profile/rankN.json), out-of-memory snapshots and NCCL's
    dumps: they read as this run's."""
    earlier = ["checkpoint.pth", "summary.json", "bad_images.txt", "metrics/val_epoch3.json", "profile/rank0.json"]
    earlier += ["memory/oom-rank0.pickle", "nccl_trace/rank_0", "tensorboard/events.out.tfevents.1.host"]
    # A researcher's own files in the folders of a run's (was: the folders deleted whole by every fresh start)
    theirs = ["metrics/results.csv", "metrics/results_epoch3.json", "memory/notes.txt", "profile/mine.json"]
    for resumed in (True, False):
        for name in earlier + theirs:
            (tmp_path / "out" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "out" / name).write_text("the earlier run's")
        (tmp_path / "out" / "nccl_trace" / "rank_notes").mkdir(exist_ok=True)  # (a folder: was an IsADirectoryError)
        RunLogger(tmp_path / "out", prints=False, writes=True).start(parse("--dummy"), resumed=resumed)
        kept = [name for name in earlier + theirs if (tmp_path / "out" / name).exists()]
        assert kept == ([name for name in earlier + theirs if name != "summary.json"] if resumed else theirs), resumed
    assert not (tmp_path / "out" / "profile" / "rank0.json").exists() and (tmp_path / "out" / "nccl_trace").is_dir()
    (tmp_path / "out" / "nccl_trace" / "rank_notes").rmdir()
    (tmp_path / "out" / "nccl_trace" / "rank_0").write_text("the earlier run's")
    RunLogger(tmp_path / "out", prints=False, writes=True).start(parse("--dummy"), resumed=False)
    assert not (tmp_path / "out" / "nccl_trace").exists()  # a folder of the run's files alone goes with them


def test_a_rank_that_does_not_write_writes_nothing(tmp_path):
    log = RunLogger(tmp_path / "out", prints=False, writes=False)
    log.start(parse("--dummy"), resumed=False)
    log.log_epoch({"epoch": 0})
    log.write_bad_images([["a.jpg", "x"]])
    log.finish({})
    assert not (tmp_path / "out").exists()


def test_bad_images_txt_is_a_line_per_file_whatever_its_name_holds(tmp_path):
    log = RunLogger(tmp_path / "out", prints=False, writes=True)
    log.start(parse("--dummy"), resumed=False)
    names = ["/d/a\nb.jpg", "/d/tab\there.jpg", "/d/back\\slash\r.jpg", "/d/caf\udce9.jpg", "/d/\x0b\u2028.jpg"]
    log.write_bad_images([[name, "cannot identify image file"] for name in names])
    lines = (tmp_path / "out" / "bad_images.txt").read_bytes().split(b"\n")
    assert lines == [
        b"/d/a\\nb.jpg\tcannot identify image file",
        b"/d/tab\\there.jpg\tcannot identify image file",
        b"/d/back\\\\slash\\r.jpg\tcannot identify image file",
        b"/d/caf\xe9.jpg\tcannot identify image file",  # (a name's bytes that are no UTF-8: as they are)
        b"/d/\\x0b\\u2028.jpg\tcannot identify image file",
        b"",
    ]


def scalars(output_dir):
    """{tag: [(step, value)]} of the run's event files (per epoch in tensorboard/, per step in tensorboard/steps/), read
    by TensorBoard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = {}
    for run in ("tensorboard", "tensorboard/steps"):
        accumulator = EventAccumulator(str(Path(output_dir) / run), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            assert tag not in found and tag.startswith("step/") == run.endswith("steps"), (run, tag)
            found[tag] = [(event.step, event.value) for event in accumulator.Scalars(tag)]
    return found


def printed_steps(output):
    """{global step: (loss, acc1, lr, img/s, input wait %)} of the progress lines."""
    return {
        int(epoch) * int(total) + int(done): tuple(map(float, values))
        for epoch, done, total, *values in PROGRESS.findall(output)
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """6 steps an epoch, -p 2: an uninterrupted run; one that crashes before its 12th step (after the checkpoint of
    step 8, and the progress line of step 10) and is resumed; their output."""
    root, printed = tmp_path_factory.mktemp("tensorboard"), {}
    import contextlib
    import io

    for name, trainer in (("whole", Trainer), ("crashed", StopsAt)):
        StopsAt.stop_at = 11
        output = io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.suppress(Crash):
            started = start_run(trainer(parse(*SMALL, "--output-dir", root / name), cpu_runtime()))
            started.fit(started.model, started.model)
        printed[name] = output.getvalue()
    output = io.StringIO()
    # TensorBoard reads a run's event files in the order of their names: a whole second, then this process's count of
    # writers (which sorts "10" before "9"). A relaunch is a second later, at least: so is this one.
    time.sleep(1.01 - time.time() % 1)
    with contextlib.redirect_stdout(output):
        resumed = start_run(Trainer(parse(*SMALL, "--output-dir", root / "crashed", "--resume", "auto"), cpu_runtime()))
        resumed.fit(resumed.model, resumed.model)
    printed["resumed"] = output.getvalue()
    return root, printed


def test_the_progress_line_s_lr_is_the_one_its_step_trained_with(tmp_path):
    """It was the next step's: an epoch's last line gave the next epoch's lr (0.005 for steps that trained at 0.05),
    and a run's last line an lr it never used. log.csv's lr (the epoch's) is the measure."""
    import contextlib
    import io

    argv = (*SMALL, "--lr-schedule", "step", "--lr-step-size", "1", "--warmup-epochs", "0", "--output-dir", tmp_path)
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        run = start_run(Trainer(parse(*argv), cpu_runtime()))
        run.fit(run.model, run.model)
    printed = {step: values[2] for step, values in printed_steps(output.getvalue()).items()}
    epochs = [float(row["lr"]) for row in csv.DictReader(open(tmp_path / "log.csv"))]
    assert epochs == pytest.approx([0.05, 0.005]) and len(printed) == 6
    assert all(lr == pytest.approx(epochs[(step - 1) // 6], rel=1e-3) for step, lr in printed.items()), printed
    assert scalars(tmp_path)["step/lr"][-1][1] == pytest.approx(0.005)


def test_per_step_tensorboard_scalars_are_the_progress_lines_values_every_p_steps(runs):
    root, printed = runs
    logged, steps = scalars(root / "whole"), printed_steps(printed["whole"])
    assert sorted(steps) == [2, 4, 6, 8, 10, 12]
    # Half a unit of the last digit printed (and a little: 46.875 prints as 46.88).
    tolerances = {
        "loss": dict(abs=5.1e-5),
        "acc1": dict(abs=5.1e-3),
        "lr": dict(rel=5.1e-4),
        "images_per_second": dict(abs=0.051),
        "input_wait_pct": dict(abs=0.51),
    }
    for index, (key, tag) in enumerate(STEP_TAGS.items()):
        assert [step for step, _ in logged[tag]] == sorted(steps), tag
        for step, value in logged[tag]:
            assert value == pytest.approx(steps[step][index], **tolerances[key]), (tag, step)
    # The per-epoch scalars stay, the EMA's beside them.
    for tag in ("train_loss", "val_acc1", "val_acc5", "lr", "ema_val_acc1", "ema_val_loss"):
        assert [step for step, _ in logged[tag]] == [0, 1], tag


def test_a_resumed_run_shows_each_step_once_in_tensorboard(runs):
    """The crashed run had logged step 10 (epoch 1 step 4) after its checkpoint at step 8; the resumed run logs it
    again, and TensorBoard hides the first (purge_step): one value per step, the uninterrupted run's."""
    root, printed = runs
    assert "Epoch: [1] [4/6]" in printed["crashed"] and "(epoch 1, step 2)" in printed["resumed"]
    resumed, uninterrupted = scalars(root / "crashed"), scalars(root / "whole")
    for tag in ("step/train_loss", "step/train_acc1", "step/lr"):
        assert [step for step, _ in resumed[tag]] == [2, 4, 6, 8, 10, 12], tag
        assert [value for _, value in resumed[tag]] == pytest.approx(
            [value for _, value in uninterrupted[tag]], rel=1e-6
        ), tag
    assert [step for step, _ in resumed["val_acc1"]] == [0, 1]


def test_a_resumed_log_drops_the_rows_of_epochs_its_checkpoint_does_not_hold(tmp_path):
    """An --async-checkpoint write cut short by a kill: the log had the epoch's row, the checkpoint resumed from is
    older; the resumed run trains that epoch again and logs it once."""
    config = parse("--dummy", "--output-dir", tmp_path)
    log = RunLogger(tmp_path, prints=False, writes=True)
    log.start(config, resumed=False)
    for epoch in range(3):
        log.log_epoch({"epoch": epoch, "train_loss": epoch})
    log.finish({})
    log = RunLogger(tmp_path, prints=False, writes=True)
    log.start(config, resumed=True, global_step=5, epochs_done=2)
    log.finish({})
    rows = (tmp_path / "log.csv").read_text().splitlines()[1:]
    assert [row.split(",")[0] for row in rows] == ["0", "1"]


class StopsInEpochZeroSLastStep(Trainer):
    """A stop signal during epoch 0's last step (the flag its handler sets): the checkpoint after that step, before
    validation, which the resumed run does."""

    def train_step(self, model, images, labels):
        self.steps_seen = getattr(self, "steps_seen", 0) + 1
        if self.steps_seen == self.steps_per_epoch:
            self._stop_signal.received, self._stop_signal.received_at = "SIGTERM", time.monotonic()
        return super().train_step(model, images, labels)


def test_resumes_at_an_epoch_s_end_with_another_batch_and_from_an_earlier_checkpoint_keep_each_scalar_once(tmp_path):
    """Three launches in one directory: stopped after epoch 0's last step (-b 2: 6 steps an epoch); resumed with -b 4
    (allowed at an epoch's end; 3 steps an epoch); resumed again from checkpoint_prev.pth, mid-epoch 1. Were: the
    global step computed from the new batch (epoch 1 plotted at steps 5-6 over epoch 0's, steps 4 and 6 hidden), each
    per-epoch scalar of epoch 1 twice (the purge, at a step, never reached the epochs), and epoch 0's row with 0 img/s
    and the input wait of a loop that trained nothing."""
    import contextlib
    import io

    import torch

    from common.errors import Preempted

    argv = [*SMALL, "--output-dir", tmp_path]
    stopped = start_run(StopsInEpochZeroSLastStep(parse(*argv), cpu_runtime()))
    try:
        with pytest.raises(Preempted), contextlib.redirect_stdout(io.StringIO()):
            stopped.fit(stopped.model, stopped.model)
    finally:
        stopped._stop_signal.close()
    assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["step_in_epoch"] == 6
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        resumed = start_run(Trainer(parse(*argv, "-b", "4", "--resume", "auto"), cpu_runtime()))
        resumed.fit(resumed.model, resumed.model)
    assert "input-bound" not in output.getvalue()
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert [row["epoch"] for row in rows] == ["0", "1"] and float(rows[1]["images_per_second"]) > 0
    assert rows[0]["images_per_second"] == "" and all(rows[0][name] == "" for name in DIAGNOSTICS), rows[0]
    previous = torch.load(tmp_path / "checkpoint_prev.pth", weights_only=True)
    assert (previous["epoch"], previous["step_in_epoch"], previous["global_step"]) == (1, 1, 7)
    with contextlib.redirect_stdout(io.StringIO()):
        again = start_run(Trainer(parse(*argv, "-b", "4", "--resume", tmp_path / "checkpoint_prev.pth"), cpu_runtime()))
        again.fit(again.model, again.model)
    logged = scalars(tmp_path)
    for tag in ("step/train_loss", "step/lr"):
        assert [step for step, _ in logged[tag]] == [2, 4, 6, 8, 9], tag
    for tag in ("val_acc1", "train_loss", "ema_val_acc1"):
        assert [step for step, _ in logged[tag]] == [0, 1], tag
    assert [step for step, _ in logged["images_per_second"]] == [1]  # (epoch 0's, not measured: none)


def test_a_run_begun_with_its_step_scalars_beside_the_epochs_keeps_them_when_resumed(tmp_path):
    """A run begun before tensorboard/steps/: its step scalars are in tensorboard/, which a purge at the epoch would
    hide from step 2 on; purged at the step there, they stay up to it, and the new ones go to steps/."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    older = SummaryWriter(str(tmp_path / "tensorboard"))
    for step in range(1, 31):
        older.add_scalar("step/train_loss", 1.0 / step, step)
    for epoch in range(3):
        older.add_scalar("val_acc1", epoch, epoch)
    older.close()
    for step in (20, 25):  # (resumed twice: the second found steps/ there)
        # Event files are read in name order: time (s), host, PID, then a counter of this process's writers, which in a
        # long test session can cross a power of ten (...9, then ...10, read first). Runs resumed are seconds apart.
        time.sleep(1 if step == 25 else 0)
        log = RunLogger(tmp_path, prints=False, writes=True)
        log.start(parse("--dummy"), resumed=True, global_step=step, epochs_done=2)
        log.log_step(step + 1, {"loss": 0.5})
        log.finish({})
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("step/train_loss")] == list(range(1, 21))
    assert [event.step for event in accumulator.Scalars("val_acc1")] == [0, 1, 2]
    steps = EventAccumulator(str(tmp_path / "tensorboard" / "steps"), size_guidance={"scalars": 0})
    steps.Reload()
    assert [event.step for event in steps.Scalars("step/train_loss")] == [21, 26]


def test_summary_json_is_json_that_every_reader_parses_a_nan_as_null():
    """A loss of NaN (a masked criterion's validation batch with no image counted), an infinite one: null, as a missing
    figure is (was: Python's NaN and Infinity, which JSON.parse and a strict json.loads refuse)."""
    text = strict_json({"final_val_loss": math.nan, "loss": -math.inf, "rows": [1.5, math.inf], "mfu_pct": None})
    strict = json.loads(text, parse_constant=lambda constant: pytest.fail(f"not JSON: {constant}"))
    assert strict == {"final_val_loss": None, "loss": None, "rows": [1.5, None], "mfu_pct": None}

"""train_dp.py end to end: real processes, started as a user starts them, on the CPU."""

import csv
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torchvision

from common.folder_index import UNFINISHED
from common.logger import CSV_FIELDS
from conftest import TINY
from harness.jobs import assert_ok, run_prewarmed, run_script, run_together, script_command
from harness.processes import clean_env

pytestmark = pytest.mark.e2e
SCRIPT = "train_dp.py"
ACC_LINE = re.compile(
    r"^ \* Acc@1 (?P<acc1>[\d.]+)  Acc@5 (?P<acc5>[\d.]+)  Loss (?P<loss>[\d.e+-]+|nan)  "
    r"\((?P<count>\d+) images\)$",
    re.MULTILINE,
)


def train_args(data, output_dir, *extra):
    return ["--data", data, *TINY, "-b", "8", "--seed", "0", "--output-dir", output_dir, *extra]


def read_log(output_dir):
    with open(Path(output_dir) / "log.csv", newline="") as file:
        return list(csv.reader(file))


def read_checkpoint(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def snapshot(directory):
    """Every file under `directory` with its size and modification time."""
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in Path(directory).rglob("*")
    }


@pytest.fixture(scope="module")
def first_runs(tiny_data, tmp_path_factory):
    """The module's two training runs, at once (one process each, a core each), each started as a user
    starts it (not prewarmed: harness.prewarm.Prewarmed): two epochs of resnet18 on the tiny set; and one epoch,
    the count taken from the EPOCHS environment variable (no --epochs)."""
    two, one = tmp_path_factory.mktemp("dp-run") / "out", tmp_path_factory.mktemp("dp-run-env") / "out"
    results = run_together(
        [
            script_command(SCRIPT, *train_args(tiny_data, two, "--epochs", "2"), as_user=True),
            (script_command(SCRIPT, *train_args(tiny_data, one), as_user=True), clean_env(EPOCHS=1)),
        ]
    )
    return [
        SimpleNamespace(stdout=assert_ok(result), output_dir=output_dir)
        for result, output_dir in zip(results, (two, one))
    ]


@pytest.fixture(scope="module")
def trained(first_runs):
    return first_runs[0]


@pytest.fixture(scope="module")
def one_epoch(first_runs):
    return first_runs[1]


@pytest.fixture(scope="module")
def second_runs(trained, one_epoch, tiny_data, tmp_path_factory):
    """The runs that start from the first ones' checkpoints, at once: -e on the 2-epoch checkpoint;
    --resume PATH and --resume auto to a second epoch from (copies of) the 1-epoch run's directory;
    and --resume of a pytorch/examples checkpoint made from that run's. name -> (result, output dir)."""
    root = tmp_path_factory.mktemp("second-runs")
    before = snapshot(trained.output_dir)
    resumed = {how: shutil.copytree(one_epoch.output_dir, root / how) for how in ("path", "auto")}
    ours = read_checkpoint(one_epoch.output_dir / "checkpoint.pth")
    # pytorch/examples imagenet/main.py saves DataParallel's `module.` names and best_acc1 as a tensor.
    torch.save(
        {
            "epoch": 1,
            "arch": "resnet18",
            "state_dict": {f"module.{name}": value for name, value in ours["state_dict"].items()},
            "best_acc1": torch.tensor(ours["best_acc1"]),
            "optimizer": ours["optimizer"],
        },
        root / "checkpoint.pth.tar",
    )
    runs = {
        "evaluate": (trained.output_dir, ["-e", "--resume", trained.output_dir / "checkpoint.pth"]),
        "resume-path": (resumed["path"], ["--resume", resumed["path"] / "checkpoint.pth", "--epochs", "2"]),
        "resume-auto": (resumed["auto"], ["--resume", "auto", "--epochs", "2"]),
        "resume-examples": (root / "examples", ["--resume", root / "checkpoint.pth.tar", "--epochs", "2"]),
    }
    results = run_together(
        [script_command(SCRIPT, *train_args(tiny_data, output_dir, *flags)) for output_dir, flags in runs.values()]
    )
    outcome = {name: (result, output_dir) for name, result, (output_dir, _) in zip(runs, results, runs.values())}
    outcome["evaluated-dir-unchanged"] = snapshot(trained.output_dir) == before
    return outcome


# ----------------------------------------------------------------------------- a run and what it leaves


def test_train_dp_trains_and_evaluates_each_epoch(trained):
    out = trained.stdout
    assert "no GPU in use" in out and "dp: world size 1" in out
    for epoch in (0, 1):  # 24 images, batch 8: 3 steps per epoch, a line per step (-p 1)
        steps = re.findall(
            rf"^Epoch: \[{epoch}\] \[([123])/3\]  loss [\d.]+  acc@1 .* img/s \(input wait \d+%\)  eta \d+:\d\d:\d\d$",
            out,
            re.MULTILINE,
        )
        assert steps == ["1", "2", "3"], out
    accuracies = ACC_LINE.findall(out)
    assert len(accuracies) == 2 and all(count == "12" for *_, count in accuracies), out
    assert "Epoch: [2]" not in out
    assert "done: best acc@1" in out


def test_train_dp_writes_checkpoints_log_and_summary(trained):
    output_dir = trained.output_dir
    names = {path.name for path in output_dir.iterdir()}
    assert {"checkpoint.pth", "model_best.pth", "log.csv", "args.json", "summary.json", "tensorboard"} <= names
    assert not [name for name in names if "tmp" in name]
    assert list((output_dir / "tensorboard").glob("events.out.tfevents.*"))

    header, *rows = read_log(output_dir)
    assert header == CSV_FIELDS
    assert [row[0] for row in rows] == ["0", "1"]
    logged = [dict(zip(header, row)) for row in rows]
    for row in logged:
        # On the CPU no GPU memory and no utilisation (no known peak); -j 0: no loader worker.
        empty = ("gpu_idle_pct", "mfu_pct", "gpu_peak_allocated_mib", "gpu_peak_reserved_mib", "worker_peak_rss_mib")
        assert all(row[field] == "" if field in empty else float(row[field]) >= 0 for field in CSV_FIELDS[2:]), row
        assert 0.0 <= float(row["val_acc1"]) <= float(row["val_acc5"]) <= 100.0
    assert [float(row["val_acc1"]) for row in logged] == [
        pytest.approx(float(acc1), abs=1e-3) for acc1, *_ in ACC_LINE.findall(trained.stdout)
    ]

    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["mode"] == "dp" and summary["epochs"] == 2 and summary["world_size"] == 1
    assert summary["arch"] == "resnet18"
    assert summary["best_acc1"] == pytest.approx(max(float(row["val_acc1"]) for row in logged))
    assert summary["final_acc1"] == pytest.approx(float(logged[-1]["val_acc1"]))

    args = json.loads((output_dir / "args.json").read_text())
    assert args["epochs"] == 2 and args["batch_size"] == 8 and args["arch"] == "resnet18"
    assert Path(args["output_dir"]) == output_dir


def test_checkpoint_holds_the_documented_fields(trained):
    saved = read_checkpoint(trained.output_dir / "checkpoint.pth")
    assert {"epoch", "arch", "state_dict", "optimizer", "scheduler", "scaler", "best_acc1", "args"} <= saved.keys()
    assert saved["epoch"] == 2 and saved["arch"] == "resnet18"
    assert isinstance(saved["args"], dict) and saved["args"]["epochs"] == 2
    summary = json.loads((trained.output_dir / "summary.json").read_text())
    assert saved["best_acc1"] == pytest.approx(summary["best_acc1"])


@pytest.mark.parametrize("name", ["checkpoint.pth", "model_best.pth"])
def test_checkpoint_loads_into_plain_torchvision_resnet18(trained, name):
    saved = read_checkpoint(trained.output_dir / name)
    model = torchvision.models.resnet18(num_classes=3)
    model.load_state_dict(saved["state_dict"])  # strict: no prefixes, no missing or extra keys
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 3)


def test_evaluate_prints_the_checkpoints_validation_accuracy_and_writes_nothing(trained, second_runs):
    result, _ = second_runs["evaluate"]
    out = assert_ok(result)
    assert "Epoch:" not in out
    (evaluated,) = [match.groupdict() for match in ACC_LINE.finditer(out)]
    last_epoch = [match.groupdict() for match in ACC_LINE.finditer(trained.stdout)][-1]
    assert (evaluated["acc1"], evaluated["acc5"], evaluated["count"]) == (
        last_epoch["acc1"],
        last_epoch["acc5"],
        last_epoch["count"],
    )
    assert float(evaluated["loss"]) == pytest.approx(float(last_epoch["loss"]), rel=1e-5)
    assert second_runs["evaluated-dir-unchanged"]


# ----------------------------------------------------------------------------- resume and defaults


def test_epochs_from_the_environment_apply_without_the_flag(one_epoch):
    assert "Epoch: [0]" in one_epoch.stdout and "Epoch: [1]" not in one_epoch.stdout
    assert [row[0] for row in read_log(one_epoch.output_dir)[1:]] == ["0"]
    assert json.loads((one_epoch.output_dir / "summary.json").read_text())["epochs"] == 1
    assert read_checkpoint(one_epoch.output_dir / "checkpoint.pth")["epoch"] == 1


@pytest.mark.parametrize("how", ["path", "auto"])
def test_resume_continues_at_the_next_epoch(second_runs, how):
    result, output_dir = second_runs[f"resume-{how}"]
    out = assert_ok(result)
    assert f"resumed from {output_dir / 'checkpoint.pth'} (epoch 1)" in out
    assert "Epoch: [1]" in out and "Epoch: [0]" not in out
    assert len(ACC_LINE.findall(out)) == 1
    header, *rows = read_log(output_dir)
    assert header == CSV_FIELDS and [row[0] for row in rows] == ["0", "1"]
    assert read_checkpoint(output_dir / "checkpoint.pth")["epoch"] == 2
    assert json.loads((output_dir / "summary.json").read_text())["epochs"] == 2


def test_resume_accepts_a_pytorch_examples_checkpoint(second_runs):
    result, output_dir = second_runs["resume-examples"]
    out = assert_ok(result)
    assert "(epoch 1)" in out and "Epoch: [1]" in out and "Epoch: [0]" not in out
    assert read_checkpoint(output_dir / "checkpoint.pth")["epoch"] == 2


# ----------------------------------------------------------------------------- bad input


class RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# name: what the one error line must contain (the checkpoint errors: the whole line).
BAD_INPUTS = {
    "data-missing": r"--data .*missing: no such directory",
    "data-without-val": r"has no val/ folder",
    "empty-class-folder": r"zebra in .*train hold no images",
    "different-classes": r"different classes \(only in train: ring; only in val: donut\)",
    "data-unfinished": r"^error: --data \S+/unfinished is unfinished: python tools/make_shards.py /src \S+/unfinished "
    r"stopped part-way through writing it, or is still writing it; run that command again to finish it",
    "data-looping-link": r"^error: cannot list \S+/looping-link/train/loop\S+: Too many levels of symbolic links$",
    "unknown-arch": r"unknown --arch 'resnet19': did you mean resnet18",
    "resume-missing": r"--resume .*missing\.pth: no such file",
    "resume-other-arch": r"holds a squeezenet1_1 model, not resnet18: pass --arch squeezenet1_1",
    "resume-other-class-count": r"does not fit resnet18 with these classes",
    "resume-arbitrary-object": r"^error: refusing to load \S+/arbitrary\.pth: it holds a Python object \(\S+\), "
    r"not only tensors and plain data; nothing in it was run$",
    "resume-text-file": r"^error: cannot read checkpoint \S+/notes\.txt: truncated or not a PyTorch checkpoint "
    r"\(\w+\)$",
    "gpus-on-cpu": r"--gpus .*no GPU",
    "epochs-0": r"--epochs must be positive, got 0",
    "batch-0": r"--batch-size must be positive, got 0",
    "lr-0": r"--lr must be positive, got 0",
    "lr-negative": r"--lr must be positive, got -1",
    "unknown-flag": r"unrecognized arguments: --no-such-flag",
}


@pytest.fixture(scope="module")
def bad_runs(tiny_data, tmp_path_factory):
    """Every bad input run once (two at a time): name -> (result, output dir that must not appear)."""
    root = tmp_path_factory.mktemp("bad")

    def copy_of_tiny(name):
        return shutil.copytree(tiny_data, root / name)

    no_val = copy_of_tiny("no-val")
    shutil.rmtree(no_val / "val")
    empty_class = copy_of_tiny("empty-class")
    (empty_class / "train" / "zebra").mkdir()
    different = copy_of_tiny("different")
    (different / "val" / "ring").rename(different / "val" / "donut")
    unfinished = copy_of_tiny("unfinished")  # what tools/make_shards.py leaves when stopped (tests/test_shards.py)
    (unfinished / UNFINISHED).write_text(f"python tools/make_shards.py /src {unfinished}")
    looping = copy_of_tiny("looping-link")  # one listed before the class folders: a traceback (has_hf_dataset's)
    for name in ("loop.jpg", *(f"loop-{letter}" for letter in "abcdefgh")):
        (looping / "train" / name).symlink_to(name)
    torch.save(
        {
            "epoch": 1,
            "arch": "squeezenet1_1",
            "state_dict": torchvision.models.squeezenet1_1(num_classes=3).state_dict(),
        },
        root / "squeezenet.pth",
    )
    torch.save(
        {"epoch": 1, "arch": "resnet18", "state_dict": torchvision.models.resnet18(num_classes=5).state_dict()},
        root / "five-classes.pth",
    )
    torch.save(
        {"epoch": 1, "state_dict": {}, "payload": RunsCodeWhenUnpickled(root / "code-ran")}, root / "arbitrary.pth"
    )
    (root / "notes.txt").write_text("hello\n")

    cases = {
        "data-missing": ["--data", root / "missing"],
        "data-without-val": ["--data", no_val],
        "empty-class-folder": ["--data", empty_class],
        "different-classes": ["--data", different],
        "data-unfinished": ["--data", unfinished],
        "data-looping-link": ["--data", looping],
        "unknown-arch": ["--arch", "resnet19"],
        "resume-missing": ["--resume", root / "missing.pth"],
        "resume-other-arch": ["--resume", root / "squeezenet.pth"],
        "resume-other-class-count": ["--resume", root / "five-classes.pth"],
        "resume-arbitrary-object": ["--resume", root / "arbitrary.pth"],
        "resume-text-file": ["--resume", root / "notes.txt"],
        "gpus-on-cpu": ["--gpus", "0"],
        "epochs-0": ["--epochs", "0"],
        "batch-0": ["-b", "0"],
        "lr-0": ["--lr", "0"],
        "lr-negative": ["--lr", "-1"],
        "unknown-flag": ["--no-such-flag"],
    }
    assert cases.keys() == BAD_INPUTS.keys()

    # Later flags win in argparse: each case overrides the good defaults given first. Each case is a
    # process of its own, forked from one that imported torch already (harness.jobs.run_prewarmed).
    names = list(cases)
    results = run_prewarmed(
        SCRIPT, [[*train_args(tiny_data, root / f"out-{name}", "--epochs", "1"), *cases[name]] for name in names]
    )
    assert not (root / "code-ran").exists(), "loading --resume ran code from the checkpoint"
    return {name: (result, root / f"out-{name}") for name, result in zip(names, results)}


def error_lines(output):
    return [line for line in output.splitlines() if line.startswith(("error:", f"{SCRIPT}: error:"))]


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_exits_2_with_one_line_and_nothing_else_and_creates_no_output_dir(bad_runs, name):
    result, output_dir = bad_runs[name]
    out = result.stdout
    assert result.returncode == 2, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == error_lines(out) and len(lines) == 1, out  # no traceback, no other line
    assert re.search(BAD_INPUTS[name], lines[0]), lines[0]
    assert not output_dir.exists()


def test_a_bad_input_gives_the_same_line_from_a_process_started_as_a_user_starts_it(bad_runs, tiny_data, tmp_path):
    """The cases above run forked from an interpreter that imported torch already; here one runs as
    `python train_dp.py` itself, with the same result."""
    result = run_script(SCRIPT, *train_args(tiny_data, tmp_path / "out", "--epochs", "1"), "--lr", "0", as_user=True)
    forked, _ = bad_runs["lr-0"]
    assert (
        (result.returncode, result.stdout)
        == (forked.returncode, forked.stdout)
        == (2, "error: --lr must be positive, got 0.0\n")
    )
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- nn.DataParallel itself


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: without one train_dp.py runs the bare model (nn.DataParallel needs GPUs)",
)
def test_dataparallel_splits_each_batch_over_every_visible_gpu(tiny_data, tmp_path):
    """train_dp.py on this machine's GPUs (clean_env hides them unless gpu=True): one replica per GPU,
    each on its share of the global batch of 8; with one GPU, DataParallel runs the model on it."""
    count = torch.cuda.device_count()
    result = run_script(
        SCRIPT,
        *train_args(tiny_data, tmp_path / "out", "--epochs", "1", "-a", "tests.tiny_models:ReplicaReportNet"),
        env=clean_env(gpu=True),
    )
    out = assert_ok(result)
    assert f"dp: world size 1, {count} device(s) per process" in out and f"{count} x " in out, out[-3000:]
    assert "no GPU in use" not in out
    replicas = dict(re.findall(r"^replica on (cuda:\d+): (\d+) images$", out, re.MULTILINE))
    assert sorted(replicas) == sorted(f"cuda:{index}" for index in range(count)), out[-3000:]
    assert sum(int(images) for images in replicas.values()) == 8
    assert read_checkpoint(tmp_path / "out" / "checkpoint.pth")["epoch"] == 1

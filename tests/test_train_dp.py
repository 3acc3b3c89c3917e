"""train_dp.py end to end: real processes, started as a user starts them, on the CPU."""
import csv
import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torchvision

from common.logger import CSV_FIELDS
from conftest import TINY, assert_ok, clean_env, run_script

SCRIPT = "train_dp.py"
ACC_LINE = re.compile(r"^ \* Acc@1 (?P<acc1>[\d.]+)  Acc@5 (?P<acc5>[\d.]+)  Loss (?P<loss>[\d.e+-]+|nan)  "
                      r"\((?P<count>\d+) images\)$", re.MULTILINE)


def train_args(data, output_dir, *extra):
    return ["--data", data, *TINY, "-b", "8", "--seed", "0", "--output-dir", output_dir, *extra]


def read_log(output_dir):
    with open(Path(output_dir) / "log.csv", newline="") as file:
        return list(csv.reader(file))


def read_checkpoint(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def snapshot(directory):
    """Every file under `directory` with its size and modification time."""
    return {str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns)
            for path in Path(directory).rglob("*")}


@pytest.fixture(scope="module")
def trained(tiny_data, tmp_path_factory):
    """Two epochs of resnet18 on the tiny set, trained once for the whole module."""
    output_dir = tmp_path_factory.mktemp("dp-run") / "out"
    result = run_script(SCRIPT, *train_args(tiny_data, output_dir, "--epochs", "2"))
    return SimpleNamespace(stdout=assert_ok(result), output_dir=output_dir)


@pytest.fixture(scope="module")
def one_epoch(tiny_data, tmp_path_factory):
    """One epoch, the count taken from the EPOCHS environment variable (no --epochs)."""
    output_dir = tmp_path_factory.mktemp("dp-run-env") / "out"
    result = run_script(SCRIPT, *train_args(tiny_data, output_dir), env=clean_env(EPOCHS=1))
    return SimpleNamespace(stdout=assert_ok(result), output_dir=output_dir)


# ----------------------------------------------------------------------------- a run and what it leaves

def test_train_dp_trains_and_evaluates_each_epoch(trained):
    out = trained.stdout
    assert "no GPU in use" in out and "dp: world size 1" in out
    for epoch in (0, 1):  # 24 images, batch 8: 3 steps per epoch, a line per step (-p 1)
        steps = re.findall(rf"^Epoch: \[{epoch}\] \[([123])/3\]  loss [\d.]+  acc@1 .* img/s  eta \d+:\d\d:\d\d$",
                           out, re.MULTILINE)
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
        for field in CSV_FIELDS[2:]:
            float(row[field])
        assert 0.0 <= float(row["val_acc1"]) <= float(row["val_acc5"]) <= 100.0
    assert [float(row["val_acc1"]) for row in logged] == [
        pytest.approx(float(acc1), abs=1e-3) for acc1, *_ in ACC_LINE.findall(trained.stdout)]

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


def test_evaluate_prints_the_checkpoints_validation_accuracy_and_writes_nothing(trained, tiny_data):
    output_dir = trained.output_dir
    before = snapshot(output_dir)
    result = run_script(SCRIPT, *train_args(tiny_data, output_dir, "-e", "--resume",
                                            output_dir / "checkpoint.pth"))
    out = assert_ok(result)
    assert "Epoch:" not in out
    (evaluated,) = [match.groupdict() for match in ACC_LINE.finditer(out)]
    last_epoch = [match.groupdict() for match in ACC_LINE.finditer(trained.stdout)][-1]
    assert (evaluated["acc1"], evaluated["acc5"], evaluated["count"]) == (
        last_epoch["acc1"], last_epoch["acc5"], last_epoch["count"])
    assert float(evaluated["loss"]) == pytest.approx(float(last_epoch["loss"]), rel=1e-5)
    assert snapshot(output_dir) == before


# ----------------------------------------------------------------------------- resume and defaults

def test_epochs_from_the_environment_apply_without_the_flag(one_epoch):
    assert "Epoch: [0]" in one_epoch.stdout and "Epoch: [1]" not in one_epoch.stdout
    assert [row[0] for row in read_log(one_epoch.output_dir)[1:]] == ["0"]
    assert json.loads((one_epoch.output_dir / "summary.json").read_text())["epochs"] == 1
    assert read_checkpoint(one_epoch.output_dir / "checkpoint.pth")["epoch"] == 1


@pytest.mark.parametrize("how", ["path", "auto"])
def test_resume_continues_at_the_next_epoch(one_epoch, tiny_data, tmp_path, how):
    output_dir = shutil.copytree(one_epoch.output_dir, tmp_path / "out")
    resume = str(output_dir / "checkpoint.pth") if how == "path" else "auto"
    out = assert_ok(run_script(SCRIPT, *train_args(tiny_data, output_dir, "--resume", resume, "--epochs", "2")))
    assert f"resumed from {output_dir / 'checkpoint.pth'} (epoch 1)" in out
    assert "Epoch: [1]" in out and "Epoch: [0]" not in out
    assert len(ACC_LINE.findall(out)) == 1
    header, *rows = read_log(output_dir)
    assert header == CSV_FIELDS and [row[0] for row in rows] == ["0", "1"]
    assert read_checkpoint(output_dir / "checkpoint.pth")["epoch"] == 2
    assert json.loads((output_dir / "summary.json").read_text())["epochs"] == 2


def test_resume_accepts_a_pytorch_examples_checkpoint(one_epoch, tiny_data, tmp_path):
    ours = read_checkpoint(one_epoch.output_dir / "checkpoint.pth")
    # pytorch/examples imagenet/main.py saves DataParallel's `module.` names and best_acc1 as a tensor.
    torch.save({"epoch": 1, "arch": "resnet18",
                "state_dict": {f"module.{name}": value for name, value in ours["state_dict"].items()},
                "best_acc1": torch.tensor(ours["best_acc1"]), "optimizer": ours["optimizer"]},
               tmp_path / "checkpoint.pth.tar")
    output_dir = tmp_path / "out"
    out = assert_ok(run_script(SCRIPT, *train_args(tiny_data, output_dir, "--resume", tmp_path / "checkpoint.pth.tar",
                                                   "--epochs", "2")))
    assert "(epoch 1)" in out and "Epoch: [1]" in out and "Epoch: [0]" not in out
    assert read_checkpoint(output_dir / "checkpoint.pth")["epoch"] == 2


# ----------------------------------------------------------------------------- bad input

class RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# name: what the one error line must contain.
BAD_INPUTS = {
    "data-missing": r"--data .*missing: no such directory",
    "data-without-val": r"has no val/ folder",
    "empty-class-folder": r"zebra in .*train hold no images",
    "different-classes": r"different classes \(only in train: ring; only in val: donut\)",
    "unknown-arch": r"unknown --arch 'resnet19': did you mean resnet18",
    "resume-missing": r"--resume .*missing\.pth: no such file",
    "resume-other-arch": r"holds a squeezenet1_1 model, not resnet18: pass --arch squeezenet1_1",
    "resume-other-class-count": r"does not fit resnet18 with these classes",
    "resume-arbitrary-object": r"refusing to load",
    "resume-text-file": r"cannot read checkpoint|not a",
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
    torch.save({"epoch": 1, "arch": "squeezenet1_1",
                "state_dict": torchvision.models.squeezenet1_1(num_classes=3).state_dict()}, root / "squeezenet.pth")
    torch.save({"epoch": 1, "arch": "resnet18",
                "state_dict": torchvision.models.resnet18(num_classes=5).state_dict()}, root / "five-classes.pth")
    torch.save({"epoch": 1, "state_dict": {}, "payload": RunsCodeWhenUnpickled(root / "code-ran")},
               root / "arbitrary.pth")
    (root / "notes.txt").write_text("hello\n")

    cases = {
        "data-missing": ["--data", root / "missing"],
        "data-without-val": ["--data", no_val],
        "empty-class-folder": ["--data", empty_class],
        "different-classes": ["--data", different],
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

    def launch(name):
        output_dir = root / f"out-{name}"
        # Later flags win in argparse: each case overrides the good defaults given first.
        result = run_script(SCRIPT, *train_args(tiny_data, output_dir, "--epochs", "1"), *cases[name], timeout=120)
        return name, (result, output_dir)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(pool.map(launch, cases))
    assert not (root / "code-ran").exists(), "loading --resume ran code from the checkpoint"
    return results


def error_lines(output):
    return [line for line in output.splitlines() if line.startswith(("error:", f"{SCRIPT}: error:"))]


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_exits_2_with_one_error_line_and_creates_no_output_dir(bad_runs, name):
    result, output_dir = bad_runs[name]
    out = result.stdout
    assert result.returncode == 2, out
    assert "Traceback" not in out, out
    (line,) = error_lines(out)
    assert out.strip().splitlines()[-1] == line, out  # the error is the last thing printed
    assert re.search(BAD_INPUTS[name], line), line
    assert not output_dir.exists()


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_prints_nothing_but_the_error_line(bad_runs, name):
    result, _ = bad_runs[name]
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, result.stdout
    assert lines == error_lines(result.stdout)

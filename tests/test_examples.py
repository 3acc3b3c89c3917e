"""examples/: the changes a researcher makes (own model with an auxiliary head, own dataset, distillation, another
optimizer and schedule with clipping, an extra metric, layer-wise learning rates, own augmentation, a metric with a
state: a confusion matrix; a loss with a parameter and a trainer with state of its own; SAM's optimizer step; a whole
experiment with its data, weights file, loss, groups and metric), each one file of theirs, run with the real
launchers: torchrun with 2 processes against one process (the same losses and named values, 1e-5), a SIGKILL
of the whole job mid-epoch then --resume auto (bitwise the weights, exactly the logged values of the run that
was never stopped), and validation counting each image once."""

import csv
import json
import re

import pytest
import torch

from common.logger import MEASURED
from conftest import log_rows, tiny_folder
from harness.ahead import SideBySide, ahead, once
from harness.jobs import Job, torchrun_command
from harness.processes import PYTHON, REPO, clean_env

pytestmark = pytest.mark.e2e

SIZE = ["--train-crop-size", "16", "--val-resize-size", "16", "--val-crop-size", "16", "-j", "0", "-p", "1"]
# tiny_data: 24 train images, 12 val; global batch 4: 6 steps an epoch, a checkpoint every 2 steps.
RUN = [*SIZE, "-b", "4", "--epochs", "2", "--seed", "3", "--lr", "0.02", "--checkpoint-interval", "2"]
TINY_NET = ["-a", "tests.tiny_models:TinyNet"]
VAL_IMAGES = 12
KILL_AT = re.compile(r"^Epoch: \[1\] \[3/6\]")  # the last checkpoint before it: epoch 1, step 2
# The killed run's model sleeps at the next step (its 10th training forward): it is killed at step 3 of epoch 1
# however late the line is read. Its arch is the same model with that pause (and so is the resumed run's).
PAUSING = {
    "tests.tiny_models:TinyNet": "tests.tiny_models:TinyNetThatPauses",
    "examples.aux_model:build": "tests.tiny_models:AuxNetThatPauses",
    "examples.experiment:Experiment": "tests.tiny_models:ExperimentThatPauses",
}  # (its --trainer)


FORWARDS_PER_STEP = {"sam": 2}  # (SAM's closure: a second forward of each step's batch)
# Training-mode forwards before the first step: the meta-device check of a torchvision --arch's training crop.
FORWARDS_BEFORE = {"experiment": 1}


def pausing(flags):
    """`flags` with the model's arch (or the trainer that builds it) swapped for the same with the pause."""
    at = next(
        index + 1 for index, flag in enumerate(flags) if flag in ("-a", "--trainer") and flags[index + 1] in PAUSING
    )
    return [*flags[:at], PAUSING[flags[at]], *flags[at + 1 :]]


def example_arguments(name, data, teacher, weights=None):
    """The flags of each example: what its docstring tells a researcher to pass."""
    return {
        "experiment": ["-a", "resnet18", "--init-from", weights, "--trainer", "examples.experiment:Experiment"],
        "aux_model": ["-a", "examples.aux_model:build", "--data", data],
        "csv_dataset": [*TINY_NET, "--dataset", "examples.csv_dataset:build", "--data", data],
        "distillation": [
            *TINY_NET,
            "--data",
            data,
            "--trainer",
            "examples.distillation:Distillation",
            "--teacher",
            teacher,
            "--teacher-arch",
            "tests.tiny_models:TinyNet",
        ],
        "adamw_onecycle": [
            *TINY_NET,
            "--data",
            data,
            "--trainer",
            "examples.adamw_onecycle:AdamWOneCycle",
            "--clip-grad-norm",
            "0.05",
            "--wd",
            "0.05",
        ],
        "extra_metric": [*TINY_NET, "--data", data, "--trainer", "examples.extra_metric:WithConfidence"],
        "layerwise_lr": [*TINY_NET, "--data", data, "--trainer", "examples.layerwise_lr:LayerwiseLr"],
        "own_augmentation": [
            *TINY_NET,
            "--data",
            data,
            "--trainer",
            "examples.own_augmentation:Rotation",
            "--rotation",
            "30",
        ],
        "confusion_matrix": [*TINY_NET, "--data", data, "--trainer", "examples.confusion_matrix:PerClass"],
        "learned_temperature": [
            *TINY_NET,
            "--data",
            data,
            "--trainer",
            "examples.learned_temperature:LearnedTemperature",
        ],
        "sam": [*TINY_NET, "--data", data, "--trainer", "examples.sam:SAM", "--sam-rho", "0.5"],
    }[name]


EXAMPLES = [
    "aux_model",
    "csv_dataset",
    "distillation",
    "adamw_onecycle",
    "extra_metric",
    "layerwise_lr",
    "own_augmentation",
    "confusion_matrix",
    "learned_temperature",
    "sam",
    "experiment",
]
# resnet18's BatchNorm normalises each process's own batch under DDP (SyncBatchNorm needs GPUs): close to one process,
# not equal (docs/concepts.md), so the experiment is compared with itself killed and resumed, not with one process.
WITHOUT_BATCHNORM = [name for name in EXAMPLES if name != "experiment"]
# The named values each example logs (log.csv columns beyond the run's own).
NAMED = {
    "distillation": ["train_ce_loss", "train_distill_loss"],
    "extra_metric": ["train_top5_error", "train_confidence", "val_top5_error", "val_confidence"],
    "layerwise_lr": ["lr_group1"],
    "confusion_matrix": ["train_balanced_acc", "val_balanced_acc"],
    "learned_temperature": ["train_temperature"],
}


def tables(folder):
    """{file: its content} of the metrics/ folder of a run (examples.confusion_matrix's per-epoch JSON files)."""
    return {path.name: path.read_text() for path in sorted((folder / "metrics").glob("*.json"))}


def torchrun(*args):
    return torchrun_command("train_ddp.py", 2, *args)


def finished(job):
    returncode, output = job.finish(timeout=300)
    assert returncode == 0, output[-3000:]
    return output


def runs_of(name, data, teacher, out, weights=None):
    """The example's three runs: one process (train_dp.py), torchrun with 2 processes, and torchrun with 2
    processes SIGKILLed (all of it) mid-epoch 1, then resumed to the end."""
    flags = [*RUN, *example_arguments(name, data, teacher, weights)]
    single = (
        Job([PYTHON, REPO / "train_dp.py", *flags, "--output-dir", out / "single"])
        if name in WITHOUT_BATCHNORM
        else None
    )  # (nothing to compare it with)
    ddp = Job(torchrun(*flags, "--output-dir", out / "ddp"))
    outputs = {**({"single": finished(single)} if single else {}), "ddp": finished(ddp)}
    killed = Job(
        torchrun(*pausing(flags), "--output-dir", out / "killed", "--resume", "auto"),
        env=clean_env(
            PAUSE_AT_TRAINING_FORWARD=str(10 * FORWARDS_PER_STEP.get(name, 1) + FORWARDS_BEFORE.get(name, 0))
        ),
    )
    killed.wait_for(KILL_AT, timeout=300)
    killed.kill()
    outputs["resumed"] = finished(Job(torchrun(*pausing(flags), "--output-dir", out / "killed", "--resume", "auto")))
    return outputs


def csv_folder(tmp_path_factory):
    """tiny_data listed in one annotations.csv (file, split, species): examples/csv_dataset.py's layout."""
    tiny_data, root = once(tiny_folder, tmp_path_factory), tmp_path_factory.mktemp("annotated")
    with open(root / "annotations.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["file", "split", "species"])
        for path in sorted(tiny_data.glob("*/*/*.jpg")):
            writer.writerow([path, path.parent.parent.name, path.parent.name])
    return root


def teacher_checkpoint(tmp_path_factory):
    tiny_data, out = once(tiny_folder, tmp_path_factory), tmp_path_factory.mktemp("teacher")
    finished(
        Job(
            [
                PYTHON,
                REPO / "train_dp.py",
                *SIZE,
                *TINY_NET,
                "--data",
                tiny_data,
                "--epochs",
                "2",
                "-b",
                "4",
                "--seed",
                "1",
                "--output-dir",
                out,
            ]
        )
    )
    return out / "checkpoint.pth"


def resnet18_weights(tmp_path_factory):
    """A researcher's own weights file for examples/experiment.py: a resnet18 state dict (RGB, 1000 classes)."""
    import torchvision

    path = tmp_path_factory.mktemp("weights") / "my_resnet18.pth"
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18().state_dict(), path)
    return path


def runs_of_examples(tmp_path_factory):
    """name -> {run: output}; the output dirs under name's folder. Two examples at a time."""
    tiny_data, csv_data, teacher, weights = (
        once(make, tmp_path_factory) for make in (tiny_folder, csv_folder, teacher_checkpoint, resnet18_weights)
    )
    folders = {name: tmp_path_factory.mktemp(name) for name in EXAMPLES}

    def run(name):
        data = csv_data if name == "csv_dataset" else tiny_data
        return runs_of(name, data, teacher, folders[name], weights)

    with SideBySide(2) as pool:
        futures = {name: pool.submit(run, name) for name in EXAMPLES}
    return {name: (future.result(), folders[name]) for name, future in futures.items()}


example_runs = ahead(runs_of_examples, "example_runs")


def compared_columns(rows):
    return [field for field in rows[0] if field not in ("epoch", *MEASURED)]


@pytest.mark.parametrize("name", WITHOUT_BATCHNORM)
def test_an_example_under_ddp_follows_the_single_process_run(example_runs, name):
    outputs, folder = example_runs[name]
    single, ddp = log_rows(folder / "single"), log_rows(folder / "ddp")
    assert len(single) == len(ddp) == 2
    columns = compared_columns(ddp)
    assert set(NAMED.get(name, [])) <= set(columns), columns  # each named value is a column of its own
    for a, b in zip(single, ddp):
        for column in columns:
            assert float(a[column]) == pytest.approx(float(b[column]), rel=1e-5, abs=1e-5), (column, a, b)
    assert tables(folder / "single") == tables(folder / "ddp")  # counts summed over the ranks exactly
    # Equality proves nothing if training stood still: the last 2 steps moved the weights.
    last, before = (
        torch.load(folder / "ddp" / file, weights_only=True)["state_dict"]
        for file in ("checkpoint.pth", "checkpoint_prev.pth")
    )
    assert max((last[key].float() - before[key].float()).abs().max().item() for key in last) > 1e-5


@pytest.mark.parametrize("name", EXAMPLES)
def test_an_example_killed_mid_epoch_resumes_to_the_same_end_bitwise(example_runs, name):
    outputs, folder = example_runs[name]
    assert re.search(r"^resumed from .*checkpoint\.pth \(epoch 1, step 2\)", outputs["resumed"], re.MULTILINE), outputs[
        "resumed"
    ][-3000:]
    final = {run: torch.load(folder / run / "checkpoint.pth", weights_only=True) for run in ("ddp", "killed")}
    assert final["ddp"]["state_dict"].keys() == final["killed"]["state_dict"].keys()
    for key, value in final["ddp"]["state_dict"].items():
        assert torch.equal(value, final["killed"]["state_dict"][key]), key
    uninterrupted, resumed = log_rows(folder / "ddp"), log_rows(folder / "killed")
    for column in compared_columns(uninterrupted):  # the named values' sums too: resumed by name
        assert [row[column] for row in uninterrupted] == [row[column] for row in resumed], column
    assert tables(folder / "ddp") == tables(folder / "killed")  # a metric's state too


@pytest.mark.parametrize("name", EXAMPLES)
def test_an_example_validates_every_image_once(example_runs, name):
    outputs, _ = example_runs[name]
    for run, output in outputs.items():
        counts = re.findall(r"^ \* Acc@1 .*\((\d+) images\)$", output, re.MULTILINE)
        assert counts and set(counts) == {str(VAL_IMAGES)}, (run, output[-2000:])
        # Validation's progress lines are rank 0's share of the images, and say so where there are others.
        shown = re.findall(r"^Test( \(rank 0's share\))? \[", output, re.MULTILINE)
        assert shown and set(shown) == {"" if run == "single" else " (rank 0's share)"}, (run, output[-2000:])


def test_the_new_hooks_examples_do_what_their_docstrings_say(example_runs):
    """layerwise_lr: the header lists both groups' lrs and log.csv the backbone's at a tenth of the head's;
    confusion_matrix: the per-class line after each validation and a matrix per epoch that counts every val image
    once; own_augmentation: a rotation changes the training (its loss differs from the same run's without it);
    learned_temperature: the temperature learned, and it and the step counter resumed; sam: its step changes the
    training."""
    outputs, folder = example_runs["layerwise_lr"]
    assert "optimizer: SGD, lr by parameter group 0.02, 0.002, momentum 0.9" in outputs["ddp"]
    assert all(float(row["lr_group1"]) == pytest.approx(float(row["lr"]) / 10) for row in log_rows(folder / "ddp"))
    outputs, folder = example_runs["confusion_matrix"]
    assert re.search(r"^ \* per-class acc@1 [\d.]+, [\d.]+, [\d.]+; lowest: \w+$", outputs["ddp"], re.MULTILINE)
    matrices = [
        json.loads(text)["confusion"] for name, text in tables(folder / "ddp").items() if name.startswith("val")
    ]
    assert len(matrices) == 2 and all(sum(map(sum, matrix)) == VAL_IMAGES for matrix in matrices)
    _, folder = example_runs["learned_temperature"]  # the criterion's parameter and the trainer's counter: resumed
    final = [torch.load(folder / run / "checkpoint.pth", weights_only=True) for run in ("ddp", "killed")]
    temperatures = [end["criterion"]["log_temperature"] for end in final]
    assert temperatures[0] != 0 and torch.equal(*temperatures)
    assert final[0]["trainer_state"] == final[1]["trainer_state"] == {"steps_taken": 12}
    rotated = log_rows(example_runs["own_augmentation"][1] / "ddp")
    plain = log_rows(example_runs["extra_metric"][1] / "ddp")  # the same flags but --trainer's, no rotation
    assert rotated[0]["train_loss"] != plain[0]["train_loss"]
    sam = log_rows(example_runs["sam"][1] / "ddp")  # likewise: SAM's second gradient changes the training
    assert sam[1]["train_loss"] != plain[1]["train_loss"]


def test_the_whole_experiment_in_one_file_uses_its_data_weights_head_channels_groups_and_metric(example_runs):
    """examples/experiment.py: its data in memory, the weights file's head replaced and conv1 adapted to one channel
    (the header says so), two lr groups, a matrix per epoch of every val image, the focal loss its criterion; in
    at most 50 lines."""
    outputs, folder = example_runs["experiment"]
    output = outputs["ddp"]  # (the resumed run takes its checkpoint's weights, not the file's)
    assert "data: Experiment.build_datasets (10 classes, 24 train / 12 val images" in output, output[:3000]
    assert re.search(
        r"^model: resnet18 from --init-from .*my_resnet18.pth, .*; changed for this data: fc: 1000 -> "
        r"10 classes, new weights; conv1: 3 -> 1 channels, RGB filters summed$",
        output,
        re.MULTILINE,
    )
    assert "optimizer: SGD, lr by parameter group 0.02, 0.002, momentum 0.9" in output
    matrices = [
        json.loads(text)["confusion"] for name, text in tables(folder / "ddp").items() if name.startswith("val")
    ]
    assert len(matrices) == 2 and all(len(matrix) == 10 and sum(map(sum, matrix)) == VAL_IMAGES for matrix in matrices)
    assert len((REPO / "examples" / "experiment.py").read_text().splitlines()) <= 50

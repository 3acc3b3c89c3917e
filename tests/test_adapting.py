"""What a researcher's own parts do in a real run: a dataset's item found bad by a loader worker ends the run in one
line, items a dataset cannot read are skipped and listed by name; GoogLeNet's auxiliary heads under torchrun; a
parameter DDP never sees a gradient for needs --find-unused-parameters, said in one line. (The rules each part must
keep, checked at start in one line: tests/unit/test_datasets.py, test_models.py, test_trainer.py.)"""

import re

import pytest
import torch

from conftest import log_rows
from harness.jobs import assert_ok, no_traceback_of_ours, run_prewarmed, run_together, torchrun_command
from harness.processes import PYTHON, REPO

pytestmark = pytest.mark.e2e
SMALL = [
    "--train-crop-size",
    "16",
    "--val-resize-size",
    "16",
    "--val-crop-size",
    "16",
    "-p",
    "1",
    "--epochs",
    "1",
    "-b",
    "4",
    "--seed",
    "1",
    "-a",
    "tests.tiny_models:TinyNet",
]


# L-BFGS (tests.tiny_models.LineSearch): NHWC gradients cannot be flattened by its .view(-1), hence channels-last off
LINE_SEARCH = [
    *("-a", "tests.tiny_models:TinyNet", "--trainer", "tests.tiny_models:LineSearch"),
    *("--channels-last", "off", "--dist-timeout", "60"),
]


def one_line_error(result):
    """The error line of a run refused: exit 2, one line, no traceback."""
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stdout[-3000:]
    return errors[0]


@pytest.fixture(scope="module")
def own_datasets(tmp_path_factory):
    out = tmp_path_factory.mktemp("own")
    runs = {"late_bad_item": [*SMALL, "-j", "1"], "unreadable_items": [*SMALL, "-j", "0"]}
    results = run_prewarmed(
        "train_dp.py",
        [
            [*flags, "--dataset", f"tests.custom_datasets:{name}", "--output-dir", out / name]
            for name, flags in runs.items()
        ],
    )
    return dict(zip(runs, results)), out


def test_an_item_a_loader_worker_finds_bad_ends_the_run_in_one_line(own_datasets):
    results, _ = own_datasets
    line = one_line_error(results["late_bad_item"])
    assert line == "error: item 5 of the train set is a tuple of 3; items must be (image, label)"


def test_items_a_dataset_cannot_read_are_skipped_and_listed_by_name(own_datasets):
    results, out = own_datasets
    output = assert_ok(results["unreadable_items"])
    assert "warning: skipped Items[2]: cannot decode it (cannot read sample 2)" in output
    assert re.search(r"^ \* Acc@1 .*\(6 images\)$", output, re.MULTILINE), output[-2000:]
    listed = (out / "unreadable_items" / "bad_images.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in listed] == ["Items[2]", "Items[3]"]


@pytest.fixture(scope="module")
def model_runs(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    common = [
        "--train-crop-size",
        "32",
        "--val-resize-size",
        "32",
        "--val-crop-size",
        "32",
        "-j",
        "0",
        "-p",
        "1",
        "--epochs",
        "1",
        "-b",
        "4",
        "--seed",
        "1",
        "--data",
        tiny_data,
    ]
    commands = {
        "googlenet": torchrun_command("train_ddp.py", 2, *common, "-a", "googlenet", "--output-dir", out / "g"),
        "unused": torchrun_command(
            "train_ddp.py", 2, *common, "-a", "tests.tiny_models:UnusedNet", "--output-dir", out / "u"
        ),
        "unused_found": torchrun_command(
            "train_ddp.py",
            2,
            *common,
            "-a",
            "tests.tiny_models:UnusedNet",
            "--find-unused-parameters",
            "--output-dir",
            out / "uf",
        ),
        "line_search": torchrun_command("train_ddp.py", 2, *common, *LINE_SEARCH, "--output-dir", out / "ls"),
        "line_search_dp": [PYTHON, REPO / "train_dp.py", *common, *LINE_SEARCH, "--output-dir", out / "ls_dp"],
    }
    return dict(zip(commands, run_together(list(commands.values())))), out


def test_googlenet_trains_under_torchrun_with_its_auxiliary_heads(model_runs):
    """Seen once: both ranks ended with `TypeError: cross_entropy_loss(): argument 'input' (position 1) must be
    Tensor, not GoogLeNetOutputs`."""
    result = model_runs[0]["googlenet"]
    assert_ok(result)
    assert re.search(r"^ \* Acc@1 .*\(12 images\)$", result.stdout, re.MULTILINE)


def test_a_parameter_left_unused_needs_find_unused_parameters_and_says_so_in_one_line(model_runs):
    refused, trained = model_runs[0]["unused"], model_runs[0]["unused_found"]
    assert refused.returncode != 0 and no_traceback_of_ours(refused.stdout), refused.stdout[-3000:]
    assert "parameters that received no gradient: add --find-unused-parameters" in refused.stdout, refused.stdout[
        -3000:
    ]
    assert_ok(trained)


def test_a_line_search_s_closure_gets_the_loss_over_all_ranks_as_under_dataparallel(model_runs):
    """L-BFGS's strong-Wolfe line search calls closure() as often as the losses it returns ask: under DDP each rank got
    its own images' loss, so the ranks made different numbers of calls and waited in each other's collectives for
    --dist-timeout. Now every rank gets the step's loss over all ranks: DataParallel's, call for call."""
    runs, out = model_runs
    for name in ("line_search", "line_search_dp"):
        assert_ok(runs[name])
    losses = [
        torch.load(out / folder / "checkpoint.pth", weights_only=True)["trainer_state"]["losses"]
        for folder in ("ls", "ls_dp")
    ]
    assert len(losses[0]) == len(losses[1]) > 6  # (6 steps, some of more than one call)
    assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-6)
    assert losses[0][:6] == pytest.approx(losses[1][:6], rel=1e-3)  # (L-BFGS's steps grow the rounding's differences)
    assert float(log_rows(out / "ls")[0]["train_loss"]) == pytest.approx(
        float(log_rows(out / "ls_dp")[0]["train_loss"]), rel=1e-2
    )

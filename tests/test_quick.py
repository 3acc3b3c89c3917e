"""The real runs of `make test-quick`, beside the unit tier: train_dp.py and train_ddp.py under torchrun with 2
processes, side by side, on the tiny set: both train and validate each image once, and DDP follows DataParallel's
trajectory (a BatchNorm-free model). The whole of it: tests/test_distributed.py."""

import re

import pytest
import torch

from conftest import TINY
from harness.jobs import assert_ok, run_together, script_command, torchrun_command

pytestmark = [pytest.mark.e2e, pytest.mark.quick]
RUN = [
    *TINY,
    "-a",
    "tests.tiny_models:TinyNet",
    "--dropout",
    "0",
    "-b",
    "8",
    "--epochs",
    "2",
    "--seed",
    "3",
    "--lr",
    "0.05",
]
VAL_LINE = re.compile(r"^ \* Acc@1 (\S+)  Acc@5 (\S+)  Loss (\S+)  \((\d+) images\)$", re.MULTILINE)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("quick")
    dp, ddp = run_together(
        [
            script_command("train_dp.py", *RUN, "--data", tiny_data, "--output-dir", out / "dp"),
            torchrun_command("train_ddp.py", 2, *RUN, "--data", tiny_data, "--output-dir", out / "ddp"),
        ]
    )
    return out, {"dp": assert_ok(dp), "ddp": assert_ok(ddp)}


def test_dataparallel_and_ddp_train_and_validate_each_image_once(runs):
    _, outputs = runs
    for mode, output in outputs.items():
        assert output.splitlines()[-1].startswith("done: best acc@1 "), output[-3000:]
        assert [count for *_, count in VAL_LINE.findall(output)] == ["12", "12"], mode
    assert "ddp: world size 2" in outputs["ddp"]


def test_ddp_follows_the_trajectory_of_dataparallel(runs):
    out, outputs = runs
    dp, ddp = (torch.load(out / mode / "checkpoint.pth", weights_only=True)["state_dict"] for mode in ("dp", "ddp"))
    assert max((dp[name] - ddp[name]).abs().max().item() for name in dp) <= 1e-5
    assert [line[:2] for line in VAL_LINE.findall(outputs["dp"])] == [
        line[:2] for line in VAL_LINE.findall(outputs["ddp"])
    ]

"""Today's recipe in one flag, end to end: --preset tv-v2 (mixing, auto-augment, erasing, repeated augmentation, the
EMA, weight-decay groups, per-epoch lr steps) trained to the end under torchrun on resnet18 (BatchNorm), its EMA in
every checkpoint, loading with weights_only into a plain torchvision model, and -e in one process on DDP's checkpoint
printing what DDP printed. (Each part against its definition: tests/unit/; the recipe without mixing keeps
DP = DDP = spawn: tests/test_distributed.py.)"""

import csv
import json
import re

import pytest
import torch
import torchvision

from common.logger import CSV_FIELDS, EMA_FIELDS
from common.models import adjusted_decay
from conftest import TINY, make_image_folder
from harness.jobs import Job, torchrun_command
from harness.processes import PYTHON, REPO

pytestmark = pytest.mark.e2e

# 48 training images at -b 8: 6 steps an epoch. The EMA updates every 2 steps, restarting from the weights through
# the warmup epoch. --data: the preset's ImageNet scale (600 epochs, -b 1024, 176 px...) is overridden flag by flag.
STEPS = 6
RECIPE = [
    "--preset",
    "tv-v2",
    "-a",
    "resnet18",
    *TINY,
    "-p",
    "2",
    "-b",
    "8",
    "--epochs",
    "2",
    "--lr",
    "0.01",
    "--warmup-epochs",
    "1",
    "--seed",
    "3",
    "--model-ema-steps",
    "2",
]
ACC = r"^ \* {label}Acc@1 ([\d.]+)  Acc@5 ([\d.]+)  Loss ([\d.]+)  \((\d+) images\)$"
RECIPE_LINE = "recipe: tv-v2 (torchvision's ResNet-50 V2 recipe, published 80.86% acc@1, not measured here)"


def accuracy_lines(output, label=""):
    return re.findall(ACC.format(label=label + " " if label else ""), output, re.MULTILINE)


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory):
    """--preset tv-v2 under torchrun with 2 processes, then -e (train_dp.py) of its checkpoint: (output dir, the
    two outputs)."""
    root = tmp_path_factory.mktemp("recipe")
    data = make_image_folder(root / "data", train_per_class=16, val_per_class=4)
    outputs = {}
    for name, command in [
        ("ddp", torchrun_command("train_ddp.py", 2, *RECIPE, "--data", data, "--output-dir", root / "ddp")),
        (
            "evaluate",
            [
                PYTHON,
                REPO / "train_dp.py",
                *RECIPE,
                "--data",
                data,
                "--output-dir",
                root / "evaluate",
                "-e",
                "--resume",
                root / "ddp" / "checkpoint.pth",
            ],
        ),
    ]:
        returncode, outputs[name] = Job(command).finish()
        assert returncode == 0, outputs[name][-4000:]
    return root / "ddp", outputs


def test_the_tv_v2_preset_trains_to_the_end_evaluating_the_ema_beside_the_weights(recipe_runs):
    _, outputs = recipe_runs
    output = outputs["ddp"]
    assert RECIPE_LINE in output.splitlines()  # on --data: no word about the demo set
    assert re.search(
        r"^optimizer: SGD, lr 0\.01, momentum 0\.9, weight decay 2e-05 \(\d+ tensors\), "
        r"0 on norm layers \(40 tensors\)$",
        output,
        re.MULTILINE,
    ), output[:3000]
    decay = adjusted_decay(0.99998, 8, 2, 2)
    assert (
        f"model EMA: decay {decay:.8g} every 2 steps (--model-ema-decay 0.99998 adjusted as torchvision's "
        "train.py does for batch 8, 2 steps, 2 epochs)"
    ) in output
    assert f"Epoch: [1] [{STEPS}/{STEPS}]" in output
    assert [count for *_, count in accuracy_lines(output)] == ["12", "12"]
    assert [count for *_, count in accuracy_lines(output, "EMA")] == ["12", "12"]
    assert re.search(
        r"^done: best acc@1 [\d.]+, final acc@1 [\d.]+ \(EMA: best [\d.]+, final [\d.]+\)", output, re.MULTILINE
    )


def test_checkpoints_hold_the_ema_which_loads_with_weights_only_into_a_plain_torchvision_model(recipe_runs):
    out, _ = recipe_runs
    for name in ("checkpoint.pth", "model_best.pth"):
        saved = load(out / name)
        plain = torchvision.models.resnet18(num_classes=3)
        plain.load_state_dict(saved["model_ema"]["state_dict"])  # strict: no prefixes, no missing or extra keys
        with torch.no_grad():
            assert plain.eval()(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    saved = load(out / "checkpoint.pth")
    # An average, not a copy of the weights: after the warmup epoch, updates at global steps 6 (a copy), 8, 10.
    assert saved["model_ema"]["n_averaged"] == 3
    assert not torch.equal(saved["model_ema"]["state_dict"]["fc.weight"], saved["state_dict"]["fc.weight"])
    # The recipe's groups: no weight decay on BatchNorm.
    assert [group["weight_decay"] for group in saved["optimizer"]["param_groups"]] == [2e-5, 0.0]
    assert saved["args"]["ra_sampler"] and saved["args"]["mixup_alpha"] == 0.2 and saved["args"]["cutmix_alpha"] == 1.0


def test_summary_and_log_csv_report_the_weights_and_the_ema(recipe_runs):
    out, outputs = recipe_runs
    summary = json.loads((out / "summary.json").read_text())
    plain = [float(acc1) for acc1, *_ in accuracy_lines(outputs["ddp"])]
    ema = [float(acc1) for acc1, *_ in accuracy_lines(outputs["ddp"], "EMA")]
    assert summary["best_acc1"] == pytest.approx(max(plain), abs=1e-3)
    assert summary["final_acc1"] == pytest.approx(plain[-1], abs=1e-3)
    assert summary["best_ema_acc1"] == pytest.approx(max(ema), abs=1e-3)
    assert summary["final_ema_acc1"] == pytest.approx(ema[-1], abs=1e-3)
    with open(out / "log.csv", newline="") as file:
        header, *rows = list(csv.reader(file))
    assert header == CSV_FIELDS + EMA_FIELDS
    assert [float(row[header.index("ema_val_acc1")]) for row in rows] == pytest.approx(ema, abs=1e-3)


def test_evaluate_on_a_checkpoint_with_an_ema_evaluates_both_as_the_training_run_did(recipe_runs):
    """-e in one process on DDP's checkpoint prints what DDP printed after its last epoch, for the weights
    and for the EMA: every rank evaluated the EMA that rank 0 saved (its BatchNorm statistics broadcast)."""
    _, outputs = recipe_runs
    trained, evaluated = outputs["ddp"], outputs["evaluate"]
    assert "Epoch:" not in evaluated
    for label in ("", "EMA"):
        (line,) = accuracy_lines(evaluated, label)
        last = accuracy_lines(trained, label)[-1]
        assert line[0] == last[0] and line[1] == last[1] and line[3] == last[3], (label, line, last)
        assert float(line[2]) == pytest.approx(float(last[2]), rel=1e-5), (label, line, last)

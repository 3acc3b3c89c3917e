"""common/metrics.py: top-k hits, exact metric sums (named values too), progress lines; metrics whose state is summed
(a confusion matrix), kept by MetricSums beside the loss: the results computed from the summed state, numbers logged by
name, tensors written per epoch, the state of a partial epoch resumed so that the resumed run's metrics are those of
the run that never stopped."""

import json
import re
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from common import metrics
from common.errors import UsageError
from common.metrics import ConfusionMatrix, MetricSums, ProgressMeter, correct_counts
from common.trainer import Trainer
from unit.test_checkpoint import SMALL, TINY_NET, Crash, StopsAt, log_rows, started

# Four samples, four classes; per row the classes ranked by score are given in the comment.
SCORES = torch.tensor(
    [
        [0.9, 0.05, 0.03, 0.02],  # 0 > 1 > 2 > 3
        [0.1, 0.2, 0.3, 0.4],  # 3 > 2 > 1 > 0
        [0.3, 0.4, 0.2, 0.1],  # 1 > 0 > 2 > 3
        [0.25, 0.1, 0.6, 0.05],
    ]
)  # 2 > 0 > 1 > 3
TARGETS = torch.tensor([0, 2, 3, 0])
# top-1 hits: sample 0 only; top-2 hits: samples 0, 1, 3; top-3 hits: samples 0, 1, 3; top-4: all.


def test_correct_counts_counts_hits_per_k():
    counts = correct_counts(SCORES, TARGETS, topk=(1, 2, 3, 4))
    assert [int(count) for count in counts] == [1, 3, 3, 4]


def test_correct_counts_top5_counts_the_target_anywhere_in_the_top_5():
    # Eight classes; scores descend with the class index, so class k is ranked k+1.
    scores = torch.arange(8, 0, -1, dtype=torch.float32).repeat(4, 1)
    targets = torch.tensor([0, 4, 5, 7])  # ranks 1, 5, 6, 8: the first two are in the top 5
    assert [int(count) for count in correct_counts(scores, targets, topk=(1, 5))] == [1, 2]


def test_correct_counts_caps_k_at_the_number_of_classes():
    scores = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.3, 0.2]])
    targets = torch.tensor([0, 2])  # both ranked last of three: never top-1, always "top-5"
    hits1, hits5 = correct_counts(scores, targets, topk=(1, 5))
    assert int(hits1) == 0 and int(hits5) == 2


def test_metric_sums_summary_without_process_group_is_the_local_average():
    assert not (dist.is_available() and dist.is_initialized())
    sums = MetricSums(torch.device("cpu"))
    # Batch 1: mean loss 1.0 over 2 samples, both right.   Batch 2: mean loss 4.0 over 2, none right at top-1,
    # one within the top 5 of 6 classes.
    sums.update(torch.tensor(1.0), torch.tensor([[5.0, 0, 0, 0, 0, 0], [0, 5.0, 0, 0, 0, 0]]), torch.tensor([0, 1]))
    sums.update(torch.tensor(4.0), torch.tensor([[6.0, 5, 4, 3, 2, 1], [6.0, 5, 4, 3, 2, 1]]), torch.tensor([1, 5]))
    summary = sums.summary()
    assert summary["count"] == 4
    assert summary["loss"] == pytest.approx((1.0 * 2 + 4.0 * 2) / 4)
    assert summary["acc1"] == pytest.approx(50.0)
    assert summary["acc5"] == pytest.approx(75.0)
    assert sums.summary(reduce=False) == summary


def test_metric_sums_summary_of_nothing_is_zero_not_nan():
    summary = MetricSums(torch.device("cpu")).summary()
    assert summary == {"loss": 0.0, "acc1": 0.0, "acc5": 0.0, "count": 0}


def test_named_values_are_image_weighted_means_and_their_state_resumes_by_name():
    """A named value is a batch mean: its epoch value weighs each batch by its images. The sums of a stopped epoch
    (state_dict) carry on in a new MetricSums (load_state_dict), by name, a name first logged later included."""
    logits, target = torch.eye(3)[[0, 1]], torch.tensor([0, 1])
    first = MetricSums(torch.device("cpu"))
    first.update(torch.tensor(1.0), logits, target, {"margin": torch.tensor(2.0)})
    saved = first.state_dict()
    assert saved == {"loss": 2.0, "hits1": 2.0, "hits5": 2.0, "margin": 4.0, "count": 2.0}
    resumed = MetricSums(torch.device("cpu"))
    resumed.load_state_dict(saved)
    resumed.update(
        torch.tensor(3.0),
        torch.eye(3)[[2, 2, 2, 2]],
        torch.tensor([2, 2, 2, 0]),
        {"margin": 5.0, "new": torch.tensor([1.0])},
    )
    summary = resumed.summary()
    assert summary["count"] == 6 and summary["loss"] == pytest.approx((2 + 12) / 6)
    assert summary["margin"] == pytest.approx((4 + 20) / 6) and summary["new"] == pytest.approx(4 / 6)
    assert MetricSums.extra(summary, "train_") == {"train_margin": summary["margin"], "train_new": summary["new"]}


def test_a_logged_value_must_be_a_scalar_with_a_name_of_its_own():
    sums, logits, target = MetricSums(torch.device("cpu")), torch.eye(3)[[0]], torch.tensor([0])
    with pytest.raises(UsageError, match=r"logged value 'margin' has shape \[2\]: log a scalar"):
        sums.update(torch.tensor(1.0), logits, target, {"margin": torch.ones(2)})
    for name in ("loss", "hits1", "count", "acc1", "acc5", "images_per_second"):  # (acc1 replaced the run's, exit 0)
        with pytest.raises(UsageError, match=f"may not be named '{name}'"):
            sums.update(torch.tensor(1.0), logits, target, {name: 1.0})


def test_progress_meter_prints_one_line_with_images_per_second_and_eta(monkeypatch):
    # The meter's clock, injected: 2 s pass for the first 2 of 10 batches (8 s to go), however slow the machine.
    now = [1000.0]
    monkeypatch.setattr(metrics, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    lines = []
    progress = ProgressMeter(10, "Epoch: [3]", lines.append)
    now[0] += 2.0
    images_per_second = progress.display(1, {"loss": 0.5, "acc1": 75.0, "acc5": 100.0, "count": 100}, lr=0.1)
    assert len(lines) == 1 and "\n" not in lines[0]
    line = lines[0]
    assert line.startswith("Epoch: [3] [ 2/10]")
    assert "loss 0.5000" in line and "acc@1  75.00" in line and "acc@5 100.00" in line and "lr 0.1" in line
    assert re.search(r"\d+\.\d img/s", line)
    assert line.endswith("   50.0 img/s  eta 0:00:08")
    assert images_per_second == 50.0


pytestmark = pytest.mark.unit


def test_a_confusion_matrix_counts_true_against_predicted_and_gives_per_class_and_balanced_accuracy():
    metric = ConfusionMatrix(3)
    state = torch.zeros(metric.shape, dtype=torch.float64)
    logits = torch.eye(3)[[0, 0, 1, 2, 2, 2]]  # predicted: 0 0 1 2 2 2
    metric.update(state, logits, torch.tensor([0, 1, 1, 2, 2, 0]))
    metric.update(state, torch.eye(3)[[0]], torch.tensor([[0.5, 0.5, 0.0]]))  # soft labels: no true class, skipped
    results = metric.compute(state)
    assert results["confusion"].tolist() == [[1, 0, 1], [1, 1, 0], [0, 0, 2]]
    assert results["per_class_acc"].tolist() == pytest.approx([50.0, 50.0, 100.0])
    assert results["balanced_acc"] == pytest.approx(200 / 3)
    empty = ConfusionMatrix(3).compute(torch.tensor([[1.0, 0, 0], [0, 0, 0], [0, 0, 0]]))
    assert empty["balanced_acc"] == 100.0  # the mean over the classes that have images


def test_metric_sums_keep_a_metric_s_state_through_a_mid_epoch_checkpoint():
    """Half the batches, the state_dict a checkpoint holds, the other half on a resumed MetricSums: the results
    of all the batches at once. Numbers go to extra() (the logged values), tensors to tables()."""
    batches = [(torch.randn(4, 3), torch.randint(0, 3, (4,))) for _ in range(4)]
    whole, first, resumed = (MetricSums(torch.device("cpu"), {"cm": ConfusionMatrix(3)}) for _ in range(3))
    for index, (logits, target) in enumerate(batches):
        whole.update(torch.tensor(1.0), logits, target)
        (first if index < 2 else resumed).update(torch.tensor(1.0), logits, target)
        if index == 1:
            resumed.load_state_dict(first.state_dict())
    expected, got = whole.summary(), resumed.summary()
    assert torch.equal(expected["confusion"], got["confusion"]) and expected["balanced_acc"] == got["balanced_acc"]
    assert set(MetricSums.extra(got)) == {"balanced_acc"} and set(MetricSums.tables(got)) == {
        "per_class_acc",
        "confusion",
    }


class WithConfusion(Trainer):
    def build_metrics(self, split, classes):
        return {"confusion": ConfusionMatrix(len(classes))}

    def after_validation(self, epoch, results, label=""):
        self.seen = getattr(self, "seen", []) + [(epoch, label, results["confusion"].sum().item())]


class WithConfusionStopsAt(WithConfusion, StopsAt):
    pass


def test_a_run_with_a_metric_stopped_mid_epoch_logs_and_writes_what_the_uninterrupted_one_does(tmp_path):
    """log.csv's train_ and val_balanced_acc and metrics/SPLIT_epochE.json of a run crashed after a mid-epoch
    checkpoint and resumed equal the uninterrupted run's; after_validation saw each validation's summed results."""
    flags = [*SMALL, *TINY_NET, "--epochs", "2", "--checkpoint-interval", "2"]
    whole = started(*flags, "--output-dir", tmp_path / "whole", trainer=WithConfusion)
    whole.fit(whole.model, whole.model)
    assert whole.seen == [(0, "", 6), (1, "", 6)]  # 6 val images, each counted once
    evaluating = started(*flags, "-e", "--resume", tmp_path / "whole" / "checkpoint.pth", trainer=WithConfusion)
    evaluating.fit(evaluating.model, evaluating.model)
    assert evaluating.seen == [(-1, "", 6)]  # (-e: epoch -1, as documented; was 1, the weights' last epoch)
    WithConfusionStopsAt.stop_at = 5
    crashed = started(*flags, "--output-dir", tmp_path / "crashed", trainer=WithConfusionStopsAt)
    with pytest.raises(Crash):
        crashed.fit(crashed.model, crashed.model)
    resumed = started(*flags, "--output-dir", tmp_path / "crashed", "--resume", "auto", trainer=WithConfusion)
    assert (resumed.start_epoch, resumed.start_step) == (1, 1)
    resumed.fit(resumed.model, resumed.model)
    rows = log_rows(tmp_path / "whole")
    assert {"train_balanced_acc", "val_balanced_acc"} <= set(rows[0]) and rows == log_rows(tmp_path / "crashed")
    for name in ("train_epoch0", "val_epoch0", "train_epoch1", "val_epoch1"):
        tables = [json.loads((tmp_path / run / "metrics" / f"{name}.json").read_text()) for run in ("whole", "crashed")]
        assert tables[0] == tables[1] and set(tables[0]) == {"per_class_acc", "confusion"}, name
    assert sum(map(sum, tables[0]["confusion"])) == 6


def test_a_metric_s_results_must_have_names_of_their_own_and_be_numbers_or_tensors():
    class Named(ConfusionMatrix):
        def __init__(self, results):
            super().__init__(3)
            self.results = results

        def compute(self, state):
            return self.results

    logits, target = torch.eye(3), torch.arange(3)
    for results, line in [
        ({"loss": 1.0}, "metric 'cm' returned 'loss': that name is taken; name its results otherwise"),
        ({"x": "text"}, "metric 'cm' returned str for 'x': compute() returns {name: number or tensor}"),
    ]:
        sums = MetricSums(torch.device("cpu"), {"cm": Named(results)})
        sums.update(torch.tensor(1.0), logits, target)
        with pytest.raises(UsageError) as refused:
            sums.summary()
        assert str(refused.value) == line
    sums = MetricSums(torch.device("cpu"), {"cm": Named({"total": torch.tensor(3.0)})})
    sums.update(torch.tensor(1.0), logits, target)
    assert sums.summary()["total"] == 3.0 and MetricSums.extra(sums.summary()) == {"total": 3.0}  # a number, logged


def test_the_extra_metric_example_logs_the_training_confidence_under_mixup(tmp_path):
    """Its comment said "the confidence alone then", and it returned nothing: no train_confidence column."""
    from common.trainer import trainer_class

    example = trainer_class("examples.extra_metric:WithConfidence")
    run = started(*SMALL, *TINY_NET, "--mixup-alpha", "0.2", "--epochs", "1", "--output-dir", tmp_path, trainer=example)
    run.fit(run.model, run.model)
    row = log_rows(tmp_path)[0]
    assert 0 < float(row["train_confidence"]) <= 1 and "train_top5_error" not in row and row["val_top5_error"]

"""common/metrics.py: metrics whose state is summed (a confusion matrix), kept by MetricSums beside the loss: the
results computed from the summed state, numbers logged by name, tensors written per epoch, the state of a partial
epoch resumed so that the resumed run's metrics are those of the run that never stopped."""
import json

import pytest
import torch

from common.errors import UsageError
from common.meters import MetricSums
from common.metrics import ConfusionMatrix
from common.trainer import Trainer
from unit.test_state import SMALL, TINY_NET, Crash, StopsAt, log_rows, started

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
    assert set(MetricSums.extra(got)) == {"balanced_acc"} and set(MetricSums.tables(got)) == {"per_class_acc", "confusion"}


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
    for results, line in [({"loss": 1.0}, "metric 'cm' returned 'loss': that name is taken; name its results otherwise"),
                          ({"x": "text"}, "metric 'cm' returned str for 'x': compute() returns {name: number or tensor}")]:
        sums = MetricSums(torch.device("cpu"), {"cm": Named(results)})
        sums.update(torch.tensor(1.0), logits, target)
        with pytest.raises(UsageError) as refused:
            sums.summary()
        assert str(refused.value) == line
    sums = MetricSums(torch.device("cpu"), {"cm": Named({"total": torch.tensor(3.0)})})
    sums.update(torch.tensor(1.0), logits, target)
    assert sums.summary()["total"] == 3.0 and MetricSums.extra(sums.summary()) == {"total": 3.0}  # a number, logged

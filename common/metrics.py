"""Metrics that are not a mean over images: a state of counts (a confusion matrix, per-class counts) summed over
batches on the device and over ranks exactly, turned into results once summed (Trainer.build_metrics).

A metric is stateless itself: MetricSums holds its state (a float64 tensor of `shape`), sums it over the ranks
with the run's other sums, saves it in a mid-epoch checkpoint and restores it, as the loss's sum.
"""
import torch


class SummedMetric:
    """Subclass it: `shape` of the state, update() that adds a batch into it on the device (no value read back to
    the host: no .item(), no bincount, which sizes its result from the data), compute() that turns the state summed
    over all ranks into {name: result}. A number is shown on the progress and result lines and logged (train_NAME,
    val_NAME in log.csv and TensorBoard); a tensor (a vector, a matrix) is written to metrics/SPLIT_epochE.json."""
    shape = ()

    def update(self, state, logits, target):
        raise NotImplementedError

    def compute(self, state):
        raise NotImplementedError


class ConfusionMatrix(SummedMetric):
    """Counts of (true class, predicted class); its results: the matrix, each class's accuracy (recall; 0 for a
    class without images) and the balanced accuracy (their mean over the classes that have images), in percent.
    Its state is classes² numbers, summed over the ranks at each progress line: for 1000 classes, 8 MB."""

    def __init__(self, num_classes):
        self.num_classes, self.shape = num_classes, (num_classes, num_classes)

    def update(self, state, logits, target):
        # The trainer gives the class indices, unmixed: with --mixup-alpha / --cutmix-alpha the training matrix
        # counts the predictions on mixed images against their own image's class, as acc@1 does. Soft labels
        # given by other code have no single true class: left out.
        if target.ndim != 1:
            return
        cells = target * self.num_classes + logits.argmax(dim=1)
        state.view(-1).index_add_(0, cells, torch.ones_like(cells, dtype=state.dtype))

    def compute(self, state):
        images = state.sum(dim=1)
        per_class = 100.0 * state.diagonal() / images.clamp(min=1)
        present = images > 0
        balanced = per_class[present].mean().item() if present.any() else 0.0
        return {"balanced_acc": balanced, "per_class_acc": per_class, "confusion": state.long()}

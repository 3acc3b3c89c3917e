"""What a run measures: top-k hits, sums exact over the ranks (MetricSums), the progress lines; and metrics that are
not a mean over images but a state of counts (a confusion matrix) summed over batches and ranks, then turned into
results (Trainer.build_metrics). A metric is stateless: MetricSums holds its float64 state as it holds the loss's sum.
"""

import datetime
import time

import torch

from . import distributed
from .errors import UsageError


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


def correct_counts(output, target, topk=(1,)):
    """Number of samples whose target is among the k highest scores, for each k, as tensors; k is capped at the number
    of classes (acc@5 of a 3-class problem is acc@3)."""
    with torch.no_grad():
        maxk = min(max(topk), output.size(1))
        _, pred = output.topk(maxk, dim=1, largest=True, sorted=True)
        hits = pred.t().eq(target.view(1, -1))
        return [hits[: min(k, maxk)].any(dim=0).sum() for k in topk]


BUILT_IN = ("loss", "hits1", "hits5")  # the sums every run keeps, in this order
RUN_OWN = ("loss", "acc1", "acc5", "count", "images_per_second")  # a summary's values that are the run's own


class MetricSums:
    """The loss, top-1/top-5 hits and any named value (Trainer.train_step / evaluate_step), summed on the device without
    a host sync per step. A named value is a batch mean; its sum is weighted by the batch's images, so its epoch value
    is the mean over every image of every rank. `metrics` ({name: SummedMetric}, Trainer.build_metrics) keep states of
    their own here, summed alike. Values are read, and summed over the ranks, only by summary(); `base` holds the totals
    carried over from before a mid-epoch resume (load_state_dict)."""

    def __init__(self, device, metrics=None):
        self.device, self.names = device, list(BUILT_IN)
        self.sums = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        self.count = 0  # known on the host: no need to read it from the device
        self.base = {}
        self.metrics = dict(metrics or {})
        self.states = {
            name: torch.zeros(metric.shape, dtype=torch.float64, device=device) for name, metric in self.metrics.items()
        }

    def state_dict(self):
        """The totals over all ranks, by name (a collective), base included."""
        return self.totals()

    def load_state_dict(self, totals):
        """Start from the totals of a checkpoint's partial epoch (state_dict()), or none."""
        self.base = dict(totals or {})

    def update(self, loss, output, target, values=None):
        n = target.size(0)
        hits1, hits5 = correct_counts(output.detach(), target, topk=(1, 5))
        batch = {"loss": loss.detach().double() * n, "hits1": hits1.double(), "hits5": hits5.double()}
        for name, value in (values or {}).items():
            batch[name] = self._value(name, value) * n
        new = [name for name in batch if name not in self.names]
        if new:  # a name first returned now: its sum starts here
            self.names += new
            self.sums = torch.cat([self.sums, self.sums.new_zeros(len(new))])
        zero = self.sums.new_zeros(())
        self.sums += torch.stack([batch.get(name, zero) for name in self.names])
        for name, metric in self.metrics.items():
            metric.update(self.states[name], output.detach(), target)
        self.count += n

    def _value(self, name, value):
        """A named value (a scalar tensor or number) as a float64 scalar on the device."""
        if name in BUILT_IN or name in RUN_OWN:  # (an acc1 of one's own had replaced the run's, exit 0)
            raise UsageError(f"a logged value may not be named {name!r}: that name is the run's own")
        if not isinstance(value, torch.Tensor):
            try:
                number = float(value)  # (numpy's scalars and 0-d arrays too)
            except (TypeError, ValueError):  # (a word, None, a list: was a traceback)
                raise UsageError(
                    f"logged value {name!r} is a {type(value).__name__}: log a number or a scalar tensor"
                ) from None
            return torch.full((), number, dtype=torch.float64, device=self.device)  # (torch.tensor: a copy, a sync)
        if value.numel() != 1:
            raise UsageError(f"logged value {name!r} has shape {list(value.shape)}: log a scalar (the batch's mean)")
        return value.detach().reshape(()).to(self.device, torch.float64)

    def totals(self, reduce=True):
        """{name: sum, ..., "count": images}, over all ranks when `reduce` (a collective: every rank calls it;
        a name that only some ranks have logged counts 0 on the others)."""
        names = self.names
        if reduce:
            names = list(dict.fromkeys(name for names in distributed.all_gather_object(self.names) for name in names))
        index = {name: i for i, name in enumerate(self.names)}
        sums = torch.stack(
            [self.sums[index[name]] if name in index else self.sums.new_zeros(()) for name in names]
            + [self.sums.new_tensor(float(self.count))]
        )
        states = [self.states[name].flatten() for name in self.metrics]
        if reduce:  # one collective for the sums and the metrics' states
            flat = distributed.all_reduce_sum(torch.cat([sums, *states]))
            sums, states = flat[: len(sums)], list(flat[len(sums) :].split([state.numel() for state in states]))
        totals = dict(zip([*names, "count"], sums.tolist()))
        totals.update({name: state.view(self.states[name].shape).cpu() for name, state in zip(self.metrics, states)})
        if reduce:
            for name, value in self.base.items():
                totals[name] = totals.get(name, 0.0) + value
        return totals

    def summary(self, reduce=True):
        """{'loss', 'acc1', 'acc5', 'count', and each named value}: means over all ranks' images when `reduce`,
        else over this rank's."""
        totals = self.totals(reduce)
        results = {}
        for name, metric in self.metrics.items():
            results.update(_results(name, metric.compute(totals.pop(name)), taken=[*BUILT_IN, *totals, *results]))
        count = totals.pop("count")
        denominator = max(count, 1.0)
        summary = {
            "loss": totals.pop("loss") / denominator,
            "acc1": 100.0 * totals.pop("hits1") / denominator,
            "acc5": 100.0 * totals.pop("hits5") / denominator,
            "count": int(count),
        }
        summary.update({name: value / denominator for name, value in totals.items()})
        summary.update(results)
        return summary

    @staticmethod
    def extra(summary, prefix=""):
        """The named numbers of a summary(): all but the run's own and the metrics' tensors, each name after `prefix`
        (log.csv's train_)."""
        return {
            prefix + name: value
            for name, value in summary.items()
            if name not in RUN_OWN and isinstance(value, (int, float))
        }

    @staticmethod
    def tables(summary):
        """The metrics' tensor results of a summary() (a confusion matrix, per-class accuracies), by name."""
        return {name: value for name, value in summary.items() if isinstance(value, torch.Tensor)}


def _results(name, results, taken):
    """The results of metric `name`'s compute(): {result: number or tensor}, a 0-dim tensor as a number; a result
    named as a value the run has already, or of another type, is a UsageError."""
    if not isinstance(results, dict):
        raise UsageError(
            f"metric {name!r} returned {type(results).__name__}: compute() returns {{name: number or tensor}}"
        )
    checked = {}
    for key, value in results.items():
        if key in (*taken, *RUN_OWN):
            raise UsageError(f"metric {name!r} returned {key!r}: that name is taken; name its results otherwise")
        if isinstance(value, torch.Tensor) and value.ndim == 0:
            value = value.item()
        if not isinstance(value, (int, float, torch.Tensor)):
            raise UsageError(
                f"metric {name!r} returned {type(value).__name__} for {key!r}: compute() returns "
                "{name: number or tensor}"
            )
        checked[key] = value
    return checked


class ProgressMeter:
    """Prints `Epoch [e][i/n]  loss ..  acc@1 ..  img/s ..  eta ..` lines on rank 0; throughput and ETA count only the
    steps run since it started (a resumed epoch starts at `first_step` with `first_count` images in its sums)."""

    def __init__(self, num_batches, prefix, print_fn, first_step=0, first_count=0):
        self.num_batches, self.prefix, self.print_fn = num_batches, prefix, print_fn
        self.first_step, self.first_count = first_step, first_count
        self.start = time.perf_counter()

    def speed(self, batch, metrics):
        """(images/s, eta) after batch `batch` (0-based), counting only what ran since this meter started."""
        elapsed = time.perf_counter() - self.start
        images_per_second = (metrics["count"] - self.first_count) / elapsed if elapsed > 0 else 0.0
        steps_run = max(batch + 1 - self.first_step, 1)
        eta = datetime.timedelta(seconds=int(elapsed / steps_run * (self.num_batches - batch - 1)))
        return images_per_second, eta

    def display(self, batch, metrics, lr=None, speed=None, wait=None):
        """Print the line of batch `batch` (0-based); `speed`: what speed() measured, else measured now; `wait`:
        the input wait's text, after the images/s. Returns the images/s it shows."""
        images_per_second, eta = speed or self.speed(batch, metrics)
        done = batch + 1
        width = len(str(self.num_batches))
        parts = [
            f"{self.prefix} [{done:>{width}}/{self.num_batches}]",
            f"loss {metrics['loss']:.4f}",
            f"acc@1 {metrics['acc1']:6.2f}",
            f"acc@5 {metrics['acc5']:6.2f}",
        ]
        parts += [f"{name} {value:.4g}" for name, value in MetricSums.extra(metrics).items()]
        if lr is not None:
            parts.append(f"lr {lr:.4g}")
        parts += [f"{images_per_second:8.1f} img/s" + (f" ({wait})" if wait else ""), f"eta {eta}"]
        self.print_fn("  ".join(parts))
        return images_per_second

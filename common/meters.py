"""Top-k accuracy, averages and progress lines."""
import datetime
import time

import torch

from . import distributed


def correct_counts(output, target, topk=(1,)):
    """Number of samples whose target is among the k highest scores, for each k, as tensors.

    k is capped at the number of classes (acc@5 of a 3-class problem is acc@3)."""
    with torch.no_grad():
        maxk = min(max(topk), output.size(1))
        _, pred = output.topk(maxk, dim=1, largest=True, sorted=True)
        hits = pred.t().eq(target.view(1, -1))
        return [hits[:min(k, maxk)].any(dim=0).sum() for k in topk]


def accuracy(output, target, topk=(1,)):
    """Top-k accuracy in percent, as pytorch/examples' accuracy() returns it."""
    batch_size = target.size(0)
    return [count.float() * (100.0 / batch_size) for count in correct_counts(output, target, topk)]


class AverageMeter:
    """Running sum and average of a host number (times, sizes)."""

    def __init__(self, name, fmt=":f"):
        self.name, self.fmt = name, fmt
        self.reset()

    def reset(self):
        self.val = self.sum = self.avg = 0.0
        self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def __str__(self):
        return ("{name} {val" + self.fmt + "} ({avg" + self.fmt + "})").format(**self.__dict__)


class MetricSums:
    """Loss and top-1/top-5 hits summed on the device, without a host sync per step.

    Values are read (and summed over all ranks) only when `summary()` is called. `base` holds
    totals over all ranks carried over from before a mid-epoch resume: [loss, hits@1, hits@5, count]."""

    def __init__(self, device, base=None):
        self.sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, hits@1, hits@5
        self.count = 0  # known on the host: no need to read it from the device
        self.base = list(base) if base else [0.0, 0.0, 0.0, 0]

    def update(self, loss, output, target):
        n = target.size(0)
        hits1, hits5 = correct_counts(output.detach(), target, topk=(1, 5))
        self.sums += torch.stack([loss.detach().double() * n, hits1.double(), hits5.double()])
        self.count += n

    def totals(self, reduce=True):
        """[loss sum, hits@1, hits@5, count], over all ranks when `reduce` (a collective: every rank calls it)."""
        count = torch.tensor([float(self.count)], dtype=torch.float64, device=self.sums.device)
        sums = torch.cat([self.sums, count])
        if reduce:
            distributed.all_reduce_sum(sums)
            return [value + base for value, base in zip(sums.tolist(), self.base)]
        return sums.tolist()

    def summary(self, reduce=True):
        """{'loss', 'acc1', 'acc5', 'count'}: averages over all ranks when `reduce`, else this rank's."""
        loss, hits1, hits5, count = self.totals(reduce)
        denominator = max(count, 1.0)
        return {"loss": loss / denominator, "acc1": 100.0 * hits1 / denominator,
                "acc5": 100.0 * hits5 / denominator, "count": int(count)}


class ProgressMeter:
    """Prints `Epoch [e][i/n]  loss ..  acc@1 ..  img/s ..  eta ..` lines on rank 0.

    Throughput and ETA count only the steps run since this meter started (a resumed
    epoch starts at `first_step` with `first_count` images already in its sums)."""

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

    def display(self, batch, metrics, lr=None, speed=None):
        """Print the line of batch `batch` (0-based); `speed`: what speed() measured, else measured now.
        Returns the images/s it shows."""
        images_per_second, eta = speed or self.speed(batch, metrics)
        done = batch + 1
        width = len(str(self.num_batches))
        parts = [f"{self.prefix} [{done:>{width}}/{self.num_batches}]",
                 f"loss {metrics['loss']:.4f}", f"acc@1 {metrics['acc1']:6.2f}",
                 f"acc@5 {metrics['acc5']:6.2f}"]
        if lr is not None:
            parts.append(f"lr {lr:.4g}")
        parts += [f"{images_per_second:8.1f} img/s", f"eta {eta}"]
        self.print_fn("  ".join(parts))
        return images_per_second

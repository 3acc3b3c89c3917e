"""train_one_epoch and evaluate: the same code for DataParallel, DDP and spawn.

Neither reads a value back from the device per step: losses and hits add up
on the device (MetricSums) and are read, and summed over ranks, only when a
progress line is printed.
"""
import contextlib
import time

import torch
import torch.nn as nn

from .meters import MetricSums, ProgressMeter

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device, amp):
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AMP_DTYPES[amp])


class AutocastForward(nn.Module):
    """`module` whose forward runs under autocast with the --amp dtype in whichever thread calls it.

    Autocast's state is per thread. nn.DataParallel runs each replica in a thread of its own and
    re-enters autocast there with the device's default dtype (float16 on CUDA), so without this
    wrapper `--amp bf16` would compute the replicas in float16, unscaled (PyTorch's "AMP with
    DataParallel" recipe). It holds no state of its own: checkpoints save the bare module."""

    def __init__(self, module, device_type, amp):
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, AMP_DTYPES[amp]

    def forward(self, *args, **kwargs):
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def train_one_epoch(model, criterion, optimizer, scheduler, scaler, loader, device, epoch, args, print_fn,
                    metrics, first_step=0, after_step=None, mix=None, log_step=None):
    """Train on `loader`, whose batches are steps first_step, first_step+1, ... of the epoch
    (a resumed epoch starts part-way, with the metric sums it had). after_step(steps_done) may
    return True to stop early. Returns (the epoch's metrics over all ranks, stopped).

    mix(images, target, step), when given (--mixup-alpha / --cutmix-alpha), mixes the batch on the
    device before the forward and returns soft targets, which the loss is taken against (label
    smoothing applies to them too). The accuracy counts each image against its own, unmixed label.
    It mixes the batch this process holds: under DataParallel the whole global batch, under DDP this
    rank's shard of it (so DP and DDP differ by design once mixing is on).
    log_step(steps_done, values) receives, at each progress line, the values it shows (loss, running
    acc@1, lr, images/s): no extra read from the device."""
    model.train()
    total_steps = first_step + len(loader)
    counted_before = metrics.base[3]  # images of this epoch trained on before a resume
    progress = ProgressMeter(total_steps, f"Epoch: [{epoch}]", print_fn, first_step, counted_before)
    start = time.perf_counter()
    stopped = False
    for step, (images, target) in enumerate(loader, start=first_step):  # batches already on the device
        labels = target
        if mix is not None:
            images, labels = mix(images, target, step)  # rows of `labels` sum to 1
        with autocast(device, args.amp):
            output = model(images)
            loss = criterion(output, labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # the scaler is a no-op unless --amp fp16
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        metrics.update(loss, output, target)
        if (step + 1) % args.print_freq == 0 or step + 1 == total_steps:
            summary = metrics.summary()  # a collective, at the same steps on every rank
            lr, speed = optimizer.param_groups[0]["lr"], progress.speed(step, summary)
            if log_step is not None:  # before the line: whoever reads the line finds these logged
                log_step(step + 1, {"loss": summary["loss"], "acc1": summary["acc1"], "lr": lr,
                                    "images_per_second": speed[0]})
            progress.display(step, summary, lr=lr, speed=speed)
        if after_step is not None and after_step(step + 1):
            stopped = True
            break
    seconds = time.perf_counter() - start
    summary = metrics.summary()
    images = summary["count"] - counted_before
    summary["images_per_second"] = images / seconds if seconds > 0 else 0.0
    return summary, stopped


def evaluate(model, criterion, loader, device, args, print_fn, prefix="Test", label=""):
    """Metrics over this rank's shard, summed over all ranks: each image counted once. `label` names
    the model in the result line (" * EMA Acc@1 ..." for label "EMA").

    Ranks may hold different numbers of batches, so the progress lines show rank 0's
    shard alone and the only collective is the final sum."""
    model.eval()
    metrics = MetricSums(device)
    progress = ProgressMeter(len(loader), prefix, print_fn)
    with torch.inference_mode():
        for step, (images, target) in enumerate(loader):
            with autocast(device, args.amp):
                output = model(images)
                loss = criterion(output, target)
            metrics.update(loss, output.float(), target)
            if (step + 1) % args.print_freq == 0:
                progress.display(step, metrics.summary(reduce=False))
    summary = metrics.summary()
    print_fn(f" * {label + ' ' if label else ''}Acc@1 {summary['acc1']:.3f}  Acc@5 {summary['acc5']:.3f}  "
             f"Loss {summary['loss']:.6f}  ({summary['count']} images)")
    return summary

"""train_one_epoch and evaluate: the same code for DataParallel, DDP and spawn.

Neither reads a value back from the device per step: losses and hits add up
on the device (MetricSums) and are read, and summed over ranks, only when a
progress line is printed.
"""
import contextlib
import time

import torch

from .meters import MetricSums, ProgressMeter


def autocast(device, amp):
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def to_device(images, target, device, channels_last):
    images = images.to(device, non_blocking=True)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, target.to(device, non_blocking=True)


def train_one_epoch(model, criterion, optimizer, scheduler, scaler, loader, device, epoch, args, print_fn):
    """One pass over `loader`; returns the epoch's metrics summed over all ranks, with images/s."""
    model.train()
    metrics = MetricSums(device)
    progress = ProgressMeter(len(loader), f"Epoch: [{epoch}]", print_fn)
    start = time.perf_counter()
    for step, (images, target) in enumerate(loader):
        images, target = to_device(images, target, device, args.channels_last)
        with autocast(device, args.amp):
            output = model(images)
            loss = criterion(output, target)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # the scaler is a no-op unless --amp fp16
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        metrics.update(loss, output, target)
        if (step + 1) % args.print_freq == 0 or step + 1 == len(loader):
            summary = metrics.summary()  # a collective, at the same steps on every rank
            progress.display(step, summary, lr=optimizer.param_groups[0]["lr"])
    seconds = time.perf_counter() - start
    summary = metrics.summary()
    summary["images_per_second"] = summary["count"] / seconds if seconds > 0 else 0.0
    return summary


def evaluate(model, criterion, loader, device, args, print_fn, prefix="Test"):
    """Metrics over this rank's shard, summed over all ranks: each image counted once.

    Ranks may hold different numbers of batches, so the progress lines show rank 0's
    shard alone and the only collective is the final sum."""
    model.eval()
    metrics = MetricSums(device)
    progress = ProgressMeter(len(loader), prefix, print_fn)
    with torch.inference_mode():
        for step, (images, target) in enumerate(loader):
            images, target = to_device(images, target, device, args.channels_last)
            with autocast(device, args.amp):
                output = model(images)
                loss = criterion(output, target)
            metrics.update(loss, output.float(), target)
            if (step + 1) % args.print_freq == 0:
                progress.display(step, metrics.summary(reduce=False))
    summary = metrics.summary()
    print_fn(f" * Acc@1 {summary['acc1']:.3f}  Acc@5 {summary['acc5']:.3f}  "
             f"Loss {summary['loss']:.6f}  ({summary['count']} images)")
    return summary

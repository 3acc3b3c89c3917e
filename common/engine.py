"""train_one_epoch and evaluate: the same loops for DataParallel, DDP and spawn, around a Trainer's
train_step and evaluate_step (common/trainer.py).

Neither reads a value back from the device per step: losses, hits and named values add up
on the device (MetricSums) and are read, and summed over ranks, only when a
progress line is printed.
"""
import contextlib
import time

import torch
import torch.nn as nn

from .errors import UsageError
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


# Auxiliary heads' weights in the loss, by the type of output that carries them: torchvision's GoogLeNet and
# Inception v3 return these in training (their papers' weights: 0.3 for each of GoogLeNet's two, 0.4 for
# Inception's one). Another model's auxiliary outputs weigh its attribute `aux_loss_weight`, else AUX_WEIGHT.
AUX_WEIGHTS = {"GoogLeNetOutputs": 0.3, "InceptionOutputs": 0.4}
AUX_WEIGHT = 0.3


def split_output(output):
    """(main logits, [auxiliary logits], their weight or None) of a model's output: a tensor; a tuple or
    list (GoogLeNet's and Inception's named tuples) whose first element is the main logits; or a dict whose
    "logits" (or "out") entry is, the other tensors being auxiliary logits. None entries are skipped."""
    if isinstance(output, torch.Tensor):
        return output, [], None
    if isinstance(output, dict):
        key = next((key for key in ("logits", "out") if key in output), None)
        if key is None:
            raise UsageError(f"the model returned a dict without 'logits' or 'out' (keys {', '.join(map(str, output))}): "
                             "name the main output 'logits'")
        main, aux = output[key], [value for name, value in output.items() if name != key]
    elif isinstance(output, (tuple, list)) and output:
        main, aux = output[0], list(output[1:])
    else:
        raise UsageError(f"the model returned a {type(output).__name__}: return the logits as a tensor, a tuple "
                         "(logits, auxiliary logits, ...) or a dict with 'logits'")
    aux = [value for value in aux if value is not None]
    if not all(isinstance(value, torch.Tensor) for value in [main, *aux]):
        raise UsageError(f"the model's {type(output).__name__} holds {', '.join(type(v).__name__ for v in [main, *aux])}: "
                         "each output must be a tensor of logits")
    return main, aux, AUX_WEIGHTS.get(type(output).__name__)


def loss_with_aux(criterion, output, labels, aux_weight=None):
    """(loss, main logits): criterion on the main logits, plus each auxiliary head's criterion times its
    weight (split_output's, else `aux_weight`, else AUX_WEIGHT), as torchvision's GoogLeNet / Inception v3
    are trained."""
    main, aux, weight = split_output(output)
    loss = criterion(main, labels)
    weight = weight if weight is not None else (aux_weight if aux_weight is not None else AUX_WEIGHT)
    for logits in aux:
        loss = loss + weight * criterion(logits, labels)
    return loss, main


def step_result(result, method):
    """(loss, output, values) of what train_step / evaluate_step returned: (loss, output) or (loss, output,
    {name: scalar})."""
    if isinstance(result, tuple) and len(result) in (2, 3) and isinstance(result[0], torch.Tensor):
        loss, output, values = (*result, {}) if len(result) == 2 else result
        if isinstance(output, torch.Tensor) and isinstance(values, dict):
            return loss, output, values
    raise UsageError(f"{method} returned {type(result).__name__}"
                     + (f" of {', '.join(type(part).__name__ for part in result)}" if isinstance(result, tuple) else "")
                     + ": return (loss, logits) or (loss, logits, {name: scalar value})")


def train_one_epoch(trainer, model, loader, epoch, metrics, first_step=0, after_step=None, mix=None, log_step=None):
    """Train on `loader`, whose batches are steps first_step, first_step+1, ... of the epoch (a resumed
    epoch starts part-way, with the metric sums it had): trainer.train_step(model, images, labels) under
    autocast, then trainer.optimizer_step(loss). after_step(steps_done) may return True to stop early.
    Returns (the epoch's metrics over all ranks, stopped).

    mix(images, target, step), when given (--mixup-alpha / --cutmix-alpha), mixes the batch on the
    device before the forward and returns soft targets, which the loss is taken against (label
    smoothing applies to them too). The accuracy counts each image against its own, unmixed label.
    It mixes the batch this process holds: under DataParallel the whole global batch, under DDP this
    rank's shard of it (so DP and DDP differ by design once mixing is on).
    log_step(steps_done, values) receives, at each progress line, the values it shows (loss, running
    acc@1, named values, lr, images/s): no extra read from the device."""
    args, device = trainer.args, trainer.runtime.device
    model.train()
    total_steps = first_step + len(loader)
    counted_before = metrics.base.get("count", 0)  # images of this epoch trained on before a resume
    progress = ProgressMeter(total_steps, f"Epoch: [{epoch}]", trainer.log.print, first_step, counted_before)
    start = time.perf_counter()
    stopped = False
    for step, (images, target) in enumerate(loader, start=first_step):  # batches already on the device
        labels = target
        if mix is not None:
            images, labels = mix(images, target, step)  # rows of `labels` sum to 1
        with autocast(device, args.amp):
            loss, output, values = step_result(trainer.train_step(model, images, labels), "train_step")
        trainer.optimizer_step(loss)
        metrics.update(loss, output, target, values)
        if (step + 1) % args.print_freq == 0 or step + 1 == total_steps:
            summary = metrics.summary()  # a collective, at the same steps on every rank
            lr, speed = trainer.optimizer.param_groups[0]["lr"], progress.speed(step, summary)
            if log_step is not None:  # before the line: whoever reads the line finds these logged
                log_step(step + 1, {"loss": summary["loss"], "acc1": summary["acc1"], **MetricSums.extra(summary),
                                    "lr": lr, "images_per_second": speed[0]})
            progress.display(step, summary, lr=lr, speed=speed)
        if after_step is not None and after_step(step + 1):
            stopped = True
            break
    seconds = time.perf_counter() - start
    summary = metrics.summary()
    images = summary["count"] - counted_before
    summary["images_per_second"] = images / seconds if seconds > 0 else 0.0
    return summary, stopped


def evaluate(trainer, model, loader, prefix="Test", label=""):
    """Metrics of trainer.evaluate_step(model, images, target) over this rank's shard, summed over all
    ranks: each image counted once. `label` names the model in the result line (" * EMA Acc@1 ..." for
    label "EMA").

    Ranks may hold different numbers of batches, so the progress lines show rank 0's
    shard alone and the only collectives are the final sum's."""
    args, device, print_fn = trainer.args, trainer.runtime.device, trainer.log.print
    model.eval()
    metrics = MetricSums(device)
    progress = ProgressMeter(len(loader), prefix, print_fn)
    with torch.inference_mode():
        for step, (images, target) in enumerate(loader):
            with autocast(device, args.amp):
                loss, output, values = step_result(trainer.evaluate_step(model, images, target), "evaluate_step")
            metrics.update(loss, output.float(), target, values)
            if (step + 1) % args.print_freq == 0:
                progress.display(step, metrics.summary(reduce=False))
    summary = metrics.summary()
    extra = "".join(f"  {name} {value:.6g}" for name, value in MetricSums.extra(summary).items())
    print_fn(f" * {label + ' ' if label else ''}Acc@1 {summary['acc1']:.3f}  Acc@5 {summary['acc5']:.3f}  "
             f"Loss {summary['loss']:.6f}{extra}  ({summary['count']} images)")
    return summary

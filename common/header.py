"""The lines a run begins with: where it runs, on what data, which model and recipe, from which checkpoint, with
which optimizer, and where it writes; and summary.json's figures at its end. Every part a run uses is named here,
whoever built it (a registry that hides where a part comes from is not what we want: style.md)."""

import json
import os
import platform
import time
from pathlib import Path

import torch

from . import distributed, optim
from .config import RECIPES
from .device_loader import SyntheticOnDevice
from .errors import UsageError, replaces
from .fsdp import state_bytes
from .models import warn_slow_amp
from .run_dir import holds


def describe_environment(device, num_devices):
    """One line with versions and hardware, for the top of every run's output."""
    if device.type == "cuda":
        hardware = f"{num_devices} x {torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
    else:
        hardware = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return f"torch {torch.__version__}, python {platform.python_version()}, {hardware}"


def start_lines(trainer):
    """What every run says first, -e too: environment, data, presets, model, validation, recipe, resume."""
    config, runtime, data = trainer.config, trainer.runtime, trainer._data
    kept = (
        ", freed memory kept for the next step (--no-keep-freed-memory: glibc's defaults)"
        if runtime.host_memory_kept
        else ""
    )
    lines = [
        f"{runtime.mode}: world size {runtime.world_size}, {runtime.num_devices} device(s) per process, "
        f"{describe_environment(runtime.device, runtime.num_devices)}{kept}"
    ]
    source = (
        type(trainer).build_datasets.__qualname__
        if replaces(type(trainer), "build_datasets")
        else f"--dataset {config.dataset_fn}"
        if config.dataset_fn
        else config.data or "synthetic (--dummy)"
    )
    made = (
        "batches made on the GPU, no loader"
        if isinstance(trainer._train_batches, SyntheticOnDevice)
        else f"{data.train_loader.num_workers} loader worker(s) per process"
    )
    if config.decode == "gpu":
        on = "the GPU (nvJPEG)" if runtime.device.type == "cuda" else "the CPU, by the training process"
        made += f", JPEGs decoded, cropped and flipped on {on}: --decode gpu"
    lines.append(
        f"data: {source} ({len(data.classes)} classes, {len(data.train_loader.dataset)} train / "
        f"{len(data.val_loader.dataset)} val images, {made}), normalised with {data.normalisation}"
    )
    lines += describe_preset(config, data.first_image)
    if config.trainer:
        lines.append(f"trainer: {config.trainer}")
    hook = type(trainer).build_batch_transform
    if replaces(type(trainer), "build_batch_transform"):  # (the default's: the preset's and the flags' lines)
        lines.append(
            f"batch transform: {hook.__qualname__} (build_batch_transform), "
            f"{'seeded per batch' if trainer._batch_transform is not None else 'none'}"
        )
    source = None if trainer.resumed_from else config.weights or config.init_from and f"--init-from {config.init_from}"
    lines.append(
        f"model: {config.arch}"
        + (f" from {source}" if source else "")
        + f", {'channels_last' if trainer._channels_last else 'default'} memory format "
        f"(--channels-last {config.channels_last}), --amp {config.amp}"
        + (f"; changed for this data: {'; '.join(trainer._model_changes)}" if trainer._model_changes else "")
    )
    if config.val_preprocessing:
        lines.append(
            f"validation: resize {config.val_resize_size}, crop {config.val_crop_size}, "
            f"{config.val_interpolation}, label smoothing {config.label_smoothing:g} ({config.val_preprocessing}; "
            "their flags override)"
        )
    if config.preset:
        lines.append(recipe_line(config))
    if config.dummy and (config.auto_augment != "none" or config.random_erase > 0):
        lines.append(
            "note: --dummy images are synthetic tensors: --auto-augment and --random-erase are not applied, "
            "and images/s leaves out their cost (measure it with --data)"
        )
    if trainer.resumed_from and config.evaluate:
        done = f"{trainer.start_epoch} epoch(s)" + (f" and {trainer.start_step} step(s)" if trainer.start_step else "")
        lines.append(
            f"evaluating {trainer.resumed_from}"
            + (f": its weights after {done}" if trainer.start_epoch or trainer.start_step else "")
        )
    elif trainer.resumed_from:
        lines.append(
            f"resumed from {trainer.resumed_from} (epoch {trainer.start_epoch}"
            + (f", step {trainer.start_step})" if trainer.start_step else ")")
        )
        lines += _best_elsewhere(trainer)
    return lines


def _best_elsewhere(trainer):
    """A note where the run resumed another directory's checkpoint: its best epoch is not in this one."""
    here = trainer.config.output_dir
    if not trainer._best_acc1 or holds(here, trainer.resumed_from):
        return []
    return [
        f"note: the best acc@1 so far, {trainer._best_acc1:.2f}, is the resumed run's, whose model_best.pth stays in "
        f"its directory; {Path(here).resolve() / 'model_best.pth'} is written when an epoch here beats it"
    ]


def warnings(trainer):
    """Warnings (and notes) of what this run's flags cost or mean, where they apply."""
    config, runtime, found = trainer.config, trainer.runtime, []
    warn_slow_amp(config.amp, runtime.device, found.append)
    if config.compile and config.sync_bn:
        found.append(
            "warning: --compile with --sync-bn: SyncBatchNorm's collectives break the compiled graph at every "
            "BatchNorm layer, which costs most of what compiling gains"
            + (
                "; and with --activation-checkpointing, each unit recomputed outside the graph updates its BatchNorm "
                "statistics twice a step: leave out one of the three"
                if getattr(config, "activation_checkpointing", False) and not config.evaluate
                else ""
            )
        )
    if config.compile and config.res_schedule and not config.evaluate:
        found.append(
            "warning: --compile with --res-schedule: each new training size compiles another graph "
            "(seconds to minutes each)"
        )
    if config.evaluate and config.model_ema and trainer.ema is None:  # (was: the model's figures alone, without a word)
        found.append(
            f"note: --model-ema: {trainer.resumed_from or config.weights} has no EMA weights these scripts read"
        )
    risks = trainer._diagnostics.bf16_risks
    if risks:
        found.append(
            "warning: --amp bf16 on the CPU: torch's bf16 kernels may compute a wrong weight gradient (NaN or garbage, "
            "at times) for a convolution strided across an input 1 pixel wide, and the run would train on it: "
            + ", ".join(f"{name} ({kernel} kernel, {shape} input at {crop} px)" for name, kernel, shape, crop in risks)
            + "; train with --amp none, or at crops where their inputs are wider"
        )
    if config.ra_sampler and runtime.world_size < config.ra_reps and not config.evaluate:
        # Consecutive copies go to consecutive ranks; with fewer ranks than copies some share a batch.
        found.append(
            f"warning: --ra-sampler with {runtime.world_size} process(es) and --ra-reps {config.ra_reps}: "
            "copies of an image share a process's batch (and its BatchNorm statistics), so a step sees fewer "
            "different images; torchvision uses it only with several processes"
        )
    return found


def training_lines(trainer):
    """What a training run says before its first step: optimizer, scheduler, EMA, outputs."""
    config = trainer.config
    lines = [describe_optimizer(trainer.optimizer, config)]
    if config.grad_accum_steps > 1:
        lines.append(
            f"gradient accumulation: each optimizer step of global batch {config.batch_size} sums "
            f"{config.grad_accum_steps} micro-batches of {trainer._data.train_loader.batch_size} per process "
            "(the gradients synced over the ranks at the last); steps, the schedule, the EMA and checkpoints "
            "count optimizer steps"
        )
    loader, sampler = trainer._data.train_loader, trainer._data.train_sampler
    if loader.drop_last and not config.compile:
        last = sampler.num_samples % loader.batch_size
        lines.append(
            f"last batch: each epoch's last {last} image{'s' * (last > 1)} per process {'are' if last > 1 else 'is'} "
            "not trained on: a device would have a single image, and BatchNorm fails on one where it sees 1x1 "
            "activations (the model has BatchNorm layers)"
        )
    if hasattr(trainer.shard, "describe"):  # train_fsdp.py: the units and what a rank holds
        lines += trainer.shard.describe(trainer.model, trainer.optimizer)
    if not isinstance(trainer.scheduler, optim.LrSchedule):
        lines.append(
            f"lr scheduler: {type(trainer.scheduler).__name__} (build_scheduler), stepped every optimizer "
            "step, saved in the checkpoints; --lr-schedule, --warmup-epochs, --lr-min, --lr-step-unit, "
            "--lr-step-size and --lr-gamma apply only as it reads them"
        )
    if trainer.ema is not None:
        lines.append(
            f"model EMA: decay {trainer.ema.decay:.8g} every {config.model_ema_steps} steps (--model-ema-decay "
            f"{config.model_ema_decay:g} adjusted as torchvision's train.py does for batch {config.batch_size}, "
            f"{config.model_ema_steps} steps, {config.epochs} epochs)"
        )
    first, steps = trainer.steps_per_epoch - trainer.start_step, trainer.steps_per_epoch  # (a resumed epoch: its rest)
    lines += trainer._diagnostics.describe(range(first, first + steps * (config.epochs - trainer.start_epoch), steps))
    lines.append(f"output: {config.output_dir}")
    return lines


def run_summary(trainer, seconds, train, val, ema_val):
    """summary.json's figures: the run's metrics, speed, where it ran, and what it held."""
    config, runtime = trainer.config, trainer.runtime
    summary = {
        "mode": runtime.mode,
        "arch": config.arch,
        "epochs": config.epochs,
        "world_size": runtime.world_size,
        "devices_per_process": runtime.num_devices,
        "device": str(runtime.device),
        "best_acc1": trainer._best_acc1,
        "final_acc1": val["acc1"],
        "final_acc5": val["acc5"],
        "final_val_loss": val["loss"],
        "train_images_per_second": train["images_per_second"],
        "wall_seconds": round(seconds, 2),
        "torch": torch.__version__,
        "bad_images": len(trainer._bad_images.found),
    }
    if trainer.ema is not None:
        summary.update(
            best_ema_acc1=trainer._best_ema_acc1,
            final_ema_acc1=ema_val["acc1"],
            final_ema_acc5=ema_val["acc5"],
            ema_decay=trainer.ema.decay,
        )
    summary.update(trainer._diagnostics.summary())  # (which reads the last validation's GPU peak too)
    if runtime.device.type == "cuda":  # the most rank 0's devices held in the run, validations included
        summary["peak_memory_gib"] = round(trainer._diagnostics.run_peak / 2**10, 3)
    if hasattr(trainer.shard, "describe"):  # train_fsdp.py: what rank 0 holds, measured after the last step
        summary.update(
            zip(
                ("rank_0_parameter_bytes", "rank_0_gradient_bytes", "rank_0_optimizer_state_bytes"),
                state_bytes(trainer.model, trainer.optimizer),
            )
        )
    if config.compile:
        # Recompilations cost seconds to minutes each: a count that grows with the epochs is a bug.
        summary["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return summary


def trained_already(trainer, eval_model):
    """A relaunch of a run trained to --epochs: nothing to do, unless summary.json is missing (a failed write, a kill)
    or another length's: then the final weights (and the EMA's) are validated again to write it, with log.csv's last
    epoch's figures."""
    config, log = trainer.config, trainer.log
    if trainer.start_step:  # (mid-epoch past a lowered --epochs: its weights trained further than any epoch's end)
        raise UsageError(
            f"{trainer.resumed_from} stands at epoch {trainer.start_epoch} step {trainer.start_step}, past --epochs "
            f"{config.epochs}: a run is not taken back; give --epochs {trainer.start_epoch + 1} or more to finish it"
        )
    log.print(f"already trained {trainer.start_epoch} of --epochs {config.epochs}: nothing to do")
    path = Path(config.output_dir) / "summary.json"
    found = distributed.computed_by_rank_0(lambda: log.writes and _summary_epochs(path))
    if found == trainer.start_epoch or found is False:  # (False: not the writer rank's to write)
        return None
    what = "is missing" if found is None else f"is of {found} epochs' run"
    log.print(f"{path} {what}: the final weights are validated to write it again")
    start, last = time.time(), log.last_row()
    val = trainer.evaluate(eval_model)
    ema_val = trainer.evaluate(trainer.ema.module, label="EMA") if trainer.ema is not None else None
    trainer._diagnostics.last = {name: last.get(name) for name in ("tflops_per_device", "mfu_pct")}
    trainer._diagnostics.run_peak = max(trainer._diagnostics.run_peak, last.get("gpu_peak_allocated_mib") or 0)
    summary = run_summary(
        trainer, time.time() - start, {"images_per_second": last.get("images_per_second")}, val, ema_val
    )
    summary["epochs"] = trainer.start_epoch  # (the weights' epochs, where --epochs was lowered)
    log.finish(summary)
    log.print(f"done: best acc@1 {trainer._best_acc1:.2f}, final acc@1 {val['acc1']:.2f}; {path} written")
    return summary


def _summary_epochs(path):
    """The epochs summary.json at `path` says its run trained, or None where there is no such file to read."""
    try:
        return json.loads(path.read_text()).get("epochs")
    except (OSError, ValueError, AttributeError):
        return None


# The hyperparameters the header names, where an optimizer has them.
DESCRIBED = ("momentum", "nesterov", "betas", "alpha", "eps")


def describe_optimizer(optimizer, config):
    """One header line: the optimizer's class and its own settings, the lr (each group's, where they differ; how
    --lr-scaling got it), the weight decay of each group, and --clip-grad-norm."""
    lrs = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
    lr = f"lr {lrs[0]:g}" if len(set(lrs)) == 1 else f"lr by parameter group {', '.join(f'{value:g}' for value in lrs)}"
    if config.lr_scaling == "linear":
        scaled = f"{config.lr_given:g} x {config.batch_size}/{config.lr_reference_batch}"
        lr += f" ({config.lr_source} {scaled}, --lr-scaling linear)"
    settings = []
    for name in DESCRIBED:
        value = optimizer.defaults.get(name)
        if name == "nesterov":
            settings += ["nesterov"] if value else []
        elif value is not None and not (name == "momentum" and value == 0 and type(optimizer).__name__ != "SGD"):
            settings.append(
                f"{name} {', '.join(f'{v:g}' for v in value) if isinstance(value, tuple) else f'{value:g}'}"
            )
    where = {
        "norm": " on norm layers" if config.bias_weight_decay is None else " on norm weights",
        "bias": " on biases",
    }
    decay = ", ".join(
        f"{group.get('weight_decay', 0):g}{where.get(group.get('name'), '')}"
        + (f" ({len(group['params'])} tensors)" if len(optimizer.param_groups) > 1 else "")
        for group in optimizer.param_groups
    )
    clip = f", gradients clipped to norm {config.clip_grad_norm:g}" if config.clip_grad_norm else ""
    return f"optimizer: {type(optimizer).__name__}, {', '.join([lr, *settings])}, weight decay {decay}{clip}"


def recipe_line(config):
    """The header's line of --preset: its name, and what of it this run does not take."""
    demo = "; on the demo set its epochs, batch, lr and image sizes stay the demo's"
    warmup = RECIPES[config.preset]["scale"].get("warmup_epochs", 0) if config.dataset != "demo" else 0
    short = config.warmup_epochs == 0 and warmup >= config.epochs  # (was dropped without a word)
    return (
        f"recipe: {config.preset} ({RECIPES[config.preset]['name']})"
        + (demo if config.dataset == "demo" else "")
        + (f"; its {warmup:g}-epoch warmup does not fit --epochs {config.epochs}" if short else "")
    )


def describe_preset(config, first_image=None):
    """Header lines: which dataset preset set which defaults of this run, and why; a warning where the
    ImageNet preset's crop is far larger than the images (first_image: (channels, height, width, dtype))."""
    names = {
        "epochs": "{} epochs",
        "batch_size": "-b {}",
        "lr": "lr {:g}",
        "train_crop_size": "{} px crops",
        "val_resize_size": "val resize {}",
        "val_crop_size": "val crop {}",
        "lr_schedule": "{} schedule",
    }
    if config.res_schedule:  # (its crops, not the preset's: the schedule line says them)
        names.pop("train_crop_size")
    given = [text.format(getattr(config, name)) for name, text in names.items() if name in config.from_data_preset]
    if not given:
        return []
    why = (
        "the built-in demo set"
        if config.data_preset == "demo"
        else "the default for --data, --dataset, --dummy and a --trainer's build_datasets, made for ImageNet-sized "
        "images"
    )
    lines = [
        f"preset: {config.data_preset} ({why}) sets {', '.join(given)}; flags, the environment and --preset override it"
    ]
    crop = config.train_crop_size
    if first_image and "train_crop_size" in config.from_data_preset and 2 * min(first_image[1:3]) <= crop:
        height, width = first_image[1:3]
        lines.append(
            f"warning: the first training image is {width}x{height} px, the {config.data_preset} preset crops "
            f"{crop} px: for images this small give --train-crop-size, --val-resize-size and "
            f"--val-crop-size near {min(height, width)} (and --epochs, -b, --lr for your data)"
        )
    return lines

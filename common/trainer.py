"""The Trainer: the parts of a run, each built by a hook a researcher may override, and the loops that use them, read
top to bottom.

A script sets up its launch mode (process group, device, Runtime), makes a Trainer, starts the run (common/run.py),
wraps `trainer.model` its own way (DataParallel, DistributedDataParallel, or a `shard` for FSDP) and calls
`trainer.fit(train_model, eval_model)`. A run can stop at any step and go on from its last checkpoint as if it had not
stopped: the data order and augmentation are functions of (seed, epoch, index) alone, and checkpoints hold the rest
(common/checkpoint.py).
"""

import math
import sys
import time

import torch
import torch.nn as nn

from . import data, distributed, fsdp, models, optim, seeding
from .augment import batch_mix_key, build_batch_mix, transformed_batch
from .checkpoint import SingleFile, assemble, init_from
from .datasets import build_datasets
from .device_loader import device_batches, validation_batches
from .diagnostics import Diagnostics, check_finite
from .errors import Preempted, UsageError, import_named, returned, wrong_return
from .header import run_summary, start_lines, trained_already, training_lines, warnings
from .logger import RunLogger, epoch_row
from .metrics import MetricSums, ProgressMeter, SummedMetric
from .preemption import StopSignal
from .run_dir import holds

# What a Trainer holds for the library. A subclass may read the public ones (docs/adapting.md lists them, and when each
# is there) and assigns none of these: a hook that does is refused in one line (Trainer.__setattr__).
# fmt: off
PUBLIC_ATTRIBUTES = ("config", "runtime", "log", "shard", "start_epoch", "start_step", "resumed_from", "seed",
                     "classes", "channels", "steps_per_epoch", "per_process_batch", "model", "ema", "criterion",
                     "optimizer", "scheduler", "scaler")
PRIVATE_ATTRIBUTES = ("_checkpoints", "_best_acc1", "_best_ema_acc1", "_best_epoch", "_epoch_lr", "_resumed_totals",
                      "_stop_signal", "_output_lock", "_deterministic", "_bare_model_guard", "_resuming", "_data",
                      "_diagnostics", "_model_changes", "_aux_weight", "_channels_last", "_metrics",
                      "_criterion_parameters", "_batch_transform", "_rng", "_bad_images", "_train_batches",
                      "_val_batches", "_steps_done")
# The methods a subclass overrides (docs/adapting.md); another of the Trainer's that it defines, the header warns of.
HOOKS = ("add_arguments", "build_datasets", "build_transforms", "build_model", "shard_units", "build_criterion",
         "build_optimizer", "build_scheduler", "build_metrics", "build_batch_transform", "state_dict",
         "load_state_dict", "after_validation", "train_step", "optimizer_step", "clip_gradients", "evaluate_step")
# fmt: on
OWNED = frozenset(PUBLIC_ATTRIBUTES + PRIVATE_ATTRIBUTES)


def trainer_class(name):
    """Trainer, or the subclass that --trainer package.module:Class names."""
    found = import_named(name, "--trainer", builtin=False) if name else Trainer
    if not (isinstance(found, type) and issubclass(found, Trainer)):
        raise UsageError(f"--trainer {name} is not a subclass of common.trainer.Trainer")
    return found


class Trainer:
    """A training run: the hooks below (add_arguments to after_validation) are what a researcher overrides in a
    subclass, selected with --trainer package.module:Class (docs/adapting.md); each gets what it uses as arguments,
    besides self.config (the frozen flags) and self.runtime (device, rank, world size). Trainer(config, runtime) has no
    side effects; build(datasets, seed) makes the parts; common/run.py's start_run does both for a script."""

    def __setattr__(self, name, value):
        if name in OWNED:  # assigned by a method of a subclass (not of common/): refused
            caller = sys._getframe(1)
            while caller.f_code.co_name == "__setattr__":  # (a subclass's own __setattr__ calling this one)
                caller = caller.f_back
            if not caller.f_globals.get("__name__", "").startswith("common.") and caller.f_locals.get("self") is self:
                raise UsageError(
                    f"{type(self).__name__} assigns self.{name}, which the Trainer holds for itself "
                    "(docs/adapting.md lists its attributes): give yours another name"
                )
        object.__setattr__(self, name, value)

    def __init__(self, config, runtime, shard=None, checkpoints=None):
        self.config, self.runtime = config, runtime
        # train_fsdp.py's shard (common/fsdp.py) and sharded checkpoints; else whole models and single-file checkpoints.
        self.shard, self._checkpoints = shard, checkpoints or SingleFile()
        self.log = RunLogger(
            config.output_dir,
            prints=runtime.is_main,
            writes=runtime.writes_checkpoints(config.save_on) and not config.evaluate,
        )
        # Where the run starts and what it carries on with (a resumed run: its checkpoint's, common/checkpoint.py).
        self.start_epoch, self.start_step, self._best_acc1, self._best_ema_acc1, self._best_epoch = 0, 0, 0.0, 0.0, None
        self._epoch_lr = self._resumed_totals = self.resumed_from = None
        self._stop_signal = StopSignal(config.stop_grace, listen=False)  # fit listens for stop signals
        self._output_lock, self._deterministic = None, config.deterministic  # the writer rank's lock, once started
        self._bare_model_guard, self._steps_done = None, 0  # (optimizer steps in the run: TensorBoard's x axis)

    # ---------------------------------------------------------------- the parts a researcher changes
    @classmethod
    def add_arguments(cls, parser):
        """Add this trainer's own flags to `parser` (an argparse group); they arrive in self.config."""

    def build_datasets(self):
        """(classes, train set, val set): class names, and two map-style datasets of (image, label), image a PIL image
        or a CHW tensor (uint8, or float in 0-1), label an int; the default: the flags' data. A train set's `mean` and
        `std` attributes normalise images that are not ImageNet-like (else --mean / --std)."""
        return build_datasets(self.config)

    def build_transforms(self, train, val):
        """(train, val): the per-image transforms, given the flags' defaults to extend or replace (docs/adapting.md):
        `train.then(t, ...)` adds torchvision transforms after the flip, seeded per image by (seed, epoch, index). Each
        (and one that replaces a default) is called as t(image) on a uint8 CHW tensor (float in 0-1 for such
        datasets), normalised after. A replaced `train` is refused with the flags only the default applies."""
        return train, val

    def build_model(self, classes):
        """The bare model for the class names `classes` (on the CPU; the base class moves it to the device and
        wraps it). Its forward may return logits, or (logits, auxiliary logits, ...) / {"logits": ..., ...}
        (models.loss_with_aux)."""
        config = self.config
        return models.build_model(config.arch, len(classes), config.pretrained, config.dropout, config.weights)

    def shard_units(self, model):
        """train_fsdp.py: the submodules of the bare `model` that FSDP shards one by one before the root (each is
        gathered whole only while it computes). The default: the model's blocks (common/fsdp.py's rule)."""
        return fsdp.default_units(model)

    def build_criterion(self):
        """The loss on (logits, labels), labels class indices or (--mixup-alpha / --cutmix-alpha) probabilities. Its
        parameters are trained with the model's (their own group: --lr, no weight decay, unless build_optimizer puts
        them in one), their gradients averaged over the ranks; its state_dict is saved in every checkpoint."""
        return nn.CrossEntropyLoss(label_smoothing=self.config.label_smoothing)

    def build_optimizer(self, model):
        """The optimizer over `model`'s parameters (--opt, --lr, --wd, their weight-decay groups). Groups of their
        own lr keep it: the schedule multiplies each group's lr, on resume too."""
        return optim.build_optimizer(model, self.config)

    def build_scheduler(self, optimizer, steps_per_epoch):
        """The lr scheduler, stepped once per optimizer step (`steps_per_epoch` of them an epoch); its state_dict
        is saved in every checkpoint and loaded on resume. The default: --lr-schedule (optim.LrSchedule)."""
        return optim.build_scheduler(optimizer, self.config, steps_per_epoch)

    def build_metrics(self, split, classes):
        """{name: SummedMetric} (common/metrics.py) kept beside the loss and accuracy in `split` ("train" or "val") for
        the class names `classes`: numbers logged as SPLIT_NAME, tensors written to metrics/SPLIT_epochE.json, states
        summed over the ranks exactly and checkpointed mid-epoch. The default: none."""
        return {}

    def build_batch_transform(self, classes):
        """The transform of each training micro-batch, or None: transform(images, labels, key) -> (images, labels),
        labels class indices in, indices or probabilities out; `key`, an int of (seed, epoch, batch, rank), seeds its
        draws (`with common.augment.seeded(key):`). Accuracy counts the labels before it. The default: --mixup-alpha /
        --cutmix-alpha's BatchMix, else None."""
        return build_batch_mix(self.config, len(classes), self.runtime.world_size)

    def state_dict(self):
        """Your subclass's own state: a dict of plain data and tensors (torch.load(..., weights_only=True) reads it),
        rank 0's, saved in every checkpoint. The default: none."""
        return {}

    def load_state_dict(self, state):
        """Given on every rank what state_dict returned, when a run resumes (after build, before training)."""

    def after_validation(self, epoch, results, label=""):
        """Called on every rank after each validation (label "EMA": of the EMA's weights) with its results summed over
        all ranks: loss, acc1, acc5, count, each named value and each metric's results (tensors too). `epoch`: the
        epoch trained, as log.csv counts it (-e: -1). The default does nothing."""

    def train_step(self, model, images, labels):
        """One batch's forward, under autocast: (loss, logits) or (loss, logits, {name: value}), each value a scalar
        (the batch's mean) summed over ranks exactly and logged as train_NAME. The loop does the rest: backward,
        clipping, the optimizer and scheduler steps; accuracy counts the logits against the unmixed labels."""
        return models.loss_with_aux(self.criterion, model(images), labels, self._aux_weight)

    def optimizer_step(self, model, closure):
        """The optimizer step, from the step's gradients averaged over its micro-batches and the ranks: clipping
        (clip_gradients), then the optimizer through the fp16 scaler. `closure()` zeroes the gradients and runs the
        step's forwards and backwards again, returning its loss over all ranks (SAM: a second gradient)."""
        self.clip_gradients()
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def clip_gradients(self):
        """--clip-grad-norm: the gradients' total norm (the model's and the criterion's, unscaled first under --amp
        fp16) clipped to it. Nothing without the flag."""
        if self.config.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            # Sharded gradients (DTensors): the norm is taken over all shards, each rank clips its own.
            parameters = [*self.model.parameters(), *self._criterion_parameters]
            nn.utils.clip_grad_norm_(parameters, self.config.clip_grad_norm)

    def evaluate_step(self, model, images, target):
        """One validation batch's forward (eval mode, no grad, autocast): (loss, logits) or (loss, logits,
        {name: value}); values as train_step's, logged as val_NAME."""
        output, _, _ = models.split_output(model(images))
        return self.criterion(output, target), output

    # ---------------------------------------------------------------- building
    def build(self, datasets, seed, resuming=False):
        """The run's parts from `datasets` ((classes, train set, val set), as build_datasets gives them) and `seed`,
        through the hooks above; no lock, no collective, no file read but the datasets' first items (`resuming`: nor
        --init-from's file, a checkpoint's weights being loaded after). Returns self."""
        config, runtime, device = self.config, self.runtime, self.runtime.device
        self.seed, self._resuming = seed, resuming
        seeding.seed_all(seed)  # the same on every rank: the same initial weights (then seed_this_rank)
        self._data = data.build_data(config, datasets, seed, runtime, self.build_transforms)
        self.classes = self._data.classes
        self.per_process_batch = data.per_process_batch(config.batch_size, runtime.world_size)
        self.channels = self._data.first_image[0] if self._data.first_image else 3  # (of the images)
        self._diagnostics = Diagnostics(config, runtime, self.log.print)
        model = self._model_on_device()
        self._data = data.last_batch_for(self._data, model, runtime.num_devices)
        # An optimizer step: --grad-accum-steps micro-batches of the loader (the epoch's last step: what is left).
        self.steps_per_epoch = math.ceil(len(self._data.train_loader) / config.grad_accum_steps)
        self.ema = None
        if config.model_ema and not config.evaluate:  # a copy of the bare model (a sharded one cannot be copied)
            decay = models.adjusted_decay(
                config.model_ema_decay, config.batch_size, config.model_ema_steps, config.epochs
            )
            self.ema = models.ModelEma(model, decay, config.model_ema_steps, config.warmup_epochs)
        self.model = self._sharded(model)
        if self.ema is not None:
            self._sharded(self.ema.module)
        seeding.seed_this_rank(seed, runtime.rank, runtime.devices)
        criterion = "an nn.Module (nn.CrossEntropyLoss(), not F.cross_entropy: its state is checkpointed)"
        self.criterion = returned(self.build_criterion(), nn.Module, "build_criterion()", criterion).to(device)
        self._metrics = {split: self._built_metrics(split) for split in ("train", "val")}
        self.optimizer = self._built_optimizer()
        self._criterion_parameters = self._train_criterion(self.optimizer)
        self.scheduler = self._built_scheduler()
        self.scaler = torch.amp.GradScaler(device.type, enabled=config.amp == "fp16")
        transform = self.build_batch_transform(self.classes)
        if transform is not None and not callable(transform):
            raise wrong_return(transform, "build_batch_transform(classes)", "a callable, or None")
        self._batch_transform = transform
        self._rng = seeding.RandomStreams(runtime.devices)
        self._bad_images = data.BadImageLog(runtime.rank, runtime.world_size)
        # On the CPU the loader workers normalise, unless the batches are decoded here (--decode gpu).
        on_device = self._data.normalise if device.type == "cuda" or config.decode == "gpu" else None
        self._train_batches, self._val_batches = (
            device_batches(
                loader,
                device,
                self._channels_last,
                report,
                on_device,
                keep_empty=self.shard is not None,
                undecodable="strict" if config.strict_data else undecodable,
            )
            for loader, report, undecodable in (
                (self._data.train_loader, self._bad_images.report, "end"),
                (self._data.val_loader, self._bad_images.report_validation, "skip"),
            )
        )
        return self

    def _model_on_device(self):
        """build_model's model for these classes, adapted to the data, on the device (not yet wrapped)."""
        config, device = self.config, self.runtime.device
        model = returned(self.build_model(self.classes), nn.Module, "build_model(classes)", "an nn.Module")
        # What was changed of a torchvision model for this data (the header says it): the pretrained heads
        # replaced for these classes (build_model; --init-from's here), the first convolution adapted to the channels.
        changes = [*getattr(model, "adaptations", [])]
        if config.init_from and not self._resuming:
            changes += init_from(model, config.init_from, config.arch, self.channels, len(self.classes))
        if models.built_by_library(model):  # (a model a subclass built is left as it is: built for the channels)
            pretrained = config.pretrained or bool(config.init_from)
            changes += models.adapt_first_conv(model, config.arch, self.channels, pretrained)
        self._model_changes = changes
        models.patch_embedding_as_matmul(model)
        train_sizes = config.crop_schedule.sizes() if config.res_schedule else [config.train_crop_size]
        crop, checked = config.val_crop_size, [] if config.evaluate else train_sizes  # (-e: no training)
        flops = models.check_input_size(model, config.arch, checked, crop, self.channels, len(self.classes))
        self._diagnostics.count_flops(model, self.channels, {crop: flops})  # (the check's count of crop: not again)
        self._aux_weight = getattr(model, "aux_loss_weight", None)
        if config.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # FSDP: parameters contiguous (no channels_last), and fully_shard moves each unit to the device as it shards it.
        self._channels_last = self.shard is None and models.use_channels_last(
            config.channels_last, device, config.amp, model
        )
        if self.shard:
            return model
        return model.to(device, memory_format=torch.channels_last if self._channels_last else None)

    def _built_metrics(self, split):
        """build_metrics(split, classes), checked: {name: SummedMetric}."""
        hook = f"build_metrics({split!r}, classes)"
        metrics = returned(self.build_metrics(split, self.classes), dict, hook, "a dict")
        for name, metric in metrics.items():
            returned(metric, SummedMetric, f"{hook}[{name!r}]", "a SummedMetric")
        return metrics

    def _built_optimizer(self):
        """build_optimizer(model), checked: an optimizer holding model parameters to train (else nothing would)."""
        trained = [parameter for parameter in self.model.parameters() if parameter.requires_grad]
        # Before build_optimizer: torch's optimizers refuse an empty list, in a traceback.
        if not self.config.evaluate and not trained:
            raise UsageError("the model (build_model) has no parameter to train: every one is frozen or it has none")
        optimizer = returned(
            self.build_optimizer(self.model), torch.optim.Optimizer, "build_optimizer(model)", "an optimizer"
        )
        held = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
        if not self.config.evaluate and not any(id(parameter) in held for parameter in trained):
            raise UsageError(
                "the optimizer (build_optimizer) holds none of the model's parameters: nothing would train (give it "
                "the `model` it is called with: model.parameters())"
            )
        return optimizer

    def _built_scheduler(self):
        """build_scheduler(optimizer, steps_per_epoch), checked (optim.checked_scheduler)."""
        return optim.checked_scheduler(self.build_scheduler(self.optimizer, self.steps_per_epoch))

    def _train_criterion(self, optimizer):
        """The criterion's trainable parameters, in `optimizer`: a group of their own unless build_optimizer put them
        in one. train_fsdp.py refuses them (fsdp.check_trained)."""
        parameters = [parameter for parameter in self.criterion.parameters() if parameter.requires_grad]
        if self.shard is not None:
            fsdp.check_trained(self.model, self.criterion, optimizer)
        held = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
        missing = [parameter for parameter in parameters if id(parameter) not in held]
        if missing:
            optimizer.add_param_group({"params": missing, "weight_decay": 0.0})
        return parameters

    def _sharded(self, model):  # train_fsdp.py: sharded in place, unit by unit
        return model if self.shard is None else self.shard(model, self.shard_units(model))

    def ema_for_evaluation(self):
        """A ModelEma to load a checkpoint's EMA weights into (-e): a copy of the model, or (sharded) another one."""
        if self.shard is None:
            return models.ModelEma(self.model, 0.0)
        ema = models.ModelEma(self._model_on_device(), 0.0)  # its own copy, sharded alike
        self._sharded(ema.module)
        return ema

    # ---------------------------------------------------------------- the loops
    def fit(self, train_model, eval_model):
        """Train from the start (or resumed) position to --epochs, validating and checkpointing each epoch (-e:
        validate once). `train_model` is the wrapped model (DataParallel, DDP), `eval_model` what validates."""
        config, log = self.config, self.log
        if config.compile:
            train_model, eval_model = (
                models.compiled(model, self.shard is not None) for model in (train_model, eval_model)
            )
        for line in [*warnings(self), *start_lines(self)]:
            log.print(line)
        if config.evaluate:
            self.evaluate(eval_model)
            if self.ema is not None:
                self.evaluate(self.ema.module, label="EMA")
            return None
        if self.start_epoch >= config.epochs:  # (summary.json written again where a failed write lost it)
            return trained_already(self, eval_model)
        for line in training_lines(self):
            log.print(line)
        log.start(
            config,
            # (another directory's checkpoint: this one's files start afresh)
            self.resumed_from is not None and holds(config.output_dir, self.resumed_from),
            ema=self.ema is not None,
            global_step=self._steps_done,
            epochs_done=self.start_epoch,
        )
        self._stop_signal = StopSignal(config.stop_grace)
        if self._output_lock is not None:  # a run started meanwhile waits for this one to stop
            self._stop_signal.on_first = self._output_lock.mark_stopping
        with self._diagnostics.watching():  # --profile's trace; out of memory: the allocator's snapshot
            summary = self._epochs(train_model, eval_model)
        self._stop_signal.close()  # (a run that stops or fails keeps its handlers to its process's end)
        return summary

    def _epochs(self, train_model, eval_model):
        """Each epoch: train, validate (and the EMA), checkpoint, log; then the run's summary."""
        config, wall_start = self.config, time.time()
        val = ema_val = {"acc1": 0.0, "acc5": 0.0, "loss": math.nan}
        train = {"images_per_second": 0.0}
        for epoch in range(self.start_epoch, config.epochs):
            epoch_start = time.time()
            train = self.train_one_epoch(train_model, epoch, self.start_step if epoch == self.start_epoch else 0)
            # BatchNorm statistics drift apart across ranks: validate and save rank 0's.
            distributed.broadcast_buffers(self.model)
            val = self.evaluate(eval_model, epoch=epoch)
            if self.ema is not None:  # its BatchNorm statistics average each rank's own: rank 0's too
                distributed.broadcast_buffers(self.ema.module)
                ema_val = self.evaluate(self.ema.module, label="EMA", epoch=epoch)
                self._best_ema_acc1 = max(ema_val["acc1"], self._best_ema_acc1)
            is_best = val["acc1"] > self._best_acc1
            self._best_acc1 = max(val["acc1"], self._best_acc1)
            if is_best:
                self._best_epoch = epoch + 1
            self._log_epoch(epoch, epoch_start, train, val, ema_val, self._bad_images.sync())  # (before the save)
            self.save(epoch + 1, is_best=is_best)
            if epoch + 1 < config.epochs and self._stop_agreed(now=True):
                self._stopped(epoch + 1, 0)  # asked to stop during validation: no step of the next epoch
        return self._finish(time.time() - wall_start, train, val, ema_val)

    def _log_epoch(self, epoch, epoch_start, train, val, ema_val, bad_images):
        """log.csv's row and the metrics' tables of `epoch` (`bad_images`: the ranks' unreadable files, pooled), written
        before the epoch's checkpoint: a run resumed from the checkpoint before drops them (Logger.start); written
        after it, a failed write or a kill in between lost the row for good."""
        ema_row = ema_val if self.ema is not None else None
        self.log.log_epoch(epoch_row(epoch, epoch_start, self._epoch_lr, train, val, ema_row, bad_images))
        self.log.write_tables(epoch, {"train": train, "val": val, **({"ema_val": ema_val} if self.ema else {})})

    def train_one_epoch(self, model, epoch, first_step=0):
        """Train `epoch` from `first_step` (a resumed epoch starts part-way); returns its metrics over all ranks. No
        value is read back from the device but at progress lines. A stop signal ends it after a step all ranks agree
        on, with a checkpoint (Preempted)."""
        metrics = self._start_epoch(model, epoch, first_step)
        counted_before, every = metrics.base.get("count", 0), self.config.checkpoint_interval
        progress = ProgressMeter(self.steps_per_epoch, f"Epoch: [{epoch}]", self.log.print, first_step, counted_before)
        start, batches = time.perf_counter(), self._optimizer_steps(self._diagnostics.timed(self._train_batches))
        for step, micro_batches in enumerate(batches, start=first_step):
            self.optimizer.zero_grad(set_to_none=True)
            self._forward_backward(model, micro_batches, epoch, step, metrics)  # (metrics: sums on the device)
            self.optimizer_step(model, lambda: self._forward_backward(model, micro_batches, epoch, step, zero=True))
            done, self._steps_done = step + 1, self._steps_done + 1
            if done % self.config.print_freq == 0 or done == self.steps_per_epoch:
                self._progress_line(progress, metrics, epoch, step)  # (its lr: the one this step used)
            self.scheduler.step()
            if self.ema is not None:
                self.ema.after_step(step, epoch, self.steps_per_epoch)  # (by step in the epoch, as a resumed run)
            self._diagnostics.after_step()  # (--profile)
            stop = self._stop_agreed()  # agreed over the ranks, the answer of the step before (no wait)
            if stop or (every and (epoch * self.steps_per_epoch + done) % every == 0 and done < self.steps_per_epoch):
                self.save(epoch, done, metrics)
            if stop:
                self._stopped(epoch, done)
        if self._stop_agreed(now=True):  # asked in the last steps: the checkpoint before validation, which may be long
            self.save(epoch, self.steps_per_epoch, metrics)
            self._stopped(epoch, self.steps_per_epoch)
        return self._epoch_summary(metrics, epoch, time.perf_counter() - start, counted_before)

    def _start_epoch(self, model, epoch, first_step):
        """The epoch's shuffle and augmentation seeds, the same on every rank (a resumed epoch skips the batches it had
        done), and its metric sums (a resumed epoch's: those it had); the model in training mode."""
        self._data.train_sampler.set_epoch(epoch, start=first_step * self.per_process_batch)
        self._data.train_loader.dataset.set_epoch(epoch)
        metrics = MetricSums(self.runtime.device, self._metrics["train"])
        if first_step:
            metrics.load_state_dict(self._resumed_totals)
        else:
            self._bad_images.next_epoch()
        if not first_step or self._epoch_lr is None:  # log.csv's lr: each group's at the epoch's first step
            self._epoch_lr = [group["lr"] for group in self.optimizer.param_groups]
        model.train()
        if self._bare_model_guard is None:  # (train_step given DDP: its bare model refused)
            self._bare_model_guard = models.BareModelGuard.around(model, self.model)
        self._diagnostics.start_epoch()
        return metrics

    def _epoch_summary(self, metrics, epoch, seconds, counted_before):
        """The epoch's metrics over all ranks (a collective), with its speed, diagnostics and, sharded, the state this
        rank holds (log.csv's train_sharded_state_mib: rank 0's, measured)."""
        summary = metrics.summary()
        trained = summary["count"] - counted_before  # (none: resumed after its last step, measured by an earlier run)
        summary["images_per_second"] = (trained / seconds if seconds > 0 else 0.0) if trained else None
        summary["diagnostics"] = self._diagnostics.epoch_figures(epoch, summary["images_per_second"]) if trained else {}
        if self.shard is not None:
            summary["sharded_state_mib"] = sum(fsdp.state_bytes(self.model, self.optimizer)) * 2**-20
        return summary

    def _optimizer_steps(self, batches):
        """Lists of the --grad-accum-steps micro-batches of each optimizer step (the epoch's last: what is left)."""
        batches, count = iter(batches), self.config.grad_accum_steps
        while micro_batches := [batch for _, batch in zip(range(count), batches)]:
            yield micro_batches

    def _forward_backward(self, model, micro_batches, epoch, step, metrics=None, zero=False):
        """The forwards (train_step) and backwards of one optimizer step's micro-batches, each loss weighted by its
        share of the images, the gradients synced at the last backward alone; metrics counted into `metrics`. `zero`
        (optimizer_step's closure): from zeroed gradients, returning the step's loss."""
        config, device, rank = self.config, self.runtime.device, self.runtime.rank
        if zero:
            self.optimizer.zero_grad(set_to_none=True)
        total, step_loss = sum(target.size(0) for _, target in micro_batches), 0.0
        for index, (images, target) in enumerate(micro_batches):
            labels = target
            if self._batch_transform is not None:  # MixUp / CutMix: soft labels, drawn from (seed, epoch, batch, rank)
                key = batch_mix_key(self.seed, epoch, step * config.grad_accum_steps + index, rank)
                images, labels = transformed_batch(self._batch_transform(images, target, key))
            share = target.size(0) / total if total else 1.0
            # (DDP decides at the forward whether the backward syncs: both inside)
            with models.gradient_sync(model, enabled=index == len(micro_batches) - 1):
                with models.autocast(device, config.amp), self._bare_model_guard:
                    loss, output, values = models.step_result(
                        self.train_step(model, images, labels), "train_step", len(self.classes)
                    )
                self.scaler.scale(loss * share if share != 1.0 else loss).backward()  # (the scaler: --amp fp16)
            if metrics is not None:
                metrics.update(loss, output, target, values)
            if zero:  # (the closure's)
                step_loss = step_loss + loss.detach() * share
        distributed.average_gradients(self._criterion_parameters)  # (DDP averages the model's alone)
        # (the closure's: the step's loss over all ranks, as DataParallel's, on which a line search branches)
        return distributed.weighted_mean(step_loss, total) if zero else step_loss

    def _progress_line(self, progress, metrics, epoch, step):
        """The progress line after `step`, its values logged first (whoever reads the line finds them logged)."""
        summary = metrics.summary()  # a collective, at the same steps on every rank (so is the input wait's)
        lr, speed = self.optimizer.param_groups[0]["lr"], progress.speed(step, summary)
        wait, said = self._diagnostics.input_wait()
        self.log.log_step(
            self._steps_done,
            {
                "loss": summary["loss"],
                "acc1": summary["acc1"],
                **MetricSums.extra(summary),
                "lr": lr,
                "images_per_second": speed[0],
                "input_wait_pct": wait,
            },
        )
        progress.display(step, summary, lr=lr, speed=speed, wait=said)
        if not math.isfinite(summary["loss"]):  # weights gone NaN stop the run now, as its next save would (every rank)
            check_finite(self, epoch, step + 1)

    def evaluate(self, model, label="", epoch=None):
        """The metrics of evaluate_step over this rank's shard of the val set, summed over all ranks: each image
        counted once. Ranks may hold different numbers of batches, so the progress lines show rank 0's shard alone
        and the only collectives are the final sum's. `label` names the model in the result line (" * EMA Acc@1").
        A validation that could not read its images ends the run in one line, the files in bad_images.txt."""
        config, device = self.config, self.runtime.device
        model.eval()
        metrics = MetricSums(device, self._metrics["val"])
        share = " (rank 0's share)" if self.runtime.world_size > 1 else ""  # (training's lines: all ranks')
        progress = ProgressMeter(len(self._val_batches), f"Test {label}".strip() + share, self.log.print)
        with torch.inference_mode() if self.shard is None else torch.no_grad():  # (FSDP's gather buffers: reused)
            shape = (self.channels, config.val_crop_size, config.val_crop_size)  # a sharded model's placeholder's
            batches = validation_batches(self._val_batches, self.shard is not None, shape)
            for step, (images, target, counted) in enumerate(batches):
                with models.autocast(device, config.amp):
                    loss, output, values = models.step_result(
                        self.evaluate_step(model, images, target), "evaluate_step", len(self.classes)
                    )
                if counted:
                    metrics.update(loss, output.float(), target, values)
                if (step + 1) % config.print_freq == 0:
                    progress.display(step, metrics.summary(reduce=False))
        summary = metrics.summary()
        extra = "".join(f"  {name} {value:.6g}" for name, value in MetricSums.extra(summary).items())
        self.log.print(
            f" * {label + ' ' if label else ''}Acc@1 {summary['acc1']:.3f}  Acc@5 {summary['acc5']:.3f}  "
            f"Loss {summary['loss']:.6f}{extra}  ({summary['count']} images)"
        )
        try:
            self._bad_images.check_validation(summary["count"], len(self._data.val_loader.dataset))
        except UsageError:
            self.log.write_bad_images(self._bad_images.sync())
            raise
        self.after_validation(
            -1 if config.evaluate else self.start_epoch - 1 if epoch is None else epoch, summary, label
        )
        return summary

    def save(self, epoch, step_in_epoch=0, metrics=None, is_best=False):
        """A checkpoint after `step_in_epoch` steps of `epoch` (0: the epoch before is complete), assembled by
        common/checkpoint.py. A collective: every rank calls it; the writer rank(s) write. Returns the epoch's
        unreadable files over all ranks."""
        with self._stop_signal.no_stop_now():
            check_finite(self, epoch, step_in_epoch)
            checkpoint = assemble(self, epoch, step_in_epoch, metrics)
            self._checkpoints.write(checkpoint, self.config.output_dir, is_best, self.log.writes)
            if self.log.writes:
                self.log.write_bad_images(checkpoint["bad_images"])
        return checkpoint["bad_images"]

    def _stop_agreed(self, now=False):
        """Whether the ranks agreed to stop (StopSignal.poll); once they have, the output directory's lock says that
        its run is stopping, so that the job that replaces it waits for it rather than being refused."""
        stop = self._stop_signal.poll(now=now)
        if stop and self._output_lock is not None:
            self._output_lock.mark_stopping(self._stop_reason)
        return stop

    _stop_reason = property(lambda self: self._stop_signal.received or "a signal to another rank")

    def _stopped(self, epoch, step):
        """The end of a run that a stop signal asked to stop, once its checkpoint at (epoch, step) is written."""
        self.log.print(
            f"stopped on {self._stop_reason}: checkpoint of "
            f"epoch {epoch} step {step} in {self.config.output_dir}; continue with --resume auto"
        )
        self._checkpoints.wait()  # --async-checkpoint: its write done
        distributed.barrier()  # no rank exits (and gets the others killed) before the save is done
        raise Preempted()

    def _finish(self, seconds, train, val, ema_val):
        """summary.json (header.run_summary), the last line, and the summary."""
        summary = run_summary(self, seconds, train, val, ema_val)
        if self.config.compile:
            self.log.print(f"torch.compile: {summary['compiled_graphs']} graph(s) compiled")
        self._checkpoints.wait()
        self.log.finish(summary)
        ema = f" (EMA: best {self._best_ema_acc1:.2f}, final {ema_val['acc1']:.2f})" if self.ema is not None else ""
        self.log.print(
            f"done: best acc@1 {self._best_acc1:.2f}, final acc@1 {val['acc1']:.2f}{ema} "
            f"in {summary['wall_seconds']:.0f} s; outputs in {self.config.output_dir}"
        )
        return summary

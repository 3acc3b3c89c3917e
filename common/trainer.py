"""Everything a run does once its processes and devices exist.

A script sets up its launch mode (process group, device, Runtime), builds a
Trainer (data sharded by rank, bare model on the device, optimizer, resumed
state), wraps `trainer.model` its own way (DataParallel or
DistributedDataParallel), and calls `trainer.fit(train_model, eval_model)`.

A run can stop at any step and go on from its last checkpoint as if it had not
stopped: checkpoints hold the position in the epoch, the partial epoch's
metric sums and every rank's RNG state; the data order and augmentation are
functions of (seed, epoch, index) alone.
"""
import os
import random
import time
from pathlib import Path

import torch
import torch.nn as nn

from . import agreement, checkpoint, distributed
from .args import RECIPES, ResSchedule, default_output_dir, describe_preset, flag
from .errors import Preempted, UsageError
from .augment import batch_mix_key, build_batch_mix
from .bad_images import BadImageLog
from .console import say
from . import data, models, schedule
from .data import DeviceLoader, build_data, loader_workers
from .ema import ModelEma, adjusted_decay
from .engine import evaluate, loss_with_aux, split_output, train_one_epoch
from .logger import RunLogger, describe_environment
from .meters import MetricSums
from .named import import_named
from .preemption import StopSignal


def trainer_class(name):
    """Trainer, or the subclass that --trainer package.module:Class names."""
    found = import_named(name or "", "--trainer") or Trainer
    if not (isinstance(found, type) and issubclass(found, Trainer)):
        raise UsageError(f"--trainer {name} is not a subclass of common.trainer.Trainer")
    return found


def per_process_batch(batch_size, world_size):
    """-b is the global batch: each of the world_size processes takes an equal share."""
    if batch_size % world_size:
        raise UsageError(f"--batch-size {batch_size} is the global batch and must divide evenly "
                         f"over {world_size} processes: use a multiple of {world_size}")
    return batch_size // world_size


def rng_state(devices):
    """This process's random streams: Python's, torch's CPU one and that of each GPU it drives, in the
    order of `devices` (the first is the one DataParallel gathers on; --gpus may name others on resume)."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": [torch.cuda.get_rng_state(device) for device in devices if device.type == "cuda"]}


def set_rng_state(state, devices):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    saved = state.get("cuda")
    if isinstance(saved, torch.Tensor):  # checkpoints before per-GPU states: the first GPU's
        saved = [saved]
    cuda = [device for device in devices if device.type == "cuda"]
    for device, device_state in zip(cuda, saved or []):  # more GPUs than saved: those keep their seeds
        torch.cuda.set_rng_state(device_state, device)


def seed_this_rank(seed, rank, devices):
    """Seed the random streams that dropout, stochastic depth and random erasing draw from with
    seed + rank (as timm does), once the model is built: every rank starts from the same weights
    but draws its own masks. (With one seed for all, every rank would drop the same units of its
    own images.) Under DataParallel, the replica on the k-th GPU draws from seed + k, as rank k
    would. Data order and augmentation do not use these streams (common/data.py)."""
    random.seed(seed + rank)
    torch.manual_seed(seed + rank)
    for k, device in enumerate(devices[1:], start=1):
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed + rank + k)


def set_determinism(deterministic):
    """--deterministic: deterministic kernels only (an error names any op that has none), cuBLAS with
    a fixed workspace, cuDNN without autotuning. Else cuDNN autotunes: fastest, not repeatable."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts
    torch.use_deterministic_algorithms(deterministic)
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic


def warn_slow_amp(amp, device, warn):
    """One warning where --amp computes slower than float32: on a CPU without native bf16/fp16
    instructions (emulated: about 40x slower here, docs/benchmarks.md), and bf16 on GPUs before
    Ampere (compute capability < 8.0), which emulate it."""
    if amp == "none":
        return
    if device.type == "cpu":
        native = (torch.ops.mkldnn._is_mkldnn_bf16_supported() if amp == "bf16"
                  else torch.ops.mkldnn._is_mkldnn_fp16_supported())
        if not native:
            warn(f"warning: --amp {amp} on this CPU ({torch.backends.cpu.get_cpu_capability()}), which has no "
                 f"native {amp} instructions: it is emulated and much slower than float32; leave out --amp here")
    elif amp == "bf16" and torch.cuda.get_device_capability(device) < (8, 0):
        warn(f"warning: --amp bf16 on {torch.cuda.get_device_name(device)} (compute capability "
             f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))} < 8.0) is emulated: "
             "use --amp fp16 on this GPU")


# Convolutional networks that channels_last does not make faster on the CPU (docs/benchmarks.md,
# measured on an idle machine: shufflenet_v2_x1_0 0.95-0.98x, its channel shuffle re-lays the whole
# activation; convnext_tiny 1.01x, its LayerNorms permute to NHWC and back anyway).
CHANNELS_LAST_NOT_FASTER = ("ShuffleNetV2", "ConvNeXt")


def use_channels_last(choice, device, amp, model):
    """--channels-last on/off, or for auto: on where it is measured faster (docs/benchmarks.md), that is
    for convolutional networks (two Conv2d layers or more; a vision transformer has one, its patch
    embedding) on the CPU (oneDNN's convolutions are fastest in NHWC) and on GPUs with --amp (tensor
    cores read NHWC); off on GPUs in float32, where cuDNN gains little, for the networks measured not
    to gain (CHANNELS_LAST_NOT_FASTER), and for other models."""
    if choice != "auto":
        return choice == "on"
    if type(model).__name__ in CHANNELS_LAST_NOT_FASTER:
        return False
    convolutional = sum(isinstance(module, nn.Conv2d) for module in model.modules()) >= 2
    return convolutional and (device.type == "cpu" or amp != "none")


class Trainer:
    """A training run. The parts a researcher changes are the methods below `add_arguments` (through
    `build_optimizer`'s scheduler, `train_step` and `evaluate_step`): override them in a subclass, and
    select it with --trainer package.module:Class (docs/adapting.md). Everything that keeps a run exact and
    resumable stays here: seeding, sharded and resumable sampling, exact validation, bad-file skipping,
    checkpoints, stops, AMP, clipping and logging.

    A script sets up its launch mode (process group, device, Runtime), builds a Trainer (data sharded by
    rank, bare model on the device, optimizer, resumed state), wraps `trainer.model` its own way
    (DataParallel or DistributedDataParallel), and calls `trainer.fit(train_model, eval_model)`."""

    @classmethod
    def add_arguments(cls, parser):
        """Add this trainer's own flags to `parser` (an argparse group); they arrive in self.args."""

    def build_datasets(self):
        """(classes, train set, val set): class names, and two map-style datasets whose items are (image,
        label), image a PIL image or a CHW tensor (uint8, or float in 0-1), label an int. The default reads
        what the flags name (--data folders or CSV, --dataset, --dummy, the demo set). Give the train set
        `mean` and `std` attributes for images that are not ImageNet-like (else --mean / --std)."""
        return data.build_datasets(self.args)

    def build_model(self, num_classes):
        """The bare model (on the CPU; the base class moves it to the device and wraps it). Its forward may
        return logits, or (logits, auxiliary logits, ...) / {"logits": ..., ...} (engine.loss_with_aux)."""
        args = self.args
        return models.build_model(args.arch, num_classes, args.pretrained, args.dropout, args.weights)

    def build_criterion(self):
        """The loss on (logits, labels) that train_step and evaluate_step take; labels may be class indices
        or (with --mixup-alpha / --cutmix-alpha) class probabilities."""
        return nn.CrossEntropyLoss(label_smoothing=self.args.label_smoothing)

    def build_optimizer(self, model):
        """The optimizer over `model`'s parameters (--opt, --lr, --wd, their weight-decay groups)."""
        return schedule.build_optimizer(model, self.args)

    def build_scheduler(self, optimizer):
        """The lr scheduler, stepped once per optimizer step. The default (--lr-schedule) is a function of the
        step alone, recomputed on resume; any other is saved in the checkpoint and loaded on resume."""
        return schedule.build_scheduler(optimizer, self.args, self.steps_per_epoch)

    def train_step(self, model, images, labels):
        """One batch's forward, under autocast: returns (loss, logits) or (loss, logits, {name: value}), each
        value a scalar (the batch's mean) that is summed over ranks exactly, shown, logged in log.csv as
        train_NAME and in TensorBoard, and resumed by name. The base class does backward, clipping, the
        optimizer and scheduler steps; the accuracy counts the logits against the unmixed labels."""
        return loss_with_aux(self.criterion, model(images), labels, self.aux_weight)

    def evaluate_step(self, model, images, target):
        """One validation batch's forward (eval mode, no grad, autocast): (loss, logits) or (loss, logits,
        {name: value}); values as train_step's, logged as val_NAME."""
        output, _, _ = split_output(model(images))
        return self.criterion(output, target), output

    def optimizer_step(self, loss):
        """Backward (scaled under --amp fp16), --clip-grad-norm on the unscaled gradients, the optimizer's and
        the scheduler's step. No value is read back from the device."""
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()  # the scaler is a no-op unless --amp fp16
        if self.args.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(self.model.parameters(), self.args.clip_grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()

    def __init__(self, args, runtime):
        self.args, self.runtime = args, runtime
        device = runtime.device
        distributed.check_sync_bn(args.sync_bn, device)
        args.output_dir = args.output_dir or default_output_dir(args, runtime.mode)
        writes = runtime.writes_checkpoints(args.save_on)
        self.log = RunLogger(args.output_dir, prints=runtime.is_main, writes=writes)
        self.output_lock, self.resume_path, resumed, error = None, None, None, None
        try:
            if writes and not args.evaluate:  # -e writes nothing
                # A restarted job (a Slurm requeue, torchrun's restart) may find the lock of the one it replaces
                # still held: by a lost node's file system lease, or while the old step writes its stop's checkpoint.
                restarted = any(os.environ.get(name, "0") not in ("", "0")
                                for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"))
                self.output_lock = checkpoint.OutputLock(
                    args.output_dir, wait=checkpoint.LOCK_WAIT_ON_RESTART if restarted else 0, say=say)
        except UsageError as failure:  # said by every rank, below
            error = str(failure)
        try:
            agreement.check_start(args, error)
            if self.output_lock is not None and self.output_lock.warning:
                say(self.output_lock.warning)
            error = None
            try:  # once the directory is this run's: no save of the run before it can land after this load
                self.resume_path, resumed = checkpoint.load_resume(args.resume, args.output_dir, warn=self.log.print)
            except UsageError as failure:
                error = str(failure)
            agreement.check_resume(agreement.resume_facts(self.resume_path, resumed), error)
            self._build(args, runtime, resumed)
        except BaseException:
            if self.output_lock is not None:
                self.output_lock.abandon()
            raise

    def _build(self, args, runtime, resumed):
        device = runtime.device
        if args.evaluate and resumed is None and not args.pretrained:  # --resume auto found nothing
            raise UsageError(f"-e: no checkpoint in {args.output_dir} to evaluate (--resume auto): "
                             "give --resume PATH, or --pretrained")
        # A resumed run keeps the determinism it was started with.
        args.deterministic = args.deterministic or bool((resumed or {}).get("args", {}).get("deterministic"))
        set_determinism(args.deterministic)
        warn_slow_amp(args.amp, device, self.log.print)
        if args.compile and args.sync_bn:
            self.log.print("warning: --compile with --sync-bn: SyncBatchNorm's collectives break the compiled "
                           "graph at every BatchNorm layer, which costs most of what compiling gains")
        if args.compile and args.res_schedule and not args.evaluate:
            self.log.print("warning: --compile with --res-schedule: each new training size compiles another "
                           "graph (seconds to minutes each)")
        if args.ra_sampler and runtime.world_size < args.ra_reps and not args.evaluate:
            # Consecutive copies go to consecutive ranks; with fewer ranks than copies some share a batch.
            self.log.print(f"warning: --ra-sampler with {runtime.world_size} process(es) and --ra-reps {args.ra_reps}: "
                           "copies of an image share a process's batch (and its BatchNorm statistics), so a step "
                           "sees fewer different images; torchvision uses it only with several processes")

        # The same seed on every rank: same initial weights and same data order (until the
        # model is built: then seed_this_rank).
        # A resumed run keeps its checkpoint's seed: data order, augmentation and mixing follow it.
        seed, saved_seed = args.seed, (resumed or {}).get("seed")
        if saved_seed is not None and not args.evaluate:
            if seed is not None and seed != saved_seed:
                self.log.print(f"warning: --seed {seed} ignored: {self.resume_path} was trained with seed {saved_seed}, "
                               "which this run keeps; another seed is another run (--overwrite or another --output-dir)")
            seed = saved_seed
        elif seed is None:
            seed = saved_seed
        self.seed = distributed.shared_seed(seed)
        random.seed(self.seed)
        torch.manual_seed(self.seed)

        self.per_process_batch = per_process_batch(args.batch_size, runtime.world_size)
        args.workers = loader_workers(args.workers, runtime.local_world_size)
        self.data = build_data(args, self.seed, runtime.rank, runtime.world_size, self.per_process_batch,
                               gpu=device.type == "cuda", datasets=self.build_datasets())
        if not args.resume and not args.evaluate and not args.overwrite:
            self._refuse_to_replace_a_run()
        model = self.build_model(len(self.data.classes))
        train_sizes = [args.train_crop_size]
        if args.res_schedule:  # progressive resizing: its smallest and largest crops
            schedule_sizes = ResSchedule.parse(args.res_schedule)
            train_sizes = [schedule_sizes.size(0), schedule_sizes.size(schedule_sizes.last_epoch)]
        models.check_input_size(model, args.arch, train_sizes, args.val_crop_size,
                                self.data.first_image[0] if self.data.first_image else 3)
        if resumed:
            checkpoint.load_weights(model, resumed, args.arch, self.data.classes, self.resume_path)
        self.aux_weight = getattr(model, "aux_loss_weight", None)
        if args.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.channels_last = use_channels_last(args.channels_last, device, args.amp, model)
        memory_format = torch.channels_last if self.channels_last else torch.preserve_format
        self.model = model.to(device, memory_format=memory_format)
        # The EMA of --model-ema; with -e, the checkpoint's (if it has one), evaluated beside its weights.
        self.ema = None
        if (args.model_ema and not args.evaluate) or (args.evaluate and "model_ema" in (resumed or {})):
            decay = adjusted_decay(args.model_ema_decay, args.batch_size, args.model_ema_steps, args.epochs)
            self.ema = ModelEma(self.model, decay, args.model_ema_steps, args.warmup_epochs)
            if "model_ema" in (resumed or {}):
                self.ema.load(resumed)
        seed_this_rank(self.seed, runtime.rank, runtime.devices)

        self.criterion = self.build_criterion().to(device)
        self.batch_mix = build_batch_mix(args, len(self.data.classes), runtime.world_size)
        self.steps_per_epoch = len(self.data.train_loader)
        self.optimizer = self.build_optimizer(self.model)
        self.scheduler = self.build_scheduler(self.optimizer)
        self.scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
        self.bad_images = BadImageLog(runtime.rank, runtime.world_size, known=(resumed or {}).get("bad_images", ()))
        on_device = self.data.normalise if device.type == "cuda" else None  # on the CPU the loader workers did it
        self.train_batches = DeviceLoader(self.data.train_loader, device, self.channels_last, self.bad_images.report,
                                          on_device)
        self.val_batches = DeviceLoader(self.data.val_loader, device, self.channels_last, self.bad_images.report,
                                        on_device)
        self.start_epoch, self.start_step, self.best_acc1, self.best_ema_acc1, self.resumed_totals = 0, 0, 0.0, 0.0, None
        self.epoch_lr = None  # the lr at the start of the epoch in progress
        self.resumed_epoch = int(resumed.get("epoch", 0)) if resumed else 0
        if resumed and not args.evaluate:
            self._restore(resumed)
        self.stop_signal = StopSignal(args.stop_grace)

    def _refuse_to_replace_a_run(self):
        """A fresh start would replace the checkpoints of the run in --output-dir: a relaunch that forgot
        --resume auto must not cost that run. Refused unless --overwrite says so."""
        output_dir = Path(self.args.output_dir)
        there = [output_dir / name for name in (checkpoint.CHECKPOINT, checkpoint.PREVIOUS, checkpoint.BEST)
                 if (output_dir / name).is_file()]
        if not there:
            return
        try:
            other = checkpoint.load_checkpoint(there[0], mmap=True)
        except UsageError:  # damaged: --resume auto falls back to the previous one, which is worth keeping
            other = None
        start_over = "start over with --overwrite (its checkpoints are deleted) or another --output-dir"
        if other and (other.get("arch") != self.args.arch
                      or other.get("classes", self.data.classes) != self.data.classes):
            raise UsageError(f"{output_dir} holds checkpoints of another run ({other.get('arch')}, "
                             f"{len(other.get('classes', []))} classes): choose another --output-dir, "
                             f"continue that run with --resume, or {start_over}")
        where = (f"at epoch {other.get('epoch', '?')} step {other.get('step_in_epoch', 0)}" if other
                 else f"({', '.join(path.name for path in there)}; the first is damaged)")
        raise UsageError(f"{output_dir} holds a run {where}: continue it with --resume auto, or {start_over}")

    def _samples(self):
        return {"train": len(self.data.train_loader.dataset), "val": len(self.data.val_loader.dataset),
                "steps": self.steps_per_epoch}

    def _check_samples(self, saved, trained):
        """A data set that changed since the checkpoint (files added or removed, a node's incomplete copy) shifts
        the data order, the lr schedule and, mid-epoch, which images the resumed epoch skips: refused mid-epoch,
        a warning line at an epoch's end (or after its last step: `trained`)."""
        now = self._samples()
        changed = [f"{split} {saved[split]} -> {now[split]}" for split in ("train", "val")
                   if split in saved and saved[split] != now[split]]
        if not changed:
            return
        if self.start_step and not trained and saved.get("train") != now["train"]:
            raise UsageError(f"{self.resume_path} stopped part-way through an epoch of {saved['train']} training images; "
                             f"the data now holds {now['train']}: the resumed epoch would skip other images than it "
                             "trained on: restore the data as it was, or resume from a checkpoint at an epoch's end")
        self.log.print(f"warning: the data changed since {self.resume_path} (images: {', '.join(changed)}): the run goes "
                       "on with the data as it is now (its epochs, lr schedule and accuracy follow the new counts)")

    def _restore(self, resumed):
        args = self.args
        self.start_epoch = int(resumed.get("epoch", 0))
        self.start_step = int(resumed.get("step_in_epoch", 0))
        saved = resumed.get("samples") or {}
        # Stopped after the epoch's last step (before validating it): its validation comes next, whatever the batch.
        trained = self.start_step >= saved.get("steps", self.steps_per_epoch)
        self._check_samples(saved, trained)
        if trained:
            self.start_step = self.steps_per_epoch
        if self.start_step:
            saved_batch = resumed.get("args", {}).get("batch_size")
            if saved_batch != args.batch_size and not trained:
                raise UsageError(f"{self.resume_path} stopped part-way through an epoch with global batch "
                                 f"{saved_batch}: resume it with -b {saved_batch}")
            self.resumed_totals = resumed.get("train_totals")
            self.epoch_lr = resumed.get("epoch_lr")  # log.csv's lr: the epoch's first, not the resumed step's
        self.best_acc1 = float(resumed.get("best_acc1", 0.0))
        self.best_ema_acc1 = float(resumed.get("best_ema_acc1", 0.0))
        if self.ema is not None and "model_ema" not in resumed:
            self.log.print(f"model EMA: {self.resume_path} holds none; it starts from the checkpoint's weights")
        saved_trainer = resumed.get("args", {}).get("trainer")
        if saved_trainer != args.trainer:
            with_it = f"with --trainer {saved_trainer}" if saved_trainer else "without --trainer"
            raise UsageError(f"{self.resume_path} was trained {with_it}: resume it so (a trainer's state and steps "
                             "are its own)")
        saved_opt = resumed.get("args", {}).get("opt", "sgd")
        if "optimizer" in resumed and saved_opt != args.opt:
            raise UsageError(f"{self.resume_path} was trained with --opt {saved_opt}: resume it with --opt {saved_opt} "
                             "(its optimizer state is that optimizer's)")
        if "optimizer" in resumed:
            try:
                self.optimizer.load_state_dict(resumed["optimizer"])
            except ValueError:  # other parameter groups: --norm-weight-decay / --bias-weight-decay changed
                saved = resumed.get("args", {})
                names = ("norm_weight_decay", "bias_weight_decay")
                if all(saved.get(name) == getattr(args, name) for name in names):
                    raise UsageError(f"{self.resume_path} groups its parameters for weight decay as these scripts did "
                                     "before norm layers' biases took --bias-weight-decay (as in torchvision): "
                                     "finish it with that version, or start afresh with --overwrite") from None
                flags = [f"{flag(name)} {saved[name]}" if saved.get(name) is not None else f"no {flag(name)}"
                         for name in names]
                raise UsageError(f"{self.resume_path} holds an optimizer with other weight-decay groups than this "
                                 f"run's: resume it as it was started, with {' and '.join(flags)}") from None
        self._restore_scheduler(resumed)
        if resumed.get("scaler"):
            self.scaler.load_state_dict(resumed["scaler"])
        states = resumed.get("rng_states")
        if states and len(states) == self.runtime.world_size:  # else: another world size, fresh streams
            set_rng_state(states[self.runtime.rank], self.runtime.devices)

    def _restore_scheduler(self, resumed):
        """The default schedule is recomputed at the resumed step (a resumed run may change --epochs or --lr);
        any other scheduler takes its saved state, which must be at that step (stepped once per optimizer step)."""
        done = self.start_epoch * self.steps_per_epoch + self.start_step
        if schedule.is_step_function(self.scheduler):
            self.scheduler = schedule.build_scheduler(self.optimizer, self.args, self.steps_per_epoch, start_step=done)
            return
        kind = type(self.scheduler).__name__
        if resumed.get("scheduler_type") != kind:
            raise UsageError(f"{self.resume_path} holds no {kind} state (its scheduler: "
                             f"{resumed.get('scheduler_type') or 'the default --lr-schedule'}): resume it with the "
                             "scheduler it was trained with")
        self.scheduler.load_state_dict(resumed["scheduler"])
        if self.scheduler.last_epoch != done:
            raise UsageError(f"{self.resume_path}: its {kind} stood at step {self.scheduler.last_epoch}, the run at "
                             f"{done}: a scheduler is stepped once per optimizer step, by the trainer alone")

    def _state(self, epoch, step_in_epoch, train_totals, rng_states, bad_images):
        return {"epoch": epoch, "step_in_epoch": step_in_epoch, "arch": self.args.arch,
                "num_classes": len(self.data.classes), "classes": list(self.data.classes), "seed": self.seed,
                "state_dict": checkpoint.unwrap(self.model).state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scheduler_type": type(self.scheduler).__name__,
                "scaler": self.scaler.state_dict(), "best_acc1": self.best_acc1, "train_totals": train_totals,
                "epoch_lr": self.epoch_lr,
                "rng_states": rng_states, "world_size": self.runtime.world_size, "args": dict(vars(self.args)),
                "samples": self._samples(),
                "bad_images": bad_images,
                **({"best_ema_acc1": self.best_ema_acc1, **self.ema.state()} if self.ema is not None else {})}

    def save(self, epoch, step_in_epoch=0, train_totals=None, is_best=False):
        """A checkpoint after `step_in_epoch` steps of `epoch` (0: the epoch before is complete).
        A collective: every rank calls it; the writer rank(s) write."""
        with self.stop_signal.no_stop_now():
            rng_states = distributed.all_gather_object(rng_state(self.runtime.devices))
            bad_images = self.bad_images.sync()
            if self.runtime.writes_checkpoints(self.args.save_on):
                state = self._state(epoch, step_in_epoch, train_totals, rng_states, bad_images)
                checkpoint.save_checkpoint(state, self.args.output_dir, is_best)
                self.log.write_bad_images(bad_images)
        return bad_images

    def _after_step(self, epoch, steps_done, metrics):
        """Between two steps: the EMA's update every --model-ema-steps steps, a checkpoint every
        --checkpoint-interval steps, and the clean stop that a SIGTERM / SIGUSR1 asks for. Returns True to stop."""
        global_step = epoch * self.steps_per_epoch + steps_done  # steps done in the run
        if self.ema is not None:
            self.ema.after_step(steps_done - 1, epoch)  # by step in the epoch: a resumed run updates where this one did
        stop = self.stop_signal.poll()
        interval = self.args.checkpoint_interval
        if stop or (interval and global_step % interval == 0 and steps_done < self.steps_per_epoch):
            self.save(epoch, steps_done, metrics.totals())
        self.steps_done = steps_done
        return stop

    def _stopped(self, epoch, step):
        """The end of a run that a stop signal asked to stop, once its checkpoint at (epoch, step) is written."""
        self.log.print(f"stopped on {self.stop_signal.received or 'a signal to another rank'}: checkpoint of "
                       f"epoch {epoch} step {step} in {self.args.output_dir}; continue with --resume auto")
        distributed.barrier()  # no rank exits (and gets the others killed) before the save is done
        raise Preempted()

    def _validate(self, model, **label):
        """evaluate() over the val set; a validation that could not read its images ends the run (one line, exit 2),
        with the files it could not read in bad_images.txt."""
        summary = evaluate(self, model, self.val_batches, **label)
        try:
            self.bad_images.check_validation(int(summary["count"]), len(self.data.val_loader.dataset))
        except UsageError:
            found = self.bad_images.sync()
            if not self.args.evaluate:  # (-e writes nothing; else the writer rank's log writes)
                self.log.write_bad_images(found)
            raise
        return summary

    def _mixer(self, epoch):
        """mix(images, target, step) for train_one_epoch, or None: --mixup-alpha / --cutmix-alpha, drawn
        from (seed, epoch, step, rank) alone, so a resumed epoch mixes as an uninterrupted one did."""
        if self.batch_mix is None:
            return None
        return lambda images, target, step: self.batch_mix(
            images, target, batch_mix_key(self.seed, epoch, step, self.runtime.rank))

    def fit(self, train_model, eval_model):
        """Train from the start (or resumed) position to --epochs, evaluating and checkpointing each epoch."""
        args, runtime, log = self.args, self.runtime, self.log
        if args.compile:
            train_model, eval_model = torch.compile(train_model), torch.compile(eval_model)
        log.print(f"{runtime.mode}: world size {runtime.world_size}, {runtime.num_devices} device(s) per process, "
                  f"{describe_environment(runtime.device, runtime.num_devices)}")
        source = (f"--dataset {args.dataset_fn}" if args.dataset_fn else args.data) or "synthetic (--dummy)"
        log.print(f"data: {source} ({len(self.data.classes)} classes, "
                  f"{len(self.data.train_loader.dataset)} train / {len(self.data.val_loader.dataset)} val images, "
                  f"{args.workers} loader worker(s) per process), normalised with {args.normalisation}")
        for line in describe_preset(args, self.data.first_image):
            log.print(line)
        if args.trainer:
            log.print(f"trainer: {args.trainer}")
        log.print(f"model: {args.arch}" + (f" from {args.weights}" if args.weights else "")
                  + f", {'channels_last' if self.channels_last else 'default'} memory format "
                  f"(--channels-last {args.channels_last}), --amp {args.amp}")
        if args.val_preprocessing:
            log.print(f"validation: resize {args.val_resize_size}, crop {args.val_crop_size}, {args.val_interpolation} "
                      f"(from {args.val_preprocessing}; --val-resize-size, --val-crop-size, --interpolation override)")
        if args.preset:
            log.print(f"recipe: {args.preset} ({RECIPES[args.preset]['name']})" + (
                "; on the demo set its epochs, batch, lr and image sizes stay the demo's" if args.dataset == "demo" else ""))
        if args.dummy and (args.auto_augment != "none" or args.random_erase > 0):
            log.print("note: --dummy images are synthetic tensors: --auto-augment and --random-erase are not applied, "
                      "and images/s leaves out their cost (measure it with --data)")
        if self.resume_path:
            log.print(f"resumed from {self.resume_path} (epoch {self.resumed_epoch}"
                      + (f", step {self.start_step})" if self.start_step else ")"))
        if args.evaluate:
            self._validate(eval_model)
            if self.ema is not None:
                self._validate(self.ema.module, prefix="Test EMA", label="EMA")
            return None
        if self.start_epoch >= args.epochs:
            log.print(f"already trained {self.start_epoch} of --epochs {args.epochs}: nothing to do")
            return None
        log.print(schedule.describe_optimizer(self.optimizer, args))
        if not schedule.is_step_function(self.scheduler):
            log.print(f"lr scheduler: {type(self.scheduler).__name__} (build_scheduler), stepped every optimizer step, "
                      "saved in the checkpoints")
        if self.ema is not None:
            log.print(f"model EMA: decay {self.ema.decay:.8g} every {args.model_ema_steps} steps (--model-ema-decay "
                      f"{args.model_ema_decay:g} adjusted as torchvision's train.py does for batch {args.batch_size}, "
                      f"{args.model_ema_steps} steps, {args.epochs} epochs)")
        log.print(f"output: {args.output_dir}")
        log.start(args, resumed=self.resume_path is not None, ema=self.ema is not None,
                  global_step=self.start_epoch * self.steps_per_epoch + self.start_step)
        wall_start = time.time()
        val = ema_val = {"acc1": 0.0, "acc5": 0.0, "loss": float("nan")}
        train = {"images_per_second": 0.0}
        for epoch in range(self.start_epoch, args.epochs):
            first_step = self.start_step if epoch == self.start_epoch else 0
            # A new shuffle every epoch, the same on every rank (and a resumed epoch skips
            # the batches it had done); also reseeds augmentation.
            self.data.train_sampler.set_epoch(epoch, start=first_step * self.per_process_batch)
            if hasattr(self.data.train_loader.dataset, "set_epoch"):
                self.data.train_loader.dataset.set_epoch(epoch)
            metrics = MetricSums(runtime.device, base=self.resumed_totals if first_step else None)
            if not first_step:
                self.bad_images.next_epoch()
            if not first_step or self.epoch_lr is None:
                self.epoch_lr = self.optimizer.param_groups[0]["lr"]
            epoch_start, lr = time.time(), self.epoch_lr
            train, stopped = train_one_epoch(
                self, train_model, self.train_batches, epoch, metrics, first_step,
                after_step=lambda steps_done: self._after_step(epoch, steps_done, metrics),
                mix=self._mixer(epoch),
                log_step=lambda steps_done, values: log.log_step(epoch * self.steps_per_epoch + steps_done, values))
            if not stopped and self.stop_signal.poll(now=True):
                # Asked to stop in the epoch's last steps: its checkpoint before validation (which may take long,
                # twice with --model-ema); a resumed run validates it.
                self.save(epoch, self.steps_per_epoch, metrics.totals())
                self.steps_done, stopped = self.steps_per_epoch, True
            if stopped:
                self._stopped(epoch, self.steps_done)
            # BatchNorm statistics drift apart across ranks; evaluate and save rank 0's.
            distributed.broadcast_buffers(self.model)
            val = self._validate(eval_model)
            row = {}
            if self.ema is not None:
                # The EMA's BatchNorm statistics average each rank's own: evaluate and save rank 0's.
                distributed.broadcast_buffers(self.ema.module)
                ema_val = self._validate(self.ema.module, prefix="Test EMA", label="EMA")
                self.best_ema_acc1 = max(ema_val["acc1"], self.best_ema_acc1)
                row = {"ema_val_loss": ema_val["loss"], "ema_val_acc1": ema_val["acc1"], "ema_val_acc5": ema_val["acc5"],
                       **MetricSums.extra(ema_val, "ema_val_")}
            is_best = val["acc1"] > self.best_acc1
            self.best_acc1 = max(val["acc1"], self.best_acc1)
            bad_images = self.save(epoch + 1, is_best=is_best)
            log.log_epoch({"epoch": epoch, "start_time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(epoch_start)),
                           "seconds": round(time.time() - epoch_start, 3), "lr": lr,
                           "train_loss": train["loss"], "train_acc1": train["acc1"], "val_loss": val["loss"],
                           "val_acc1": val["acc1"], "val_acc5": val["acc5"],
                           "images_per_second": round(train["images_per_second"], 1),
                           "bad_images": len(bad_images), **row,
                           **MetricSums.extra(train, "train_"), **MetricSums.extra(val, "val_")})
            if epoch + 1 < args.epochs and self.stop_signal.poll(now=True):
                self._stopped(epoch + 1, 0)  # asked to stop during validation: no step of the next epoch
        summary = {"mode": runtime.mode, "arch": args.arch, "epochs": args.epochs, "world_size": runtime.world_size,
                   "devices_per_process": runtime.num_devices, "device": str(runtime.device),
                   "best_acc1": self.best_acc1, "final_acc1": val["acc1"], "final_acc5": val["acc5"],
                   "final_val_loss": val["loss"], "train_images_per_second": train["images_per_second"],
                   "wall_seconds": round(time.time() - wall_start, 2), "torch": torch.__version__,
                   "bad_images": len(self.bad_images.found)}
        if self.ema is not None:
            summary.update(best_ema_acc1=self.best_ema_acc1, final_ema_acc1=ema_val["acc1"],
                           final_ema_acc5=ema_val["acc5"], ema_decay=self.ema.decay)
        if runtime.device.type == "cuda":  # rank 0's first GPU
            summary["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(runtime.device) / 2**30, 3)
        if args.compile:
            # Recompilations cost seconds to minutes each: a count that grows with the epochs is a bug.
            summary["compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            log.print(f"torch.compile: {summary['compiled_graphs']} graph(s) compiled")
        log.finish(summary)
        ema = (f" (EMA: best {self.best_ema_acc1:.2f}, final {ema_val['acc1']:.2f})" if self.ema is not None else "")
        log.print(f"done: best acc@1 {self.best_acc1:.2f}, final acc@1 {val['acc1']:.2f}{ema} "
                  f"in {summary['wall_seconds']:.0f} s; outputs in {args.output_dir}")
        return summary

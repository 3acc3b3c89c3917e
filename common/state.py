"""The checkpoint format: one place assembles a checkpoint from the state of each part of a run, and one place
checks and restores it when a run resumes.

A checkpoint is a dict of plain data and tensors (torch.load(..., weights_only=True) reads it):
  format_version   FORMAT_VERSION: a checkpoint of these scripts in another format is refused (WRITTEN_BY)
  checkpoint_id    new at every save: the ranks of a resumed job check that they all loaded the same one
  epoch            epochs completed; step_in_epoch: steps done of the next one (0 at an epoch's end)
  arch, num_classes, classes, seed, world_size, deterministic, args (the run's Config as a plain dict)
  samples          {train, val, steps}: the data's image counts and an epoch's steps when it was saved
  state_dict       the bare model's: loads into torchvision.models.<arch>(num_classes=K) as it is (images of other
                   channels than 3: after models.adapt_first_conv)
  optimizer, scheduler, scaler   their own state_dict(); scheduler_type: the scheduler's class
  model_ema        with --model-ema, ModelEma.state_dict(): {"state_dict": the EMA's weights, which load into the
                   same plain model, "n_averaged": its updates since it last restarted}
  best_acc1, best_ema_acc1, epoch_lr (each parameter group's lr at the start of the epoch in progress: log.csv's)
  best_epoch       the `epoch` of the checkpoint that model_best.pth holds (None: no best yet, or an older checkpoint)
  train_totals     the partial epoch's metric sums over all ranks (MetricSums.state_dict()), or None
  rng_states       every rank's random streams, in rank order (RandomStreams.state_dict())
  bad_images       the epoch's unreadable files, over all ranks (BadImageLog.state_dict())
  criterion        the criterion's state_dict() (its parameters: a learned temperature), rank 0's
  trainer_state    what a Trainer subclass's state_dict() returns, rank 0's
The sampler's position is (epoch, step_in_epoch): the data order is a function of the seed and the epoch.
"""
import copy
import io
import pickle

import torch

from . import distributed
from .checkpoint import unsafe_global
from .config import flag
from .errors import UsageError

FORMAT_VERSION = 1
# The last commit of this repository that wrote each older format (None: before checkpoints had a version).
WRITTEN_BY = {None: "fa90e47"}


def is_ours(checkpoint):
    """Whether a checkpoint was written by these scripts (any version), not weights from elsewhere."""
    return "format_version" in checkpoint or "step_in_epoch" in checkpoint


def check_format(checkpoint, path):
    """A checkpoint of these scripts in another format than this version's cannot be resumed: UsageError naming
    the commit to finish that run with. Weights from elsewhere (pytorch/examples', a bare state_dict) pass."""
    version = checkpoint.get("format_version")
    if not is_ours(checkpoint) or version == FORMAT_VERSION:
        return
    if version in WRITTEN_BY:
        raise UsageError(f"{path} was written by an earlier version of these scripts (checkpoint format "
                         f"{version or 'without a version'}; this one resumes format {FORMAT_VERSION}): finish that "
                         f"run with the version that wrote it (git checkout {WRITTEN_BY[version]}), or start afresh "
                         "with --overwrite (its weights still load: -e, or --resume for a fresh start elsewhere)")
    raise UsageError(f"{path} was written by a newer version of these scripts (checkpoint format {version}; this one "
                     f"resumes format {FORMAT_VERSION}): resume it with that version")


def samples(trainer):
    return {"train": len(trainer._data.train_loader.dataset), "val": len(trainer._data.val_loader.dataset),
            "steps": trainer.steps_per_epoch}


def assemble(trainer, epoch, step_in_epoch, metrics=None):
    """The checkpoint of `trainer` after `step_in_epoch` steps of `epoch` (0: the epoch before is complete), with
    the partial epoch's `metrics`. A collective (every rank calls it: it gathers the ranks' random streams, their
    unreadable files and metric sums); the writer rank saves what it returns."""
    ema = {"best_ema_acc1": trainer._best_ema_acc1} if trainer.ema else {}
    return {"format_version": FORMAT_VERSION, "epoch": epoch, "step_in_epoch": step_in_epoch,
            "arch": trainer.config.arch, "num_classes": len(trainer.classes), "classes": list(trainer.classes),
            "seed": trainer.seed, "world_size": trainer.runtime.world_size, "deterministic": trainer._deterministic,
            "args": dict(vars(trainer.config)), "samples": samples(trainer),
            **trainer._checkpoints.states(trainer),  # state_dict, optimizer, model_ema (sharded: each rank's shards)
            "scheduler": trainer.scheduler.state_dict(), "scheduler_type": type(trainer.scheduler).__name__,
            "scaler": trainer.scaler.state_dict(), "best_acc1": trainer._best_acc1, "best_epoch": trainer._best_epoch,
            "epoch_lr": trainer._epoch_lr,
            "train_totals": metrics.state_dict() if metrics is not None and step_in_epoch else None,
            "rng_states": distributed.all_gather_object(trainer._rng.state_dict()),
            "bad_images": trainer._bad_images.state_dict(),
            # (copies: a sharded checkpoint's state.pth may be written after the next steps, --async-checkpoint)
            "criterion": copy.deepcopy(trainer.criterion.state_dict()),
            "trainer_state": _own_state(trainer), **ema}


def restore(trainer, checkpoint, path):
    """Load `checkpoint` (read from `path`) into the built `trainer`: the weights always (-e evaluates them, with
    the EMA a checkpoint of ours holds); to train on, each part's state and the position, after the checks that
    the checkpoint can go on as this run. Weights from elsewhere give their epoch, optimizer and best acc@1."""
    config, checkpoints = trainer.config, trainer._checkpoints
    checkpoints.load_weights(trainer.model, checkpoint, config.arch, trainer.classes, path)
    if "criterion" in checkpoint:  # (its parameters: -e's loss too)
        _load_criterion(trainer, checkpoint["criterion"], path)
    trainer.start_epoch = int(checkpoint.get("epoch", 0))
    if config.evaluate:  # (the header says which epoch's weights it evaluates)
        trainer.start_step = int(checkpoint.get("step_in_epoch", 0))
        if (is_ours(checkpoint) or "exported_from" in checkpoint) and "model_ema" in checkpoint:
            trainer.ema = trainer.ema_for_evaluation()
            checkpoints.load_weights(trainer.ema.module, checkpoint, config.arch, trainer.classes, path, key="model_ema")
        return
    trainer._best_acc1 = float(checkpoint.get("best_acc1", 0.0))
    if not is_ours(checkpoint):
        if "optimizer" in checkpoint:
            _load_optimizer(trainer, checkpoint, path)
        _restore_scheduler(trainer, checkpoint, path)
        return
    _check_run(trainer, checkpoint, path)
    trainer._best_epoch = checkpoint.get("best_epoch")
    if trainer.log.writes:  # a save that wrote this checkpoint, the best, but not model_best.pth: written now
        try:
            checkpoints.repair_best(checkpoint, path, config.output_dir, trainer.log.print)
        except (OSError, UsageError) as error:  # (still a full disk, a shard it cannot read): training goes on
            trainer.log.print(f"warning: could not write model_best.pth again from {path} ({' '.join(str(error).split())[:200]}); "
                              "it holds an earlier epoch until a better one is saved")
    _restore_position(trainer, checkpoint, path)
    _load_optimizer(trainer, checkpoint, path)
    _restore_scheduler(trainer, checkpoint, path)
    trainer.scaler.load_state_dict(checkpoint["scaler"])
    if trainer.ema is not None:
        if "model_ema" in checkpoint:
            checkpoints.load_weights(trainer.ema.module, checkpoint, config.arch, trainer.classes, path, key="model_ema")
            trainer.ema.restart(int(checkpoint["model_ema"]["n_averaged"]), copy=False)
        else:
            trainer.ema.restart(0)
            trainer.log.print(f"model EMA: {path} holds none; it starts from the checkpoint's weights")
    trainer._best_ema_acc1 = float(checkpoint.get("best_ema_acc1", 0.0))
    states = checkpoint["rng_states"]
    if len(states) == trainer.runtime.world_size:  # else: another world size, fresh streams
        trainer._rng.load_state_dict(states[trainer.runtime.rank])
    trainer._bad_images.load_state_dict(checkpoint["bad_images"])
    if "trainer_state" in checkpoint:  # (since checkpoints had it)
        trainer.load_state_dict(checkpoint["trainer_state"])


def _load_criterion(trainer, state, path):
    try:
        trainer.criterion.load_state_dict(state)
    except RuntimeError as error:
        raise UsageError(f"{path}: its criterion's state does not fit this run's build_criterion: "
                         f"{' '.join(str(error).split())[:300]}") from None


def _own_state(trainer):
    """A copy of the subclass's state_dict() (a sharded checkpoint's state.pth may be written after the next steps),
    refused in one line, at the first save, where torch.load(weights_only=True) could not read it back at a resume."""
    own = copy.deepcopy(trainer.state_dict())
    if own and not getattr(trainer, "_own_state_checked", False):
        buffer = io.BytesIO()
        torch.save(own, buffer)
        try:
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        except pickle.UnpicklingError as error:
            raise UsageError(f"{type(trainer).__name__}.state_dict() returned {unsafe_global(error) or 'an object'}, "
                             "which a resume cannot load (weights_only): return plain data and tensors") from None
        trainer._own_state_checked = True
    return own


def _check_run(trainer, checkpoint, path):
    """Refuse what would not go on as the checkpoint's run: another --trainer, another --opt."""
    saved = checkpoint["args"]
    if saved["trainer"] != trainer.config.trainer:
        with_it = f"with --trainer {saved['trainer']}" if saved["trainer"] else "without --trainer"
        raise UsageError(f"{path} was trained {with_it}: resume it so (a trainer's state and steps are its own)")
    if saved["opt"] != trainer.config.opt:
        raise UsageError(f"{path} was trained with --opt {saved['opt']}: resume it with --opt {saved['opt']} "
                         "(its optimizer state is that optimizer's)")


def _restore_position(trainer, checkpoint, path):
    """Where the run goes on: the epoch and step, the partial epoch's metric sums and lr. A stop after an epoch's
    last step (before its validation) resumes at its validation, whatever the batch. A data set that changed since
    the checkpoint (files added or removed, a node's incomplete copy) shifts the data order, the lr schedule and,
    mid-epoch, which images the resumed epoch skips: refused mid-epoch, a warning line at an epoch's end."""
    saved, now = checkpoint["samples"], samples(trainer)
    step = int(checkpoint["step_in_epoch"])
    trained = step >= saved["steps"]
    changed = [f"{split} {saved[split]} -> {now[split]}" for split in ("train", "val") if saved[split] != now[split]]
    if step and not trained and saved["train"] != now["train"]:
        raise UsageError(f"{path} stopped part-way through an epoch of {saved['train']} training images; "
                         f"the data now holds {now['train']}: the resumed epoch would skip other images than it "
                         "trained on: restore the data as it was, or resume from a checkpoint at an epoch's end")
    if changed:
        trainer.log.print(f"warning: the data changed since {path} (images: {', '.join(changed)}): the run goes "
                          "on with the data as it is now (its epochs, lr schedule and accuracy follow the new counts)")
    saved_batch = checkpoint["args"]["batch_size"]
    if step and not trained and saved_batch != trainer.config.batch_size:
        raise UsageError(f"{path} stopped part-way through an epoch with global batch {saved_batch}: "
                         f"resume it with -b {saved_batch}")
    trainer.start_step = trainer.steps_per_epoch if trained else step
    if step:
        trainer._resumed_totals = checkpoint["train_totals"]
        trainer._epoch_lr = checkpoint["epoch_lr"]  # log.csv's lr: the epoch's first, not the resumed step's


def _load_optimizer(trainer, checkpoint, path):
    try:
        trainer._checkpoints.load_optimizer(trainer.model, trainer.optimizer, checkpoint, path)
    except ValueError:  # other parameter groups: --norm-weight-decay / --bias-weight-decay changed, say
        saved = checkpoint.get("args", {})
        names = ("norm_weight_decay", "bias_weight_decay")
        flags = [f"{flag(name)} {saved[name]}" if saved.get(name) is not None else f"no {flag(name)}" for name in names]
        raise UsageError(f"{path} holds an optimizer with other parameter groups than this run's: resume it as it "
                         f"was started, with {' and '.join(flags)} (and the same build_optimizer)") from None


def _restore_scheduler(trainer, checkpoint, path):
    """The scheduler's own state, which must stand at the run's step (stepped once per optimizer step). The
    default schedule's state is its place alone: it recomputes its lr from the flags (a resumed run may change
    --epochs or --lr; schedule.LrSchedule). Weights from elsewhere: the default schedule at their epoch's start."""
    done = trainer.start_epoch * trainer.steps_per_epoch + trainer.start_step
    scheduler, kind = trainer.scheduler, type(trainer.scheduler).__name__
    if not is_ours(checkpoint):
        checkpoint = {"scheduler": {"last_epoch": done, "steps_per_epoch": trainer.steps_per_epoch}, "scheduler_type": kind}
    if checkpoint["scheduler_type"] != kind:
        raise UsageError(f"{path} holds no {kind} state (its scheduler: {checkpoint['scheduler_type']}): resume it "
                         "with the scheduler it was trained with")
    scheduler.load_state_dict(checkpoint["scheduler"])
    if scheduler.last_epoch != done:
        raise UsageError(f"{path}: its {kind} stood at step {scheduler.last_epoch}, the run at {done}: a scheduler is "
                         "stepped once per optimizer step, by the trainer alone")

"""Starting a run: what happens between a Trainer made and a Trainer that trains.

start_run(trainer), on every rank of the job, in this order: the writer rank takes the output directory's lock;
the ranks agree on their arguments; each loads the checkpoint --resume names, and they agree on it; the seed is
chosen (the checkpoint's, --seed, or one drawn by rank 0); the data is scanned (build_datasets); a fresh start
that would replace a run's checkpoints is refused; the trainer's parts are built (Trainer.build) and take the
checkpoint's state (common/checkpoint.py). Every refusal is one line on every rank (common/agreement.py).
"""
import os
from pathlib import Path

from . import agreement, distributed, seeding
from .checkpoint import check_format, restore
from .config import evaluated_as_trained
from .errors import UsageError, say
from .run_dir import LOCK_WAIT_ON_RESTART, OutputLock


def take_output_dir(trainer):
    """The writer rank's OutputLock on the output directory (None elsewhere, and for -e, which writes nothing), or
    the line that refuses it. A restarted job (a Slurm requeue, torchrun's restart) may find the lock of the one
    it replaces still held: by a lost node's file system lease, or while the old step writes its stop's checkpoint."""
    if not trainer.log.writes:
        return None, None
    restarted = any(os.environ.get(name, "0") not in ("", "0")
                    for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"))
    try:
        return OutputLock(trainer.config.output_dir, wait=LOCK_WAIT_ON_RESTART if restarted else 0, say=say), None
    except UsageError as failure:  # said by every rank, by check_start
        return None, str(failure)


def load_agreed_checkpoint(trainer):
    """(path, checkpoint) that --resume names, loaded by every rank, which agree that they loaded the same one
    (a collective), or (None, None). Once the directory is this run's: no save of the run before it can land after
    this load. A checkpoint of these scripts in another format is refused, but for -e, which needs its weights."""
    config, error, path, checkpoint = trainer.config, None, None, None
    try:
        path, checkpoint = trainer._checkpoints.load_resume(config.resume, config.output_dir, warn=trainer.log.print)
        if checkpoint is not None and not config.evaluate:
            check_format(checkpoint, path)
    except UsageError as failure:
        error = str(failure)
    agreement.check_resume(agreement.resume_facts(path, checkpoint), error)
    if config.evaluate and checkpoint is None and not config.pretrained:  # --resume auto found nothing
        raise UsageError(f"-e: no checkpoint in {config.output_dir} to evaluate (--resume auto): "
                         "give --resume PATH, or --pretrained")
    return path, checkpoint


def choose_seed(trainer, path, checkpoint):
    """The run's seed, the same on every rank: a resumed run keeps its checkpoint's (data order, augmentation
    and mixing follow it), saying so when --seed asks for another; else --seed, or one drawn by rank 0."""
    seed, saved = trainer.config.seed, (checkpoint or {}).get("seed")
    if saved is not None and not trainer.config.evaluate:
        if seed is not None and seed != saved:
            trainer.log.print(f"warning: --seed {seed} ignored: {path} was trained with seed {saved}, which this run "
                              "keeps; another seed is another run (--overwrite or another --output-dir)")
        seed = saved
    elif seed is None:
        seed = saved
    return distributed.shared_seed(seed)


def trained_outputs(output_dir, there):
    """What in `output_dir` a run left that is worth keeping: its checkpoint files `there` (model_best.pth), its
    summary.json. (Not log.csv's rows: an epoch's row may outlive its checkpoint, as with --async-checkpoint, whose
    save completes at the next one; a relaunch then starts over.)"""
    return [path.name for path in there] + (["summary.json"] if (output_dir / "summary.json").is_file() else [])


def refuse_to_replace_a_run(config, classes, checkpoints, resumed=False):
    """A fresh start would replace the checkpoints of the run in --output-dir: a relaunch that forgot
    --resume auto must not cost that run; nor may --resume auto, where that run's checkpoints to continue from are
    gone but its model_best.pth or summary.json are not (`resumed`: whether it found one). Refused unless --overwrite
    says so."""
    output_dir = Path(config.output_dir)
    there = checkpoints.existing(output_dir)
    if config.evaluate or config.overwrite:
        return
    if config.resume == "auto" and not resumed:
        found = trained_outputs(output_dir, there)
        if found:
            raise UsageError(f"--resume auto: {output_dir} holds a run ({', '.join(found)}) but no checkpoint to continue "
                             "it from: start over with --overwrite (its outputs are replaced) or another --output-dir")
    if not there or config.resume:
        return
    try:
        other = checkpoints.peek(there[0])
    except UsageError:  # damaged: --resume auto falls back to the previous one, which is worth keeping
        other = None
    start_over = "start over with --overwrite (its checkpoints are deleted) or another --output-dir"
    if other and (other.get("arch") != config.arch or other.get("classes", classes) != classes):
        raise UsageError(f"{output_dir} holds checkpoints of another run ({other.get('arch')}, "
                         f"{len(other.get('classes', []))} classes): choose another --output-dir, "
                         f"continue that run with --resume, or {start_over}")
    where = (f"at epoch {other.get('epoch', '?')} step {other.get('step_in_epoch', 0)}" if other
             else f"({', '.join(path.name for path in there)}; the first is damaged)")
    raise UsageError(f"{output_dir} holds a run {where}: continue it with --resume auto, or {start_over}")


def start_run(trainer):
    """Start `trainer`'s run (see the module's docstring). The writer rank holds the output directory's lock
    (trainer._output_lock) for the process's life: the kernel drops it when the process ends. Returns `trainer`."""
    config = trainer.config
    distributed.check_sync_bn(config.sync_bn, trainer.runtime.device)
    lock, error = take_output_dir(trainer)
    try:
        agreement.check_start(config, error)
        if lock is not None and lock.warning:
            say(lock.warning)
        path, checkpoint = load_agreed_checkpoint(trainer)
        if config.evaluate and isinstance((checkpoint or {}).get("args"), dict):  # at the sizes it was trained with
            trainer.config = config = evaluated_as_trained(config, checkpoint["args"])
        # A resumed run keeps the determinism it was started with.
        trainer._deterministic = config.deterministic or bool((checkpoint or {}).get("deterministic"))
        seeding.set_determinism(trainer._deterministic)
        seed = choose_seed(trainer, path, checkpoint)
        datasets = trainer.build_datasets()
        refuse_to_replace_a_run(config, list(datasets[0]), trainer._checkpoints, resumed=checkpoint is not None)
        trainer.build(datasets, seed, resuming=checkpoint is not None)
        if checkpoint is not None:
            restore(trainer, checkpoint, path)
            trainer.resumed_from = path
        trainer._output_lock = lock
        return trainer
    except BaseException:
        if lock is not None:
            lock.abandon()
        raise

"""Checkpoints: their files (checkpoint.pth, checkpoint_prev.pth, model_best.pth), written atomically by one process
and read with weights_only=True, and their format, assembled (assemble) and restored (restore) in one place each.
Weights from elsewhere load too: pytorch/examples' (`module.` keys), torchvision's references' (`model`), a bare
state_dict. docs/reference.md, "Checkpoint format", says what each key holds."""

import argparse
import collections
import copy
import io
import pickle
import re
import shutil
import uuid
import zipfile
from pathlib import Path

import torch

from . import distributed
from .config import flag
from .data import items_digest, other_items
from .errors import CheckpointWriteError, Preempted, UsageError, raise_interrupt_within, written_reason
from .models import unwrap
from .optim import group_parameters, restore_scheduler
from .run_dir import atomic_write, link_or_copy, replace_synced, write_synced

CHECKPOINT = "checkpoint.pth"
PREVIOUS = "checkpoint_prev.pth"  # the checkpoint before the latest, kept in case the latest is damaged
BEST = "model_best.pth"
OWN_PARTS = ("args", "optimizer", "scheduler", "criterion", "trainer_state")  # (those a researcher's code fills)
PLAIN = (str, int, float, bool, type(None))  # (a value of another type in args: its str(), as in args.json)
WRAPPER_PREFIXES = re.compile(r"^(?:module\.|_orig_mod\.)+")  # DataParallel's, DDP's, torch.compile's: once or more


def strip_prefixes(state_dict, features=False):
    """Names without wrapper prefixes (`module.`); `features.module.` too with `features` (a model's own, else)."""
    strip = re.compile(r"^features\.module\." if features else r"(?!)")  # ((?!): matches nothing)
    return {strip.sub("features.", WRAPPER_PREFIXES.sub("", k)): v for k, v in state_dict.items()}


def save_checkpoint(state, output_dir, is_best, keep_previous=False):
    """Writer rank: write checkpoint.pth atomically with a new checkpoint_id, the one before kept as checkpoint_prev.pth
    (unless keep_previous: the run resumed from it), and copy it to model_best.pth when is_best. On failure the
    checkpoints already there stay whole, and CheckpointWriteError says so."""
    latest, new, written = Path(output_dir) / CHECKPOINT, None, False
    state = {**state, "checkpoint_id": uuid.uuid4().hex}
    try:
        new = write_synced(latest, lambda file: torch.save(state, file))
        if latest.exists() and not keep_previous:
            link_or_copy(latest, latest.with_name(PREVIOUS))
        replace_synced(new, latest)
        written = True
        if is_best:
            copy_to_best(latest, latest.parent)
    except (OSError, RuntimeError) as error:  # torch.save reports a failed write as a RuntimeError
        raise_interrupt_within(error)
        reason = written_reason(error)
        if written:  # (the latest is this best epoch: a resume copies it, checkpoint.restore's repair_best)
            raise CheckpointWriteError(
                f"could not copy {latest} to {BEST} ({reason}); the checkpoint itself is written "
                f"and --resume auto writes {BEST} again from it"
            ) from None
        raise CheckpointWriteError(
            f"could not write a checkpoint to {output_dir} ({reason}); the checkpoints already there are intact"
        ) from None
    finally:  # Ctrl-C, a full disk: no full-size temporary left behind
        if new is not None:
            new.unlink(missing_ok=True)


def copy_to_best(path, output_dir):
    """The checkpoint at `path` copied to model_best.pth in `output_dir`, atomically."""
    with open(path, "rb") as source:
        atomic_write(Path(output_dir) / BEST, lambda file: shutil.copyfileobj(source, file))


def stale_best(checkpoint, path, latest, best, peek):
    """Whether `best` (model_best.pth) must be written again from the checkpoint at `path`: it is the `latest`, ends
    its best epoch, and `best` is missing, unreadable or another checkpoint's (checkpoint_id)."""
    ends_best = checkpoint.get("best_epoch") == checkpoint.get("epoch") and not checkpoint.get("step_in_epoch")
    if not ends_best or Path(path).resolve() != latest.resolve():
        return False
    try:  # (model_best.pth is the checkpoint's copy, or its export: the same checkpoint_id)
        return not best.exists() or peek(best).get("checkpoint_id") != checkpoint.get("checkpoint_id")
    except UsageError:  # damaged
        return True


def resolve_resume(resume, output_dir):
    """The checkpoint path that --resume names (not auto: load_resume's), or None to start fresh."""
    if not resume:
        return None
    if Path(resume).is_dir():
        if (Path(resume) / "state.pth").is_file():  # (sharded_checkpoint.STATE)
            raise UsageError(
                f"--resume {resume}: a sharded checkpoint of train_fsdp.py; resume it with train_fsdp.py, "
                "or write its weights as one file (python tools/export_checkpoint.py DIR model.pth) to "
                "evaluate (-e --resume) or fine-tune (--init-from) here"
            )
        raise UsageError(
            f"--resume {resume}: a directory; give a checkpoint file (OUTPUT/checkpoint.pth), or --resume auto"
        )
    if not Path(resume).is_file():  # (a device, a FIFO: not a checkpoint either)
        what = "not a file" if Path(resume).exists() else "no such file"
        raise UsageError(f"--resume {resume}: {what} (give a checkpoint.pth, or --resume auto)")
    return Path(resume)


def load_resume(resume, output_dir, warn):
    """(path, checkpoint) that --resume asks for, or (None, None). With 'auto', a damaged latest checkpoint is
    reported through warn() and the previous one is used."""
    if resume == "auto":
        found = [Path(output_dir) / name for name in (CHECKPOINT, PREVIOUS) if (Path(output_dir) / name).is_file()]
        return first_readable(found, load_checkpoint, warn)
    path = resolve_resume(resume, output_dir)
    return (None, None) if path is None else (path, load_checkpoint(path))


def first_readable(paths, load, warn):
    """(path, load(path)) of the first of `paths` that loads, else (None, None); a damaged one warned of (warn)."""
    for index, path in enumerate(paths):
        try:
            return path, load(path)
        except UsageError as error:
            if index + 1 == len(paths):
                raise
            warn(f"warning: {error}; resuming from the previous checkpoint {paths[index + 1]}")
    return None, None


def check_crcs(path):
    """UsageError where a record of the zip at `path` (torch.save's format) does not match its CRC-32: torch.load does
    not check them, so a flipped bit loaded as a wrong weight. A file that is no zip is torch.load's to judge."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):  # truncated, not a zip, an older torch.save format: torch.load says
        return
    with archive:
        for info in archive.infolist():
            if info.CRC == 0:  # none written (torch.save with serialization.config.save.compute_crc32 off)
                continue
            try:
                with archive.open(info) as record:  # (zipfile checks the CRC-32 at the record's end)
                    while record.read(1 << 24):
                        pass
            except zipfile.BadZipFile:
                raise UsageError(
                    f"cannot read checkpoint {path}: corrupt (its record {info.filename} fails its CRC-32 check)"
                ) from None
            except (OSError, EOFError):  # cut short: torch.load says
                return


def unsafe_global(error, path=None):
    """The Python object that torch.load(weights_only=True) refused to build, as its UnpicklingError names it; None
    for a file at `path` that is no pickle (a text whose first letter, c, reads as pickle's GLOBAL opcode)."""
    pickled = path is None or zipfile.is_zipfile(path) or Path(path).read_bytes()[:1] == b"\x80"  # (a pickle's PROTO)
    return found[1] if pickled and (found := re.search(r"GLOBAL (\S+)", str(error))) else None


def load_checkpoint(path, mmap=False, weights=True, foreign=False):
    """The checkpoint dict at `path`, loaded with weights_only=True once every record matches its CRC-32; a bare
    state_dict as {"state_dict": it}; wrapper prefixes stripped. mmap: the tensors mapped, unchecked (for the metadata).
    weights=False: a sharded checkpoint's state.pth. foreign (--init-from): torchvision's references' "model" too."""
    if not mmap:
        check_crcs(path)
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as error:
        unsafe = "Unsupported global" in str(error) and unsafe_global(error, path)
        if unsafe:
            raise UsageError(
                f"refusing to load {path}: it holds a Python object ({unsafe}), "
                "not only tensors and plain data; nothing in it was run"
            )
        raise UsageError(f"cannot read checkpoint {path}: not a PyTorch checkpoint")
    except Preempted:  # a stop signal while it loads (launch.py): never taken for a damaged file
        raise
    except OSError as error:  # gone (a sharded checkpoint's state.pth deleted), unreadable: not "truncated"
        raise UsageError(f"cannot read checkpoint {path}: {error.strerror or error}") from None
    except Exception as error:  # truncated zip, text, random bytes: the unpickler raises many kinds
        raise UsageError(
            f"cannot read checkpoint {path}: truncated or not a PyTorch checkpoint ({type(error).__name__})"
        )
    not_a_checkpoint = UsageError(f"{path} is not a checkpoint: expected a dict with a 'state_dict' of tensors")
    if not isinstance(checkpoint, dict):
        raise not_a_checkpoint
    if "state_dict" not in checkpoint and checkpoint and all(torch.is_tensor(value) for value in checkpoint.values()):
        checkpoint = {"state_dict": checkpoint}  # a bare state_dict
    if not weights and "format_version" in checkpoint:
        return checkpoint
    if foreign and "state_dict" not in checkpoint and isinstance(checkpoint.get("model"), dict):
        checkpoint["state_dict"] = checkpoint["model"]
    if not isinstance(checkpoint.get("state_dict"), dict):
        raise not_a_checkpoint
    features = str(checkpoint.get("arch")).startswith(("alexnet", "vgg"))  # (pytorch/examples' own wrapping)
    checkpoint["state_dict"] = strip_prefixes(checkpoint["state_dict"], features)
    return checkpoint


def check_weights(checkpoint, arch, classes, path):
    """Refuse a checkpoint of another arch or other classes."""
    saved_arch = checkpoint.get("arch")
    if saved_arch and saved_arch != arch:
        raise UsageError(f"{path} holds a {saved_arch} model, not {arch}: pass --arch {saved_arch}")
    saved_classes, classes = list(checkpoint.get("classes") or []), list(classes)
    if saved_classes and len(saved_classes) != len(classes):
        raise UsageError(f"{path} was trained on {len(saved_classes)} classes, the data has {len(classes)}")
    if saved_classes != classes and saved_classes:
        index = next(index for index, (a, b) in enumerate(zip(saved_classes, classes)) if a != b)
        raise UsageError(
            f"{path} was trained on other classes than the data's: its class {index} is "
            f"{saved_classes[index]}, the data's {classes[index]}"
        )


def load_weights(model, checkpoint, arch, classes, path, key="state_dict"):
    """Load the checkpoint's weights (its `key`) into the bare `model`, refusing another arch or other classes."""
    check_weights(checkpoint, arch, classes, path)
    weights = checkpoint["state_dict"] if key == "state_dict" else checkpoint[key]["state_dict"]
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:
        detail = " ".join(str(error).split())
        raise UsageError(f"{path} does not fit {arch} with these classes: {detail[:300]}") from None


def weights_file(path, flag):
    """The checkpoint dict at `path`, given as `flag` (--init-from, a trainer's --teacher): ours, pytorch/examples',
    torchvision's references' (`model`, its args a Namespace) or a bare state_dict; a directory or no file: one line."""
    if Path(path).is_dir():
        raise UsageError(
            f"{flag} {path}: a directory; give a weights file (a checkpoint.pth or model_best.pth; a sharded "
            "checkpoint as tools/export_checkpoint.py writes it)"
        )
    if not Path(path).is_file():  # (a device, a FIFO: not a weights file either)
        raise UsageError(f"{flag} {path}: {'not a file' if Path(path).exists() else 'no such file'}")
    with torch.serialization.safe_globals([argparse.Namespace]):  # (torchvision's references save their args so)
        return load_checkpoint(path, foreign=True)


def init_from(model, path, arch, channels, num_classes):
    """--init-from: the weights at `path` loaded into the fresh `model`, as --pretrained's: a classifier of another
    number of classes keeps its new weights; a file trained on `channels` channels gets a first convolution for them.
    Anything else that differs is refused in one line. Returns what was changed, for the header."""
    from .models import NEW_HEAD, adapt_first_conv, classifiers, first_conv

    weights, changes = weights_file(path, "--init-from")["state_dict"], []
    first, _ = first_conv(model)
    given = weights.get(f"{first}.weight")
    other_channels = given is not None and given.ndim == 4 and given.shape[1] == channels != 3
    if other_channels and adapt_first_conv(model, arch, channels, pretrained=False):
        changes.append(f"{first}: 3 -> {channels} channels, as in {Path(path).name}")
    own = model.state_dict()
    heads = {f"{name}.{part}" for name, _ in classifiers(model, num_classes) for part in ("weight", "bias")}
    differ = [key for key in own if key in weights and weights[key].shape != own[key].shape]
    # (BatchNorm's counter, absent from older files: torch's strict load takes them without it too)
    missing = [key for key in own if key not in weights and not key.endswith("num_batches_tracked")]
    problems = [
        f"{what} {', '.join(keys[:3])}" + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        for what, keys in (
            ("missing", missing),
            ("not in the model", [key for key in weights if key not in own]),
            ("of other shapes", [key for key in differ if key not in heads]),
        )
        if keys
    ]
    if problems:
        raise UsageError(f"--init-from {path} does not fit --arch {arch}: weights {'; '.join(problems)}")
    model.load_state_dict({key: value for key, value in weights.items() if key not in differ}, strict=False)
    return changes + [
        f"{key.rsplit('.', 1)[0]}: {weights[key].shape[0]} -> {num_classes} {NEW_HEAD}"
        for key in differ
        if key.endswith(".weight")
    ]


class SingleFile:
    """The checkpoints of train_dp.py, train_ddp.py and train_spawn.py, one file each: the interface through which the
    Trainer and restore() write and read them (train_fsdp.py's: sharded_checkpoint.ShardedCheckpoints)."""

    names = (CHECKPOINT, PREVIOUS, BEST)
    fell_back = False  # --resume auto took checkpoint_prev.pth, the latest damaged: the next save keeps it

    def existing(self, output_dir):
        return [Path(output_dir) / name for name in self.names if (Path(output_dir) / name).is_file()]

    def peek(self, path):
        return load_checkpoint(path, mmap=True)

    def load_resume(self, resume, output_dir, warn):
        sharded = not (Path(output_dir) / CHECKPOINT).is_file() and (Path(output_dir) / "checkpoint").is_dir()
        if resume == "auto" and sharded:
            raise UsageError(
                f"{output_dir} holds a run of train_fsdp.py (sharded checkpoints in checkpoint/): continue "
                "it with train_fsdp.py, or choose another --output-dir"
            )
        path, checkpoint = load_resume(resume, output_dir, warn)
        self.fell_back = resume == "auto" and path is not None and path.name == PREVIOUS
        return path, checkpoint

    def load_weights(self, model, checkpoint, arch, classes, path, key="state_dict"):
        load_weights(unwrap(model), checkpoint, arch, classes, path, key)

    def load_optimizer(self, model, optimizer, checkpoint, path):
        groups = group_parameters(unwrap(model), optimizer)  # (regrouped, as many in each: went on, momenta swapped)
        if checkpoint.get("optimizer_groups", groups) != groups:
            raise ValueError("other parameter groups")  # (_load_optimizer's line names the flags)
        optimizer.load_state_dict(checkpoint["optimizer"])

    def states(self, trainer):
        """The parts of a checkpoint that are the model's and optimizer's (and the EMA's): plain state dicts."""
        states = {"state_dict": unwrap(trainer.model).state_dict(), "optimizer": trainer.optimizer.state_dict()}
        states["optimizer_groups"] = group_parameters(unwrap(trainer.model), trainer.optimizer)
        if trainer.ema is not None:
            states["model_ema"] = trainer.ema.state_dict()
        return states

    def write(self, checkpoint, output_dir, is_best, writes):
        if writes:
            save_checkpoint(checkpoint, output_dir, is_best, keep_previous=self.fell_back)
            self.fell_back = False

    def repair_best(self, checkpoint, path, output_dir, say):
        """model_best.pth copied again from the resumed checkpoint where stale_best says so (its save was cut short)."""
        best = Path(output_dir) / BEST
        if stale_best(checkpoint, path, Path(output_dir) / CHECKPOINT, best, self.peek):
            copy_to_best(path, output_dir)
            say(f"warning: {best} did not hold the best epoch {checkpoint['epoch']}: copied again from {path}")

    def wait(self):
        """Nothing to wait for: a single file is written when write() returns."""


FORMAT_VERSION = 1
# The last commit of this repository that wrote each older format (None: before checkpoints had a version).
WRITTEN_BY = {None: "fa90e47"}


def is_ours(checkpoint):
    """Whether a checkpoint was written by these scripts (any version), not weights from elsewhere (or exported)."""
    return ("format_version" in checkpoint or "step_in_epoch" in checkpoint) and "exported_from" not in checkpoint


def check_format(checkpoint, path):
    """UsageError for a checkpoint of these scripts in another format than this version's, naming the commit to
    finish that run with. Weights from elsewhere pass."""
    version = checkpoint.get("format_version")
    if not is_ours(checkpoint) or version == FORMAT_VERSION:
        return
    if version in WRITTEN_BY:
        raise UsageError(
            f"{path} was written by an earlier version of these scripts (checkpoint format "
            f"{version or 'without a version'}; this one resumes format {FORMAT_VERSION}): finish that "
            f"run with the version that wrote it (git checkout {WRITTEN_BY[version]}), or start afresh "
            "with --overwrite (its weights still load: -e --resume, or --init-from for a fresh start)"
        )
    raise UsageError(
        f"{path} was written by a newer version of these scripts (checkpoint format {version}; this one "
        f"resumes format {FORMAT_VERSION}): resume it with that version"
    )


def samples(trainer):
    loaders = (trainer._data.train_loader, trainer._data.val_loader)
    return {
        **{split: len(loader.dataset) for split, loader in zip(("train", "val"), loaders)},
        "steps": trainer.steps_per_epoch,
        "train_items": items_digest(loaders[0]),  # (data.py: None for a dataset of one's own)
    }


def assemble(trainer, epoch, step_in_epoch, metrics=None):
    """The checkpoint of `trainer` after `step_in_epoch` steps of `epoch`, with the partial epoch's `metrics`. A
    collective (it gathers the ranks' random streams, unreadable files, metric sums); the writer rank saves it."""
    ema = {"best_ema_acc1": trainer._best_ema_acc1} if trainer.ema else {}
    checkpoint = {
        "format_version": FORMAT_VERSION,
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
        "global_step": trainer._steps_done,  # (TensorBoard's x axis, which -b changed at an epoch's end does not reset)
        "arch": trainer.config.arch,
        "num_classes": len(trainer.classes),
        "classes": list(trainer.classes),
        "seed": trainer.seed,
        "world_size": trainer.runtime.world_size,
        "job": distributed.job_ids(),  # (a restart of this job goes on from it, whatever its --overwrite said)
        "deterministic": trainer._deterministic,
        "args": _walk(vars(trainer.config), lambda x: x if isinstance(x, PLAIN) else str(x)),
        "samples": samples(trainer),
        **trainer._checkpoints.states(trainer),  # state_dict, optimizer, model_ema (sharded: each rank's shards)
        "scheduler": trainer.scheduler.state_dict(),
        "scheduler_type": type(trainer.scheduler).__name__,
        "scaler": trainer.scaler.state_dict(),
        "best_acc1": trainer._best_acc1,
        "best_epoch": trainer._best_epoch,
        "epoch_lr": trainer._epoch_lr,
        "train_totals": metrics.state_dict() if metrics is not None and step_in_epoch else None,
        "rng_states": distributed.all_gather_object(trainer._rng.state_dict()),
        "bad_images": trainer._bad_images.state_dict(),
        # (copies: a sharded checkpoint's state.pth may be written after the next steps, --async-checkpoint)
        "criterion": copy.deepcopy(trainer.criterion.state_dict()),
        "trainer_state": copy.deepcopy(trainer.state_dict()),
        **ema,
    }
    return _loadable(trainer, checkpoint)


def restore(trainer, checkpoint, path):
    """Load `checkpoint` (read from `path`) into the built `trainer`: the weights (and EMA) always; to train on, each
    part's state and the position, once checked. Weights from elsewhere give their epoch, optimizer and best acc@1."""
    config, checkpoints = trainer.config, trainer._checkpoints
    checkpoints.load_weights(trainer.model, checkpoint, config.arch, trainer.classes, path)
    if "criterion" in checkpoint:  # (its parameters: -e's loss too)
        _load_criterion(trainer, checkpoint["criterion"], path)
    trainer.start_epoch = int(checkpoint.get("epoch", 0))
    trainer._steps_done = trainer.start_epoch * trainer.steps_per_epoch  # (weights from elsewhere: at their epoch's)
    if config.evaluate:  # (the header says which epoch's weights it evaluates)
        trainer.start_step = int(checkpoint.get("step_in_epoch", 0))
        if (is_ours(checkpoint) or "exported_from" in checkpoint) and "model_ema" in checkpoint:
            trainer.ema = trainer.ema_for_evaluation()
            checkpoints.load_weights(
                trainer.ema.module, checkpoint, config.arch, trainer.classes, path, key="model_ema"
            )
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
            trainer.log.print(
                f"warning: could not write model_best.pth again from {path} ({' '.join(str(error).split())[:200]}); "
                "it holds an earlier epoch until a better one is saved"
            )
    _restore_position(trainer, checkpoint, path)
    _load_optimizer(trainer, checkpoint, path)
    _restore_scheduler(trainer, checkpoint, path)
    if checkpoint["scaler"]:  # (none: saved without --amp fp16; this run's loss scale starts at its default)
        trainer.scaler.load_state_dict(checkpoint["scaler"])
    if trainer.ema is not None:
        if "model_ema" in checkpoint:
            checkpoints.load_weights(
                trainer.ema.module, checkpoint, config.arch, trainer.classes, path, key="model_ema"
            )
            trainer.ema.restart(int(checkpoint["model_ema"]["n_averaged"]), copy=False)
        else:
            trainer.ema.restart(0)
            trainer.log.print(f"model EMA: {path} holds none; it starts from the checkpoint's weights")
    elif "model_ema" in checkpoint:
        trainer.log.print(
            f"warning: {path} holds a model EMA and this run has no --model-ema: the EMA is not kept (this run's "
            "checkpoints hold none); resume with --model-ema to keep it"
        )
    trainer._best_ema_acc1 = float(checkpoint.get("best_ema_acc1", 0.0))
    states = checkpoint["rng_states"]
    if len(states) == trainer.runtime.world_size:
        trainer._rng.load_state_dict(states[trainer.runtime.rank])
    else:
        trainer.log.print(
            f"note: {path} was written by {len(states)} process(es), this run has {trainer.runtime.world_size}: each "
            "process's random streams (dropout, stochastic depth) start afresh from the seed; the data's order and "
            "augmentation are functions of the seed alone and go on"
        )
    trainer._bad_images.load_state_dict(checkpoint["bad_images"])
    if "trainer_state" in checkpoint:  # (since checkpoints had it)
        trainer.load_state_dict(checkpoint["trainer_state"])


def _load_criterion(trainer, state, path):
    try:
        trainer.criterion.load_state_dict(state)
    except RuntimeError as error:
        raise UsageError(
            f"{path}: its criterion's state does not fit this run's build_criterion: "
            f"{' '.join(str(error).split())[:300]}"
        ) from None


def _walk(value, leaf):
    """`value` with leaf(x) in place of each x in it that is no dict, OrderedDict, list or tuple."""
    if type(value) in (dict, collections.OrderedDict):
        return type(value)((key, _walk(item, leaf)) for key, item in value.items())
    return type(value)(_walk(item, leaf) for item in value) if type(value) in (list, tuple) else leaf(value)


def _loadable(trainer, checkpoint):
    """`checkpoint`, each part's data but its tensors read back with weights_only=True at every save (a trainer's own
    state may gain an object late), else one line naming the part (was: saved, exit 0, and no resume could load it)."""
    for key in OWN_PARTS:
        buffer = io.BytesIO()
        torch.save(_walk(checkpoint[key], lambda x: None if isinstance(x, torch.Tensor) else x), buffer)
        try:
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        except pickle.UnpicklingError as error:
            where = {"trainer_state": f"{type(trainer).__name__}.state_dict() returned"}.get(
                key, f"the {key}'s state_dict() holds" if key in ("optimizer", "scheduler") else f"{key} holds"
            )
            raise UsageError(
                f"{where} {unsafe_global(error) or 'an object'}, which a resume cannot load (weights_only): return "
                "plain data and tensors"
            ) from None
    return checkpoint


def _check_run(trainer, checkpoint, path):
    """Refuse what would not go on as the checkpoint's run: a part missing (edited), another --trainer or --opt."""
    parts = ("args", "samples", "step_in_epoch", "scheduler", "scheduler_type", "scaler", "epoch_lr", "train_totals")
    parts += ("rng_states", "bad_images") + (("optimizer",) if "state_dict" in checkpoint else ())  # (FSDP's: shards)
    missing = [key for key in parts if key not in checkpoint] or [
        f"args['{key}']" for key in ("trainer", "opt", "batch_size") if key not in checkpoint["args"]
    ]
    if missing:
        raise UsageError(f"{path} lacks {', '.join(missing)}: not a whole checkpoint of these scripts (edited?)")
    saved = checkpoint["args"]
    if saved["trainer"] != trainer.config.trainer:
        with_it = f"with --trainer {saved['trainer']}" if saved["trainer"] else "without --trainer"
        raise UsageError(f"{path} was trained {with_it}: resume it so (a trainer's state and steps are its own)")
    if saved["opt"] != trainer.config.opt:
        raise UsageError(
            f"{path} was trained with --opt {saved['opt']}: resume it with --opt {saved['opt']} "
            "(its optimizer state is that optimizer's)"
        )


def _restore_position(trainer, checkpoint, path):
    """Where the run goes on: the epoch and step, the partial epoch's metric sums and lr (after an epoch's last step:
    its validation, whatever the batch). A data set, batch or --ra-sampler that changed is refused mid-epoch (the
    resumed epoch would skip other images); a changed data set is a warning at an epoch's end."""
    saved, now = checkpoint["samples"], samples(trainer)
    step = int(checkpoint["step_in_epoch"])
    trained = step >= saved["steps"]
    changed = [f"{split} {saved[split]} -> {now[split]}" for split in ("train", "val") if saved[split] != now[split]]
    other = other_items(saved.get("train_items"), now["train_items"])
    if step and not trained and (saved["train"] != now["train"] or other):  # (other: as many, other files or labels)
        raise UsageError(
            f"{path} stopped part-way through an epoch of {saved['train']} training images; the data now holds "
            f"{now['train'] if saved['train'] != now['train'] else 'as many, of other files or labels'}: the resumed "
            "epoch would skip other images than it trained on: restore the data as it was, or resume from a "
            "checkpoint at an epoch's end"
        )
    if changed:
        trainer.log.print(
            f"warning: the data changed since {path} (images: {', '.join(changed)}): the run goes "
            "on with the data as it is now (its epochs, lr schedule and accuracy follow the new counts)"
        )
    saved_batch = checkpoint["args"]["batch_size"]
    if step and not trained and saved_batch != trainer.config.batch_size:
        raise UsageError(
            f"{path} stopped part-way through an epoch with global batch {saved_batch}: resume it with -b {saved_batch}"
        )
    order = [_epoch_order(args) for args in (checkpoint["args"], vars(trainer.config))]
    if step and not trained and order[0] != order[1]:
        raise UsageError(
            f"{path} stopped part-way through an epoch drawn {order[0]}: resume it so (the rest of that epoch "
            "comes from its order)"
        )
    trainer.start_step = trainer.steps_per_epoch if trained else step
    trainer._steps_done = int(checkpoint.get("global_step", trainer._steps_done + trainer.start_step))
    if step:
        trainer._resumed_totals = checkpoint["train_totals"]
        trainer._epoch_lr = checkpoint["epoch_lr"]  # log.csv's lr: the epoch's first, not the resumed step's


def _epoch_order(args):
    """What, beside the seed and the data, draws an epoch's order: --ra-sampler and its --ra-reps."""
    return f"with --ra-sampler --ra-reps {args.get('ra_reps')}" if args.get("ra_sampler") else "without --ra-sampler"


def _load_optimizer(trainer, checkpoint, path):
    """The optimizer's state. Its groups' settings come back with it: where a resume changes the flags that set them
    (--wd 0.05 on a run of 1e-4), this run's (were silently the checkpoint's, args.json saying otherwise)."""
    settings = ("weight_decay", "momentum")  # (their flags: --wd, --momentum, --norm-weight-decay, ...; not the lr)
    built = [{key: group[key] for key in settings if key in group} for group in trainer.optimizer.param_groups]
    saved = checkpoint.get("args", {})
    try:
        trainer._checkpoints.load_optimizer(trainer.model, trainer.optimizer, checkpoint, path)
    except ValueError:  # other parameter groups: --norm-weight-decay / --bias-weight-decay changed, say
        names = ("weight_decay", "norm_weight_decay", "bias_weight_decay")  # (a decay equal to --wd's joins its group)
        flags = [f"{flag(name)} {saved[name]}" if saved.get(name) is not None else f"no {flag(name)}" for name in names]
        raise UsageError(
            f"{path} holds an optimizer with other parameter groups than this run's: resume it as it "
            f"was started, with {' and '.join(flags)} (and the same build_optimizer)"
        ) from None
    if any(saved.get(name, value) != value for name, value in vars(trainer.config).items() if name.endswith(settings)):
        for group, settings in zip(trainer.optimizer.param_groups, built):
            group.update(settings)


def _restore_scheduler(trainer, checkpoint, path):
    """The scheduler at the run's step (optim.restore_scheduler); weights from elsewhere: at their epoch's start."""
    done = trainer.start_epoch * trainer.steps_per_epoch + trainer.start_step
    saved = checkpoint if is_ours(checkpoint) else None
    restore_scheduler(trainer.scheduler, saved, path, done, trainer.steps_per_epoch, trainer.config.epochs)

"""Sharded checkpoints for train_fsdp.py: every rank writes its shard through Distributed Checkpoint (DCP).

A checkpoint is a new directory, OUTPUT/sharded/eEEEE-sSSSSSS-ID/: DCP's files and state.pth (the rest of
checkpoint.py's dict, with the size and CRC-32 of each of DCP's files). Once all are on disk, the links
OUTPUT/checkpoint and OUTPUT/checkpoint_prev are switched atomically. A resume checks the CRCs and falls back as for a
single file. model_best.pth is a single file (export). DCP reads .metadata with pickle: trust a sharded checkpoint as
you trust code. docs/reference.md says the rest.
"""

import shutil
import uuid
import warnings
import zlib
from pathlib import Path

import torch

from . import distributed
from .checkpoint import BEST, CHECKPOINT, check_weights, first_readable, load_checkpoint, stale_best
from .errors import SHORT_WRITE, CheckpointWriteError, UsageError, raise_interrupt_within, written_reason
from .models import unwrap
from .run_dir import atomic_write, fsync

LATEST, PREVIOUS, FOLDER, STATE = "checkpoint", "checkpoint_prev", "sharded", "state.pth"
SHARDED = ("state_dict", "optimizer", "model_ema")  # the parts DCP writes, each rank its shard


def _failures():
    """What DCP raises when a rank's read or write fails (its CheckpointException is a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def is_sharded(path):
    return Path(path).is_dir() and (Path(path) / STATE).is_file()


def _reason(error):
    """One line for what DCP raised: the first failing rank's exception (a CheckpointException holds every rank's,
    each with its traceback), an OSError by its message (No space left on device)."""
    rank = ""
    if getattr(error, "failures", None):
        index, (error, _) = min(error.failures.items(), key=lambda item: item[0])
        rank = f"rank {index}: "
    if isinstance(error, OSError) or isinstance(error.__context__, OSError) or SHORT_WRITE in str(error):
        text = written_reason(error)  # (its file is often a temporary one: the caller names what it wrote)
    else:
        text = f"{type(error).__name__}: {error}"
    return rank + " ".join(text.split())[:300]


def _checksum(path):
    """(size, CRC-32) of the file at `path`."""
    size, crc = 0, 0
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            size, crc = size + len(chunk), zlib.crc32(chunk, crc)
    return size, crc


def _checksums(directory):
    """{name: (size, CRC-32)} of DCP's files in the just-written `directory`, each rank reading a share (a collective):
    a rank that cannot read its share fails the save on every rank, in one line."""

    def listing():
        try:
            return sorted(path.name for path in Path(directory).iterdir() if path.name != STATE)
        except OSError as error:
            raise UsageError(error.strerror) from None

    error, mine = None, {}
    try:
        names = distributed.computed_by_rank_0(listing)
        mine = {
            name: _checksum(Path(directory) / name)
            for name in names[distributed.get_rank() :: distributed.get_world_size()]
        }
    except (OSError, UsageError) as failure:
        error = getattr(failure, "strerror", None) or str(failure)
    parts = distributed.all_gather_object((mine, error))
    errors = [error for _, error in parts if error]
    if errors:
        raise CheckpointWriteError(
            f"could not read back the sharded checkpoint {directory} ({errors[0]}); the "
            "checkpoints already there are intact"
        )
    return {name: value for part, _ in parts for name, value in part.items()}


def _check_files(directory, files, share=slice(None)):
    """UsageError where a file that state.pth records (`files`: name -> (size, CRC-32)), of the sorted names' `share`,
    is missing or not as written. A checkpoint of a version that recorded none is not checked."""
    for name in sorted(files)[share]:
        try:
            found = _checksum(Path(directory) / name)
        except OSError as error:
            raise UsageError(
                f"cannot read checkpoint {directory}: its {name} is unreadable ({error.strerror})"
            ) from None
        if tuple(found) != tuple(files[name]):
            what = (
                "fails its CRC-32 check"
                if found[0] == files[name][0]
                else f"holds {found[0]} bytes of {files[name][0]}"
            )
            raise UsageError(f"cannot read checkpoint {directory}: corrupt (its {name} {what})")


class ShardedCheckpoints:
    """The checkpoints of a sharded model (the interface of checkpoint.SingleFile, which the Trainer and
    common/checkpoint.py call). --async-checkpoint: the shards are copied to host memory at the save, written while
    training goes on, on a process group of their own (on the training's, gloo hung or reset the connection), and
    the links switch at the next save, a stop or the run's end, which wait for the write."""

    names = (LATEST, PREVIOUS, BEST, FOLDER)

    def __init__(self, config):
        import torch.distributed as dist

        self.output_dir = Path(config.output_dir)
        self.group = dist.new_group(backend="gloo") if config.async_checkpoint else None
        self.pending = None  # (future, directory, state, writes) of the asynchronous save under way
        self.fell_back_to = None  # the checkpoint --resume auto took where the latest was damaged (load_resume)

    # ---------------------------------------------------------------- finding and reading
    def existing(self, output_dir):
        return [Path(output_dir) / name for name in (LATEST, PREVIOUS, BEST) if (Path(output_dir) / name).exists()]

    def peek(self, path):
        path = Path(path)
        if path.is_dir():
            return load_checkpoint(path / STATE, mmap=True, weights=False)
        return load_checkpoint(path, mmap=True)

    def load_resume(self, resume, output_dir, warn):
        """(path, checkpoint without the sharded parts) that --resume names: a checkpoint's directory (OUTPUT/
        checkpoint: the latest), 'auto' (the latest, else the one before), or a single file for its weights."""
        if not resume:
            return None, None
        if resume == "auto":
            # (a link whose directory is gone is tried too, said, and the one before taken; both gone: no checkpoint,
            # and run.refuse_to_replace_a_run says what is left)
            found = [
                Path(output_dir) / name
                for name in (LATEST, PREVIOUS)
                if is_sharded(Path(output_dir) / name) or (Path(output_dir) / name).is_symlink()
            ]
            found = found if any(is_sharded(path) for path in found) else []
            if not found and (Path(output_dir) / CHECKPOINT).is_file():
                raise UsageError(
                    f"{output_dir} holds a run of train_dp.py, train_ddp.py or train_spawn.py ({CHECKPOINT}): "
                    "train_fsdp.py resumes its own sharded checkpoints; continue that run with its script, "
                    "or choose another --output-dir"
                )
            path, checkpoint = first_readable(found, self._verified, warn)
            # Taken instead of a damaged latest: the next save keeps it as checkpoint_prev (not the damaged one).
            self.fell_back_to = path.resolve() if path is not None and path != found[0] else None
            return (path and path.resolve()), checkpoint
        path = Path(resume)
        if path.is_dir():
            if not is_sharded(path):
                raise UsageError(
                    f"--resume {resume}: no {STATE} in it: give a sharded checkpoint's directory "
                    f"(OUTPUT/{LATEST}), or --resume auto"
                )
            return path.resolve(), self._verified(path)
        if not path.is_file():
            raise UsageError(f"--resume {resume}: no such file or directory (give OUTPUT/{LATEST}, or --resume auto)")
        return path, load_checkpoint(path)

    def _verified(self, path):
        """The state.pth of the sharded checkpoint at `path`, once its files are as written: each rank checks a share,
        and all raise the first rank's UsageError (a collective), so that all fall back alike."""
        error, state = None, None
        try:
            if not Path(path).is_dir():
                raise UsageError(f"cannot read checkpoint {path}: its directory {Path(path).readlink()} is gone")
            state = load_checkpoint(Path(path) / STATE, weights=False)
            share = slice(distributed.get_rank(), None, distributed.get_world_size())
            _check_files(path, state.get("files", {}), share)
        except UsageError as failure:
            error = str(failure)
        except OSError as failure:  # (an I/O error reading state.pth: said by every rank, not a hang of the others)
            error = f"cannot read checkpoint {path}: {failure.strerror or failure}"
        errors = [error for error in distributed.all_gather_object(error) if error]
        if errors:
            raise UsageError(errors[0])
        return state

    def _load(self, path, part, template):
        import torch.distributed.checkpoint as dcp

        state = {part: template}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except _failures() as error:  # each rank's failure: missing keys, other shapes, damaged files
            raise UsageError(f"cannot load the {part} of {path}: {_reason(error)}") from None
        return state[part]

    def load_weights(self, model, checkpoint, arch, classes, path, key="state_dict"):
        """The checkpoint's weights (or the EMA's: key model_ema) into the sharded `model`; from a single file
        (model_best.pth, weights from elsewhere) each rank takes its shard of the whole."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

        check_weights(checkpoint, arch, classes, path)
        model = unwrap(model)
        if Path(path).is_dir():
            if key == "state_dict":
                weights = self._load(path, key, get_model_state_dict(model))
            else:
                weights = self._load(path, key, {"state_dict": get_model_state_dict(model)})["state_dict"]
            set_model_state_dict(model, weights)
            return
        weights = checkpoint["state_dict"] if key == "state_dict" else checkpoint[key]["state_dict"]
        try:
            _load_whole(model, weights)
        except (RuntimeError, KeyError, ValueError) as error:
            detail = " ".join(str(error).split())
            raise UsageError(f"{path} does not fit {arch} with these classes: {detail[:300]}") from None

    def load_optimizer(self, model, optimizer, checkpoint, path):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        if not Path(path).is_dir():
            raise UsageError(
                f"{path} holds an optimizer state of a single-file checkpoint: train_fsdp.py resumes its own "
                f"sharded checkpoints (OUTPUT/{LATEST}); it takes a single file's weights alone (-e, or an "
                "exported model_best.pth)"
            )
        model, template = unwrap(model), get_optimizer_state_dict(model, optimizer)
        groups = checkpoint.get("optimizer_groups")  # (DCP loads by name: groups joined went on, split a traceback)
        if groups is not None and groups != group_names(template):
            raise ValueError("other parameter groups")  # (checkpoint._load_optimizer's line names the flags)
        set_optimizer_state_dict(model, optimizer, self._load(path, "optimizer", template))

    # ---------------------------------------------------------------- writing
    def states(self, trainer):
        """The sharded parts of the checkpoint: each a state dict of DTensors (this rank's shards) keyed by the
        bare model's parameter names. BatchNorm statistics are each rank's own under FSDP: rank 0's are saved (as
        DDP's are: DDP gives every rank rank 0's at each forward)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        from torch.distributed.fsdp import FSDPModule

        model = unwrap(trainer.model)
        # --no-reshard-after-forward: the units stay whole after validation's forwards, and the optimizer's state is of
        # the sharded parameters (was: a KeyError at each epoch's end): sharded again first.
        for module in (*model.modules(), *(trainer.ema.module.modules() if trainer.ema is not None else ())):
            if isinstance(module, FSDPModule):
                module.reshard()
        distributed.broadcast_buffers(model)
        optimizer = get_optimizer_state_dict(model, trainer.optimizer)
        states = {"state_dict": get_model_state_dict(model), "optimizer": optimizer}
        # (in state.pth: each parameter group's parameters by name, which a resume's groups must be)
        states["optimizer_groups"] = group_names(optimizer)
        if trainer.ema is not None:
            distributed.broadcast_buffers(trainer.ema.module)
            states["model_ema"] = {
                "state_dict": get_model_state_dict(trainer.ema.module),
                "n_averaged": trainer.ema.n_averaged,
            }
        return states

    def write(self, checkpoint, output_dir, is_best, writes):
        """Write `checkpoint` (checkpoint.assemble's) as a new directory, every rank its shards (a collective), and make
        it the latest once complete (at once, or with --async-checkpoint once its write is done)."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        output_dir = Path(output_dir)
        name = distributed.computed_by_rank_0(lambda: uuid.uuid4().hex[:12])
        directory = output_dir / FOLDER / f"e{checkpoint['epoch']:04d}-s{checkpoint['step_in_epoch']:06d}-{name}"
        sharded = {key: checkpoint[key] for key in SHARDED if key in checkpoint}
        state = {key: value for key, value in checkpoint.items() if key not in SHARDED}
        state["checkpoint_id"] = name
        if "model_ema" in sharded:
            state["model_ema"] = {"n_averaged": sharded["model_ema"]["n_averaged"]}
        try:
            if self.group is None:
                dcp.save(sharded, checkpoint_id=str(directory))
            else:
                future = dcp.async_save(sharded, checkpoint_id=str(directory), process_group=self.group)
                self.pending = (future, directory, state, is_best, writes)
                return
        except _failures() as error:
            raise _not_written(directory, error) from None
        self._complete(directory, state, is_best, writes)

    def repair_best(self, checkpoint, path, output_dir, say):
        """model_best.pth exported again from the resumed checkpoint where checkpoint.stale_best says so (its save
        switched the links but did not export model_best.pth: a full disk, a kill between the two)."""
        output_dir = Path(output_dir)
        if stale_best(checkpoint, path, output_dir / LATEST, output_dir / BEST, self.peek):
            try:
                export(path, output_dir / BEST, check=False)  # (its files checked at the resume)
            except _failures() as error:  # (DCP's CheckpointException is a BaseException)
                raise CheckpointWriteError(f"could not export {path} to {BEST} ({_reason(error)})") from None
            say(
                f"warning: {output_dir / BEST} did not hold the best epoch {checkpoint['epoch']}: "
                f"exported again from {path}"
            )

    def wait(self):
        """Wait for the asynchronous save under way, if any, and make it the latest."""
        if self.pending is None:
            return
        (future, directory, state, is_best, writes), self.pending = self.pending, None
        try:
            future.result()
        except _failures() as error:
            raise _not_written(directory, error) from None
        self._complete(directory, state, is_best, writes)

    def _complete(self, directory, state, is_best, writes):
        """Once every shard and .metadata are written: their checksums (a collective), then on the writer rank
        state.pth, the links, the older directories, and model_best.pth."""
        state["files"] = _checksums(directory)
        if not writes:
            return
        latest, previous, switched = self.output_dir / LATEST, self.output_dir / PREVIOUS, False
        try:
            atomic_write(directory / STATE, lambda file: torch.save(state, file))
            for link in (latest, previous):  # a copy of the run with its links followed (cp -rL, scp -r): linked again
                if link.is_dir() and not link.is_symlink():  # (was: no save could replace it, exit 1 at each)
                    adopted = self.output_dir / FOLDER / f"{link.name}-copied-{uuid.uuid4().hex[:8]}"
                    if self.fell_back_to == link.resolve():  # (the one resumed from, its latest damaged: kept)
                        self.fell_back_to = adopted
                    link.rename(adopted)
                    _link(link, Path(FOLDER) / adopted.name)
            if self.fell_back_to is not None:  # the damaged latest goes with the older ones
                _link(previous, Path(FOLDER) / self.fell_back_to.name)
            elif latest.is_symlink():
                _link(previous, latest.readlink())
            _link(latest, Path(FOLDER) / directory.name)
            keep = {directory.name, previous.readlink().name if previous.is_symlink() else None}
            for other in (self.output_dir / FOLDER).iterdir():
                if other.name not in keep:
                    shutil.rmtree(other, ignore_errors=True)
            switched, self.fell_back_to = True, None
            if is_best:
                export(directory, self.output_dir / BEST, check=False)  # (its files just checksummed)
        except _failures() as error:  # a full disk, a shard unreadable for the export
            raise_interrupt_within(error)
            reason = _reason(error)
            if switched:  # (the latest is this best epoch: a resume exports it, checkpoint.restore's repair_best)
                raise CheckpointWriteError(
                    f"could not export {directory} to {BEST} ({reason}); the checkpoint itself "
                    f"is complete and --resume auto exports {BEST} again from it"
                ) from None
            raise CheckpointWriteError(
                f"could not complete the checkpoint {directory} ({reason}); the checkpoints already there are intact"
            ) from None


def _not_written(directory, error):
    return CheckpointWriteError(
        f"could not write a sharded checkpoint to {directory} ({_reason(error)}); "
        "the checkpoints already there are intact"
    )


def group_names(optimizer_state):
    """Each parameter group's parameter names, of an optimizer state dict by name (get_optimizer_state_dict's)."""
    return [list(group["params"]) for group in optimizer_state["param_groups"]]


def _link(link, target):
    """Point the symbolic link `link` at `target` atomically: a new link beside it renamed over it."""
    new = link.with_name(f".{link.name}.{uuid.uuid4().hex[:8]}.tmp")
    new.symlink_to(target)
    new.replace(link)
    fsync(link.parent)


def export(directory, out, check=True):
    """Write the sharded checkpoint in `directory` as one single-file checkpoint `out` (atomically), without the
    optimizer state; no process group needed. check: its files' sizes and CRC-32s first."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    directory = Path(directory).resolve()  # the link's target now: a save meanwhile switches the link, not this
    state = load_checkpoint(directory / STATE, weights=False)
    if check:
        _check_files(directory, state.get("files", {}))
    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    template = {"state_dict": {}, "model_ema": {"state_dict": {}}}
    targets = {"state_dict.": template["state_dict"], "model_ema.state_dict.": template["model_ema"]["state_dict"]}
    for key, entry in metadata.items():
        for prefix, target in targets.items():
            if key.startswith(prefix) and hasattr(entry, "size"):
                target[key[len(prefix) :]] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if not template["model_ema"]["state_dict"]:
        del template["model_ema"]
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(template, checkpoint_id=str(directory), no_dist=True)
    kept = ("epoch", "step_in_epoch", "arch", "num_classes", "classes", "seed", "best_acc1", "best_ema_acc1", "args")
    kept += ("best_epoch", "checkpoint_id")
    exported = {key: state[key] for key in kept if key in state}
    exported.update(exported_from=str(directory), state_dict=template["state_dict"])
    if "model_ema" in template:
        exported["model_ema"] = {
            "state_dict": template["model_ema"]["state_dict"],
            "n_averaged": state.get("model_ema", {}).get("n_averaged", 0),
        }
    atomic_write(Path(out), lambda file: torch.save(exported, file))
    return exported


def _load_whole(model, weights):
    """A single file's whole `weights` into the sharded `model`: each rank copies its shard of each parameter and the
    buffers whole; a key missing or too many, or a size that differs, refused. (DCP's full-state load refuses a model
    whose tensors are on two devices: --cpu-offload's parameters in host memory, its buffers on the GPU.)"""
    from torch.distributed.tensor import DTensor, distribute_tensor

    own = model.state_dict()  # (this rank's shards of the parameters, DTensors; the buffers whole)
    missing, unexpected = [name for name in own if name not in weights], [name for name in weights if name not in own]
    sizes = [
        f"{name} {list(weights[name].shape)} (the model's {list(own[name].shape)})"
        for name in own
        if name in weights and weights[name].shape != own[name].shape
    ]
    if missing or unexpected or sizes:
        raise RuntimeError(
            f"missing key(s): {', '.join(missing) or '-'}; unexpected key(s): {', '.join(unexpected) or '-'}; "
            f"size mismatch: {', '.join(sizes) or '-'}"
        )
    with torch.no_grad():
        for name, mine in own.items():
            if isinstance(mine, DTensor):  # (its shard of the whole, taken here: src_data_rank None, no collective)
                shard = distribute_tensor(weights[name], mine.device_mesh, mine.placements, src_data_rank=None)
                mine.to_local().copy_(shard.to_local())
            else:
                mine.copy_(weights[name])

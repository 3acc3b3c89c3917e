"""Starting a run, start_run(trainer) on every rank, in order: the writer rank takes the output directory's lock; the
ranks agree on their arguments; each loads the checkpoint --resume names, and they agree on it; on the CPU, malloc is
set to keep freed memory (distributed.keep_freed_host_memory); the seed is chosen; the data is scanned; a fresh start
that would replace a run is refused; Trainer.build, then the checkpoint's state. Ranks that disagree would meet in
collectives of other sizes or train apart: a difference ends every rank with one line naming it and the ranks on each
side (exit code 2).
"""

import difflib
import os
from pathlib import Path

from . import distributed, seeding
from .checkpoint import CHECKPOINT, PREVIOUS, check_format, restore
from .config import PER_NODE, evaluated_as_trained, flag
from .errors import NoRoom, UsageError, say
from .models import NEW_HEAD
from .run_dir import LOCK_WAIT_ON_RESTART, OutputLock, holds
from .sharded_checkpoint import LATEST
from .sharded_checkpoint import PREVIOUS as SHARDED_PREVIOUS
from .trainer import HOOKS, Trainer

RESTARTS = {"slurm": "SLURM_RESTART_COUNT", "torchrun": "TORCHELASTIC_RESTART_COUNT"}  # (distributed.job_ids' kinds)


def restarts():
    """The kinds of restart this process is of its job ("slurm": a requeue, "torchrun": its --max-restarts), if any."""
    return [kind for kind, name in RESTARTS.items() if os.environ.get(name, "0") not in ("", "0")]


def going_on_after_a_restart(trainer):
    """A restart's config: --resume auto where the directory's latest checkpoint is this job's (distributed.job_ids),
    whatever its first start's --overwrite or --resume said (was: torchrun's restart of a command with --overwrite began
    again at epoch 0 and deleted what the job had trained, exit 0)."""
    config = trainer.config
    there = trainer._checkpoints.existing(config.output_dir)
    kinds = restarts()
    if config.evaluate or (config.resume == "auto" and not config.overwrite) or not kinds or not there:
        return config
    current = {job for job in distributed.job_ids() if job.split()[0] in kinds}  # (a requeue's: Slurm's id alone)
    try:
        ours = set(trainer._checkpoints.peek(there[0]).get("job") or []) & current
    except UsageError:  # (damaged: as the command says)
        ours = None
    if not ours:
        return config
    given = "--overwrite" if config.overwrite else f"--resume {config.resume}" if config.resume else "no --resume"
    trainer.log.print(
        f"note: a restart of this job ({min(ours)}): it goes on from its checkpoint in {config.output_dir} (as "
        f"--resume auto); {given} was for its first start"
    )
    return config.replace(resume="auto", overwrite=False)


def take_output_dir(trainer):
    """(the writer rank's OutputLock or None, the line that refused it or None). A restarted job (a Slurm requeue,
    torchrun's restart) waits for the lock of the one it replaces: a lost node's lease, or its stop's checkpoint."""
    if not trainer.log.writes:
        return None, None
    try:
        wait = LOCK_WAIT_ON_RESTART if restarts() else 0
        node = " (with --save-on node, this job's other nodes write there too: give each node a disk of its own)"
        return OutputLock(trainer.config.output_dir, wait, say, node if trainer.config.save_on == "node" else ""), None
    except UsageError as failure:  # said by every rank, by check_start
        return None, failure


def load_agreed_checkpoint(trainer):
    """(path, checkpoint) that --resume names, or (None, None), loaded by every rank once the directory is this run's,
    and agreed on (a collective). Another format is refused, but for -e, which needs its weights alone."""
    config, error, path, checkpoint = trainer.config, None, None, None
    try:
        path, checkpoint = trainer._checkpoints.load_resume(config.resume, config.output_dir, warn=trainer.log.print)
        if checkpoint is not None and not config.evaluate:
            check_format(checkpoint, path)
            if "exported_from" in checkpoint:  # (was taken as weights from elsewhere: its epoch's start, all else new)
                raise UsageError(
                    f"--resume {path}: the weights of {checkpoint['exported_from']}, exported without the optimizer, "
                    "position and random streams a run goes on with: continue that run with train_fsdp.py --resume "
                    f"auto in its directory, or start a new one from these weights with --init-from {path}"
                )
    except UsageError as failure:
        error = str(failure)
    check_resume(resume_facts(path, checkpoint), error)
    if config.evaluate and checkpoint is None and not (config.pretrained or config.init_from):  # (auto found nothing)
        raise UsageError(
            f"-e: no checkpoint in {config.output_dir} to evaluate (--resume auto): give --resume PATH, --init-from "
            "PATH or --pretrained"
        )
    return path, checkpoint


def nothing_to_resume(output_dir):
    """The note of --resume auto that found no checkpoint: a fresh start; the runs beside it of the other scripts that
    resume each other's (their default --output-dir names the script) that hold one."""
    output_dir = Path(output_dir)
    mode, _, rest = output_dir.name.partition("-")
    modes = ("dp", "ddp", "spawn")  # (train_fsdp.py's resume no other's)
    beside = [output_dir.parent / f"{other}-{rest}" for other in modes if mode in modes and other != mode]
    held = [str(path) for path in beside if (path / CHECKPOINT).is_file()]
    return f"note: --resume auto found no checkpoint in {output_dir}: a fresh start" + (
        f"; {', '.join(held)} holds a run of another script: --output-dir {held[0]} --resume auto goes on with it"
        if held
        else ""
    )


def choose_seed(trainer, path, checkpoint):
    """The run's seed, the same on every rank: a resumed run keeps its checkpoint's (data order, augmentation
    and mixing follow it), saying so when --seed asks for another; else --seed, or one drawn by rank 0."""
    seed, saved = trainer.config.seed, (checkpoint or {}).get("seed")
    if saved is not None and not trainer.config.evaluate:
        if seed is not None and seed != saved:
            trainer.log.print(
                f"warning: --seed {seed} ignored: {path} was trained with seed {saved}, which this run "
                "keeps; another seed is another run (--overwrite or another --output-dir)"
            )
        seed = saved
    elif seed is None:
        seed = saved
    return distributed.shared_seed(seed)


# Each kind of run's own checkpoints (model_best.pth is both kinds'), by the scripts that write them.
CHECKPOINT_KINDS = {
    "train_dp.py, train_ddp.py or train_spawn.py": (CHECKPOINT, PREVIOUS),
    "train_fsdp.py": (LATEST, SHARDED_PREVIOUS),
}


def trained_outputs(output_dir, there):
    """What in `output_dir` a run left that is worth keeping: its checkpoint files `there` (model_best.pth), its
    summary.json. (Not log.csv's rows: an epoch's row may outlive its checkpoint, as with --async-checkpoint, whose
    save completes at the next one; a relaunch then starts over.)"""
    return [path.name for path in there] + (["summary.json"] if (output_dir / "summary.json").is_file() else [])


def refuse_a_finished_run_from_elsewhere(config, path, checkpoint):
    """Refuse --resume of another directory's checkpoint trained to --epochs: nothing to go on with here (was: its
    summary.json written into --output-dir, beside that directory's own run and log)."""
    if checkpoint is None or config.evaluate or holds(config.output_dir, path):
        return
    epoch, step = int(checkpoint.get("epoch", 0)), int(checkpoint.get("step_in_epoch", 0))
    if epoch >= config.epochs:
        stands = f"epoch {epoch}" + (f" step {step}" if step else "")
        weights = config.resume if Path(path).is_file() else "its export (tools/export_checkpoint.py)"
        raise UsageError(
            f"--resume {config.resume} stands at {stands} of --epochs {config.epochs}: nothing to train in "
            f"{config.output_dir}; give --epochs {epoch + 1} or more to train it further, -e to evaluate it, or "
            f"--init-from {weights} to start a new run from its weights"
        )


def refuse_to_replace_a_run(config, classes, checkpoints, resumed=False):
    """Refuse, unless --overwrite, a start that would replace the run in --output-dir: a relaunch that forgot --resume
    auto, --resume auto that found no checkpoint (`resumed`) where the run left outputs worth keeping, or --resume of
    a checkpoint from elsewhere."""
    output_dir = Path(config.output_dir)
    there = checkpoints.existing(output_dir)
    if config.evaluate or config.overwrite:
        return
    if config.resume == "auto" and not resumed:
        found = trained_outputs(output_dir, there)
        if found:
            raise UsageError(
                f"--resume auto: {output_dir} holds a run ({', '.join(found)}) but no checkpoint to continue "
                "it from: start over with --overwrite (its outputs are replaced) or another --output-dir"
            )
    ours = config.resume and holds(output_dir, config.resume)
    for script, names in CHECKPOINT_KINDS.items():  # (a link that names no directory, a checkpoint_prev alone too)
        found = [name for name in names if name not in checkpoints.names and os.path.lexists(output_dir / name)]
        if found and not ours and (config.resume != "auto" or not resumed):  # (--resume of elsewhere: refused)
            raise UsageError(
                f"{output_dir} holds a run of {script} ({', '.join(found)}): continue it with that script and "
                "--resume auto, or start over with --overwrite (its checkpoints are deleted) or another --output-dir"
            )
    if not there or config.resume == "auto" or ours:
        return
    try:
        other = checkpoints.peek(there[0])
    except UsageError:  # damaged: --resume auto falls back to the previous one, which is worth keeping
        other = None
    start_over = "start over with --overwrite (its checkpoints are deleted) or another --output-dir"
    if other and (other.get("arch") != config.arch or other.get("classes", classes) != classes):
        raise UsageError(
            f"{output_dir} holds checkpoints of another run ({other.get('arch')}, "
            f"{len(other.get('classes', []))} classes): choose another --output-dir, "
            f"continue that run with --resume, or {start_over}"
        )
    where = (
        f"at epoch {other.get('epoch', '?')} step {other.get('step_in_epoch', 0)}"
        if other
        else f"({', '.join(path.name for path in there)}; the first is damaged)"
    )
    if config.resume:  # another directory's checkpoint, whose run would replace this one's files (and mix its logs)
        raise UsageError(
            f"{output_dir} holds a run {where}, which --resume {config.resume} would replace: continue this run with "
            "--resume auto, or that checkpoint in another --output-dir (or here with --overwrite: this run's files "
            "are deleted)"
        )
    raise UsageError(f"{output_dir} holds a run {where}: continue it with --resume auto, or {start_over}")


def start_run(trainer):
    """Start `trainer`'s run (see the module's docstring). The writer rank holds the output directory's lock
    (trainer._output_lock) for the process's life: the kernel drops it when the process ends. Returns `trainer`."""
    config = trainer.config
    distributed.check_sync_bn(config.sync_bn, trainer.runtime.device)
    lock, error = take_output_dir(trainer)
    try:
        check_start(config, error)
        if lock is not None and lock.warning:
            say(lock.warning)
        trainer.config = config = going_on_after_a_restart(trainer)
        for line in library_replaced(type(trainer)):
            trainer.log.print(line)
        path, checkpoint = load_agreed_checkpoint(trainer)
        if config.evaluate and isinstance((checkpoint or {}).get("args"), dict):  # at the sizes it was trained with
            trainer.config = config = evaluated_as_trained(config, checkpoint["args"])
        # A resumed run keeps the determinism it was started with.
        trainer._deterministic = config.deterministic or bool((checkpoint or {}).get("deterministic"))
        seeding.set_determinism(trainer._deterministic)
        if config.keep_freed_memory:
            trainer.runtime.host_memory_kept = distributed.keep_freed_host_memory(trainer.runtime.device)
        seed = choose_seed(trainer, path, checkpoint)
        # What the run uses, as args.json and its checkpoints' args record it (were the ignored --seed, say).
        trainer.config = config = config.replace(seed=seed, deterministic=trainer._deterministic)
        datasets = trainer.build_datasets()
        refuse_to_replace_a_run(config, list(datasets[0]), trainer._checkpoints, resumed=checkpoint is not None)
        if config.resume == "auto" and checkpoint is None and not config.evaluate:
            trainer.log.print(nothing_to_resume(config.output_dir))
        trainer.build(datasets, seed, resuming=checkpoint is not None)
        new = [change for change in trainer._model_changes if change.endswith(NEW_HEAD)]
        if config.evaluate and checkpoint is None and new:  # (a checkpoint's weights replace them: a fine-tuned run's)
            raise UsageError(  # (was: a head of new weights evaluated, its chance figures given)
                f"-e of weights for other classes than the data's: the model's {new[0]}, which nothing trained: "
                "evaluate on data of the weights' classes, or fine-tune first"
            )
        if checkpoint is not None:
            restore(trainer, checkpoint, path)  # (its weights checked: another arch, other classes)
            refuse_a_finished_run_from_elsewhere(config, path, checkpoint)
            trainer.resumed_from = path
        trainer._output_lock = lock
        return trainer
    except BaseException:
        if lock is not None:
            lock.abandon()
        raise


def library_replaced(cls):
    """A warning naming the Trainer's own methods (not its HOOKS) that the subclass `cls` replaces (a helper of one's
    own named `save` had turned every checkpoint off, exit 0), and one for each method of its own named as a hook
    misspelt."""
    names = [
        name
        for name, method in vars(Trainer).items()
        if callable(method) and not name.startswith("__") and name not in HOOKS and getattr(cls, name) is not method
    ]
    kinds = [kind for kind in cls.__mro__ if issubclass(kind, Trainer) and kind is not Trainer]
    methods = [(name, value) for kind in kinds for name, value in vars(kind).items()]  # (each class's: super() calls)

    def called(name):  # (by another of its methods: its own code may call a helper of the same name, recurse)
        return any(name in _names_used(value) for other, value in methods if other != name)

    misspelt = {  # (a build_optimiser of one's own: never called, the default's SGD trained, without a word)
        name: close[0]
        for name in {name for name, _ in methods} - set(vars(Trainer))
        for close in [difflib.get_close_matches(name, HOOKS, 1, 0.85)]
        if close and not called(name)
    }
    return [
        f"warning: {cls.__name__} replaces the Trainer's own {', '.join(names)} (not hooks: the loops call them; "
        "docs/adapting.md): the tests no longer cover this run; give a method of your own another name"
    ] * bool(names) + [
        f"warning: {cls.__name__}.{name} is not a hook, and nothing calls it: did you mean {hook}?"
        for name, hook in sorted(misspelt.items())
    ]


def _names_used(value):
    """The names that the code of `value` reads (self.NAME among them, and strings: getattr(self, "NAME")): a function,
    those it defines and wraps, a property's or a cached_property's."""
    found = [value]
    for name in ("__func__", "fget", "fset", "func", "__wrapped__"):  # (method kinds, properties, decorators)
        found += [getattr(part, name) for part in list(found) if getattr(part, name, None) is not None]
    codes, names = [part.__code__ for part in found if hasattr(part, "__code__")], set()
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        names.update(constant for constant in code.co_consts if isinstance(constant, str))
        codes += [constant for constant in code.co_consts if hasattr(constant, "co_names")]
    return names


# The ranks' agreement on their arguments and checkpoint.

_MISSING = "(not given)"


PLAIN = (str, int, float, bool, type(None), list, tuple, dict)


def comparable_args(config):
    """The arguments that every rank must have alike (all but config.PER_NODE's), as a plain dict (a value of
    another type, which a --trainer's own flag may hold, as its repr)."""
    return {
        name: value if isinstance(value, PLAIN) else repr(value)
        for name, value in sorted(vars(config).items())
        if name not in PER_NODE
    }


def ranks_text(ranks):
    """'rank 3', 'ranks 0-3', 'ranks 0, 2, 5-7'."""
    spans, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            spans.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def _grouped(values, show):
    """'8 on ranks 0-3, 16 on rank 4' for the per-rank `values` (in order of first appearance)."""
    groups = {}
    for rank, value in enumerate(values):
        groups.setdefault(repr(value), (value, []))[1].append(rank)
    return ", ".join(f"{show(value)} on {ranks_text(ranks)}" for value, ranks in groups.values())


def argument_difference(per_rank):
    """One line for the first argument (in name order) that differs between the ranks' comparable_args, else None."""
    for name in sorted(set().union(*per_rank)):
        values = [arguments.get(name, _MISSING) for arguments in per_rank]
        if any(value != values[0] for value in values):
            shown = _grouped(values, lambda value: "unset" if value is None else str(value))
            allowed = ", ".join(flag(name) for name in ("workers", "data")) + " and --output-dir"
            return (
                f"the processes of this job were started with different arguments: {flag(name)} is {shown}; "
                f"every process takes the same ones (only {allowed} may differ between nodes)"
            )
    return None


def resume_facts(path, checkpoint):
    """What identifies the checkpoint a rank resumes from (None: it starts afresh)."""
    if checkpoint is None:
        return None
    return {
        "path": str(path),
        "epoch": int(checkpoint.get("epoch", 0)),
        "step": int(checkpoint.get("step_in_epoch", 0)),
        "seed": checkpoint.get("seed"),
        "id": checkpoint.get("checkpoint_id"),
    }


def _position(facts):
    if facts is None:
        return "no checkpoint (a fresh start)"
    step = f" step {facts['step']}" if facts["step"] else ""
    return f"{facts['path']} (epoch {facts['epoch']}{step}, seed {facts['seed']})"


def resume_difference(per_rank):
    """One line when the ranks loaded different checkpoints (or some loaded none), else None."""
    keys = [
        None if facts is None else (facts["epoch"], facts["step"], facts["seed"], facts["id"]) for facts in per_rank
    ]
    if all(key == keys[0] for key in keys):
        return None
    shown = {repr(key): facts for key, facts in zip(keys, per_rank)}
    return (
        "the processes of this job would resume from different checkpoints: "
        + _grouped(keys, lambda key: _position(shown[repr(key)]))
        + "; a job resumes from one checkpoint: give every node a copy of the same one (--save-on node), "
        "or name it with --resume PATH"
    )


def check_start(config, error):
    """The job's first collective: every rank gives its arguments and the error that stopped its start-up or None; a
    difference, or any rank's error, is raised on every rank as one UsageError (NoRoom where a disk was full: exit
    code 1), so none waits for another."""
    mine = {"args": comparable_args(config), "error": error and str(error), "no_room": isinstance(error, NoRoom)}
    gathered = distributed.all_gather_object(mine)
    line = argument_difference([rank["args"] for rank in gathered]) or distributed.first_error(gathered)
    if line is not None:
        raise (NoRoom if any(rank["no_room"] for rank in gathered) else UsageError)(line)


def check_resume(resumed_from, error):
    """A collective: a rank's error loading its checkpoint, or ranks that loaded different ones (resume_facts), raised
    on every rank."""
    gathered = distributed.all_gather_object({"resume": resumed_from, "error": error})
    line = distributed.first_error(gathered) or resume_difference([rank["resume"] for rank in gathered])
    if line is not None:
        raise UsageError(line)

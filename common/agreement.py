"""What the processes of a job check together before they train: the same arguments, the same checkpoint.

Ranks started with different arguments (a platform that sets BATCH_SIZE differently on one node, a typo
in one node's command) would otherwise meet in a collective of another size: gloo aborts with
"Received data size doesn't match expected size", NCCL may hang. Ranks that loaded different checkpoints
(--save-on node and a node that holds an older one, a read error on one rank that fell back to
checkpoint_prev.pth) would train on: DDP gives them rank 0's weights, but each keeps its own momentum,
lr step, epoch and data order. So the first collective of a run compares both, and a mismatch ends every
rank with one line that names the first difference and the ranks on each side (exit code 2).
"""
from . import distributed
from .config import PER_NODE, flag
from .errors import UsageError

_MISSING = "(not given)"


PLAIN = (str, int, float, bool, type(None), list, tuple, dict)


def comparable_args(config):
    """The arguments that every rank must have alike (all but config.PER_NODE's), as a plain dict (a value of
    another type, which a --trainer's own flag may hold, as its repr)."""
    return {name: value if isinstance(value, PLAIN) else repr(value)
            for name, value in sorted(vars(config).items()) if name not in PER_NODE}


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
    """One line for the first argument (in name order) that differs between the ranks' comparable_args
    dicts, else None."""
    names = sorted(set().union(*per_rank))
    for name in names:
        values = [arguments.get(name, _MISSING) for arguments in per_rank]
        if any(value != values[0] for value in values):
            shown = _grouped(values, lambda value: "unset" if value is None else str(value))
            allowed = ", ".join(flag(name) for name in ("workers", "data")) + " and --output-dir"
            return (f"the processes of this job were started with different arguments: {flag(name)} is {shown}; "
                    f"every process takes the same ones (only {allowed} may differ between nodes)")
    return None


def resume_facts(path, checkpoint):
    """What identifies the checkpoint a rank resumes from (None: it starts afresh)."""
    if checkpoint is None:
        return None
    return {"path": str(path), "epoch": int(checkpoint.get("epoch", 0)), "step": int(checkpoint.get("step_in_epoch", 0)),
            "seed": checkpoint.get("seed"), "id": checkpoint.get("checkpoint_id")}


def _position(facts):
    if facts is None:
        return "no checkpoint (a fresh start)"
    step = f" step {facts['step']}" if facts["step"] else ""
    return f"{facts['path']} (epoch {facts['epoch']}{step}, seed {facts['seed']})"


def resume_difference(per_rank):
    """One line when the ranks loaded different checkpoints (or some loaded none), else None."""
    keys = [None if facts is None else (facts["epoch"], facts["step"], facts["seed"], facts["id"]) for facts in per_rank]
    if all(key == keys[0] for key in keys):
        return None
    shown = {repr(key): facts for key, facts in zip(keys, per_rank)}
    return ("the processes of this job would resume from different checkpoints: "
            + _grouped(keys, lambda key: _position(shown[repr(key)]))
            + "; a job resumes from one checkpoint: give every node a copy of the same one (--save-on node), "
              "or name it with --resume PATH")


def _first_error(gathered):
    """The first rank's error line (prefixed with its rank on the others), or None."""
    for rank, facts in enumerate(gathered):
        if facts["error"] is not None:
            return facts["error"] if rank == distributed.get_rank() else f"rank {rank}: {facts['error']}"
    return None


def check_start(config, error):
    """The job's first collective: every rank gives its arguments and the error that stopped its start-up (the
    writer's --output-dir locked by another run) or None. A difference, or any rank's error, is raised on every
    rank as one UsageError, so no rank is left waiting for another."""
    gathered = distributed.all_gather_object({"args": comparable_args(config), "error": error})
    line = argument_difference([rank["args"] for rank in gathered]) or _first_error(gathered)
    if line is not None:
        raise UsageError(line)


def check_resume(resumed_from, error):
    """Every rank gives the checkpoint it loaded (resume_facts) and the error of its loading or None: a rank's
    error, or ranks that loaded different checkpoints, are raised on every rank (a collective)."""
    gathered = distributed.all_gather_object({"resume": resumed_from, "error": error})
    line = _first_error(gathered) or resume_difference([rank["resume"] for rank in gathered])
    if line is not None:
        raise UsageError(line)


def raise_any(error):
    """A collective: every rank gives the error (a line) that stops it, or None; the first rank's is raised on
    every rank, so none is left waiting for another."""
    line = _first_error(distributed.all_gather_object({"error": error}))
    if line is not None:
        raise UsageError(line)

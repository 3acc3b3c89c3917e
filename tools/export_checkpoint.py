"""Export a sharded checkpoint of train_fsdp.py as one plain file: the whole weights (and the EMA's), loadable with
torch.load(..., weights_only=True) into the torchvision model, and by every script's -e --resume.

    python tools/export_checkpoint.py runs/fsdp-vit_b_16-imagenet/checkpoint model.pth

No process group and no GPU are needed: the shards of every rank are read from the directory and put together.
The optimizer state stays in the sharded checkpoint. model_best.pth is written this way at each best epoch.
"""

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.errors import UsageError, console_never_fails
from shared import Stopped, stop_on_signals


def file_to_write(text):
    """The file OUT (`text`) names: a link's target, written in its place (the link kept). UsageError where writing
    it would be no file of its own: a folder (or the run's `checkpoint` link, which a file would replace: the run
    could not resume), a device, a pipe or a socket (a file would replace it), a file inside a sharded checkpoint (its
    state.pth), or a folder that does not exist."""
    out = Path(text)
    if out.is_dir():
        raise UsageError(f"OUT {out} is a folder{' (a link to one)' if out.is_symlink() else ''}: give a file name")
    if text.endswith(os.sep):
        raise UsageError(f"OUT {text} ends in {os.sep}, as a folder's name: give a file name")
    from common.sharded_checkpoint import is_sharded

    try:
        target = out.resolve()
    except (OSError, RuntimeError):  # (Python 3.11: RuntimeError for a loop of links)
        raise UsageError(f"OUT {out} is a loop of links: give a file name") from None
    if target.exists() and not target.is_file():
        raise UsageError(f"OUT {out} is not a file (a device, a pipe or a socket): give a file name")
    if is_sharded(target.parent):
        raise UsageError(f"OUT {out} lies inside a sharded checkpoint: write it elsewhere (the run resumes from there)")
    if not target.parent.is_dir():
        raise UsageError(f"OUT {out}: no folder {target.parent if out.is_symlink() else out.parent}")
    return target


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__ and __doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a sharded checkpoint's directory (OUTPUT/checkpoint: the latest)")
    parser.add_argument("out", help="the file to write (atomically)")
    args = parser.parse_args(argv)
    from torch.distributed.checkpoint.api import CheckpointException

    from common.sharded_checkpoint import export, is_sharded

    before = stop_on_signals()
    try:
        if not is_sharded(args.checkpoint):
            raise UsageError(
                f"{args.checkpoint} is not a sharded checkpoint of train_fsdp.py (a directory holding "
                "state.pth and DCP's .metadata)"
            )
        exported = export(args.checkpoint, file_to_write(args.out))
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (OSError, CheckpointException) as error:  # a shard or .metadata missing or damaged, OUT not writable
        reason = getattr(error, "strerror", None) or " ".join(str(error).split())[:300]
        print(f"error: cannot export {args.checkpoint} to {args.out}: {reason}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Stopped) as stopped:  # (the temporary beside OUT removed: run_dir.write_synced)
        print(f"stopped: {args.out} not written", file=sys.stderr)
        return 130 if isinstance(stopped, KeyboardInterrupt) else 143
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    ema = " and the EMA's" if "model_ema" in exported else ""
    step = f" and {exported['step_in_epoch']} step(s)" if exported.get("step_in_epoch") else ""
    print(
        f"wrote {args.out}: {exported.get('arch')} weights{ema} after {exported.get('epoch')} epoch(s){step} "
        f"({len(exported['state_dict'])} tensors) from {Path(args.checkpoint).resolve()}"
    )
    return 0


if __name__ == "__main__":
    console_never_fails()  # (`| head`, a full device: ends nothing)
    sys.exit(main())

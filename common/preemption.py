"""Stopping cleanly when the cluster asks.

SIGTERM (sent by torchrun, Slurm and Kubernetes before they kill) and SIGUSR1
(Slurm's `--signal` warning) set a flag. The ranks agree on it with an
all-reduce that is started at one step and read at the next, so no step
waits for it; every rank then stops after the same step, rank 0 saves a
checkpoint, and the process exits with args.PREEMPTED_EXIT_CODE (75).
"""
import signal
import threading

import torch
import torch.distributed as dist

from . import distributed

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def ignore_stop_signals(_worker_id=None):
    """DataLoader workers leave stopping to the training process (as worker_init_fn)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


class StopSignal:
    def __init__(self):
        self.received = None  # name of the signal, once one came
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._handle)
        # A CPU group of its own, so the flag never waits on GPU work.
        self.group = dist.new_group(backend="gloo") if distributed.is_initialized() else None
        self.pending = None

    def _handle(self, signum, _frame):
        self.received = signal.Signals(signum).name

    def poll(self):
        """True when some rank had received a stop signal by the previous poll (the same answer
        on every rank). Every rank must call it at the same steps."""
        if self.group is None:
            return self.received is not None
        agreed = False
        if self.pending is not None:
            work, flag = self.pending
            work.wait()
            agreed = bool(flag.item())
        flag = torch.tensor([int(self.received is not None)])
        self.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        return agreed

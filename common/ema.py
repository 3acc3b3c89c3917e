"""--model-ema: an exponential moving average of the weights, kept, evaluated and checkpointed beside them.

Built as torchvision's references/classification/train.py builds it: torch.optim.swa_utils.AveragedModel
with its EMA helper, over parameters and buffers (BatchNorm statistics), updated every --model-ema-steps
optimizer steps, its decay adjusted for the batch, the update interval and the epochs, and restarted from
the weights at every update of the warmup epochs. As there, it updates after the steps of an epoch whose
index in the epoch is a multiple of --model-ema-steps (0, N, 2N, ...), so a run resumed mid-epoch updates
at the steps an uninterrupted one did.
"""
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


def adjusted_decay(decay, global_batch, every, epochs):
    """The decay per update, as torchvision's train.py adjusts --model-ema-decay (after pycls): the EMA
    spans about the same share of the run whatever the batch, the update interval and the epochs.
    torchvision's world_size x per-GPU batch is our global -b."""
    adjust = global_batch * every / epochs
    alpha = min(1.0, (1.0 - decay) * adjust)
    return 1.0 - alpha


def by_kind(update):
    """`update` (a multi_avg_fn) called apart for sharded tensors (DTensors: a sharded model's parameters) and plain
    ones (its buffers): one foreach call cannot take both."""
    def split(averaged, current, count):
        for sharded in (True, False):
            pairs = [(mine, theirs) for mine, theirs in zip(averaged, current) if hasattr(mine, "to_local") == sharded]
            if pairs:
                update([mine for mine, _ in pairs], [theirs for _, theirs in pairs], count)
    return split


class ModelEma:
    """The EMA of the bare `model` (not a DataParallel / DDP wrapper: the same parameters, without prefixes).

    `module` is a model of the same class: evaluate it, or load its state_dict into a plain model."""

    def __init__(self, model, decay, every=1, warmup_epochs=0.0):
        self.model, self.decay, self.every, self.warmup_epochs = model, decay, every, warmup_epochs
        # device=None: the copy stays where the model is, n_averaged on the CPU. An update waits for the
        # GPU once (AveragedModel copies n_averaged there), as torchvision's does: once per --model-ema-steps.
        self.averaged = AveragedModel(model, multi_avg_fn=by_kind(get_ema_multi_avg_fn(decay)), use_buffers=True)

    @property
    def module(self):
        return self.averaged.module

    @property
    def n_averaged(self):
        return int(self.averaged.n_averaged)

    def after_step(self, step, epoch):
        """After the optimizer step numbered `step` (from 0, in its epoch) of `epoch`: at steps 0, every,
        2 x every, ... of each epoch (torchvision's `i % args.model_ema_steps == 0`) the EMA moves towards the
        weights. During the warmup epochs it restarts from them each time (torchvision resets n_averaged to
        0, so the next update copies the weights). Returns whether it updated."""
        if step % self.every:
            return False
        self.averaged.update_parameters(self.model)
        if epoch < self.warmup_epochs:
            self.averaged.n_averaged.fill_(0)
        return True

    def state_dict(self):
        """The EMA's weights, with the bare model's keys (they load into a plain model), and the count of its
        updates since it last restarted."""
        return {"state_dict": self.module.state_dict(), "n_averaged": self.n_averaged}

    def restart(self, n_averaged=0, copy=True):
        """Set the count of updates (a checkpoint's); copy=True: the weights' values first, as a new EMA has them
        (in place: a sharded model, which cannot be deep-copied, and its sharded copy alike)."""
        if copy:
            for mine, theirs in zip([*self.module.parameters(), *self.module.buffers()],
                                    [*self.model.parameters(), *self.model.buffers()]):
                mine.detach().copy_(theirs.detach())
        self.averaged.n_averaged.fill_(n_averaged)

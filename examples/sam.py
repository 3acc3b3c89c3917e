"""Sharpness-aware minimisation (SAM, Foret et al., 2021) in the optimizer_step hook: `--trainer examples.sam:SAM`.

    torchrun --standalone --nproc-per-node 2 train_ddp.py --trainer examples.sam:SAM --sam-rho 0.05

optimizer_step runs once the step's gradients are summed over its micro-batches (--grad-accum-steps) and averaged over
the ranks. SAM moves the weights by --sam-rho along the normalised gradient, takes the gradient there (closure(): the
step's forwards and backwards again, from zeroed gradients), moves the weights back, and lets the optimizer step with
that gradient (the base class's optimizer_step: clipping, then the optimizer). Two forwards per step: twice the cost,
and BatchNorm's running statistics updated at the moved weights too. Not with --amp fp16 (a scaled gradient that
overflowed would move the weights by inf before the scaler skips the step) or train_fsdp.py (sharded gradients).
"""

import torch

from common.cli import number_in
from common.errors import UsageError
from common.trainer import Trainer


class SAM(Trainer):
    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument(
            "--sam-rho",
            type=number_in(0, 10),
            default=0.05,
            metavar="RHO",
            help="the radius of SAM's step up the gradient (%(default)s)",
        )

    def build_optimizer(self, model):
        if self.config.amp == "fp16" or self.shard is not None:
            raise UsageError("examples.sam: not with --amp fp16 (use bf16) or train_fsdp.py")
        return super().build_optimizer(model)

    def optimizer_step(self, model, closure):
        parameters = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if parameters:
            norm = torch.linalg.vector_norm(torch.stack([p.grad.detach().norm() for p in parameters]))
            with torch.no_grad():
                weights = [p.detach().clone() for p in parameters]
                for parameter in parameters:
                    parameter.add_(parameter.grad * (self.config.sam_rho / (norm + 1e-12)))
            closure()  # the gradient at the moved weights
            with torch.no_grad():
                for parameter, weight in zip(parameters, weights):
                    parameter.copy_(weight)  # (exactly back: p + m - m rounds)
        super().optimizer_step(model, closure)

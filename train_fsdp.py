"""Train an image classifier with FSDP2: one process per device, started by torchrun, the model sharded over them.

    torchrun --standalone --nproc_per_node=8 train_fsdp.py --data /path/to/imagenet -a vit_h_14 -b 256 --amp bf16
    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=8 --rdzv-endpoint=HOST:29500 train_fsdp.py ...
    torchrun --standalone --nproc_per_node=2 train_fsdp.py                   # no GPU: 2 CPU processes, gloo

The launch is train_ddp.py's (torchrun, or srun with one task per GPU). What differs: DDP keeps a whole replica of
the model, its gradients and optimizer state in every process; FSDP (fully_shard) gives each process 1/N of each,
gathering a block's parameters only while it computes (docs/concepts.md says when that pays). Every rank trains on
its own shard of each batch, as under DDP, and the numbers are DDP's (in float32; docs/concepts.md: under bf16).

Where each FSDP essential lives: the process group and device as in train_ddp.py (its setup()); fully_shard,
block by block then the root, in common/fsdp.py (Sharding, which Trainer.build applies before the optimizer is made
over the shards; the blocks: Trainer.shard_units); the sharded checkpoints, every rank writing its shard through
Distributed Checkpoint, in common/sharded_checkpoint.py; the rest is the Trainer's (common/trainer.py), as under DDP.
Your own model, data, loss or optimizer: docs/adapting.md.
"""

import sys

from common import cli, launch  # torch is imported after the arguments are parsed: --help is instant
from train_ddp import setup  # the processes start and join the group as train_ddp.py's do


def parse_args(argv=None):
    parser = cli.build_parser(__doc__ and __doc__.splitlines()[0])
    return cli.parse_args(parser, argv, mode="fsdp")


def main(config):
    from common.distributed import destroy_process_group
    from common.fsdp import Sharding
    from common.run import start_run
    from common.sharded_checkpoint import ShardedCheckpoints
    from common.trainer import trainer_class

    runtime = setup(config, mode="fsdp")
    finished = False
    try:
        # The Trainer shards the model as it builds it, before its optimizer is made over the shards; every rank
        # writes its shard of each checkpoint.
        trainer = start_run(
            trainer_class(config.trainer)(
                config, runtime, shard=Sharding(config, runtime), checkpoints=ShardedCheckpoints(config)
            )
        )
        # The sharded model trains and validates as it is: its forward is a collective, so every rank validates
        # as many batches as the others (the Trainer adds uncounted ones where a rank's shard is shorter).
        trainer.fit(train_model=trainer.model, eval_model=trainer.model)
        finished = True
    finally:
        destroy_process_group(finished)


if __name__ == "__main__":
    sys.exit(launch.run_main(main, parse_args))

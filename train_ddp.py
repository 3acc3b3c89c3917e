"""Train an image classifier with DistributedDataParallel: one process per device, started by torchrun.

    torchrun --standalone --nproc_per_node=4 train_ddp.py --data /path/to/imagenet -a resnet50 -b 256
    torchrun --nnodes=2 --node-rank=0 --nproc_per_node=8 --rdzv-endpoint=HOST:29500 train_ddp.py ...
    python -m torch.distributed.launch --nproc_per_node=4 train_ddp.py ...   # the legacy launcher
    torchrun --standalone --nproc_per_node=2 train_ddp.py                   # no GPU: 2 CPU processes, gloo

The launcher starts the processes and gives each one RANK (global), LOCAL_RANK
(on its node: which GPU) and WORLD_SIZE, plus MASTER_ADDR/MASTER_PORT to meet
at. Every process holds a full replica of the model, trains on its own shard
of each batch, and DDP averages the gradients over all processes during
backward(). Under Slurm, `srun` with one task per GPU works too (SLURM_PROCID,
SLURM_LOCALID, SLURM_NTASKS; MASTER_ADDR/MASTER_PORT exported by the job script).

Where each DDP essential lives: init_process_group and torch.cuda.set_device in setup() below
(common/distributed.py's init_process_group); the DistributedDataParallel wrap in main() below;
DistributedSampler (ResumableSampler, common/samplers.py) and its set_epoch in Trainer.train_one_epoch
(common/trainer.py), as is the optimizer step; the save by rank 0 alone in Trainer.save; destroy_process_group
in main(). Your own model, data, loss or optimizer: docs/adapting.md.
"""

import os
import sys

from common import cli, launch  # torch is imported after the arguments are parsed: --help is instant
from common.errors import UsageError


def parse_args(argv=None):
    parser = cli.build_parser(__doc__ and __doc__.splitlines()[0])
    return cli.parse_args(parser, argv, mode="ddp")


def setup(config, mode="ddp"):
    """Join the process group that the launcher set up (env:// reads MASTER_ADDR/PORT). train_fsdp.py's processes
    are started and join alike (mode "fsdp")."""
    from common.data import micro_batch
    from common.distributed import (
        Runtime,
        check_env_rendezvous,
        choose_backend,
        init_process_group,
        local_world_size_from_env,
        select_device,
        world_info_from_env,
    )

    rank, local_rank, world_size = world_info_from_env()
    local = "LOCAL_RANK" if "RANK" in os.environ else "SLURM_LOCALID"  # (as world_info_from_env reads them)
    if config.save_on == "node" and world_size > 1 and local not in os.environ:
        raise UsageError(  # (RANK stood in for it: the nodes past the first wrote nothing)
            "--save-on node: LOCAL_RANK is not set (torchrun and srun set it), so no process knows whether it is "
            "its node's first, which writes: set it, or leave --save-on node out"
        )
    if world_size == 1 and not os.environ.get("MASTER_ADDR"):  # `python train_ddp.py`: a group of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]  # (empty: unset)
    if missing:
        raise UsageError(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: start this script with "
            "torchrun, or export them in the job script when srun starts it"
        )
    # Rank 0 listens where srun (or a user) started the tasks; under torchrun its agent does.
    check_env_rendezvous(world_size, rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True")
    device = select_device(config.device, local_rank)
    backend = choose_backend(config.dist_backend, device)
    micro_batch(config.batch_size, world_size, config.grad_accum_steps)  # fail before the rendezvous, not after
    local_world_size = local_world_size_from_env(world_size)
    init_process_group(
        backend, "env://", rank, world_size, device, config.dist_timeout, local_world_size, config.output_dir
    )
    return Runtime(mode, device, rank, local_rank, world_size, local_world_size)


def main(config):
    from torch.nn.parallel import DistributedDataParallel

    from common.distributed import destroy_process_group
    from common.run import start_run
    from common.trainer import trainer_class

    runtime = setup(config)
    model, finished = None, False
    try:
        trainer = start_run(trainer_class(config.trainer)(config, runtime))
        # DDP keeps the replicas equal by all-reducing gradients in buckets during backward.
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets, saving a copy per step.
        # find_unused_parameters: for models whose forward leaves some parameters out (--find-unused-parameters).
        model = DistributedDataParallel(
            trainer.model,
            device_ids=device_ids,
            gradient_as_bucket_view=True,
            find_unused_parameters=config.find_unused_parameters,
        )
        # Evaluate the bare model: ranks hold shards of different sizes, and DDP's
        # forward would wait for the others.
        trainer.fit(train_model=model, eval_model=trainer.model)
        finished = True
    finally:
        # DDP's reducer holds the process group: freed first, or the group ends with it, inside a destructor that
        # holds Python's lock (see destroy_process_group).
        model = None
        destroy_process_group(finished)


if __name__ == "__main__":
    sys.exit(launch.run_main(main, parse_args))

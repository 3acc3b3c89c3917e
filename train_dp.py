"""Train an image classifier with nn.DataParallel: one process drives every GPU.

    python train_dp.py                                  # the built-in demo set, on CPU or all GPUs
    python train_dp.py --data /path/to/imagenet -a resnet50 -b 256 --gpus 0,1,2,3

DataParallel splits each batch over the GPUs, runs a replica of the model on
each, and gathers the outputs on the first one. It is one line of code, but
the first GPU does more work than the others and one Python process feeds
them all; train_ddp.py (one process per GPU) is faster. With no GPU this
script runs on the CPU.
"""

import sys

from common import cli, launch  # torch is imported after the arguments are parsed: --help is instant
from common.errors import UsageError


def parse_args(argv=None):
    parser = cli.build_parser(__doc__ and __doc__.splitlines()[0])
    parser.add_argument(
        "--gpus",
        type=cli.indices,
        default=None,
        metavar="0,1,..",
        help="GPU ids to use (default: every visible GPU)",
    )
    return cli.parse_args(parser, argv, mode="dp")


def setup(config):
    """The device list: every visible GPU (or --gpus); none on the CPU."""
    import torch

    from common.distributed import select_device

    device = select_device(config.device)
    if device.type == "cpu":
        if config.gpus:
            raise UsageError(
                f"--gpus {','.join(map(str, config.gpus))} asked for, but this run uses "
                f"no GPU ({torch.cuda.device_count()} visible)"
            )
        return device, []
    visible = list(range(torch.cuda.device_count()))
    gpus = config.gpus if config.gpus is not None else visible
    missing = [gpu for gpu in gpus if gpu not in visible]
    if missing:
        raise UsageError(f"--gpus names GPU {missing[0]}, but the visible GPUs are {visible}")
    if config.sync_bn and len(gpus) > 1:
        raise UsageError(
            "DataParallel cannot synchronise BatchNorm over GPUs: use train_ddp.py or train_spawn.py for --sync-bn"
        )
    if config.compile and len(gpus) > 1:
        raise UsageError(
            f"--compile does not work with DataParallel over {len(gpus)} GPUs: "
            "use train_ddp.py (torchrun), or --gpus with one GPU"
        )
    # The model and each batch go to the first GPU; DataParallel scatters from there.
    torch.cuda.set_device(gpus[0])
    return torch.device("cuda", gpus[0]), gpus


def main(config):
    import torch.nn as nn

    from common.distributed import Runtime
    from common.models import AutocastForward
    from common.run import start_run
    from common.trainer import trainer_class

    device, gpus = setup(config)
    runtime = Runtime("dp", device, num_devices=max(len(gpus), 1), device_ids=tuple(gpus))
    trainer = start_run(trainer_class(config.trainer)(config, runtime))
    model = trainer.model
    if len(gpus) == 1 and config.compile:
        trainer.log.print("one GPU and --compile: the bare model is compiled (DataParallel would split the graph)")
    elif gpus:
        if config.amp != "none":
            # DataParallel's replica threads would each enter autocast with float16: the replicas
            # must set the --amp dtype themselves.
            model = AutocastForward(model, device.type, config.amp)
        model = nn.DataParallel(model, device_ids=gpus, output_device=gpus[0])
    else:
        trainer.log.print("no GPU in use: the bare model runs on the CPU (DataParallel needs GPUs)")
    return trainer.fit(train_model=model, eval_model=model)


if __name__ == "__main__":
    sys.exit(launch.run_main(main, parse_args))

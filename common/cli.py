"""The command line the three scripts share: parsing alone, into a frozen Config (common/config.py). argparse
converts each value to its type; the rules on the values, whatever gave them, are checked in config.py alone.

Flag names follow pytorch/examples' imagenet/main.py where they overlap. Defaults come, in order of
precedence, from: the command line, the platform's environment variables (EPOCHS, LR, BATCH_SIZE,
DATASETS_PATH + DATASETS, WORKSPACE, BACKEND; train_spawn.py also WORKER_PER_NODE, MASTER_ADDR, MASTER_PORT),
and the presets (common/config.py). This module imports no torch: --help and usage errors are instant.
"""

import argparse

from .config import RECIPES, resolve
from .errors import UsageError, import_named, replaces


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line instead of argparse's usage block.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def floats(text):
    """--mean / --std: numbers separated by commas (an argparse type)."""
    return _numbers(text, float, "numbers")


def indices(text):
    """train_dp.py's --gpus: whole numbers separated by commas (an argparse type)."""
    return _numbers(text, int, "whole numbers")


def _numbers(text, kind, what):
    try:
        return [kind(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what} separated by commas, got {text!r}") from None


def number_in(low, high, low_open=False):
    """An argparse type for a --trainer's own flag: a number in [low, high] ((low, high] with low_open), else
    argparse's one line (`type=number_in(0, 1)`)."""

    def number(text):
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not ((low < value) if low_open else (low <= value)) or not value <= high:  # (nan: neither)
            raise argparse.ArgumentTypeError(f"{text} is not in {'(' if low_open else '['}{low:g}, {high:g}]")
        return value

    return number


def workers_count(text):
    """-j: 'auto' or a whole number (an argparse type; config checks that it is 0 or more)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number, got {text!r}") from None


def build_parser(description):
    """The shared flags; each script adds its launch flags to the returned parser."""
    parser = Parser(description=description)
    for group in (_data_flags, _model_flags, _training_flags, _run_flags, _device_flags, _diagnostics_flags):
        group(parser.add_argument)
    _recipe_flags(parser)
    # torch.distributed.launch passes --local-rank (--local_rank before torch 2.0) to any script: LOCAL_RANK in the
    # environment says the same, and is what train_ddp.py reads; train_dp.py and train_spawn.py then say in one line
    # that it is not their launcher (was: argparse's "unrecognized arguments: --local-rank=0" from every process).
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(parser, argv=None, mode="dp"):
    """The frozen Config of `argv` for a script of `mode` (dp, ddp, spawn); UsageError for a value that breaks a
    rule. A --trainer class adds its own flags (Trainer.add_arguments) before the command line is parsed."""
    chosen_trainer = argparse.ArgumentParser(add_help=False)
    chosen_trainer.add_argument("--trainer")
    name = chosen_trainer.parse_known_args(argv)[0].trainer
    found = import_named(name, "--trainer", builtin=False) if name else None  # (imports torch, if any)
    add_arguments = getattr(found, "add_arguments", None)
    try:
        if mode == "fsdp":
            _fsdp_flags(parser.add_argument_group("FSDP (train_fsdp.py)").add_argument)
        ours = [action for action in parser._actions if action.option_strings or action.dest == "data_positional"]
        if add_arguments is not None:
            add_arguments(parser.add_argument_group(f"--trainer {name}"))
    except argparse.ArgumentError as error:  # (was a traceback)
        raise UsageError(f"--trainer {name}'s add_arguments: {error}: give yours another name") from None
    namespace = parser.parse_args(argv)
    empty = next((action for action in ours if getattr(namespace, action.dest, None) == ""), None)
    if empty is not None:  # (the scripts' own flags: was taken as not given, without a word)
        shown = max(empty.option_strings, key=len) if empty.option_strings else empty.metavar
        raise UsageError(f"{shown} is empty: give a value, or leave it out")
    return resolve(namespace, mode, own_data=found is not None and replaces(found, "build_datasets"))


def _fsdp_flags(add):
    """The sharding's options (common/fsdp.py, common/sharded_checkpoint.py)."""
    add(
        "--reshard-after-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="free each unit's gathered parameters after its forward and gather them again for backward (ZeRO-3: "
        "least memory); --no-reshard-after-forward keeps them until backward (one all-gather less per unit)",
    )
    add(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each unit's activations in backward instead of keeping them: less memory, about a third "
        "more compute",
    )
    add(
        "--cpu-offload",
        action="store_true",
        help="keep parameters, gradients and optimizer state in host memory, the optimizer step on the CPU (GPU only)",
    )
    add(
        "--async-checkpoint",
        action="store_true",
        help="write checkpoints while training goes on (copied to host memory first); a stop and the end wait for it",
    )


def _data_flags(add):
    """The data and how it is read."""
    add("data_positional", nargs="?", metavar="DIR", help="same as --data")
    add(
        "--data",
        metavar="DIR",
        help="ImageFolder root with train/<class>/* and val/<class>/*, or a folder with train.csv and val.csv (or "
        ".tsv) of path,label lines (default: $DATASETS_PATH/<first of $DATASETS>, else the built-in demo set)",
    )
    add(
        "--dataset",
        dest="dataset_fn",
        metavar="PKG.MOD:FN",
        help="your own data: FN(args) returns (classes, train_set, val_set) of (image, label) items (docs/adapting.md)",
    )
    add(
        "--mean",
        type=floats,
        metavar="M,M,M",
        help="per-channel mean of the images, 0-1 scale (default: the dataset's .mean, else ImageNet's)",
    )
    add(
        "--std",
        type=floats,
        metavar="S,S,S",
        help="per-channel std of the images, 0-1 scale (default: the dataset's .std, else ImageNet's)",
    )
    add(
        "--trainer",
        metavar="PKG.MOD:CLASS",
        help="your own subclass of common.trainer.Trainer: its model, data, loss, optimizer, steps (docs/adapting.md)",
    )
    add(
        "--decode",
        choices=["cpu", "gpu"],
        default="cpu",
        help="where JPEGs are decoded: cpu, in the loader workers; gpu, in batches on the training device, then "
        "cropped and flipped there (nvJPEG on a GPU; no --auto-augment or --random-erase; measured slower than 15 "
        "workers on an H200: docs/reference.md) (%(default)s)",
    )
    add("--dummy", action="store_true", help="random tensors instead of images, for throughput only")
    add("--dummy-size", type=int, default=1281167, metavar="N", help="training images per --dummy epoch (%(default)s)")


def _model_flags(add):
    """The model."""
    add(
        "-a",
        "--arch",
        default="resnet18",
        help="any torchvision classification model, or package.module:callable for your own (%(default)s)",
    )
    add(
        "--pretrained",
        action="store_true",
        help="start from torchvision's default weights for --arch; on "
        "ImageNet-style data and --dummy, validation takes the weights' resize, crop and interpolation",
    )
    add(
        "--weights",
        metavar="NAME",
        help="--pretrained with this weight set of --arch, as torchvision names it (ResNet50_Weights.IMAGENET1K_V2 "
        "or IMAGENET1K_V2)",
    )
    add(
        "--init-from",
        metavar="PATH",
        help="start from the weights in PATH (a checkpoint of these scripts or of torchvision's references, or a "
        "state dict), another number of classes' heads replaced and the first convolution adapted to the "
        "data's channels, as --pretrained's",
    )
    add("--dropout", type=float, metavar="P", help="the model's dropout, for archs that take one")


def _training_flags(add):
    """The optimizer, its schedule and the loop."""
    add(
        "-j",
        "--workers",
        type=workers_count,
        default="auto",
        metavar="N|auto",
        help="data loading workers per process; auto: this node's usable cores shared among its processes, "
        "one core left to each process, at most 16 each (%(default)s)",
    )
    add("--epochs", type=int, metavar="N", help="total epochs (env EPOCHS; 90; demo 10)")
    add(
        "-b",
        "--batch-size",
        type=int,
        metavar="N",
        help="GLOBAL batch over all processes, split evenly among them (env BATCH_SIZE; 256; demo 64)",
    )
    add(
        "--lr",
        "--learning-rate",
        type=float,
        dest="lr",
        metavar="LR",
        help="learning rate for the global batch (env LR; 0.1; demo 0.04)",
    )
    add(
        "--opt",
        choices=["sgd", "sgd-nesterov", "adamw", "rmsprop"],
        default="sgd",
        help="optimizer, as torchvision's train.py builds it (%(default)s)",
    )
    add("--momentum", type=float, metavar="M", help="momentum of sgd and rmsprop (0.9)")
    add("--wd", "--weight-decay", type=float, dest="weight_decay", metavar="W", help="weight decay (1e-4; tv-v2 2e-5)")
    add("--label-smoothing", type=float, metavar="E", help="label smoothing (0; tv-v2 0.1)")
    add(
        "--lr-schedule",
        choices=["step", "cosine", "constant"],
        help="step: x gamma every --lr-step-size epochs (default; demo: cosine)",
    )
    add(
        "--lr-step-unit",
        choices=["step", "epoch"],
        help="step: the lr changes every optimizer step (default); epoch: once per epoch, as torchvision's "
        "train.py (default under --preset tv-v2)",
    )
    add("--lr-min", type=float, default=0.0, metavar="LR", help="where the cosine schedule ends (%(default)s)")
    add(
        "--grad-accum-steps",
        type=int,
        default=1,
        metavar="N",
        help="each optimizer step sums the gradients of N micro-batches; -b stays the global batch of one step "
        "(%(default)s)",
    )
    add(
        "--clip-grad-norm",
        type=float,
        metavar="N",
        help="clip the gradients' total norm to N (under --amp fp16 the unscaled gradients'); default: no clipping",
    )
    add("--lr-step-size", type=int, default=30, metavar="N", help="epochs between decays (%(default)s)")
    add("--lr-gamma", type=float, default=0.1, metavar="G", help="decay factor of the step schedule (%(default)s)")
    add("--warmup-epochs", type=float, metavar="N", help="linear warmup from 1%% of --lr (0; demo 1)")
    add("-p", "--print-freq", type=int, metavar="N", help="steps between progress lines (10; demo 20)")
    _image_size_flags(add)


def _image_size_flags(add):
    """The training crop and flip, and validation's resize and crop."""
    add("--train-crop-size", type=int, metavar="PX", help="RandomResizedCrop size (224; demo 32)")
    add("--val-resize-size", type=int, metavar="PX", help="validation resize (256; demo 36)")
    add("--val-crop-size", type=int, metavar="PX", help="validation centre crop (224; demo 32)")
    add(
        "--min-crop-scale",
        type=float,
        metavar="S",
        help="RandomResizedCrop's smallest share of the image's area (0.08; demo 0.7)",
    )
    add("--hflip-prob", type=float, default=0.5, metavar="P", help="horizontal flip probability (%(default)s)")
    add(
        "--interpolation",
        choices=["bilinear", "bicubic", "nearest"],
        help="image resizing in training and validation (bilinear; validation with --pretrained: the weights')",
    )


def _run_flags(add):
    """Checkpoints, outputs, stops and repeatability."""
    add(
        "--resume",
        metavar="PATH|auto",
        help="checkpoint to resume from; 'auto': OUTPUT_DIR/checkpoint.pth if it exists, else start fresh",
    )
    add(
        "--overwrite",
        action="store_true",
        help="start afresh in an --output-dir that holds a run, deleting its checkpoints (else refused)",
    )
    add(
        "--strict-data",
        action="store_true",
        help="stop at the first image that cannot be decoded (default: skip it, list it in bad_images.txt)",
    )
    add(
        "--checkpoint-interval",
        type=int,
        default=0,
        metavar="STEPS",
        help="also checkpoint every STEPS optimizer steps, not only at the end of each epoch (0: off)",
    )
    add(
        "-e",
        "--evaluate",
        action="store_true",
        help="only evaluate (the weights of --resume, --init-from or --pretrained)",
    )
    add(
        "--seed",
        type=int,
        help="seed everything: the same seed gives the same run on the CPU (on GPUs see --deterministic)",
    )
    add(
        "--deterministic",
        action="store_true",
        help="deterministic GPU kernels, no cuDNN autotuning: with --seed, bitwise repeatable GPU runs (slower)",
    )
    add(
        "--output-dir",
        metavar="DIR",
        help="where rank 0 writes (default: $WORKSPACE/<mode>-<arch>-<data>, else runs/<mode>-<arch>-<data>)",
    )


def _device_flags(add):
    """Devices, processes and speed."""
    add("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: CUDA when visible (%(default)s)")
    add("--dist-backend", metavar="NAME", help="nccl on CUDA, gloo on CPU (env BACKEND)")
    add(
        "--stop-grace",
        type=float,
        metavar="SECONDS",
        help="how long the launcher lets a stop signal's clean stop take before it kills (torchrun's "
        "--shutdown-timeout; run_scripts/ set both from env STOP_GRACE, 120): a stopping run waits at most a "
        "third of it for a batch (default: env STOP_GRACE, else 30, torchrun's own)",
    )
    add(
        "--dist-timeout",
        type=float,
        default=1800,
        metavar="SECONDS",
        help="a collective waiting this long for a stalled rank fails the job (%(default)s)",
    )
    add("--sync-bn", action="store_true", help="SyncBatchNorm: BatchNorm statistics over the global batch (GPU only)")
    add(
        "--save-on",
        choices=["global", "node"],
        default="global",
        help="global: rank 0 writes; node: local rank 0 of every node writes (no shared file system)",
    )
    add("--amp", choices=["none", "bf16", "fp16"], default="none", help="mixed precision (%(default)s)")
    add(
        "--channels-last",
        nargs="?",
        const="on",
        default="auto",
        choices=["auto", "on", "off"],
        help="NHWC memory format for model and images (alone: on); auto: on for convolutional networks on the "
        "CPU, and on GPUs with --amp or TF32 (compute capability 8.0 and up), where it is measured faster "
        "(%(default)s)",
    )
    add(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on the CPU with glibc's malloc: keep the memory a step frees for the next step, returned before each "
        "fork (docs/reference.md); --no-keep-freed-memory: glibc's malloc as it comes (on)",
    )
    add("--compile", action="store_true", help="torch.compile the model")
    add(
        "--find-unused-parameters",
        action="store_true",
        help="DDP: for models whose forward leaves parameters unused (else DDP stops with an error naming them); "
        "slower",
    )


def _diagnostics_flags(add):
    """What limits the run (common/diagnostics.py; docs/benchmarks.md, "Why is my run slow?")."""
    add(
        "--profile",
        metavar="START:STEPS",
        help="record torch.profiler over STEPS training steps from step START of this launch (its first is 0): "
        "one Chrome trace per rank in OUTPUT_DIR/profile/ (off)",
    )
    add(
        "--peak-tflops",
        type=float,
        metavar="TFLOPS",
        help="one device's peak TFLOP/s at this run's precision, for the utilisation (mfu_pct) of a GPU whose peak "
        "common/diagnostics.py does not know",
    )
    add(
        "--memory-history",
        action="store_true",
        help="GPU: record the allocator's history, so that the snapshot written on out-of-memory holds each "
        "allocation's stack (slower)",
    )


def _recipe_flags(parser):
    add = parser.add_argument_group(
        "recipe",
        "today's ImageNet training recipe, from torchvision's own parts "
        "(flag names as in torchvision's references/classification/train.py)",
    ).add_argument
    add(
        "--preset",
        choices=sorted(RECIPES),
        help="tv-v2: torchvision's ResNet-50 V2 recipe (published 80.86%% acc@1, not measured here); "
        "on the demo set only its augmentation and regularisation, with the demo's epochs, batch, lr "
        "and sizes",
    )
    add("--mixup-alpha", type=float, metavar="A", help="MixUp, per batch on the device (0: off)")
    add(
        "--cutmix-alpha",
        type=float,
        metavar="A",
        help="CutMix, per batch on the device (0: off); with --mixup-alpha, one of the two per batch",
    )
    add(
        "--auto-augment",
        choices=["none", "ta_wide", "ra", "aa", "imagenet", "augmix"],
        help="TrivialAugmentWide, RandAugment, AutoAugment's ImageNet policy (aa, or torchvision's name imagenet) "
        "or AugMix, per image (none)",
    )
    add("--ra-magnitude", type=int, metavar="M", help="RandAugment magnitude (9)")
    add("--augmix-severity", type=int, default=3, metavar="S", help="AugMix severity, 1 to 10 (%(default)s)")
    add(
        "--random-erase",
        type=float,
        metavar="P",
        help="RandomErasing probability, per image, filling with the mean pixel (0)",
    )
    add(
        "--model-ema",
        action=argparse.BooleanOptionalAction,  # (--no-model-ema: a preset's off)
        help="keep an exponential moving average of the weights, evaluated and checkpointed beside them",
    )
    add(
        "--model-ema-decay",
        type=float,
        metavar="D",
        help="EMA decay, as torchvision's train.py adjusts it for batch, --model-ema-steps and epochs (0.99998)",
    )
    add("--model-ema-steps", type=int, metavar="N", help="optimizer steps between EMA updates (32)")
    _recipe_schedule_flags(add)


def _recipe_schedule_flags(add):
    """The recipe's weight decay by kind of parameter, repeated augmentation, progressive resizing, lr scaling."""
    add(
        "--norm-weight-decay",
        type=float,
        metavar="W",
        help="weight decay of normalisation layers' weights (and biases, without --bias-weight-decay) (default: --wd)",
    )
    add("--bias-weight-decay", type=float, metavar="W", help="weight decay of every bias (default: --wd)")
    add(
        "--ra-sampler",
        action=argparse.BooleanOptionalAction,  # (--no-ra-sampler: a preset's off)
        help="repeated augmentation: each image --ra-reps times per epoch, differently augmented, on different ranks",
    )
    add("--ra-reps", type=int, metavar="K", help="repetitions of --ra-sampler (3; tv-v2 4)")
    add(
        "--res-schedule",
        metavar="START:END:FIRST:LAST[:STEP]",
        help="progressive resizing: the training crop grows from START px at epoch FIRST to END px at epoch "
        "LAST, linearly, rounded to a multiple of STEP px (32); overrides --train-crop-size",
    )
    add(
        "--lr-scaling",
        choices=["none", "linear"],
        help="linear: --lr (or LR) is for a global batch of 256 and is scaled by -b/256; a preset's lr by -b over "
        "the preset's batch (none)",
    )

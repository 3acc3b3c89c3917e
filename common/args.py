"""The command line shared by the three scripts.

Flag names follow pytorch/examples' imagenet/main.py where they overlap.
Defaults come, in order of precedence, from: the command line, the platform
environment variables (EPOCHS, LR, BATCH_SIZE, DATASETS_PATH + DATASETS,
WORKSPACE, BACKEND; train_spawn.py also WORKER_PER_NODE, MASTER_ADDR,
MASTER_PORT), and the preset of the dataset in use (ImageNet-style folder,
the built-in demo set, or --dummy).
"""
import argparse
import difflib
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


class UsageError(Exception):
    """Bad input from the user: reported as one line and exit code 2."""
    exit_code = 2


def run_main(main, parse_args):
    """main(parse_args()) with a UsageError turned into one line on stderr and exit code 2; the
    process never outlives its DataLoader workers, nor waits for them, whatever happened."""
    try:
        try:
            main(parse_args())
        finally:
            # Now, while an error still holds the data loaders: once it is handled they shut down,
            # waiting 5 s for each worker stuck in a read. (Not imported before: nothing to clean
            # up, and a usage error or --help does not wait for torch to load.)
            preemption = sys.modules.get(f"{__package__}.preemption")
            if preemption is not None:
                preemption.before_exit()
        return 0
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return error.exit_code
    except Preempted as stop:
        if str(stop):  # else the trainer said where its checkpoint is
            print(stop, file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except KeyboardInterrupt:
        return 130
    except RuntimeError as error:
        line = known_failure(error)
        if line is None:
            raise  # a bug: its traceback is the report
        print(line, file=sys.stderr, flush=True)
        return 1


def known_failure(error):
    """One line for the errors that are not this process's own fault (their cause is reported
    elsewhere or is the machine's), else None."""
    text = str(error)
    if text.startswith("DataLoader worker"):
        # "DataLoader worker (pid X) is killed by signal: Killed.": the kernel's OOM killer, mostly.
        return f"error: {text.splitlines()[0].strip()} (out of memory? fewer --workers use less)"
    if any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "rank 0 failed")):
        # A collective lost a process of the job: that one failed (or was stopped) first and said why.
        return "error: another process of this job ended, see its error; this one stops too"
    return None


class Preempted(Exception):
    """Stopped on SIGTERM / SIGUSR1 after writing a checkpoint; exit code PREEMPTED_EXIT_CODE."""


PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: stopped on request; continue with --resume auto


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line instead of argparse's usage block.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# Defaults that depend on the data. The demo preset is sized so that a small
# model learns the built-in set in about a minute on two CPU cores.
PRESETS = {
    "imagenet": dict(epochs=90, batch_size=256, lr=0.1, print_freq=10,
                     train_crop_size=224, val_resize_size=256, val_crop_size=224,
                     lr_schedule="step", warmup_epochs=0.0, min_crop_scale=0.08),
    # Measured: resnet18 reaches ~98% val acc@1 in about 65 s on two CPU cores.
    "demo": dict(epochs=10, batch_size=64, lr=0.04, print_freq=20,
                 train_crop_size=32, val_resize_size=36, val_crop_size=32,
                 lr_schedule="cosine", warmup_epochs=1.0, min_crop_scale=0.7),
}


def env_default(name, kind=str):
    """The value of environment variable `name` converted by `kind`, or None when unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return kind(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={value!r} is not a valid {kind.__name__}")


def workers_count(text):
    """-j: 'auto' or a count of 0 or more (an argparse type)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected auto or a count of 0 or more, got {text!r}")
    return value


def build_parser(description):
    """The shared flags; each script adds its launch flags to the returned parser."""
    p = Parser(description=description)
    add = p.add_argument
    add("data_positional", nargs="?", metavar="DIR", help="same as --data")
    add("--data", metavar="DIR", help="ImageFolder root with train/<class>/* and val/<class>/* "
        "(default: $DATASETS_PATH/<first of $DATASETS>, else the built-in demo set)")
    add("--dummy", action="store_true", help="random tensors instead of images, for throughput only")
    add("--dummy-size", type=int, default=1281167, metavar="N", help="training images per --dummy epoch (%(default)s)")
    add("-a", "--arch", default="resnet18",
        help="any torchvision classification model, or package.module:callable for your own (%(default)s)")
    add("--pretrained", action="store_true", help="start from torchvision's default weights for --arch")
    add("--dropout", type=float, default=None, metavar="P", help="the model's dropout, for archs that take one")
    add("-j", "--workers", type=workers_count, default="auto", metavar="N|auto",
        help="data loading workers per process; auto: this node's usable cores shared among its processes, "
             "one core left to each process, at most 8 each (%(default)s)")
    add("--epochs", type=int, default=None, metavar="N", help="total epochs (env EPOCHS; 90; demo 10)")
    add("-b", "--batch-size", type=int, default=None, metavar="N",
        help="GLOBAL batch over all processes, split evenly among them (env BATCH_SIZE; 256; demo 64)")
    add("--lr", "--learning-rate", type=float, default=None, dest="lr", metavar="LR",
        help="learning rate for the global batch (env LR; 0.1; demo 0.04)")
    add("--momentum", type=float, default=0.9, metavar="M", help="SGD momentum (%(default)s)")
    add("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay", metavar="W",
        help="weight decay (%(default)s)")
    add("--label-smoothing", type=float, default=0.0, metavar="E", help="label smoothing (%(default)s)")
    add("--lr-schedule", choices=["step", "cosine", "constant"], default=None,
        help="step: x gamma every --lr-step-size epochs (default; demo: cosine)")
    add("--lr-step-size", type=int, default=30, metavar="N", help="epochs between decays (%(default)s)")
    add("--lr-gamma", type=float, default=0.1, metavar="G", help="decay factor of the step schedule (%(default)s)")
    add("--warmup-epochs", type=float, default=None, metavar="N",
        help="linear warmup from 1%% of --lr (0; demo 1)")
    add("-p", "--print-freq", type=int, default=None, metavar="N", help="steps between progress lines (10; demo 20)")
    add("--train-crop-size", type=int, default=None, metavar="PX", help="RandomResizedCrop size (224; demo 32)")
    add("--val-resize-size", type=int, default=None, metavar="PX", help="validation resize (256; demo 36)")
    add("--val-crop-size", type=int, default=None, metavar="PX", help="validation centre crop (224; demo 32)")
    add("--resume", metavar="PATH|auto", default="",
        help="checkpoint to resume from; 'auto': OUTPUT_DIR/checkpoint.pth if it exists, else start fresh")
    add("--overwrite", action="store_true",
        help="start afresh in an --output-dir that holds a run, deleting its checkpoints (else refused)")
    add("--strict-data", action="store_true",
        help="stop at the first image that cannot be decoded (default: skip it, list it in bad_images.txt)")
    add("--checkpoint-interval", type=int, default=0, metavar="STEPS",
        help="also checkpoint every STEPS optimizer steps, not only at the end of each epoch (0: off)")
    add("-e", "--evaluate", action="store_true", help="only evaluate (the weights of --resume or --pretrained)")
    add("--seed", type=int, default=None,
        help="seed everything: the same seed gives the same run on the CPU (on GPUs see --deterministic)")
    add("--deterministic", action="store_true",
        help="deterministic GPU kernels, no cuDNN autotuning: with --seed, bitwise repeatable GPU runs (slower)")
    add("--output-dir", default=None, metavar="DIR",
        help="where rank 0 writes (default: $WORKSPACE/<mode>-<arch>-<data>, else runs/<mode>-<arch>-<data>)")
    add("--device", choices=["auto", "cuda", "cpu"], default="auto", help="auto: CUDA when visible (%(default)s)")
    add("--dist-backend", default=None, metavar="NAME", help="nccl on CUDA, gloo on CPU (env BACKEND)")
    add("--dist-timeout", type=float, default=1800, metavar="SECONDS",
        help="a collective waiting this long for a stalled rank fails the job (%(default)s)")
    add("--sync-bn", action="store_true", help="SyncBatchNorm: BatchNorm statistics over the global batch (GPU only)")
    add("--save-on", choices=["global", "node"], default="global",
        help="global: rank 0 writes; node: local rank 0 of every node writes (no shared file system)")
    add("--amp", choices=["none", "bf16", "fp16"], default="none", help="mixed precision (%(default)s)")
    add("--channels-last", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
        help="NHWC memory format for model and images (alone: on); auto: on for convolutional networks on the "
             "CPU, and on GPUs with --amp, where it is measured faster (%(default)s)")
    add("--compile", action="store_true", help="torch.compile the model")
    return p


def _check_positive(args, names):
    for name in names:
        value = getattr(args, name)
        if value is None or value <= 0:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be positive, got {value}")


def check_arch(arch):
    if ":" in arch:  # package.module:callable
        from .models import custom_builder
        custom_builder(arch)
        return
    import torchvision.models
    names = torchvision.models.list_models(module=torchvision.models)
    if arch not in names:
        close = difflib.get_close_matches(arch, names, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "see torchvision.models.list_models()"
        raise UsageError(f"unknown --arch {arch!r}: {hint}")


def parse_args(parser, argv=None):
    """Parse, apply environment and preset defaults, and validate; raises UsageError."""
    args = parser.parse_args(argv)
    if args.data_positional and args.data and args.data_positional != args.data:
        raise UsageError("give the data directory once: as DIR or as --data, not both")
    args.data = args.data or args.data_positional
    del args.data_positional
    if args.data is None and not args.dummy:
        root, names = env_default("DATASETS_PATH"), env_default("DATASETS")
        if root:
            args.data = os.path.join(root, names.split(",")[0]) if names else root
    args.dataset = "dummy" if args.dummy else ("imagenet" if args.data else "demo")
    preset = PRESETS["demo" if args.dataset == "demo" else "imagenet"]

    from_env = {"epochs": env_default("EPOCHS", int), "batch_size": env_default("BATCH_SIZE", int),
                "lr": env_default("LR", float), "dist_backend": env_default("BACKEND")}
    warmup_given = args.warmup_epochs is not None
    for name, value in {**preset, **from_env}.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value if value is not None else preset.get(name))
    args.min_crop_scale = preset["min_crop_scale"]
    if not warmup_given and args.warmup_epochs >= args.epochs:
        args.warmup_epochs = 0.0  # the preset's warmup does not fit a run this short

    _check_positive(args, ["epochs", "batch_size", "lr", "print_freq", "train_crop_size",
                           "val_resize_size", "val_crop_size", "dummy_size", "lr_step_size"])
    if args.checkpoint_interval < 0:
        raise UsageError(f"--checkpoint-interval must be 0 (off) or positive, got {args.checkpoint_interval}")
    if args.dist_timeout <= 0:
        raise UsageError(f"--dist-timeout must be positive, got {args.dist_timeout}")
    if not 0.0 <= args.label_smoothing < 1.0:
        raise UsageError(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    if args.warmup_epochs < 0 or (args.warmup_epochs > 0 and args.warmup_epochs >= args.epochs):
        raise UsageError(f"--warmup-epochs must be in [0, --epochs), got {args.warmup_epochs}")
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.deterministic:  # read by cuBLAS when it starts: before anything touches CUDA
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.evaluate and not (args.resume or args.pretrained):
        raise UsageError("-e evaluates the weights of --resume PATH or --pretrained: give one of them")
    check_arch(args.arch)
    return args


def default_output_dir(args, mode):
    """A run name fixed by mode, arch and data, so --resume auto finds the last run again."""
    dataset = args.dataset if args.dataset != "imagenet" else Path(args.data).resolve().name
    root = env_default("WORKSPACE") or "runs"
    return os.path.join(root, f"{mode}-{args.arch}-{dataset}")

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
from typing import NamedTuple

from .console import say
from .named import import_named
from .errors import PREEMPTED_EXIT_CODE, Preempted, UsageError, stop_at_once_until_training  # noqa: F401 (the scripts use cli.UsageError)

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_main(main, parse_args):
    """main(parse_args()) with a UsageError turned into one line on stderr and exit code 2; the
    process never outlives its DataLoader workers, nor waits for them, whatever happened."""
    try:
        try:
            stop_at_once_until_training()
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
        say(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except Preempted as stop:
        if str(stop):  # else the trainer said where its checkpoint is
            say(stop, file=sys.stderr)
        return PREEMPTED_EXIT_CODE
    except KeyboardInterrupt:
        return 130
    except RuntimeError as error:
        line = known_failure(error)
        if line is None:
            raise  # a bug: its traceback is the report
        say(line, file=sys.stderr)
        return 1


def known_failure(error):
    """One line for the errors that are not this process's own fault (their cause is reported
    elsewhere or is the machine's), else None."""
    text = str(error)
    if text.startswith("DataLoader worker"):
        # "DataLoader worker (pid X) is killed by signal: Killed.": the kernel's OOM killer, mostly.
        return f"error: {text.splitlines()[0].strip()} (out of memory? fewer --workers use less)"
    if "Expected to have finished reduction in the prior iteration" in text:
        # DDP waited for the gradient of a parameter that the forward did not use.
        return ("error: DDP: the model has parameters that received no gradient: add --find-unused-parameters "
                "(or use them all in forward)")
    if any(sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "rank 0 failed")):
        # A collective lost a process of the job: that one failed (or was stopped) first and said why.
        return "error: another process of this job ended, see its error; this one stops too"
    return None


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line instead of argparse's usage block.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


# Defaults that depend on the data. The demo preset is sized so that a small
# model learns the built-in set in minutes on two CPU cores.
PRESETS = {
    "imagenet": dict(epochs=90, batch_size=256, lr=0.1, print_freq=10,
                     train_crop_size=224, val_resize_size=256, val_crop_size=224,
                     lr_schedule="step", warmup_epochs=0.0, min_crop_scale=0.08),
    # Measured: resnet18 reaches about 99% val acc@1 in under 2 minutes on two idle CPU cores (README).
    "demo": dict(epochs=10, batch_size=64, lr=0.04, print_freq=20,
                 train_crop_size=32, val_resize_size=36, val_crop_size=32,
                 lr_schedule="cosine", warmup_epochs=1.0, min_crop_scale=0.7),
}

# The defaults of the flags a recipe may set (below the dataset's preset in precedence).
RECIPE_DEFAULTS = dict(momentum=0.9, weight_decay=1e-4, norm_weight_decay=None, bias_weight_decay=None,
                       label_smoothing=0.0, mixup_alpha=0.0, cutmix_alpha=0.0, auto_augment="none",
                       ra_magnitude=9, random_erase=0.0, model_ema=False, model_ema_decay=0.99998,
                       model_ema_steps=32, ra_sampler=False, ra_reps=3, lr_scaling="none",
                       lr_step_unit="step")

# --preset: a published recipe in one flag. "name" is what the run's header says of it; "training" holds
# what applies to any data (augmentation, regularisation); "scale" what fits ImageNet only (epochs, batch,
# lr, image sizes), which the demo set keeps its own of. Command line and environment still take precedence.
RECIPES = {
    # torchvision's ResNet-50 "V2" weights (IMAGENET1K_V2, 80.858% acc@1 published, not measured here):
    # references/classification/train.py --epochs 600 --batch-size 128 on 8 GPUs --lr 0.5
    # --lr-scheduler cosineannealinglr --lr-warmup-epochs 5 --lr-warmup-method linear
    # --label-smoothing 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 --auto-augment ta_wide
    # --random-erase 0.1 --weight-decay 2e-5 --norm-weight-decay 0.0 --train-crop-size 176 --model-ema
    # --val-resize-size 232 --ra-sampler --ra-reps 4
    "tv-v2": dict(
        name="torchvision's ResNet-50 V2 recipe, published 80.86% acc@1, not measured here",
        training=dict(label_smoothing=0.1, mixup_alpha=0.2, cutmix_alpha=1.0, auto_augment="ta_wide",
                      random_erase=0.1, weight_decay=2e-5, norm_weight_decay=0.0, model_ema=True,
                      model_ema_decay=0.99998, model_ema_steps=32, ra_sampler=True, ra_reps=4, lr_step_unit="epoch"),
        scale=dict(epochs=600, batch_size=1024, lr=0.5, lr_schedule="cosine", warmup_epochs=5.0,
                   train_crop_size=176, val_resize_size=232, val_crop_size=224)),
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


def floats(text):
    """--mean / --std: comma-separated numbers (an argparse type)."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None


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
    add("--dataset", dest="dataset_fn", default=None, metavar="PKG.MOD:FN",
        help="your own data: FN(args) returns (classes, train_set, val_set) of (image, label) items (docs/adapting.md)")
    add("--mean", type=floats, default=None, metavar="M,M,M",
        help="per-channel mean of the images, 0-1 scale (default: the dataset's .mean, else ImageNet's)")
    add("--std", type=floats, default=None, metavar="S,S,S",
        help="per-channel std of the images, 0-1 scale (default: the dataset's .std, else ImageNet's)")
    add("--trainer", default=None, metavar="PKG.MOD:CLASS",
        help="your own subclass of common.trainer.Trainer: its model, data, loss, optimizer, steps (docs/adapting.md)")
    add("--dummy", action="store_true", help="random tensors instead of images, for throughput only")
    add("--dummy-size", type=int, default=1281167, metavar="N", help="training images per --dummy epoch (%(default)s)")
    add("-a", "--arch", default="resnet18",
        help="any torchvision classification model, or package.module:callable for your own (%(default)s)")
    add("--pretrained", action="store_true", help="start from torchvision's default weights for --arch; on "
        "ImageNet-style data and --dummy, validation takes the weights' resize, crop and interpolation")
    add("--weights", default=None, metavar="NAME",
        help="--pretrained with this weight set of --arch, as torchvision names it (ResNet50_Weights.IMAGENET1K_V2 "
             "or IMAGENET1K_V2)")
    add("--dropout", type=float, default=None, metavar="P", help="the model's dropout, for archs that take one")
    add("-j", "--workers", type=workers_count, default="auto", metavar="N|auto",
        help="data loading workers per process; auto: this node's usable cores shared among its processes, "
             "one core left to each process, at most 8 each (%(default)s)")
    add("--epochs", type=int, default=None, metavar="N", help="total epochs (env EPOCHS; 90; demo 10)")
    add("-b", "--batch-size", type=int, default=None, metavar="N",
        help="GLOBAL batch over all processes, split evenly among them (env BATCH_SIZE; 256; demo 64)")
    add("--lr", "--learning-rate", type=float, default=None, dest="lr", metavar="LR",
        help="learning rate for the global batch (env LR; 0.1; demo 0.04)")
    add("--opt", choices=["sgd", "sgd-nesterov", "adamw", "rmsprop"], default="sgd",
        help="optimizer, as torchvision's train.py builds it (%(default)s)")
    add("--momentum", type=float, default=None, metavar="M", help="momentum of sgd and rmsprop (0.9)")
    add("--wd", "--weight-decay", type=float, default=None, dest="weight_decay", metavar="W",
        help="weight decay (1e-4; tv-v2 2e-5)")
    add("--label-smoothing", type=float, default=None, metavar="E", help="label smoothing (0; tv-v2 0.1)")
    add("--lr-schedule", choices=["step", "cosine", "constant"], default=None,
        help="step: x gamma every --lr-step-size epochs (default; demo: cosine)")
    add("--lr-step-unit", choices=["step", "epoch"], default=None,
        help="step: the lr changes every optimizer step (default); epoch: once per epoch, as torchvision's "
             "train.py (default under --preset tv-v2)")
    add("--lr-min", type=float, default=0.0, metavar="LR", help="where the cosine schedule ends (%(default)s)")
    add("--clip-grad-norm", type=float, default=None, metavar="N",
        help="clip the gradients' total norm to N (under --amp fp16 the unscaled gradients'); default: no clipping")
    add("--lr-step-size", type=int, default=30, metavar="N", help="epochs between decays (%(default)s)")
    add("--lr-gamma", type=float, default=0.1, metavar="G", help="decay factor of the step schedule (%(default)s)")
    add("--warmup-epochs", type=float, default=None, metavar="N",
        help="linear warmup from 1%% of --lr (0; demo 1)")
    add("-p", "--print-freq", type=int, default=None, metavar="N", help="steps between progress lines (10; demo 20)")
    add("--train-crop-size", type=int, default=None, metavar="PX", help="RandomResizedCrop size (224; demo 32)")
    add("--val-resize-size", type=int, default=None, metavar="PX", help="validation resize (256; demo 36)")
    add("--val-crop-size", type=int, default=None, metavar="PX", help="validation centre crop (224; demo 32)")
    add("--interpolation", choices=["bilinear", "bicubic", "nearest"], default=None,
        help="image resizing in training and validation (bilinear; validation with --pretrained: the weights')")
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
    add("--stop-grace", type=float, default=env_default("STOP_GRACE", float) or 30, metavar="SECONDS",
        help="how long the launcher lets a stop signal's clean stop take before it kills (torchrun's "
             "--shutdown-timeout; run_scripts/ set both from env STOP_GRACE, 120): a stopping run waits at most a "
             "third of it for a batch (default: %(default)s, torchrun's own)")
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
    add("--find-unused-parameters", action="store_true",
        help="DDP: for models whose forward leaves parameters unused (else DDP stops with an error naming them); slower")

    r = p.add_argument_group("recipe", "today's ImageNet training recipe, from torchvision's own parts "
                             "(flag names as in torchvision's references/classification/train.py)")
    add = r.add_argument
    add("--preset", choices=sorted(RECIPES), default=None,
        help="tv-v2: torchvision's ResNet-50 V2 recipe (published 80.86%% acc@1, not measured here); "
             "on the demo set only its augmentation and regularisation, with the demo's epochs, batch, lr "
             "and sizes")
    add("--mixup-alpha", type=float, default=None, metavar="A", help="MixUp, per batch on the device (0: off)")
    add("--cutmix-alpha", type=float, default=None, metavar="A",
        help="CutMix, per batch on the device (0: off); with --mixup-alpha, one of the two per batch")
    add("--auto-augment", choices=["none", "ta_wide", "ra", "aa", "imagenet", "augmix"], default=None,
        help="TrivialAugmentWide, RandAugment, AutoAugment's ImageNet policy (aa, or torchvision's name imagenet) "
             "or AugMix, per image (none)")
    add("--ra-magnitude", type=int, default=None, metavar="M", help="RandAugment magnitude (9)")
    add("--augmix-severity", type=int, default=3, metavar="S", help="AugMix severity, 1 to 10 (%(default)s)")
    add("--random-erase", type=float, default=None, metavar="P",
        help="RandomErasing probability, per image, filling with the mean pixel (0)")
    add("--model-ema", action="store_const", const=True, default=None,
        help="keep an exponential moving average of the weights, evaluated and checkpointed beside them")
    add("--model-ema-decay", type=float, default=None, metavar="D",
        help="EMA decay, as torchvision's train.py adjusts it for batch, --model-ema-steps and epochs "
             "(0.99998)")
    add("--model-ema-steps", type=int, default=None, metavar="N", help="optimizer steps between EMA updates (32)")
    add("--norm-weight-decay", type=float, default=None, metavar="W",
        help="weight decay of normalisation layers' weights and biases (default: --wd)")
    add("--bias-weight-decay", type=float, default=None, metavar="W",
        help="weight decay of the other layers' biases (default: --wd)")
    add("--ra-sampler", action="store_const", const=True, default=None,
        help="repeated augmentation: each image --ra-reps times per epoch, differently augmented, "
             "on different ranks")
    add("--ra-reps", type=int, default=None, metavar="K", help="repetitions of --ra-sampler (3; tv-v2 4)")
    add("--res-schedule", default=None, metavar="START:END:FIRST:LAST[:STEP]", type=res_schedule,
        help="progressive resizing: the training crop grows from START px at epoch FIRST to END px at epoch "
             "LAST, linearly, rounded to a multiple of STEP px (32); overrides --train-crop-size")
    add("--lr-scaling", choices=["none", "linear"], default=None,
        help="linear: --lr (or LR) is for a global batch of 256 and is scaled by -b/256; a preset's lr by -b over "
             "the preset's batch (none)")
    return p


class ResSchedule(NamedTuple):
    """--res-schedule: the training crop size of each epoch (FFCV's progressive resizing)."""
    start: int
    end: int
    first_epoch: int
    last_epoch: int
    step: int = 32

    def size(self, epoch):
        if epoch <= self.first_epoch:
            pixels = self.start
        elif epoch >= self.last_epoch:
            pixels = self.end
        else:
            t = (epoch - self.first_epoch) / (self.last_epoch - self.first_epoch)
            pixels = self.start + t * (self.end - self.start)
        return max(self.step, int(round(pixels / self.step)) * self.step)

    @staticmethod
    def parse(text):
        """The ResSchedule of a --res-schedule text (ArgumentTypeError if it is not one)."""
        try:
            values = [int(part) for part in text.split(":")]
        except ValueError:
            values = []
        if len(values) not in (4, 5) or any(value < 0 for value in values):
            raise argparse.ArgumentTypeError(f"expected START:END:FIRST_EPOCH:LAST_EPOCH[:STEP], "
                                             f"whole numbers, got {text!r}")
        schedule = ResSchedule(*values)
        if min(schedule.start, schedule.end, schedule.step) <= 0 or schedule.first_epoch > schedule.last_epoch:
            raise argparse.ArgumentTypeError(f"{text!r}: sizes and STEP must be positive and FIRST_EPOCH <= LAST_EPOCH")
        return schedule


def res_schedule(text):
    """--res-schedule START:END:FIRST:LAST[:STEP] (an argparse type): the text, checked (a plain string, so
    that checkpoints holding the arguments load with weights_only=True). ResSchedule.parse reads it."""
    ResSchedule.parse(text)
    return text


def flag(name):
    """The command-line flag of argument `name` (its dest): weight_decay -> --weight-decay."""
    return "--" + name.replace("_", "-")


def _check_positive(args, names):
    for name in names:
        value = getattr(args, name)
        if value is None or value <= 0:
            raise UsageError(f"{flag(name)} must be positive, got {value}")


def _check_at_least(args, names, low, requirement):
    """UsageError "--NAME must be <requirement>" for the first of `names` below `low` (None: not given)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < low:
            raise UsageError(f"{flag(name)} must be {requirement}, got {value}")


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
    """Parse, apply environment and preset defaults, and validate; raises UsageError. A --trainer class adds
    its own flags (Trainer.add_arguments) before the command line is parsed."""
    chosen_trainer = argparse.ArgumentParser(add_help=False)
    chosen_trainer.add_argument("--trainer")
    name = chosen_trainer.parse_known_args(argv)[0].trainer
    add_arguments = getattr(import_named(name or "", "--trainer"), "add_arguments", None)  # imports torch, if any
    if add_arguments is not None:
        add_arguments(parser.add_argument_group(f"--trainer {name}"))
    args = parser.parse_args(argv)
    if args.data_positional and args.data and args.data_positional != args.data:
        raise UsageError("give the data directory once: as DIR or as --data, not both")
    args.data = args.data or args.data_positional
    del args.data_positional
    if args.data is None and not args.dummy:
        root, names = env_default("DATASETS_PATH"), env_default("DATASETS")
        if root:
            args.data = os.path.join(root, names.split(",")[0]) if names else root
    args.dataset = "dummy" if args.dummy else ("custom" if args.dataset_fn else "imagenet" if args.data else "demo")
    preset_name = "demo" if args.dataset == "demo" else "imagenet"
    preset = PRESETS[preset_name]

    from_env = {"epochs": env_default("EPOCHS", int), "batch_size": env_default("BATCH_SIZE", int),
                "lr": env_default("LR", float), "dist_backend": env_default("BACKEND")}
    warmup_given = args.warmup_epochs is not None
    val_sizes_given = {name for name in ("val_resize_size", "val_crop_size") if getattr(args, name) is not None}
    recipe = RECIPES.get(args.preset, {})
    # Precedence: command line, environment, --preset (its "scale" part on ImageNet-style data and
    # --dummy only), the dataset's preset, the flags' defaults. Each layer is named for the lr it may give.
    layers = [("", RECIPE_DEFAULTS), (f"the {preset_name} preset's lr", preset), ("", recipe.get("training", {})),
              (f"--preset {args.preset}'s lr", recipe.get("scale", {}) if args.dataset != "demo" else {}),
              ("LR", {name: value for name, value in from_env.items() if value is not None}),
              ("--lr", {"lr": args.lr} if args.lr is not None else {})]
    # --lr-scaling linear scales an lr from the batch it was given for: the user's (--lr, LR) for 256 images,
    # a preset's for that preset's batch.
    args.lr_source, args.lr_reference_batch = next(
        (name, 256 if name in ("--lr", "LR") else layer["batch_size"]) for name, layer in reversed(layers) if "lr" in layer)
    chosen, origin = {}, {}
    for position, (_, layer) in enumerate(layers):
        chosen.update(layer)
        origin.update(dict.fromkeys(layer, position))
    args.data_preset = preset_name  # and the defaults it gave (layer 1), for the run's header
    args.from_data_preset = [name for name in preset if origin.get(name) == 1 and getattr(args, name, None) is None]
    for name, value in chosen.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
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
    if args.lr_step_unit == "epoch" and args.warmup_epochs != int(args.warmup_epochs):
        raise UsageError(f"--warmup-epochs {args.warmup_epochs:g} with --lr-step-unit epoch: give whole epochs")
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    _check_at_least(args, ["mixup_alpha", "cutmix_alpha"], 0, "0 (off) or positive")
    if not 0.0 <= args.random_erase <= 1.0:
        raise UsageError(f"--random-erase must be a probability in [0, 1], got {args.random_erase}")
    if not 0.0 <= args.model_ema_decay <= 1.0:
        raise UsageError(f"--model-ema-decay must be in [0, 1], got {args.model_ema_decay}")
    _check_at_least(args, ["model_ema_steps", "ra_reps"], 1, "1 or more")
    if not 0 <= args.ra_magnitude <= 30:
        raise UsageError(f"--ra-magnitude must be in [0, 30], got {args.ra_magnitude}")
    if not 1 <= args.augmix_severity <= 10:
        raise UsageError(f"--augmix-severity must be in [1, 10], got {args.augmix_severity}")
    _check_at_least(args, ["weight_decay", "norm_weight_decay", "bias_weight_decay", "momentum", "lr_min"], 0, "0 or more")
    if args.clip_grad_norm is not None and args.clip_grad_norm <= 0:
        raise UsageError(f"--clip-grad-norm must be positive, got {args.clip_grad_norm}")
    if args.lr_min and args.lr_schedule != "cosine":
        raise UsageError(f"--lr-min is where the cosine schedule ends: add --lr-schedule cosine (not {args.lr_schedule})")
    args.lr_given = args.lr  # before --lr-scaling linear, for args.lr_reference_batch images
    if args.lr_scaling == "linear":
        args.lr = args.lr * args.batch_size / args.lr_reference_batch
    if args.lr_min and args.lr_min >= args.lr:
        raise UsageError(f"--lr-min {args.lr_min:g} must be below the lr, {args.lr:g}")
    if args.dataset_fn and args.dummy:
        raise UsageError("give --dataset or --dummy, not both")
    if args.deterministic:  # read by cuBLAS when it starts: before anything touches CUDA
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    args.pretrained = args.pretrained or args.weights is not None
    if args.evaluate and not (args.resume or args.pretrained):
        raise UsageError("-e evaluates the weights of --resume PATH or --pretrained: give one of them")
    check_arch(args.arch)
    val_interpolation = args.interpolation
    args.interpolation = args.interpolation or "bilinear"
    args.val_preprocessing = None  # where the validation sizes and interpolation came from, if not the flags
    if args.pretrained:
        from .models import pretrained_weights
        weights = pretrained_weights(args.arch, args.weights)
        args.weights = f"{type(weights).__name__}.{weights.name}"
        if args.dataset != "demo":
            # As torchvision's train.py evaluates weights: with their own transforms() (what they were measured with).
            preprocessing = weights.transforms()
            if "val_resize_size" not in val_sizes_given:
                args.val_resize_size = preprocessing.resize_size[0]
            if "val_crop_size" not in val_sizes_given:
                args.val_crop_size = preprocessing.crop_size[0]
            val_interpolation = val_interpolation or preprocessing.interpolation.value
            args.val_preprocessing = f"{args.weights}.transforms()"
    args.val_interpolation = val_interpolation or "bilinear"
    return args


def describe_preset(args, first_image=None):
    """Header lines: which dataset preset set which defaults of this run, and why; a warning where the
    ImageNet preset's crop is far larger than the images (first_image: (channels, height, width, dtype))."""
    names = {"epochs": "{} epochs", "batch_size": "-b {}", "lr": "lr {:g}", "train_crop_size": "{} px crops",
             "val_resize_size": "val resize {}", "val_crop_size": "val crop {}", "lr_schedule": "{} schedule"}
    given = [text.format(getattr(args, name)) for name, text in names.items() if name in args.from_data_preset]
    if not given:
        return []
    why = ("the built-in demo set" if args.data_preset == "demo"
           else "the default for --data, --dataset and --dummy, made for ImageNet-sized images")
    lines = [f"preset: {args.data_preset} ({why}) sets {', '.join(given)}; flags, the environment and --preset "
             "override it"]
    if first_image and "train_crop_size" in args.from_data_preset and 2 * min(first_image[1:3]) <= args.train_crop_size:
        height, width = first_image[1:3]
        lines.append(f"warning: the first training image is {width}x{height} px, the {args.data_preset} preset crops "
                     f"{args.train_crop_size} px: for images this small give --train-crop-size, --val-resize-size and "
                     f"--val-crop-size near {min(height, width)} (and --epochs, -b, --lr for your data)")
    return lines


def default_output_dir(args, mode):
    """A run name fixed by mode, arch and data, so --resume auto finds the last run again (your own
    package.module:name as its name)."""
    if args.dataset == "custom":
        dataset = args.dataset_fn.replace(":", ".")
    else:
        dataset = args.dataset if args.dataset != "imagenet" else Path(args.data).resolve().name
    root = env_default("WORKSPACE") or "runs"
    # No colon in the name: TensorBoard's --logdir reads NAME:PATH, and some file systems refuse it.
    return os.path.join(root, f"{mode}-{args.arch.replace(':', '.')}-{dataset}")

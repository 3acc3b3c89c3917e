"""The run's configuration: resolved once from the command line, the platform's environment and the presets (below),
checked, then frozen. Nothing writes to it afterwards; what a run learns later (the data's classes, the loader workers
of this node, a resumed run's seed) lives with the part that learned it.

The presets: defaults that depend on the data (the dataset presets) and published recipes in one flag (--preset).
Precedence, highest first: the command line, the platform's environment (EPOCHS, LR, BATCH_SIZE, BACKEND),
--preset (its "scale" part on ImageNet-style data and --dummy only), the dataset's preset, RECIPE_DEFAULTS.
"""

import argparse
import difflib
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple

from .errors import UsageError
from .run_dir import check_names

# Arguments that may differ between nodes (every other one must be alike on every rank: common/run.py):
# loader workers, where a node holds its copy of the data (the same files: checked on their own), where it
# writes (only the writer ranks write), the process's own place in the job, and how a node names node 0.
PER_NODE = ("workers", "data", "output_dir", "local_rank", "node_rank", "master_addr", "dist_url")


class Config(argparse.Namespace):
    """The resolved flags, read as attributes (config.lr); frozen: config.replace(...) makes a changed copy."""

    def __init__(self, **values):
        self.__dict__.update(values)

    def __setattr__(self, name, _value=None):
        raise AttributeError(
            f"the run's configuration is frozen: {name} cannot change after it is resolved "
            "(config.replace(name=value) makes a changed copy)"
        )

    __delattr__ = __setattr__

    def replace(self, **changes):
        return Config(**{**vars(self), **changes})

    @property
    def crop_schedule(self):
        """--res-schedule as a ResSchedule (None without one): the flag stays text, so that args load weights_only."""
        return ResSchedule.parse(self.res_schedule)


def flag(name):
    """The command-line flag of argument `name` (its dest): weight_decay -> --weight-decay."""
    return "--" + name.replace("_", "-")


def env_default(name, kind=str):
    """The value of environment variable `name` converted by `kind`, or None when unset or empty."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return kind(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={value!r} is not a valid {kind.__name__}")


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

    def sizes(self):
        """The smallest and the largest crop."""
        return sorted({self.size(0), self.size(self.last_epoch)})

    def crops(self, epochs):
        """The crops of epochs 0 to epochs - 1, each once, in order, without going through the epochs one by one where
        each crop is within a STEP of the one before: then every multiple of STEP between the ends is passed."""
        last, span = min(epochs - 1, self.last_epoch + 1), self.last_epoch - self.first_epoch  # (+ 1: END after a jump)
        if span and abs(self.end - self.start) < self.step * span:
            low, high = sorted((self.size(0), self.size(last)))
            return list(range(low, high + 1, self.step))
        # (else few epochs change the crop: each by a STEP or more)
        return sorted({self.size(epoch) for epoch in range(min(self.first_epoch, last), last + 1)})

    @staticmethod
    def parse(text):
        """The ResSchedule of a --res-schedule text (ValueError if it is not one); None for none."""
        if not text:
            return None
        try:
            values = [int(part) for part in text.split(":")]
        except ValueError:
            values = []
        if len(values) not in (4, 5) or any(value < 0 for value in values):
            raise ValueError(f"expected START:END:FIRST_EPOCH:LAST_EPOCH[:STEP], whole numbers, got {text!r}")
        schedule = ResSchedule(*values)
        if min(schedule.start, schedule.end, schedule.step) <= 0 or schedule.first_epoch > schedule.last_epoch:
            raise ValueError(f"sizes and STEP must be positive and FIRST_EPOCH <= LAST_EPOCH, got {text!r}")
        return schedule


def profile_steps(text):
    """(start, steps) of --profile START:STEPS (kept as text in the Config); ValueError if `text` is not one."""
    start, _, steps = (text or "").partition(":")
    if not (start.isdigit() and steps.isdigit() and int(steps) > 0):
        raise ValueError(f"expected START:STEPS, whole numbers, STEPS at least 1, got {text!r}")
    return int(start), int(steps)


def resolve(namespace, mode, own_data=False):
    """The frozen Config of what argparse parsed (`namespace`) for a script of `mode` (dp, ddp, spawn; `own_data`: a
    --trainer that builds its datasets): the data source, the layered defaults, the checks (UsageError), the
    pretrained weights' preprocessing, the output dir."""
    check_launcher(mode)
    values = dict(vars(namespace))
    _data_source(values, own_data)
    from_environment = _layered_defaults(values)
    try:
        _check(values)
    except UsageError as error:  # (a value the environment gave: the line names its variable)
        raise _naming_the_variable(error, from_environment) from None
    if mode == "fsdp":
        _check_fsdp(values)
    _learning_rate(values)
    _pretrained(values)
    _check_val_sizes(values)
    if values["deterministic"]:  # read by cuBLAS when it starts: before anything touches CUDA
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    derived = not values["output_dir"]
    values["output_dir"] = values["output_dir"] or default_output_dir(values, mode)
    check_names(values, derived)
    return Config(**values)


def check_launcher(mode):
    """One line where the script of `mode` runs under torchrun, which is not its launcher: train_spawn.py (each of
    torchrun's processes would spawn a job of its own), train_dp.py with several processes (each would train the whole
    run). Was a line about a port or an output directory in use."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or mode not in ("dp", "spawn"):  # (torch.distributed.launch's too)
        return
    if mode == "spawn" or os.environ.get("WORLD_SIZE", "1") != "1":
        script, what = (
            ("train_spawn.py", "starts its own processes")
            if mode == "spawn"
            else ("train_dp.py", "is one process driving every GPU")
        )
        raise UsageError(f"{script} {what}: run it with python, not torchrun (train_ddp.py is torchrun's)")


def _data_source(values, own_data):
    """--data (or DIR, or DATASETS_PATH + DATASETS), --dataset, --dummy, a --trainer's own build_datasets
    (`own_data`) or the built-in demo set: `dataset` says which ("custom" for --dataset or a trainer's own, with or
    without --data; "imagenet" for any other --data), `data` the folder (the demo set's where it is generated)."""
    positional = values.pop("data_positional")
    if positional and values["data"] and positional != values["data"]:
        raise UsageError("give the data directory once: as DIR or as --data, not both")
    values["data"] = values["data"] or positional
    if values["dataset_fn"] and values["dummy"]:
        raise UsageError("give --dataset or --dummy, not both")
    if values["data"] and values["dummy"]:  # (was: random images, the header naming the folder)
        raise UsageError("give --data or --dummy (random images), not both")
    if values["dummy"] and values["decode"] == "gpu":
        raise UsageError("--decode gpu decodes JPEGs, and --dummy has none: leave one of them out")
    if values["data"] is None and not values["dummy"]:
        root, names = env_default("DATASETS_PATH"), env_default("DATASETS")
        if names and not root:
            raise UsageError(
                f"DATASETS={names} names folders under DATASETS_PATH, which is not set: set it, or give --data"
            )
        if root:
            values["data"] = os.path.join(root, names.split(",")[0]) if names else root
    kinds = (("dummy", values["dummy"]), ("custom", values["dataset_fn"] or own_data), ("imagenet", values["data"]))
    values["dataset"] = next((kind for kind, given in kinds if given), "demo")
    if values["dataset"] == "demo":
        from .demo_data import DEFAULT_ROOT

        values["data"] = str(DEFAULT_ROOT)


# The flags an environment variable may give (below the command line, above the presets): {name: (variable, type)}.
ENVIRONMENT_DEFAULTS = {
    "epochs": ("EPOCHS", int),
    "batch_size": ("BATCH_SIZE", int),
    "lr": ("LR", float),
    "dist_backend": ("BACKEND", str),
}


def _layered_defaults(values):
    """Each flag not given takes the value of the highest layer of preset_layers that has it; `data_preset` and
    `from_data_preset` say which dataset preset gave what (the header names them), `lr_source` and
    `lr_reference_batch` where the lr came from and for which batch (--lr-scaling linear). Returns {name: variable}
    of the values an environment variable gave."""
    preset_name = "demo" if values["dataset"] == "demo" else "imagenet"
    from_env = {name: env_default(variable, kind) for name, (variable, kind) in ENVIRONMENT_DEFAULTS.items()}
    layers = preset_layers(values["dataset"], preset_name, values["preset"], from_env, values["lr"])
    # --lr-scaling linear scales an lr from the batch it was given for: the user's (--lr, LR) for 256 images,
    # a preset's for that preset's batch.
    values["lr_source"], values["lr_reference_batch"] = next(
        (name, 256 if name in ("--lr", "LR") else layer["batch_size"])
        for name, layer in reversed(layers)
        if "lr" in layer
    )
    values["data_preset"] = preset_name
    values["from_data_preset"] = [  # (the preset's names that no flag and no higher layer gives)
        name
        for name in PRESETS[preset_name]
        if values.get(name) is None and not any(name in layer for _, layer in layers[2:])
    ]
    values["val_flags_given"] = [  # (-e: the others are the checkpoint's run's)
        name
        for name in ("val_resize_size", "val_crop_size", "interpolation", "label_smoothing", "mean", "std")
        if values[name] is not None
    ]
    warmup_given = values["warmup_epochs"] is not None
    chosen = {name: value for _, layer in layers for name, value in layer.items()}  # (the highest layer's)
    given = {
        name: ENVIRONMENT_DEFAULTS[name][0]
        for name, value in from_env.items()
        if value is not None and values[name] is None
    }
    for name, value in chosen.items():
        if values.get(name) is None:
            values[name] = value
    if values["stop_grace"] is None:  # (the flag, else the environment's STOP_GRACE, else torchrun's own 30 s)
        grace = env_default("STOP_GRACE", float)
        values["stop_grace"] = 30.0 if grace is None else grace
        given.update({"stop_grace": "STOP_GRACE"} if grace is not None else {})
    if not warmup_given and values["warmup_epochs"] >= values["epochs"]:
        values["warmup_epochs"] = 0.0  # the preset's warmup does not fit a run this short
    return given


def _naming_the_variable(error, from_environment):
    """`error`, whose line starts with a flag whose value came from an environment variable ({name: variable}), with
    the variable named after the flag (the user set LR, not --lr)."""
    text = str(error)
    for name, variable in from_environment.items():
        if text.startswith(f"{flag(name)} "):
            return UsageError(f"{flag(name)} (from {variable}={os.environ[variable].strip()}){text[len(flag(name)) :]}")
    return error


def _positive(values, names):
    for name in names:
        if values[name] is None or not values[name] > 0:
            raise UsageError(f"{flag(name)} must be positive, got {values[name]}")
        if not math.isfinite(values[name]):
            raise UsageError(f"{flag(name)} must be finite, got {values[name]}")


def _parsed(values, name, parse):
    """UsageError naming the flag where `parse` refuses a flag kept as text (None: not given)."""
    try:
        if values[name] is not None:
            parse(values[name])
    except ValueError as error:
        raise UsageError(f"{flag(name)}: {error}") from None


def _at_least(values, names, low, requirement):
    """UsageError "--NAME must be <requirement>" for the first given one of `names` below `low` or not finite."""
    for name in names:
        if values[name] is not None and not (values[name] >= low and math.isfinite(values[name])):
            raise UsageError(f"{flag(name)} must be {requirement}, got {values[name]}")


def _within(values, name, low, high, what, high_open=False, low_open=False):
    value = values[name]
    if not ((low < value if low_open else low <= value) and (value < high if high_open else value <= high)):
        raise UsageError(f"{flag(name)} must be {what}, got {value}")


def _check(values):
    """The values' own rules, each broken one a UsageError naming the flag."""
    _positive(
        values,
        [
            "epochs",
            "batch_size",
            "lr",
            "print_freq",
            "train_crop_size",
            "val_resize_size",
            "val_crop_size",
            "dummy_size",
            "lr_step_size",
            "dist_timeout",
            "grad_accum_steps",
            "stop_grace",
            "lr_gamma",
        ],
    )
    _within(values, "batch_size", 1, sys.maxsize, "a whole number from 1 to 2**63 - 1")  # (the sampler's islice)
    if values["peak_tflops"] is not None:
        _positive(values, ["peak_tflops"])
    if values["workers"] != "auto":
        _at_least(values, ["workers"], 0, "auto or 0 or more")
    _parsed(values, "res_schedule", ResSchedule.parse)
    _parsed(values, "profile", profile_steps)
    if values["seed"] is not None:  # (torch's seeds take 64 bits; every rank adds its rank)
        _within(values, "seed", 0, 2**63, "a whole number from 0 to 2**63 - 1", high_open=True)
    _at_least(values, ["checkpoint_interval"], 0, "0 (off) or positive")
    _within(values, "label_smoothing", 0.0, 1.0, "in [0, 1)", high_open=True)
    if values["dist_timeout"] > 1e9:  # (torch's timer overflowed: a traceback)
        raise UsageError(f"--dist-timeout must be at most 1e9 seconds, got {values['dist_timeout']:g}")
    parts = (values["dist_backend"] or "gloo").split(",")  # (torch's, or "cpu:gloo,cuda:nccl": by device)
    if any(part.split(":")[-1] not in ("nccl", "gloo", "ucc", "mpi", "xccl") for part in parts):
        raise UsageError(f"--dist-backend must be nccl or gloo (or another of torch's), got {values['dist_backend']}")
    if values["opt"] == "sgd-nesterov" and not values["momentum"] > 0:  # (torch's SGD refuses it: a traceback)
        raise UsageError(f"--opt sgd-nesterov needs a --momentum above 0, got {values['momentum']:g}")
    if not 0 <= values["warmup_epochs"] < values["epochs"]:
        raise UsageError(f"--warmup-epochs must be in [0, --epochs), got {values['warmup_epochs']}")
    if values["lr_step_unit"] == "epoch" and values["warmup_epochs"] != int(values["warmup_epochs"]):
        raise UsageError(f"--warmup-epochs {values['warmup_epochs']:g} with --lr-step-unit epoch: give whole epochs")
    if values["dropout"] is not None:
        _within(values, "dropout", 0.0, 1.0, "in [0, 1)", high_open=True)
    _at_least(values, ["mixup_alpha", "cutmix_alpha"], 0, "0 (off) or positive")
    _within(values, "random_erase", 0.0, 1.0, "a probability in [0, 1]")
    _within(values, "hflip_prob", 0.0, 1.0, "a probability in [0, 1]")
    _within(values, "min_crop_scale", 0.0, 1.0, "in (0, 1]", low_open=True)
    _within(values, "model_ema_decay", 0.0, 1.0, "in [0, 1]")
    _at_least(values, ["model_ema_steps", "ra_reps"], 1, "1 or more")
    _within(values, "ra_magnitude", 0, 30, "in [0, 30]")
    _within(values, "augmix_severity", 1, 10, "in [1, 10]")
    _at_least(values, ["weight_decay", "norm_weight_decay", "bias_weight_decay", "momentum", "lr_min"], 0, "0 or more")
    if values["clip_grad_norm"] is not None:
        _positive(values, ["clip_grad_norm"])
    if values["lr_min"] and values["lr_schedule"] != "cosine":
        raise UsageError(
            f"--lr-min is where the cosine schedule ends: add --lr-schedule cosine (not {values['lr_schedule']})"
        )
    if values["init_from"] and (values["pretrained"] or values["weights"]):
        raise UsageError("--init-from and --pretrained both give the starting weights: choose one")
    if values["evaluate"] and not (
        values["resume"] or values["pretrained"] or values["weights"] or values["init_from"]
    ):
        raise UsageError(
            "-e evaluates the weights of --resume PATH, --init-from PATH or --pretrained: give one of them"
        )
    if values["evaluate"] and values["profile"]:  # (was: nothing recorded, without a word)
        raise UsageError("--profile records training steps, and -e trains none: leave one of them out")
    check_arch(values["arch"])


def _check_val_sizes(values):
    """A centre crop larger than the resize would pad the image with black (torchvision's CenterCrop does)."""
    crop, resize = values["val_crop_size"], values["val_resize_size"]
    if crop > resize and values["dataset"] != "dummy":  # (--dummy's images are made at the crop's size)
        raise UsageError(
            f"--val-crop-size {crop} is larger than --val-resize-size {resize}: the centre crop would pad the resized "
            "image with black (give a crop at most the resize)"
        )


def _check_fsdp(values):
    """What train_fsdp.py cannot do, refused in one line each."""
    if values["save_on"] == "node":
        raise UsageError(
            "--save-on node: every rank writes its shard of a sharded checkpoint, so all ranks need "
            "one shared file system (leave --save-on out)"
        )
    if values["amp"] == "fp16":
        raise UsageError(
            "--amp fp16 needs loss scaling, which the sharded gradients do not have here: use --amp bf16 "
            "(FSDP's mixed precision: bf16 compute, float32 gradient reduction, no scaling)"
        )
    if values["channels_last"] == "on":
        raise UsageError(
            "--channels-last on: FSDP shards contiguous parameters only, and channels-last weights are "
            "not (leave it out: the default is off under FSDP)"
        )
    if values["cpu_offload"] and values["clip_grad_norm"]:
        raise UsageError(
            "--cpu-offload with --clip-grad-norm: the gradient norm over shards kept in host memory needs a "
            "CPU backend beside NCCL, which this script does not start (leave one of them out)"
        )
    if values["find_unused_parameters"]:
        raise UsageError("--find-unused-parameters is DDP's: FSDP needs no such flag (leave it out)")


def _learning_rate(values):
    """--lr-scaling linear: the lr for this global batch (`lr_given`: the lr before scaling)."""
    values["lr_given"] = values["lr"]  # for lr_reference_batch images
    if values["lr_scaling"] == "linear":
        values["lr"] = values["lr"] * values["batch_size"] / values["lr_reference_batch"]
    if values["lr_min"] and values["lr_min"] >= values["lr"]:
        raise UsageError(f"--lr-min {values['lr_min']:g} must be below the lr, {values['lr']:g}")


def _pretrained(values):
    """--weights implies --pretrained; their name as torchvision spells it; on ImageNet-style data and --dummy,
    validation takes the weights' own resize, crop and interpolation unless flags give them (`val_preprocessing`
    says where they came from)."""
    values["pretrained"] = values["pretrained"] or values["weights"] is not None
    values["val_interpolation"] = values["interpolation"]
    values["interpolation"] = values["interpolation"] or "bilinear"
    values["val_preprocessing"] = None
    if values["pretrained"]:
        from .pretrained import pretrained_weights

        weights = pretrained_weights(values["arch"], values["weights"])
        values["weights"] = f"{type(weights).__name__}.{weights.name}"
        if values["dataset"] != "demo":
            # As torchvision's train.py evaluates weights: with their own transforms() (what they were measured with).
            preprocessing = weights.transforms()
            given = (preprocessing.resize_size[0], preprocessing.crop_size[0], preprocessing.interpolation.value)
            said = _take(values, dict(zip(_PARTS, given)))  # (resize, crop, interpolation: _PARTS' order)
            values["val_preprocessing"] = said and f"{said} from {values['weights']}.transforms()"
    values["val_interpolation"] = values["val_interpolation"] or "bilinear"


_PARTS = {
    "val_resize_size": ("resize", "val_resize_size"),
    "val_crop_size": ("crop", "val_crop_size"),
    "val_interpolation": ("interpolation", "interpolation"),
    "label_smoothing": ("label smoothing", "label_smoothing"),  # (-e's loss: its run's validation's)
    "mean": ("mean", "mean"),  # (its run's --mean/--std; not given: the dataset's or ImageNet's, as -e's)
    "std": ("std", "std"),
}  # (the word, the flag's name in val_flags_given)


def _take(values, taken):
    """Set each validation size of `taken` ({name: value}) that no flag gave; returns what the header says of
    them ("resize, crop and interpolation"; None: every one given)."""
    named = [name for name in taken if _PARTS[name][1] not in values["val_flags_given"]]
    values.update({name: taken[name] for name in named})
    words = [_PARTS[name][0] for name in named]
    return f"{', '.join(words[:-1])} and {words[-1]}" if len(words) > 1 else (words[0] if words else None)


def evaluated_as_trained(config, args):
    """-e of a checkpoint that holds its run's flags (`args`): validation at that run's resize, crop, interpolation and
    --mean/--std, its loss with that run's label smoothing, each unless a flag gives it; val_preprocessing says which
    came from it."""
    values = dict(vars(config))
    said = _take(values, {name: args[name] for name in _PARTS if args.get(name) is not None})
    if said is None:
        return config
    values["val_preprocessing"] = f"{said} of the checkpoint's run"  # (not the preset's)
    values["from_data_preset"] = [name for name in config.from_data_preset if name not in _PARTS]
    try:  # (checked before with the preset's: a crop given against the checkpoint's resize evaluated padded images)
        _check_val_sizes(values)
    except UsageError as error:
        raise UsageError(f"{error}; the size a flag does not give is the checkpoint's run's") from None
    return Config(**values)


def check_arch(arch):
    """A torchvision classification model's name (a typo gets "did you mean"), or package.module:callable."""
    if ":" in arch:
        from .models import custom_builder

        custom_builder(arch)
        return
    import torchvision.models

    names = torchvision.models.list_models(module=torchvision.models)
    if arch not in names:
        close = difflib.get_close_matches(arch, names, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else "see torchvision.models.list_models()"
        raise UsageError(f"unknown --arch {arch!r}: {hint}")


def folder_name(path):
    """The name of the folder at `path`, as text (TensorBoard's paths must be UTF-8): bytes that are not, as \\xNN."""
    return os.fsencode(Path(path).resolve().name).decode(errors="backslashreplace")


def default_output_dir(values, mode):
    """A run name fixed by mode, arch and data, so --resume auto finds the last run again (your own
    package.module:name as its name, and --data's folder's with it; a --trainer's that builds its datasets)."""
    if values["dataset"] == "custom":
        dataset = (values["dataset_fn"] or values["trainer"]).replace(":", ".")
        dataset += f"-{folder_name(values['data'])}" if values["data"] else ""
    elif values["dataset"] == "imagenet":
        dataset = folder_name(values["data"])
    else:
        dataset = values["dataset"]
    root = env_default("WORKSPACE") or "runs"
    # No colon in the name: TensorBoard's --logdir reads NAME:PATH, and some file systems refuse it.
    return os.path.join(root, f"{mode}-{values['arch'].replace(':', '.')}-{dataset}")


# Defaults that depend on the data. The demo preset is sized so that a small model learns the built-in set in minutes
# on two CPU cores.
PRESETS = {
    "imagenet": dict(
        epochs=90,
        batch_size=256,
        lr=0.1,
        print_freq=10,
        train_crop_size=224,
        val_resize_size=256,
        val_crop_size=224,
        lr_schedule="step",
        warmup_epochs=0.0,
        min_crop_scale=0.08,
    ),
    "demo": dict(
        epochs=10,
        batch_size=64,
        lr=0.04,
        print_freq=20,
        train_crop_size=32,
        val_resize_size=36,
        val_crop_size=32,
        lr_schedule="cosine",
        warmup_epochs=1.0,
        min_crop_scale=0.7,
    ),
}

# The defaults of the flags a recipe may set (below the dataset's preset in precedence).
RECIPE_DEFAULTS = dict(
    momentum=0.9,
    weight_decay=1e-4,
    norm_weight_decay=None,
    bias_weight_decay=None,
    label_smoothing=0.0,
    mixup_alpha=0.0,
    cutmix_alpha=0.0,
    auto_augment="none",
    ra_magnitude=9,
    random_erase=0.0,
    model_ema=False,
    model_ema_decay=0.99998,
    model_ema_steps=32,
    ra_sampler=False,
    ra_reps=3,
    lr_scaling="none",
    lr_step_unit="step",
)

# --preset: a published recipe in one flag. "name" is what the run's header says of it; "training" holds
# what applies to any data (augmentation, regularisation); "scale" what fits ImageNet only (epochs, batch,
# lr, image sizes), which the demo set keeps its own of. Command line and environment still take precedence.
RECIPES = {
    # torchvision's ResNet-50 IMAGENET1K_V2 weights: references/classification/train.py's command for them, on 8 GPUs
    # of --batch-size 128 (global 1024), with linear warmup and its --lr-scheduler cosineannealinglr.
    "tv-v2": dict(
        name="torchvision's ResNet-50 V2 recipe, published 80.86% acc@1, not measured here",
        training=dict(
            label_smoothing=0.1,
            mixup_alpha=0.2,
            cutmix_alpha=1.0,
            auto_augment="ta_wide",
            random_erase=0.1,
            weight_decay=2e-5,
            norm_weight_decay=0.0,
            model_ema=True,
            model_ema_decay=0.99998,
            model_ema_steps=32,
            ra_sampler=True,
            ra_reps=4,
            lr_step_unit="epoch",
        ),
        scale=dict(
            epochs=600,
            batch_size=1024,
            lr=0.5,
            lr_schedule="cosine",
            warmup_epochs=5.0,
            train_crop_size=176,
            val_resize_size=232,
            val_crop_size=224,
        ),
    ),
}


def preset_layers(dataset, preset_name, recipe_name, from_env, lr_flag):
    """The layers of defaults, lowest precedence first, as (name of the lr it may give, {flag: value})."""
    recipe = RECIPES.get(recipe_name, {})
    return [
        ("", RECIPE_DEFAULTS),
        (f"the {preset_name} preset's lr", PRESETS[preset_name]),
        ("", recipe.get("training", {})),
        (f"--preset {recipe_name}'s lr", recipe.get("scale", {}) if dataset != "demo" else {}),
        ("LR", {name: value for name, value in from_env.items() if value is not None}),
        ("--lr", {"lr": lr_flag} if lr_flag is not None else {}),
    ]

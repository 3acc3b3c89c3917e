"""Defaults that depend on the data (the dataset presets) and published recipes in one flag (--preset).

Precedence, highest first: the command line, the platform's environment (EPOCHS, LR, BATCH_SIZE, BACKEND),
--preset (its "scale" part on ImageNet-style data and --dummy only), the dataset's preset, RECIPE_DEFAULTS.
"""

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


def layers(dataset, preset_name, recipe_name, from_env, lr_flag):
    """The layers of defaults, lowest precedence first, as (name of the lr it may give, {flag: value})."""
    recipe = RECIPES.get(recipe_name, {})
    return [("", RECIPE_DEFAULTS), (f"the {preset_name} preset's lr", PRESETS[preset_name]),
            ("", recipe.get("training", {})),
            (f"--preset {recipe_name}'s lr", recipe.get("scale", {}) if dataset != "demo" else {}),
            ("LR", {name: value for name, value in from_env.items() if value is not None}),
            ("--lr", {"lr": lr_flag} if lr_flag is not None else {})]


def describe_preset(config, first_image=None):
    """Header lines: which dataset preset set which defaults of this run, and why; a warning where the
    ImageNet preset's crop is far larger than the images (first_image: (channels, height, width, dtype))."""
    names = {"epochs": "{} epochs", "batch_size": "-b {}", "lr": "lr {:g}", "train_crop_size": "{} px crops",
             "val_resize_size": "val resize {}", "val_crop_size": "val crop {}", "lr_schedule": "{} schedule"}
    given = [text.format(getattr(config, name)) for name, text in names.items() if name in config.from_data_preset]
    if not given:
        return []
    why = ("the built-in demo set" if config.data_preset == "demo"
           else "the default for --data, --dataset and --dummy, made for ImageNet-sized images")
    lines = [f"preset: {config.data_preset} ({why}) sets {', '.join(given)}; flags, the environment and --preset "
             "override it"]
    crop = config.train_crop_size
    if first_image and "train_crop_size" in config.from_data_preset and 2 * min(first_image[1:3]) <= crop:
        height, width = first_image[1:3]
        lines.append(f"warning: the first training image is {width}x{height} px, the {config.data_preset} preset crops "
                     f"{crop} px: for images this small give --train-crop-size, --val-resize-size and "
                     f"--val-crop-size near {min(height, width)} (and --epochs, -b, --lr for your data)")
    return lines

"""What docs/adapting.md promises a researcher who copies this repository: their own dataset (any map-style
dataset of (image, label); the built-in CSV splits), model (auxiliary heads, every torchvision family, sizes a
model cannot take), optimizer (--opt, --clip-grad-norm) and trainer, each in one place, and each mistake
refused at start in one line. The examples/ under the launchers: tests/test_examples.py."""
import csv
import functools
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torchvision

from conftest import assert_ok, no_traceback_of_ours, run_prewarmed, torchrun
from common import data
from common.engine import loss_with_aux
from common.meters import MetricSums, totals_by_name
from common.models import build_model, check_input_size
from common.errors import UsageError
from common.trainer import Trainer

SMALL = ["--train-crop-size", "16", "--val-resize-size", "16", "--val-crop-size", "16", "-j", "0", "-p", "1",
         "--epochs", "1", "-b", "4", "--seed", "1"]
TINY_NET = ["-a", "tests.tiny_models:TinyNet"]


def one_line_error(result):
    """The error line of a run refused at start: exit 2, one line, no traceback."""
    assert result.returncode == 2, result.stdout[-3000:]
    assert "Traceback" not in result.stdout, result.stdout[-3000:]
    errors = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stdout[-3000:]
    return errors[0]


# ----------------------------------------------------------------------------- datasets

REFUSED = {
    "triples": "item 0 of the train set is a tuple of 3; items must be (image, label)",
    "numpy_images": "the image is a ndarray; expected a PIL image or a CHW tensor (torch.from_numpy(array).permute(2, 0, 1)",
    "hwc_tensors": "an image of shape [20, 6, 3]; expected channels x height x width",
    "labels_out_of_range": "label 3; expected a class index, an int in 0..2",
    "iterable": "the train set is a Stream: give a map-style dataset",
    "two_things": "returned tuple: return (classes, train_set, val_set)",
    "uint16_images": "an image of dtype torch.int16; expected uint8 (0-255) or float (0-1)",
    "gray_tensors": "the images have 1 channel(s): give --mean and --std with 1 value(s) each",
    "late_bad_item": "item 5 of the train set is a tuple of 3; items must be (image, label)",
}


@pytest.fixture(scope="module")
def dataset_refusals(tmp_path_factory):
    out = tmp_path_factory.mktemp("refused")
    runs = [[*SMALL, *TINY_NET, "--dataset", f"tests.custom_datasets:{name}", "--output-dir", out / name]
            for name in REFUSED]
    return dict(zip(REFUSED, run_prewarmed("train_dp.py", runs)))


@pytest.mark.parametrize("name", REFUSED)
def test_a_dataset_item_the_loaders_cannot_take_is_refused_in_one_line(dataset_refusals, name):
    """Checked at start on item 0 (late_bad_item: in a loader worker, still one line), before any training."""
    line = one_line_error(dataset_refusals[name])
    assert REFUSED[name] in line, line


@pytest.fixture(scope="module")
def own_datasets(tmp_path_factory):
    out = tmp_path_factory.mktemp("own")
    runs = {"pil_images": [*TINY_NET], "float_tensors": [*TINY_NET],
            "gray_with_stats": ["-a", "tests.custom_datasets:gray_net"],
            "gray_tensors": ["-a", "tests.custom_datasets:gray_net", "--mean", "0.5", "--std", "0.25"],
            "unreadable_items": [*TINY_NET]}
    argvs = [[*SMALL, *flags, "--dataset", f"tests.custom_datasets:{name}", "--output-dir", out / name]
             for name, flags in runs.items()]
    # The ImageNet preset's sizes on 20 px images: said in the header, warned of.
    argvs.append([*TINY_NET, "--epochs", "1", "-b", "4", "-j", "0", "--dataset", "tests.custom_datasets:pil_images",
                  "--output-dir", out / "preset"])
    results = run_prewarmed("train_dp.py", argvs)
    return dict(zip([*runs, "preset"], results)), out


def test_a_dataset_that_is_not_imagenet_sized_hears_which_preset_applies_and_why(own_datasets):
    results, _ = own_datasets
    output = assert_ok(results["preset"])
    assert ("preset: imagenet (the default for --data, --dataset and --dummy, made for ImageNet-sized images) sets "
            "-b 256, lr 0.1, 224 px crops, val resize 256, val crop 224, step schedule") not in output  # -b given
    assert ("preset: imagenet (the default for --data, --dataset and --dummy, made for ImageNet-sized images) sets "
            "lr 0.1, 224 px crops, val resize 256, val crop 224, step schedule; flags, the environment and --preset "
            "override it") in output, output[:2000]
    assert ("warning: the first training image is 20x20 px, the imagenet preset crops 224 px: for images this small "
            "give --train-crop-size, --val-resize-size and --val-crop-size near 20") in output


@pytest.mark.parametrize("name, normalisation", [
    ("pil_images", "mean 0.485, 0.456, 0.406, std 0.229, 0.224, 0.225 (ImageNet's)"),
    ("float_tensors", "mean 0.485, 0.456, 0.406, std 0.229, 0.224, 0.225 (ImageNet's)"),
    ("gray_with_stats", "mean 0.47, std 0.3 (the dataset's mean/std)"),
    ("gray_tensors", "mean 0.5, std 0.25 (--mean/--std)"),
    ("unreadable_items", "mean 0.485, 0.456, 0.406, std 0.229, 0.224, 0.225 (ImageNet's)")])
def test_a_dataset_of_pil_images_or_tensors_trains_and_validates_each_image_once(own_datasets, name, normalisation):
    results, out = own_datasets
    result = results[name]
    assert_ok(result)
    assert f"data: --dataset tests.custom_datasets:{name} (3 classes, 12 train / 6 val images" in result.stdout
    assert f"normalised with {normalisation}" in result.stdout, result.stdout[:2000]
    assert re.search(r"^ \* Acc@1 .*\(6 images\)$", result.stdout, re.MULTILINE), result.stdout[-2000:]


def test_items_a_dataset_cannot_read_are_skipped_and_listed_by_name(own_datasets):
    results, out = own_datasets
    assert "warning: skipped Items[2]: cannot decode it (cannot read sample 2)" in results["unreadable_items"].stdout
    listed = (out / "unreadable_items" / "bad_images.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in listed] == ["Items[2]", "Items[3]"]


def float_and_uint8_inputs():
    """The model inputs of one batch of the same pixels given as uint8 and as float images (CPU loaders)."""
    inputs = []
    for name in ("pil_images", "float_tensors"):
        args = SimpleNamespace(dummy=False, dataset_fn=f"tests.custom_datasets:{name}", data=None, workers=0, compile=False,
                               strict_data=False, train_crop_size=16, val_resize_size=20, val_crop_size=20,
                               mean=None, std=None)
        loaders = data.build_data(args, seed=0, rank=0, world_size=1, per_process_batch=6, gpu=False)
        inputs.append(next(iter(loaders.val_loader))[0])
    return inputs


def test_uint8_and_float_images_of_the_same_pixels_give_the_same_inputs():
    """pil_images' items are grey PIL images (converted to RGB), float_tensors' the same pixels / 255 in 3
    channels: normalised on one scale each, they are the same model inputs."""
    from_uint8, from_float = float_and_uint8_inputs()
    assert from_uint8.dtype == from_float.dtype == torch.float32
    # pil_images is the grey (L) version of the noise: compare the channel means, which the noise barely moves.
    assert torch.allclose(from_uint8.mean(dim=(1, 2, 3)), from_float.mean(dim=(1, 2, 3)), atol=0.05)


@pytest.fixture(scope="module")
def csv_splits(tiny_data, tmp_path_factory):
    """tiny_data listed in train.csv / val.csv (paths relative to the folder, a header row), and in .tsv."""
    root = tmp_path_factory.mktemp("splits")
    for suffix, delimiter in ((".csv", ","), (".tsv", "\t")):
        folder = root / suffix[1:]
        folder.mkdir()
        (folder / "images").symlink_to(tiny_data)
        for split in ("train", "val"):
            with open(folder / f"{split}{suffix}", "w", newline="") as file:
                writer = csv.writer(file, delimiter=delimiter)
                writer.writerow(["path", "label"])
                for path in sorted((tiny_data / split).glob("*/*.jpg")):
                    writer.writerow([f"images/{split}/{path.parent.name}/{path.name}", path.parent.name])
    return root


def test_the_built_in_csv_and_tsv_splits_train_as_the_image_folder_does(csv_splits, tiny_data, tmp_path):
    runs = [[*SMALL, *TINY_NET, "--data", csv_splits / kind, "--output-dir", tmp_path / kind] for kind in ("csv", "tsv")]
    runs.append([*SMALL, *TINY_NET, "--data", tiny_data, "--output-dir", tmp_path / "folder"])
    results = run_prewarmed("train_dp.py", runs)
    logs = []
    for result in results:
        assert_ok(result)
        assert "(3 classes, 24 train / 12 val images" in result.stdout
        logs.append((tmp_path / result.args[-1]).joinpath("log.csv").read_text().splitlines()[1].split(",")[4:9])
    assert logs[0] == logs[1] == logs[2]  # the same files in the same order: the same losses


def test_csv_splits_that_do_not_fit_are_refused_in_one_line(csv_splits, tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "train.csv").write_text("a.jpg,cat\n")
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "train.csv").write_text("a.jpg,cat\n")
    (tmp_path / "unknown" / "val.csv").write_text("b.jpg,dog\n")
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "train.csv").write_text("path,label\na.jpg\n")
    (tmp_path / "short" / "val.csv").write_text("b.jpg,cat\n")
    runs = [[*SMALL, *TINY_NET, "--data", tmp_path / name, "--output-dir", tmp_path / f"out-{name}"]
            for name in ("one", "unknown", "short")]
    lines = [one_line_error(result) for result in run_prewarmed("train_dp.py", runs)]
    assert "has train.csv but no val.csv: give both splits" in lines[0]
    assert "val labels dog of" in lines[1] and "do not occur in its train split" in lines[1]
    assert "train.csv line 2: expected path,label, got 'a.jpg'" in lines[2]


# ----------------------------------------------------------------------------- models

# The smallest model of each classification family torchvision lists, and a crop it takes (the smallest
# that is a multiple of 32 and at least its minimum; ViT and MaxViT take 224 alone, Inception v3's
# auxiliary head needs 299 in training).
FAMILIES = {"alexnet": ("alexnet", 64), "convnext": ("convnext_tiny", 32), "densenet": ("densenet121", 32),
            "efficientnet": ("efficientnet_b0", 32), "googlenet": ("googlenet", 32), "inception": ("inception_v3", 299),
            "maxvit": ("maxvit_t", 224), "mnasnet": ("mnasnet0_5", 32), "mobilenet": ("mobilenet_v3_small", 32),
            "regnet": ("regnet_x_400mf", 32), "resnet": ("resnet18", 32), "resnext": ("resnext50_32x4d", 32),
            "shufflenet": ("shufflenet_v2_x0_5", 32), "squeezenet": ("squeezenet1_1", 32), "swin": ("swin_t", 32),
            "vgg": ("vgg11", 32), "vit": ("vit_b_16", 224), "wide_resnet": ("wide_resnet50_2", 32)}


def test_the_families_cover_every_classification_model_torchvision_lists():
    names = torchvision.models.list_models(module=torchvision.models)
    assert [name for name in names if not name.startswith(tuple(FAMILIES))] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_the_smallest_model_of_each_family_trains_one_step_at_a_size_it_takes(family):
    """build_model, the size check, then the Trainer's own train_step and optimizer_step (auxiliary heads
    included: GoogLeNet's and Inception's named tuples), on 2 random images."""
    arch, size = FAMILIES[family]
    torch.manual_seed(0)
    model = build_model(arch, num_classes=3)
    check_input_size(model, arch, [size], size)  # passes
    trainer = SimpleNamespace(args=SimpleNamespace(clip_grad_norm=1.0), model=model, criterion=nn.CrossEntropyLoss(),
                              aux_weight=None, scaler=torch.amp.GradScaler("cpu", enabled=False))
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
    before = [p.detach().clone() for p in model.parameters()]
    model.train()
    loss, logits = Trainer.train_step(trainer, model, torch.randn(2, 3, size, size), torch.tensor([0, 2]))
    Trainer.optimizer_step(trainer, loss)
    assert logits.shape == (2, 3) and torch.isfinite(loss)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("arch, size, line", [
    ("inception_v3", 32, "--arch inception_v3 cannot take 32x32 px images (Calculated padded input size"),
    ("vit_b_16", 256, "--arch vit_b_16 cannot take 256x256 px images (Wrong image height! Expected 224 but got 256!)"),
    ("alexnet", 32, "--arch alexnet cannot take 32x32 px images")])
def test_a_size_a_model_cannot_take_is_refused_in_one_line(arch, size, line):
    with pytest.raises(UsageError) as refused:
        check_input_size(build_model(arch, num_classes=3), arch, [size], size)
    assert str(refused.value).startswith(line)
    assert "(torchvision: at least" in str(refused.value) and "\n" not in str(refused.value)


def test_auxiliary_outputs_add_their_weighted_loss():
    criterion, labels = nn.CrossEntropyLoss(), torch.tensor([0, 1])
    main, aux1, aux2 = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    googlenet = torchvision.models.GoogLeNetOutputs(main, aux2, aux1)
    inception = torchvision.models.InceptionOutputs(main, aux1)
    loss, logits = loss_with_aux(criterion, googlenet, labels)
    assert logits is main
    assert loss == pytest.approx(criterion(main, labels) + 0.3 * (criterion(aux1, labels) + criterion(aux2, labels)))
    loss, _ = loss_with_aux(criterion, inception, labels)
    assert loss == pytest.approx(criterion(main, labels) + 0.4 * criterion(aux1, labels))
    loss, logits = loss_with_aux(criterion, {"logits": main, "aux": aux1}, labels, aux_weight=0.5)
    assert logits is main and loss == pytest.approx(criterion(main, labels) + 0.5 * criterion(aux1, labels))
    with pytest.raises(UsageError, match="a dict without 'logits' or 'out'"):
        loss_with_aux(criterion, {"main": main}, labels)


@pytest.fixture(scope="module")
def model_runs(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("models")
    common = ["--train-crop-size", "32", "--val-resize-size", "32", "--val-crop-size", "32", "-j", "0", "-p", "1",
              "--epochs", "1", "-b", "4", "--seed", "1", "--data", tiny_data]
    runs = {"googlenet": torchrun("train_ddp.py", 2, *common, "-a", "googlenet", "--output-dir", out / "googlenet"),
            "unused": torchrun("train_ddp.py", 2, *common, "-a", "tests.tiny_models:UnusedNet", "--output-dir", out / "u"),
            "unused_found": torchrun("train_ddp.py", 2, *common, "-a", "tests.tiny_models:UnusedNet",
                                     "--find-unused-parameters", "--output-dir", out / "uf")}
    runs["inception"], = run_prewarmed("train_dp.py", [[*common, "-a", "inception_v3", "--output-dir", out / "i"]])
    return runs


def test_googlenet_trains_under_torchrun_with_its_auxiliary_heads(model_runs):
    """Seen once: both ranks ended with `TypeError: cross_entropy_loss(): argument 'input' (position 1) must be
    Tensor, not GoogLeNetOutputs`."""
    result = model_runs["googlenet"]
    assert_ok(result)
    assert re.search(r"^ \* Acc@1 .*\(12 images\)$", result.stdout, re.MULTILINE)


def test_inception_at_a_crop_too_small_is_refused_in_one_line_naming_its_size(model_runs):
    line = one_line_error(model_runs["inception"])
    assert "--arch inception_v3 cannot take 32x32 px images" in line and "trained at 299 px" in line


def test_a_parameter_left_unused_needs_find_unused_parameters_and_says_so_in_one_line(model_runs):
    refused, trained = model_runs["unused"], model_runs["unused_found"]
    assert refused.returncode != 0 and no_traceback_of_ours(refused.stdout), refused.stdout[-3000:]
    assert "parameters that received no gradient: add --find-unused-parameters" in refused.stdout, refused.stdout[-3000:]
    assert_ok(trained)


# ----------------------------------------------------------------------------- optimizers and clipping

@pytest.mark.parametrize("opt, expected", [
    ("sgd", functools.partial(torch.optim.SGD, momentum=0.9, weight_decay=1e-4, nesterov=False)),
    ("sgd-nesterov", functools.partial(torch.optim.SGD, momentum=0.9, weight_decay=1e-4, nesterov=True)),
    ("rmsprop", functools.partial(torch.optim.RMSprop, momentum=0.9, weight_decay=1e-4, eps=0.0316, alpha=0.9)),
    ("adamw", functools.partial(torch.optim.AdamW, weight_decay=1e-4))])
def test_opt_builds_the_optimizer_torchvisions_train_py_builds(no_platform_env, opt, expected):
    """torchvision's references/classification/train.py: SGD(momentum, weight_decay, nesterov="nesterov" in opt),
    RMSprop(momentum, weight_decay, eps=0.0316, alpha=0.9), AdamW(weight_decay); the header names it."""
    import train_dp
    from common.schedule import build_optimizer, describe_optimizer
    args = train_dp.parse_args(["--opt", opt, "--lr", "0.1"])
    ours, theirs = build_optimizer(nn.Linear(2, 2), args), expected(nn.Linear(2, 2).parameters(), lr=0.1)
    assert type(ours) is type(theirs) and ours.defaults == theirs.defaults
    assert describe_optimizer(ours, args).startswith(f"optimizer: {type(theirs).__name__}, lr 0.1")


def test_clip_grad_norm_clips_the_unscaled_gradients_under_fp16():
    """Under --amp fp16 the gradients are those of the loss times the scale (2**16 at first): clipping them
    before unscaling would clip to a norm 65536 times too small. optimizer_step unscales first."""
    def stepped(scaled):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        trainer = SimpleNamespace(args=SimpleNamespace(clip_grad_norm=0.5), model=model,
                                  scaler=torch.amp.GradScaler("cpu", enabled=scaled))
        trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda step: 1.0)
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        loss = (model(torch.ones(3, 4)) ** 2).sum()
        Trainer.optimizer_step(trainer, loss)
        return torch.cat([p.detach().flatten() for p in model.parameters()]) - before
    unscaled, scaled = stepped(False), stepped(True)
    assert unscaled.norm().item() == pytest.approx(0.5, rel=1e-5)  # clipped to 0.5, lr 1
    assert torch.allclose(scaled, unscaled, rtol=1e-5, atol=1e-7)


def test_a_resume_with_another_optimizer_or_trainer_is_refused_in_one_line(tiny_data, tmp_path):
    out = tmp_path / "run"
    first, = run_prewarmed("train_dp.py", [[*SMALL, *TINY_NET, "--data", tiny_data, "--output-dir", out]])
    assert_ok(first)
    more = [*SMALL, "--epochs", "2", *TINY_NET, "--data", tiny_data, "--output-dir", out, "--resume", "auto"]
    refusals = run_prewarmed("train_dp.py", [[*more, "--opt", "adamw"],
                                             [*more, "--trainer", "examples.extra_metric:WithConfidence"]],
                              parallel=1)  # one run at a time in an output directory
    lines = [one_line_error(result) for result in refusals]
    assert lines[0].endswith("was trained with --opt sgd: resume it with --opt sgd (its optimizer state is that optimizer's)")
    assert lines[1].endswith("was trained without --trainer: resume it so (a trainer's state and steps are its own)")


# ----------------------------------------------------------------------------- metrics by name

def test_train_totals_of_a_checkpoint_before_named_metrics_resume_by_position():
    """Checkpoints before named metrics held [loss, hits@1, hits@5, count]: read as those names, and a value
    named since starts at 0."""
    assert totals_by_name([6.0, 2.0, 3.0, 4]) == {"loss": 6.0, "hits1": 2.0, "hits5": 3.0, "count": 4}
    metrics = MetricSums(torch.device("cpu"), base=[6.0, 2.0, 3.0, 4])
    metrics.update(torch.tensor(1.0), torch.eye(3)[:2], torch.tensor([0, 1]), {"extra": torch.tensor(0.5)})
    totals = metrics.totals()
    assert totals == {"loss": 8.0, "hits1": 4.0, "hits5": 5.0, "extra": 1.0, "count": 6.0}
    summary = metrics.summary()
    assert summary["extra"] == pytest.approx(1 / 6) and summary["loss"] == pytest.approx(8 / 6)


def test_a_logged_value_must_be_a_scalar_with_a_name_of_its_own():
    metrics = MetricSums(torch.device("cpu"))
    with pytest.raises(UsageError, match="logged value 'per_class' has shape \\[3\\]: log a scalar"):
        metrics.update(torch.tensor(1.0), torch.eye(3), torch.tensor([0, 1, 2]), {"per_class": torch.ones(3)})
    with pytest.raises(UsageError, match="may not be named 'loss'"):
        metrics.update(torch.tensor(1.0), torch.eye(3), torch.tensor([0, 1, 2]), {"loss": torch.tensor(1.0)})


def test_a_trainer_that_is_no_trainer_or_returns_the_wrong_thing_is_refused_in_one_line(tiny_data, tmp_path):
    runs = [[*SMALL, *TINY_NET, "--data", tiny_data, "--output-dir", tmp_path / "a", "--trainer", "tests.tiny_models:TinyNet"],
            [*SMALL, *TINY_NET, "--data", tiny_data, "--output-dir", tmp_path / "b", "--trainer",
             "tests.tiny_models:ReturnsLogitsOnly"]]
    lines = [one_line_error(result) for result in run_prewarmed("train_dp.py", runs)]
    assert lines[0] == "error: --trainer tests.tiny_models:TinyNet is not a subclass of common.trainer.Trainer"
    assert lines[1] == "error: train_step returned Tensor: return (loss, logits) or (loss, logits, {name: scalar value})"

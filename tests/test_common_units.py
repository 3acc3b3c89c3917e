"""Unit specifications of common/: run in-process, no subprocesses, no process group."""
import argparse
import collections
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torchvision
from PIL import Image

from common import args as cli
from common import checkpoint
from common import data as data_module
from common import meters
from common.args import UsageError
from common.console import say
from common.data import DeviceLoader, EvalPreset, ShardSampler, SeededTransform, TrainPreset, build_data, load_image
from common.folder_index import scan_image_folder
from common.meters import AverageMeter, MetricSums, ProgressMeter, accuracy, correct_counts
from common.models import build_model
from common.schedule import LrFactor, build_scheduler
from common.trainer import per_process_batch

def parse(*argv):
    return cli.parse_args(cli.build_parser("test"), list(argv))


# ----------------------------------------------------------------------------- meters

# Four samples, four classes; per row the classes ranked by score are given in the comment.
SCORES = torch.tensor([[0.9, 0.05, 0.03, 0.02],    # 0 > 1 > 2 > 3
                       [0.1, 0.2, 0.3, 0.4],       # 3 > 2 > 1 > 0
                       [0.3, 0.4, 0.2, 0.1],       # 1 > 0 > 2 > 3
                       [0.25, 0.1, 0.6, 0.05]])    # 2 > 0 > 1 > 3
TARGETS = torch.tensor([0, 2, 3, 0])
# top-1 hits: sample 0 only; top-2 hits: samples 0, 1, 3; top-3 hits: samples 0, 1, 3; top-4: all.


def test_accuracy_top1_counts_only_the_highest_score():
    (top1,) = accuracy(SCORES, TARGETS, topk=(1,))
    assert top1.item() == pytest.approx(25.0)


def test_correct_counts_counts_hits_per_k():
    counts = correct_counts(SCORES, TARGETS, topk=(1, 2, 3, 4))
    assert [int(count) for count in counts] == [1, 3, 3, 4]


def test_accuracy_top5_counts_target_anywhere_in_top5():
    # Eight classes; scores descend with the class index, so class k is ranked k+1.
    scores = torch.arange(8, 0, -1, dtype=torch.float32).repeat(4, 1)
    targets = torch.tensor([0, 4, 5, 7])  # ranks 1, 5, 6, 8: the first two are in the top 5
    top1, top5 = accuracy(scores, targets, topk=(1, 5))
    assert top1.item() == pytest.approx(25.0)
    assert top5.item() == pytest.approx(50.0)


def test_correct_counts_caps_k_at_the_number_of_classes():
    scores = torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.3, 0.2]])
    targets = torch.tensor([0, 2])  # both ranked last of three: never top-1, always "top-5"
    hits1, hits5 = correct_counts(scores, targets, topk=(1, 5))
    assert int(hits1) == 0 and int(hits5) == 2
    assert accuracy(scores, targets, topk=(5,))[0].item() == pytest.approx(100.0)


def test_average_meter_weights_values_by_count():
    meter = AverageMeter("Loss", ":.2f")
    meter.update(2.0)
    meter.update(4.0, n=3)
    assert meter.val == 4.0 and meter.sum == 14.0 and meter.count == 4
    assert meter.avg == pytest.approx(3.5)
    assert str(meter) == "Loss 4.00 (3.50)"
    meter.reset()
    assert meter.count == 0 and meter.sum == 0.0


def test_metric_sums_summary_without_process_group_is_the_local_average():
    assert not (dist.is_available() and dist.is_initialized())
    sums = MetricSums(torch.device("cpu"))
    # Batch 1: mean loss 1.0 over 2 samples, both right.   Batch 2: mean loss 4.0 over 2, none right at top-1,
    # one within the top 5 of 6 classes.
    sums.update(torch.tensor(1.0), torch.tensor([[5.0, 0, 0, 0, 0, 0], [0, 5.0, 0, 0, 0, 0]]), torch.tensor([0, 1]))
    sums.update(torch.tensor(4.0), torch.tensor([[6.0, 5, 4, 3, 2, 1], [6.0, 5, 4, 3, 2, 1]]), torch.tensor([1, 5]))
    summary = sums.summary()
    assert summary["count"] == 4
    assert summary["loss"] == pytest.approx((1.0 * 2 + 4.0 * 2) / 4)
    assert summary["acc1"] == pytest.approx(50.0)
    assert summary["acc5"] == pytest.approx(75.0)
    assert sums.summary(reduce=False) == summary


def test_metric_sums_summary_of_nothing_is_zero_not_nan():
    summary = MetricSums(torch.device("cpu")).summary()
    assert summary == {"loss": 0.0, "acc1": 0.0, "acc5": 0.0, "count": 0}


def test_progress_meter_prints_one_line_with_images_per_second_and_eta(monkeypatch):
    # The meter's clock, injected: 2 s pass for the first 2 of 10 batches (8 s to go), however slow the machine.
    now = [1000.0]
    monkeypatch.setattr(meters, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    lines = []
    progress = ProgressMeter(10, "Epoch: [3]", lines.append)
    now[0] += 2.0
    images_per_second = progress.display(1, {"loss": 0.5, "acc1": 75.0, "acc5": 100.0, "count": 100}, lr=0.1)
    assert len(lines) == 1 and "\n" not in lines[0]
    line = lines[0]
    assert line.startswith("Epoch: [3] [ 2/10]")
    assert "loss 0.5000" in line and "acc@1  75.00" in line and "acc@5 100.00" in line and "lr 0.1" in line
    assert re.search(r"\d+\.\d img/s", line)
    assert line.endswith("   50.0 img/s  eta 0:00:08")
    assert images_per_second == 50.0


# ----------------------------------------------------------------------------- schedule

def test_step_schedule_is_full_lr_through_the_last_step_of_epoch_29():
    factor = LrFactor("step", steps_per_epoch=10, epochs=90)
    assert factor(0) == 1.0
    assert factor(30 * 10 - 1) == 1.0


def test_step_schedule_decays_tenfold_at_the_first_step_of_epoch_30():
    factor = LrFactor("step", steps_per_epoch=10, epochs=90)
    assert factor(30 * 10) == pytest.approx(0.1)
    assert factor(60 * 10 - 1) == pytest.approx(0.1)


def test_step_schedule_is_a_hundredth_at_epoch_60():
    factor = LrFactor("step", steps_per_epoch=10, epochs=90)
    assert factor(60 * 10) == pytest.approx(0.01)
    assert factor(90 * 10 - 1) == pytest.approx(0.01)


def test_step_schedule_honours_step_size_and_gamma():
    factor = LrFactor("step", steps_per_epoch=4, epochs=10, step_size=2, gamma=0.5)
    assert [factor(epoch * 4) for epoch in range(6)] == pytest.approx([1, 1, 0.5, 0.5, 0.25, 0.25])


def test_cosine_schedule_starts_at_full_lr_right_after_warmup():
    assert LrFactor("cosine", steps_per_epoch=10, epochs=10)(0) == 1.0
    assert LrFactor("cosine", steps_per_epoch=10, epochs=10, warmup_epochs=2)(20) == 1.0


def test_cosine_schedule_is_half_at_the_midpoint_and_zero_at_the_end():
    factor = LrFactor("cosine", steps_per_epoch=10, epochs=10, warmup_epochs=2)
    # 20 warmup steps, then 80 cosine steps: the midpoint is step 20 + 40.
    assert factor(60) == pytest.approx(0.5)
    assert factor(100) == pytest.approx(0.0, abs=1e-12)
    assert factor(99) > 0.0
    no_warmup = LrFactor("cosine", steps_per_epoch=10, epochs=10)
    assert no_warmup(50) == pytest.approx(0.5)
    assert no_warmup(100) == pytest.approx(0.0, abs=1e-12)


def test_cosine_schedule_decreases_monotonically():
    factor = LrFactor("cosine", steps_per_epoch=7, epochs=5)
    values = [factor(step) for step in range(36)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_warmup_starts_at_one_percent_and_reaches_full_lr_at_its_end():
    for schedule in ("step", "cosine", "constant"):
        factor = LrFactor(schedule, steps_per_epoch=10, epochs=10, warmup_epochs=2)
        assert factor(0) == pytest.approx(0.01)
        assert factor(10) == pytest.approx(0.01 + 0.99 * 0.5)  # linear
        assert 0.01 < factor(19) < 1.0
        assert factor(20) == pytest.approx(1.0)


def test_constant_schedule_keeps_the_lr():
    factor = LrFactor("constant", steps_per_epoch=10, epochs=10)
    assert {factor(step) for step in range(0, 101, 7)} == {1.0}


def schedule_args(schedule, **overrides):
    values = dict(lr=0.1, epochs=10, lr_schedule=schedule, warmup_epochs=1.0, lr_step_size=3, lr_gamma=0.1)
    values.update(overrides)
    return argparse.Namespace(**values)


def stepped_lr(args, steps_per_epoch, steps):
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=args.lr)
    scheduler = build_scheduler(optimizer, args, steps_per_epoch)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    return optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize("schedule", ["step", "cosine", "constant"])
@pytest.mark.parametrize("start_step", [0, 3, 5, 17, 32, 50])
def test_scheduler_built_at_start_step_k_matches_stepping_k_times(schedule, start_step):
    args, steps_per_epoch = schedule_args(schedule), 5
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=args.lr)
    build_scheduler(optimizer, args, steps_per_epoch, start_step=start_step)
    resumed_lr = optimizer.param_groups[0]["lr"]
    assert resumed_lr == pytest.approx(stepped_lr(args, steps_per_epoch, start_step), rel=1e-12, abs=1e-15)
    factor = LrFactor(schedule, steps_per_epoch, args.epochs, args.warmup_epochs, args.lr_step_size, args.lr_gamma)
    assert resumed_lr == pytest.approx(args.lr * factor(start_step), rel=1e-12, abs=1e-15)


def test_scheduler_uses_the_lr_flag_even_when_the_optimizer_was_restored_with_another():
    args = schedule_args("constant", warmup_epochs=0.0, lr=0.05)
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.3)  # e.g. loaded from a checkpoint
    build_scheduler(optimizer, args, steps_per_epoch=5, start_step=10)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_scheduler_state_loads_with_weights_only(tmp_path):
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    scheduler = build_scheduler(optimizer, schedule_args("cosine"), steps_per_epoch=5, start_step=7)
    torch.save(scheduler.state_dict(), tmp_path / "scheduler.pth")
    state = torch.load(tmp_path / "scheduler.pth", weights_only=True)
    assert state["last_epoch"] == 7


# ----------------------------------------------------------------------------- checkpoint

def small_resnet(num_classes=3, seed=0):
    torch.manual_seed(seed)
    return torchvision.models.resnet18(num_classes=num_classes)


def assert_same_weights(state_a, state_b):
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name


def test_save_checkpoint_round_trip_keeps_the_previous_one_and_no_temp_files(tmp_path):
    model = small_resnet()
    state = {"epoch": 3, "arch": "resnet18", "state_dict": model.state_dict(), "best_acc1": 12.5,
             "args": {"lr": 0.1, "data": "/x", "gpus": None}}
    checkpoint.save_checkpoint(state, tmp_path, is_best=True)
    checkpoint.save_checkpoint({**state, "epoch": 4}, tmp_path, is_best=False)  # replaces the latest
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "checkpoint.pth", "checkpoint_prev.pth", "model_best.pth"]
    latest = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    previous = torch.load(tmp_path / "checkpoint_prev.pth", weights_only=True)
    best = torch.load(tmp_path / "model_best.pth", weights_only=True)
    assert latest["epoch"] == 4 and previous["epoch"] == 3 and best["epoch"] == 3
    loaded = checkpoint.load_checkpoint(tmp_path / "checkpoint.pth")
    assert loaded["arch"] == "resnet18" and loaded["best_acc1"] == 12.5 and loaded["args"]["lr"] == 0.1
    assert_same_weights(loaded["state_dict"], model.state_dict())


def test_save_checkpoint_without_best_writes_only_the_latest(tmp_path):
    checkpoint.save_checkpoint({"epoch": 1, "state_dict": {}}, tmp_path, is_best=False)
    assert [path.name for path in tmp_path.iterdir()] == ["checkpoint.pth"]


def test_saved_state_dict_loads_into_plain_torchvision_model_strictly(tmp_path):
    model = build_model("resnet18", 3)
    checkpoint.save_checkpoint({"epoch": 1, "arch": "resnet18",
                                "state_dict": checkpoint.unwrap(nn.DataParallel(model)).state_dict()},
                               tmp_path, is_best=False)
    saved = torch.load(tmp_path / "checkpoint.pth", map_location="cpu", weights_only=True)
    fresh = torchvision.models.resnet18(num_classes=3)
    fresh.load_state_dict(saved["state_dict"])  # strict
    assert_same_weights(fresh.state_dict(), model.state_dict())


CLASSES3 = ["circle", "ring", "square"]


def test_load_weights_trained_on_other_class_names_raises_usage_error(tmp_path):
    torch.save({"arch": "resnet18", "classes": ["cat", "dog", "fox"], "state_dict": small_resnet().state_dict()},
               tmp_path / "pets.pth")
    loaded = checkpoint.load_checkpoint(tmp_path / "pets.pth")
    with pytest.raises(UsageError, match=r"trained on other classes \(cat, dog, fox, ...\)"):
        checkpoint.load_weights(small_resnet(), loaded, "resnet18", CLASSES3, tmp_path / "pets.pth")


def test_pytorch_examples_checkpoint_with_module_prefix_loads(tmp_path):
    model = small_resnet(seed=1)
    wrapped = nn.DataParallel(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    # What pytorch/examples imagenet/main.py writes: DataParallel's prefixed names, best_acc1 a tensor.
    torch.save({"epoch": 5, "arch": "resnet18", "state_dict": wrapped.state_dict(),
                "best_acc1": torch.tensor(42.5), "optimizer": optimizer.state_dict(),
                "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 30).state_dict()},
               tmp_path / "examples.pth.tar")
    assert all(name.startswith("module.") for name in wrapped.state_dict())
    loaded = checkpoint.load_checkpoint(tmp_path / "examples.pth.tar")
    fresh = small_resnet(seed=2)
    checkpoint.load_weights(fresh, loaded, "resnet18", CLASSES3, tmp_path / "examples.pth.tar")
    assert_same_weights(fresh.state_dict(), model.state_dict())
    assert float(loaded["best_acc1"]) == pytest.approx(42.5)


def test_a_bare_state_dict_file_loads_as_a_checkpoint(tmp_path):
    model = small_resnet()
    torch.save(model.state_dict(), tmp_path / "weights.pth")
    loaded = checkpoint.load_checkpoint(tmp_path / "weights.pth")
    assert_same_weights(loaded["state_dict"], model.state_dict())


def test_compile_and_wrapper_prefixes_are_stripped(tmp_path):
    model = small_resnet()
    compiled = torch.compile(model)  # no compilation happens until the first call
    assert all(name.startswith("_orig_mod.") for name in compiled.state_dict())
    torch.save({"arch": "resnet18", "state_dict": nn.DataParallel(compiled).state_dict()}, tmp_path / "c.pth")
    loaded = checkpoint.load_checkpoint(tmp_path / "c.pth")
    assert_same_weights(loaded["state_dict"], model.state_dict())
    assert checkpoint.strip_prefixes({"module._orig_mod.fc.weight": 1, "_orig_mod.module.fc.bias": 2,
                                      "layer1.0.conv1.weight": 3}) == {
        "fc.weight": 1, "fc.bias": 2, "layer1.0.conv1.weight": 3}


def test_unwrap_removes_dataparallel_and_compile():
    model = small_resnet()
    assert checkpoint.unwrap(model) is model
    assert checkpoint.unwrap(nn.DataParallel(model)) is model
    assert checkpoint.unwrap(torch.compile(model)) is model
    assert checkpoint.unwrap(nn.DataParallel(torch.compile(model))) is model


def test_load_weights_of_another_arch_raises_usage_error_naming_it(tmp_path):
    torch.manual_seed(0)
    other = torchvision.models.squeezenet1_1(num_classes=3)
    torch.save({"arch": "squeezenet1_1", "state_dict": other.state_dict()}, tmp_path / "sq.pth")
    loaded = checkpoint.load_checkpoint(tmp_path / "sq.pth")
    with pytest.raises(UsageError, match=r"squeezenet1_1 model, not resnet18: pass --arch squeezenet1_1"):
        checkpoint.load_weights(small_resnet(), loaded, "resnet18", CLASSES3, tmp_path / "sq.pth")


def test_load_weights_of_another_arch_without_arch_key_raises_usage_error(tmp_path):
    torch.save(torchvision.models.squeezenet1_1(num_classes=3).state_dict(), tmp_path / "sq.pth")
    loaded = checkpoint.load_checkpoint(tmp_path / "sq.pth")
    with pytest.raises(UsageError, match="does not fit resnet18"):
        checkpoint.load_weights(small_resnet(), loaded, "resnet18", CLASSES3, tmp_path / "sq.pth")


def test_load_weights_with_another_class_count_raises_usage_error(tmp_path):
    torch.save({"arch": "resnet18", "state_dict": small_resnet(num_classes=5).state_dict()}, tmp_path / "r5.pth")
    loaded = checkpoint.load_checkpoint(tmp_path / "r5.pth")
    with pytest.raises(UsageError) as error:
        checkpoint.load_weights(small_resnet(num_classes=3), loaded, "resnet18", CLASSES3, tmp_path / "r5.pth")
    message = str(error.value)
    assert "does not fit resnet18 with these classes" in message and "fc.weight" in message
    assert "\n" not in message


class CreatesMarkerWhenUnpickled:
    """Unpickling this calls open(marker, 'w'): a stand-in for arbitrary code in a pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_holding_arbitrary_objects_is_refused_without_running_them(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pth"
    torch.save({"epoch": 1, "state_dict": small_resnet().state_dict(),
                "payload": CreatesMarkerWhenUnpickled(marker)}, path)
    with pytest.raises(UsageError, match="refusing to load"):
        checkpoint.load_checkpoint(path)
    assert not marker.exists()
    # Control: the same file does run code when loaded without weights_only, so the check above means something.
    torch.load(path, weights_only=False)
    assert marker.exists()


class CustomStateDict(collections.OrderedDict):
    pass


def test_checkpoint_holding_an_ordered_dict_subclass_is_refused(tmp_path):
    torch.save({"state_dict": CustomStateDict(small_resnet().state_dict())}, tmp_path / "sub.pth")
    with pytest.raises(UsageError, match="refusing to load"):
        checkpoint.load_checkpoint(tmp_path / "sub.pth")


def test_truncated_checkpoint_raises_usage_error(tmp_path):
    checkpoint.save_checkpoint({"epoch": 1, "state_dict": small_resnet().state_dict()}, tmp_path, is_best=False)
    data = (tmp_path / "checkpoint.pth").read_bytes()
    (tmp_path / "truncated.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError, match="truncated or not a PyTorch checkpoint"):
        checkpoint.load_checkpoint(tmp_path / "truncated.pth")


def test_a_text_file_given_as_checkpoint_raises_usage_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello\n")
    with pytest.raises(UsageError, match=rf"^cannot read checkpoint {re.escape(str(tmp_path / 'notes.txt'))}: "
                                         r"truncated or not a PyTorch checkpoint \(\w+\)$"):
        checkpoint.load_checkpoint(tmp_path / "notes.txt")


def test_a_file_of_random_bytes_raises_usage_error(tmp_path):
    (tmp_path / "random.bin").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(UsageError):
        checkpoint.load_checkpoint(tmp_path / "random.bin")


def test_a_pytorch_file_without_weights_is_not_a_checkpoint(tmp_path):
    torch.save({"epoch": 1}, tmp_path / "no-weights.pth")
    with pytest.raises(UsageError, match="not a checkpoint"):
        checkpoint.load_checkpoint(tmp_path / "no-weights.pth")


def test_resolve_resume_auto_is_none_in_an_empty_dir_and_the_checkpoint_when_present(tmp_path):
    assert checkpoint.resolve_resume("auto", tmp_path) is None
    assert checkpoint.resolve_resume("auto", tmp_path / "not-created-yet") is None
    assert checkpoint.resolve_resume("", tmp_path) is None
    (tmp_path / "checkpoint.pth").write_bytes(b"x")
    assert checkpoint.resolve_resume("auto", tmp_path) == tmp_path / "checkpoint.pth"


def test_resolve_resume_of_a_missing_file_raises_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        checkpoint.resolve_resume(str(tmp_path / "missing.pth"), tmp_path)
    with pytest.raises(UsageError, match="no such file"):
        checkpoint.resolve_resume(str(tmp_path), tmp_path)  # a directory is not a checkpoint


# ----------------------------------------------------------------------------- data

@pytest.fixture
def folder(tiny_data, tmp_path):
    """A private, editable copy of the tiny ImageFolder."""
    return shutil.copytree(tiny_data, tmp_path / "data")


def test_scan_image_folder_returns_the_sorted_classes(tiny_data):
    assert scan_image_folder(tiny_data).classes == ["circle", "ring", "square"]


def test_scan_image_folder_lists_the_samples_of_torchvisions_image_folder_in_its_order(folder):
    train = folder / "train"
    (train / "ring" / "nested" / "deeper").mkdir(parents=True)
    siblings = [f"square/sub-{name}" for name in "qcxhatme"]  # created out of order: listing order is no help
    for sibling in siblings:
        (train / sibling).mkdir()
    for path in ("ring/nested/b.jpg", "ring/nested/deeper/a.JPEG", "ring/nested-x.png", "square/UPPER.JPG",
                 "square/notes.txt", "circle/-first.jpg", *[f"{sibling}/1.jpg" for sibling in siblings]):
        shutil.copy(next((train / "circle").glob("0*.jpg")), train / path)
    (train / "square" / "a-dir.jpg").mkdir()  # a folder with an image's name is no image
    (train / "square" / "a-dir.jpg" / "z.jpg").write_bytes((train / "square" / "UPPER.JPG").read_bytes())
    (train / "circle" / "linked").symlink_to(train / "ring" / "nested", target_is_directory=True)
    scan = scan_image_folder(folder)
    for split, index in (("train", scan.train), ("val", scan.val)):
        expected = torchvision.datasets.ImageFolder(folder / split)
        assert scan.classes == expected.classes
        assert [index[i] for i in range(len(index))] == expected.samples


def test_scan_image_folder_of_a_missing_dir_says_so(tmp_path):
    with pytest.raises(UsageError, match="no such directory"):
        scan_image_folder(tmp_path / "missing")


def test_scan_image_folder_without_val_says_so(folder):
    shutil.rmtree(folder / "val")
    with pytest.raises(UsageError, match=r"has no val/ folder"):
        scan_image_folder(folder)


def test_scan_image_folder_with_an_empty_class_folder_names_it(folder):
    (folder / "train" / "zebra").mkdir()
    with pytest.raises(UsageError, match=r"zebra in .*train hold no images"):
        scan_image_folder(folder)


def test_scan_image_folder_with_no_class_folders_says_so(folder):
    shutil.rmtree(folder / "val")
    (folder / "val").mkdir()
    with pytest.raises(UsageError, match="has no class folders"):
        scan_image_folder(folder)


def test_scan_image_folder_with_different_classes_names_them(folder):
    (folder / "val" / "ring").rename(folder / "val" / "donut")
    with pytest.raises(UsageError, match=r"different classes \(only in train: ring; only in val: donut\)"):
        scan_image_folder(folder)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shard_sampler_covers_every_index_exactly_once(world_size):
    shards = [list(ShardSampler(13, rank, world_size)) for rank in range(world_size)]
    assert sorted(index for shard in shards for index in shard) == list(range(13))
    assert [len(ShardSampler(13, rank, world_size)) for rank in range(world_size)] == [len(s) for s in shards]


def seeded_dataset(seed=0):
    # Every pixel different, so that any two different crops or flips give different images.
    pattern = (torch.arange(3 * 40 * 40) * 7919 % 251).to(torch.uint8).view(3, 40, 40)
    images = [(pattern.roll(i, dims=2), i, []) for i in range(4)]
    return SeededTransform(images, TrainPreset(16, min_scale=0.1), seed)


def test_load_image_decodes_jpeg_and_png_with_torchvision_and_other_formats_with_pil(tmp_path, monkeypatch):
    picture = Image.new("RGB", (30, 20), (200, 40, 10))
    picture.paste((10, 220, 30), (5, 5, 20, 15))
    # Which decoder ran: both, unchanged, count their calls (their pixels may agree to the bit).
    calls = []
    torchvision_decode, pil_open = data_module.decode_image, Image.open
    assert torchvision_decode is not None, "torchvision.io.decode_image is gone: load_image uses PIL alone"
    monkeypatch.setattr(data_module, "decode_image", lambda *a, **k: calls.append("torchvision") or torchvision_decode(*a, **k))
    monkeypatch.setattr(Image, "open", lambda *a, **k: calls.append("PIL") or pil_open(*a, **k))
    for name, decoder in (("a.jpg", "torchvision"), ("a.png", "torchvision"), ("a.bmp", "PIL")):
        picture.save(tmp_path / name)
        calls.clear()
        image = load_image(str(tmp_path / name))
        assert calls == [decoder], name
        assert image.dtype == torch.uint8 and image.shape == (3, 20, 30), name
        reference = torchvision.transforms.v2.functional.pil_to_tensor(pil_open(tmp_path / name).convert("RGB"))
        assert (image.int() - reference.int()).abs().max() <= 2, name  # two JPEG decoders may round apart
    Image.new("L", (8, 6), 90).save(tmp_path / "grey.png")
    assert load_image(str(tmp_path / "grey.png")).shape == (3, 6, 8)  # always RGB


def test_load_image_of_a_broken_file_names_it(tmp_path):
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(Exception, match=rf"cannot identify image file .*{re.escape(str(tmp_path / 'broken.jpg'))}"):
        load_image(str(tmp_path / "broken.jpg"))


def test_train_preset_crops_inside_the_image_and_returns_the_crop_size():
    import random
    preset = TrainPreset(24, min_scale=0.08)
    rng = random.Random(0)
    for height, width in [(375, 500), (500, 375), (40, 40), (30, 300)]:
        for _ in range(200):
            top, left, h, w = preset.crop_box(height, width, rng)
            assert 0 <= top and 0 <= left and top + h <= height and left + w <= width and h > 0 and w > 0
    out = preset(torch.zeros(3, 60, 80, dtype=torch.uint8), rng)
    assert out.shape == (3, 24, 24) and out.dtype == torch.uint8
    assert EvalPreset(36, 32)(torch.zeros(3, 40, 60, dtype=torch.uint8)).shape == (3, 32, 32)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_device_loader_and_the_loader_workers_normalise_alike_uint8_and_float_images(channels_last, dtype):
    """On a GPU DeviceLoader normalises (the batch travels as decoded), on the CPU the workers' Collate does: one
    arithmetic for both, uint8 images on the 0-255 scale, float ones on 0-1 (the same pixels give the same
    inputs). Once float images were left unnormalised on a GPU, silently."""
    pixels = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8)
    images = pixels if dtype == torch.uint8 else pixels.float() / 255
    normalise = data_module.Normalise()
    loader = DeviceLoader([(images, torch.tensor([1, 2]), [])], torch.device("cpu"), channels_last, normalise=normalise)
    (batch, target), = list(loader)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    assert torch.allclose(batch, (pixels.float() / 255 - mean) / std, atol=1e-5)
    assert batch.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert target.tolist() == [1, 2] and len(loader) == 1
    collated, _, _ = data_module.Collate(normalise)([(image, label, ()) for image, label in zip(images, [1, 2])])
    assert torch.allclose(collated, batch, atol=1e-6)


def test_seeded_transform_is_a_function_of_seed_epoch_and_index():
    first, again = seeded_dataset(), seeded_dataset()
    torch.manual_seed(123)  # the global RNG state must not matter...
    image, label, _ = first[2]
    torch.manual_seed(456)
    assert torch.equal(image, again[2][0]) and label == 2
    first.set_epoch(1)
    assert not torch.equal(image, first[2][0])
    assert not torch.equal(image, seeded_dataset(seed=1)[2][0])


def test_seeded_transform_leaves_the_global_rng_alone():
    dataset = seeded_dataset()
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    dataset[0]
    assert torch.equal(torch.rand(3), expected)


def first_batch(args, rank, world_size, batch):
    data = build_data(args, seed=5, rank=rank, world_size=world_size, per_process_batch=batch, gpu=False)
    data.train_sampler.set_epoch(0)
    images, labels, _ = next(iter(data.train_loader))
    return {(int(label), image.numpy().tobytes()) for image, label in zip(images, labels)}, data


def test_ranks_first_batches_together_are_the_single_process_first_batch(folder, no_platform_env):
    # 13 validation images: 2 ranks cannot split them evenly, so padding (DistributedSampler's) would show.
    extra = next((folder / "val" / "circle").glob("0*.jpg"))
    shutil.copy(extra, extra.with_name("extra.jpg"))
    args = parse("--data", str(folder), "-j", "0", "--train-crop-size", "24", "--val-resize-size", "32",
                 "--val-crop-size", "32")
    single, _ = first_batch(args, rank=0, world_size=1, batch=8)
    rank0, data0 = first_batch(args, rank=0, world_size=2, batch=4)
    rank1, data1 = first_batch(args, rank=1, world_size=2, batch=4)
    assert len(single) == 8 and len(rank0) == len(rank1) == 4
    assert rank0.isdisjoint(rank1)
    assert rank0 | rank1 == single
    # Validation: each of the 13 images on exactly one rank, none twice.
    shards = [list(data.val_loader.sampler) for data in (data0, data1)]
    assert sorted(shards[0] + shards[1]) == list(range(13)) and len(data0.val_loader.dataset) == 13
    assert [len(data.val_loader.sampler) for data in (data0, data1)] == [len(shard) for shard in shards] == [7, 6]
    assert data0.classes == ["circle", "ring", "square"]


def test_global_batch_must_divide_over_the_processes():
    assert per_process_batch(8, 2) == 4
    with pytest.raises(UsageError, match="multiple of 3"):
        per_process_batch(8, 3)


# ----------------------------------------------------------------------------- args

def test_environment_variables_set_the_defaults(no_platform_env, tmp_path):
    no_platform_env.setenv("EPOCHS", "7")
    no_platform_env.setenv("LR", "0.5")
    no_platform_env.setenv("BATCH_SIZE", "16")
    no_platform_env.setenv("DATASETS_PATH", str(tmp_path))
    no_platform_env.setenv("DATASETS", "tiny,other")
    no_platform_env.setenv("WORKSPACE", str(tmp_path / "ws"))
    args = parse()
    assert (args.epochs, args.lr, args.batch_size) == (7, 0.5, 16)
    assert args.data == str(tmp_path / "tiny") and args.dataset == "imagenet"
    assert cli.default_output_dir(args, "dp") == str(tmp_path / "ws" / "dp-resnet18-tiny")


def test_datasets_path_alone_is_the_data_dir(no_platform_env, tmp_path):
    no_platform_env.setenv("DATASETS_PATH", str(tmp_path))
    assert parse().data == str(tmp_path)


def test_command_line_flags_win_over_environment_variables(no_platform_env, tmp_path):
    for name, value in dict(EPOCHS="7", LR="0.5", BATCH_SIZE="16", DATASETS_PATH=str(tmp_path),
                            DATASETS="tiny", WORKSPACE=str(tmp_path / "ws")).items():
        no_platform_env.setenv(name, value)
    args = parse("--epochs", "3", "--lr", "0.2", "-b", "4", "--data", str(tmp_path / "mine"),
                 "--output-dir", str(tmp_path / "out"))
    assert (args.epochs, args.lr, args.batch_size) == (3, 0.2, 4)
    assert args.data == str(tmp_path / "mine")
    assert args.output_dir == str(tmp_path / "out")


def test_without_environment_the_output_dir_is_under_runs(no_platform_env):
    args = parse("--data", "/datasets/imagenet")
    assert cli.default_output_dir(args, "ddp") == "runs/ddp-resnet18-imagenet"


def test_positional_data_dir_is_the_same_as_the_flag(no_platform_env):
    assert parse("/some/imagenet").data == "/some/imagenet"
    with pytest.raises(UsageError, match="once"):
        parse("/a", "--data", "/b")


def test_an_invalid_environment_value_raises_usage_error(no_platform_env):
    no_platform_env.setenv("EPOCHS", "ten")
    with pytest.raises(UsageError, match="EPOCHS='ten'"):
        parse("--data", "/x")


@pytest.mark.parametrize("argv", [["--epochs", "0"], ["--epochs", "-3"], ["-b", "0"], ["--batch-size", "-8"],
                                  ["--lr", "0"], ["--lr", "-1"]])
def test_non_positive_epochs_batch_or_lr_raise_usage_error(no_platform_env, argv):
    flag = {"-b": "--batch-size"}.get(argv[0], argv[0])
    with pytest.raises(UsageError, match=f"{flag} must be positive"):
        parse("--data", "/x", *argv)


def test_non_positive_environment_value_raises_usage_error(no_platform_env):
    no_platform_env.setenv("BATCH_SIZE", "0")
    with pytest.raises(UsageError, match="--batch-size must be positive"):
        parse("--data", "/x")


def test_unknown_arch_suggests_close_names(no_platform_env):
    with pytest.raises(UsageError, match=r"unknown --arch 'resnet19': did you mean resnet18"):
        parse("--data", "/x", "--arch", "resnet19")


def test_demo_preset_applies_when_no_data_is_given(no_platform_env):
    args = parse()
    assert args.data is None and args.dataset == "demo"
    demo = cli.PRESETS["demo"]
    assert (args.epochs, args.batch_size, args.lr, args.lr_schedule, args.train_crop_size, args.warmup_epochs) == (
        demo["epochs"], demo["batch_size"], demo["lr"], demo["lr_schedule"], demo["train_crop_size"],
        demo["warmup_epochs"])
    imagenet = parse("--data", "/x")
    assert (imagenet.dataset, imagenet.epochs, imagenet.batch_size, imagenet.lr, imagenet.lr_schedule) == (
        "imagenet", 90, 256, 0.1, "step")
    assert parse("--dummy").dataset == "dummy"


def test_demo_preset_accepts_a_single_epoch(no_platform_env):
    assert parse("--epochs", "1").epochs == 1


def test_warmup_given_by_the_user_must_be_shorter_than_the_run(no_platform_env):
    with pytest.raises(UsageError, match="--warmup-epochs"):
        parse("--data", "/x", "--epochs", "2", "--warmup-epochs", "2")


# ----------------------------------------------------------------------------- models

@pytest.mark.parametrize("arch", ["resnet18", "squeezenet1_1"])
def test_build_model_gives_one_output_per_class(arch):
    model = build_model(arch, num_classes=3).eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 3)


def test_build_model_sets_dropout_where_the_arch_has_one():
    model = build_model("squeezenet1_1", num_classes=3, dropout=0.0)
    assert [module.p for module in model.modules() if isinstance(module, nn.Dropout)] == [0.0]


def test_dropout_on_an_arch_without_one_raises_usage_error():
    with pytest.raises(UsageError, match="resnet18 has no dropout"):
        build_model("resnet18", num_classes=3, dropout=0.5)


def test_arch_may_name_your_own_model_as_module_and_callable():
    model = build_model("tests.tiny_models:TinyNet", num_classes=4, dropout=0.25)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 4)
    with pytest.raises(UsageError, match="cannot import Missing from tests.tiny_models"):
        build_model("tests.tiny_models:Missing", num_classes=4)
    with pytest.raises(UsageError, match="--pretrained needs a torchvision --arch"):
        build_model("tests.tiny_models:TinyNet", num_classes=4, pretrained=True)


def test_a_console_line_is_written_whole_in_one_write():
    """print() writes a line's text and its newline separately: another process's output between the two
    (a rank's warning, a library's report) would glue itself onto our line."""
    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)

        def flush(self):
            writes.append("<flush>")

    say("done: best acc@1 99.00", file=Stream())
    say("error: rank 1: two\nlines", file=Stream())
    assert writes == ["done: best acc@1 99.00\n", "<flush>", "error: rank 1: two\nlines\n", "<flush>"]


def common_imports():
    """module -> the modules of common/ it imports, at its top or inside a function."""
    import ast
    graph = {}
    for path in sorted((Path(cli.__file__).parent).glob("*.py")):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module} if node.module else {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
                imported.add(node.module.split(".")[1])
        graph[path.stem] = {name.split(".")[0] for name in imported}
    return graph


def test_common_has_no_import_circle():
    """A module of common/ never imports, directly or through others, one that imports it (args.py and
    models.py once did, through a function-level import): each can be read, and copied, on its own."""
    graph = common_imports()
    assert "models" in graph["args"]  # the walk finds function-level imports too

    def reaches(start, goal, seen=()):
        return any(name == goal or (name not in seen and reaches(name, goal, (*seen, name)))
                   for name in graph.get(start, ()))
    circles = sorted(name for name in graph if reaches(name, name))
    assert not circles, {name: sorted(graph[name]) for name in circles}

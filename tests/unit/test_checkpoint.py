"""common/checkpoint.py: checkpoint files written atomically (the previous one kept), read with weights_only=True,
weights from elsewhere (pytorch/examples', DataParallel's, a bare state_dict), and every bad file refused in one
line without running anything in it."""
import collections
import re

import pytest
import torch
import torch.nn as nn
import torchvision

from common import checkpoint
from common.errors import UsageError
from common.models import build_model, unwrap


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
                                "state_dict": unwrap(nn.DataParallel(model)).state_dict()},
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
    with pytest.raises(UsageError, match=r"trained on other classes than the data's: its class 0 is cat, the data's circle$"):
        checkpoint.load_weights(small_resnet(), loaded, "resnet18", CLASSES3, tmp_path / "pets.pth")
    # the classes that differ, not the first ones of each (the same here)
    loaded["classes"] = ["circle", "ring", "star"]
    with pytest.raises(UsageError, match=r"its class 2 is star, the data's square$"):
        checkpoint.load_weights(small_resnet(), loaded, "resnet18", CLASSES3, tmp_path / "pets.pth")
    loaded["classes"] = ["circle", "ring"]
    with pytest.raises(UsageError, match=r"pets.pth was trained on 2 classes, the data has 3$"):
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


def flip_bytes_in_record(path, suffix, count=16):
    """XOR `count` bytes in the middle of the data of the zip record of `path` whose name ends with `suffix` (a tensor's
    storage): the file still loads with torch.load, one tensor's values changed."""
    import zipfile
    with zipfile.ZipFile(path) as archive:
        info = next(info for info in archive.infolist() if info.filename.endswith(suffix))
    data = bytearray(path.read_bytes())
    header = info.header_offset
    start = header + 30 + int.from_bytes(data[header + 26:header + 28], "little") \
        + int.from_bytes(data[header + 28:header + 30], "little") + info.file_size // 2
    data[start:start + count] = bytes(byte ^ 0xFF for byte in data[start:start + count])
    path.write_bytes(bytes(data))


def test_a_bit_flipped_checkpoint_is_corrupt_and_resume_auto_falls_back_to_the_one_before(tmp_path):
    """16 bytes XORed inside a tensor's storage: torch.load reads it without a word (values changed), so the records'
    CRC-32s are checked first. --resume auto then warns and takes checkpoint_prev.pth, as for a truncated file."""
    state = {"epoch": 1, "state_dict": small_resnet().state_dict()}
    checkpoint.save_checkpoint(state, tmp_path, is_best=False)
    checkpoint.save_checkpoint({**state, "epoch": 2}, tmp_path, is_best=False)
    latest = tmp_path / "checkpoint.pth"
    flip_bytes_in_record(latest, "/data/0")  # conv1.weight's storage
    loaded = torch.load(latest, weights_only=True)  # what resumed before: no error, other weights
    assert not torch.equal(loaded["state_dict"]["conv1.weight"], state["state_dict"]["conv1.weight"])
    with pytest.raises(UsageError, match=rf"^cannot read checkpoint {re.escape(str(latest))}: corrupt \(its record "
                                         r"\S+/data/0 fails its CRC-32 check\)$"):
        checkpoint.load_checkpoint(latest)
    warned = []
    path, resumed = checkpoint.load_resume("auto", tmp_path, warned.append)
    assert path == tmp_path / "checkpoint_prev.pth" and resumed["epoch"] == 1
    assert warned == [f"warning: cannot read checkpoint {latest}: corrupt (its record "
                      f"{warned[0].split('record ')[1].split(' ')[0]} fails its CRC-32 check); resuming from the "
                      f"previous checkpoint {tmp_path / 'checkpoint_prev.pth'}"]
    assert checkpoint.load_checkpoint(latest, mmap=True)["epoch"] == 2  # a look at its metadata alone: unchecked
    # torch.save told to write no CRC-32s (for speed) writes 0 for each: nothing to check, and the file loads.
    from torch.utils.serialization import config
    config.save.compute_crc32 = False
    try:
        torch.save(state, tmp_path / "no-crcs.pth")
    finally:
        config.save.compute_crc32 = True
    assert checkpoint.load_checkpoint(tmp_path / "no-crcs.pth")["epoch"] == 1


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


def test_resume_auto_is_none_in_an_empty_dir_and_the_checkpoint_when_present(tmp_path):
    assert checkpoint.load_resume("auto", tmp_path, warn=print) == (None, None)
    assert checkpoint.load_resume("auto", tmp_path / "not-created-yet", warn=print) == (None, None)
    assert checkpoint.resolve_resume("", tmp_path) is None
    torch.save({"state_dict": {}, "arch": "resnet18"}, tmp_path / "checkpoint.pth")
    assert checkpoint.load_resume("auto", tmp_path, warn=print)[0] == tmp_path / "checkpoint.pth"


def test_resolve_resume_of_a_missing_file_raises_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        checkpoint.resolve_resume(str(tmp_path / "missing.pth"), tmp_path)
    with pytest.raises(UsageError, match=r"^--resume \S+: a directory; give a checkpoint file"):
        checkpoint.resolve_resume(str(tmp_path), tmp_path)  # a directory is not a checkpoint
    (tmp_path / "state.pth").write_bytes(b"x")  # train_fsdp.py's: said so (it said "no such file")
    with pytest.raises(UsageError, match=r"^--resume \S+: a sharded checkpoint of train_fsdp.py; resume it with "
                                         r"train_fsdp.py, or write its weights as one file \(python tools/export_checkpoint"):
        checkpoint.resolve_resume(str(tmp_path), tmp_path)


def test_after_a_fallback_the_next_save_keeps_the_checkpoint_resumed_from(tmp_path):
    """checkpoint.pth damaged, --resume auto took checkpoint_prev.pth: the next save replaces the damaged one and keeps
    checkpoint_prev.pth (it moved the damaged one there, over the good one); the save after rotates as before."""
    files = checkpoint.SingleFile()
    for epoch in (1, 2):
        files.write({"epoch": epoch, "state_dict": small_resnet().state_dict()}, tmp_path, False, writes=True)
    good = (tmp_path / "checkpoint_prev.pth").read_bytes()
    (tmp_path / "checkpoint.pth").write_bytes(b"cut short")
    path, _ = files.load_resume("auto", tmp_path, warn=lambda line: None)
    assert path.name == "checkpoint_prev.pth"
    files.write({"epoch": 2, "state_dict": small_resnet().state_dict()}, tmp_path, False, writes=True)
    assert (tmp_path / "checkpoint_prev.pth").read_bytes() == good
    assert checkpoint.load_checkpoint(tmp_path / "checkpoint.pth")["epoch"] == 2
    files.write({"epoch": 3, "state_dict": small_resnet().state_dict()}, tmp_path, False, writes=True)
    assert checkpoint.load_checkpoint(tmp_path / "checkpoint_prev.pth")["epoch"] == 2


def test_init_from_loads_another_run_s_weights_as_pretrained_ones_heads_and_channels_adapted(tmp_path):
    """--init-from: torchvision's references' checkpoint ("model", DDP's module. prefix, "args") of resnet18 on 5 classes,
    into a run on 3 classes of 1-channel images: every weight loaded but the head (new, 5 -> 3 classes), conv1's RGB
    filters summed as --pretrained's are; the header names the file and the changes."""
    from common.header import start_lines
    from conftest import built_trainer, tensor_datasets
    torch.manual_seed(0)
    source = torchvision.models.resnet18(num_classes=5)
    path = tmp_path / "theirs.pth"
    import argparse  # (the references save their flags as a Namespace; older weights lack num_batches_tracked)
    torch.save({"model": {f"module.{key}": value for key, value in source.state_dict().items()
                          if not key.endswith("num_batches_tracked")}, "epoch": 7, "args": argparse.Namespace(lr=0.5)},
               path)
    trainer = built_trainer("-a", "resnet18", "--init-from", str(path), "--train-crop-size", "16", "--val-resize-size",
                            "16", "--val-crop-size", "16", "-j", "0", "-b", "4", "--mean", "0.5", "--std", "0.25",
                            datasets=tensor_datasets(channels=1))
    model = trainer.model
    assert torch.equal(model.layer1[0].conv1.weight, source.layer1[0].conv1.weight)
    assert torch.equal(model.bn1.running_mean, source.bn1.running_mean)
    assert torch.allclose(model.conv1.weight, source.conv1.weight.sum(dim=1, keepdim=True))
    assert model.fc.weight.shape == (3, 512)
    assert trainer._model_changes == ["fc: 5 -> 3 classes, new weights", "conv1: 3 -> 1 channels, RGB filters summed"]
    assert any(line.startswith(f"model: resnet18 from --init-from {path}, ") for line in start_lines(trainer))


def test_init_from_takes_a_file_of_the_data_s_channels_as_it_is_and_refuses_another_arch_in_one_line(tmp_path):
    from conftest import built_trainer, tensor_datasets
    flags = ["--train-crop-size", "16", "--val-resize-size", "16", "--val-crop-size", "16", "-j", "0", "-b", "4", "--mean",
             "0.5", "--std", "0.25"]
    own = built_trainer("-a", "resnet18", *flags, datasets=tensor_datasets(channels=1))  # 1 channel, 3 classes
    path = tmp_path / "ours.pth"
    torch.save({"state_dict": own.model.state_dict()}, path)
    again = built_trainer("-a", "resnet18", "--init-from", str(path), *flags, datasets=tensor_datasets(channels=1))
    assert again._model_changes == ["conv1: 3 -> 1 channels, as in ours.pth"]
    assert all(torch.equal(value, own.model.state_dict()[key]) for key, value in again.model.state_dict().items())
    with pytest.raises(UsageError, match=rf"^--init-from {re.escape(str(path))} does not fit --arch resnet34: weights "
                                         r"missing layer1\.2\.conv1\.weight, layer1\.2\.bn1\.weight, .* and \d+ more$"):
        built_trainer("-a", "resnet34", "--init-from", str(path), *flags, datasets=tensor_datasets(channels=1))
    with pytest.raises(UsageError, match=r"^--init-from \S+missing\.pth: no such file$"):
        built_trainer("-a", "resnet18", "--init-from", str(tmp_path / "missing.pth"), *flags,
                      datasets=tensor_datasets(channels=1))
    with pytest.raises(UsageError, match=r"^--init-from and --pretrained both give the starting weights: choose one$"):
        built_trainer("-a", "resnet18", "--init-from", str(path), "--pretrained", *flags,
                      datasets=tensor_datasets(channels=1))


def test_the_offline_pretrained_line_names_the_file_and_the_folder_it_goes_in(monkeypatch, tmp_path):
    from common.models import offline_message
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    line = offline_message(torchvision.models.ResNet18_Weights.IMAGENET1K_V1, OSError("no network"))
    assert line == (f"cannot get pretrained weights ResNet18_Weights.IMAGENET1K_V1 (no network): put "
                    f"resnet18-f37072fd.pth (from https://download.pytorch.org/models/resnet18-f37072fd.pth) into "
                    f"{tmp_path}/home/hub/checkpoints, or train without --pretrained")

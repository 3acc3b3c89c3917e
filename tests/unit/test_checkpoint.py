"""common/checkpoint.py: checkpoint files written atomically (the previous one kept), read with weights_only=True,
weights from elsewhere (pytorch/examples', DataParallel's, a bare state_dict), and every bad file refused in one
line without running anything in it; the checkpoint format, assembled in one place from each part's state, with a
version; restored into a built trainer, a run stopped mid-epoch goes on bitwise as one that never stopped; what cannot
go on as the checkpoint's run is refused in one line; a checkpoint of an earlier format names the commit to finish it
with."""

import collections
import csv
import re
import resource
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torchvision

from common import checkpoint
from common.errors import CheckpointWriteError, UsageError
from common.logger import MEASURED
from common.models import build_model, unwrap
from common.run import start_run
from common.trainer import Trainer
from conftest import built_trainer, cpu_runtime, parse
from examples.learned_temperature import LearnedTemperature
from harness.processes import REPO
from tests.tiny_models import TinyNet

sys.path.insert(0, str(REPO / "tools"))


def small_resnet(num_classes=3, seed=0):
    torch.manual_seed(seed)
    return torchvision.models.resnet18(num_classes=num_classes)


def assert_same_weights(state_a, state_b):
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name


def test_save_checkpoint_round_trip_keeps_the_previous_one_and_no_temp_files(tmp_path):
    model = small_resnet()
    state = {
        "epoch": 3,
        "arch": "resnet18",
        "state_dict": model.state_dict(),
        "best_acc1": 12.5,
        "args": {"lr": 0.1, "data": "/x", "gpus": None},
    }
    checkpoint.save_checkpoint(state, tmp_path, is_best=True)
    checkpoint.save_checkpoint({**state, "epoch": 4}, tmp_path, is_best=False)  # replaces the latest
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "checkpoint.pth",
        "checkpoint_prev.pth",
        "model_best.pth",
    ]
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


def test_a_checkpoint_that_the_disk_cannot_hold_says_why_and_leaves_the_one_before(tmp_path):
    """torch.save's own error ("unexpected pos 29568 vs 29520") hid the write's reason: now it is said. A real failed
    write: a file size limit (EFBIG, as a quota)."""
    checkpoint.save_checkpoint({"epoch": 1, "state_dict": {}}, tmp_path, is_best=False)
    before = (tmp_path / "checkpoint.pth").read_bytes()
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(before) + 4096, limits[1]))
    try:
        with pytest.raises(CheckpointWriteError, match=r"^could not write a checkpoint to \S+ \(File too large\); the"):
            checkpoint.save_checkpoint({"epoch": 2, "state_dict": {"w": torch.zeros(100_000)}}, tmp_path, is_best=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert (tmp_path / "checkpoint.pth").read_bytes() == before and len(list(tmp_path.iterdir())) == 1


def test_saved_state_dict_loads_into_plain_torchvision_model_strictly(tmp_path):
    model = build_model("resnet18", 3)
    checkpoint.save_checkpoint(
        {"epoch": 1, "arch": "resnet18", "state_dict": unwrap(nn.DataParallel(model)).state_dict()},
        tmp_path,
        is_best=False,
    )
    saved = torch.load(tmp_path / "checkpoint.pth", map_location="cpu", weights_only=True)
    fresh = torchvision.models.resnet18(num_classes=3)
    fresh.load_state_dict(saved["state_dict"])  # strict
    assert_same_weights(fresh.state_dict(), model.state_dict())


CLASSES3 = ["circle", "ring", "square"]


def test_load_weights_trained_on_other_class_names_raises_usage_error(tmp_path):
    torch.save(
        {"arch": "resnet18", "classes": ["cat", "dog", "fox"], "state_dict": small_resnet().state_dict()},
        tmp_path / "pets.pth",
    )
    loaded = checkpoint.load_checkpoint(tmp_path / "pets.pth")
    with pytest.raises(
        UsageError, match=r"trained on other classes than the data's: its class 0 is cat, the data's circle$"
    ):
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
    torch.save(
        {
            "epoch": 5,
            "arch": "resnet18",
            "state_dict": wrapped.state_dict(),
            "best_acc1": torch.tensor(42.5),
            "optimizer": optimizer.state_dict(),
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 30).state_dict(),
        },
        tmp_path / "examples.pth.tar",
    )
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
    assert checkpoint.strip_prefixes(
        {"module._orig_mod.fc.weight": 1, "_orig_mod.module.fc.bias": 2, "layer1.0.conv1.weight": 3}
    ) == {"fc.weight": 1, "fc.bias": 2, "layer1.0.conv1.weight": 3}


def test_pytorch_examples_alexnet_and_vgg_whose_features_alone_it_wrapped_load(tmp_path):
    """pytorch/examples' main.py wraps AlexNet's and VGG's `features` alone in DataParallel: `features.module.0.weight`
    (was: refused as weights the model lacks)."""
    torch.manual_seed(0)
    model = torchvision.models.alexnet(num_classes=3)
    model.features = nn.DataParallel(model.features)
    torch.save({"epoch": 90, "arch": "alexnet", "state_dict": model.state_dict()}, tmp_path / "alexnet.pth.tar")
    assert "features.module.0.weight" in model.state_dict()
    fresh = torchvision.models.alexnet(num_classes=3)
    loaded = checkpoint.load_checkpoint(tmp_path / "alexnet.pth.tar")
    checkpoint.load_weights(fresh, loaded, "alexnet", CLASSES3, tmp_path / "alexnet.pth.tar")
    unwrapped = {name.replace("features.module.", "features."): value for name, value in model.state_dict().items()}
    assert_same_weights(fresh.state_dict(), unwrapped)
    # Only theirs: a model of yours may hold a module named `module` in its `features` (a QuantWrapper, say)
    assert checkpoint.strip_prefixes({"module.features.module.0.weight": 1}) == {"features.module.0.weight": 1}
    torch.save({"arch": "mine:Net", "state_dict": model.state_dict()}, tmp_path / "mine.pth")
    assert "features.module.0.weight" in checkpoint.load_checkpoint(tmp_path / "mine.pth")["state_dict"]


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
    assert "\n" not in message and error.value.__suppress_context__  # (torch's error is in the line, not chained)


class CreatesMarkerWhenUnpickled:
    """Unpickling this calls open(marker, 'w'): a stand-in for arbitrary code in a pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_holding_arbitrary_objects_is_refused_without_running_them(tmp_path):
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pth"
    torch.save(
        {"epoch": 1, "state_dict": small_resnet().state_dict(), "payload": CreatesMarkerWhenUnpickled(marker)}, path
    )
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


def test_a_text_file_is_no_checkpoint_even_where_pickle_reads_its_first_letter_as_an_object(tmp_path):
    """A list of classes (classes.txt: `circle`...): pickle reads its `c` as the opcode of a global, `ircle.cross`; it
    was refused as a file that holds a Python object. A legacy torch.save file (a pickle) still is."""
    (tmp_path / "classes.txt").write_text("circle\ncross\ndiamond\n")
    with pytest.raises(UsageError, match=r"^cannot read checkpoint \S+classes\.txt: not a PyTorch checkpoint$"):
        checkpoint.load_checkpoint(tmp_path / "classes.txt")
    payload = {"state_dict": small_resnet().state_dict(), "payload": CreatesMarkerWhenUnpickled(tmp_path / "ran")}
    torch.save(payload, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    with pytest.raises(UsageError, match=r"^refusing to load \S+legacy\.pth: it holds a Python object \("):
        checkpoint.load_checkpoint(tmp_path / "legacy.pth")
    assert not (tmp_path / "ran").exists()


def test_truncated_checkpoint_raises_usage_error(tmp_path):
    checkpoint.save_checkpoint({"epoch": 1, "state_dict": small_resnet().state_dict()}, tmp_path, is_best=False)
    data = (tmp_path / "checkpoint.pth").read_bytes()
    (tmp_path / "truncated.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError, match="truncated or not a PyTorch checkpoint"):
        checkpoint.load_checkpoint(tmp_path / "truncated.pth")
    # Gone (a sharded checkpoint's state.pth deleted): said so (was "truncated or not ... (FileNotFoundError)").
    with pytest.raises(UsageError, match=r"^cannot read checkpoint \S+gone\.pth: No such file or directory$"):
        checkpoint.load_checkpoint(tmp_path / "gone.pth")


def flip_bytes_in_record(path, suffix, count=16):
    """XOR `count` bytes in the middle of the data of the zip record of `path` whose name ends with `suffix` (a tensor's
    storage): the file still loads with torch.load, one tensor's values changed."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = next(info for info in archive.infolist() if info.filename.endswith(suffix))
    data = bytearray(path.read_bytes())
    header = info.header_offset
    start = (
        header
        + 30
        + int.from_bytes(data[header + 26 : header + 28], "little")
        + int.from_bytes(data[header + 28 : header + 30], "little")
        + info.file_size // 2
    )
    data[start : start + count] = bytes(byte ^ 0xFF for byte in data[start : start + count])
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
    with pytest.raises(
        UsageError,
        match=rf"^cannot read checkpoint {re.escape(str(latest))}: corrupt \(its record "
        r"\S+/data/0 fails its CRC-32 check\)$",
    ):
        checkpoint.load_checkpoint(latest)
    warned = []
    path, resumed = checkpoint.load_resume("auto", tmp_path, warned.append)
    assert path == tmp_path / "checkpoint_prev.pth" and resumed["epoch"] == 1
    assert warned == [
        f"warning: cannot read checkpoint {latest}: corrupt (its record "
        f"{warned[0].split('record ')[1].split(' ')[0]} fails its CRC-32 check); resuming from the "
        f"previous checkpoint {tmp_path / 'checkpoint_prev.pth'}"
    ]
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
    with pytest.raises(
        UsageError,
        match=rf"^cannot read checkpoint {re.escape(str(tmp_path / 'notes.txt'))}: "
        r"truncated or not a PyTorch checkpoint \(\w+\)$",
    ):
        checkpoint.load_checkpoint(tmp_path / "notes.txt")


def test_a_file_of_random_bytes_raises_usage_error(tmp_path):
    (tmp_path / "random.bin").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(UsageError):
        checkpoint.load_checkpoint(tmp_path / "random.bin")


def test_a_pytorch_file_without_weights_is_not_a_checkpoint(tmp_path):
    torch.save({"epoch": 1}, tmp_path / "no-weights.pth")
    with pytest.raises(UsageError, match="not a checkpoint"):
        checkpoint.load_checkpoint(tmp_path / "no-weights.pth")
    torch.save({"state_dict": 5}, tmp_path / "int.pth")  # (once an AttributeError from inside the loading)
    for foreign in (False, True):  # (--resume's and --init-from's)
        with pytest.raises(UsageError, match=r"int\.pth is not a checkpoint: expected a dict with a 'state_dict' of"):
            checkpoint.load_checkpoint(tmp_path / "int.pth", foreign=foreign)


def test_resume_auto_is_none_in_an_empty_dir_and_the_checkpoint_when_present(tmp_path):
    assert checkpoint.load_resume("auto", tmp_path, warn=print) == (None, None)
    assert checkpoint.load_resume("auto", tmp_path / "not-created-yet", warn=print) == (None, None)
    assert checkpoint.resolve_resume("", tmp_path) is None
    torch.save({"state_dict": {}, "arch": "resnet18"}, tmp_path / "checkpoint.pth")
    assert checkpoint.load_resume("auto", tmp_path, warn=print)[0] == tmp_path / "checkpoint.pth"


def test_resolve_resume_of_a_missing_file_raises_usage_error(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        checkpoint.resolve_resume(str(tmp_path / "missing.pth"), tmp_path)
    with pytest.raises(UsageError, match=r"^--resume /dev/null: not a file \(give a checkpoint.pth"):
        checkpoint.resolve_resume("/dev/null", tmp_path)  # (it said "no such file")
    with pytest.raises(UsageError, match=r"^--resume \S+: a directory; give a checkpoint file"):
        checkpoint.resolve_resume(str(tmp_path), tmp_path)  # a directory is not a checkpoint
    (tmp_path / "state.pth").write_bytes(b"x")  # train_fsdp.py's: said so (it said "no such file")
    with pytest.raises(
        UsageError,
        match=r"^--resume \S+: a sharded checkpoint of train_fsdp.py; resume it with "
        r"train_fsdp.py, or write its weights as one file \(python tools/export_checkpoint",
    ):
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
    """--init-from: torchvision's references' checkpoint ("model", DDP's module. prefix, "args") of resnet18 on 5
    classes, into a run on 3 classes of 1-channel images: every weight loaded but the head (new, 5 -> 3 classes),
    conv1's RGB filters summed as --pretrained's are; the header names the file and the changes."""
    from common.header import start_lines
    from conftest import built_trainer, tensor_datasets

    torch.manual_seed(0)
    source = torchvision.models.resnet18(num_classes=5)
    path = tmp_path / "theirs.pth"
    import argparse  # (the references save their flags as a Namespace; older weights lack num_batches_tracked)

    torch.save(
        {
            "model": {
                f"module.{key}": value
                for key, value in source.state_dict().items()
                if not key.endswith("num_batches_tracked")
            },
            "epoch": 7,
            "args": argparse.Namespace(lr=0.5),
        },
        path,
    )
    trainer = built_trainer(
        "-a",
        "resnet18",
        "--init-from",
        str(path),
        "--train-crop-size",
        "16",
        "--val-resize-size",
        "16",
        "--val-crop-size",
        "16",
        "-j",
        "0",
        "-b",
        "4",
        "--mean",
        "0.5",
        "--std",
        "0.25",
        datasets=tensor_datasets(channels=1),
    )
    model = trainer.model
    assert torch.equal(model.layer1[0].conv1.weight, source.layer1[0].conv1.weight)
    assert torch.equal(model.bn1.running_mean, source.bn1.running_mean)
    assert torch.allclose(model.conv1.weight, source.conv1.weight.sum(dim=1, keepdim=True))
    assert model.fc.weight.shape == (3, 512)
    assert trainer._model_changes == ["fc: 5 -> 3 classes, new weights", "conv1: 3 -> 1 channels, RGB filters summed"]
    assert any(line.startswith(f"model: resnet18 from --init-from {path}, ") for line in start_lines(trainer))


def test_init_from_takes_a_file_of_the_data_s_channels_as_it_is_and_refuses_another_arch_in_one_line(tmp_path):
    from conftest import built_trainer, tensor_datasets

    flags = [
        "--train-crop-size",
        "16",
        "--val-resize-size",
        "16",
        "--val-crop-size",
        "16",
        "-j",
        "0",
        "-b",
        "4",
        "--mean",
        "0.5",
        "--std",
        "0.25",
    ]
    own = built_trainer("-a", "resnet18", *flags, datasets=tensor_datasets(channels=1))  # 1 channel, 3 classes
    path = tmp_path / "ours.pth"
    torch.save({"state_dict": own.model.state_dict()}, path)
    again = built_trainer("-a", "resnet18", "--init-from", str(path), *flags, datasets=tensor_datasets(channels=1))
    assert again._model_changes == ["conv1: 3 -> 1 channels, as in ours.pth"]
    assert all(torch.equal(value, own.model.state_dict()[key]) for key, value in again.model.state_dict().items())
    with pytest.raises(
        UsageError,
        match=rf"^--init-from {re.escape(str(path))} does not fit --arch resnet34: weights "
        r"missing layer1\.2\.conv1\.weight, layer1\.2\.bn1\.weight, .* and \d+ more$",
    ):
        built_trainer("-a", "resnet34", "--init-from", str(path), *flags, datasets=tensor_datasets(channels=1))
    with pytest.raises(UsageError, match=r"^--init-from \S+missing\.pth: no such file$"):
        built_trainer(
            "-a", "resnet18", "--init-from", str(tmp_path / "missing.pth"), *flags, datasets=tensor_datasets(channels=1)
        )
    with pytest.raises(UsageError, match=r"^--init-from \S+: a directory; give a weights file \("):
        built_trainer("-a", "resnet18", "--init-from", str(tmp_path), *flags, datasets=tensor_datasets(channels=1))
    with pytest.raises(UsageError, match=r"^--init-from /dev/null: not a file$"):  # (it said "no such file")
        built_trainer("-a", "resnet18", "--init-from", "/dev/null", *flags, datasets=tensor_datasets(channels=1))
    with pytest.raises(UsageError, match=r"^--init-from and --pretrained both give the starting weights: choose one$"):
        built_trainer(
            "-a", "resnet18", "--init-from", str(path), "--pretrained", *flags, datasets=tensor_datasets(channels=1)
        )


SMALL = [
    "--train-crop-size",
    "16",
    "--val-resize-size",
    "16",
    "--val-crop-size",
    "16",
    "-j",
    "0",
    "-p",
    "1",
    "-b",
    "4",
    "--seed",
    "1",
    "--lr",
    "0.05",
    "--dataset",
    "tests.custom_datasets:uint8_tensors",
]
TINY_NET = ["-a", "tests.tiny_models:TinyNet"]

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables


class Crash(Exception):
    """What kills a run in-process: raised at a step, after the checkpoint of the step before."""


class StopsAt(Trainer):
    """A trainer that crashes before its global step `stop_at` (STOP_AT), as a SIGKILL would."""

    stop_at = None

    def train_step(self, model, images, labels):
        self.steps_taken = getattr(self, "steps_taken", self.start_epoch * self.steps_per_epoch + self.start_step)
        if self.steps_taken == self.stop_at:
            raise Crash()
        self.steps_taken += 1
        return super().train_step(model, images, labels)


def started(*argv, trainer=Trainer):
    """A trainer started as a script starts one (common/run.py), in this process."""
    return start_run(trainer(parse(*argv), cpu_runtime()))


def test_decode_gpu_trains_the_weights_of_the_loader_workers_decoding_and_resumes_mid_epoch_alike(tiny_data, tmp_path):
    """--decode gpu on the CPU (the training process decodes, crops and flips; the Trainer normalises there): the run
    of the loader workers' decoding, bit for bit, also when it crashed mid-epoch and resumed."""
    flags = [*SMALL[: SMALL.index("--dataset")], *TINY_NET, "--epochs", "2", "--checkpoint-interval", "2"]
    whole = started(*flags, "--data", tiny_data, "--output-dir", tmp_path / "whole")
    whole.fit(whole.model, whole.model)
    StopsAt.stop_at = 9
    crashed = started(*flags, "--data", tiny_data, "--decode", "gpu", "--output-dir", tmp_path / "gpu", trainer=StopsAt)
    with pytest.raises(Crash):
        crashed.fit(crashed.model, crashed.model)
    resumed = started(
        *flags, "--data", tiny_data, "--decode", "gpu", "--output-dir", tmp_path / "gpu", "--resume", "auto"
    )
    assert (resumed.start_epoch, resumed.start_step) == (1, 2)  # (6 steps an epoch; the checkpoint after the 8th)
    resumed.fit(resumed.model, resumed.model)
    ends = [torch.load(tmp_path / name / "checkpoint.pth", weights_only=True) for name in ("whole", "gpu")]
    assert all(torch.equal(ends[0]["state_dict"][name], ends[1]["state_dict"][name]) for name in ends[0]["state_dict"])
    assert log_rows(tmp_path / "whole")[-1] == log_rows(tmp_path / "gpu")[-1]


def test_decode_gpu_leaves_a_jpeg_no_decoder_reads_out_of_validation_and_ends_training_on_it(tiny_data, tmp_path):
    """--decode gpu: a JPEG found undecodable in the training process is left out of validation (named in
    bad_images.txt, the run goes on); in training it ends the run in one line, as --strict-data does."""
    from common.errors import UnreadableImage
    from tests.unit.test_device_loader import broken_jpeg

    flags = [*SMALL[: SMALL.index("--dataset")], *TINY_NET, "--epochs", "1", "--decode", "gpu"]
    root = shutil.copytree(tiny_data, tmp_path / "data")
    (root / "val" / "circle" / "broken.jpg").write_bytes(broken_jpeg())
    run = started(*flags, "--data", root, "--output-dir", tmp_path / "val")
    run.fit(run.model, run.model)
    assert (tmp_path / "val" / "bad_images.txt").read_text().startswith(f"{root / 'val' / 'circle' / 'broken.jpg'}\t")
    (root / "train" / "circle" / "broken.jpg").write_bytes(broken_jpeg())
    for extra, ending in [("--overwrite", "--decode gpu found it in a training batch"), ("--strict-data", "without")]:
        run = started(*flags, "--data", root, "--output-dir", tmp_path / extra, extra)
        with pytest.raises(
            UnreadableImage, match=rf"^cannot decode {re.escape(str(root))}/\w+/circle/broken.jpg .*; {ending}"
        ):
            run.fit(run.model, run.model)


def log_rows(folder):
    with open(folder / "log.csv", newline="") as file:
        return [{name: value for name, value in row.items() if name not in MEASURED} for row in csv.DictReader(file)]


def test_a_run_stopped_mid_epoch_goes_on_bitwise_as_one_that_never_stopped(tmp_path):
    """Weights, optimizer, schedule, EMA, metric sums, random streams (dropout), mixing: every part's own state,
    put back by checkpoint.restore. 3 steps an epoch, a checkpoint every 2: the crash before step 5 resumes at step 4.
    """
    flags = [
        *SMALL,
        *TINY_NET,
        "--epochs",
        "2",
        "--checkpoint-interval",
        "2",
        "--dropout",
        "0.3",
        "--model-ema",
        "--model-ema-steps",
        "1",
        "--mixup-alpha",
        "0.2",
        "--lr-schedule",
        "cosine",
    ]
    uninterrupted = started(*flags, "--output-dir", tmp_path / "whole")
    uninterrupted.fit(uninterrupted.model, uninterrupted.model)
    StopsAt.stop_at = 5
    crashed = started(*flags, "--output-dir", tmp_path / "crashed", trainer=StopsAt)
    with pytest.raises(Crash):
        crashed.fit(crashed.model, crashed.model)
    saved = torch.load(tmp_path / "crashed" / "checkpoint.pth", weights_only=True)
    assert (saved["epoch"], saved["step_in_epoch"]) == (1, 1)  # after the run's 4th step
    resumed = started(*flags, "--output-dir", tmp_path / "crashed", "--resume", "auto")
    assert (resumed.start_epoch, resumed.start_step) == (1, 1)
    resumed.fit(resumed.model, resumed.model)
    ends = [torch.load(tmp_path / name / "checkpoint.pth", weights_only=True) for name in ("whole", "crashed")]
    for key in ("state_dict", "model_ema"):
        weights = [end[key] if key == "state_dict" else end[key]["state_dict"] for end in ends]
        assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0]), key
    assert ends[0]["optimizer"]["state"][0]["momentum_buffer"].equal(
        ends[1]["optimizer"]["state"][0]["momentum_buffer"]
    )
    assert log_rows(tmp_path / "whole") == log_rows(tmp_path / "crashed")


class TemperatureCrashes(LearnedTemperature):
    """examples/learned_temperature.py's trainer, crashing (as a SIGKILL would) before its step `crash_at`."""

    crash_at = 5

    def train_step(self, model, images, labels):
        if self.steps_taken == self.crash_at:
            raise Crash()
        return super().train_step(model, images, labels)


def test_a_criterion_s_parameters_and_a_trainer_s_own_state_resume_bitwise(tmp_path):
    """The learned temperature (the criterion's parameter, trained in an optimizer group of its own) and the trainer's
    step counter (state_dict) are saved mid-epoch and given back: the resumed run ends as the one never stopped."""
    flags = [
        *SMALL,
        *TINY_NET,
        "--epochs",
        "2",
        "--checkpoint-interval",
        "2",
        "--trainer",
        "examples.learned_temperature:LearnedTemperature",
        "--temperature-warmup",
        "2",
    ]
    whole = started(*flags, "--output-dir", tmp_path / "whole", trainer=LearnedTemperature)
    whole.fit(whole.model, whole.model)
    crashed = started(*flags, "--output-dir", tmp_path / "crashed", trainer=TemperatureCrashes)
    with pytest.raises(Crash):
        crashed.fit(crashed.model, crashed.model)
    resumed = started(*flags, "--output-dir", tmp_path / "crashed", "--resume", "auto", trainer=LearnedTemperature)
    assert (resumed.start_epoch, resumed.start_step, resumed.steps_taken) == (1, 1, 4)
    resumed.fit(resumed.model, resumed.model)
    ends = [torch.load(tmp_path / name / "checkpoint.pth", weights_only=True) for name in ("whole", "crashed")]
    assert ends[0]["trainer_state"] == ends[1]["trainer_state"] == {"steps_taken": 6}
    assert ends[0]["criterion"]["log_temperature"] != 0  # learned
    for key in ("state_dict", "criterion"):
        assert all(torch.equal(ends[0][key][name], ends[1][key][name]) for name in ends[0][key]), key
    assert log_rows(tmp_path / "whole") == log_rows(tmp_path / "crashed")
    evaluated = started(
        *flags,
        "-e",
        "--resume",
        tmp_path / "whole" / "checkpoint.pth",
        "--output-dir",
        tmp_path / "e",
        trainer=LearnedTemperature,
    )  # -e's loss is the learned temperature's
    assert torch.equal(evaluated.criterion.log_temperature.detach(), ends[0]["criterion"]["log_temperature"])


class NumpyState(Trainer):
    """Plain state at the first save; a numpy scalar (np.mean of a history, say) from the second on."""

    saves = 0

    def state_dict(self):
        import numpy

        self.saves += 1
        return {"seen": 1.0 if self.saves == 1 else numpy.float64(1.0)}

    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument("--extra-weights", type=Path, nargs="*", default=[Path("none.pth")])


def test_what_a_resume_could_not_load_is_refused_at_every_save_and_flags_of_other_types_are_saved_as_text(tmp_path):
    """A checkpoint that torch.load(weights_only=True) could not read was written, exit 0, where the trainer's state
    was plain at the first save only (the check ran once) or a --trainer flag held a Path (args was not checked)."""
    trainer = built_trainer(
        *SMALL,
        *TINY_NET,
        "--output-dir",
        tmp_path,
        "--trainer",
        "tests.unit.test_checkpoint:NumpyState",
        trainer=NumpyState,
    )
    saved = checkpoint.assemble(trainer, epoch=1, step_in_epoch=0)
    torch.save(saved, tmp_path / "c.pth")
    assert torch.load(tmp_path / "c.pth", weights_only=True)["args"]["extra_weights"] == ["none.pth"]
    with pytest.raises(
        UsageError,
        match=r"^NumpyState.state_dict\(\) returned numpy\.\S+, which a resume cannot load "
        r"\(weights_only\): return plain data and tensors$",
    ):
        checkpoint.assemble(trainer, epoch=1, step_in_epoch=1)
    trainer.saves = 0
    trainer.optimizer.param_groups[0]["note"] = Path("x")  # (an optimizer of one's own, an object in its groups)
    with pytest.raises(UsageError, match=r"^the optimizer's state_dict\(\) holds pathlib\.\w*Path, which a resume"):
        checkpoint.assemble(trainer, epoch=1, step_in_epoch=1)


def test_a_checkpoint_holds_each_part_under_its_documented_key_and_loads_with_weights_only(tmp_path):
    trainer = built_trainer(*SMALL, *TINY_NET, "--model-ema", "--output-dir", tmp_path)
    saved = checkpoint.assemble(trainer, epoch=1, step_in_epoch=0)
    torch.save(saved, tmp_path / "c.pth")
    loaded = torch.load(tmp_path / "c.pth", weights_only=True)
    assert loaded["format_version"] == checkpoint.FORMAT_VERSION == 1
    assert {
        "epoch",
        "step_in_epoch",
        "global_step",
        "arch",
        "num_classes",
        "classes",
        "seed",
        "world_size",
        "job",
        "deterministic",
        "args",
        "samples",
        "state_dict",
        "optimizer",
        "optimizer_groups",
        "scheduler",
        "scheduler_type",
        "scaler",
        "model_ema",
        "best_acc1",
        "best_ema_acc1",
        "best_epoch",
        "epoch_lr",
        "train_totals",
        "rng_states",
        "bad_images",
        "criterion",
        "trainer_state",
    } == set(loaded) - {"format_version"}
    reference = (Path(__file__).parents[2] / "docs" / "reference.md").read_text().split("## Checkpoint format")[1]
    assert not [key for key in loaded if f"`{key}`" not in reference.split("\n## ")[0]]  # each key's row there
    assert loaded["scheduler"] == {"last_epoch": 0, "steps_per_epoch": 3} and loaded["samples"] == {
        "train": 12,
        "val": 6,
        "steps": 3,
        "train_items": None,  # (a dataset of one's own: tests.custom_datasets)
    }
    for key in ("state_dict", "model_ema"):
        plain = TinyNet(num_classes=3)
        plain.load_state_dict(loaded[key] if key == "state_dict" else loaded[key]["state_dict"])  # strict


def old_checkpoint(path, **changes):
    """A checkpoint as this repository wrote them up to commit fa90e47: no format_version, the parts' old keys."""
    torch.save(
        {
            "epoch": 1,
            "step_in_epoch": 0,
            "arch": "tests.tiny_models:TinyNet",
            "classes": ["dark", "mid", "light"],
            "state_dict": TinyNet(num_classes=3).state_dict(),
            "rng_states": [],
            "train_totals": None,
            "checkpoint_id": "x",
            **changes,
        },
        path,
    )
    return path


def test_a_checkpoint_of_an_earlier_format_is_refused_naming_the_commit_that_finishes_it(tmp_path):
    path = old_checkpoint(tmp_path / "old.pth")
    loaded = checkpoint.load_checkpoint(path)
    with pytest.raises(
        UsageError,
        match=rf"^{path} was written by an earlier version of these scripts \(checkpoint "
        r"format without a version; this one resumes format 1\): finish that run with "
        r"the version that wrote it \(git checkout fa90e47\), or start afresh",
    ):
        checkpoint.check_format(loaded, path)
    with pytest.raises(UsageError, match="newer version"):
        checkpoint.check_format({**loaded, "format_version": 2}, path)
    checkpoint.check_format({**loaded, "format_version": 1}, path)


def test_weights_from_elsewhere_are_no_checkpoint_of_ours_and_pass(tmp_path):
    """pytorch/examples' main.py, a bare state_dict: not resumed runs of these scripts, their weights load."""
    examples = {
        "epoch": 5,
        "arch": "resnet18",
        "state_dict": torchvision.models.resnet18().state_dict(),
        "best_acc1": torch.tensor(40.0),
        "optimizer": {},
    }
    bare = {"state_dict": TinyNet(3).state_dict()}
    for foreign in (examples, bare):
        assert not checkpoint.is_ours(foreign)
        checkpoint.check_format(foreign, tmp_path / "x.pth")


def test_an_old_checkpoint_is_refused_on_resume_and_its_weights_still_evaluate(tmp_path):
    path = old_checkpoint(tmp_path / "old.pth")
    with pytest.raises(UsageError, match="git checkout fa90e47"):
        started(*SMALL, *TINY_NET, "--output-dir", tmp_path / "out", "--resume", path)
    assert not (tmp_path / "out").exists()  # a run that ends before it writes leaves no directory it made
    evaluated = started(*SMALL, *TINY_NET, "-e", "--resume", path)
    evaluated.fit(evaluated.model, evaluated.model)  # -e: the weights, validated; nothing written
    assert evaluated.ema is None


@pytest.fixture
def one_epoch(tmp_path):
    """A run of one epoch (3 steps of batch 4) with a checkpoint after step 2, and its output dir."""
    StopsAt.stop_at = 2
    trainer = started(
        *SMALL, *TINY_NET, "--epochs", "1", "--checkpoint-interval", "1", "--output-dir", tmp_path, trainer=StopsAt
    )
    with pytest.raises(Crash):
        trainer.fit(trainer.model, trainer.model)
    return tmp_path


@pytest.mark.parametrize(
    "flags, line",
    [
        (
            ["--opt", "adamw"],
            "was trained with --opt sgd: resume it with --opt sgd (its optimizer state is that optimizer's)",
        ),
        (
            ["--trainer", "examples.extra_metric:WithConfidence"],
            "was trained without --trainer: resume it so (a trainer's state and steps are its own)",
        ),
        (["-b", "6"], "stopped part-way through an epoch with global batch 4: resume it with -b 4"),
        (
            ["--ra-sampler"],
            "stopped part-way through an epoch drawn without --ra-sampler: resume it so (the rest of that epoch comes "
            "from its order)",
        ),
        (
            ["--bias-weight-decay", "0"],
            "holds an optimizer with other parameter groups than this run's: resume it as it was "
            "started, with --weight-decay 0.0001 and no --norm-weight-decay and no --bias-weight-decay (and the same "
            "build_optimizer)",
        ),
        (["--dataset", "tests.custom_datasets:pil_images"], None),
    ],
)
def test_what_would_not_go_on_as_the_checkpoint_s_run_is_refused_in_one_line(one_epoch, flags, line):
    """Another optimizer or trainer, another batch or order mid-epoch, other parameter groups; the same data of
    another kind (PIL images, 12 of them: the same counts) goes on."""
    argv = [*SMALL, *TINY_NET, "--epochs", "2", "--output-dir", one_epoch, "--resume", "auto", *flags]
    if line is None:
        assert started(*argv).start_step == 2
        return
    with pytest.raises(UsageError) as refused:
        started(*argv)
    assert str(refused.value).endswith(line), str(refused.value)


def test_a_resume_whose_flags_regroup_as_many_parameters_is_refused(tmp_path):
    """(was: went on, exit 0, the groups keeping the checkpoint's settings and each moved parameter another's momentum;
    torch's load_state_dict compares the groups' lengths alone)"""
    argv = [*SMALL, "-a", "tests.tiny_models:RegroupNet", "--output-dir", tmp_path]
    first = started(*argv, "--epochs", "1", "--norm-weight-decay", "0")
    first.fit(first.model, first.model)
    assert [len(group) for group in torch.load(tmp_path / "checkpoint.pth", weights_only=True)["optimizer_groups"]] == [
        4,
        2,
    ]
    with pytest.raises(UsageError, match="holds an optimizer with other parameter groups than this run's: resume"):
        started(*argv, "--epochs", "2", "--bias-weight-decay", "0", "--resume", "auto")
    assert started(*argv, "--epochs", "2", "--norm-weight-decay", "0", "--resume", "auto").start_epoch == 1


@pytest.mark.parametrize("part", ["scheduler", "samples", "optimizer", "step_in_epoch", "args/trainer"])
def test_a_checkpoint_without_a_part_it_resumes_from_is_refused_in_one_line(one_epoch, tmp_path, part):
    """Edited by hand, whole to its checks (was a KeyError traceback)."""
    saved = torch.load(one_epoch / "checkpoint.pth", weights_only=True)
    *outer, key = part.split("/")
    del (saved[outer[0]] if outer else saved)[key]
    torch.save(saved, tmp_path / "edited.pth")
    argv = [*SMALL, *TINY_NET, "--epochs", "2", "--output-dir", tmp_path / "out", "--resume", tmp_path / "edited.pth"]
    name = f"args['{key}']" if outer else key
    with pytest.raises(
        UsageError, match=rf"edited.pth lacks {re.escape(name)}: not a whole checkpoint of these scripts"
    ):
        started(*argv)


def test_data_that_changed_is_refused_mid_epoch_and_named_at_an_epoch_s_end(one_epoch, tmp_path, capsys):
    more = ["--dataset", "tests.custom_datasets:more_uint8_tensors"]  # 15 training images, not 12
    with pytest.raises(
        UsageError,
        match=r"stopped part-way through an epoch of 12 training images; the data now "
        r"holds 15: the resumed epoch would skip other images",
    ):
        started(*SMALL, *TINY_NET, "--epochs", "2", "--output-dir", one_epoch, "--resume", "auto", *more)
    whole_epoch = started(*SMALL, *TINY_NET, "--epochs", "1", "--output-dir", tmp_path / "end")
    whole_epoch.fit(whole_epoch.model, whole_epoch.model)
    resumed = started(*SMALL, *TINY_NET, *more, "--epochs", "2", "--output-dir", tmp_path / "end", "--resume", "auto")
    assert resumed.start_epoch == 1 and resumed.start_step == 0
    assert "warning: the data changed since " in capsys.readouterr().out


def stopped_at_step_2(data, tmp_path):
    """A run on `data` stopped after step 2 of its epoch, and its argv."""
    argv = [*SMALL[:-2], "--data", data, *TINY_NET, "--epochs", "1", "--output-dir", tmp_path / "run"]
    StopsAt.stop_at = 2
    trainer = started(*argv, "--checkpoint-interval", "1", trainer=StopsAt)
    with pytest.raises(Crash):
        trainer.fit(trainer.model, trainer.model)
    return argv


def as_csv(folder, out):
    """train.csv and val.csv of `folder`'s images (its classes, in its order), their paths under `out`."""
    out.mkdir()
    for split in ("train", "val"):
        rows = [f"{path},{path.parent.name}\n" for path in sorted((folder / split).glob("*/*.jpg"))]
        (out / f"{split}.csv").write_text("".join(rows))
    return out


@pytest.mark.parametrize("kind", ["moved", "renamed", "csv", "shards"])
def test_as_many_other_files_are_refused_mid_epoch(tiny_data, tmp_path, kind):
    """The same number of training images, other files: an image moved to another class, one renamed (sorting
    elsewhere: the same labels), two train.csv rows' labels swapped, shards written again of a folder with one
    renamed. Resumed mid-epoch, the epoch read shifted indices or other labels (was: exit code 0)."""
    import make_shards

    data = shutil.copytree(tiny_data, tmp_path / "data")
    ring = sorted((data / "train" / "ring").iterdir())
    given = {"csv": as_csv(data, tmp_path / "listed"), "shards": tmp_path / "shards"}.get(kind, data)
    if kind == "shards":
        assert make_shards.main([str(data), str(given), "--workers", "1"]) == 0
    argv = stopped_at_step_2(given, tmp_path)
    if kind == "moved":
        ring[0].rename(data / "train" / "circle" / f"moved-{ring[0].name}")
    elif kind == "csv":
        lines = (given / "train.csv").read_text().splitlines(keepends=True)
        first, last = lines[0].rsplit(",", 1), lines[-1].rsplit(",", 1)
        (given / "train.csv").write_text("".join([f"{first[0]},{last[1]}", *lines[1:-1], f"{last[0]},{first[1]}"]))
    else:
        ring[0].rename(ring[0].with_name("zzz.jpg"))
    if kind == "shards":
        shutil.rmtree(given)
        assert make_shards.main([str(data), str(given), "--workers", "1"]) == 0
    with pytest.raises(UsageError, match=r"an epoch of 24 training images; the data now holds as many, of other files"):
        started(*argv, "--resume", "auto")


def test_the_same_images_moved_or_in_another_form_resume_mid_epoch(tiny_data, tmp_path):
    """Not refused (as the items' digest compares): the folder moved elsewhere; its CSV split moved (paths under
    their common prefix); a folder's run resumed on the folder's shards or its CSV split (other kinds: not compared)."""
    import make_shards

    data = shutil.copytree(tiny_data, tmp_path / "data")
    argv = stopped_at_step_2(data, tmp_path)
    moved = data.rename(tmp_path / "moved")
    assert make_shards.main([str(moved), str(tmp_path / "shards"), "--workers", "1"]) == 0
    for given in (moved, tmp_path / "shards", as_csv(moved, tmp_path / "listed")):
        assert started(*argv, "--data", given, "--resume", "auto").start_step == 2
    listed = stopped_at_step_2(tmp_path / "listed", tmp_path / "csv-run")
    shutil.rmtree(tmp_path / "listed")
    as_csv(moved.rename(tmp_path / "again"), tmp_path / "listed")
    assert started(*listed, "--resume", "auto").start_step == 2


def test_a_run_on_another_number_of_processes_says_its_random_streams_start_afresh(one_epoch, capsys):
    """FSDP (and DDP) checkpoints resume on any number of processes; each process's streams cannot go on then."""
    saved = torch.load(one_epoch / "checkpoint.pth", weights_only=True)
    torch.save(
        {**saved, "rng_states": saved["rng_states"] * 2}, one_epoch / "checkpoint.pth"
    )  # as 2 processes wrote it
    resumed = started(*SMALL, *TINY_NET, "--epochs", "2", "--output-dir", one_epoch, "--resume", "auto")
    assert resumed.start_step == 2
    assert (
        f"note: {one_epoch / 'checkpoint.pth'} was written by 2 process(es), this run has 1: each process's random "
        "streams (dropout, stochastic depth) start afresh from the seed" in capsys.readouterr().out
    )


def test_a_resume_with_fp16_added_starts_its_loss_scale_afresh_and_one_without_model_ema_says_it_is_dropped(
    tmp_path, capsys
):
    """--amp fp16 added: torch's GradScaler refused the checkpoint's empty state (a traceback). --model-ema left out:
    the EMA was dropped without a word (the opposite way says so)."""
    whole_epoch = started(*SMALL, *TINY_NET, "--epochs", "1", "--model-ema", "--output-dir", tmp_path)
    whole_epoch.fit(whole_epoch.model, whole_epoch.model)
    capsys.readouterr()
    resumed = started(*SMALL, *TINY_NET, "--epochs", "2", "--amp", "fp16", "--output-dir", tmp_path, "--resume", "auto")
    assert resumed.start_epoch == 1 and resumed.scaler.is_enabled()
    assert (
        f"warning: {tmp_path / 'checkpoint.pth'} holds a model EMA and this run has no --model-ema: the EMA is not "
        "kept" in capsys.readouterr().out
    )


def test_ctrl_c_while_a_checkpoint_is_written_is_an_interrupt_not_a_failed_write(tmp_path, monkeypatch):
    """torch.save turns a KeyboardInterrupt in its write into its own RuntimeError ("unexpected pos"), which read as a
    disk fault: exit 1 and "could not write a checkpoint". It is Ctrl-C's (exit 130), and no temporary is left."""
    import io

    save = torch.save

    class Interrupted(io.RawIOBase):
        def __init__(self, file):
            self.file, self.writes = file, 0

        def writable(self):
            return True

        def write(self, data):
            self.writes += 1
            if self.writes == 3:
                raise KeyboardInterrupt
            return self.file.write(data)

    monkeypatch.setattr(torch, "save", lambda state, file: save(state, Interrupted(file)))
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint({"state_dict": {"w": torch.zeros(1000)}}, tmp_path, is_best=False)
    assert list(tmp_path.iterdir()) == []


class TwoGroups(Trainer):
    """A backbone at a tenth of the head's lr: the researcher's own parameter groups."""

    def build_optimizer(self, model):
        *backbone, head = model
        return torch.optim.SGD(
            [{"params": nn_parameters(backbone), "lr": self.config.lr / 10}, {"params": head.parameters()}],
            lr=self.config.lr,
            momentum=0.9,
        )


def nn_parameters(modules):
    return [parameter for module in modules for parameter in module.parameters()]


class StepEachEpoch(Trainer):
    def build_scheduler(self, optimizer, steps_per_epoch):
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=steps_per_epoch, gamma=0.5)


class WarmRestarts(Trainer):  # (its place in T_cur and T_i too)
    def build_scheduler(self, optimizer, steps_per_epoch):
        return torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=2)


class Halving(Trainer):  # (a LambdaLR: its function is not in its state)
    def build_scheduler(self, optimizer, steps_per_epoch):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** (step // steps_per_epoch))


def test_a_scheduler_of_one_s_own_resumes_where_this_run_builds_it_as_it_was_built(tmp_path):
    """OneCycleLR's state holds total_steps: a resume with a longer --epochs trained a step, then a traceback ("Tried
    to step 4 times"); another -b went on with the old length, exit 0. Now refused in one line, naming what differs.
    A StepLR of a step per epoch holds no length: a longer --epochs goes on; another -b changes its step_size."""
    from common.trainer import trainer_class

    onecycle = trainer_class("examples.adamw_onecycle:AdamWOneCycle")
    flags = [*SMALL, *TINY_NET, "--trainer", "examples.adamw_onecycle:AdamWOneCycle", "--output-dir", tmp_path]
    first = started(*flags, "--epochs", "1", trainer=onecycle)
    first.fit(first.model, first.model)
    for changed, steps in ((["--epochs", "2"], 6), (["--epochs", "2", "-b", "2"], 12)):
        with pytest.raises(
            UsageError, match=rf"OneCycleLR was built with total_steps 3 \(this run's: {steps}\).*resume"
        ) as refused:
            started(*flags, *changed, "--resume", "auto", trainer=onecycle)
        # Long settings cut between words (was: mid-token, "{'end_lr': 'max_ (this run's: ...")
        assert re.search(r"_schedule_phases \[.{,50} \.\.\. \(this run's: \[.{,50} \.\.\.\)", str(refused.value))
    for changed in (["--epochs", "1"], ["--epochs", "1", "-b", "2"]):  # (trained: validated again, nothing to train)
        assert started(*flags, *changed, "--resume", "auto", trainer=onecycle).scheduler.total_steps == 3
    flags = [*SMALL, *TINY_NET, "--output-dir", tmp_path / "step"]
    first = started(*flags, "--epochs", "1", trainer=StepEachEpoch)
    first.fit(first.model, first.model)
    assert started(*flags, "--epochs", "2", "--resume", "auto", trainer=StepEachEpoch).scheduler.last_epoch == 3
    with pytest.raises(UsageError, match=r"StepLR was built with step_size 3 \(this run's: 6\)"):
        started(*flags, "--epochs", "2", "-b", "2", "--resume", "auto", trainer=StepEachEpoch)
    # Its place outside last_epoch (T_cur): the same flags go on (were refused, "T_cur 1 (this run's: 0)").
    flags = [*SMALL, *TINY_NET, "--epochs", "2", "--output-dir", tmp_path / "warm"]
    StopsAt.stop_at = 5  # (after step 5 of 3 an epoch: T_cur 1)
    with pytest.raises(Crash):
        run = started(*flags, "--checkpoint-interval", "1", trainer=type("S", (StopsAt, WarmRestarts), {}))
        run.fit(run.model, run.model)
    resumed = started(*flags, "--resume", "auto", trainer=WarmRestarts).scheduler
    assert (resumed.last_epoch, resumed.T_cur) == (5, 1)
    # Another -b at an epoch's end, which a LambdaLR's state does not hold: named (was blamed on the trainer).
    flags = [*SMALL, *TINY_NET, "--output-dir", tmp_path / "halving"]
    first = started(*flags, "--epochs", "1", trainer=Halving)
    first.fit(first.model, first.model)
    with pytest.raises(UsageError, match=r"LambdaLR counts 3 steps an epoch, this run 6 \(another -b or data size\)"):
        started(*flags, "--epochs", "2", "-b", "2", "--resume", "auto", trainer=Halving)


def test_parameter_groups_of_their_own_keep_their_lr_across_a_resume(one_epoch, tmp_path):
    """Once: both groups at --lr after a resume, without a word (the default schedule was rebuilt at --lr)."""
    StopsAt.stop_at = 2
    flags = [*SMALL, *TINY_NET, "--epochs", "2", "--checkpoint-interval", "1", "--output-dir", tmp_path / "groups"]
    first = started(*flags, trainer=type("StopsWithGroups", (StopsAt, TwoGroups), {}))
    with pytest.raises(Crash):
        first.fit(first.model, first.model)
    resumed = started(*flags, "--resume", "auto", trainer=TwoGroups)
    lrs = [group["lr"] for group in resumed.optimizer.param_groups]
    assert lrs == pytest.approx([0.005, 0.05])


def test_an_fp16_run_resumes_with_the_scale_its_gradscaler_had(tmp_path):
    """fp16 trains with a GradScaler; a resumed run goes on with the scale it had, not a new one."""
    flags = [*SMALL, *TINY_NET, "--amp", "fp16", "--output-dir", tmp_path]
    first = started(*flags, "--epochs", "1")
    first.fit(first.model, first.model)
    saved = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert saved["scaler"]["scale"] == 65536.0  # GradScaler's initial scale: no overflow in so few steps
    saved["scaler"].update(scale=1024.0, _growth_tracker=7)  # as if a long run had met overflows
    torch.save(saved, tmp_path / "checkpoint.pth")
    resumed = started(*flags, "--epochs", "2", "--resume", "auto")
    resumed.fit(resumed.model, resumed.model)
    scaler = torch.load(tmp_path / "checkpoint.pth", weights_only=True)["scaler"]
    assert scaler["scale"] == 1024.0 and scaler["_growth_tracker"] == 7 + 3, scaler  # 3 more steps, no overflow


def test_a_best_epoch_whose_model_best_copy_failed_is_copied_again_on_resume(tmp_path, capsys):
    """A save of the best epoch writes checkpoint.pth, then copies it to model_best.pth: a failure between the two (a
    full disk, a kill) says so in its line, and the resumed run copies it again. model_best.pth stayed an older, worse
    epoch for good before (the latest recorded the new best accuracy, so no later epoch was 'best')."""
    from common.errors import CheckpointWriteError

    flags = [*SMALL, *TINY_NET, "--epochs", "3", "--output-dir", tmp_path]
    trainer = started(*flags)
    trainer.optimizer.step()  # (no gradients: nothing moves; the schedule stands where a trained epoch leaves it)
    for _ in range(trainer.steps_per_epoch):
        trainer.scheduler.step()
    trainer._best_acc1, trainer._best_epoch = 20.0, 1
    trainer.save(1, is_best=True)
    best = tmp_path / "model_best.pth"
    assert torch.load(best, weights_only=True)["epoch"] == 1
    for _ in range(trainer.steps_per_epoch):
        trainer.scheduler.step()
    trainer._best_acc1, trainer._best_epoch = 25.0, 2
    best.unlink()
    best.mkdir()  # model_best.pth cannot be replaced: the copy fails, as on a full disk
    with pytest.raises(
        CheckpointWriteError,
        match=rf"^could not copy {tmp_path / 'checkpoint.pth'} to model_best.pth "
        r"\(Is a directory\); the checkpoint itself is written and --resume "
        r"auto writes model_best.pth again from it$",
    ):
        trainer.save(2, is_best=True)
    best.rmdir()
    (tmp_path / "checkpoint_prev.pth").rename(best)  # what the failed copy left: the earlier best (epoch 1)
    latest = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert (latest["epoch"], latest["best_epoch"], latest["best_acc1"]) == (2, 2, 25.0)
    capsys.readouterr()
    resumed = started(*flags, "--resume", "auto")
    assert (
        f"warning: {best} did not hold the best epoch 2: copied again from {tmp_path / 'checkpoint.pth'}"
        in capsys.readouterr().out
    )
    assert torch.load(best, weights_only=True)["checkpoint_id"] == latest["checkpoint_id"] and resumed._best_epoch == 2
    started(*flags, "--resume", "auto")  # model_best.pth is the best now: left alone
    assert "did not hold the best" not in capsys.readouterr().out
    best.unlink()
    best.mkdir()  # still no room for it: the resume goes on, saying so
    assert started(*flags, "--resume", "auto").start_epoch == 2
    assert (
        f"warning: could not write model_best.pth again from {tmp_path / 'checkpoint.pth'} (" in capsys.readouterr().out
    )

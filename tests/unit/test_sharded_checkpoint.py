"""common/sharded_checkpoint.py in-process, in a process group of one: each save a new directory made the latest by
switching links once complete, the older ones removed; resume (auto falls back to the previous one); the one-line
refusals; the single-file export; --async-checkpoint's switch after its write; a failed write leaves the links."""

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from common.checkpoint import check_format, is_ours, restore
from common.errors import CheckpointWriteError, UsageError
from common.fsdp import Sharding
from common.run import start_run
from common.sharded_checkpoint import LATEST, PREVIOUS, ShardedCheckpoints, export, is_sharded
from common.trainer import Trainer
from conftest import cpu_runtime, parse, sharded_trainer
from harness.processes import PYTHON, REPO, clean_env
from tests.tiny_models import BlockNet

BLOCKS = ["-a", "tests.tiny_models:BlockNet", "--model-ema", "--opt", "adamw", "--lr", "0.01"]


def trained(tmp_path, *flags):
    trainer = sharded_trainer(*BLOCKS, "--output-dir", tmp_path, *flags)
    trainer.model(torch.randn(2, 3, 16, 16)).sum().backward()
    trainer.optimizer.step()
    trainer.scheduler.step()
    trainer.ema.after_step(0, 1)
    return trainer


def whole(model):
    return {
        name: value.full_tensor() if hasattr(value, "full_tensor") else value
        for name, value in model.state_dict().items()
    }


def test_each_save_is_a_new_directory_behind_switched_links_and_older_ones_go(group_of_one, tmp_path):
    trainer = trained(tmp_path)
    trainer.save(1)
    (tmp_path / "sharded" / "e0001-s000002-crashed").mkdir()  # a save that died before its state.pth
    trainer.save(1, 2)
    trainer.save(2)
    latest, previous = tmp_path / LATEST, tmp_path / PREVIOUS
    assert latest.is_symlink() and str(latest.readlink()).startswith("sharded/e0002-s000000-")
    assert str(previous.readlink()).startswith("sharded/e0001-s000002-")
    assert sorted(path.name for path in (tmp_path / "sharded").iterdir()) == sorted(
        [latest.resolve().name, previous.resolve().name]
    )
    assert sorted(path.name for path in latest.iterdir()) == [".metadata", "__0_0.distcp", "state.pth"]
    saved = torch.load(latest / "state.pth", weights_only=True)
    assert (saved["epoch"], saved["step_in_epoch"]) == (2, 0) and "state_dict" not in saved and "optimizer" not in saved
    assert saved["checkpoint_id"] in latest.resolve().name and is_sharded(latest)


def test_a_run_copied_with_its_links_followed_saves_on_as_links(group_of_one, tmp_path):
    """cp -rL (scp -r) made checkpoint/ and checkpoint_prev/ directories: it resumed, then every save failed (a link
    cannot replace a directory), exit 1. Now they are taken in under sharded/ and linked again."""
    trainer = trained(tmp_path / "run")
    trainer.save(1)
    trainer.save(2)
    shutil.copytree(tmp_path / "run", tmp_path / "copy", symlinks=False)
    copied = sharded_trainer(*BLOCKS, "--output-dir", tmp_path / "copy")
    assert not (tmp_path / "copy" / LATEST).is_symlink()
    copied.save(3)
    latest, previous = tmp_path / "copy" / LATEST, tmp_path / "copy" / PREVIOUS
    assert latest.is_symlink() and str(latest.readlink()).startswith("sharded/e0003-s000000-")
    assert previous.is_symlink() and torch.load(previous / "state.pth", weights_only=True)["epoch"] == 2
    assert sorted(path.name for path in (tmp_path / "copy" / "sharded").iterdir()) == sorted(
        [latest.resolve().name, previous.resolve().name]
    )
    # Its latest damaged: --resume auto takes checkpoint_prev/, which the save keeps as checkpoint_prev.
    shutil.copytree(tmp_path / "run", tmp_path / "damaged", symlinks=False)
    (tmp_path / "damaged" / LATEST / "state.pth").write_bytes(b"damaged")
    copied = sharded_trainer(*BLOCKS, "--output-dir", tmp_path / "damaged")
    assert copied._checkpoints.load_resume("auto", tmp_path / "damaged", warn=lambda line: None)[1]["epoch"] == 1
    copied.save(3)
    assert torch.load(tmp_path / "damaged" / PREVIOUS / "state.pth", weights_only=True)["epoch"] == 1


def test_a_save_after_validation_without_resharding_after_forward_saves_the_sharded_state(group_of_one, tmp_path):
    """--no-reshard-after-forward: validation's forwards (no backward) leave the units whole; the save shards them
    again (was: a KeyError in torch's get_optimizer_state_dict at every epoch's end, an unusable flag)."""
    trainer = trained(tmp_path, "--no-reshard-after-forward")
    with torch.no_grad():
        for model in (trainer.model, trainer.ema.module):
            model.eval()(torch.randn(2, 3, 16, 16))
    trainer.save(0, 1)
    resumed = sharded_trainer(*BLOCKS, "--output-dir", tmp_path, "--resume", "auto")
    path, checkpoint = resumed._checkpoints.load_resume("auto", tmp_path, warn=print)
    restore(resumed, checkpoint, path)
    assert all(torch.equal(value, whole(trainer.model)[name]) for name, value in whole(resumed.model).items())


def test_a_finished_sharded_checkpoint_from_elsewhere_is_refused_naming_its_export(group_of_one, tmp_path):
    """(--init-from takes a weights file, not the sharded directory the refusal named before)"""
    trainer = trained(tmp_path / "run")
    trainer.save(1)
    small = "--train-crop-size 16 --val-resize-size 16 --val-crop-size 16 -j 0 -b 4 --seed 1 --epochs 1".split()
    flags = [*small, *BLOCKS, "--dataset", "tests.custom_datasets:uint8_tensors", "--output-dir", tmp_path / "new"]
    config = parse(*flags, "--resume", tmp_path / "run" / LATEST, mode="fsdp")
    runtime = cpu_runtime(mode="fsdp")
    with pytest.raises(
        UsageError, match=r"or --init-from its export \(tools/export_checkpoint.py\) to start a new run"
    ):
        start_run(Trainer(config, runtime, shard=Sharding(config, runtime), checkpoints=ShardedCheckpoints(config)))


def test_a_resumed_trainer_gets_the_weights_the_ema_and_the_optimizer_state(group_of_one, tmp_path):
    trainer = trained(tmp_path)
    trainer.save(0, 1)
    resumed = sharded_trainer(*BLOCKS, "--output-dir", tmp_path, "--resume", "auto")
    path, checkpoint = resumed._checkpoints.load_resume("auto", tmp_path, warn=print)
    assert path == (tmp_path / LATEST).resolve()
    restore(resumed, checkpoint, path)
    for mine, theirs in ((resumed.model, trainer.model), (resumed.ema.module, trainer.ema.module)):
        assert all(torch.equal(value, whole(theirs)[name]) for name, value in whole(mine).items())
    moments = [
        [value.full_tensor() for value in entry.values() if value.dim()] for entry in trainer.optimizer.state.values()
    ]
    loaded = [
        [value.full_tensor() for value in entry.values() if value.dim()] for entry in resumed.optimizer.state.values()
    ]
    assert len(moments) == 8 and all(torch.equal(a, b) for pair in zip(moments, loaded) for a, b in zip(*pair))
    assert (resumed.start_epoch, resumed.start_step) == (0, 1)


def test_a_resume_with_other_parameter_groups_is_refused_in_one_line_naming_the_flags(group_of_one, tmp_path):
    """As a single file's: groups joined (--bias-weight-decay 0 left out) were loaded by name and went on with the
    biases decayed, exit 0; groups split were DCP's "Missing key" line, no flag named."""
    from common.checkpoint import _load_optimizer

    for saved, resumed in ((["--bias-weight-decay", "0"], []), ([], ["--bias-weight-decay", "0"])):
        out = tmp_path / str(len(saved))
        trained(out, *saved).save(0, 1)
        trainer = sharded_trainer(*BLOCKS, "--output-dir", out, *resumed)
        path, checkpoint = trainer._checkpoints.load_resume("auto", out, warn=print)
        with pytest.raises(UsageError, match=r"holds an optimizer with other parameter groups than this run's: resume"):
            _load_optimizer(trainer, checkpoint, path)
    _load_optimizer(sharded_trainer(*BLOCKS, "--output-dir", out, *saved), checkpoint, path)  # (as saved: loads)


def test_auto_falls_back_to_the_previous_checkpoint_when_the_latest_is_damaged(group_of_one, tmp_path):
    trainer = trained(tmp_path)
    trainer.save(1)
    trainer.save(2)
    (tmp_path / LATEST / "state.pth").write_bytes(b"cut short")
    warned = []
    path, checkpoint = trainer._checkpoints.load_resume("auto", tmp_path, warn=warned.append)
    assert path == (tmp_path / PREVIOUS).resolve() and checkpoint["epoch"] == 1
    assert warned and "resuming from the previous checkpoint" in warned[0]


def test_what_is_no_sharded_checkpoint_is_refused_in_one_line(group_of_one, tmp_path):
    trainer = trained(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="^--resume .*empty: no state.pth in it: give a sharded checkpoint's"):
        trainer._checkpoints.load_resume(str(tmp_path / "empty"), tmp_path, warn=print)
    with pytest.raises(UsageError, match="^--resume .*nothing: no such file or directory"):
        trainer._checkpoints.load_resume(str(tmp_path / "nothing"), tmp_path, warn=print)
    single = tmp_path / "single.pth"
    torch.save({"state_dict": whole(trainer.model), "format_version": 1}, single)
    with pytest.raises(
        UsageError, match="single.pth holds an optimizer state of a single-file checkpoint: train_fsdp.py"
    ):
        trainer._checkpoints.load_optimizer(trainer.model, trainer.optimizer, {}, single)


def test_the_export_is_a_plain_file_of_the_whole_weights_and_the_ema(group_of_one, tmp_path):
    trainer = trained(tmp_path)
    trainer._best_epoch = 1  # (as the epoch loop sets it)
    trainer.save(1, is_best=True)
    for exported in (
        torch.load(tmp_path / "model_best.pth", weights_only=True),
        export(tmp_path / LATEST, tmp_path / "exported.pth"),
    ):
        model = BlockNet(3)
        model.load_state_dict(exported["state_dict"])
        assert all(torch.equal(value, model.state_dict()[name]) for name, value in whole(trainer.model).items())
        model.load_state_dict(exported["model_ema"]["state_dict"])
        assert all(torch.equal(value, model.state_dict()[name]) for name, value in whole(trainer.ema.module).items())
        assert exported["arch"] == "tests.tiny_models:BlockNet" and "optimizer" not in exported
        assert exported["best_epoch"] == 1  # (as train_ddp.py's model_best.pth: was left out)


def test_an_export_of_a_checkpoint_mid_epoch_keeps_its_step_and_stays_weights_from_elsewhere(group_of_one, tmp_path):
    """Its step was dropped: "weights of epoch 1" and -e's "after 1 epoch(s)" for weights 2 steps further."""
    trainer = trained(tmp_path)
    trainer.save(1, step_in_epoch=2)
    exported = export(tmp_path / LATEST, tmp_path / "exported.pth")
    assert (exported["epoch"], exported["step_in_epoch"]) == (1, 2)
    assert not is_ours(exported)
    check_format(exported, tmp_path / "exported.pth")  # (not a checkpoint of an older format: passes)
    # To train on, refused (was: resumed at epoch 1's start, its 2 steps trained again with a new optimizer, exit 0).
    from common.run import load_agreed_checkpoint
    from common.trainer import Trainer
    from conftest import cpu_runtime, parse

    argv = (*BLOCKS, "--output-dir", tmp_path / "new", "--resume", tmp_path / "exported.pth")
    with pytest.raises(UsageError, match=r"exported without the optimizer, .*--init-from \S+exported\.pth$"):
        load_agreed_checkpoint(Trainer(parse(*argv), cpu_runtime()))
    assert load_agreed_checkpoint(Trainer(parse(*argv, "-e"), cpu_runtime()))[1]["step_in_epoch"] == 2  # (-e: taken)


def test_an_asynchronous_save_becomes_the_latest_once_written(group_of_one, tmp_path):
    trainer = trained(tmp_path, "--async-checkpoint")
    trainer.save(1)
    assert not (tmp_path / LATEST).exists() and trainer._checkpoints.pending is not None
    trainer._checkpoints.wait()
    assert str((tmp_path / LATEST).readlink()).startswith("sharded/e0001-s000000-")


def test_a_failed_write_says_so_and_leaves_the_checkpoints_there(group_of_one, tmp_path):
    trainer = trained(tmp_path)
    trainer.save(1)
    before = (tmp_path / LATEST).readlink()
    for folder in (tmp_path / "sharded").iterdir():  # sharded/ a file: no directory can be made in it
        folder.rename(tmp_path / folder.name)
    (tmp_path / "sharded").rmdir()
    (tmp_path / "sharded").write_text("in the way")
    with pytest.raises(
        CheckpointWriteError, match="^could not write a sharded checkpoint to .*the checkpoints already"
    ):
        trainer.save(2)
    assert (tmp_path / LATEST).readlink() == before


def test_a_best_epoch_whose_export_failed_is_exported_again_on_resume(group_of_one, tmp_path):
    """The links switched to the best epoch's checkpoint, its export to model_best.pth failed (a full disk): the line
    says so, and the resumed run exports it again (it stayed an older epoch for good before)."""
    trainer = trained(tmp_path)  # (one step; the schedule stands where trained epochs leave it)
    for _ in range(trainer.steps_per_epoch - 1):
        trainer.scheduler.step()
    trainer._best_acc1, trainer._best_epoch = 20.0, 1
    trainer.save(1, is_best=True)
    best = tmp_path / "model_best.pth"
    for _ in range(trainer.steps_per_epoch):
        trainer.scheduler.step()
    trainer._best_acc1, trainer._best_epoch = 25.0, 2
    kept = best.read_bytes()
    best.unlink()
    best.mkdir()  # model_best.pth cannot be replaced: the export fails, as on a full disk
    with pytest.raises(
        CheckpointWriteError,
        match=r"^could not export \S+ to model_best.pth \(Is a directory\); the "
        r"checkpoint itself is complete and --resume auto exports",
    ):
        trainer.save(2, is_best=True)
    best.rmdir()
    best.write_bytes(kept)  # the earlier best (epoch 1), as the failed export left it
    resumed = sharded_trainer(*BLOCKS, "--output-dir", tmp_path, "--resume", "auto")
    path, checkpoint = resumed._checkpoints.load_resume("auto", tmp_path, warn=print)
    said = []
    resumed.log.print = said.append
    restore(resumed, checkpoint, path)
    assert torch.load(best, weights_only=True)["epoch"] == 2
    assert said == [f"warning: {best} did not hold the best epoch 2: exported again from {path}"]


def test_resume_auto_refuses_the_other_kind_of_run_in_its_directory(group_of_one, tmp_path):
    """train_fsdp.py --resume auto where train_ddp.py's checkpoint.pth is, and train_ddp.py's where train_fsdp.py's
    checkpoint/ is: one line each, not a fresh start that would delete that run's files."""
    from common.checkpoint import CHECKPOINT, SingleFile

    trainer = trained(tmp_path)
    (tmp_path / "ddp").mkdir()
    torch.save({"state_dict": whole(trainer.model)}, tmp_path / "ddp" / CHECKPOINT)
    with pytest.raises(UsageError, match="holds a run of train_dp.py, train_ddp.py or train_spawn.py"):
        trainer._checkpoints.load_resume("auto", tmp_path / "ddp", warn=print)
    trainer.save(1)
    with pytest.raises(UsageError, match="holds a run of train_fsdp.py"):
        SingleFile().load_resume("auto", tmp_path, warn=print)


def test_a_fresh_start_refuses_the_other_kind_of_run_and_overwrite_deletes_both_kinds(group_of_one, tmp_path):
    """Without --overwrite, train_dp.py where train_fsdp.py's checkpoint/ is (a stop mid-epoch: no model_best.pth
    yet), and train_fsdp.py where train_dp.py's checkpoint.pth is: one line each. With it, a fresh start deletes
    both kinds and metrics/ (was: its own kind alone, so that a later --resume auto of the other script went on
    with the run that --overwrite was to delete, over the new one's log)."""
    from common.checkpoint import CHECKPOINT, SingleFile
    from common.logger import RunLogger
    from common.run import refuse_to_replace_a_run
    from conftest import parse

    trainer = trained(tmp_path)
    trainer.save(0, 1)
    argv = (*BLOCKS, "--output-dir", tmp_path)
    with pytest.raises(UsageError, match=r"holds a run of train_fsdp\.py \(checkpoint\): continue it with that script"):
        refuse_to_replace_a_run(parse(*argv), trainer.classes, SingleFile())
    (tmp_path / "ddp").mkdir()
    torch.save({"state_dict": whole(trainer.model)}, tmp_path / "ddp" / CHECKPOINT)
    with pytest.raises(UsageError, match=r"holds a run of train_dp\.py, train_ddp\.py or train_spawn\.py \(checkp"):
        refuse_to_replace_a_run(parse(*BLOCKS, "--output-dir", tmp_path / "ddp"), trainer.classes, trainer._checkpoints)
    refuse_to_replace_a_run(parse(*argv, "--overwrite"), trainer.classes, SingleFile())
    # --resume auto that found none of its own kind: its loader refused a checkpoint/ it could read, not one whose
    # link names no directory (it started afresh, and the fresh start deleted that run's checkpoint_prev/).
    (tmp_path / LATEST).resolve().rename(tmp_path / "moved")
    with pytest.raises(UsageError, match=r"holds a run of train_fsdp\.py \(checkpoint\): continue it with that script"):
        refuse_to_replace_a_run(parse(*argv, "--resume", "auto"), trainer.classes, SingleFile(), resumed=False)
    # --resume of another directory's checkpoint (resumed: loaded), here where train_fsdp.py's run is: refused too.
    shutil.copy(tmp_path / "ddp" / CHECKPOINT, tmp_path.parent / f"{tmp_path.name}-elsewhere.pth")
    elsewhere = ("--resume", tmp_path.parent / f"{tmp_path.name}-elsewhere.pth")
    with pytest.raises(UsageError, match=r"holds a run of train_fsdp\.py \(checkpoint\): continue it with that script"):
        refuse_to_replace_a_run(parse(*argv, *elsewhere), trainer.classes, SingleFile(), resumed=True)
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "val_epoch1.json").write_text("{}")
    for directory in (tmp_path, tmp_path / "ddp"):
        RunLogger(directory, prints=False, writes=True).start(parse(*argv, "--overwrite"), resumed=False)
    left = {path.name for path in tmp_path.iterdir()} | {path.name for path in (tmp_path / "ddp").iterdir()}
    assert not left & {"checkpoint", "checkpoint_prev", "sharded", "metrics", CHECKPOINT}, left


def damage(checkpoint, how):
    """Damage the sharded checkpoint at `checkpoint` (a link) as a crash of the storage or a bad disk would."""
    folder = checkpoint.resolve()
    shard = folder / "__0_0.distcp"
    if how == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "missing shard":
        shard.unlink()
    elif how == "missing .metadata":
        (folder / ".metadata").unlink()
    elif how == "16 flipped bytes":
        data = bytearray(shard.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 16] = bytes(byte ^ 0xFF for byte in data[middle : middle + 16])
        shard.write_bytes(bytes(data))
    elif how == "deleted directory":
        shutil.rmtree(folder)


DAMAGE = {
    "truncated shard": r"corrupt \(its __0_0\.distcp holds \d+ bytes of \d+\)",
    "missing shard": r"its __0_0\.distcp is unreadable \(No such file or directory\)",
    "missing .metadata": r"its \.metadata is unreadable \(No such file or directory\)",
    "16 flipped bytes": r"corrupt \(its __0_0\.distcp fails its CRC-32 check\)",
    "deleted directory": r"its directory sharded/e0002-s000000-\w+ is gone",
}


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_sharded_checkpoint_is_said_and_auto_resumes_from_the_one_before(group_of_one, tmp_path, how):
    """Each DCP file's size and CRC-32 are in state.pth and checked at the resume (DCP checks none: flipped bytes
    loaded as wrong weights, a missing file was a traceback cut at 300 characters); the checkpoint before is whole."""
    trainer = trained(tmp_path)
    trainer.save(1)
    trainer.save(2)
    named = tmp_path / LATEST
    damage(named, how)
    warned = []
    path, checkpoint = trainer._checkpoints.load_resume("auto", tmp_path, warn=warned.append)
    assert path == (tmp_path / PREVIOUS).resolve() and checkpoint["epoch"] == 1
    assert len(warned) == 1 and re.search(
        rf"^warning: cannot read checkpoint \S+/{LATEST}: {DAMAGE[how]}; resuming from "
        rf"the previous checkpoint \S+/{PREVIOUS}$",
        warned[0],
    ), warned
    resumed = sharded_trainer(*BLOCKS, "--output-dir", tmp_path / "resumed")
    resumed._checkpoints.load_weights(resumed.model, checkpoint, resumed.config.arch, resumed.classes, path)
    resumed._checkpoints.load_optimizer(resumed.model, resumed.optimizer, checkpoint, path)  # the one before: whole
    assert all(torch.equal(value, whole(trainer.model)[name]) for name, value in whole(resumed.model).items())
    if how != "deleted directory":  # named, it is refused in the same words
        with pytest.raises(UsageError, match=rf"^cannot read checkpoint \S+/{LATEST}: {DAMAGE[how]}$"):
            trainer._checkpoints.load_resume(str(named), tmp_path, warn=print)
        with pytest.raises(UsageError, match=DAMAGE[how]):
            export(named, tmp_path / "exported.pth")


def test_a_dcp_failure_is_one_line_that_names_the_rank_and_the_system_s_words(group_of_one, tmp_path):
    """What DCP raises (a CheckpointException with each rank's traceback) in one line: the first rank's error, an
    OSError by its message; a load of another shape too."""
    from torch.distributed.checkpoint.api import CheckpointException

    from common.sharded_checkpoint import _reason

    full = CheckpointException(
        "save failed",
        {1: (OSError(errno.ENOSPC, "No space left on device", "/x/.tmp"), None), 0: (ValueError("bad\nvalue"), None)},
    )
    assert _reason(full) == "rank 0: ValueError: bad value"
    assert (
        _reason(CheckpointException("", {1: (OSError(errno.ENOSPC, "No space left on device"), None)}))
        == "rank 1: No space left on device"
    )
    short = RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598")  # (another rank's:
    assert _reason(CheckpointException("", {1: (short, None)})) == (  # sent without the OSError it came from)
        "rank 1: a write fell short: no space left on the device, or a quota or file size limit reached"
    )
    trainer = trained(tmp_path)
    trainer.save(1)
    other = sharded_trainer(*BLOCKS, "--output-dir", tmp_path / "other", "--opt", "sgd")
    with pytest.raises(UsageError) as error:
        other._checkpoints.load_optimizer(other.model, other.optimizer, {}, tmp_path / LATEST)
    assert str(error.value).startswith(f"cannot load the optimizer of {tmp_path / LATEST}: rank 0: ")
    assert "\n" not in str(error.value) and "Traceback" not in str(error.value)


def test_a_full_disk_during_a_sharded_save_says_so_and_leaves_the_checkpoints_there(group_of_one, tmp_path):
    """A real full disk (a 2 MiB tmpfs, filled after the first save; it needs root, as mount does): the line says
    "No space left on device", the links stay on the checkpoint before, which resumes."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", disk], capture_output=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs could be mounted (it needs root): {mounted.stderr.decode().strip()}")
    try:
        trainer = trained(disk)
        trainer.save(1)
        before = (disk / LATEST).readlink()
        with open(disk / "filler", "wb") as filler:
            with pytest.raises(OSError, match="No space left"):
                while True:
                    filler.write(b"\0" * 65536)
                    filler.flush()
        with pytest.raises(
            CheckpointWriteError,
            match=r"^could not write a sharded checkpoint to \S+ \(rank 0: No space "
            r"left on device\); the checkpoints already there are intact$",
        ):
            trainer.save(2)
        (disk / "filler").unlink()
        assert (disk / LATEST).readlink() == before
        path, checkpoint = trainer._checkpoints.load_resume("auto", disk, warn=pytest.fail)
        assert checkpoint["epoch"] == 1
    finally:
        subprocess.run(["umount", "-l", disk], timeout=30)


def test_after_a_fallback_the_next_save_keeps_the_checkpoint_resumed_from_and_drops_the_damaged_one(
    group_of_one, tmp_path
):
    """The latest damaged, --resume auto took the one before: the next save makes that one checkpoint_prev (it made the
    damaged one checkpoint_prev and removed the good one)."""
    trainer = trained(tmp_path)
    trainer.save(1)
    trainer.save(2)
    good, damaged = (tmp_path / PREVIOUS).resolve(), (tmp_path / LATEST).resolve()
    damage(tmp_path / LATEST, "16 flipped bytes")
    path, _ = trainer._checkpoints.load_resume("auto", tmp_path, warn=lambda line: None)
    assert path == good
    trainer.save(2, 1)
    assert (tmp_path / PREVIOUS).resolve() == good and not damaged.exists()
    trainer.save(2, 2)  # and then as before
    assert (tmp_path / PREVIOUS).resolve() != good and not good.exists()


def test_both_links_dangling_are_no_checkpoint_and_an_unreadable_share_fails_the_save_in_one_line(
    group_of_one, tmp_path
):
    """sharded/ deleted: --resume auto finds no checkpoint (run.refuse_to_replace_a_run then says what is left), not
    an error about the link before. A file of the new checkpoint that cannot be read back fails the save on every
    rank in one line (a rank's OSError left the others waiting in the gather)."""
    from common.sharded_checkpoint import _checksums

    trainer = trained(tmp_path)
    trainer.save(1)
    trainer.save(2)
    shutil.rmtree(tmp_path / "sharded")
    assert trainer._checkpoints.load_resume("auto", tmp_path, warn=pytest.fail) == (None, None)
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "__0_0.distcp").symlink_to(tmp_path / "nowhere")
    with pytest.raises(
        CheckpointWriteError,
        match=r"^could not read back the sharded checkpoint \S+new \(No such file "
        r"or directory\); the checkpoints already there are intact$",
    ):
        _checksums(tmp_path / "new")


def test_export_checkpoint_refuses_an_out_that_is_not_a_file_of_its_own(group_of_one, tmp_path, capsys):
    """tools/export_checkpoint.py over the checkpoint it reads (its state.pth, or the `checkpoint` link replaced by a
    file) exited 0, and the run could no longer resume; an OUT in no folder was exit code 1; Ctrl-C a traceback; a
    pipe or a device (as root: /dev/null) became a file, a folder's name ending in / a file of that name, and a link
    was replaced by a file (now: its target written, the link kept)."""
    sys.path.insert(0, str(REPO / "tools"))
    import export_checkpoint

    trainer = trained(tmp_path / "run")
    trainer.save(1)
    latest = tmp_path / "run" / LATEST
    before = {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()}
    for out, line in (
        (
            latest / "state.pth",
            f"OUT {latest / 'state.pth'} lies inside a sharded checkpoint: write it elsewhere "
            "(the run resumes from there)",
        ),
        (latest, f"OUT {latest} is a folder (a link to one): give a file name"),
        (tmp_path, f"OUT {tmp_path} is a folder: give a file name"),
        (tmp_path / "no" / "model.pth", f"OUT {tmp_path / 'no' / 'model.pth'}: no folder {tmp_path / 'no'}"),
        (tmp_path / "loop", f"OUT {tmp_path / 'loop'} is a loop of links: give a file name"),
        (tmp_path / "pipe", f"OUT {tmp_path / 'pipe'} is not a file (a device, a pipe or a socket): give a file name"),
        (f"{tmp_path / 'new'}/", f"OUT {tmp_path / 'new'}/ ends in /, as a folder's name: give a file name"),
        (tmp_path / "dangling", f"OUT {tmp_path / 'dangling'}: no folder {tmp_path / 'gone'}"),
    ):
        if str(out).endswith("loop"):
            out.symlink_to("loop")  # (was a RuntimeError traceback)
        if str(out).endswith("pipe"):
            os.mkfifo(out)
        if str(out).endswith("dangling"):
            out.symlink_to(tmp_path / "gone" / "model.pth")
        assert export_checkpoint.main([str(latest), str(out)]) == 2
        assert capsys.readouterr().err.splitlines() == [f"error: {line}"]
    assert {path: path.read_bytes() for path in (tmp_path / "run").rglob("*") if path.is_file()} == before
    assert latest.is_symlink() and is_sharded(latest)

    def interrupted(file):
        file.write(b"half")
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "save", lambda state, file: interrupted(file))
        assert export_checkpoint.main([str(latest), str(tmp_path / "model.pth")]) == 130
    assert capsys.readouterr().err.splitlines() == [f"stopped: {tmp_path / 'model.pth'} not written"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["dangling", "loop", "pipe", "run"]  # no temporary
    (tmp_path / "model.pth").symlink_to("elsewhere.pth")
    assert export_checkpoint.main([str(latest), str(tmp_path / "model.pth")]) == 0
    assert (tmp_path / "model.pth").is_symlink() and (tmp_path / "elsewhere.pth").is_file()
    assert torch.load(tmp_path / "model.pth", weights_only=True)["epoch"] == 1
    hook, out = tmp_path / "hook", tmp_path / "signalled"  # SIGTERM while it writes, as a process (was: killed
    hook.mkdir()  # at once, its temporary left beside OUT)
    out.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, pathlib, time, torch\n_save = torch.save\n"
        "def slow(*args, **kwargs):\n    pathlib.Path(os.environ['READY']).touch()\n    time.sleep(60)\n"
        "    return _save(*args, **kwargs)\ntorch.save = slow\n"
    )
    env = clean_env(PYTHONPATH=hook, READY=tmp_path / "ready")
    process = subprocess.Popen(
        [PYTHON, REPO / "tools" / "export_checkpoint.py", latest, out / "model.pth"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        for _ in range(600):
            if (tmp_path / "ready").exists() or process.poll() is not None:
                break
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    assert process.returncode == 143 and output.splitlines()[-1:] == [f"stopped: {out / 'model.pth'} not written"], (
        output
    )
    assert list(out.iterdir()) == []


def test_a_single_file_s_weights_load_into_a_sharded_model_each_rank_copying_its_shard(group_of_one):
    """(_load_whole) Each parameter's shard from the whole file and the BatchNorm statistics, copied (DCP's full-state
    load refuses --cpu-offload's parameters in host memory beside the buffers on the GPU: gpu-check's row `fsdp
    cpu-offload -e of model_best.pth`); a key missing (a parameter's too) or too many, or another size, named."""
    from torch.distributed.fsdp import fully_shard

    from common.sharded_checkpoint import _load_whole
    from tests.tiny_models import NormBlockNet

    torch.manual_seed(1)
    source = NormBlockNet(3)
    for module in source.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(), module.running_var.uniform_(1, 2), module.num_batches_tracked.fill_(7)
    weights = source.state_dict()
    model = fully_shard(NormBlockNet(3))
    _load_whole(model, weights)
    loaded = {name: getattr(value, "full_tensor", lambda v=value: v)() for name, value in model.state_dict().items()}
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[name], weights[name]) for name in weights)
    buffer, parameter = (next(name for name in weights if name.endswith(end)) for end in ("running_var", ".weight"))
    wrong = {**weights, parameter: torch.zeros(1)}
    with pytest.raises(RuntimeError, match=rf"^missing key\(s\): {re.escape(buffer)}; unexpected key\(s\): extra; "):
        _load_whole(model, {**{k: v for k, v in weights.items() if k != buffer}, "extra": torch.zeros(1)})
    with pytest.raises(RuntimeError, match=rf"^missing key\(s\): -; .* size mismatch: {re.escape(parameter)} \[1\] "):
        _load_whole(model, wrong)
    with pytest.raises(RuntimeError, match=rf"^missing key\(s\): {re.escape(parameter)}; unexpected key\(s\): -; "):
        _load_whole(model, {k: v for k, v in weights.items() if k != parameter})

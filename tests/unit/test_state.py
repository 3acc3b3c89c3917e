"""common/state.py: the checkpoint format, assembled in one place from each part's state, with a version; restored
into a built trainer, a run stopped mid-epoch goes on bitwise as one that never stopped; what cannot go on as the
checkpoint's run is refused in one line; a checkpoint of an earlier format names the commit to finish it with."""
import csv

import pytest
import torch
import torchvision

from common import checkpoint, state
from common.errors import UsageError
from common.logger import MEASURED
from common.run import start_run
from common.trainer import Trainer
from conftest import built_trainer, cpu_runtime, parse
from examples.learned_temperature import LearnedTemperature
from tests.tiny_models import TinyNet

SMALL = ["--train-crop-size", "16", "--val-resize-size", "16", "--val-crop-size", "16", "-j", "0", "-p", "1",
         "-b", "4", "--seed", "1", "--lr", "0.05", "--dataset", "tests.custom_datasets:uint8_tensors"]
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


def log_rows(folder):
    with open(folder / "log.csv", newline="") as file:
        return [{name: value for name, value in row.items() if name not in MEASURED}
                for row in csv.DictReader(file)]


def test_a_run_stopped_mid_epoch_goes_on_bitwise_as_one_that_never_stopped(tmp_path):
    """Weights, optimizer, schedule, EMA, metric sums, random streams (dropout), mixing: every part's own state,
    put back by state.restore. 3 steps an epoch, a checkpoint every 2: the crash before step 5 resumes at step 4."""
    flags = [*SMALL, *TINY_NET, "--epochs", "2", "--checkpoint-interval", "2", "--dropout", "0.3", "--model-ema",
             "--model-ema-steps", "1", "--mixup-alpha", "0.2", "--lr-schedule", "cosine"]
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
    assert ends[0]["optimizer"]["state"][0]["momentum_buffer"].equal(ends[1]["optimizer"]["state"][0]["momentum_buffer"])
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
    flags = [*SMALL, *TINY_NET, "--epochs", "2", "--checkpoint-interval", "2", "--trainer",
             "examples.learned_temperature:LearnedTemperature", "--temperature-warmup", "2"]
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
    evaluated = started(*flags, "-e", "--resume", tmp_path / "whole" / "checkpoint.pth", "--output-dir", tmp_path / "e",
                        trainer=LearnedTemperature)  # -e's loss is the learned temperature's
    assert torch.equal(evaluated.criterion.log_temperature.detach(), ends[0]["criterion"]["log_temperature"])


class NumpyState(Trainer):
    def state_dict(self):
        import numpy
        return {"seen": numpy.float64(1.0)}


def test_a_trainer_state_that_a_resume_could_not_load_is_refused_at_the_first_save(tmp_path):
    trainer = built_trainer(*SMALL, *TINY_NET, "--output-dir", tmp_path, trainer=NumpyState)
    with pytest.raises(UsageError, match=r"^NumpyState.state_dict\(\) returned numpy\.\S+, which a resume cannot load "
                                         r"\(weights_only\): return plain data and tensors$"):
        state.assemble(trainer, epoch=1, step_in_epoch=0)


def test_a_checkpoint_holds_each_part_under_its_documented_key_and_loads_with_weights_only(tmp_path):
    trainer = built_trainer(*SMALL, *TINY_NET, "--model-ema", "--output-dir", tmp_path)
    saved = state.assemble(trainer, epoch=1, step_in_epoch=0)
    torch.save(saved, tmp_path / "c.pth")
    loaded = torch.load(tmp_path / "c.pth", weights_only=True)
    assert loaded["format_version"] == state.FORMAT_VERSION == 1
    assert {"epoch", "step_in_epoch", "arch", "num_classes", "classes", "seed", "world_size", "deterministic", "args",
            "samples", "state_dict", "optimizer", "scheduler", "scheduler_type", "scaler", "model_ema", "best_acc1",
            "best_ema_acc1", "best_epoch", "epoch_lr", "train_totals", "rng_states", "bad_images", "criterion",
            "trainer_state"} == set(loaded) - {"format_version"}
    assert loaded["scheduler"] == {"last_epoch": 0, "steps_per_epoch": 3} and loaded["samples"] == {"train": 12, "val": 6, "steps": 3}
    for key in ("state_dict", "model_ema"):
        plain = TinyNet(num_classes=3)
        plain.load_state_dict(loaded[key] if key == "state_dict" else loaded[key]["state_dict"])  # strict


def old_checkpoint(path, **changes):
    """A checkpoint as this repository wrote them up to commit fa90e47: no format_version, the parts' old keys."""
    torch.save({"epoch": 1, "step_in_epoch": 0, "arch": "tests.tiny_models:TinyNet", "classes": ["dark", "mid", "light"],
                "state_dict": TinyNet(num_classes=3).state_dict(), "rng_states": [], "train_totals": None,
                "checkpoint_id": "x", **changes}, path)
    return path


def test_a_checkpoint_of_an_earlier_format_is_refused_naming_the_commit_that_finishes_it(tmp_path):
    path = old_checkpoint(tmp_path / "old.pth")
    loaded = checkpoint.load_checkpoint(path)
    with pytest.raises(UsageError, match=rf"^{path} was written by an earlier version of these scripts \(checkpoint "
                                         r"format without a version; this one resumes format 1\): finish that run with "
                                         r"the version that wrote it \(git checkout fa90e47\), or start afresh"):
        state.check_format(loaded, path)
    with pytest.raises(UsageError, match="newer version"):
        state.check_format({**loaded, "format_version": 2}, path)
    state.check_format({**loaded, "format_version": 1}, path)


def test_weights_from_elsewhere_are_no_checkpoint_of_ours_and_pass(tmp_path):
    """pytorch/examples' main.py, a bare state_dict: not resumed runs of these scripts, their weights load."""
    examples = {"epoch": 5, "arch": "resnet18", "state_dict": torchvision.models.resnet18().state_dict(),
                "best_acc1": torch.tensor(40.0), "optimizer": {}}
    bare = {"state_dict": TinyNet(3).state_dict()}
    for foreign in (examples, bare):
        assert not state.is_ours(foreign)
        state.check_format(foreign, tmp_path / "x.pth")


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
    trainer = started(*SMALL, *TINY_NET, "--epochs", "1", "--checkpoint-interval", "1", "--output-dir", tmp_path,
                      trainer=StopsAt)
    with pytest.raises(Crash):
        trainer.fit(trainer.model, trainer.model)
    return tmp_path


@pytest.mark.parametrize("flags, line", [
    (["--opt", "adamw"], "was trained with --opt sgd: resume it with --opt sgd (its optimizer state is that optimizer's)"),
    (["--trainer", "examples.extra_metric:WithConfidence"],
     "was trained without --trainer: resume it so (a trainer's state and steps are its own)"),
    (["-b", "6"], "stopped part-way through an epoch with global batch 4: resume it with -b 4"),
    (["--bias-weight-decay", "0"], "holds an optimizer with other parameter groups than this run's: resume it as it was "
                                   "started, with no --norm-weight-decay and no --bias-weight-decay (and the same "
                                   "build_optimizer)"),
    (["--dataset", "tests.custom_datasets:pil_images"], None)])
def test_what_would_not_go_on_as_the_checkpoint_s_run_is_refused_in_one_line(one_epoch, flags, line):
    """Another optimizer or trainer, another batch mid-epoch, other parameter groups; the same data of another kind
    (PIL images, 12 of them: the same counts) goes on."""
    argv = [*SMALL, *TINY_NET, "--epochs", "2", "--output-dir", one_epoch, "--resume", "auto", *flags]
    if line is None:
        assert started(*argv).start_step == 2
        return
    with pytest.raises(UsageError) as refused:
        started(*argv)
    assert str(refused.value).endswith(line), str(refused.value)


def test_data_that_changed_is_refused_mid_epoch_and_named_at_an_epoch_s_end(one_epoch, tmp_path, capsys):
    more = ["--dataset", "tests.custom_datasets:more_uint8_tensors"]  # 15 training images, not 12
    with pytest.raises(UsageError, match=r"stopped part-way through an epoch of 12 training images; the data now "
                                         r"holds 15: the resumed epoch would skip other images"):
        started(*SMALL, *TINY_NET, "--epochs", "2", "--output-dir", one_epoch, "--resume", "auto", *more)
    whole_epoch = started(*SMALL, *TINY_NET, "--epochs", "1", "--output-dir", tmp_path / "end")
    whole_epoch.fit(whole_epoch.model, whole_epoch.model)
    resumed = started(*SMALL, *TINY_NET, *more, "--epochs", "2", "--output-dir", tmp_path / "end", "--resume", "auto")
    assert resumed.start_epoch == 1 and resumed.start_step == 0
    assert ("warning: the data changed since " in capsys.readouterr().out)


class TwoGroups(Trainer):
    """A backbone at a tenth of the head's lr: the researcher's own parameter groups."""

    def build_optimizer(self, model):
        *backbone, head = model
        return torch.optim.SGD([{"params": nn_parameters(backbone), "lr": self.config.lr / 10},
                                {"params": head.parameters()}], lr=self.config.lr, momentum=0.9)


def nn_parameters(modules):
    return [parameter for module in modules for parameter in module.parameters()]


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
    with pytest.raises(CheckpointWriteError, match=rf"^could not copy {tmp_path / 'checkpoint.pth'} to model_best.pth "
                                                   r"\(Is a directory\); the checkpoint itself is written and --resume "
                                                   r"auto writes model_best.pth again from it$"):
        trainer.save(2, is_best=True)
    best.rmdir()
    (tmp_path / "checkpoint_prev.pth").rename(best)  # what the failed copy left: the earlier best (epoch 1)
    latest = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    assert (latest["epoch"], latest["best_epoch"], latest["best_acc1"]) == (2, 2, 25.0)
    capsys.readouterr()
    resumed = started(*flags, "--resume", "auto")
    assert f"warning: {best} did not hold the best epoch 2: copied again from {tmp_path / 'checkpoint.pth'}" \
        in capsys.readouterr().out
    assert torch.load(best, weights_only=True)["checkpoint_id"] == latest["checkpoint_id"] and resumed._best_epoch == 2
    started(*flags, "--resume", "auto")  # model_best.pth is the best now: left alone
    assert "did not hold the best" not in capsys.readouterr().out
    best.unlink()
    best.mkdir()  # still no room for it: the resume goes on, saying so
    assert started(*flags, "--resume", "auto").start_epoch == 2
    assert f"warning: could not write model_best.pth again from {tmp_path / 'checkpoint.pth'} (" \
        in capsys.readouterr().out

"""common/run.py: starting a run in this process: a fresh start that would replace a run is refused in one line, -e
needs weights, a resumed run keeps its seed (saying so when another is given) and its determinism, a start that
fails before writing leaves no directory it made, and a Trainer holds its documented attributes alone, none of which a
subclass may assign; what the ranks of one job compare before they train (arguments, checkpoints) and the one line
that names the first difference."""

import functools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torchvision

from common import distributed
from common.errors import NoRoom, UsageError
from common.header import start_lines, warnings
from common.models import unwrap
from common.run import (
    argument_difference,
    check_start,
    comparable_args,
    ranks_text,
    resume_difference,
    resume_facts,
    start_run,
)
from common.trainer import Trainer
from conftest import cpu_runtime, parse
from harness.processes import resident_bytes_returned_at_fork

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
    "--lr",
    "0.05",
    "--dataset",
    "tests.custom_datasets:uint8_tensors",
    "-a",
    "tests.tiny_models:TinyNet",
]

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables


def started(*argv):
    return start_run(Trainer(parse(*SMALL, *argv), cpu_runtime()))


def trained(*argv):
    trainer = started(*argv)
    trainer.fit(trainer.model, trainer.model)
    return trainer


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of one epoch, seed 1 (its output dir)."""
    out = tmp_path_factory.mktemp("finished")
    trained("--epochs", "1", "--seed", "1", "--output-dir", out)
    return out


def test_a_fresh_start_in_the_directory_of_a_run_is_refused_and_costs_it_nothing(finished, tmp_path):
    before = {path.name: path.read_bytes() for path in finished.iterdir() if path.is_file()}
    with pytest.raises(
        UsageError,
        match=rf"^{re.escape(str(finished))} holds a run at epoch 1 step 0: continue it with "
        r"--resume auto, or start over with --overwrite \(its checkpoints are deleted\) "
        r"or another --output-dir$",
    ):
        started("--epochs", "2", "--output-dir", finished)
    with pytest.raises(
        UsageError,
        match=r"holds checkpoints of another run \(tests.tiny_models:TinyNet, 3 classes\): "
        r"choose another --output-dir",
    ):
        started("--epochs", "2", "--output-dir", finished, "--dataset", "tests.custom_datasets:two_classes")
    # Another directory's checkpoint resumed here (was accepted: its files replaced this run's, log.csv mixed both).
    elsewhere = tmp_path / "elsewhere.pth"
    elsewhere.write_bytes((finished / "checkpoint.pth").read_bytes())
    with pytest.raises(
        UsageError, match=r"holds a run at epoch 1 step 0, which --resume \S+elsewhere.pth would replace"
    ):
        started("--epochs", "2", "--output-dir", finished, "--resume", elsewhere)
    # With --overwrite, that directory's files start afresh (its log.csv kept the replaced run's rows before).
    shutil.copytree(finished, tmp_path / "replaced")
    trained("--epochs", "2", "--overwrite", "--output-dir", tmp_path / "replaced", "--resume", elsewhere)
    rows = (tmp_path / "replaced" / "log.csv").read_text().splitlines()[1:]
    assert [row.split(",")[0] for row in rows] == ["1"], rows

    # Trained to --epochs already, into another directory, with --overwrite or into a new one (was: "nothing to do",
    # then its summary.json written there beside the replaced run's files and log.csv's figures, or alone).
    def files(folder):  # (run.lock aside: a refused start took this process's own lock again)
        return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file() and path.name != "run.lock"}

    kept = files(tmp_path / "replaced")
    for flags in (["--overwrite", "--output-dir", tmp_path / "replaced"], ["--output-dir", tmp_path / "empty"]):
        with pytest.raises(
            UsageError,
            match=r"^--resume \S+elsewhere.pth stands at epoch 1 of --epochs 1: nothing to train in \S+; give "
            r"--epochs 2 or more to train it further, -e to evaluate it, or --init-from \S+ to start a new run",
        ):
            started("--epochs", "1", *flags, "--resume", elsewhere)
    assert not (tmp_path / "empty").exists()
    assert files(tmp_path / "replaced") == kept
    resumed = started("--epochs", "2", "--output-dir", finished, "--resume", finished / "checkpoint.pth")
    assert not any(line.startswith("note: the best acc@1 so far") for line in start_lines(resumed))
    # Into a directory of its own: its best epoch's model_best.pth is not there (summary.json and done: say its acc@1)
    lines = start_lines(started("--epochs", "2", "--output-dir", tmp_path / "new", "--resume", elsewhere))
    assert any(
        re.match(r"note: the best acc@1 so far, \S+, is the resumed run's, whose model_best.pth stays", line)
        for line in lines
    ), lines
    # (run.lock aside: in this process the lock is this process's own, so the refused starts took it again; a
    # second process is refused by the lock itself: test_cluster_faults.py, test_run_dir.py)
    assert {
        path.name: path.read_bytes() for path in finished.iterdir() if path.is_file() and path.name != "run.lock"
    } == {name: content for name, content in before.items() if name != "run.lock"}


def test_resume_auto_without_a_checkpoint_to_continue_does_not_replace_the_run_that_left_its_outputs(
    finished, tmp_path
):
    """Its checkpoints gone (deleted, a disk that lost them), the run's model_best.pth and summary.json are still worth
    keeping: --resume auto, finding nothing to continue, is refused as a fresh start would be, not started afresh over
    them. log.csv's rows alone do not count: an epoch's row may outlive its checkpoint (--async-checkpoint's save
    completes at the next one), and a relaunch then starts over."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    for name in ("checkpoint.pth", "checkpoint_prev.pth", "run.lock"):
        (out / name).unlink(missing_ok=True)
    before = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    assert {"model_best.pth", "log.csv", "summary.json"} <= before.keys()
    with pytest.raises(
        UsageError,
        match=rf"^--resume auto: {re.escape(str(out))} holds a run \(model_best.pth, "
        r"summary.json\) but no checkpoint to continue it from: start over with "
        r"--overwrite \(its outputs are replaced\) or another --output-dir$",
    ):
        started("--epochs", "2", "--resume", "auto", "--output-dir", out)
    assert {
        path.name: path.read_bytes() for path in out.iterdir() if path.is_file() and path.name != "run.lock"
    } == before
    (out / "model_best.pth").unlink()
    with pytest.raises(UsageError, match=r"holds a run \(summary.json\)"):  # a finished run's summary alone
        started("--epochs", "2", "--resume", "auto", "--output-dir", out)
    (out / "summary.json").unlink()
    assert (
        started("--epochs", "2", "--resume", "auto", "--output-dir", out).resumed_from is None
    )  # log.csv's rows alone
    assert started("--epochs", "2", "--resume", "auto", "--output-dir", finished).resumed_from is not None


def test_evaluate_needs_weights_to_evaluate(tmp_path):
    with pytest.raises(
        UsageError,
        match=r"^-e: no checkpoint in \S+ to evaluate \(--resume auto\): give --resume PATH, --init-from PATH "
        r"or --pretrained$",
    ):
        started("-e", "--resume", "auto", "--output-dir", tmp_path / "empty")
    with pytest.raises(
        UsageError,
        match=r"^-e evaluates the weights of --resume PATH, --init-from PATH or --pretrained: give one of them$",
    ):
        parse(*SMALL, "-e")


def test_evaluate_takes_the_weights_of_init_from_and_refuses_a_head_nothing_trained(finished, tmp_path):
    """-e --init-from FILE evaluates the file's weights (a torchvision references' checkpoint, whose Namespace --resume
    refuses, is evaluated so; was: refused). Weights of another class count: refused in one line (was: a head of new
    weights evaluated, its chance figures given, exit code 0)."""
    weights = torch.load(finished / "checkpoint.pth", weights_only=True)["state_dict"]
    evaluated = started("-e", "--init-from", finished / "checkpoint.pth", "--output-dir", tmp_path / "e1")
    assert all(torch.equal(value, weights[name]) for name, value in unwrap(evaluated.model).state_dict().items())
    torch.save({**weights, "12.weight": torch.zeros(5, 64), "12.bias": torch.zeros(5)}, tmp_path / "five.pth")
    with pytest.raises(UsageError, match=r"^-e of weights for other classes than the data's: the model's 12: 5 -> 3 "):
        started("-e", "--init-from", tmp_path / "five.pth", "--output-dir", tmp_path / "e2")


def test_evaluate_of_a_fine_tuned_pretrained_run_takes_its_checkpoint(tmp_path, monkeypatch):
    """The fine-tuning command with -e and the run's checkpoint: its weights, whose head was trained (was: refused,
    as the head --pretrained makes anew); without a checkpoint, refused."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(torchvision.models.resnet18().state_dict(), tmp_path / "home/hub/checkpoints/resnet18-f37072fd.pth")
    trained("-a", "resnet18", "--pretrained", "--epochs", "1", "--output-dir", tmp_path / "tuned")
    weights = torch.load(tmp_path / "tuned" / "checkpoint.pth", weights_only=True)["state_dict"]
    evaluated = started("-a", "resnet18", "--pretrained", "-e", "--resume", tmp_path / "tuned" / "checkpoint.pth")
    assert all(torch.equal(value, weights[name]) for name, value in unwrap(evaluated.model).state_dict().items())
    with pytest.raises(UsageError, match=r"^-e of weights for other classes than the data's: the model's fc: 1000 "):
        started("-a", "resnet18", "--pretrained", "-e", "--output-dir", tmp_path / "e")


def test_evaluate_with_model_ema_says_where_the_weights_have_no_ema(finished, tmp_path):
    """(was: the model's figures alone, without a word); a checkpoint with an EMA evaluates it, without the note."""
    plain = started("-e", "--model-ema", "--resume", finished / "checkpoint.pth", "--output-dir", tmp_path / "e1")
    assert f"note: --model-ema: {finished / 'checkpoint.pth'} has no EMA weights these scripts read" in warnings(plain)
    trained("--epochs", "1", "--model-ema", "--output-dir", tmp_path / "ema")
    averaged = started("-e", "--model-ema", "--resume", tmp_path / "ema" / "checkpoint.pth", "--output-dir", tmp_path)
    assert averaged.ema is not None and not any("no EMA weights" in line for line in warnings(averaged))


def test_resume_auto_that_finds_nothing_says_so_and_names_another_script_s_run_beside(tmp_path, capsys):
    """train_dp.py's run, then train_ddp.py --resume auto without --output-dir: the default names the script, so it
    started afresh in runs/ddp-... without a word. Now a note, naming the dp run that it can go on with. And the
    header's model line of a resumed run names no --init-from file (its weights are the checkpoint's)."""
    trained("--epochs", "1", "--output-dir", tmp_path / "dp-tiny-demo")
    capsys.readouterr()
    fresh = started("--epochs", "1", "--resume", "auto", "--output-dir", tmp_path / "ddp-tiny-demo")
    assert fresh.resumed_from is None
    assert (
        f"note: --resume auto found no checkpoint in {tmp_path / 'ddp-tiny-demo'}: a fresh start; "
        f"{tmp_path / 'dp-tiny-demo'} holds a run of another script: --output-dir {tmp_path / 'dp-tiny-demo'} "
        "--resume auto goes on with it"
    ) in capsys.readouterr().out.splitlines()
    started("--epochs", "1", "--resume", "auto", "--output-dir", tmp_path / "other")
    assert f"note: --resume auto found no checkpoint in {tmp_path / 'other'}: a fresh start" in capsys.readouterr().out
    # The weights a resumed run starts from are its checkpoint's: the model's line named --init-from's file.
    init = ("--init-from", tmp_path / "dp-tiny-demo" / "checkpoint.pth", "--epochs", "2", "--output-dir")
    fresh, resumed = started(*init, tmp_path / "init"), started(*init, tmp_path / "dp-tiny-demo", "--resume", "auto")
    assert any(line.startswith("model: tests.tiny_models:TinyNet from --init-from") for line in start_lines(fresh))
    assert not any("--init-from" in line for line in start_lines(resumed) if line.startswith("model:"))


def test_a_resume_keeps_the_checkpoint_s_seed_and_says_so_when_another_is_given(finished, tmp_path, capsys):
    """Seen once: --seed 2 resumed a --seed 1 run with no word, in another data order from then on."""
    out = tmp_path / "copy"
    out.mkdir()
    (out / "checkpoint.pth").write_bytes((finished / "checkpoint.pth").read_bytes())
    capsys.readouterr()
    resumed = started("--epochs", "2", "--seed", "2", "--resume", "auto", "--output-dir", out)
    assert resumed.seed == resumed.config.seed == 1  # (the config: what args.json says; was the ignored 2)
    assert re.search(
        r"^warning: --seed 2 ignored: \S+checkpoint\.pth was trained with seed 1, which this run keeps; "
        r"another seed is another run \(--overwrite or another --output-dir\)$",
        capsys.readouterr().out,
        re.MULTILINE,
    )


def test_a_resume_takes_the_weight_decay_and_momentum_its_flags_give(finished, tmp_path):
    """--wd and --momentum changed on a resume were silently the checkpoint's (args.json saying the new ones); the
    same flags keep the checkpoint's groups as they were (a trainer's own settings in them too)."""
    out = tmp_path / "copy"
    out.mkdir()
    (out / "checkpoint.pth").write_bytes((finished / "checkpoint.pth").read_bytes())
    groups = started("--epochs", "2", "--wd", "0.05", "--momentum", "0", "--resume", "auto", "--output-dir", out)
    assert [(group["weight_decay"], group["momentum"]) for group in groups.optimizer.param_groups] == [(0.05, 0.0)]
    checkpoint = torch.load(out / "checkpoint.pth", weights_only=True)
    checkpoint["optimizer"]["param_groups"][0]["weight_decay"] = 0.5  # as a trainer's own schedule of it would leave it
    torch.save(checkpoint, out / "checkpoint.pth")
    kept = started("--epochs", "2", "--resume", "auto", "--output-dir", out)
    assert [group["weight_decay"] for group in kept.optimizer.param_groups] == [0.5]


class Watched(Trainer):
    """Records at each step whether summary.json is there; raises at its step `stop_at` (counted from 1), as a kill
    would end the run there."""

    stop_at, seen = None, []

    def train_step(self, model, images, labels):
        Watched.seen.append((Path(self.config.output_dir) / "summary.json").exists())
        if len(Watched.seen) == Watched.stop_at:
            raise RuntimeError("stopped here")
        return super().train_step(model, images, labels)


def test_a_run_that_goes_on_has_no_summary_of_its_shorter_run_and_one_past_its_epochs_is_refused(finished, tmp_path):
    """A finished run resumed for more epochs kept the shorter run's summary.json until its end (and for ever, where
    it was stopped in the last epoch and relaunched: "nothing to do"); a checkpoint mid-epoch past a lowered --epochs
    wrote a summary of weights trained further than log.csv says: refused."""
    out = tmp_path / "copy"
    out.mkdir()
    for name in ("checkpoint.pth", "summary.json", "log.csv"):
        (out / name).write_bytes((finished / name).read_bytes())
    Watched.seen, Watched.stop_at = [], None
    run = start_run(Watched(parse(*SMALL, "--epochs", "2", "--resume", "auto", "--output-dir", out), cpu_runtime()))
    run.fit(run.model, run.model)
    assert Watched.seen and not any(Watched.seen)
    assert json.loads((out / "summary.json").read_text())["epochs"] == 2
    (out / "summary.json").write_bytes((finished / "summary.json").read_bytes())  # (a relaunch after a stop, say)
    trained("--epochs", "2", "--resume", "auto", "--output-dir", out)
    assert json.loads((out / "summary.json").read_text())["epochs"] == 2
    (out / "summary.json").unlink()  # written again by a relaunch with fewer --epochs: of the weights' 2
    trained("--epochs", "1", "--resume", "auto", "--output-dir", out)
    assert json.loads((out / "summary.json").read_text())["epochs"] == 2
    # Stopped at epoch 1 step 1 with its checkpoint, then relaunched with --epochs 1.
    Watched.seen, Watched.stop_at = [], run.steps_per_epoch + 2
    argv = (*SMALL, "--epochs", "2", "--checkpoint-interval", "1", "--output-dir", tmp_path / "past")
    run = start_run(Watched(parse(*argv), cpu_runtime()))
    with pytest.raises(RuntimeError, match="stopped here"):
        try:
            run.fit(run.model, run.model)
        finally:
            run._stop_signal.close()  # (the failed run's signal handlers: not this process's from now on)
    with pytest.raises(UsageError, match=r"stands at epoch 1 step 1, past --epochs 1: .* give --epochs 2 or more"):
        trained("--epochs", "1", "--resume", "auto", "--output-dir", tmp_path / "past")


def test_a_resumed_run_keeps_the_determinism_it_was_started_with(tmp_path):
    try:
        trained("--epochs", "1", "--deterministic", "--output-dir", tmp_path)
        assert torch.load(tmp_path / "checkpoint.pth", weights_only=True)["deterministic"] is True
        torch.use_deterministic_algorithms(False)
        resumed = started("--epochs", "2", "--resume", "auto", "--output-dir", tmp_path)
        assert resumed._deterministic and torch.are_deterministic_algorithms_enabled()
        assert resumed.config.deterministic is True  # (what args.json says: was False, the flag not given again)
    finally:
        torch.use_deterministic_algorithms(False)


def test_a_start_that_fails_before_writing_leaves_no_directory_it_made(tmp_path):
    with pytest.raises(UsageError, match="item 0 of the train set is a tuple of 3"):
        started("--dataset", "tests.custom_datasets:triples", "--output-dir", tmp_path / "new")
    assert not (tmp_path / "new").exists()


def documented_attributes():
    """The attribute names of docs/adapting.md's table "The attributes you may read"."""
    from harness.processes import REPO

    text = (REPO / "docs" / "adapting.md").read_text()
    table = text[text.index("### The attributes you may read") :].split("\n\n")[2]
    return {name for row in table.splitlines()[2:] for name in re.findall(r"`(\w+)`", row.split(" | ")[0])}


def test_a_trainer_holds_the_documented_attributes_and_private_ones_alone(tmp_path):
    """After a run and its resume (--model-ema: every part), what a Trainer holds is PUBLIC_ATTRIBUTES, each in
    docs/adapting.md's table, and PRIVATE_ATTRIBUTES: nothing else a subclass's name could collide with unseen."""
    from common.trainer import OWNED, PUBLIC_ATTRIBUTES

    trained("--epochs", "1", "--model-ema", "--output-dir", tmp_path)
    trainer = trained("--epochs", "2", "--model-ema", "--resume", "auto", "--output-dir", tmp_path)
    assert trainer.resumed_from is not None and set(vars(trainer)) <= OWNED, set(vars(trainer)) - OWNED
    assert {name for name in vars(trainer) if not name.startswith("_")} == set(PUBLIC_ATTRIBUTES)
    assert documented_attributes() == set(PUBLIC_ATTRIBUTES)


class Assigns(Trainer):
    """Assigns `name` in the hook `where` (build_model or train_step), and its own names, which are free."""

    name, where = "log", "build_model"

    def build_model(self, classes):
        self.data, self.metrics, self.rng = "mine", {}, None  # (the library's are private)
        if self.where == "build_model":
            setattr(self, self.name, None)
        return super().build_model(classes)

    def train_step(self, model, images, labels):
        if self.where == "train_step":
            setattr(self, self.name, None)
        return super().train_step(model, images, labels)


@pytest.mark.parametrize("name, where", [("log", "build_model"), ("seed", "train_step"), ("_data", "build_model")])
def test_a_subclass_that_assigns_an_attribute_the_trainer_holds_is_refused_in_one_line(tmp_path, name, where):
    from conftest import built_trainer, tensor_datasets

    flags = [*SMALL[:-4], "-a", "tests.tiny_models:TinyNet", "--output-dir", tmp_path, "--epochs", "1"]
    Assigns.name, Assigns.where = name, where
    with pytest.raises(
        UsageError,
        match=rf"^Assigns assigns self.{name}, which the Trainer holds for itself "
        r"\(docs/adapting.md lists its attributes\): give yours another name$",
    ):
        trainer = built_trainer(*flags, trainer=Assigns, datasets=tensor_datasets())
        trainer.train_one_epoch(trainer.model, 0)
    Assigns.where = "nowhere"
    trainer = built_trainer(*flags, trainer=Assigns, datasets=tensor_datasets())
    assert trainer.train_one_epoch(trainer.model, 0)["count"] == 12 and trainer.data == "mine"
    Assigns.where = (
        "build_model"  # through a __setattr__ of its own: still refused, and the library's own assignments not
    )
    with pytest.raises(UsageError, match=rf"^OwnSetattr assigns self.{name}, "):
        built_trainer(*flags, trainer=OwnSetattr, datasets=tensor_datasets())


class OwnSetattr(Assigns):
    def __setattr__(self, name, value):
        super().__setattr__(name, value)


def test_evaluate_takes_the_sizes_the_checkpoint_was_trained_at_flags_override_and_says_which_epoch(tmp_path):
    """-e --resume of a run trained at 20 px crops (resize 24) with label smoothing 0.3 and its own --mean/--std:
    validation at those sizes, that smoothing and normalisation, with the run's last acc@1 and loss (were -e's flags':
    no smoothing, ImageNet's mean); --val-crop-size overrides the crop alone, --label-smoothing the smoothing; the
    header names their source and the weights' epoch."""
    import csv

    from common.header import start_lines

    trained(
        "--epochs",
        "1",
        "--seed",
        "1",
        "--train-crop-size",
        "20",
        "--val-resize-size",
        "24",
        "--val-crop-size",
        "20",
        "--interpolation",
        "bicubic",
        "--label-smoothing",
        "0.3",
        "--mean",
        "0.3,0.4,0.5",
        "--std",
        "0.1,0.2,0.3",
        "--output-dir",
        tmp_path,
    )
    last = list(csv.DictReader(open(tmp_path / "log.csv")))[-1]
    unsized = [
        flag for i, flag in enumerate(SMALL) if not {flag, SMALL[i - 1]} & {"--val-resize-size", "--val-crop-size"}
    ]

    def evaluate(*argv):
        return start_run(Trainer(parse(*unsized, "-e", "--resume", tmp_path / "checkpoint.pth", *argv), cpu_runtime()))

    evaluating = evaluate()
    config = evaluating.config
    assert (config.val_resize_size, config.val_crop_size, config.val_interpolation) == (24, 20, "bicubic")
    lines = start_lines(evaluating)
    assert (
        "validation: resize 24, crop 20, bicubic, label smoothing 0.3 (resize, crop, interpolation, label smoothing, "
        "mean and std of the checkpoint's run; their flags override)"
    ) in lines, lines
    assert f"evaluating {tmp_path / 'checkpoint.pth'}: its weights after 1 epoch(s)" in lines, lines
    assert not any(line.startswith("preset:") and "val " in line for line in lines), lines  # (not the preset's sizes)
    result = evaluating.evaluate(evaluating.model)
    assert (result["acc1"], result["loss"]) == pytest.approx((float(last["val_acc1"]), float(last["val_loss"])))
    assert evaluate("--label-smoothing", "0").criterion.label_smoothing == 0.0
    config = evaluate("--val-crop-size", "16").config
    assert (config.val_resize_size, config.val_crop_size, config.val_interpolation) == (24, 16, "bicubic")
    assert config.val_preprocessing == "resize, interpolation, label smoothing, mean and std of the checkpoint's run"
    with pytest.raises(UsageError, match=r"--val-crop-size 32 is larger than --val-resize-size 24: .*the checkpoint's"):
        evaluate("--val-crop-size", "32")  # (was evaluated: the checkpoint's resize, the crop padded with black)


def test_a_start_that_found_no_room_ends_every_rank_with_exit_code_1():
    """check_start shares a rank's error with every rank: a full disk's stays NoRoom (exit code 1, not bad input)."""
    config = parse(*SMALL)
    with pytest.raises(NoRoom, match="^no room here$"):
        check_start(config, NoRoom("no room here"))
    with pytest.raises(UsageError, match="^bad$") as refused:
        check_start(config, UsageError("bad"))
    assert type(refused.value) is UsageError


def test_the_ranks_text_and_the_first_difference():
    assert ranks_text([3]) == "rank 3"
    assert ranks_text([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"
    same = {"batch_size": 8, "lr": 0.1, "output_dir": "x"}
    assert argument_difference([same, dict(same)]) is None
    line = argument_difference([same, same, {**same, "lr": 0.2}, {**same, "lr": None}])
    assert "--lr is 0.1 on ranks 0-1, 0.2 on rank 2, unset on rank 3;" in line
    fresh = resume_facts(None, None)
    loaded = resume_facts(Path("a/checkpoint.pth"), {"epoch": 2, "seed": 1, "checkpoint_id": "x"})
    assert resume_difference([loaded, dict(loaded)]) is None
    assert resume_difference([fresh, fresh]) is None
    assert "a/checkpoint.pth (epoch 2, seed 1) on rank 0, no checkpoint (a fresh start) on rank 1" in resume_difference(
        [loaded, fresh]
    )
    assert resume_difference([loaded, {**loaded, "id": "y"}]) is not None  # same place, other bytes


def test_the_per_node_arguments_may_differ(no_platform_env):
    node = [parse("--data", f"/d{k}", "--output-dir", f"/n{k}", "-j", k) for k in (0, 1)]
    assert argument_difference([comparable_args(config) for config in node]) is None
    node[1] = node[1].replace(lr=0.2)
    assert (
        "--lr is 0.1 on rank 0, 0.2 on rank 1; every process takes the same ones (only --workers, --data and "
        "--output-dir may differ between nodes)"
    ) in argument_difference([comparable_args(config) for config in node])


@pytest.mark.skipif(distributed.glibc_malloc() is None, reason="glibc's malloc alone has these settings")
def test_a_run_on_the_cpu_keeps_the_memory_its_steps_free_and_returns_it_before_a_fork(monkeypatch):
    """start_run sets it (distributed.keep_freed_host_memory; the memory kept and returned: tests/unit/
    test_distributed.py): 80 MB freed is still resident until the process forks; the header says so.
    --no-keep-freed-memory: not set."""
    for name in ("GLIBC_TUNABLES", *distributed.MALLOC_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    assert not started("--no-keep-freed-memory").runtime.host_memory_kept  # (not set by that run: the header's)
    trainer = started()
    assert trainer.runtime.host_memory_kept and resident_bytes_returned_at_fork() > 40 << 20
    assert start_lines(trainer)[0].endswith(
        ", freed memory kept for the next step (--no-keep-freed-memory: glibc's defaults)"
    )


def test_an_epoch_whose_last_batch_is_a_single_image_trains_a_batchnorm_model_without_it(tmp_path, capsys):
    """Seen: 12 images at -b 11 ended the epoch in a traceback ("Expected more than 1 value per channel when
    training": resnet18's last BatchNorm sees 1x1 activations of one image) on every epoch of every resume."""
    trainer = trained("-a", "resnet18", "-b", "11", "--epochs", "1", "--output-dir", tmp_path / "out")
    assert trainer.steps_per_epoch == 1
    assert (
        "last batch: each epoch's last 1 image per process is not trained on: a device would have a single image, and "
        "BatchNorm fails on one where it sees 1x1 activations (the model has BatchNorm layers)"
    ) in capsys.readouterr().out.splitlines()
    assert (tmp_path / "out" / "log.csv").read_text().splitlines()[1].startswith("0,")
    assert (
        trained("-b", "11", "--epochs", "1", "--output-dir", tmp_path / "tiny").steps_per_epoch == 2
    )  # (no BatchNorm)
    assert "last batch: " not in capsys.readouterr().out


class LogUnwritableInTraining(Trainer):
    """log.csv replaced by a folder during the first step: the epoch's row cannot be written."""

    def train_step(self, model, images, labels):
        log = Path(self.config.output_dir) / "log.csv"
        if log.is_file():
            log.unlink()
            log.mkdir()
        return super().train_step(model, images, labels)


def test_an_epoch_s_row_of_log_csv_is_written_before_its_checkpoint(tmp_path):
    """Seen: the checkpoint written, then a failed write (model_best.pth on a full disk) or a kill before log.csv's
    row: the resumed run went on from the checkpoint, and the epoch's row was lost for good. The row now comes first:
    where it cannot be written, the checkpoint is not either, and a resume trains that epoch again."""
    trainer = start_run(
        LogUnwritableInTraining(parse(*SMALL, "--epochs", "1", "--output-dir", tmp_path), cpu_runtime())
    )
    with pytest.raises(IsADirectoryError):
        trainer.fit(trainer.model, trainer.model)
    assert not (tmp_path / "checkpoint.pth").exists()


def test_a_subclass_that_replaces_a_method_of_the_library_is_warned_of_by_name():
    """A helper of one's own named `save` turned every checkpoint off, exit 0: the header names each of the Trainer's
    own methods (not its HOOKS, those of its section "the parts a researcher changes") that a subclass replaces."""
    import inspect

    from common.run import library_replaced
    from common.trainer import HOOKS
    from examples.sam import SAM

    source, start = inspect.getsourcelines(Trainer)
    first, last = (next(i for i, line in enumerate(source) if marker in line) for marker in ("researcher", "building"))
    starts = {
        name: inspect.getsourcelines(getattr(method, "__func__", method))[1] - start
        for name, method in vars(Trainer).items()
        if callable(getattr(method, "__func__", method)) and not name.startswith("__")
    }
    assert {name for name, start in starts.items() if first < start < last} == set(HOOKS)
    assert library_replaced(SAM) == []  # (hooks alone: build_optimizer, optimizer_step)
    helper = type("Helper", (Trainer,), {"save": lambda self, images: None, "build_model": Trainer.build_model})
    assert library_replaced(helper) == [
        "warning: Helper replaces the Trainer's own save (not hooks: the loops call them; docs/adapting.md): the "
        "tests no longer cover this run; give a method of your own another name"
    ]

    # A hook's name misspelt (was: never called, the default trained, without a word)
    def logged(function):  # (a decorator: the method is its wrapper, whose own code calls no build_transform)
        @functools.wraps(function)
        def wrapper(*args):
            return function(*args)

        return wrapper

    class Misspelt(SAM):
        def build_optimiser(self, model):  # (its own code naming it: still warned of)
            return self.build_optimiser(model)

        def build_dataset(self, split): ...  # (a helper of its own, which its build_datasets calls: no warning)

        def build_metric(self): ...  # (called by name from a property)

        def build_transform(self): ...  # (called from a decorated method)

        def build_datasets(self):
            return self.build_dataset("train"), self.build_dataset("val")

        @property
        def metric(self):
            return getattr(self, "build_metric")()

        @logged
        def build_transforms(self, train, val):
            return self.build_transform()

    assert library_replaced(Misspelt) == [
        "warning: Misspelt.build_optimiser is not a hook, and nothing calls it: did you mean build_optimizer?"
    ]

    class Extended(Misspelt):  # (its build_datasets calls the parent's, which calls build_dataset: no warning)
        def build_datasets(self):
            return super().build_datasets()

    assert library_replaced(Extended) == [
        "warning: Extended.build_optimiser is not a hook, and nothing calls it: did you mean build_optimizer?"
    ]


def test_a_restart_goes_on_from_its_own_job_s_checkpoint_alone(tmp_path, monkeypatch):
    """torchrun's restart, or a Slurm requeue, of a command with --overwrite goes on from the directory's checkpoint
    where that is its job's (was: began again at epoch 0, deleting it); another job's (another torchrun in the same
    Slurm allocation, say) is left to the command's --overwrite."""
    from common.checkpoint import assemble, save_checkpoint
    from common.run import going_on_after_a_restart
    from conftest import built_trainer

    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    flags = [*SMALL, "--output-dir", tmp_path, "--overwrite"]
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setattr(distributed, "TORCHRUN_JOB", ["torchrun a"])  # (what init_process_group gets from the agent)
    trainer = built_trainer(*flags)
    save_checkpoint(assemble(trainer, epoch=1, step_in_epoch=0), tmp_path, is_best=False)
    assert going_on_after_a_restart(trainer).overwrite  # a first start: as the command says
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setattr(distributed, "TORCHRUN_JOB", ["torchrun b"])  # another torchrun, the same allocation
    assert going_on_after_a_restart(trainer).overwrite
    monkeypatch.setattr(distributed, "TORCHRUN_JOB", ["torchrun a"])
    again = going_on_after_a_restart(trainer)
    assert (again.resume, again.overwrite) == ("auto", False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeue: new torchruns, the same Slurm job
    monkeypatch.setattr(distributed, "TORCHRUN_JOB", ["torchrun c"])
    assert going_on_after_a_restart(trainer).resume == "auto"

"""common/cli.py: the shared flags, each script's own, a --trainer's own flags, and --help and usage errors that come
before torch is imported."""

import subprocess

import pytest

from common import cli
from common.errors import UsageError
from conftest import parse
from harness.processes import PYTHON, REPO, clean_env

pytestmark = pytest.mark.usefixtures("no_platform_env")  # conftest: none of the platform variables

SCRIPTS = ["train_dp.py", "train_ddp.py", "train_spawn.py"]
CASES = [(["--help"], 0), (["--epochs", "x"], 2), (["--epochs", "0"], 2), (["-j", "-1"], 2)]
# Runs each script as `python SCRIPT ARGS` would, in one interpreter that never imports torch itself, and reports
# for each whether torch was imported on the way.
PROBE = """import io, runpy, sys, contextlib
for script, argv in CASES:
    sys.argv = [script, *argv]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            runpy.run_path(script, run_name='__main__')
        except SystemExit as end:
            code = end.code
    print(script, argv, 'exit', code, 'torch imported:', 'torch' in sys.modules)
"""


def test_help_and_usage_errors_come_before_torch_is_imported():
    cases = [(str(REPO / script), argv) for script in SCRIPTS for argv, _ in CASES]
    result = subprocess.run(
        [PYTHON, "-c", f"CASES = {cases!r}\n{PROBE}"],
        cwd=REPO,
        env=clean_env(),
        timeout=120,
        capture_output=True,
        text=True,
    )
    expected = [
        f"{REPO / script} {argv} exit {code} torch imported: False" for script in SCRIPTS for argv, code in CASES
    ]
    assert result.stdout.splitlines() == expected, result.stdout + result.stderr


def test_the_data_directory_is_a_flag_or_a_positional_argument_and_its_help_names_the_split_files():
    assert parse("/some/imagenet").data == "/some/imagenet"
    with pytest.raises(UsageError, match="give the data directory once"):
        parse("/a", "--data", "/b")
    assert "train.csv and val.csv" in " ".join(cli.build_parser("test").format_help().split())


def test_flag_values_that_are_no_values_are_one_line_and_exit_2(capsys):
    for argv, line in [
        (["-j", "x"], "argument -j/--workers: expected auto or a whole number, got 'x'"),
        (["--mean", "a,b"], "argument --mean: expected numbers separated by commas, got 'a,b'"),
        (["--epochs", "1.5"], "argument --epochs: invalid int value: '1.5'"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ]:
        with pytest.raises(SystemExit) as ended:
            parse(*argv)
        assert ended.value.code == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and line in error and error.endswith("(see --help)\n"), error


def test_channels_last_alone_means_on_and_workers_take_auto_or_a_count():
    assert parse().channels_last == "auto" and parse("--channels-last").channels_last == "on"
    assert parse("--channels-last", "off").channels_last == "off"
    assert parse().workers == "auto" and parse("-j", "2").workers == 2


def test_a_trainer_s_own_flags_join_the_command_line_and_its_config():
    config = parse("--trainer", "examples.distillation:Distillation", "--teacher", "t.pth", "--distill-alpha", "0.3")
    assert (config.teacher, config.teacher_arch, config.distill_alpha) == ("t.pth", "resnet50", 0.3)
    with pytest.raises(UsageError, match="--trainer examples.nothing:Here: cannot import Here from examples.nothing"):
        parse("--trainer", "examples.nothing:Here")
    with pytest.raises(
        UsageError,
        match=r"^--trainer tests.tiny_models:FlagClash's add_arguments: argument --warmup-epochs: conflicting option "
        r"string: --warmup-epochs: give yours another name$",
    ):
        parse("--trainer", "tests.tiny_models:FlagClash")
    assert parse("--trainer", "tests.tiny_models:EmptyDefault", "--tag", "").tag == ""  # (its own: not refused)


@pytest.mark.parametrize(
    "trainer, flag, value, says",
    [
        ("examples.distillation:Distillation", "--distill-temperature", "0", "0 is not in (0, 1000]"),  # (was: NaN)
        ("examples.sam:SAM", "--sam-rho", "-0.5", "-0.5 is not in [0, 10]"),  # (was: a step down the gradient)
        ("examples.own_augmentation:Rotation", "--rotation", "-5", "-5 is not in [0, 180]"),  # (was: a traceback)
        ("examples.layerwise_lr:LayerwiseLr", "--backbone-lr-factor", "nan", "nan is not in [0, 1]"),
    ],
)
def test_the_examples_own_flags_are_checked_in_one_line(capsys, trainer, flag, value, says):
    extra = ["--teacher", "t.pth"] if "distillation" in trainer else []
    with pytest.raises(SystemExit) as ended:
        parse("--trainer", trainer, *extra, flag, value)
    error = capsys.readouterr().err
    assert ended.value.code == 2 and f"argument {flag}: {says}" in error and error.count("\n") == 1, error

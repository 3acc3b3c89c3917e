"""The documentation's commands and links cannot go stale.

Every command line in README.md and docs/*.md (fenced code blocks and inline code) that starts one of
the scripts is parsed with that script's own argument parser, in this process, without training:

- `python train_{dp,ddp,spawn,fsdp}.py ARGS`: `parse_args(ARGS)` of that script must accept them.
- `torchrun OPTIONS train_ddp.py ARGS` and `python -m torch.distributed.{run,launch} OPTIONS train_ddp.py ARGS`:
  OPTIONS must parse with the launcher's own parser, and ARGS with train_ddp.py's.
- `run_scripts/NAME ARGS` and `tools/NAME ARGS` (also after `bash`, `sbatch OPTIONS`, `srun`): the script
  must exist. A shell launcher passes ARGS on to the one train_*.py it starts, so ARGS must parse with
  that script's parser; for `python tools/NAME.py ARGS`, every option in ARGS must be one its argparse
  defines.
- `make TARGET`: the Makefile must have that target.
- `torchrun OPTIONS --no-python ...` (no train script): OPTIONS must parse.

Every option must be spelled exactly as the parser defines it: argparse would also take a unique
prefix (`--epoch` for `--epochs`), which is a misspelling in a document.

How a command line is read: a `\\` at the end of a line continues it; quotes may span lines; `# ...`
ends it; `;`, `&&`, `||`, `|`, `&` separate commands; a leading `$ ` prompt, `do`, `then`, `time`,
`exec` are dropped, and so are leading `NAME=value` assignments, which become the environment of the
parse (the platform variables EPOCHS, LR, DATASETS_PATH... set defaults). Apart from those, each
command is parsed in an EMPTY environment, so that variables of the shell running the tests do not
change what is checked. In a ```text (or console, output) block, which holds output or a file
listing, only the lines after a `$ ` prompt are commands; ```python blocks are not read. A `...` argument ("the rest, as
above") is dropped. Shell variables are replaced by the example values in SHELL_VARIABLES below: a command that uses
another one fails this test until it is added there. Paths such as /data/imagenet need not exist: parse_args does not
look at the file system (it checks values and the --arch name, not --data or --resume).

Some documented commands are examples of errors; EXPECTED_TO_FAIL lists them, and they must fail.

The second half checks the links of the same files: a relative link must name an existing file, and a
`#anchor` must be a heading of the file it points to (GitHub's anchors). Every path into the repository's
folders (common/, docs/, run_scripts/, tools/, tests/) that the files name anywhere, in prose, inline
code or any code block (file listings included), must exist.

The `python -c` snippets of README.md and docs/*.md are run, one after the other in one process (a
few seconds in all): the README's answers to the twelve questions rely on them.
"""

import ast
import contextlib
import functools
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

import common.cli as cli  # conftest puts the repository on sys.path
from common.errors import UsageError
from harness.processes import REPO, clean_env

pytestmark = pytest.mark.e2e

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# Example values for the shell variables that documented commands use.
SHELL_VARIABLES = {
    "PWD": str(REPO),
    "node": "0",  # for node in 0 1; do torchrun --node-rank=$node ...
    "amp": "bf16",  # for amp in none bf16 fp16; do ... --amp $amp
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_ID": "1234",
    "NPROC_PER_NODE": "4",  # inside the sbatch scripts
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}

# Documented on purpose as errors: (script, arguments) that must be refused.
EXPECTED_TO_FAIL = {
    ("train_dp.py", ("--epochs", "0")),
    ("train_dp.py", ("--no-such-flag",)),
}

TRAIN_SCRIPT = re.compile(r"(?:^|/)(train_(?:dp|ddp|spawn|fsdp)\.py)$")
PYTHON = re.compile(r"(?:^|/)python(?:3(?:\.\d+)?)?$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", ";;"}
DROPPED_WORDS = {"$", "do", "then", "else", "time", "exec", "done", "fi"}
# A script of the repository's run_scripts/ (launchers) or tools/, also as ./tools/... or $PWD/tools/...,
# but not setuptools/.
SCRIPT_FOLDER = re.compile(r"(?<![\w.-])(?:run_scripts|tools)/")
CANDIDATE = re.compile(
    rf"train_(?:dp|ddp|spawn|fsdp)\.py|{SCRIPT_FOLDER.pattern}|torchrun|torch\.distributed\.(?:run|launch)"
    r"|\bmake\b|python3? -c"
)
# A path into one of the repository's folders, as the documents name them (run_scripts/single_node_{dp,ddp}.sh,
# docs/*.md); not a part of a longer path (/usr/share/docs/...) or of a URL.
REPO_PATH = re.compile(r"(?<![\w./$-])(?:common|docs|run_scripts|tools|tests)/[\w.{},/*-]*")


# ---------------------------------------------------------------- reading the documents


class Command:
    def __init__(self, source, tokens, text):
        self.source, self.tokens, self.text = source, tokens, text

    def __repr__(self):
        return f"{self.source}: {self.text.strip()[:200]}"


def fenced_blocks_and_prose(text):
    """(line number, code block text, language) for each fenced block, and the prose with blocks blanked."""
    blocks, prose, inside, language, start, body = [], [], False, "", 0, []
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*(```+|~~~+)\s*([\w+-]*)", line)
        if fence and not inside:
            inside, language, start, body = True, fence.group(2), number + 1, []
            prose.append("")
        elif fence and inside:
            inside = False
            blocks.append((start, "\n".join(body), language))
            prose.append("")
        elif inside:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return blocks, prose


def inline_code(prose_lines):
    """(line number, text) of each `inline code` span of the prose."""
    for number, line in enumerate(prose_lines, 1):
        for match in re.finditer(r"(`+)(.+?)\1", line):
            yield number, match.group(2).strip()


def balanced(text):
    try:
        shlex.split(text)
        return True
    except ValueError:
        return False


def logical_lines(block):
    """(offset of the first line, text) per command line: `\\` continuations joined, and quotes that
    span lines kept together (for lines that may hold a command)."""
    lines = block.splitlines()
    i = 0
    while i < len(lines):
        first, text = i, lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i]
        if CANDIDATE.search(text) and not balanced(text):
            j, joined = i, text
            while not balanced(joined) and j + 1 < len(lines):
                j += 1
                joined += "\n" + lines[j]
            if balanced(joined):
                i, text = j, joined
        yield first, text
        i += 1


def tokenize(text):
    try:
        lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, ""
        tokens = list(lexer)
    except ValueError:  # prose with an apostrophe in a text block: not a command
        tokens = text.split()
    for index, token in enumerate(tokens):
        if token.startswith("#"):
            return tokens[:index]
    return tokens


def simple_commands(tokens):
    """Split at ; && || | & ( ) and drop the shell words that only introduce a command."""
    command = []
    for token in tokens + [";"]:
        if token in SEPARATORS:
            while command and command[0] in DROPPED_WORDS:
                command.pop(0)
            if command:
                yield command
            command = []
        else:
            command.append(token)


def documented_commands():
    commands = []
    for path in DOCS:
        name = path.relative_to(REPO)
        blocks, prose = fenced_blocks_and_prose(path.read_text())
        pieces = [
            (start + offset, text)
            for start, block, language in blocks
            if language not in ("python", "py")
            for offset, text in logical_lines(block)
            # In a block of output or a file listing, only the lines after a `$ ` prompt are commands.
            if language not in ("text", "console", "output") or text.lstrip().startswith("$ ")
        ]
        pieces += list(inline_code(prose))
        for number, text in pieces:
            if not CANDIDATE.search(text):
                continue
            for tokens in simple_commands(tokenize(text)):
                commands.append(Command(f"{name}:{number}", tokens, text))
    return commands


COMMANDS = documented_commands()


# ---------------------------------------------------------------- checking one command


class Invalid(Exception):
    pass


def substitute(token):
    def value(match):
        name = match.group(1) or match.group(2)
        if name not in SHELL_VARIABLES:
            raise Invalid(
                f"shell variable ${name} has no example value: add one to SHELL_VARIABLES in {Path(__file__).name}"
            )
        return SHELL_VARIABLES[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, token)


@contextlib.contextmanager
def environment(assignments):
    """os.environ holding only `assignments` (NAME=value strings), restored afterwards."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(dict(substitute(item).split("=", 1) for item in assignments))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def check_option_names(tokens, options, where):
    """Every option among `tokens` is one of `options` (name -> whether it takes a value), spelled out."""
    skip = False
    for token in tokens:
        if skip:
            skip = False
            continue
        if not token.startswith("-") or token == "-" or re.fullmatch(r"-\d[\d.e-]*", token):
            continue
        name = token.split("=", 1)[0]
        if name not in options and not (not token.startswith("--") and token[:2] in options and options[token[:2]]):
            close = [option for option in options if option.startswith(name) or name.startswith(option)]
            hint = f" (did you mean {', '.join(sorted(close))}?)" if close else ""
            raise Invalid(f"{where} has no option {name}{hint}")
        skip = options.get(name, False) and "=" not in token  # its value is the next token


def parser_options(parser):
    return {option: action.nargs != 0 for option, action in parser._option_string_actions.items()}


@functools.lru_cache(maxsize=None)
def training_script(name):
    __import__(name[:-3])
    return sys.modules[name[:-3]]


def parse_training_args(script, args, assignments=()):
    """parse_args(args) of train_*.py `script` in an environment holding only `assignments`."""
    module = training_script(script)
    args = [substitute(arg) for arg in args if arg != "..."]
    parsers = []
    real_parse = cli.parse_args

    def recording_parse(parser, argv=None, mode="dp"):
        parsers.append(parser)
        return real_parse(parser, argv, mode)

    stderr = io.StringIO()
    with (
        environment(assignments),
        mock.patch.object(cli, "parse_args", recording_parse),
        contextlib.redirect_stderr(stderr),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            module.parse_args(args)
        except SystemExit as exit:
            if exit.code not in (0, None):  # --help exits 0
                raise Invalid(f"{script} {' '.join(args)}: {stderr.getvalue().strip()}") from None
        except UsageError as error:
            raise Invalid(f"{script} {' '.join(args)}: error: {error}") from None
    check_option_names(args, parser_options(parsers[0]), script)


@functools.lru_cache(maxsize=None)
def launcher_parser(module):
    if module == "torch.distributed.launch":
        from torch.distributed.launch import get_args_parser
    else:
        from torch.distributed.run import get_args_parser
    return get_args_parser()


def parse_launcher_args(module, options, script="train_ddp.py"):
    options = [substitute(option) for option in options if option != "..."]
    parser = launcher_parser(module)
    stderr = io.StringIO()
    with environment(()), contextlib.redirect_stderr(stderr):
        try:
            parser.parse_args([*options, script])
        except SystemExit:
            raise Invalid(f"{module} {' '.join(options)}: {stderr.getvalue().strip()}") from None
    check_option_names(options, parser_options(parser), module)


@functools.lru_cache(maxsize=None)
def argparse_options_in_source(path):
    """The options a Python script's argparse defines (name -> whether it takes a value), from its source."""
    options = {"-h": False, "--help": False}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = [arg.value for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")]
            action = next(
                (kw.value.value for kw in node.keywords if kw.arg == "action" and isinstance(kw.value, ast.Constant)),
                None,
            )
            for name in names:
                options[name] = action not in ("store_true", "store_false", "count", "version")
    return options


def expand_braces(path):
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [
        expanded
        for choice in match.group(1).split(",")
        for expanded in expand_braces(path[: match.start()] + choice + path[match.end() :])
    ]


@functools.lru_cache(maxsize=None)
def make_targets():
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", (REPO / "Makefile").read_text(), re.MULTILINE))


def check(command):
    """Raises Invalid if the documented command would not parse."""
    tokens = list(command.tokens)
    assignments = []
    while tokens and ASSIGNMENT.match(tokens[0]):
        assignments.append(tokens.pop(0))
    if not tokens:
        return

    if tokens[0] == "make":
        for target in tokens[1:]:
            if not ASSIGNMENT.match(target) and not target.startswith("-") and target not in make_targets():
                raise Invalid(f"the Makefile has no target {target!r}")
        return

    for index, token in enumerate(tokens):
        if SCRIPT_FOLDER.search(token):
            return check_repo_script(token, tokens[:index], tokens[index + 1 :], assignments)
        script = TRAIN_SCRIPT.search(token)
        if script:
            before = tokens[:index]
            launcher = launcher_of(before)
            if launcher is None:
                return  # a file name, not a command (`diff train_ddp.py train_spawn.py`)
            module, options = launcher
            if module:
                parse_launcher_args(module, options)
            if (script.group(1), tuple(tokens[index + 1 :])) in EXPECTED_TO_FAIL:
                with pytest.raises(Invalid):
                    parse_training_args(script.group(1), tokens[index + 1 :], assignments)
                return
            return parse_training_args(script.group(1), tokens[index + 1 :], assignments)

    launcher = launcher_of(tokens)
    if launcher and launcher[0] and "--no-python" in launcher[1]:  # torchrun OPTIONS --no-python PROGRAM ...
        module, options = launcher
        stop = options.index("--no-python") + 1
        parse_launcher_args(module, options[:stop], script=options[stop] if stop < len(options) else "true")


def launcher_of(before):
    """(launcher module or None, its options) for the tokens before a script; None: not a launch."""
    for index, token in enumerate(before):
        if token == "torchrun" or token.endswith("/torchrun"):
            return "torch.distributed.run", before[index + 1 :]
        if PYTHON.search(token):
            rest = before[index + 1 :]
            if rest[:1] == ["-m"] and rest[1:2] and rest[1] in ("torch.distributed.run", "torch.distributed.launch"):
                return rest[1], rest[2:]
            if all(option.startswith("-") for option in rest):  # python -u train_dp.py
                return None, []
            return None
    return None


def check_repo_script(token, before, args, assignments):
    paths = expand_braces(token[SCRIPT_FOLDER.search(token).start() :].rstrip("/"))
    for path in paths:
        if not (REPO / path).exists():
            raise Invalid(f"{path} does not exist")
    path = REPO / paths[0]
    if path.is_dir() or len(paths) > 1:
        return
    if path.suffix == ".py":
        if before and PYTHON.search(before[-1]):
            args = [substitute(arg) for arg in args if arg != "..."]
            check_option_names(args, argparse_options_in_source(path), path.name)
        return
    if (
        before
        and before[-1] not in ("bash", "sh", "sbatch", "srun", "exec")
        and not before[-1].startswith("-")
        and "=" not in before[-1]
    ):
        return  # a mention, not a command
    chosen = [
        value for name, _, value in (assignment.partition("=") for assignment in assignments) if name == "TRAIN_SCRIPT"
    ]  # the DDP launchers run ${TRAIN_SCRIPT:-train_ddp.py}
    default = re.search(r"\$\{TRAIN_SCRIPT:-(train_\w+\.py)\}", path.read_text())
    trains = (
        ({chosen[-1]} if chosen else {default[1]})
        if default
        else set(re.findall(r"train_(?:dp|ddp|spawn|fsdp)\.py", path.read_text()))
    )
    if len(trains) == 1:  # a launcher: its extra arguments go to that script
        parse_training_args(trains.pop(), args, assignments)


# ---------------------------------------------------------------- the tests


def test_the_documents_hold_the_commands_this_test_checks():
    """The extraction works: if it silently found nothing, every other test here would pass."""
    texts = [" ".join(command.tokens) for command in COMMANDS]
    for expected in (
        "torchrun --standalone --nproc_per_node=8 train_ddp.py",
        "python train_spawn.py",
        "python train_dp.py",
        "tools/prepare_imagenet.py",
        "run_scripts/slurm_ddp.sbatch",
        "python -m torch.distributed.launch",
        "make demo",
        "make test",
    ):
        assert any(expected in text for text in texts), f"no documented command holds {expected!r}"
    assert len(COMMANDS) > 50


@pytest.mark.parametrize("command", COMMANDS, ids=lambda command: command.source)
def test_documented_command_parses(command):
    try:
        check(command)
    except Invalid as error:
        pytest.fail(f"{command.source}: {error}\n  the command: {command.text.strip()}", pytrace=False)


def test_a_misspelled_flag_fails_the_check():
    """What this test file exists for: a documented flag that the scripts do not define."""
    for tokens in (
        ["python", "train_dp.py", "--epoch", "1"],  # a prefix argparse would take
        ["torchrun", "--nproc-per-nod=2", "train_ddp.py"],
        ["python", "train_spawn.py", "--nprocs-per-node", "2"],
        ["run_scripts/single_node_ddp.sh", "--lr", "fast"],
        ["python", "tools/prepare_imagenet.py", "a", "b", "--resise", "256"],
        ["python", "./tools/benchmark.py", "--quik"],
        ["make", "no-such-target"],
    ):
        with pytest.raises(Invalid):
            check(Command("example", tokens, " ".join(tokens)))


def test_a_script_that_does_not_exist_fails_the_check():
    """Moved or renamed: the documents must follow (the tools left run_scripts/ for tools/)."""
    for tokens in (
        ["python", "run_scripts/prepare_imagenet.py", "a", "b"],
        ["run_scripts/slurm_local_cluster.sh", "start"],
        ["bash", "tools/single_node_ddp.sh"],
        ["python", "$PWD/tools/no_such_tool.py"],
        ["run_scripts/single_node_{dp,nope}.sh"],
    ):
        with pytest.raises(Invalid, match="does not exist"):
            check(Command("example", tokens, " ".join(tokens)))
    check(Command("example", ["python", "tools/gpu_check.py", "--quick"], ""))


def test_a_documented_command_parses_in_an_empty_environment_plus_its_own_assignments():
    check(Command("example", ["EPOCHS=1", "python", "train_dp.py"], ""))
    with pytest.raises(Invalid):
        check(Command("example", ["EPOCHS=0", "python", "train_dp.py"], ""))
    with mock.patch.dict(os.environ, {"EPOCHS": "0"}):  # the test's own shell does not count
        check(Command("example", ["python", "train_dp.py"], ""))


# ---------------------------------------------------------------- links


def github_anchor(heading, seen):
    anchor = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    count = seen.get(anchor, 0)
    seen[anchor] = count + 1
    return anchor if count == 0 else f"{anchor}-{count}"


@functools.lru_cache(maxsize=None)
def anchors(path):
    _, prose = fenced_blocks_and_prose(path.read_text())
    seen = {}
    return {
        github_anchor(match.group(1), seen)
        for line in prose
        for match in [re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)]
        if match
    }


def links():
    for path in DOCS:
        _, prose = fenced_blocks_and_prose(path.read_text())
        for number, line in enumerate(prose, 1):
            line = re.sub(r"(`+).+?\1", "", line)
            for match in re.finditer(r"\]\(([^)\s]+)\)", line):
                target = match.group(1)
                if not re.match(r"^[a-z]+:", target):
                    yield pytest.param(path, target, id=f"{path.relative_to(REPO)}:{number}:{target}")


@pytest.mark.parametrize("path, target", list(links()))
def test_link_resolves(path, target):
    file_part, _, anchor = target.partition("#")
    destination = (path.parent / file_part).resolve() if file_part else path
    assert destination.exists(), f"{path.relative_to(REPO)} links to {file_part}, which does not exist"
    if anchor:
        assert destination.suffix == ".md", f"an anchor into {destination.name}, which is not a Markdown file"
        assert anchor in anchors(destination), (
            f"{path.relative_to(REPO)} links to #{anchor}, not a heading of {destination.relative_to(REPO)}"
        )


def missing_repo_paths(text):
    """The paths into the repository's folders that `text` names (anywhere) and that do not exist."""
    missing = []
    for match in REPO_PATH.finditer(text):
        for path in expand_braces(match.group(0).rstrip(".,")):
            if not (any(REPO.glob(path)) if "*" in path else (REPO / path).exists()):
                missing.append(path)
    return missing


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(REPO)))
def test_every_path_a_document_names_exists(path):
    """Prose, inline code and every code block, file listings included: not only the commands."""
    missing = missing_repo_paths(path.read_text())
    assert not missing, f"{path.relative_to(REPO)} names paths that do not exist: {', '.join(dict.fromkeys(missing))}"


def test_a_missing_path_is_found_wherever_it_is_named():
    text = """- `run_scripts/`: launchers; run_scripts/benchmark.py measures (tools/benchmark.py now).
```text
run_scripts/gpu_check.py     the GPU check
tools/single_node_{dp,ddp}.sh
```
See [the docs](docs/no-such-page.md), common/trainer.py, tests/*.py, /usr/share/docs/x and setuptools/y."""
    assert missing_repo_paths(text) == [
        "run_scripts/benchmark.py",
        "run_scripts/gpu_check.py",
        "tools/single_node_dp.sh",
        "tools/single_node_ddp.sh",
        "docs/no-such-page.md",
    ]


def test_the_readme_stays_short():
    """The README is the way in; the rest belongs in docs/."""
    size = len((REPO / "README.md").read_bytes())
    assert size <= 15_000, f"README.md is {size} bytes: move detail to docs/ to keep it at 15 KB or less"


# ---------------------------------------------------------------- snippets


def python_snippets():
    """(where, code) of each distinct `python -c CODE` of the documents (not those run under torchrun)."""
    snippets = {}
    for command in COMMANDS:
        tokens = command.tokens
        for index, token in enumerate(tokens[:-2]):
            if (
                PYTHON.search(token)
                and tokens[index + 1] == "-c"
                and not any("torchrun" in earlier for earlier in tokens[:index])
            ):
                snippets.setdefault(tokens[index + 2], command.source)
    return [(where, code) for code, where in snippets.items()]


RUN_EACH = r"""
import json, sys, traceback
failed = []
for where, code in json.load(sys.stdin):
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        failed.append(where + ":\n" + traceback.format_exc())
print("\n".join(failed), file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def test_documented_python_snippets_run():
    """All in one process, one after the other: torch is imported once."""
    snippets = python_snippets()
    assert len(snippets) >= 4
    result = subprocess.run(
        [sys.executable, "-c", RUN_EACH],
        input=json.dumps(snippets),
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]

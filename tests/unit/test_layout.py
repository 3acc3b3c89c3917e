"""The library's shape, which every later change keeps: no module of common/ over 600 lines, no function over 80, one
concern per module with a unit file of its own, no import circle (in tools/ either), and the command line imported by
the scripts and tools alone."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

COMMON = Path(__file__).resolve().parents[2] / "common"
MODULES = sorted(path for path in COMMON.glob("*.py") if path.name != "__init__.py")
SCRIPTS = sorted(COMMON.parent.glob("train_*.py"))
TOOLS = sorted((COMMON.parent / "tools").glob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_a_module_holds_at_most_600_lines_and_a_function_at_most_80(path):
    lines = path.read_text().splitlines()
    assert len(lines) <= 600, f"{path.name}: {len(lines)} lines; split its concerns"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80
    ]
    assert not long, f"{path.name}: {', '.join(long)}"


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_a_docstring_says_what_and_why_in_at_most_100_words(path):
    """Measurements, incident stories and long lists go to docs/ or the commit message, where they are kept."""
    tree = ast.parse(path.read_text())
    long = [
        f"{getattr(node, 'name', 'the module')} ({len(ast.get_docstring(node).split())} words)"
        for node in [tree, *ast.walk(tree)]
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and ast.get_docstring(node)
        and len(ast.get_docstring(node).split()) > 100
    ]
    assert not long, f"{path.name}: {', '.join(sorted(set(long)))}"


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_every_module_has_a_unit_file_of_its_own(path):
    assert (Path(__file__).parent / f"test_{path.stem}.py").is_file(), f"tests/unit/test_{path.stem}.py"


def imports(path):
    """The modules of common/ that `path` imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module} if node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common"):
            found |= {node.module.split(".")[1]} if "." in node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("common.")}
    return {name.split(".")[0] for name in found}


def circles(graph):
    """The names of `graph` ({name: names it imports}) that reach themselves."""

    def reaches(start, goal, seen=()):
        return any(
            name == goal or (name not in seen and reaches(name, goal, (*seen, name))) for name in graph.get(start, ())
        )

    return {name: sorted(graph[name]) for name in graph if reaches(name, name)}


def test_common_has_no_import_circle():
    """A module never imports, directly or through others, one that imports it: each can be read, and copied, on
    its own."""
    graph = {path.stem: imports(path) for path in MODULES}
    assert "demo_data" in graph["config"]  # the walk finds function-level imports too
    assert not circles(graph)


def test_the_tools_have_no_import_circle():
    """tools/ imports its own modules by name (each puts tools/ first on sys.path, as a script's folder is): what
    two tools share lives in a module both import (tools/shared.py), never in one tool the other imports back."""
    names = {path.stem for path in TOOLS}
    graph = {}
    for path in TOOLS:
        graph[path.stem] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in names:
                graph[path.stem].add(node.module)
            elif isinstance(node, ast.Import):
                graph[path.stem] |= {alias.name for alias in node.names if alias.name in names}
    assert "make_shards" in graph["prepare_imagenet"]  # the walk finds function-level imports too
    assert not circles(graph)


def test_the_library_never_imports_the_command_line_or_a_script():
    for path in MODULES:
        assert "cli" not in imports(path), f"{path.name} imports the command line"
        assert not {script.stem for script in SCRIPTS} & imports(path), path.name
    assert all("cli" in imports(script) and "launch" in imports(script) for script in SCRIPTS)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda path: path.name)
def test_a_script_shows_its_launch_mode_in_under_200_lines(path):
    assert len(path.read_text().splitlines()) < 200


def test_every_entry_point_starts_under_python_oo():
    """`python -OO` (PYTHONOPTIMIZE=2) drops the docstrings: a description read from __doc__ is read only where there
    is one (was: an AttributeError at every script's and tool's start)."""
    for path in [*MODULES, *SCRIPTS, *TOOLS, *sorted((COMMON.parent / "examples").glob("*.py"))]:
        unguarded = re.findall(r"(?<!__doc__ and )__doc__\.\w+", path.read_text())
        assert not unguarded, f"{path.name}: {unguarded[0]} where __doc__ may be None"
    result = subprocess.run(
        [sys.executable, "-OO", str(SCRIPTS[0]), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["ruff format", "ruff check"])
def test_the_code_is_formatted_and_linted(command):
    """ruff (ruff.toml: lines of at most 120 characters, pycodestyle, pyflakes, the imports' order) finds nothing to
    change: `make format` changes what it can."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=COMMON.parent, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


# The training step's reading path: Trainer.train_one_epoch and what it runs at every step with the default flags
# (a model whose output is a tensor, no MixUp, no EMA), by file. ELSEWHERE: what the loop calls at some steps only.
READING_PATH = {
    "trainer.py": ["Trainer.train_one_epoch", "Trainer._optimizer_steps", "Trainer._forward_backward",
                   "Trainer.train_step", "Trainer.optimizer_step", "Trainer.clip_gradients", "Trainer._stop_agreed"],
    "models.py": ["gradient_sync", "autocast", "step_result", "loss_with_aux", "BareModelGuard.__enter__",
                  "BareModelGuard.__exit__"],
    "metrics.py": ["MetricSums.update"],
    "distributed.py": ["average_gradients"],
    "preemption.py": ["StopSignal.poll"],
    "diagnostics.py": ["Diagnostics.timed", "Diagnostics.after_step"],
}  # fmt: skip
ELSEWHERE = {"_start_epoch", "_epoch_summary", "_progress_line", "save", "_stopped", "after_step", "_batch_transform",
             "zero_grad", "step", "scale", "backward", "get",
             "weighted_mean"}  # (the EMA's; torch's, dict's; the closure's)  # fmt: skip
OURS = {"self", "models", "distributed", "metrics"}  # calls of the library's code, as the loop names it


def root(node):
    """The name an attribute chain starts from: "self" of self._diagnostics.timed."""
    while isinstance(node, (ast.Attribute, ast.Call)):
        node = node.value if isinstance(node, ast.Attribute) else node.func
    return getattr(node, "id", None)


def functions(path):
    """{"name" or "Class.name": node} of a module's functions and methods."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        for sub in [node, *(node.body if isinstance(node, ast.ClassDef) else [])]:
            if isinstance(sub, ast.FunctionDef):
                found[f"{node.name}.{sub.name}" if sub is not node else sub.name] = sub
    return found


def test_the_training_step_reads_in_at_most_220_lines_in_6_files():
    """A reader follows one step in at most 220 lines; a call added to the loop is listed here, in one or the other."""
    nodes = {(file, name): functions(COMMON / file)[name] for file, names in READING_PATH.items() for name in names}
    lines = sum(node.end_lineno - node.lineno + 1 for node in nodes.values())
    assert len(READING_PATH) <= 6 and lines <= 220, f"{lines} lines in {len(READING_PATH)} files"
    listed = {name.split(".")[-1] for names in READING_PATH.values() for name in names} | ELSEWHERE
    loop = [nodes["trainer.py", "Trainer.train_one_epoch"], nodes["trainer.py", "Trainer._forward_backward"]]
    called = {
        call.func.attr for node in loop for call in ast.walk(node)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and root(call.func) in OURS
    }  # fmt: skip
    assert called <= listed, f"called in the loop, not listed: {sorted(called - listed)}"

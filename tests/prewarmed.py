"""Run one script several times, each run a process of its own forked from this interpreter after it
imported torch, torchvision, common/ and what else the script imports: conftest.run_prewarmed.

    python tests/prewarmed.py SPEC.json

SPEC: {"script": path, "runs": [[argv...], ...], "envs": [{...} or null, ...], "outputs": [path, ...],
"parallel": 2, "timeout": seconds}. Each run is `python script argv` with stdout and stderr in its
output file and its own environment; the exit codes (negative: killed by that signal) are written
to SPEC.json.result. What importing printed is written there too: a real process would print it.

Starting Python and importing torch costs about 5 s of CPU here; the runs that end in a usage error
take a fraction of a second after that. Everything from the script's first line on runs in the
child as in `python script`: the script is executed as __main__ (runpy), with its own sys.argv,
environment, working directory and exit code; an uncaught exception prints its traceback and exits 1.
"""
import atexit
import contextlib
import importlib.util
import io
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path


def child(script, argv, env, output):
    os.setsid()
    fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(script)
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main(spec_path):
    with open(spec_path) as file:
        spec = json.load(file)
    script = os.path.abspath(spec["script"])
    sys.path[0] = os.path.dirname(script)
    # Import torch, torchvision and every module of common/ (the scripts import most of them only
    # after parsing their arguments), and the script as a module (its `if __name__ == "__main__"`
    # does not run): done once, here. Whatever that prints is reported.
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        for name in ["torch", "torchvision", *(f"common.{path.stem}" for path in
                                                sorted(Path(script).parent.glob("common/*.py")))]:
            importlib.import_module(name)
        module_spec = importlib.util.spec_from_file_location("_prewarmed_script", script)
        module_spec.loader.exec_module(importlib.util.module_from_spec(module_spec))
    runs, envs, outputs = spec["runs"], spec["envs"], spec["outputs"]
    deadline = time.monotonic() + spec["timeout"]
    codes, running, pending = [None] * len(runs), {}, list(range(len(runs)))
    while pending or running:
        while pending and len(running) < spec["parallel"]:
            index = pending.pop(0)
            sys.stdout.flush()
            pid = os.fork()
            if pid == 0:
                child(script, runs[index], envs[index], outputs[index])
            running[pid] = index
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                for late in running:
                    os.killpg(late, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.02)
            continue
        if pid in running:
            codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
    with open(spec_path + ".result", "w") as file:
        json.dump({"codes": codes, "import_output": printed.getvalue()}, file)


if __name__ == "__main__":
    main(sys.argv[1])

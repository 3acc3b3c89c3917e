"""tools/prepare_imagenet.py on a miniature ImageNet: the official archives (real per-class
tars, a real meta.mat, the ground-truth file) and Kaggle's extracted layout, with the odd files the
real set has (CMYK, grayscale, a PNG named .JPEG); a val/ sorted by valprep.sh; reruns after a crash
left empty or cut-short markers and images."""

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.datasets import load_image
from common.errors import UsageError
from common.folder_index import UNFINISHED, refuse_unfinished
from harness.jobs import assert_ok, described, run
from harness.processes import PYTHON, REPO, alive, clean_env, process_stat

scipy_io = pytest.importorskip("scipy.io", reason="the miniature devkit's meta.mat is written with scipy")

SCRIPT = REPO / "tools" / "prepare_imagenet.py"
sys.path.insert(0, str(SCRIPT.parent))
import make_shards  # noqa: E402
import prepare_imagenet  # noqa: E402

pytestmark = pytest.mark.e2e

# wnid: (ILSVRC2012_ID, words) of four real leaf classes.
CLASSES = {
    "n01440764": (1, "tench, Tinca tinca"),
    "n01443537": (2, "goldfish, Carassius auratus"),
    "n01484850": (3, "great white shark, white shark, man-eater, Carcharodon carcharias"),
    "n01491361": (4, "tiger shark, Galeocerdo cuvieri"),
}
TRAIN_PER_CLASS, VAL_PER_CLASS = 5, 2
TEMPORARY = re.compile(r"^\..*\.tmp$")  # common/run_dir.py's temporary_beside
WORKER_DIED = "error: a worker process died (out of memory?): run the same command again to carry on"


def encode(size, seed, mode="RGB", fmt="JPEG"):
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    image = Image.fromarray(pixels).resize(size).convert(mode)
    output = io.BytesIO()
    image.save(output, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return output.getvalue()


def miniature_images(broken=False):
    """{"train/<wnid>/<name>" or "val/<wnid>/<name>": bytes}: JPEGs of 30-80 px, a CMYK JPEG, a
    grayscale JPEG and an RGBA PNG named .JPEG (and, with `broken`, a file no decoder reads)."""
    images = {}
    for label, wnid in enumerate(CLASSES):
        for index in range(TRAIN_PER_CLASS):
            size = (40 + 9 * index, 80 - 7 * index - 3 * label)
            images[f"train/{wnid}/{wnid}_{100 + index}.JPEG"] = encode(size, seed=label * 100 + index)
        for index in range(VAL_PER_CLASS):
            number = 1 + index * len(CLASSES) + (label * 3) % len(CLASSES)  # the classes interleave in val
            images[f"val/{wnid}/ILSVRC2012_val_{number:08d}.JPEG"] = encode((56, 42), seed=1000 + number)
    images["train/n01440764/n01440764_100.JPEG"] = encode((64, 48), 1, mode="CMYK")
    images["train/n01443537/n01443537_100.JPEG"] = encode((50, 70), 2, mode="L")
    images["val/n01491361/ILSVRC2012_val_00000002.JPEG"] = encode((48, 60), 3, mode="RGBA", fmt="PNG")
    images["train/n01491361/n01491361_101.JPEG"] = encode((50, 30), 4)  # shorter side under 32: kept
    if broken:
        images["train/n01484850/n01484850_999.JPEG"] = b"\xff\xd8\xff\xe0 not really a JPEG"
    return images


def tar_bytes(files, gzip=False):
    output = io.BytesIO()
    with tarfile.open(fileobj=output, mode="w:gz" if gzip else "w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return output.getvalue()


def write_meta_mat(path):
    """meta.mat as in the devkit: a `synsets` struct array, leaves first, then a non-leaf
    (num_children != 0) that torchvision's parser drops."""
    fields = [
        "ILSVRC2012_ID",
        "WNID",
        "words",
        "gloss",
        "num_children",
        "children",
        "wordnet_height",
        "num_train_images",
    ]
    rows = [
        (ident, wnid, words, "a fish", 0, np.zeros(0), 0, TRAIN_PER_CLASS) for wnid, (ident, words) in CLASSES.items()
    ]
    rows.append((1001, "n01439121", "cyprinid", "a family of fish", 2, np.array([1, 2]), 1, 0))
    synsets = np.array(rows, dtype=[(field, object) for field in fields])
    scipy_io.savemat(path, {"synsets": synsets})


def make_archives(root, images):
    """The three official archives of `images`, in root; in a class's tar also a Thumbs.db, as a re-packed archive
    may hold (was: copied into the class folder and counted, and --shards refused "does not read back as written")."""
    root.mkdir(parents=True)
    class_tars = {
        f"{wnid}.tar": tar_bytes(
            {Path(name).name: data for name, data in images.items() if name.startswith(f"train/{wnid}/")}
            | ({"Thumbs.db": b"not an image"} if wnid == min(CLASSES) else {})
        )
        for wnid in CLASSES
    }
    (root / "ILSVRC2012_img_train.tar").write_bytes(tar_bytes(class_tars))
    val = {Path(name).name: data for name, data in images.items() if name.startswith("val/")}
    (root / "ILSVRC2012_img_val.tar").write_bytes(tar_bytes(dict(sorted(val.items()))))  # flat, in name order
    truth = {Path(name).name: CLASSES[name.split("/")[1]][0] for name in images if name.startswith("val/")}
    meta = root / "meta.mat"
    write_meta_mat(meta)
    (root / "ILSVRC2012_devkit_t12.tar.gz").write_bytes(
        tar_bytes(
            {
                "ILSVRC2012_devkit_t12/data/meta.mat": meta.read_bytes(),
                "ILSVRC2012_devkit_t12/data/ILSVRC2012_validation_ground_truth.txt": "".join(
                    f"{truth[name]}\n" for name in sorted(truth)
                ).encode(),
            },
            gzip=True,
        )
    )
    meta.unlink()
    return root


def make_kaggle(root, images):
    """Kaggle's extracted layout of `images`, labelled by LOC_val_solution.csv, in root."""
    rows = ["ImageId,PredictionString"]
    for name, data in images.items():
        split, wnid, file = name.split("/")
        path = root / prepare_imagenet.KAGGLE_ROOT / split / (wnid if split == "train" else "") / file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if split == "val":
            rows.append(f"{Path(file).stem},{wnid} 1 2 30 40 {wnid} 5 6 20 30")
    (root / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    return root


def make_valprep(root, images):
    """Both archives extracted by hand, val/ sorted into class folders by pytorch/examples' valprep.sh:
    root/val/<wnid>/ILSVRC2012_val_*.JPEG, and no labels file."""
    for name, data in images.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def prepare(*args, env=None, timeout=60):
    return run([PYTHON, SCRIPT, *args], timeout=timeout, env=env)


def contents(out):
    """{relative path: bytes} of every file under out/train and out/val (temporaries included)."""
    return {
        path.relative_to(out).as_posix(): path.read_bytes()
        for split in ("train", "val")
        for path in sorted((out / split).rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def images():
    return miniature_images()


@pytest.fixture(scope="module")
def archives(images, tmp_path_factory):
    return make_archives(tmp_path_factory.mktemp("downloads") / "imagenet", images)


@pytest.fixture(scope="module")
def prepared(archives, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "imagenet"
    return out, assert_ok(prepare(archives, out, "--skip-md5"))


def test_archives_become_an_image_folder(prepared, images):
    out, output = prepared
    assert contents(out) == images  # right classes, val by its ground truth, bytes unchanged, nothing else
    assert "4 classes, 20 train images, 8 val images" in output, output
    assert re.search(r"^warning: ImageNet-1k has 1,000 classes", output, re.M), output
    for name in images:
        image = load_image(str(out / name))
        assert image.dtype == torch.uint8 and image.shape[0] == 3, name


def test_resize_makes_small_rgb_jpegs(tmp_path):
    images = miniature_images(broken=True)
    out = tmp_path / "out"
    output = assert_ok(prepare(make_archives(tmp_path / "downloads", images), out, "--skip-md5", "--resize", "32"))
    assert "warning: cannot decode train/n01484850/n01484850_999.JPEG: copied unchanged" in output, output
    assert "(1 could not be decoded: copied unchanged)" in output, output
    written = contents(out)
    assert written.keys() == images.keys()
    for name, data in written.items():
        if name.endswith("_999.JPEG"):
            assert data == images[name]
            continue
        with Image.open(io.BytesIO(data)) as image, Image.open(io.BytesIO(images[name])) as original:
            assert (image.format, image.mode) == ("JPEG", "RGB"), name  # CMYK, gray and PNG converted
            assert min(image.size) == min(32, *original.size), name  # shorter side 32, never upscaled


def slow_writes(tmp_path, seconds, hold_second_fork=None):
    """PYTHONPATH for a run whose every rename waits `seconds` first: deterministically slow, and a
    temporary stands in its folder meanwhile. With `hold_second_fork` (a path), the process's second fork (the pool's
    second worker) creates that file right after the fork and then sleeps 60 s, before its start-up."""
    hook = tmp_path / "slow"
    hook.mkdir()
    code = (
        "import os, time\n_replace = os.replace\n"
        f"def slow_replace(*args, **kwargs):\n    time.sleep({seconds})\n    return _replace(*args, **kwargs)\n"
        "os.replace = slow_replace\n"
    )
    if hold_second_fork is not None:
        code += (
            f"forks = [0]\ndef count():\n    forks[0] += 1\n"
            f"def hold():\n    if forks[0] == 2:\n        open({str(hold_second_fork)!r}, 'w').close()\n"
            "        time.sleep(60)\n"
            "os.register_at_fork(before=count, after_in_child=hold)\n"
        )
    (hook / "sitecustomize.py").write_text(code)
    return str(hook)


def start(*args, env):
    """The script in a process group of its own, with SIGINT handled as in a terminal (this test may
    run as a background job, whose children inherit SIGINT ignored)."""
    return subprocess.Popen(
        [PYTHON, SCRIPT, *map(str, args)],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


# The script's start (Python, torch, the archives' listing, its workers) before the state a test waits for: under the
# suite's load on 2 cores, 30 s was seen to pass before a worker's first file.
START_UP = 90


def wait_for(what, condition, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def group_gone(process):
    """Whether no process is left in the process group of `process` (the script and its workers)."""
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return True
    return False


def output_once_ended(process, timeout):
    """What `process` printed, once its group has ended. Where it has not within `timeout` s, the failure lists the
    group's processes and every Python thread's stack in each (started with PYTHONFAULTHANDLER=1: SIGABRT dumps them).
    """
    try:
        return process.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        group = [
            int(entry.name)
            for entry in Path("/proc").glob("[0-9]*")
            if (fields := process_stat(entry.name)) is not None and int(fields[2]) == process.pid
        ]
        left = described(group)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGABRT)
        output, _ = process.communicate(timeout=30)
        pytest.fail(f"not ended {timeout} s after: {left}\n{output}")


def kill_group(process):
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.communicate()


def final_images(out):
    return {path: path.stat() for path in out.rglob("*.JPEG")}


def temporaries(out):
    return [path for path in out.rglob("*") if TEMPORARY.match(path.name)]


def workers(process):
    """The worker processes of `process` (its children: the pool's workers)."""
    return [
        int(entry.name)
        for entry in Path("/proc").glob("[0-9]*")
        if (fields := process_stat(entry.name)) is not None and int(fields[1]) == process.pid and fields[0] != "Z"
    ]


def part_way_class(out):
    """A class with a marker, and one with finished images and a temporary but no marker yet."""
    markers = {path.name for path in (out / ".prepare").glob("train-*.done")}
    return markers and any(
        f"train-{folder.name}.done" not in markers and temporaries(folder) and list(folder.glob("*.JPEG"))
        for folder in (out / "train").iterdir()
    )


def test_killed_run_carries_on_without_redoing_finished_work(archives, images, tmp_path):
    out = tmp_path / "out"
    process = start(
        archives, out, "--skip-md5", "--workers", "1", env=clean_env(PYTHONPATH=slow_writes(tmp_path, 0.3))
    )  # time to see, and kill
    try:
        wait_for("a finished class, and one part-way", lambda: part_way_class(out), timeout=START_UP)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
    before, markers = final_images(out), {path: path.stat() for path in (out / ".prepare").glob("*.done")}
    assert before and markers and temporaries(out)
    stopped_part_way(out, f"cd {REPO} && python {SCRIPT} {archives} {out} --skip-md5 --workers 1")
    for path in before:  # a final path never holds half an image
        assert path.read_bytes() == images[path.relative_to(out).as_posix()]

    output = assert_ok(prepare(archives, out, "--skip-md5", "--workers", "1"))
    assert re.search(r"^carrying on: [1-4] of 4 classes and 0 val chunks were done before$", output, re.M), output
    assert contents(out) == images and not temporaries(out) and not (out / UNFINISHED).exists()
    for path, stat in {**before, **markers}.items():  # finished classes and files were not done again
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns), path


# Ctrl-C signals the process group: the workers ignore it and the main process stops them (as after
# `kill PID`). A batch system often sends SIGTERM to the whole group: the workers end at once. The second worker is
# still starting (between its fork and its initializer) when the signal comes, as under load it can be: it ends too
# (it ignored the signals and ran on while the main process waited for it, seen once as a stopped run that hung).
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_stop_signal_ends_it_within_seconds(archives, tmp_path, signum, code):
    out, held = tmp_path / "out", tmp_path / "held"
    process = start(
        archives,
        out,
        "--skip-md5",
        "--workers",
        "2",
        env=clean_env(PYTHONPATH=slow_writes(tmp_path, 1, hold_second_fork=held), PYTHONFAULTHANDLER="1"),
    )
    try:
        wait_for(
            "a worker's temporary, the other worker still starting",
            lambda: temporaries(out / "train") and held.exists(),
            timeout=START_UP,
        )
        os.killpg(process.pid, signum)
        output = output_once_ended(process, 10)
        assert process.returncode == code, output
        assert output.strip().splitlines()[-1] == "stopped: run the same command again to carry on", output
        assert "Traceback" not in output, output
        wait_for("the workers to end", lambda: group_gone(process), timeout=5)
    finally:
        kill_group(process)


def test_killed_worker_ends_the_run_and_a_rerun_completes(archives, images, tmp_path):
    """A worker SIGKILLed (by the OOM killer) never returns its job: the script must not wait for it."""
    out = tmp_path / "out"
    process = start(archives, out, "--skip-md5", "--workers", "2", env=clean_env(PYTHONPATH=slow_writes(tmp_path, 1)))
    try:
        wait_for("a worker's temporary", lambda: temporaries(out / "train"), timeout=START_UP)
        os.kill(workers(process)[0], signal.SIGKILL)  # mid-job: a temporary stands, its rename waits
        output, _ = process.communicate(timeout=30)
        assert process.returncode == 1 and output.strip().splitlines() == [WORKER_DIED], output
        wait_for("the other worker to end", lambda: group_gone(process), timeout=5)
    finally:
        kill_group(process)
    assert_ok(prepare(archives, out, "--skip-md5"))
    assert contents(out) == images and not temporaries(out)


def test_a_sigkilled_make_shards_takes_its_pool_s_workers_with_it(prepared, tmp_path):
    """SIGKILL to tools/make_shards.py alone (the OOM killer's choice) while its workers write: they end too, at once
    (they were left alive, 400 MB each, waiting on the pool's pipe forever). prepare_imagenet.py's pool starts alike."""
    hook = tmp_path / "slow"  # a worker's renames wait 60 s (the main process's do not)
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import multiprocessing, os, time\n_replace = os.replace\n"
        "def slow_replace(*args, **kwargs):\n"
        "    if multiprocessing.parent_process() is not None:\n        time.sleep(60)\n"
        "    return _replace(*args, **kwargs)\nos.replace = slow_replace\n"
    )
    process = subprocess.Popen(
        [
            PYTHON,
            REPO / "tools" / "make_shards.py",
            prepared[0],
            tmp_path / "shards",
            "--shard-size",
            "2",
            "--workers",
            "2",
        ],
        cwd=REPO,
        env=clean_env(PYTHONPATH=hook),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_for(
            "both workers writing",
            lambda: len(workers(process)) == 2 and temporaries(tmp_path / "shards"),
            timeout=START_UP,
        )
        pool = workers(process)
        process.kill()  # the main process alone
        process.wait(timeout=30)
        wait_for("its workers to end", lambda: not any(alive(pid) for pid in pool), timeout=10)
    finally:
        kill_group(process)
    out = tmp_path / "shards"
    stopped_part_way(
        out, f"cd {REPO} && python {SCRIPT.parent}/make_shards.py {prepared[0]} {out} --shard-size 2 --workers 2"
    )
    assert make_shards.main([str(prepared[0]), str(out), "--shard-size", "2", "--workers", "1"]) == 0
    assert not (out / UNFINISHED).exists()


def stopped_part_way(out, command):
    """The training scripts refuse `out` while it holds the marker of the tool stopped writing it (was: trained on what
    it held, 40 of 300 val images of one class, exit code 0)."""
    assert (out / UNFINISHED).read_text() == command
    with pytest.raises(UsageError, match=f"^--data {out} is unfinished: {re.escape(command)} stopped part-way"):
        refuse_unfinished(out)


def test_the_devkit_s_labels_cut_short_are_parsed_again(archives, prepared, images, tmp_path):
    """The devkit's val labels, parsed (val_wnids.json), cut short by a kill under an older version, and the
    temporaries of later writes: the labels are read from the devkit again, as torchvision's parse_devkit_archive
    reads them (meta.mat's leaf synsets by ID, the ground truth's lines in image order)."""
    out = tmp_path / "out"
    shutil.copytree(prepared[0], out)
    parsed = out / ".prepare" / prepare_imagenet.VAL_WNIDS
    truth = [name.split("/")[1] for name in sorted(images, key=lambda name: Path(name).name) if name.startswith("val/")]
    assert json.loads(parsed.read_text()) == truth  # val wnids in name order
    parsed.write_bytes(parsed.read_bytes()[: parsed.stat().st_size // 2])
    (out / ".prepare" / ".devkit.tmp-x1y2z3").mkdir()
    (out / ".prepare" / ".val_wnids.json.a1b2c3.tmp").write_bytes(b"half")
    output = assert_ok(prepare(archives, out, "--skip-md5"))
    assert "carrying on: 4 of 4 classes and 1 val chunks were done before" in output, output
    assert contents(out) == images and not list((out / ".prepare").glob(".*tmp*"))
    assert json.loads(parsed.read_text()) == truth


def inodes(folder):
    return {path.name: path.stat().st_ino for path in folder.iterdir()}


def warnings(output):
    assert "Traceback" not in output, output
    return [line for line in output.splitlines() if line.startswith("warning: ") and "ImageNet-1k has" not in line]


def test_empty_or_cut_short_markers_are_redone(archives, prepared, images, tmp_path):
    """After a power loss (under an older version, which did not fsync) a marker may be empty or cut
    short: its class or val chunk is written again, with one warning line each, not a JSONDecodeError."""
    out = tmp_path / "out"
    shutil.copytree(prepared[0], out)
    state = out / ".prepare"
    (state / "train-n01443537.done").write_bytes(b"")
    (state / "val-0000.done").write_bytes((state / "val-0000.done").read_bytes()[:9])
    before = {wnid: inodes(out / "train" / wnid) for wnid in CLASSES}
    output = assert_ok(prepare(archives, out, "--skip-md5"))
    assert warnings(output) == [
        f"warning: {state}/train-n01443537.done is empty: redoing train/n01443537",
        f"warning: {state}/val-0000.done is cut short or corrupt (not JSON): redoing val images 1 to 8 (in name order)",
    ], output
    assert "carrying on: 3 of 4 classes and 0 val chunks were done before" in output, output
    assert "4 classes, 20 train images, 8 val images" in output, output
    assert contents(out) == images and not temporaries(out)
    after = {wnid: inodes(out / "train" / wnid) for wnid in CLASSES}
    for wnid in CLASSES:  # the class redone was written anew, the others kept
        assert (after[wnid] == before[wnid]) == (wnid != "n01443537"), wnid
    output = assert_ok(prepare(archives, out, "--skip-md5"))  # the new markers are trusted: nothing redone
    assert warnings(output) == [] and "carrying on: 4 of 4 classes and 1 val chunks were done before" in output
    assert {wnid: inodes(out / "train" / wnid) for wnid in CLASSES} == after


def test_image_emptied_under_its_marker_is_restored(archives, prepared, images, tmp_path):
    """A marker that reads well but does not match its files (an image emptied by a power loss: the
    number of bytes differs) is redone too; a marker of an older version ([images, undecodable], no
    byte count) is kept while none of its images is empty."""
    out = tmp_path / "out"
    shutil.copytree(prepared[0], out)
    state = out / ".prepare"
    emptied = ["train/n01484850/n01484850_102.JPEG", "val/n01440764/ILSVRC2012_val_00000001.JPEG"]
    for name in emptied:
        (out / name).write_bytes(b"")
    (state / "train-n01491361.done").write_text("[5, []]")  # an older version's, matching
    total = sum(len(data) for name, data in images.items() if name.startswith("train/n01484850/"))
    val_total = sum(len(data) for name, data in images.items() if name.startswith("val/"))
    output = assert_ok(prepare(archives, out, "--skip-md5"))
    assert warnings(output) == [
        f"warning: {state}/train-n01484850.done says 5 images of {total:,} bytes, but 5 of "
        f"{total - len(images[emptied[0]]):,} bytes are there (1 empty): redoing train/n01484850",
        f"warning: {state}/val-0000.done says 8 images of {val_total:,} bytes, but 8 of "
        f"{val_total - len(images[emptied[1]]):,} bytes are there (1 empty): redoing val images 1 to 8 (in name order)",
    ], output
    assert contents(out) == images and not temporaries(out)


def test_val_sorted_into_class_folders(images, tmp_path, capsys):
    """valprep.sh's layout: val/<wnid>/ is taken as it is (its folders are the labels), as train/."""
    source, out = make_valprep(tmp_path / "extracted", images), tmp_path / "out"
    output = assert_ok(prepare(source, out))
    assert warnings(output) == [] and "4 classes, 20 train images, 8 val images" in output, output
    assert contents(out) == images
    name = "val/n01491361/ILSVRC2012_val_00000002.JPEG"
    assert (out / name).stat().st_ino == (source / name).stat().st_ino  # linked, not copied
    (source / name).rename(source / "val" / Path(name).name)  # valprep.sh stopped part-way, and no labels
    assert "lacks ILSVRC2012_devkit_t12.tar.gz" in one_error_line(capsys, source, out)


def test_a_rerun_after_the_source_changed_redoes_what_changed(images, tmp_path):
    """A source that gained images since its classes and val chunks were marked done (a download cut short, then
    extracted again) kept them without the new images; one that lost an image kept it in OUT_DIR to train on."""
    source, out = make_valprep(tmp_path / "extracted", images), tmp_path / "out"
    assert_ok(prepare(source, out))
    added = {
        "train/n01440764/n01440764_900.JPEG": encode((40, 30), 900),
        "val/n01443537/ILSVRC2012_val_00000099.JPEG": encode((40, 30), 901),
    }
    for name, data in added.items():
        (source / name).write_bytes(data)
    removed = "train/n01484850/n01484850_101.JPEG"
    (source / removed).unlink()
    output = assert_ok(prepare(source, out))
    changed = "was written from other images than the source holds now (some added, removed or renamed): redoing"
    assert warnings(output) == [
        f"warning: {out}/.prepare/train-n01440764.done {changed} train/n01440764",
        f"warning: {out}/.prepare/train-n01484850.done {changed} train/n01484850",
        f"warning: {out}/.prepare/val-0000.done {changed} val images 1 to 9 (in name order)",
    ], output
    note = "note: removed 1 image(s) that its source does not hold from train/"
    assert f"{note}n01484850: {Path(removed).name}" in output.splitlines(), output
    assert contents(out) == {name: data for name, data in (images | added).items() if name != removed}
    assert warnings(assert_ok(prepare(source, out))) == []  # (the new markers trusted)
    # A class whose marker a kill left unwritten: its stale image removed too; a user's own file and folder kept
    folder = out / "train" / "n01491361"
    (folder / "README.txt").write_text("mine")
    (folder / "crops").mkdir()
    (folder / "gone.JPEG").write_bytes(images["train/n01491361/n01491361_101.JPEG"])
    (out / ".prepare" / "train-n01491361.done").unlink()
    output = assert_ok(prepare(source, out))
    assert f"{note}n01491361: gone.JPEG" in output.splitlines(), output
    assert sorted(path.name for path in folder.iterdir() if not path.name.lower().endswith(".jpeg")) == [
        "README.txt",
        "crops",
    ]
    assert warnings(assert_ok(prepare(source, out))) == []  # (they are not counted as the class's images)


def damaged_class_tars(images, root):
    """Train archives whose second class's tar has a damaged first header, or whose first class's tar ends inside its
    last image (tarfile took both for the end of the class: its images, or the last one's end, left out unsaid)."""
    class_tars = {
        wnid: tar_bytes({Path(name).name: data for name, data in images.items() if name.startswith(f"train/{wnid}/")})
        for wnid in CLASSES
    }
    last = tarfile.open(fileobj=io.BytesIO(class_tars["n01440764"])).getmembers()[-1]
    damaged = {
        "header": {**class_tars, "n01443537": b"garbage " * 200},
        "cut": {**class_tars, "n01440764": class_tars["n01440764"][: last.offset_data + 100]},
    }
    for kind, tars in damaged.items():
        make_valprep(root / kind, {name: data for name, data in images.items() if name.startswith("val/")})
        (root / kind / "ILSVRC2012_img_train.tar").write_bytes(tar_bytes({f"{w}.tar": d for w, d in tars.items()}))
    return root / "header", root / "cut"


def test_a_damaged_class_tar_in_the_train_archive_is_one_line_with_or_without_shards(images, tmp_path, capsys):
    header, cut = damaged_class_tars(images, tmp_path)
    with tarfile.open(header / "ILSVRC2012_img_train.tar") as archive:
        garbage = archive.getmembers()[1].offset_data
    assert one_error_line(capsys, header, tmp_path / "out1", "--skip-md5", "--shards") == (
        f"error: cannot read {header}/ILSVRC2012_img_train.tar: damaged tar header at byte {garbage:,}"
    )
    assert one_error_line(capsys, cut, tmp_path / "out2", "--skip-md5", "--shards") == (
        f"error: cannot read {cut}/ILSVRC2012_img_train.tar: n01440764_104.JPEG runs past the end of its class's tar "
        "(damaged)"
    )
    result = prepare(cut, tmp_path / "out3", "--skip-md5", "--workers", "1")  # (read by a worker of the pool)
    assert result.returncode == 2 and result.stdout.splitlines() == [
        f"error: {cut}/ILSVRC2012_img_train.tar (train-n01440764): n01440764_104.JPEG runs past the end of its "
        "class's tar (damaged)"
    ], result.stdout
    outer = (header / "ILSVRC2012_img_train.tar").read_bytes()  # a damaged header in the archive itself
    second = tarfile.open(fileobj=io.BytesIO(outer)).getmembers()[1].offset
    (header / "ILSVRC2012_img_train.tar").write_bytes(outer[:second] + b"x" * 512 + outer[second + 512 :])
    assert one_error_line(capsys, header, tmp_path / "out4", "--skip-md5") == (
        f"error: cannot read {header}/ILSVRC2012_img_train.tar: damaged tar header at byte {second:,} (download it "
        "again)"
    )


def test_every_write_is_synced_before_its_rename(archives, images, tmp_path, monkeypatch):
    """Every file is fsynced under its temporary name before it is renamed into place (else a power loss
    can leave the final name empty), and a marker is written once its images' folders are synced."""
    calls, fsync, replace = [], os.fsync, os.replace

    def recorded_fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))  # the file's name at the time
        fsync(fd)

    def recorded_replace(old, new):
        calls.append(("replace", str(old), str(new)))
        replace(old, new)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    out = tmp_path.resolve() / "out"
    prepare_imagenet.open_output(out, None, 90)
    labels = {Path(name).stem: name.split("/")[1] for name in images if name.startswith("val/")}
    jobs = prepare_imagenet.make_jobs(
        archives / prepare_imagenet.TRAIN_TAR, archives / prepare_imagenet.VAL_TAR, labels
    )
    for job in jobs:
        prepare_imagenet.run_job(job, out, None, 90)
    assert contents(out) == images
    written = [path for path in out.rglob("*") if path.is_file()]  # images, markers and options.json
    assert len(written) == len(images) + len(jobs) + 1, written
    renamed, temporary = {}, {}
    for path in written:
        ((renamed[path], temporary[path]),) = [
            (index, call[1]) for index, call in enumerate(calls) if call[0] == "replace" and call[2] == str(path)
        ]
        assert TEMPORARY.match(Path(temporary[path]).name) and Path(temporary[path]).parent == path.parent, path
        assert ("fsync", temporary[path]) in calls[: renamed[path]], path
        if path.parent.name == ".prepare":  # its folder synced after the rename
            assert ("fsync", str(path.parent)) in calls[renamed[path] :], path
    for job in jobs:
        marker = out / ".prepare" / job.marker
        synced = calls.index(("fsync", temporary[marker]))
        split = "val" if job.split == "val" else f"train/{job.args[0]}"
        for path in (path for path in written if path.relative_to(out).as_posix().startswith(split + "/")):
            assert renamed[path] < synced, path
            assert ("fsync", str(path.parent)) in calls[renamed[path] : synced], path
        assert ("fsync", str(out / job.split)) in calls[:synced], job.marker


def one_error_line(capsys, *args):
    """main() with these arguments, in this process (no second torch import): exit code 2 and one
    line, no traceback; this process's signal handlers given back (pytest's SIGINT, what a fork inherits)."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(sys, "argv", [str(SCRIPT), *map(str, args)])
            try:
                code = prepare_imagenet.main()
            except SystemExit as exit:  # argparse's
                code = exit.code
        assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    out, err = capsys.readouterr()
    lines = (out + err).strip().splitlines()
    assert code == 2 and len(lines) == 1 and re.match(r"(prepare_imagenet\.py: )?error: ", lines[0]), (
        out + err
    )  # argparse's
    return lines[0]


def test_a_full_disk_is_one_line_of_exit_code_1_and_the_same_command_carries_on(archives, images, tmp_path):
    """A disk that cannot hold an image (here a file-size limit, a real failed write: EFBIG) in a worker: one line,
    exit code 1 (make room), not 2 (bad input); so with --shards (tools/make_shards.py's)."""
    for flags, out in (([], tmp_path / "folder"), (["--shards"], tmp_path / "shards")):
        command = shlex.join([str(PYTHON), str(SCRIPT), str(archives), str(out), "--skip-md5", *flags])
        full = run(["bash", "-c", f"ulimit -f 8 && exec {command}"], timeout=60)  # 8 KiB: the largest image is 10
        assert full.returncode == 1, full.stdout
        assert re.search(
            r"^error: cannot write .* \(File too large\): make room, then run the same command again", full.stdout, re.M
        ), full.stdout
        assert "Traceback" not in full.stdout
        assert_ok(prepare(archives, out, "--skip-md5", *flags))
    assert contents(tmp_path / "folder") == images
    # 64 bytes: the devkit's val labels, which this process writes itself, cannot be written (was a traceback)
    limited = "import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64)); "
    limited += "os.execv(sys.argv[1], sys.argv[1:])"
    full = run([PYTHON, "-c", limited, PYTHON, SCRIPT, archives, tmp_path / "labels", "--skip-md5"], timeout=60)
    assert full.returncode == 1 and full.stdout.strip().splitlines()[-1] == (
        f"error: cannot write to {tmp_path / 'labels'} (File too large): make room, then run the same command again"
    ), full.stdout


def test_the_archives_names_and_md5_sums_are_torchvision_s_and_the_tools_start_without_torch():
    from torchvision.datasets import imagenet

    assert prepare_imagenet.ARCHIVE_META == imagenet.ARCHIVE_META
    probe = (
        "import sys; sys.path.insert(0, 'tools'); import prepare_imagenet, make_shards; print('torch' in sys.modules)"
    )
    result = run([PYTHON, "-c", probe], timeout=60, prewarmed=False)
    assert (result.returncode, result.stdout) == (0, "False\n"), result.stdout[-500:]


def test_official_md5_checked_by_default(archives, prepared, tmp_path, capsys):
    """Also on a prepared folder, which stays whole: the refused rerun marks it unfinished no more (it did, before
    its MD5 check, and training then refused the whole folder)."""
    done = shutil.copytree(prepared[0], tmp_path / "done")
    for out in (tmp_path / "out", done):
        line = one_error_line(capsys, archives, out)
        assert "ILSVRC2012_img_train.tar does not have the official MD5" in line and "--skip-md5" in line, line
    assert not (done / UNFINISHED).exists()


def test_bad_input_is_one_line(archives, tmp_path, capsys):
    assert "nowhere: no such directory" in one_error_line(capsys, tmp_path / "nowhere", tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "lacks ILSVRC2012_img_train.tar" in one_error_line(capsys, empty, tmp_path / "out")
    (tmp_path / "a-file").write_text("")
    assert "cannot write to" in one_error_line(capsys, archives, tmp_path / "a-file" / "out", "--skip-md5")
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for archive in archives.iterdir():  # the train archive cut short
        data = archive.read_bytes()
        (corrupt / archive.name).write_bytes(data[: len(data) * 2 // 3] if "train" in archive.name else data)
    assert "ILSVRC2012_img_train.tar" in one_error_line(capsys, corrupt, tmp_path / "out2", "--skip-md5")
    assert "--resize" in one_error_line(capsys, archives, tmp_path / "out", "--resize", "0")


def test_bad_kaggle_layout_is_one_line(images, tmp_path, capsys):
    kaggle, out = make_kaggle(tmp_path / "kaggle", images), tmp_path / "out"
    labels = kaggle / "LOC_val_solution.csv"
    good = labels.read_text()
    labels.write_text(good.replace("ImageId,PredictionString", "ImageID,Predictions"))
    assert "does not start with the header ImageId,PredictionString" in one_error_line(capsys, kaggle, out)
    labels.write_text(good.replace("n01443537 1 2 30 40 n01443537 5 6 20 30", ""))
    number = next(number for number, row in enumerate(labels.read_text().splitlines(), 1) if row.endswith(","))
    assert f"line {number}: no ImageId, or no wnid" in one_error_line(capsys, kaggle, out)
    labels.write_text(good)
    (kaggle / prepare_imagenet.KAGGLE_ROOT / "train" / "n00000000").symlink_to("n00000000")  # a loop
    assert re.search(r"cannot list .*n00000000: Too many levels", one_error_line(capsys, kaggle, out))


def test_missing_scipy_is_one_line(archives, tmp_path):
    hidden = tmp_path / "no-scipy" / "scipy"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('scipy hidden by the test')\n")
    result = prepare(archives, tmp_path / "out", "--skip-md5", env=clean_env(PYTHONPATH=hidden.parent))
    assert result.returncode == 2 and result.stdout == (
        "error: reading the devkit's meta.mat needs scipy: pip install -r requirements-imagenet.txt\n"
    ), result.stdout


def test_kaggle_layout_gives_the_same_result(images, prepared, tmp_path):
    kaggle = make_kaggle(tmp_path / "imagenet-object-localization-challenge", images)
    out = tmp_path / "out"
    output = assert_ok(prepare(kaggle, out))
    assert contents(out) == contents(prepared[0])
    assert "4 classes, 20 train images, 8 val images" in output, output
    source = kaggle / "ILSVRC/Data/CLS-LOC/train/n01440764/n01440764_100.JPEG"
    assert (out / "train/n01440764/n01440764_100.JPEG").stat().st_ino == source.stat().st_ino  # linked, not copied


def test_train_one_epoch_on_the_prepared_folder(prepared, tmp_path):
    out = tmp_path / "run"
    assert_ok(
        run(
            [
                PYTHON,
                REPO / "train_dp.py",
                "--data",
                prepared[0],
                "--epochs",
                "1",
                "-a",
                "resnet18",
                "-b",
                "8",
                "-j",
                "1",
                "--train-crop-size",
                "32",
                "--val-resize-size",
                "32",
                "--val-crop-size",
                "32",
                "--output-dir",
                out,
            ],
            timeout=120,
        )
    )
    rows = (out / "log.csv").read_text().strip().splitlines()
    assert len(rows) == 2, rows  # the header and one epoch


def test_shards_straight_from_the_archives_are_those_make_shards_writes_from_the_folder(
    archives, prepared, images, tmp_path
):
    """--shards writes, from the official archives and from Kaggle's extracted copy, byte for byte the shards that
    tools/make_shards.py writes from the folder this script makes; an OUT_DIR holding the other kind is refused."""
    import make_shards
    from common.shards import scan_shards

    outs = {name: tmp_path / name for name in ("archives", "kaggle", "folder")}
    output = assert_ok(prepare(archives, outs["archives"], "--skip-md5", "--shards", "--shard-size", "3"))
    assert "wrote " in output and "4 classes, 20 train and 8 val images in shards of 3" in output, output
    assert_ok(prepare(make_kaggle(tmp_path / "kaggle-copy", images), outs["kaggle"], "--shards", "--shard-size", "3"))
    assert make_shards.main([str(prepared[0]), str(outs["folder"]), "--shard-size", "3", "--workers", "1"]) == 0

    def written(out):
        return {
            path.relative_to(out).as_posix(): path.read_bytes()
            for path in sorted(out.rglob("*"))
            if path.suffix in (".tar", ".txt")
        }

    assert written(outs["archives"]) == written(outs["folder"]) == written(outs["kaggle"])
    assert len(written(outs["folder"])) == 1 + 7 + 3  # classes.txt, 20 train and 8 val images by 3
    classes, train, val = scan_shards(outs["archives"])
    assert classes == sorted(CLASSES) and (len(train), len(val)) == (20, 8)
    refused = prepare(archives, prepared[0], "--skip-md5", "--shards")
    assert refused.returncode == 2 and refused.stdout.strip().splitlines() == [
        f"error: {prepared[0]} holds class folders: give the shards an OUT_DIR of their own"
    ], refused.stdout


def tree(root):
    """{relative path: bytes or None (a folder)} of everything under root."""
    return {path.relative_to(root): None if path.is_dir() else path.read_bytes() for path in root.rglob("*")}


def test_an_out_dir_where_it_reads_is_refused_before_anything_is_written(images, tmp_path, capsys):
    """An OUT_DIR that is, holds or lies inside an input (ARCHIVE_DIR's train/ or val/) would add its train/, val/
    and .prepare/ to the classes it reads; a source inside what OUT_DIR writes would be read while written. An
    OUT_DIR beside the inputs (ARCHIVE_DIR itself, or a folder of it, for archives or Kaggle's layout) is fine."""
    source = make_valprep(tmp_path / "extracted", images)
    inner = make_valprep(tmp_path / "outer" / "train" / "extracted", images)
    before = tree(tmp_path)
    for archive_dir, out, read in (
        (source, source / "train", source / "train"),
        (source, source, source / "train"),
        (source, source / "val" / "n01440764", source / "val"),
        (inner, tmp_path / "outer", inner / "train"),
    ):
        for shards in ([], ["--shards"]):
            line = one_error_line(capsys, archive_dir, out, *shards)
            assert line.startswith(f"error: OUT_DIR {out} would write {out}/") and f"where it reads {read}:" in line
    assert tree(tmp_path) == before
    assert_ok(prepare(source, source / "prepared"))
    assert contents(source / "prepared") == images


def test_shard_size_without_shards_and_shards_where_no_folder_can_be_made_are_one_line(images, tmp_path, capsys):
    source = make_valprep(tmp_path / "extracted", images)
    line = one_error_line(capsys, source, tmp_path / "out", "--shard-size", "5")
    assert "--shard-size 5 is for --shards" in line, line
    assert not (tmp_path / "out").exists()
    (tmp_path / "a-file").write_text("")
    line = one_error_line(capsys, source, tmp_path / "a-file", "--shards")
    assert line == f"error: cannot write to {tmp_path / 'a-file'}: File exists"  # (as tools/make_shards.py says it)

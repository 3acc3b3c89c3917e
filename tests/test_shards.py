"""Shards (tools/make_shards.py, --data DIR of shards): written in the folder's order and carried on after a crash
without rewriting a finished shard; trained on with every guarantee a folder has: bitwise the run of the folder they
came from, a sample that cannot be decoded skipped and named SHARD:KEY, exact validation under torchrun, bitwise
resume after a SIGKILL mid-epoch. A Hugging Face dataset made of the same folder (save_to_disk's, the Hub's parquet
files) trains bitwise as the folder, its broken rows skipped and named SPLIT[ROW], validation exact under torchrun."""

import re
import shutil
import signal
import sys
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch

from conftest import EXACT_MODEL, TINY, hf_copy, make_image_folder
from harness.ahead import ahead, once
from harness.jobs import Job, assert_ok, no_traceback_of_ours, run_prewarmed, script_command, torchrun_command
from harness.prewarm import worker_command
from harness.processes import PYTHON, REPO, clean_env, free_port

sys.path.insert(0, str(REPO / "tools"))
import make_shards
from common.folder_index import UNFINISHED
from common.shards import read_index, scan_shards

pytestmark = pytest.mark.e2e

RUN = [*TINY, *EXACT_MODEL, "-b", "8", "--epochs", "2"]


def broken_folder(tmp_path_factory):
    """24 train and 15 val images, plus in each split a JPEG cut short by a crash (readable: 24 and 15)."""
    root = make_image_folder(tmp_path_factory.mktemp("broken-folder"), train_per_class=8, val_per_class=5)
    for split in ("train", "val"):
        whole = next((root / split / "ring").iterdir()).read_bytes()
        (root / split / "ring" / "zz.cut.jpg").write_bytes(whole[: len(whole) // 3])
    return root


def sharded(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")  # (a process of its own: in-process, it would print into a test's capsys)
    assert_ok(
        run_prewarmed("tools/make_shards.py", [[once(broken_folder, tmp_path_factory), out, "--shard-size", "4"]])[0]
    )
    return out


def node_copy(shards, out):
    """A copy of the shards at another path, as on a node's local disk: copied without their times (their indexes no
    longer match them: node 1 indexes its copy again) and the first training sample of each shard broken on node 1
    alone (so only reading them tells the copies apart; same size, so the indexes still list the same samples)."""
    copy = shutil.copytree(shards, out / "node-1-copy", copy_function=shutil.copy)
    _, train, _ = scan_shards(shards)
    for first in sorted({int(train.shard_of.tolist().index(number)) for number in range(len(train.shards))}):
        shard, offset, size, _ = train.location(first)
        with open(copy / "train" / Path(shard).name, "r+b") as file:
            file.seek(offset)
            file.write(b"\0" * size)
    return copy


def training_runs(tmp_path_factory):
    """Together: train_dp.py on the folder, on its shards and on its Hugging Face copy (save_to_disk's); torchrun with
    3 processes on the shards and on the parquet copy; two "nodes" whose node 1 reads its own copy of the shards at
    another path; train_dp.py on the shards SIGKILLed in epoch 1, then resumed. name -> (result, output dir)."""
    folder, shards = once(broken_folder, tmp_path_factory), once(sharded, tmp_path_factory)
    out = tmp_path_factory.mktemp("shard-runs")
    copy, port = node_copy(shards, out), free_port()
    hf = {form: hf_copy(folder, out / f"hf-{form}", form) for form in ("disk", "parquet")}
    hf_env = clean_env(HF_DATASETS_CACHE=out / "hf-cache")  # (datasets' arrow copy of the parquet files)
    killed = [*RUN, "--data", shards, "--output-dir", out / "resumed", "--resume", "auto", "--checkpoint-interval", "1"]
    killed += ["--trainer", "tests.tiny_models:SlowSixthStep"]  # (epoch 1's last step: the kill lands before it ends)
    jobs = {
        "killed": Job(script_command("train_dp.py", *killed)),
        "folder": Job(script_command("train_dp.py", *RUN, "--data", folder, "--output-dir", out / "folder")),
        "shards": Job(script_command("train_dp.py", *RUN, "--data", shards, "--output-dir", out / "shards")),
        "hf": Job(script_command("train_dp.py", *RUN, "--data", hf["disk"], "--output-dir", out / "hf"), hf_env),
        "hf3": Job(
            torchrun_command(
                "train_ddp.py",
                3,
                *RUN,
                "-b",
                "9",
                "--epochs",
                "1",
                "--data",
                hf["parquet"],
                "--output-dir",
                out / "hf3",
            ),
            hf_env,
        ),
        "three": Job(
            torchrun_command(
                "train_ddp.py", 3, *RUN, "-b", "9", "--epochs", "1", "--data", shards, "--output-dir", out / "three"
            )
        ),
        **{
            f"node{rank}": Job(
                [
                    PYTHON,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes=2",
                    f"--node-rank={rank}",
                    "--nproc-per-node=1",
                    "--master-addr=127.0.0.1",
                    f"--master-port={port}",
                    *worker_command("train_ddp.py"),
                    *RUN,
                    "--epochs",
                    "1",
                    "--save-on",
                    "node",
                    "--data",
                    data,
                    "--output-dir",
                    out / f"node{rank}",
                ]
            )
            for rank, data in enumerate((shards, copy))
        },
    }
    try:
        jobs["killed"].wait_for(re.compile(r"^Epoch: \[1\] \[2/"), timeout=300)  # saved: step 1 or 2
        jobs["killed"].process.send_signal(signal.SIGKILL)
        jobs["killed"].finish(timeout=60)
        results = {
            name: CompletedProcess(job.process.args, *job.finish(timeout=300))
            for name, job in jobs.items()
            if name != "killed"
        }
    finally:
        for job in jobs.values():
            job.kill()
    saved = torch.load(out / "resumed" / "checkpoint.pth", weights_only=True)
    results["resumed"] = run_prewarmed("train_dp.py", [killed])[0]
    return {name: (result, out / name) for name, result in results.items()}, (saved["epoch"], saved["step_in_epoch"])


shard_runs = ahead(training_runs, "shard_runs")


def weights(folder):
    return torch.load(folder / "checkpoint.pth", weights_only=True)["state_dict"]


def losses(folder):
    return [row.split(",")[4] for row in (folder / "log.csv").read_text().splitlines()[1:]]


def test_the_same_images_in_shards_and_in_their_folder_give_bitwise_the_same_run(shard_runs):
    runs, _ = shard_runs
    (folder, folder_dir), (shards, shards_dir) = runs["folder"], runs["shards"]
    assert_ok(folder), assert_ok(shards)
    reference, trained = weights(folder_dir), weights(shards_dir)
    assert reference.keys() == trained.keys()
    assert all(torch.equal(reference[name], trained[name]) for name in reference)
    assert losses(folder_dir) == losses(shards_dir) and len(losses(folder_dir)) == 2
    assert progress(shards.stdout) == progress(folder.stdout) and progress(folder.stdout)


def test_a_hugging_face_copy_of_the_folder_gives_bitwise_its_run_broken_rows_named_and_validation_exact(shard_runs):
    """save_to_disk's form under train_dp.py: the folder's run, bitwise (its cut JPEGs skipped in both, named
    SPLIT[ROW]: FILE here); the parquet form under torchrun with 3 processes: each readable val image counted once (15
    of 16)."""
    runs, _ = shard_runs
    (folder, folder_dir), (hf, hf_dir) = runs["folder"], runs["hf"]
    output = assert_ok(hf)
    reference, trained = weights(folder_dir), weights(hf_dir)
    assert reference.keys() == trained.keys() and all(torch.equal(reference[name], trained[name]) for name in reference)
    assert losses(hf_dir) == losses(folder_dir) and progress(output) == progress(assert_ok(folder))
    named = set(re.findall(r"^warning: (?:rank \d: )?skipped (\S+): cannot decode it", output, re.MULTILINE))
    assert {re.sub(r"\[\d+\]", "[N]", name).rsplit("/", 2)[-1] for name in named} == {
        "train[N]:zz.cut.jpg",
        "validation[N]:zz.cut.jpg",
    }, named
    three = assert_ok(runs["hf3"][0])
    assert "world size 3" in three and re.findall(r" \* Acc@1 .*\((\d+) images\)", three) == ["15"], three[-3000:]
    assert no_traceback_of_ours(three) and "validation[" in (runs["hf3"][1] / "bad_images.txt").read_text()


def progress(output):
    """(epoch, step, loss, acc@1) of each progress line."""
    return re.findall(r"^Epoch: \[(\d+)\] \[ *(\d+)/\d+\]  loss (\S+)  acc@1 +(\S+)", output, re.MULTILINE)


def test_a_sample_that_cannot_be_decoded_is_skipped_and_named_shard_key_and_validation_is_exact(shard_runs):
    """torchrun with 3 processes (and the two nodes: 2): each readable val image counted once (15 of 16), the broken
    ones skipped, named SHARD:KEY and listed."""
    runs, _ = shard_runs
    result, out = runs["three"]
    output = assert_ok(result)
    assert "world size 3" in output and re.findall(r" \* Acc@1 .*\((\d+) images\)", output) == ["15"], output[-3000:]
    assert re.findall(r" \* Acc@1 .*\((\d+) images\)", assert_ok(runs["node0"][0])) == ["15"]
    named = set(re.findall(r"^warning: (?:rank \d: )?skipped (\S+): cannot decode it", output, re.MULTILINE))
    splits = [re.fullmatch(r"\S+/(train|val)/\1-\d{6}\.tar:ring/zz_cut", name) for name in named]
    assert all(splits) and sorted(split[1] for split in splits) == ["train", "val"], output[-3000:]
    listed = (out / "bad_images.txt").read_text()
    assert ".tar:ring/zz_cut" in listed and no_traceback_of_ours(output)


def test_each_node_reads_its_own_copy_of_the_shards_at_its_own_path(shard_runs):
    """Node 1's copy at another path, copied without the shards' times: it indexes its copy again, and reads it (the
    sample broken there alone is skipped there alone, named by the copy's path)."""
    runs, _ = shard_runs
    outputs = [assert_ok(runs[f"node{rank}"][0]) for rank in (0, 1)]
    skipped = re.findall(r"^warning: (?:rank \d: )?skipped (\S+): cannot decode it", "".join(outputs), re.MULTILINE)
    copy = runs["node1"][1].parent / "node-1-copy"
    own = [name for name in skipped if name.startswith(f"{copy}/train/")]
    assert own and all(re.fullmatch(rf"{copy}/train/train-\d{{6}}\.tar:\w+/\d+", name) for name in own), skipped
    assert all(f"{copy}/" not in name for name in re.findall(r"skipped (\S+)", outputs[0])), outputs[0][-3000:]
    assert all(read_index(path.with_suffix(".tar")) for path in copy.glob("*/*.idx"))  # they match their shards now


def test_a_run_on_shards_killed_mid_epoch_resumes_bitwise(shard_runs):
    runs, (epoch, step) = shard_runs
    result, out = runs["resumed"]
    output = assert_ok(result)
    assert epoch == 1 and step in (1, 2)
    assert re.search(rf"resumed from \S+checkpoint\.pth \(epoch 1, step {step}\)", output), output[-3000:]
    reference = weights(runs["shards"][1])
    assert all(torch.equal(reference[name], tensor) for name, tensor in weights(out).items())


def test_a_rerun_carries_on_after_a_crash_and_never_rewrites_a_finished_shard(tmp_path, tiny_data):
    out = tmp_path / "shards"
    assert_ok(run_prewarmed("tools/make_shards.py", [[tiny_data, out, "--shard-size", "5", "--workers", "2"]])[0])
    shards = sorted(out.glob("*/*.tar"))
    written = {path: (path.stat().st_mtime_ns, path.read_bytes()) for path in shards}
    crashed = out / "val" / "val-000001.tar"
    crashed.with_suffix(".idx").unlink()  # killed after the shard's rename, before its index
    stale = out / "train" / ".train-000004.tar.abc123.tmp"
    stale.write_bytes(b"half a shard")  # killed while writing a shard
    assert make_shards.main([str(tiny_data), str(out), "--shard-size", "5", "--workers", "1"]) == 0
    assert not stale.exists() and crashed.with_suffix(".idx").exists()
    for path in shards:
        assert path.read_bytes() == written[path][1]
        assert (path.stat().st_mtime_ns == written[path][0]) == (path != crashed), path


def test_a_rerun_with_other_options_or_a_missing_source_is_refused_in_one_line(tmp_path, tiny_data):
    out = tmp_path / "shards"
    assert make_shards.main([str(tiny_data), str(out), "--shard-size", "5", "--workers", "1"]) == 0
    other, missing = run_prewarmed(
        "tools/make_shards.py", [[tiny_data, out, "--shard-size", "6"], [tmp_path / "nothing", tmp_path / "out"]]
    )
    assert other.returncode == 2 and other.stdout.splitlines() == [
        f"error: {out} holds shards written with other options (shard_size 5 -> 6): give another OUT, or rerun the "
        "command that wrote them"
    ], other.stdout
    assert missing.returncode == 2 and missing.stdout.splitlines() == [
        f"error: SRC {tmp_path / 'nothing'} is not a folder"
    ], missing.stdout
    assert not (tmp_path / "out").exists()


def test_a_manifest_this_tool_did_not_write_is_refused_in_one_line(tmp_path, tiny_data, capsys):
    """Empty or cut short: a JSONDecodeError traceback; a list: taken for no manifest, none written, and a rerun with
    other options then added their shards to the first ones (the images read twice)."""
    for text in ("", '{"shard_size": 5', "[]", "null"):
        out = tmp_path / f"out-{text.encode().hex()}"
        out.mkdir()
        (out / "shards.json").write_text(text)
        assert make_shards.main([str(tiny_data), str(out), "--shard-size", "5", "--workers", "1"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: {out}/shards.json is not a manifest this tool writes (empty, damaged or another's): give another "
            f"OUT, or delete {out} to write the shards again"
        ]
        assert sorted(path.name for path in out.rglob("*")) == [".lock", "shards.json"]


def test_a_rerun_on_other_images_or_into_an_image_folder_is_refused_in_one_line(tmp_path, tiny_data, capsys):
    """A rerun after SRC changed (here a class renamed, then an image moved to another class: counts unchanged) kept
    the shards written with the old labels and wrote the new classes.txt: images trained under another class's name.
    An OUT holding class folders got shards beside them, and the scripts read the folder, not the shards."""
    source, out = shutil.copytree(tiny_data, tmp_path / "data"), tmp_path / "shards"
    assert make_shards.main([str(source), str(out), "--shard-size", "5", "--workers", "1"]) == 0
    before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
    refused = [
        f"error: {out} holds shards of other images than SRC's now (a class or an image added, removed, renamed or "
        f"moved since): give another OUT, or delete {out} to write them again"
    ]
    for split in ("train", "val"):
        (source / split / "ring").rename(source / split / "zebra")
    assert make_shards.main([str(source), str(out), "--shard-size", "5", "--workers", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == refused
    for split in ("train", "val"):
        (source / split / "zebra").rename(source / split / "ring")
    moved = sorted((source / "train" / "ring").iterdir())[0]
    moved.rename(source / "train" / "circle" / f"moved-{moved.name}")
    assert make_shards.main([str(source), str(out), "--shard-size", "5", "--workers", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == refused
    assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before
    (source / UNFINISHED).write_text("cd /d && python /r/tools/prepare_imagenet.py /a /src")  # (its OUT_DIR, stopped)
    assert make_shards.main([str(source), str(tmp_path / "new"), "--workers", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: SRC {source} is unfinished: cd /d && python /r/tools/prepare_imagenet.py /a /src stopped part-way "
        "through writing it, or is still writing it; run that command again to finish it (it carries on), then make "
        "the shards"
    ]
    (source / UNFINISHED).unlink()
    image_folder = shutil.copytree(tiny_data, tmp_path / "folder")
    assert make_shards.main([str(source), str(image_folder), "--workers", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {image_folder} holds class folders: give the shards an OUT of their own"
    ]
    assert sorted(image_folder.rglob("*.tar")) == []


def test_a_relative_src_of_csv_files_with_absolute_paths_keys_each_image_by_its_path_in_src(
    tmp_path, tiny_data, monkeypatch
):
    """Absolute paths in train.csv under SRC given relative: each image was keyed by its bare name (00000), so the
    classes' images of one name were refused as one key ("rename one"), and other names lost their folders."""
    source = shutil.copytree(tiny_data, tmp_path / "data")
    for split in ("train", "val"):
        rows = [f"{path},{path.parent.name}\n" for path in sorted((source / split).glob("*/*.jpg"))]
        (source / f"{split}.csv").write_text("".join(rows))
    monkeypatch.chdir(tmp_path)
    assert make_shards.main(["data", "shards", "--workers", "1"]) == 0
    _, train, _ = scan_shards(tmp_path / "shards")
    assert train.names[0] == "circle/00000.jpg" and len(train) == 24  # (keyed under train/, as from the folder)


def test_two_images_of_one_key_are_refused_in_one_line(tmp_path, tiny_data, capsys):
    """A key ends at the first dot of a name, so dots become "_": 00000.b.jpg and 00000_b.jpg would share one."""
    source = shutil.copytree(tiny_data, tmp_path / "data")
    first = sorted((source / "train" / "ring").iterdir())[0]
    for name in ("00000.b.jpg", "00000_b.jpg"):
        shutil.copy(first, first.with_name(name))
    assert make_shards.main([str(source), str(tmp_path / "out"), "--workers", "1"]) == 2
    folder = source / "train" / "ring"
    assert capsys.readouterr().err.splitlines() == [
        f"error: two train images of {source.resolve()} have the same key ring/00000_b (their paths without the "
        f"extension, dots made _): {folder / '00000.b.jpg'} and {folder / '00000_b.jpg'}: rename one"
    ]
    assert not (tmp_path / "out").exists()


def test_a_source_without_val_is_named_as_make_shards_names_it_src(tmp_path, tiny_data, capsys):
    """common/folder_index.py says it of the training scripts' --data; make_shards has no --data flag."""
    source = shutil.copytree(tiny_data / "train", tmp_path / "data" / "train").parent
    assert make_shards.main([str(source), str(tmp_path / "out"), "--workers", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: SRC {source} has no val/ folder: expected {source}/{{train,val}}/<class>/<image>"
    ]
    (source / "train.csv").write_text("train/ring/00000.jpg,ring\n")
    assert make_shards.main([str(source), str(tmp_path / "out"), "--workers", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: SRC {source} has train.csv but no val.csv: give both splits"
    ]
    assert not (tmp_path / "out").exists()


def test_an_out_that_cannot_be_made_is_refused_in_one_line_with_nothing_written(tmp_path, tiny_data, capsys):
    """As tools/prepare_imagenet.py says it: `cannot write to OUT: why`, exit code 2, no traceback."""
    (tmp_path / "a-file").write_text("")
    for out, why in (
        (tmp_path / "a-file", "File exists"),
        (tmp_path / "a-file" / "out", "Not a directory"),
        (Path("/proc/no-such-folder"), "No such file or directory"),
    ):
        assert make_shards.main([str(tiny_data), str(out), "--workers", "1"]) == 2
        assert capsys.readouterr().err.splitlines() == [f"error: cannot write to {out}: {why}"]
    assert [path.name for path in tmp_path.iterdir()] == ["a-file"] and not (tmp_path / "a-file").read_text()


def test_an_out_where_it_reads_is_refused_before_anything_is_written(tmp_path, tiny_data, capsys):
    """OUT in SRC's train/ or val/ (or SRC itself) would add train/ and val/ to its classes; SRC inside OUT's train/
    would be read while written. An OUT beside them, in SRC, is fine."""
    source = shutil.copytree(tiny_data, tmp_path / "data")
    inner = shutil.copytree(tiny_data, tmp_path / "outer" / "train" / "data")
    before = sorted(tmp_path.rglob("*"))
    for src, out, read in (
        (source, source / "train", source / "train"),
        (source, source, source / "train"),
        (source, source / "val" / "ring", source / "val"),
        (inner, tmp_path / "outer", inner / "train"),
    ):
        assert make_shards.main([str(src), str(out), "--workers", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: OUT {out} would write {out}/") and f"where it reads {read}:" in err, err
        assert len(err.splitlines()) == 1, err
    assert sorted(tmp_path.rglob("*")) == before
    assert make_shards.main([str(source), str(source / "shards"), "--workers", "1"]) == 0

"""common/run_dir.py: a file written is whole or absent (a write that fails half-way leaves the old one, and no
temporary), temporaries of names no other process may take, and the output directory's lock: one run at a time, the
second refused in one line naming the first, released however the first ends, waited for by a restarted job."""

import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common import checkpoint, run_dir
from common.errors import NoRoom, UsageError
from common.run_dir import OutputLock, atomic_export, atomic_write, link_or_copy
from harness.processes import PYTHON, REPO


def test_a_write_that_fails_half_way_leaves_the_old_file_whole_and_no_temporary(tmp_path):
    path = tmp_path / "log.csv"
    atomic_write(path, lambda file: file.write(b"the old file\n"))

    def half_then_full_disk(file):
        file.write(b"the new fi")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, half_then_full_disk)
    assert path.read_bytes() == b"the old file\n" and os.listdir(tmp_path) == ["log.csv"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~run_dir._UMASK


def test_a_checkpoint_s_temporary_file_never_takes_a_name_another_process_may_write(tmp_path):
    """Temporary names once held only the PID, which a process in another container can share: its half-written
    file would have been renamed over the checkpoint."""
    import torch

    state = {"state_dict": {"w": torch.ones(2)}, "epoch": 1}
    others = [tmp_path / f".checkpoint.pth.tmp-{os.getpid()}", tmp_path / f".checkpoint_prev.pth.tmp-{os.getpid()}"]
    for other in others:
        other.write_bytes(b"another process's bytes")
    checkpoint.save_checkpoint(state, tmp_path, is_best=True)
    checkpoint.save_checkpoint(state, tmp_path, is_best=True)
    assert all(other.read_bytes() == b"another process's bytes" for other in others)
    saved = checkpoint.load_checkpoint(tmp_path / "checkpoint.pth")
    assert saved["epoch"] == 1 and len(saved["checkpoint_id"]) == 32
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        ["checkpoint.pth", "checkpoint_prev.pth", "model_best.pth", *(other.name for other in others)]
    )
    assert (tmp_path / "checkpoint.pth").stat().st_mode & 0o777 == 0o666 & ~run_dir._UMASK


def test_link_or_copy_gives_a_second_name_to_the_same_bytes(tmp_path):
    (tmp_path / "a").write_bytes(b"bytes")
    link_or_copy(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == b"bytes" and (tmp_path / "b").stat().st_ino == (
        tmp_path / "a"
    ).stat().st_ino
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]
    link_or_copy(tmp_path / "a", tmp_path / "b")  # again (a class redone by tools/prepare_imagenet.py)
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]  # (was: the temporary left, the rename over b a no-op)


HOLDER = """import sys, time
sys.path.insert(0, {repo!r})
from common.run_dir import OutputLock
lock = OutputLock({out!r})
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def held(tmp_path):
    """A process of its own that holds the lock of tmp_path/run (lockf: locks are a process's), and that directory."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [PYTHON, "-c", HOLDER.format(repo=str(REPO), out=str(out))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder, out
    finally:
        holder.kill()
        holder.wait()


def test_a_second_run_is_refused_in_one_line_naming_the_first_until_the_first_ends(held):
    holder, out = held
    with pytest.raises(
        UsageError,
        match=rf"^{out} is in use by another run \(host \S+, PID {holder.pid}, started \S+\): "
        r"one run at a time writes an output directory; wait for that one to end, or "
        r"give this one another --output-dir$",
    ):
        OutputLock(out)
    # --save-on node: the other node of this job may be the holder, which waiting would not end (was not said)
    from common.run import take_output_dir
    from conftest import built_trainer

    trainer = built_trainer("--dummy", "--dummy-size", "8", "-b", "4", "--save-on", "node", "--output-dir", out)
    assert str(take_output_dir(trainer)[1]).endswith(
        "another --output-dir (with --save-on node, this job's other nodes write there too: give each node a disk of "
        "its own)"
    )
    holder.kill()  # SIGKILL: no exit handler runs; the kernel drops the lock
    holder.wait()
    assert OutputLock(out).warning is None


def test_a_restarted_job_waits_for_the_lock_of_the_one_it_replaces(held):
    holder, out = held
    said = []
    start = time.monotonic()
    with pytest.raises(UsageError, match="is in use by another run"):
        OutputLock(out, wait=1.5, say=said.append)
    assert time.monotonic() - start >= 1.5
    assert len(said) == 1 and said[0].startswith(
        f"waiting up to 2 s for the run this job replaces to release {out}/run.lock"
    )


def test_a_run_that_ends_before_it_wrote_leaves_no_directory_it_made(tmp_path):
    """Also where it indexed read-only shards before their bad label stopped it (was: run.lock and shard-indexes/
    left in it)."""
    lock = OutputLock(tmp_path / "runs" / "new")  # (runs/ too, made by it: a first run's)
    (tmp_path / "runs" / "new" / "shard-indexes").mkdir()
    (tmp_path / "runs" / "new" / "shard-indexes" / "train-000000-0123456789abcdef.idx").write_bytes(b"PK")
    lock.abandon()
    assert not (tmp_path / "runs").exists()
    (tmp_path / "old").mkdir()
    OutputLock(tmp_path / "old").abandon()
    assert (tmp_path / "old").exists()  # not made by this run: left as it was
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(UsageError, match="cannot write to --output-dir"):
        OutputLock(tmp_path / "a-file" / "run")


def test_an_output_dir_that_cannot_be_had_is_one_line_and_the_folder_it_made_is_removed(tmp_path, monkeypatch):
    """A name longer than 255 bytes (was: OSError's traceback, from exists()); a folder made but then not writable
    (umask 0777 for a user that is not root: made, mode 000) is removed (was: left behind)."""
    with pytest.raises(UsageError, match=r"^cannot write to --output-dir \S+ \(File name too long\)"):
        OutputLock(tmp_path / ("a" * 256))
    real_open = os.open

    def refused(path, *args, **kwargs):
        if str(path).endswith(run_dir.LOCK):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(UsageError, match=r"^cannot write to --output-dir \S+ \(Permission denied\)"):
        OutputLock(tmp_path / "runs" / "made")  # (runs/ too: missing at a first run)
    assert sorted(tmp_path.iterdir()) == []


def test_a_file_rendezvous_a_running_job_holds_is_refused_to_a_second_job_of_one_node(tmp_path):
    """Two train_spawn.py jobs of a sweep given one --dist-url file://PATH: the second joined the first's store (a
    hang, a traceback, or a line about another process's error). With several nodes it takes its shared lock, as
    its own nodes started before node 0 hold theirs."""
    path = tmp_path / "rendezvous"
    hold = f"import fcntl, os, time; fd = os.open({str(path)!r} + '.owner', os.O_RDWR | os.O_CREAT); "
    hold += "fcntl.lockf(fd, fcntl.LOCK_SH); print('held', flush=True); time.sleep(60)"
    holder = subprocess.Popen([PYTHON, "-c", hold], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(UsageError, match=rf"^rendezvous file {path} is in use by a running job \(it holds "):
            run_dir.claim_rendezvous_file(path, 0, nnodes=1)
        run_dir.claim_rendezvous_file(path, 0, nnodes=2)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
        if run_dir._rendezvous_owner is not None:
            os.close(run_dir._rendezvous_owner)
            run_dir._rendezvous_owner = None


def test_the_lock_s_holder_removes_the_temporaries_a_killed_run_left_and_nothing_else(tmp_path):
    """Seen: a SIGKILL while a checkpoint was written left .checkpoint.pth.XXXXXXXX.tmp (65 MB for resnet50), which no
    later run removed."""
    out = tmp_path / "run"
    for folder in ("metrics", "profile", "memory"):
        (out / folder).mkdir(parents=True)
    fd, half_written = run_dir.temporary_beside(out / "checkpoint.pth")
    os.write(fd, b"x" * 3_000_000)
    os.close(fd)
    left = [
        half_written,
        out / f".checkpoint_prev.pth.{'ab12' * 8}.tmp",
        out / "metrics" / ".val_epoch0.json.k2j4_x9z.tmp",
        out / "profile" / ".rank0.json.a1b2c3d4.tmp",  # (atomic_export's: a trace, a snapshot, killed while written)
        out / "memory" / ".oom-rank0.pickle.a1b2c3d4.tmp",
    ]
    for path in left[1:]:
        path.write_bytes(b"y")
    kept = [out / "notes.tmp", out / ".notes.tmp", out / ".mine.ABCDEFGH.tmp", out / ".backup.20240612.tmp"]
    kept.append(out / "checkpoint.pth")
    for path in kept:
        path.write_bytes(b"z")
    said = []
    OutputLock(out, say=said.append)
    assert not any(path.exists() for path in left) and all(path.exists() for path in kept)
    assert said == [
        f"note: removed 5 temporary file(s) of 2.9 MiB from {out}, left by a run killed while it wrote them"
    ]


STOPPING_HOLDER = """import sys, time
sys.path.insert(0, {repo!r})
from common.run_dir import OutputLock
lock = OutputLock({out!r})
lock.mark_stopping("SIGTERM")
print("stopping", flush=True)
time.sleep(2)
"""


def test_a_stop_on_a_full_disk_leaves_the_lock_as_it_was_and_a_start_there_is_one_line_exit_code_1(tmp_path):
    """The lock's "stopping" write on a full disk raised from the stop signal's handler (a run that should stop with a
    checkpoint failed without one); the lock taken on a full disk is NoRoom, shared with every rank (check_start). A
    real failed write: a file size limit (EFBIG, as a quota)."""
    lock = OutputLock(tmp_path / "run", wait=0, say=print)
    before = (tmp_path / "run" / "run.lock").read_bytes()
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10, limits[1]))
    try:
        lock.mark_stopping("SIGTERM")
        with pytest.raises(NoRoom, match=r"\(File too large\): make room, then run it again$"):
            OutputLock(tmp_path / "other", wait=0, say=print)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert lock.stopping and (tmp_path / "run" / "run.lock").read_bytes() == before


def test_a_run_started_while_the_holder_is_stopping_waits_for_it_instead_of_being_refused(tmp_path):
    """A holder that marked its lock as stopping (its launcher ended, a stop signal came) and ends 2 s later: a new
    run (no restart: wait 0) waits for it, says so once, and then holds the lock."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [PYTHON, "-c", STOPPING_HOLDER.format(repo=str(REPO), out=str(out))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "stopping\n"
        said, asked = [], time.monotonic()
        lock = OutputLock(out, say=said.append)
        waited = time.monotonic() - asked
        assert holder.wait(timeout=10) == 0 and waited >= 1.5  # taken once the holder ended, not before
        assert lock.warning is None and len(said) == 1
        assert said[0].startswith(
            f"waiting up to 180 s for the run this job replaces to release {out}/run.lock (host "
        ) and said[0].endswith(", stopping on SIGTERM)")
    finally:
        holder.kill()
        holder.wait()


def test_a_trace_or_snapshot_killed_while_written_leaves_the_one_before_whole(tmp_path):
    """torch's writers of a file by its name (export_chrome_trace, _dump_snapshot) wrote straight to it: a run killed
    while writing a large trace left half of one, profile/rank0.json."""
    path = tmp_path / "rank0.json"
    path.write_text("the trace before")

    def killed(name):
        Path(name).write_text('{"traceEvents": [')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_export(path, killed)
    assert path.read_text() == "the trace before" and [p.name for p in tmp_path.iterdir()] == ["rank0.json"]
    atomic_export(path, lambda name: Path(name).write_text("the trace after"))
    assert path.read_text() == "the trace after" and [p.name for p in tmp_path.iterdir()] == ["rank0.json"]

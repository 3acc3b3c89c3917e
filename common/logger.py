"""What a run leaves behind: console lines (rank 0), log.csv, TensorBoard, args.json, summary.json.

Only the process that writes checkpoints writes files; every other process
gets a RunLogger that prints and writes nothing.
"""

import contextlib
import csv
import io
import json
import math
import shutil
import time
from pathlib import Path

from .checkpoint import SingleFile
from .errors import ESCAPED, say, unwritable_output
from .metrics import MetricSums
from .run_dir import atomic_write
from .sharded_checkpoint import ShardedCheckpoints

# What limits the run (common/diagnostics.py): input wait (mean and slowest rank), the GPU's idle share between steps,
# achieved rate and utilisation, peak memory; empty where not measured (GPU figures on the CPU, a model whose FLOPs
# could not be counted).
DIAGNOSTICS = [
    "input_wait_pct",
    "input_wait_pct_max",
    "gpu_idle_pct",
    "tflops_per_device",
    "mfu_pct",
    "gpu_peak_allocated_mib",
    "gpu_peak_reserved_mib",
    "host_peak_rss_mib",
    "worker_peak_rss_mib",
]
CSV_FIELDS = [
    "epoch",
    "start_time",
    "seconds",
    "lr",
    "train_loss",
    "train_acc1",
    "val_loss",
    "val_acc1",
    "val_acc5",
    "images_per_second",
    "bad_images",
    *DIAGNOSTICS,
]
EMA_FIELDS = ["ema_val_loss", "ema_val_acc1", "ema_val_acc5"]  # with --model-ema, after the others
MEASURED = ["start_time", "seconds", "images_per_second", *DIAGNOSTICS]  # columns that differ between equal runs
NOT_PLOTTED = ("epoch", "start_time", "seconds", "bad_images")  # log.csv columns that are no curve in TensorBoard
# Per-step TensorBoard scalars (every -p steps, global step on the x axis), as the progress line shows them: in
# tensorboard/steps/, a run of their own beside tensorboard/'s per-epoch scalars (epoch on the x axis). Each axis is
# a run's, and TensorBoard's purge_step, which hides what an interrupted run logged past a resume, is one per run.
STEP_TAGS = {
    "loss": "step/train_loss",
    "acc1": "step/train_acc1",
    "lr": "step/lr",
    "images_per_second": "step/images_per_second",
    "input_wait_pct": "step/input_wait_pct",
}


# Every kind of run's checkpoints: a fresh run in a directory (--overwrite) deletes them all, train_fsdp.py's sharded
# ones (common/sharded_checkpoint.py) in a run of train_dp.py too, so that no --resume auto finds an earlier run's.
RUN_CHECKPOINTS = tuple(dict.fromkeys((*SingleFile.names, *ShardedCheckpoints.names)))
# The folders of a run's own files, and their names: a fresh run deletes these (a researcher's files there stay).
# metrics/: the metrics' tensors; profile/: --profile's traces; memory/: a GPU's out-of-memory snapshots;
# nccl_trace/: NCCL's Flight Recorder dumps.
RUN_FOLDERS = {
    "metrics": ("train_epoch*.json", "val_epoch*.json", "ema_val_epoch*.json"),
    "profile": ("rank*.json",),
    "memory": ("oom-rank*.pickle",),
    "nccl_trace": ("rank_*",),
}


def epoch_row(epoch, start, lrs, train, val, ema_val, bad_images):
    """log.csv's row of an epoch begun at `start` (time.time()), with each parameter group's lr `lrs`: CSV_FIELDS
    (lr: the first group's; lr_group1, ...: the others', where they differ; DIAGNOSTICS: those in train["diagnostics"]),
    EMA_FIELDS where `ema_val` is given, then each named value (train_NAME, val_NAME, ema_val_NAME)."""
    speed = train["images_per_second"]
    row = {
        "epoch": epoch,
        "start_time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(start)),  # (a resume in another zone)
        "seconds": round(time.time() - start, 3),
        "lr": lrs[0],
        "train_loss": train["loss"],
        "train_acc1": train["acc1"],
        "val_loss": val["loss"],
        "val_acc1": val["acc1"],
        "val_acc5": val["acc5"],
        "images_per_second": None if speed is None else round(speed, 1),  # (None: resumed after its last step)
        "bad_images": len(bad_images),
        **train.get("diagnostics", {}),
    }
    if len(set(lrs)) > 1:
        row.update({f"lr_group{index}": lr for index, lr in enumerate(lrs) if index})
    if ema_val is not None:
        row.update({field: ema_val[field.removeprefix("ema_val_")] for field in EMA_FIELDS})
        row.update(MetricSums.extra(ema_val, "ema_val_"))
    return {**row, **MetricSums.extra(train, "train_"), **MetricSums.extra(val, "val_")}


def write_text(path, text):
    atomic_write(path, lambda file: file.write(text.encode()))


class RunLogger:
    def __init__(self, output_dir, prints, writes):
        self.output_dir, self.prints, self.writes = Path(output_dir), prints, writes
        self.tensorboard = self.step_tensorboard = None
        self.fields = CSV_FIELDS

    def print(self, message):
        if self.prints:
            say(message)

    def start(self, config, resumed, ema=False, global_step=0, epochs_done=None):
        """Create the output dir and write args.json; a fresh run starts a fresh log.csv (with the EMA's
        columns when `ema`). A resumed run at `global_step` (optimizer steps) after `epochs_done` epochs hides the
        TensorBoard scalars that the interrupted one logged after them (they are logged again)."""
        if not self.writes:
            return
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            write_text(self.output_dir / "args.json", json.dumps(vars(config), indent=2, default=str))
        except OSError as error:
            raise unwritable_output(self.output_dir, error) from None
        log = self.output_dir / "log.csv"
        if not resumed:
            # A fresh run (the trainer refused it where a run's checkpoints were, unless --overwrite):
            # nothing of an earlier run in this directory may pass for this one's.
            for name in (*RUN_CHECKPOINTS, "summary.json", "bad_images.txt"):
                path = self.output_dir / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            for name, patterns in RUN_FOLDERS.items():
                folder = self.output_dir / name
                for path in [path for files in patterns for path in folder.glob(files)] if folder.is_dir() else []:
                    if path.is_file() or path.is_symlink():  # (a folder of that name: a researcher's)
                        path.unlink()
                with contextlib.suppress(OSError):  # (not there, or not empty: a researcher's own files in it)
                    folder.rmdir()
            for events in self.output_dir.glob("tensorboard/**/events.out.tfevents.*"):
                events.unlink()
        else:  # a run that goes on is not finished: its summary.json (of fewer --epochs, say) would pass for this one's
            (self.output_dir / "summary.json").unlink(missing_ok=True)
        self.fields = CSV_FIELDS + EMA_FIELDS if ema else list(CSV_FIELDS)
        if not resumed or not log.exists():
            self._rewrite_log([])
        else:
            with open(log, newline="") as file:
                header, *rows = list(csv.reader(file)) or [[]]
            # Rows of epochs the checkpoint does not hold (logged while an --async-checkpoint write was under way,
            # which a kill then cut short) are trained again: they go.
            kept = rows if epochs_done is None else [row for row in rows if row and int(row[0]) < epochs_done]
            if header[: len(self.fields)] == self.fields:
                self.fields = header  # as it was (the EMA's and named values' columns of earlier legs stay)
            else:  # a run begun without --model-ema: its rows lack the EMA's columns
                self.fields += [field for field in header if field not in self.fields]
            if kept != rows or self.fields != header:
                self._rewrite_log([dict(zip(header, row)) for row in kept])
        from torch.utils.tensorboard import SummaryWriter  # imported here: slow, and rank 0 only

        # purge_step: TensorBoard hides the run's events at and after it in the earlier files. A run begun before
        # tensorboard/steps/ has its per-step scalars in tensorboard/ (more files there: a launch writes one in each
        # since): purged at the step, as then.
        folder, events = self.output_dir / "tensorboard", "events.out.tfevents.*"
        older = len(list(folder.glob(events))) > len(list(folder.glob(f"steps/{events}")))
        self.tensorboard = SummaryWriter(
            str(folder), purge_step=(global_step + 1 if older else epochs_done) if resumed else None
        )
        self.step_tensorboard = SummaryWriter(
            str(self.output_dir / "tensorboard" / "steps"), purge_step=global_step + 1 if resumed else None
        )

    def _rewrite_log(self, rows):
        """log.csv anew with the header self.fields and `rows` (dicts; a column a row lacks stays empty)."""
        text = io.StringIO()
        csv.writer(text).writerows([self.fields, *([row.get(field, "") for field in self.fields] for row in rows)])
        write_text(self.output_dir / "log.csv", text.getvalue())

    def last_row(self):
        """log.csv's last row, its numbers as floats (an empty cell: None); {} where there is none."""
        try:
            with open(self.output_dir / "log.csv", newline="") as file:
                row = list(csv.DictReader(file))[-1]
        except (OSError, IndexError):
            return {}
        numbers = {}
        for name, value in row.items():
            try:
                numbers[name] = float(value)
            except (TypeError, ValueError):
                numbers[name] = None
        return numbers

    def log_epoch(self, row):
        """One row of log.csv and its numbers in TensorBoard. A value this log has no column for yet (a
        named value of Trainer.train_step / evaluate_step) gets a new last column: the file is rewritten
        with it, earlier rows empty there."""
        if not self.writes:
            return
        new = [field for field in row if field not in self.fields]
        if new:
            with open(self.output_dir / "log.csv", newline="") as file:
                header, *rows = list(csv.reader(file))
            self.fields += new
            self._rewrite_log([dict(zip(header, line)) for line in rows] + [row])
        else:
            with open(self.output_dir / "log.csv", "a", newline="") as file:
                csv.writer(file).writerow([row.get(field, "") for field in self.fields])
        for key, value in row.items():
            if key not in NOT_PLOTTED and isinstance(value, (int, float)):
                self.tensorboard.add_scalar(key, value, row["epoch"])
        self.tensorboard.flush()

    def log_step(self, global_step, values):
        """The per-step scalars of a progress line (STEP_TAGS, and step/train_NAME for each named value), at
        `global_step` (steps done in the run), flushed: TensorBoard shows them at once, and a run killed later
        loses none of them."""
        if self.writes and self.step_tensorboard is not None:
            for key, value in values.items():
                self.step_tensorboard.add_scalar(STEP_TAGS.get(key, f"step/train_{key}"), value, global_step)
            self.step_tensorboard.flush()

    def write_tables(self, epoch, summaries):
        """metrics/SPLIT_epochE.json: the tensor results of the metrics (Trainer.build_metrics) of each split's
        summary (MetricSums.summary()) of `epoch`, as nested lists by name; nothing where a split has none."""
        for split, summary in summaries.items():
            tables = MetricSums.tables(summary)
            if self.writes and tables:
                (self.output_dir / "metrics").mkdir(exist_ok=True)
                text = strict_json({name: table.tolist() for name, table in tables.items()})
                write_text(self.output_dir / "metrics" / f"{split}_epoch{epoch}.json", text)

    def write_bad_images(self, found):
        """bad_images.txt: one `path<TAB>reason` line per file skipped as undecodable (none: no file); a name's bytes
        as they are, but for what would split or hide a line (ESCAPED: \\, \\t, \\n, \\r, \\xNN, \\u2028)."""
        if self.writes and not found:
            (self.output_dir / "bad_images.txt").unlink(missing_ok=True)  # an earlier epoch's: those read again
        elif self.writes:
            lines = "".join(
                f"{str(path).translate(ESCAPED)}\t{str(reason).translate(ESCAPED)}\n" for path, reason in found
            )
            atomic_write(
                self.output_dir / "bad_images.txt", lambda file: file.write(lines.encode("utf-8", "surrogateescape"))
            )

    def finish(self, summary):
        if not self.writes:
            return
        write_text(self.output_dir / "summary.json", strict_json(summary, indent=2))
        for writer in (self.tensorboard, self.step_tensorboard):
            if writer:
                writer.close()


def strict_json(value, **options):
    """`value` as JSON that every reader parses: NaN and infinities as null (Python's NaN, Infinity are not JSON: a
    loss of NaN, a masked criterion's batch with no image counted, made summary.json unreadable to JSON.parse)."""

    def finite(item):
        if isinstance(item, dict):
            return {key: finite(entry) for key, entry in item.items()}
        if isinstance(item, (list, tuple)):
            return [finite(entry) for entry in item]
        return None if isinstance(item, float) and not math.isfinite(item) else item

    return json.dumps(finite(value), allow_nan=False, **options)

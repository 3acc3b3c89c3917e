"""Files that cannot be decoded: skipped and reported, or (--strict-data) the end of the run.

A large data set on a shared file system nearly always holds a few broken files (truncated
copies, empty files, a disk error). By default such a file is skipped: in training another
image takes its place, so every batch keeps its size and every rank its number of steps; in
validation it is left out, so no other image is counted twice. Each process warns once per
file, and at each checkpoint the ranks pool what they found: the writer rank lists the files
in OUTPUT/bad_images.txt and log.csv / summary.json carry their number. A skipped file is read
again each time it comes up: the list is the epoch's, so a file that a transient outage made
unreadable leaves it once it reads again. A validation that cannot read more than
MAX_UNREADABLE_SHARE of its images (or any) ends the run: its accuracy would mean nothing.
"""
import re

from torch.utils.data import Dataset

from . import distributed
from .errors import BadItem, Preempted, UnreadableImage, UsageError, say

MAX_IN_A_ROW = 50  # more consecutive failures than this is no broken file but unreadable data (or a bug)
MAX_UNREADABLE_SHARE = 0.1  # of the validation set: more is no broken file but an unreadable set


# Errors of a dataset's own code, not of an unreadable file: never skipped, their traceback is the report.
PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, ImportError, AssertionError, BadItem)


def printable(path):
    """A file name that is not UTF-8 (its bytes kept as surrogates), with those bytes escaped."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def describe(error):
    """The decoder's reason, on one line and without PIL's file-object repr (a file's, or the BytesIO of a shard's
    sample or a Hugging Face row)."""
    reason = re.sub(r" ?<_io\.\w+ (?:name=[^>]*|object at 0x[0-9a-fA-F]+)>", "", " ".join(str(error).split()))
    return (reason or type(error).__name__)[:200]


class SkipUnreadable(Dataset):
    """(image, label, bad) for each item of `dataset`, where `bad` lists the (name, reason) of the items that could
    not be read on the way, named by the dataset's name(i) if it has one (else "Class[i]"). `check(item, i)`, when
    given, makes a dataset's item what the loaders take (datasets.ItemCheck). An error of the dataset's own code
    (PROGRAMMING_ERRORS) is raised, not skipped. replace=True (training): the next readable item takes a bad one's
    place; replace=False (validation): image is None. strict=True: raise UnreadableImage instead."""

    def __init__(self, dataset, replace, strict, check=None):
        self.dataset, self.replace, self.strict, self.check = dataset, replace, strict, check

    def __len__(self):
        return len(self.dataset)

    def _read(self, index):
        item = self.dataset[index]
        return item if self.check is None else self.check(item, index)

    def _name(self, index):
        """What warnings and bad_images.txt call item `index`: the dataset's name for it (an image file's path)."""
        if hasattr(self.dataset, "name"):
            return self.dataset.name(index)
        return f"{type(self.dataset).__name__}[{index}]"

    def __getitem__(self, index):
        bad = []
        for attempt in range(MAX_IN_A_ROW):
            position = (index + attempt) % len(self.dataset)
            try:
                image, label = self._read(position)
                return image, label, bad
            except (MemoryError, Preempted):  # (a stop signal raised while this process waited for the file)
                raise
            except PROGRAMMING_ERRORS:
                raise
            except Exception as error:  # decoders raise OSError, ValueError, RuntimeError, SyntaxError, ...
                path = self._name(position)
                if self.strict:
                    raise UnreadableImage(f"cannot decode {printable(path)} ({describe(error)}); without --strict-data "
                                          "such files are skipped and listed in bad_images.txt") from None
                bad.append((path, describe(error)))
                if not self.replace:
                    return None, None, bad
        raise UnreadableImage(f"{MAX_IN_A_ROW} files in a row cannot be decoded, from {printable(bad[0][0])} on "
                              f"({bad[0][1]}): is the data set readable?")


class BadImageLog:
    """What the run could not read in the epoch in progress; a warning line the first time each file is met."""

    def __init__(self, rank, world_size):
        self.prefix = f"rank {rank}: " if world_size > 1 else ""
        self.found = {}  # path -> reason, this epoch, of every rank as of the last sync and of this one since
        self.new = {}  # this process's since the last sync: all that sync() gathers
        self.warned = set()
        self.in_validation = {}  # this process's, this epoch: check_validation's example is one of them

    def report_validation(self, bad):
        self.in_validation.update(bad)
        self.report(bad)

    def report(self, bad):
        for path, reason in bad:
            if path not in self.found:
                self.found[path] = self.new[path] = reason
            if path not in self.warned:
                self.warned.add(path)
                say(f"warning: {self.prefix}skipped {printable(path)}: cannot decode it ({reason})")

    def next_epoch(self):
        """Files that could not be read are read again; the list starts afresh."""
        self.found, self.new, self.in_validation = {}, {}, {}

    def sync(self):
        """Pool every rank's findings since the last sync (a collective: all ranks call it at the same point).
        Returns the sorted [path, reason] pairs of the epoch."""
        for found in distributed.all_gather_object(self.new):
            self.found.update(found)
        self.new = {}
        return sorted([path, reason] for path, reason in self.found.items())

    def state_dict(self):
        """The epoch's files so far, of every rank (a collective: sync)."""
        return self.sync()

    def load_state_dict(self, found):
        self.found = dict(found)
        self.warned |= set(self.found)

    def check_validation(self, counted, total):
        """UsageError when a validation counted none of its `total` images, or left out more than
        MAX_UNREADABLE_SHARE of them. Call it on every rank, with the counts of all."""
        unread = total - counted
        if total and (counted == 0 or unread > MAX_UNREADABLE_SHARE * total):
            # one of validation's own unread files (the epoch's training found others), of any rank: a collective,
            # here where every rank raises
            example = next(filter(None, distributed.all_gather_object(next(iter(self.in_validation.items()), None))), None)
            raise UsageError(f"validation could not read {unread} of its {total} images"
                             + (f" (e.g. {printable(example[0])}: {example[1]})" if example else "")
                             + f", more than {MAX_UNREADABLE_SHARE:.0%}: its accuracy would mean nothing; is the data "
                               "set readable? (after a transient outage, --resume auto goes on from the last checkpoint)")

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
from .errors import Preempted, UsageError
from .console import say

MAX_IN_A_ROW = 50  # more consecutive failures than this is no broken file but unreadable data (or a bug)
MAX_UNREADABLE_SHARE = 0.1  # of the validation set: more is no broken file but an unreadable set


class WorkerUsageError(UsageError):
    """A UsageError that may be raised in a DataLoader worker, and still reads as one line."""

    def __init__(self, message):
        # A DataLoader worker's error arrives in the main process as "Caught ... Original Traceback
        # ...: <message>": keep the one line that says what happened.
        super().__init__(message.strip().splitlines()[-1].split(f"{type(self).__name__}: ", 1)[-1])


class UnreadableImage(WorkerUsageError):
    """--strict-data met a file that cannot be decoded."""


class BadItem(WorkerUsageError):
    """A dataset's item is not what the loaders take: (image, label) of a PIL image or a CHW tensor and a
    class index."""


# Errors of a dataset's own code, not of an unreadable file: never skipped, their traceback is the report.
PROGRAMMING_ERRORS = (TypeError, AttributeError, NameError, ImportError, AssertionError, BadItem)


def printable(path):
    """A file name that is not UTF-8 (its bytes kept as surrogates), with those bytes escaped."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def describe(error):
    """The decoder's reason, on one line and without PIL's file-object repr."""
    reason = re.sub(r" ?<_io\.\w+ name=[^>]*>", "", " ".join(str(error).split()))
    return (reason or type(error).__name__)[:200]


class SkipUnreadable(Dataset):
    """(image, label, bad) for each item, where `bad` lists the (name, reason) of the items that could not
    be loaded on the way. Items are (loader(path), label) for each (path, label) of `samples` (image files:
    any error is a file that cannot be decoded), or with loader None, check(samples[i], i) of a dataset's
    (image, label) items, named by the dataset's name(i) if it has one (else "Class[i]"); there an error of
    the dataset's own code (PROGRAMMING_ERRORS) is raised, not skipped. replace=True (training): the next
    readable item takes a bad one's place; replace=False (validation): image is None. strict=True: raise instead."""

    def __init__(self, samples, loader, replace, strict, check=None):
        self.samples, self.loader, self.replace, self.strict, self.check = samples, loader, replace, strict, check

    def __len__(self):
        return len(self.samples)

    def _read(self, index):
        if self.loader is not None:
            path, label = self.samples[index]
            return self.loader(path), label
        return self.check(self.samples[index], index)

    def _name(self, index):
        """What warnings and bad_images.txt call item `index`: its path, or the dataset's name for it."""
        if self.loader is not None:
            return self.samples[index][0]
        if hasattr(self.samples, "name"):
            return self.samples.name(index)
        return f"{type(self.samples).__name__}[{index}]"

    def __getitem__(self, index):
        bad = []
        for attempt in range(MAX_IN_A_ROW):
            position = (index + attempt) % len(self.samples)
            try:
                image, label = self._read(position)
                return image, label, bad
            except (MemoryError, Preempted):  # (a stop signal raised while this process waited for the file)
                raise
            except Exception as error:  # decoders raise OSError, ValueError, RuntimeError, SyntaxError, ...
                if self.loader is None and isinstance(error, PROGRAMMING_ERRORS):
                    raise
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

    def __init__(self, rank, world_size, known=()):
        self.prefix = f"rank {rank}: " if world_size > 1 else ""
        self.found = dict(known)  # path -> reason, this epoch, of every rank as of the last sync and of this one since
        self.new = {}  # this process's since the last sync: all that sync() gathers
        self.warned = set(self.found)

    def report(self, bad):
        for path, reason in bad:
            if path not in self.found:
                self.found[path] = self.new[path] = reason
            if path not in self.warned:
                self.warned.add(path)
                say(f"warning: {self.prefix}skipped {printable(path)}: cannot decode it ({reason})")

    def next_epoch(self):
        """Files that could not be read are read again; the list starts afresh."""
        self.found, self.new = {}, {}

    def sync(self):
        """Pool every rank's findings since the last sync (a collective: all ranks call it at the same point).
        Returns the sorted [path, reason] pairs of the epoch."""
        for found in distributed.all_gather_object(self.new):
            self.found.update(found)
        self.new = {}
        return sorted([path, reason] for path, reason in self.found.items())

    def check_validation(self, counted, total):
        """UsageError when a validation counted none of its `total` images, or left out more than
        MAX_UNREADABLE_SHARE of them. Call it on every rank, with the counts of all."""
        unread = total - counted
        if total and (counted == 0 or unread > MAX_UNREADABLE_SHARE * total):
            example = next(iter(self.found.items()), None)
            raise UsageError(f"validation could not read {unread} of its {total} images"
                             + (f" (e.g. {printable(example[0])}: {example[1]})" if example else "")
                             + f", more than {MAX_UNREADABLE_SHARE:.0%}: its accuracy would mean nothing; is the data "
                               "set readable? (after a transient outage, --resume auto goes on from the last checkpoint)")

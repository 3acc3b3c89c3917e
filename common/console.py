"""Console lines, each written whole: its text and newline in one write, then flushed.

print() writes a line's text and its newline in two writes. The processes of a job share one
terminal or pipe (ranks, loader workers, torchrun, libraries printing warnings), and another
process's output landing between the two writes glues itself onto the end of our line, or our
next line onto it. A line written at once (under the pipe's 4 KiB atomic size) arrives whole.
"""
import sys


def say(message, file=None):
    """print(message, file=file, flush=True), in one write."""
    stream = sys.stdout if file is None else file
    stream.write(f"{message}\n")
    stream.flush()

"""common/console.py: a line is written whole, in one write, then flushed."""
from common.console import say


def test_a_console_line_is_written_whole_in_one_write():
    """print() writes a line's text and its newline separately: another process's output between the two
    (a rank's warning, a library's report) would glue itself onto our line."""
    writes = []

    class Stream:
        def write(self, text):
            writes.append(text)

        def flush(self):
            writes.append("<flush>")

    say("done: best acc@1 99.00", file=Stream())
    say("error: rank 1: two\nlines", file=Stream())
    assert writes == ["done: best acc@1 99.00\n", "<flush>", "error: rank 1: two\nlines\n", "<flush>"]

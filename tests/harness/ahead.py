"""Runs that several tests share, started in the background ahead of their first test, on the core that the
in-process tests leave idle."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest


class Once:
    """A value computed once in the session, by the first thread that asks for it; the others wait for it."""

    def __init__(self, function):
        self.function, self.lock, self.done, self.value, self.error = function, threading.Lock(), False, None, None

    def get(self, tmp_path_factory):
        with self.lock:
            if not self.done:
                try:
                    self.value = self.function(tmp_path_factory)
                except Exception as error:  # each test that uses it fails with it, as a fixture's error
                    self.error = error
                self.done = True
        if self.error is not None:
            raise self.error
        return self.value


_once, _once_lock = {}, threading.Lock()


def once(function, tmp_path_factory):
    """function(tmp_path_factory), computed once in the session (data folders, runs that tests share), whichever
    thread asks first: a fixture, or the background thread that starts runs ahead."""
    with _once_lock:
        entry = _once.setdefault(function, Once(function))
    return entry.get(tmp_path_factory)


_AHEAD = {}  # (module, or None for a session fixture; fixture name) -> function(tmp_path_factory)


def ahead(function, name, scope="module"):
    """The fixture `name` whose value is function(tmp_path_factory): real-process runs that several tests share. The
    session starts it in the background before its first test comes (in the order of the tests that use it), on the
    core that in-process tests leave idle; the fixture then waits for it (or computes it, if nothing started it).
    A module assigns it to a name of its own: `side_by_side = ahead(side_by_side_runs, "side_by_side")`."""
    _AHEAD[(None if scope == "session" else function.__module__, name)] = function

    def fixture(tmp_path_factory):
        return once(function, tmp_path_factory)

    fixture.__doc__ = function.__doc__
    return pytest.fixture(fixture, scope=scope, name=name)


def ahead_of(item):
    """The functions of the fixtures started ahead that `item` uses."""
    found = (_AHEAD.get((item.module.__name__, name)) or _AHEAD.get((None, name)) for name in item.fixturenames)
    return [function for function in found if function is not None]


_background = threading.local()  # .on: a thread that runs what was started ahead, or one such a thread started


def in_background():
    return getattr(_background, "on", False)


def _mark_background(on):
    _background.on = on


class SideBySide(ThreadPoolExecutor):
    """A ThreadPoolExecutor for runs side by side; its threads belong to the background if the thread that made it
    does (their jobs are then the session's to end, not those of the test that runs meanwhile)."""

    def __init__(self, workers):
        super().__init__(workers, initializer=_mark_background, initargs=(in_background(),))


@pytest.fixture(scope="session", autouse=True)
def _runs_started_ahead(request, tmp_path_factory):
    """Start, one after another in a background thread, the fixtures started ahead that the session's tests use, in
    the order of their first test."""
    order = []
    for item in request.session.items:
        order += [function for function in ahead_of(item) if function not in order]
    pool = ThreadPoolExecutor(1, initializer=_mark_background, initargs=(True,))
    for function in order:
        pool.submit(once, function, tmp_path_factory)
    yield pool  # shut down by _no_job_outlives_the_session, before it kills the jobs

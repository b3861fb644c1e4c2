"""`BucketPrograms`' background making, with a `make` that stands for compiling (no JAX): a
step's `get` waits for its program, the log says when the last is made, and `stop` ends the
making after the program in progress, quietly if that one fails."""

from __future__ import annotations

import logging
import threading

import pytest

from jaxengine.runner.bucket_programs import ALL_READY, THREAD_NAME, BucketPrograms
from tests.conftest import PROGRAMS_THREAD

BUCKETS = [("step", 2), ("step", 4), ("sample", 8)]


class _Maker:
    """`make` for `make_later`: records what it makes and on which thread; each program waits
    for `release` (the first one also says it `started`), then returns its bucket or, with
    `fail`, raises."""

    def __init__(self, *, fail: bool = False) -> None:
        self.started, self.release = threading.Event(), threading.Event()
        self.made: list[tuple[str, int]] = []
        self.threads: set[threading.Thread] = set()
        self.fail = fail

    def __call__(self, bucket: tuple[str, int]) -> object:
        self.made.append(bucket)
        self.threads.add(threading.current_thread())
        self.started.set()
        assert self.release.wait(10)
        if self.fail:
            raise OSError("the cache directory is gone")
        return bucket


def test_a_get_waits_for_its_program_and_each_is_made_once(
        caplog: pytest.LogCaptureFixture) -> None:
    maker, programs = _Maker(), BucketPrograms()
    with caplog.at_level(logging.INFO, logger="jaxengine.runner"):
        programs.make_later(BUCKETS, maker)
        assert maker.started.wait(10)
        assert not [r for r in caplog.records if ALL_READY in r.message]
        maker.release.set()
        assert programs.get(("sample", 8)) == ("sample", 8)
        assert programs.get(("step", 16)) is None  # never asked for: the caller jits it
        programs.wait()
        programs.stop()  # nothing left to stop: joins the threads, so their logging is done
    assert maker.made[0] == ("step", 2) and sorted(maker.made) == sorted(BUCKETS)
    assert len([r for r in caplog.records if ALL_READY in r.message]) == 1
    # tests/conftest.py waits for threads of this name before removing the cache directory
    assert {t.name for t in maker.threads} == {THREAD_NAME} == {PROGRAMS_THREAD}


@pytest.mark.parametrize("fail", [False, True])
def test_stop_ends_the_making_after_the_program_in_progress(
        fail: bool, caplog: pytest.LogCaptureFixture) -> None:
    maker, programs = _Maker(fail=fail), BucketPrograms()
    programs.make_later(BUCKETS, maker)
    assert maker.started.wait(10)  # ("step", 2) in progress
    threading.Timer(0.05, maker.release.set).start()
    with caplog.at_level(logging.DEBUG, logger="jaxengine.runner"):
        programs.stop()  # returns once the thread has ended
    assert not any(t.is_alive() for t in maker.threads)
    assert maker.made == [("step", 2)]  # the others never started
    if fail:
        with pytest.raises(OSError, match="cache directory"):
            programs.get(("step", 2))
        (record,) = [r for r in caplog.records if "in the background failed" in r.message]
        assert record.levelno == logging.DEBUG  # quiet: its runner is gone
    else:
        assert programs.get(("step", 2)) == ("step", 2)
    with pytest.raises(RuntimeError, match="never made: its runner was shut down"):
        programs.get(("step", 4))
    programs.stop()  # again: nothing to do
    assert not [r for r in caplog.records if ALL_READY in r.message]  # not all were made


def test_a_program_a_step_waits_for_is_made_beside_the_one_in_progress() -> None:
    # ("step", 2) is being made and holds until released; a step needing ("sample", 8) gets
    # it made at once on a thread of its own, not after ("step", 2) and ("step", 4).
    blocked, others = _Maker(), []

    def make(bucket: tuple[str, int]) -> object:
        if bucket == ("step", 2):
            return blocked(bucket)
        others.append((bucket, threading.current_thread()))
        return bucket

    programs = BucketPrograms()
    programs.make_later(BUCKETS, make)
    assert blocked.started.wait(10)
    assert programs.get(("sample", 8)) == ("sample", 8)
    assert not blocked.release.is_set() and blocked.made == [("step", 2)]
    ((bucket, thread),) = others
    assert bucket == ("sample", 8) and thread.name == THREAD_NAME
    assert thread not in blocked.threads  # not the background thread, which is still busy
    blocked.release.set()
    programs.wait()
    assert sorted(b for b, _ in others) == [("sample", 8), ("step", 4)]  # each made once
    programs.stop()

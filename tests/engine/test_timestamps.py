"""Timestamps at the edges and background tasks that keep failing, through the engine (issue 48, items 1 and 2).

The same-second rewrites on a backing with real 1-second timestamps are tests/mount/test_timestamps.py's (a
loop-mounted ext4); here a 1-second mtime is set by hand, which the rule treats the same way.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
import trio
import trio.testing

from tierfs.daemon.backing.revalidator import Verdict
from tierfs.daemon.runtime.jobs import supervised
from tierfs.daemon.tree.tree import NS_MAX, clamp_ns, fingerprint, stat_fingerprints

YEAR_2300_NS = 10_413_792_000 * 10**9  # 2300-01-01T00:00:00Z: above 2**63 ns


def _backing_path(e, fidx: int) -> str:
    return os.path.join(e.config.backing, os.fsdecode(e.tree.file_path(fidx)))


def _rewrite(path: str) -> bytes:
    """Other bytes, same size, written in place; returns them."""
    with open(path, "rb") as f:
        new = bytes(b ^ 0x5A for b in f.read())
    with open(path, "r+b") as f:
        f.write(new)
    return new


def test_clamp_ns_keeps_what_fits_and_bounds_the_rest():
    assert clamp_ns(1_700_000_000 * 10**9) == 1_700_000_000 * 10**9
    assert clamp_ns(YEAR_2300_NS) == NS_MAX == 2**63 - 1
    assert clamp_ns(-(2**70)) == -(2**63)


def test_a_rewrite_dated_2300_is_applied_and_served(open_engine, t):
    """A cached file rewritten and dated 2300-01-01: the open finds the change, the tree takes the date (clamped,
    no OverflowError) and the new bytes are served; the clamped fingerprint then agrees with the backing's."""
    e = open_engine()
    f = int(e.schedule.view.order[0])
    path = _backing_path(e, f)
    t.run(lambda: t.read_file(e, f))
    assert e.cache.get(f) is not None
    new = _rewrite(path)
    os.utime(path, ns=(YEAR_2300_NS, YEAR_2300_NS))
    st = os.stat(path)
    if st.st_mtime_ns != YEAR_2300_NS:
        pytest.skip("the filesystem under tmp_path does not store a 2300 mtime")
    assert t.run(lambda: t.read_file(e, f)) == new
    assert int(e.tree.mtime[f + 1]) == NS_MAX
    assert e.tree.holds(f, fingerprint(st))
    assert e.reval.verdict(f, st) is Verdict.SAME
    fps, regular = stat_fingerprints([st])  # (the batch path gives up on it; the verdict above judges it)
    assert not regular.any() or e.tree.holds_many([f], fps).all()


@pytest.mark.slow
def test_a_copy_of_a_file_changed_within_its_timestamp_tick_is_put_off(open_engine, t):
    """A file whose mtime is the current whole second (what a backing with 1-second timestamps stores) cannot be
    told from a rewrite later in that second: its copy is not made now -- the open reads the backing file -- but
    once the second is over, and then holds the bytes of that moment."""
    e = open_engine()
    f = int(e.schedule.view.order[0])
    path = _backing_path(e, f)
    t.run(lambda: t.read_file(e, f))
    assert e.cache.get(f) is not None
    time.sleep(1.02 - time.time() % 1.0)  # (early in a second: the tick has most of a second to run)
    new = _rewrite(path)
    second = time.time_ns() // 10**9 * 10**9
    os.utime(path, ns=(second, second))
    assert t.run(lambda: t.read_file(e, f)) == new
    assert e.cache.get(f) is None, "a copy was made within the tick its fingerprint cannot tell apart"
    time.sleep(max(0.0, (second + 1.2 * 10**9 - time.time_ns()) / 1e9))  # (the tick, and the retry time, over)
    assert t.run(lambda: t.read_file(e, f)) == new
    assert e.cache.get(f) is not None  # made now
    assert not e.last_error


def test_a_background_task_that_keeps_failing_is_said_once_and_shown_while_it_fails(caplog):
    """``supervised`` restarts a failing task every second; the log has its first failure with the traceback and
    then a line a minute, ``failures`` (status's last_error) names it while it fails, and once a run has lasted a
    minute that goes.  On the old code every failure logged a traceback and nothing reached last_error."""
    failures: dict[str, str] = {}
    runs = 0

    async def task() -> None:
        nonlocal runs
        runs += 1
        if runs <= 150:  # (150 virtual seconds of failing, then it works)
            raise OverflowError("Python int too large to convert to C long")
        await trio.sleep_forever()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervised, "probe", task, failures)
            await trio.sleep(5.5)
            assert "probe" in failures and "OverflowError" in failures["probe"], failures
            assert "6 times in a row" in failures["probe"], failures
            await trio.sleep(150)  # (working again since second ~150)
            assert "probe" in failures  # (not yet a minute)
            await trio.sleep(60)
            assert failures == {}
            nursery.cancel_scope.cancel()

    caplog.set_level(logging.INFO, logger="tierfs")
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    mine = [r for r in caplog.records if "probe" in r.getMessage()]
    tracebacks = [r for r in mine if r.exc_info]
    assert len(tracebacks) == 1
    assert 2 <= len(mine) <= 1 + 150 // 60 + 2, [r.getMessage() for r in mine]
    assert "runs again" in mine[-1].getMessage()

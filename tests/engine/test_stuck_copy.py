"""Issue 22: a staging copy stuck on the backing is abandoned, never waited for -- the engine's side.

The backing dir is a passthrough FUSE mount (tierfs.testing.mirrorfs) whose opens of the files listed in its hang file
do not answer while they are listed: a real hang in the kernel, as a FUSE or network server that hangs on one
file makes.  Every wait has a deadline; the passthrough is killed (and its connection aborted) on the way out.
"""

from __future__ import annotations

import errno
import os

import pytest
import trio

from tierfs.daemon.backing.calls import BackingError
from tierfs.testing.harness import make_dataset, passthrough


@pytest.fixture
def hanging(tmp_path):
    """A factory: ``hanging(open_engine, **settings)`` -> (engine, hang file) over a passthrough FUSE backing of a
    4 x 8 file dataset; the passthrough goes on the way out (its hung opens then answer ENOTCONN)."""
    data, inner, hang = tmp_path / "data", tmp_path / "inner", tmp_path / "hang"
    make_dataset(data, dirs=4, files_per_dir=8, max_size=4096, seed=11)
    inner.mkdir()
    hang.write_text("")
    with passthrough(data, inner, hang=str(hang)) as pt:
        try:
            yield lambda open_engine, **settings: (open_engine(backing_dir=inner, **settings), hang)
        finally:
            hang.write_text("")  # let go of what still hangs, then stop the server
            pt.kill()


def _rel(e, fidx: int) -> str:
    return os.fsdecode(e.tree.file_path(fidx))


async def _until(pred, seconds: float = 30.0) -> None:
    with trio.fail_after(seconds):
        while not pred():
            await trio.sleep(0.05)


def _orphans(e) -> set[str]:
    """Files in the cache's data/ that the cache does not count (a copy that landed unaccounted, a temp file)."""
    return set(os.listdir(e.cache.data_path)) - {entry.name for entry in e.cache.entries.values()}


@pytest.mark.slow
def test_a_stuck_copy_is_abandoned_its_batch_and_mini_epoch_staged_its_reader_released(hanging, open_engine, t):
    """One batch holds a file of the current mini-epoch and one of the next whose opens hang: each is skipped after
    the bound (the files before it in its batch land, the files after it are staged again), a reader waiting on
    the current one's copy is let go and gets EIO from its own backing open, the next mini-epoch counts as staged
    and ``advance`` moves on; when the hang ends, neither abandoned copy lands and the cache counts what is on disk."""
    e, hang = hanging(open_engine, nm=4, rf=1000, backing_timeout=1)
    order = list(e.stager.queue)  # staging order: the current mini-epoch, then the next
    assert len(order) >= 12 and all(int(e.tree.sizes[f]) < 256 << 10 for f in order)  # one batch of 16
    cur, nxt = order[3], order[11]
    assert e.schedule.current_mask[cur] and nxt in set(e.schedule.next_files.tolist())
    hang.write_text(f"{_rel(e, cur)}\n{_rel(e, nxt)}\n")
    before = e.passes.current_mini_epoch

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            with trio.fail_after(30), pytest.raises(BackingError) as exc:
                await e.data.open_file(cur)  # waits on the copy in flight, then on its own backing open
            assert exc.value.errno == errno.EIO
            await _until(lambda: {cur, nxt} <= set(e.stager.unstaged) and e.stager.settled())
            st = e.stager.statistics()
            assert st.stuck == 2 and st.threads_left == 62 and st.skipped >= 2, st
            assert e.stager.limiter.borrowed_tokens == 2  # the stuck threads keep theirs: staging has 62 left
            assert {u.file for u in st.unstaged} >= {_rel(e, cur), _rel(e, nxt)}
            assert all("abandoned" in u.why for u in st.unstaged), st.unstaged
            assert e.last_error is not None and "abandoned" in e.last_error
            assert e.backing.statistics().state == "ok"  # a file that hangs is not a stalled backing
            for f in order:
                if f not in (cur, nxt):
                    assert e.cache.get(f) is not None, _rel(e, f)  # the rest of both batches landed
                    with trio.fail_after(10):
                        assert await t.read_file(e, f) == t.backing_bytes(e, f)
            assert e.passes.next_ready()
            e.control_write(b"advance\n")  # (advance=ready: the next mini-epoch is staged, less the stuck file)
            assert e.passes.current_mini_epoch != before
            hang.write_text("")  # the server answers again: the abandoned copies complete, and never land
            await _until(lambda: not e.stager.statistics().stuck and e.stager.settled() and not e.cache.reserved)
            assert _orphans(e) == set()
            assert e.cache.used == e.cache.disk_bytes()  # the reservations went back exactly once
            with trio.fail_after(10):  # the file now current is staged again (or read from the backing)
                assert await t.read_file(e, nxt) == t.backing_bytes(e, nxt)
            n.cancel_scope.cancel()

    t.run(main)


@pytest.mark.slow
def test_a_backing_that_answers_nothing_is_a_stall_and_staging_waits(hanging, open_engine, t):
    """While the backing root does not answer either (a server that stopped), a hung copy is not the file's fault:
    nothing is skipped and the schedule waits; once the root answers again, the file that still hangs is skipped."""
    e, hang = hanging(open_engine, nm=4, rf=1000, backing_timeout=1)
    nxt = next(f for f in e.stager.queue if f in set(e.schedule.next_files.tolist()))
    hang.write_text(f"{_rel(e, nxt)}\n.\n")

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            await _until(lambda: e.backing.statistics().state == "stalled")
            await trio.sleep(3)  # three times the bound
            assert nxt in e.stager.inflight and nxt not in e.stager.unstaged and not e.passes.next_ready()
            hang.write_text(f"{_rel(e, nxt)}\n")  # the root answers again, that one file still hangs
            await _until(lambda: nxt in e.stager.unstaged and e.stager.settled())
            assert e.passes.next_ready()  # (the files after it in its batch were staged again)
            n.cancel_scope.cancel()

    t.run(main)


@pytest.mark.slow
def test_under_lru_a_reader_whose_copy_hangs_gets_eio_and_the_copy_never_lands(hanging, open_engine, t):
    """``lru`` stages nothing ahead: a reader's open copies its file in and waits for it.  A copy that hangs is
    abandoned; the reader gets EIO from its own backing open, later readers too, every other file is served, and
    once the server answers the file is copied and read whole, the abandoned copy nowhere."""
    e, hang = hanging(open_engine, policy="lru", backing_timeout=1)
    stuck = 5
    hang.write_text(f"{_rel(e, stuck)}\n")

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            for _ in range(3):
                with trio.fail_after(30), pytest.raises(BackingError) as exc:
                    await e.data.open_file(stuck)
                assert exc.value.errno == errno.EIO
            assert e.stager.statistics().stuck == 1
            for f in range(e.tree.n_files):
                if f != stuck:
                    with trio.fail_after(10):
                        assert await t.read_file(e, f) == t.backing_bytes(e, f)
            hang.write_text("")
            await _until(lambda: not e.stager.statistics().stuck and not e.cache.reserved)
            with trio.fail_after(10):
                assert await t.read_file(e, stuck) == t.backing_bytes(e, stuck)
            assert e.cache.get(stuck) is not None and _orphans(e) == set()
            n.cancel_scope.cancel()

    t.run(main)

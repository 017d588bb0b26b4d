"""Issue 22: no backing object can hold a thread forever -- the engine's side, without a mount."""

from __future__ import annotations

import contextlib
import errno
import os

import pytest
import trio

from tierfs.daemon.backing.calls import PER_FILE, BackingError


def _path(e, fidx: int) -> str:
    return os.path.join(e.config.backing, os.fsdecode(e.tree.file_path(fidx)))


@contextlib.contextmanager
def _fifo_in_place_of(path: str):
    """Replace ``path`` by a FIFO; on the way out let go of any open still waiting on it (the code before issue 22
    opened it blocking: a writer's non-blocking open releases that reader)."""
    os.unlink(path)
    os.mkfifo(path)
    try:
        yield
    finally:
        for _ in range(64):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                break  # ENXIO: no reader waits any more


def test_a_fifo_in_a_later_mini_epoch_is_found_gone_once_named_and_the_schedule_moves_on(open_engine, t, caplog):
    e = open_engine(rf=1)
    later = [f for f in range(e.tree.n_files) if not e.schedule.wanted[f]]
    fifo = later[0]
    name = os.fsdecode(e.tree.file_path(fifo))

    async def main():
        async with trio.open_nursery() as n:
            await n.start(e.run)
            seen = [e.passes.current_mini_epoch]
            named = 0
            for _ in range(2 * e.settings.nm):  # through the FIFO's mini-epoch and on into the next epoch
                with trio.fail_after(30):
                    while e.passes.current_mini_epoch == seen[-1]:
                        await t.settle(e)
                        if e.tree.gone[fifo]:  # its mini-epoch came: a re-stat or its copy found it gone
                            assert not e.schedule.wanted[fifo]  # (out of the mini-epochs: never tried again)
                            assert any(name in r.getMessage() and "gone" in r.getMessage() for r in caplog.records)
                            named += 1
                        e.control_write(b"advance\n")
                        await trio.sleep(0.01)
                seen.append(e.passes.current_mini_epoch)
            assert named >= 2 and e.stager.statistics().skipped <= 1  # (issue 48: met once at most, never again)
            assert e.trees.statistics().gone == 1
            # ~40 opens of it: each fails at once (ENOENT, not a regular file any more), none takes a thread
            for _ in range(40):
                with trio.fail_after(10), pytest.raises(BackingError) as exc:
                    await e.data.open_file(fifo)
                assert exc.value.errno == errno.ENOENT
            assert e.backing.statistics().waiting == 0
            other = next(f for f in range(e.tree.n_files) if f != fifo and e.cache.get(f) is None)
            with trio.fail_after(10):
                assert await t.read_file(e, other) == t.backing_bytes(e, other)
            n.cancel_scope.cancel()
        assert len(set(seen)) == len(seen)  # the position moved at every advance

    with _fifo_in_place_of(_path(e, fifo)):
        t.run(main)


@pytest.mark.slow
def test_one_file_whose_calls_hang_holds_at_most_per_file_threads(open_engine, t):
    """A file whose backing calls never return (here: a FIFO opened the old, blocking way) holds PER_FILE
    threads; later calls on it fail at once, and every other file is still served."""
    e = open_engine(policy="lru", backing_timeout=0.5)
    stuck = 0
    path = e.tree.file_path(stuck)

    def blocking_open(p: str) -> int:
        return os.open(p, os.O_RDONLY)  # (waits for a writer)

    async def main():
        failed = 0
        for _ in range(40):
            with trio.fail_after(10):
                try:
                    await e.backing.call(blocking_open, _path(e, stuck), timeout=0.5, file=path)
                except BackingError as exc:
                    assert exc.errno == errno.EIO
                    failed += 1
        assert failed == 40
        st = e.backing.statistics()
        assert st.refused >= 40 - PER_FILE and e.backing.limiter.borrowed_tokens == PER_FILE
        for f in range(1, e.tree.n_files):
            with trio.fail_after(10):
                assert await t.read_file(e, f) == t.backing_bytes(e, f)

    with _fifo_in_place_of(_path(e, stuck)):
        t.run(main)

"""CacheStore invariants under any sequence of reserve / commit / open / evict / release (hypothesis)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.common.protocol import COPY_MTIME_NS
from tierfs.daemon.cache.copy_check import open_copy
from tierfs.daemon.cache.store import CacheStore, allocated, entry_name

ops = st.lists(st.tuples(st.sampled_from(["stage", "open", "release", "evict", "lru"]),
                         st.integers(0, 7), st.integers(0, 400)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_accounting_never_passes_the_cap_and_matches_the_disk(seq):
    with tempfile.TemporaryDirectory() as tmp:
        cache = CacheStore(os.path.join(tmp, "c"), 40000)
        os.makedirs(cache.data_path, mode=0o700)
        cache.data_fd = os.open(cache.data_path, os.O_RDONLY | os.O_DIRECTORY)
        cache.block = 4096
        handles: list = []
        every = np.arange(8)
        for op, fidx, size in seq:
            need = cache.estimate(size)
            if op == "stage" and cache.get(fidx) is None and cache.reserve(need):
                serial = cache.next_serial()
                name = entry_name(b"f%d" % fidx, (size, serial, 1, serial), serial, None)
                assert not os.path.exists(os.path.join(cache.data_path, name))  # a name is never reused
                with open(os.path.join(cache.data_path, name), "wb") as f:
                    f.write(b"x" * size)
                os.utime(os.path.join(cache.data_path, name), ns=(COPY_MTIME_NS, COPY_MTIME_NS))
                st = os.stat(os.path.join(cache.data_path, name))
                cache.commit(fidx, name, (size, serial, 1, serial), None, need, allocated(st, cache.block),
                             (st.st_ino, st.st_ctime_ns))
            elif op == "open" and cache.get(fidx) is not None:
                e = cache.get(fidx)
                fd = open_copy(cache.data_fd, e.name, e.size, e.copy_id)
                cache.pin(e)
                handles.append((e, fd))
            elif op == "release" and handles:
                e, fd = handles.pop(size % len(handles))
                os.close(fd)
                cache.unpin(e)
            elif op == "evict":
                cache.evict(fidx)
            elif op == "lru":
                cache.evict_lru(size)
            assert cache.used <= cache.capacity
            assert cache.reserved == 0
            assert cache.committed == cache.disk_bytes()
            assert cache.doomed_bytes == sum({id(e): e.disk for e, _ in handles if e.doomed}.values())
            assert cache.logical == sum(e.size for e in cache.entries.values())
            assert cache.cached(every).tolist() == [f in cache.entries for f in range(8)]  # the mask a switch reads
            assert cache.held(8).tolist() == [f in cache.entries for f in range(8)]
        for e, fd in handles:
            os.close(fd)
            cache.unpin(e)
        assert cache.committed == cache.disk_bytes() == sum(e.disk for e in cache.entries.values())
        assert cache.doomed_bytes == 0
        cache.close()


def _store_with_copies(tmp: str, n: int, size: int) -> CacheStore:
    cache = CacheStore(os.path.join(tmp, "c"), n * size * 2)
    os.makedirs(cache.data_path, mode=0o700)
    cache.data_fd = os.open(cache.data_path, os.O_RDONLY | os.O_DIRECTORY)
    for fidx in range(n):
        need = cache.estimate(size)
        assert cache.reserve(need)
        serial = cache.next_serial()
        name = entry_name(b"f%d" % fidx, (size, serial, 1, serial), serial, None)
        with open(os.path.join(cache.data_path, name), "wb") as f:
            f.write(b"x" * size)
        st = os.stat(os.path.join(cache.data_path, name))
        cache.commit(fidx, name, (size, serial, 1, serial), None, need, allocated(st, cache.block),
                     (st.st_ino, st.st_ctime_ns))
    return cache


class _Freed:
    """The engine's side of CacheEvents: what the deleting task said, with the bytes still queued then."""

    def __init__(self, cache: CacheStore) -> None:
        self.cache = cache
        self.calls: list[int] = []

    def space_freed(self) -> None:
        self.calls.append(self.cache.deleting_bytes)


def test_evicted_copies_are_deleted_by_the_background_task_and_counted_until_gone(tmp_path):
    cache = _store_with_copies(str(tmp_path), 6, 40000)
    names = {f: cache.get(f).name for f in range(6)}
    one = cache.get(0).disk
    events = _Freed(cache)

    def on_disk() -> set[str]:
        return set(os.listdir(cache.data_path))

    async def deleted() -> None:
        with trio.fail_after(10):  # (the worker thread's unlinks: a task waiting on a thread counts as blocked)
            while cache.deleting_bytes:
                await trio.sleep(0.005)
            await trio.testing.wait_all_tasks_blocked()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            cache.events = events  # (the engine gives its own at construction)
            nursery.start_soon(cache.run_deletes)
            await trio.testing.wait_all_tasks_blocked()
            # an eviction queues the copy: still on disk and still counted (the cap holds on disk), not freed yet
            assert cache.evict(0) is False
            assert names[0] in on_disk() and cache.committed == cache.disk_bytes() == 6 * one
            assert cache.deleting_bytes == one and cache.used == 6 * one
            await deleted()
            assert names[0] not in on_disk() and cache.committed == cache.disk_bytes() == 5 * one
            assert cache.deleting_bytes == 0 and events.calls == [0]
            # making room evicts what fits once the queued deletions land -- not every copy while they travel
            room = cache.capacity - cache.used + 2 * one
            assert cache.evict_lru(room) is False
            assert set(cache.entries) == {3, 4, 5} and cache.deleting_bytes == 2 * one
            await deleted()
            assert cache.can_reserve(room) and {names[1], names[2]}.isdisjoint(on_disk())
            # a copy still open is deleted on its last unpin, by the task too
            cache.pin(cache.get(3))
            entry = cache.get(3)
            assert cache.evict(3) is False and entry.doomed and cache.deleting_bytes == 0
            assert cache.unpin(entry) is False and cache.deleting_bytes == one
            await deleted()
            assert names[3] not in on_disk() and cache.doomed_bytes == 0
            # the mount stops with deletions queued: they are made as the task ends, none left behind
            cache.evict(4)
            nursery.cancel_scope.cancel()
        assert names[4] not in on_disk() and cache.committed == cache.disk_bytes() == one
        assert cache.deleting_bytes == 0
        # no task: deleted at once (engine tests, startup, close)
        assert cache.evict(5) is True and not on_disk() and cache.committed == 0

    trio.run(main)

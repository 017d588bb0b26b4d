"""CacheStore invariants under any sequence of reserve / commit / open / evict / release (hypothesis)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.cache import CacheStore, allocated, entry_name
from tierfs.copies import open_copy
from tierfs.protocol import COPY_MTIME_NS

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

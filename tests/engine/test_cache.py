"""CacheStore invariants under any sequence of reserve / commit / open / evict / release (hypothesis)."""

from __future__ import annotations

import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from tierfs.cache import CacheStore

ops = st.lists(st.tuples(st.sampled_from(["stage", "open", "release", "evict", "lru"]),
                         st.integers(0, 7), st.integers(0, 400)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_accounting_never_passes_the_cap_and_matches_the_disk(seq):
    with tempfile.TemporaryDirectory() as tmp:
        cache = CacheStore(os.path.join(tmp, "c"), 1000)
        os.makedirs(cache.data_path, mode=0o700)
        cache.data_fd = os.open(cache.data_path, os.O_RDONLY | os.O_DIRECTORY)
        handles: list = []
        serial = 0
        for op, fidx, size in seq:
            if op == "stage" and cache.get(fidx) is None and cache.reserve(size):
                serial += 1
                name = f"{fidx:016x}-{size}-{serial}-1"
                with open(os.path.join(cache.data_path, name), "wb") as f:
                    f.write(b"x" * size)
                cache.commit(fidx, name, (size, serial, 1), None, size)
            elif op == "open" and cache.get(fidx) is not None:
                e = cache.get(fidx)
                handles.append((e, cache.open_entry(e)))
            elif op == "release" and handles:
                e, fd = handles.pop(size % len(handles))
                cache.release_entry(e, fd)
            elif op == "evict":
                cache.evict(fidx)
            elif op == "lru":
                cache.evict_lru(size)
            assert cache.used <= cache.capacity
            assert cache.reserved == 0
            assert cache.committed == cache.disk_bytes()
            assert cache.doomed_bytes == sum({id(e): e.size for e, _ in handles if e.doomed}.values())
        for e, fd in handles:
            cache.release_entry(e, fd)
        assert cache.committed == cache.disk_bytes() == sum(e.size for e in cache.entries.values())
        assert cache.doomed_bytes == 0
        cache.close()

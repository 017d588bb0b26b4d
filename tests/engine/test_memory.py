"""What the daemon keeps per file (issue 22, 7: a million files in 200 bytes each, the interpreter included).

The arrays the engine holds after a mount's start, its tree saved, and a listing of every directory (what a
``find`` of a ``view=full`` mount makes), each counted once (a view with what it views): a structural figure,
the sum of ``nbytes`` -- not RSS, nor timing.  At a million files the interpreter and its libraries take
~56 bytes a file and the cache's copies of a mini-epoch up to ~40; these arrays must stay well under the rest.
"""

from __future__ import annotations

import collections
import functools
import os

import numpy as np
import pytest
import trio

from tierfs.testing.harness import make_dataset

#: what the engine's arrays may take per file.  Now ~70: the tree 46 (parents, kids, name offsets, inode and
#: block counts 4 bytes each; size, mtime, ctime 8 each; kind and stat row 1 each), the plan of the epoch 4,
#: the view's serving order and its listing order 4 each, the cache disk sizes 4, confirmation times 4, and
#: four masks of 1; the per-file arrays a tenth longer for the tree's room to grow (rescan=epoch: at 10,000 files
#: its least, 1,024 slots), ~6 more.  Room for one more plan (the next epoch's); int64 indices or float64 times
#: anywhere break it (main before this change kept ~154).
PER_FILE = 88
#: the per-file columns that need 64 bits (byte counts and nanosecond times); every other per-file array is
#: at most 4 bytes an entry (file and node indices are int32 below 2**31 files)
WIDE = {"size", "sizes", "mtime", "ctime"}  # (``sizes``: the files' view of ``size``)


def _held_arrays(root: object) -> dict[int, tuple[str, np.ndarray]]:
    """Every numpy array reachable from ``root`` through tierfs's and sampler's objects and the containers
    they hold (not through functions or modules), by the id of the array that owns its memory, with the name
    of the attribute or key that holds it."""
    out: dict[int, tuple[str, np.ndarray]] = {}
    seen: set[int] = set()
    stack: list[tuple[str, object]] = [("engine", root)]
    while stack:
        name, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            base = obj
            while isinstance(base.base, np.ndarray):
                base = base.base
            out.setdefault(id(base), (name, base))
        elif isinstance(obj, dict):
            stack += [(str(k), v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack += [(name, v) for v in obj]
        elif type(obj).__module__.split(".")[0] in ("tierfs", "sampler"):
            attrs = getattr(obj, "__dict__", None)
            pairs = list(attrs.items()) if isinstance(attrs, dict) else []
            for cls in type(obj).__mro__:
                pairs += [(k, getattr(obj, k)) for k in getattr(cls, "__slots__", ()) if hasattr(obj, k)]
            stack += [(k.lstrip("_"), v) for k, v in pairs]
    return out


def test_the_engine_keeps_a_few_narrow_arrays_per_file(open_engine, tmp_path, t):
    backing = tmp_path / "many"
    make_dataset(backing, dirs=20, files_per_dir=500, max_size=1)
    e = open_engine(backing_dir=backing, view="full", nm=4)
    n = e.tree.n_files
    assert n == 10_000

    class NoNews:  # (RescanEvents)
        def all_confirmed(self, *_):
            pytest.fail("a first mount's tree has nothing to compare")

        changed = gone = all_confirmed

    # what the mount's background job does first: save the tree (the cache found its copies by then)
    t.run(functools.partial(e.trees.run, e.tree, limiter=trio.CapacityLimiter(1), events=NoNews()))
    assert os.path.exists(os.path.join(e.config.cache, "tree.bin"))
    root = e.names.list_dir(1)
    for _, inode in root:
        e.names.list_dir(inode)
    assert len(root) == 20

    held = _held_arrays(e)
    # (per file, or per file of a mini-epoch: a plan's pieces)
    wide = sorted(f"{name} ({a.dtype})" for name, a in held.values()
                  if a.size >= n // 16 and a.itemsize > 4 and name not in WIDE)
    assert not wide, f"per-file arrays wider than 4 bytes an entry: {wide}"
    total = sum(a.nbytes for _, a in held.values())
    table = sorted(((a.nbytes / n, name, str(a.dtype)) for name, a in held.values()), reverse=True)
    assert total / n <= PER_FILE, f"{total / n:.1f} bytes a file in arrays: {table[:12]}"


def test_a_revalidation_round_makes_no_node_per_file(open_engine, tmp_path, t):
    """A round re-stats every unread file of the view -- all of them under ``view=full``, every ``revalidate / 2``
    seconds -- and compares the answers with the tree's arrays: it makes no ``Node`` (a path, a stat_result and
    a slot in the bounded node cache per file: at a million files the round was the daemon's busiest work), and
    still finds the file that changed."""
    backing = tmp_path / "many"
    make_dataset(backing, dirs=4, files_per_dir=300, max_size=64)
    e = open_engine(backing_dir=backing, view="full", revalidate="0.2")
    changed = e.tree.file_path(700)
    with open(backing / os.fsdecode(changed), "ab") as f:
        f.write(b"more")

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(e.reval.run)
            with trio.fail_after(30):
                while e.reval.checked < 2 * e.tree.n_files:
                    await trio.sleep(0.02)
            n.cancel_scope.cancel()

    t.run(main)
    assert e.tree.nodes.resident == 0
    assert 700 in e.versions.changed_files and e.reval.statistics().changed >= 1
    assert (e.reval.confirmed[:e.tree.n_files][np.arange(e.tree.n_files) != 700] > -np.inf).all()


def test_the_heap_trimmer_gives_freed_memory_back():
    """A peak of small blocks freed around a few that stay (a scan, a ``find``) leaves the heap full of free pages
    it cannot shrink from the top; a trim makes them not resident (tierfs.daemon.runtime.memory)."""
    from tierfs.daemon.runtime.memory import HeapTrimmer, resident_bytes

    blocks = [bytes([i & 255]) * 2000 for i in range(40_000)]  # ~80 MB through malloc (over pymalloc's 512 B)
    kept = blocks[::16]  # one in 16 stays: free runs of 30 KB between them
    del blocks
    before = resident_bytes()
    trimmer = HeapTrimmer()
    trio.run(trimmer.trim)
    st = trimmer.statistics()
    assert st.trims == 1 and st.rss_bytes <= resident_bytes() + (1 << 20)
    assert before - st.rss_bytes > 40 << 20, (before, st)  # most of the 75 MB freed is handed back
    assert st.returned_bytes > 40 << 20
    assert len(kept) == 2500


def test_a_cached_copy_keeps_no_int_object_per_number():
    """The cache's index holds one entry per copy, 62,500 of them at a million files (two mini-epochs of
    ``nm=32``): its fixed numbers are packed, not eight int objects of ~32 bytes each (issue 22, 7).  What one
    entry keeps, its name aside (shared here), measured by tracemalloc: ~226 bytes (464 kept as ints)."""
    import tracemalloc

    from tierfs.daemon.cache.store import CacheEntry

    n, name = 10_000, "0123456789abcdef-0123456789abcdef-1f"
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        entries = [CacheEntry(100_000 + i, name, 512 + i, 4096 + i, (512 + i, 1_700_000_000_000_000_000 + i,
                                                                    10_000_000 + i, 1_700_000_000_000_000_001 + i),
                              None, (20_000_000 + i, 1_700_000_000_000_000_002 + i)) for i in range(n)]
        per_entry = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert per_entry < 260, per_entry
    e = entries[7]
    assert (e.fidx, e.size, e.disk, e.fp, e.copy_id) == (
        100_007, 519, 4103, (519, 1_700_000_000_000_000_007, 10_000_007, 1_700_000_000_000_000_008),
        (20_000_007, 1_700_000_000_000_000_009))
    big = CacheEntry(1, name, 1, 4096, (1, -5, 2**64 - 1, 0), 2**64 - 1, (2**63 + 5, 3))  # (64-bit inodes)
    assert big.fp == (1, -5, 2**64 - 1, 0) and big.copy_id == (2**63 + 5, 3) and big.digest == 2**64 - 1

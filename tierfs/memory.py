"""The daemon's heap: glibc tuned at start, and its freed memory given back after the peaks.

A mount's peaks -- the scan of a first mount, a ``find`` that lists every directory, staging a mini-epoch's tens of
thousands of copies -- allocate and free millions of small blocks.  glibc keeps what was freed for reuse, and its
heap only shrinks from the top: at a million files 23-29 MB of an 84 MB main heap was free after a ``find`` of a
``view=full`` mount, resident (20 of the 200 bytes a file promised).  ``malloc_trim(0)`` hands the free pages
inside the heaps back (``MADV_DONTNEED``; 0.3 ms on that heap): once after the scan (:func:`trim_heap`, before
the mount serves) and then every :data:`TRIM_INTERVAL` seconds (:class:`HeapTrimmer`, in a worker thread: a
ctypes call lets go of the GIL, the trio thread goes on serving).  Nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import trio

from tierfs.threads import in_thread

__all__ = ["TRIM_INTERVAL", "HeapTrimmer", "MemoryStatistics", "resident_bytes", "trim_heap", "tune_malloc"]

#: Seconds between two trims: a peak's freed memory is resident at most this long after it.
TRIM_INTERVAL = 10.0

_M_MMAP_THRESHOLD = -3  # mallopt parameters (glibc's malloc.h)
_M_ARENA_MAX = -8
_MMAP_THRESHOLD = 128 << 10  # glibc's default
_PAGE = os.sysconf("SC_PAGESIZE")


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None  # not glibc: its own defaults


def tune_malloc() -> None:
    """Make freed numpy arrays leave the daemon's memory.  By default glibc serves an allocation of 128 KiB or
    more by a mapping of its own only until one is freed, then raises that threshold to the freed size (up to
    32 MiB): the scan's and each plan's temporaries -- tens of MB at a million files -- then come from the
    heap, and the holes they leave stay resident (~80 bytes a file after a first mount).  A fixed threshold
    keeps every big array in its own mapping, returned when freed; two arenas keep the worker threads'
    small allocations from spreading over one heap each."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        libc.mallopt(_M_ARENA_MAX, 2)


def trim_heap() -> None:
    """Give the heaps' free pages back (blocking, short: a worker thread once the mount serves)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def resident_bytes() -> int:
    """This process's resident set (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


@dataclass(frozen=True)
class MemoryStatistics:
    """``status``'s ``memory``: the resident bytes after the last trim, the trims made and the bytes they gave
    back (resident before less after, summed)."""

    rss_bytes: int = 0
    trims: int = 0
    returned_bytes: int = 0


class HeapTrimmer:
    """See the module docstring; ``run`` in the mount's nursery, ``trim`` once (tests)."""

    def __init__(self) -> None:
        self._stats = MemoryStatistics()

    @staticmethod
    def _trim_now() -> tuple[int, int]:
        before = resident_bytes()
        trim_heap()
        return before, resident_bytes()

    async def trim(self) -> None:
        before, after = await in_thread(self._trim_now)
        s = self._stats
        self._stats = MemoryStatistics(rss_bytes=after, trims=s.trims + 1,
                                       returned_bytes=s.returned_bytes + max(0, before - after))

    async def run(self) -> None:
        while True:
            await self.trim()
            await trio.sleep(TRIM_INTERVAL)

    def statistics(self) -> MemoryStatistics:
        return self._stats

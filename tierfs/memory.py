"""Giving the heap's freed memory back to the system: the daemon's resident size after its peaks.

A mount's peaks -- the scan of a first mount, a ``find`` that lists every directory, staging a mini-epoch's tens of
thousands of copies -- allocate and free millions of small blocks.  glibc keeps what was freed for reuse, and its
heap only shrinks from the top: at a million files 40 MB of an 80 MB main heap was free after the mount and 26-29
MB after a ``find`` of a ``view=full`` mount, all of it resident (26-40 of the 200 bytes a file promised).
``malloc_trim(0)`` hands the free pages inside the heaps back (``MADV_DONTNEED``; 0.3 ms on that heap), so
:class:`HeapTrimmer` calls it every :data:`TRIM_INTERVAL` seconds, in a worker thread (a ctypes call lets go of
the GIL: the trio thread goes on serving).  Nothing where the C library has no ``malloc_trim`` (musl).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import trio

__all__ = ["TRIM_INTERVAL", "HeapTrimmer", "MemoryStatistics", "resident_bytes"]

#: Seconds between two trims: a peak's freed memory is resident at most this long after it.
TRIM_INTERVAL = 10.0

_PAGE = os.sysconf("SC_PAGESIZE")


def resident_bytes() -> int:
    """This process's resident set (``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # (another C library)
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


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
        self._trim = _malloc_trim()
        self._stats = MemoryStatistics()

    def _trim_now(self) -> tuple[int, int]:
        before = resident_bytes()
        if self._trim is not None:
            self._trim(0)
        return before, resident_bytes()

    async def trim(self) -> None:
        before, after = await trio.to_thread.run_sync(self._trim_now)
        s = self._stats
        self._stats = MemoryStatistics(rss_bytes=after, trims=s.trims + (self._trim is not None),
                                       returned_bytes=s.returned_bytes + max(0, before - after))

    async def run(self) -> None:
        while True:
            await self.trim()
            await trio.sleep(TRIM_INTERVAL)

    def statistics(self) -> MemoryStatistics:
        return self._stats

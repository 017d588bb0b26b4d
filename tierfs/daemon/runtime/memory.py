"""The daemon's heap: glibc tuned at start, and its freed memory given back after the peaks.

A mount's peaks -- the scan of a first mount, a ``find`` that lists every directory, staging a mini-epoch's tens of
thousands of copies -- allocate and free millions of small blocks.  glibc keeps what was freed for reuse, and its
heap only shrinks from the top: at a million files 23-29 MB of an 84 MB main heap was free after a ``find`` of a
``view=full`` mount, resident (20 of the 200 bytes a file promised).  ``malloc_trim(0)`` hands the free pages
inside the heaps back (``MADV_DONTNEED``; 0.3 ms on that heap): once after the scan (:func:`trim_heap`, before
the mount serves) and then every :data:`TRIM_INTERVAL` seconds (:class:`HeapTrimmer`, in a worker thread: a
ctypes call lets go of the GIL, the trio thread goes on serving).  Nothing where the C library is not glibc.

A node's memory limit is often its cgroup's (a systemd unit's ``MemoryMax=``, a batch system's job): what the
kernel kills the daemon at is the cgroup's limit against its charge (the daemon's memory, page cache it caused
included), not the RSS.  So each trim also reads the two (:func:`cgroup_memory`) for ``status.memory``.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import trio

from tierfs.daemon.runtime.threads import in_thread

__all__ = ["TRIM_INTERVAL", "HeapTrimmer", "MemoryStatistics", "cgroup_memory", "resident_bytes", "trim_heap",
           "tune_malloc"]

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


#: a cgroup v1 limit this high is none (the kernel's "unlimited": PAGE_COUNTER_MAX pages)
_NO_LIMIT = 1 << 62


def _read_int(path: str) -> int | None:
    """The number in a cgroup file; None for ``max`` (no limit), an unlimited v1 value or no such file."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    value = int(text)
    return None if value >= _NO_LIMIT else value


def _cgroup_dirs() -> tuple[list[str], str, str] | None:
    """This process's memory cgroup: its directory and those above it up to the hierarchy's mount (leaf first),
    and the names of the limit and charge files there; cgroup v2 (``0::PATH``) where its hierarchy has the
    memory controller, else v1's ``memory`` hierarchy.  None where neither is found."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    found: list[tuple[str, str, str, str]] = []  # (cgroup path, mount point, mount root, version)
    for entry in mounts:
        sep = entry.index("-") if "-" in entry else -1
        if sep < 0 or len(entry) < sep + 4:
            continue
        fstype, options = entry[sep + 1], entry[sep + 3].split(",")
        for parts in lines:
            if len(parts) != 3:
                continue
            if fstype == "cgroup2" and parts[0] == "0" and parts[1] == "":
                found.append((parts[2], entry[4], entry[3], "v2"))
            elif fstype == "cgroup" and "memory" in options and "memory" in parts[1].split(","):
                found.append((parts[2], entry[4], entry[3], "v1"))
    for version, limit, charge in (("v2", "memory.max", "memory.current"),
                                   ("v1", "memory.limit_in_bytes", "memory.usage_in_bytes")):
        for path, point, root, v in found:
            if v != version:
                continue
            rel = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
            leaf = os.path.normpath(os.path.join(point, "" if rel == "." else rel))
            if not os.path.exists(os.path.join(leaf, charge)):
                continue  # (a v2 hierarchy without the memory controller: a hybrid host's; v1 then)
            dirs = [leaf]
            while dirs[-1] != point and os.path.dirname(dirs[-1]).startswith(point):
                dirs.append(os.path.dirname(dirs[-1]))
            return dirs, limit, charge
    return None


def cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, charge) in bytes of this process's memory cgroup: the lowest limit of its cgroup and those above
    it (``memory.max``; v1: ``memory.limit_in_bytes``), None where there is none; and what is charged to it
    (``memory.current``; v1: ``memory.usage_in_bytes``), None where no memory cgroup is found.  Blocking
    (reads of /proc and /sys): a worker thread."""
    where = _cgroup_dirs()
    if where is None:
        return None, None
    dirs, limit_file, charge_file = where
    limits = [v for v in (_read_int(os.path.join(d, limit_file)) for d in dirs) if v is not None]
    return (min(limits) if limits else None), _read_int(os.path.join(dirs[0], charge_file))


@dataclass(frozen=True)
class MemoryStatistics:
    """``status``'s ``memory``: the resident bytes after the last trim, the trims made and the bytes they gave
    back (resident before less after, summed); the memory cgroup's limit and charge at the last trim (None: no
    limit, no memory cgroup found; see :func:`cgroup_memory`)."""

    rss_bytes: int = 0
    trims: int = 0
    returned_bytes: int = 0
    cgroup_limit_bytes: int | None = None
    cgroup_charge_bytes: int | None = None


class HeapTrimmer:
    """See the module docstring; ``run`` in the mount's nursery, ``trim`` once (tests)."""

    def __init__(self) -> None:
        # (the cgroup's figures from the start, not only after the first trim: /sys and /proc, never a mount)
        limit, charge = cgroup_memory()
        self._stats = MemoryStatistics(rss_bytes=resident_bytes(), cgroup_limit_bytes=limit,
                                       cgroup_charge_bytes=charge)

    @staticmethod
    def _trim_now() -> tuple[int, int, tuple[int | None, int | None]]:
        before = resident_bytes()
        trim_heap()
        return before, resident_bytes(), cgroup_memory()

    async def trim(self) -> None:
        before, after, (limit, charge) = await in_thread(self._trim_now)
        s = self._stats
        self._stats = MemoryStatistics(rss_bytes=after, trims=s.trims + 1,
                                       returned_bytes=s.returned_bytes + max(0, before - after),
                                       cgroup_limit_bytes=limit, cgroup_charge_bytes=charge)

    async def run(self) -> None:
        while True:
            await self.trim()
            await trio.sleep(TRIM_INTERVAL)

    def statistics(self) -> MemoryStatistics:
        return self._stats

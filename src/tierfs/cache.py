"""The cache directory: what is cached, how many bytes are promised, and what may be deleted.

Layout of ``CACHE`` (mode 0700, files 0600)::

    lock            flock'ed for the life of a mount: two daemons never share a cache
    journal.json    the position journal (see journal.py)
    data/           one file per cached backing file, named  <pathhash>-<size>-<mtime_ns>-<ino>[-<xxh3>]

The directory ``data/`` *is* the index: a copy appears there only by an atomic rename from a ``.tmp-`` name,
and its name carries the fingerprint of the backing file it was copied from (and, with ``verify=xxhash``, the
hash of the bytes read).  So the index can never disagree with the files, a killed daemon loses nothing, and a
restart keeps exactly the entries whose fingerprint still matches the backing file and deletes the rest and
every stray temp file.

Capacity is accounted in bytes of file content: ``used`` counts every committed copy plus every reservation
of a copy in flight, and a reservation that would pass the capacity is refused, so the cap holds at every
instant.  A copy that is open (or lent, see Engine.lend) is never deleted: eviction marks it and it goes on
the last release.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from tierfs.atomic import TEMP_PREFIX
from tierfs.tree import Tree, fingerprint

__all__ = ["CacheEntry", "CacheStore", "entry_name", "path_hash"]


def path_hash(relpath: bytes) -> int:
    return xxhash.xxh3_64_intdigest(relpath)


def entry_name(relpath: bytes, fp: tuple[int, int, int], digest: int | None) -> str:
    size, mtime_ns, ino = fp
    name = f"{path_hash(relpath):016x}-{size}-{mtime_ns}-{ino}"
    return name if digest is None else f"{name}-{digest:016x}"


def _parse_name(name: str) -> tuple[int, tuple[int, int, int], int | None] | None:
    parts = name.split("-")
    if len(parts) not in (4, 5):
        return None
    try:
        ph = int(parts[0], 16)
        fp = (int(parts[1]), int(parts[2]), int(parts[3]))
        digest = int(parts[4], 16) if len(parts) == 5 else None
    except ValueError:
        return None
    return ph, fp, digest


@dataclass(eq=False)
class CacheEntry:
    """One cached copy.  ``opens`` pins it; ``doomed`` means delete on the last release."""

    fidx: int
    name: str
    size: int
    fp: tuple[int, int, int]
    digest: int | None
    opens: int = 0
    doomed: bool = False
    verified: bool = False


class CacheStore:
    """Cached copies and the byte accounting that keeps them under ``capacity``."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path = os.path.abspath(path)
        self.data_path = os.path.join(self.path, "data")
        self.capacity = capacity
        self.entries: OrderedDict[int, CacheEntry] = OrderedDict()  # in LRU order (oldest first)
        self.committed = 0  # bytes of every copy on disk, doomed ones included
        self.reserved = 0  # bytes promised to copies in flight
        self.doomed_bytes = 0  # bytes of evicted copies still open (they go on release)
        self.data_fd = -1
        self._lock_fd = -1

    # ----------------------------------------------------------------------------------------- lifecycle

    def open(self, tree: Tree, *, need_digest: bool) -> tuple[int, int]:
        """Create/lock the directory and reconcile ``data/`` with ``tree``; returns (kept, removed)."""
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        st = os.stat(self.path)
        if st.st_uid != os.getuid():
            raise ValueError(f"cache dir {self.path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(self.path, 0o700)  # cached data is private to the daemon's user
        self._lock_fd = os.open(os.path.join(self.path, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            self._lock_fd = -1
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(f"cache dir {self.path} is in use by another tierfs mount") from None
            raise
        os.makedirs(self.data_path, mode=0o700, exist_ok=True)
        os.chmod(self.data_path, 0o700)
        for name in os.listdir(self.path):
            if name.startswith(TEMP_PREFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.path, name))
        self.data_fd = os.open(self.data_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        by_hash: dict[int, list[int]] = {}
        for fidx in range(tree.n_files):
            by_hash.setdefault(path_hash(tree.file_path(fidx)), []).append(fidx)
        kept = removed = 0
        for name in os.listdir(self.data_path):
            parsed = None if name.startswith(TEMP_PREFIX) else _parse_name(name)
            keep = None
            if parsed is not None:
                ph, fp, digest = parsed
                for fidx in by_hash.get(ph, ()):
                    node = tree.file_node(fidx)
                    if fingerprint(node.st) == fp and fidx not in self.entries and (digest or not need_digest):
                        keep = fidx
                        break
            try:
                est = os.stat(name, dir_fd=self.data_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if keep is not None and stat.S_ISREG(est.st_mode) and est.st_size == parsed[1][0]:  # type: ignore[index]
                ph, fp, digest = parsed  # type: ignore[misc]
                self.entries[keep] = CacheEntry(keep, name, fp[0], fp, digest)
                self.committed += fp[0]
                if stat.S_IMODE(est.st_mode) != 0o600:
                    os.chmod(name, 0o600, dir_fd=self.data_fd)
                kept += 1
            else:
                self._unlink(name)
                removed += 1
        return kept, removed

    def close(self) -> None:
        if self.data_fd >= 0:
            os.close(self.data_fd)
            self.data_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    # -------------------------------------------------------------------------------------------- space

    @property
    def used(self) -> int:
        return self.committed + self.reserved

    def can_reserve(self, n: int) -> bool:
        return self.used + n <= self.capacity

    def reserve(self, n: int) -> bool:
        """Promise ``n`` bytes to a copy about to start; False (and nothing promised) if that passes the cap."""
        if self.used + n > self.capacity:
            return False
        self.reserved += n
        return True

    def unreserve(self, n: int) -> None:
        self.reserved -= n
        assert self.reserved >= 0

    def commit(self, fidx: int, name: str, fp: tuple[int, int, int], digest: int | None, reserved: int) -> CacheEntry:
        """A copy of ``reserved`` promised bytes landed under ``name``: it now counts as committed."""
        self.reserved -= reserved
        old = self.entries.pop(fidx, None)
        if old is not None:
            self._drop(old)
        entry = CacheEntry(fidx, name, fp[0], fp, digest, verified=digest is not None)
        self.entries[fidx] = entry
        self.committed += fp[0]
        return entry

    # ------------------------------------------------------------------------------------------ lookups

    def get(self, fidx: int) -> CacheEntry | None:
        return self.entries.get(fidx)

    def touch(self, entry: CacheEntry) -> None:
        """Mark as most recently used (the LRU policy evicts from the other end)."""
        if self.entries.get(entry.fidx) is entry:
            self.entries.move_to_end(entry.fidx)

    def open_entry(self, entry: CacheEntry) -> int:
        fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.data_fd)
        self.pin(entry)
        return fd

    def release_entry(self, entry: CacheEntry, fd: int) -> bool:
        """Close a copy opened by :meth:`open_entry`; True if that freed space (a doomed copy went)."""
        os.close(fd)
        return self.unpin(entry)

    def pin(self, entry: CacheEntry) -> None:
        """Keep ``entry`` on disk without opening it (a copy lent to a reader, see Engine.lend)."""
        entry.opens += 1

    def unpin(self, entry: CacheEntry) -> bool:
        """Undo one :meth:`pin` or open; True if that freed space (a doomed copy went)."""
        entry.opens -= 1
        if entry.doomed and entry.opens == 0:
            self._unlink(entry.name)
            self.committed -= entry.size
            self.doomed_bytes -= entry.size
            return True
        return False

    # --------------------------------------------------------------------------------------------- evict

    def evict(self, fidx: int) -> bool:
        """Remove the copy of ``fidx`` now, or on its last release if open; True if space was freed now."""
        entry = self.entries.pop(fidx, None)
        if entry is None:
            return False
        return self._drop(entry)

    def _drop(self, entry: CacheEntry) -> bool:
        if entry.opens:
            if not entry.doomed:
                entry.doomed = True
                self.doomed_bytes += entry.size
            return False
        self._unlink(entry.name)
        self.committed -= entry.size
        return True

    def evict_lru(self, need: int, keep: frozenset[int] | set[int] = frozenset()) -> bool:
        """Evict least recently used, unpinned copies until ``need`` more bytes fit; True if they do."""
        for fidx in list(self.entries):
            if self.can_reserve(need):
                return True
            entry = self.entries[fidx]
            if entry.opens or fidx in keep:
                continue
            self.evict(fidx)
        return self.can_reserve(need)

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.data_fd)

    def disk_bytes(self) -> int:
        """Bytes of every file under ``data/`` as found on disk (temp files included): for tests and checks."""
        total = 0
        for name in os.listdir(self.data_path):
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(name, dir_fd=self.data_fd, follow_symlinks=False).st_size
        return total

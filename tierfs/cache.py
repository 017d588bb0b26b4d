"""The cache directory: what is cached, how much of the disk it may take, and what may be deleted.

Layout of ``CACHE`` (mode 0700, files 0600)::

    lock            flock'ed for the life of a mount: two daemons never share a cache
    journal.json    the position journal (see journal.py)
    data/           one file per cached backing file, named  <pathhash>-<fphash>-<serial>[-<xxh3>]
                    (xxh3 of its path and of its fingerprint: short, so a lent path fits a small buffer)

The directory ``data/`` *is* the index: a copy appears there only by an atomic rename from a ``.tmp-`` name,
and its name carries the fingerprint of the backing file it was copied from (and, with ``verify=xxhash``, the
hash of the bytes read).  So a killed daemon loses nothing and never leaves a partial copy under a real name,
and a restart keeps exactly the entries whose fingerprint still matches the backing file, deleting the rest
and every stray temp file.

**A name is never reused.**  Every copy gets a fresh ``serial`` (one more than any name found at mount), so a
copy evicted while open -- which keeps its name until its last holder lets go and then unlinks *that name* --
can never unlink a newer copy of the same file.  Every unlink in ``data/`` goes through :meth:`_unlink` with
the name of the entry being dropped.

**The cap is kept on disk.**  A copy counts the blocks it occupies (at least one block of the cache
filesystem), not its logical size: ``used`` is every committed copy's allocation plus every reservation of a
copy in flight, and a reservation that would pass the capacity is refused, so the cap holds at every instant.

**The directory is not trusted.**  Cleaners and admins can delete, truncate or replace copies, or the whole
``data/`` dir.  :func:`tierfs.copies.open_copy` checks the copy against its entry -- a regular file, the
right size, the same inode and ctime as when it was committed -- and a copy that fails is dropped from the
index and the accounting by :meth:`CacheStore.repair` (a cache miss, never an error or a short read).

A copy that is open (or pinned, see ``DataPath.lend``) is never deleted: eviction marks it doomed and it goes on
the last :meth:`CacheStore.unpin`.  Everything here runs on the trio thread except the module-level functions,
which only touch the disk and are called from worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from sampler.atomic import TEMP_PREFIX
from tierfs.cacheindex import indexed_copies, save_index
from tierfs.tree import Fingerprint, Tree, path_hash

__all__ = ["COPY_MTIME_NS", "CacheEntry", "CacheStatistics", "CacheStore", "allocated", "cache_block", "disk_estimates",
           "entry_name", "path_hash"]


def fingerprint_hash(fp: Fingerprint) -> int:
    return xxhash.xxh3_64_intdigest(",".join(str(x) for x in fp).encode())


def entry_name(relpath: bytes, fp: Fingerprint, serial: int, digest: int | None) -> str:
    name = f"{path_hash(relpath):016x}-{fingerprint_hash(fp):016x}-{serial:x}"
    return name if digest is None else f"{name}-{digest:016x}"


def _parse_name(name: str) -> tuple[int, int, int, int | None] | None:
    """(path hash, fingerprint hash, serial, digest) of a copy's name; None for anything else."""
    parts = name.split("-")
    if len(parts) not in (3, 4):
        return None
    try:
        ph, fph, serial = int(parts[0], 16), int(parts[1], 16), int(parts[2], 16)
        digest = int(parts[3], 16) if len(parts) == 4 else None
    except ValueError:
        return None
    return ph, fph, serial, digest


#: Every copy's mtime, set when it lands: a write or truncate by anyone moves it to "now", which a check of
#: mtime sees even within the filesystem's timestamp granularity (ctime alone could miss a write made in the
#: same tick as the commit).
COPY_MTIME_NS = 1_000_000_000


def disk_estimates(sizes: np.ndarray, blocks: np.ndarray, block: int) -> np.ndarray:
    """Disk bytes a copy of each file will occupy: its data (a sparse file's holes stay holes: no more than the
    backing file allocates) rounded up to the cache filesystem's block, at least one block, plus room for
    the filesystem's own extent blocks of a big file (st_blocks counts them too).  What the cap and the plans
    count."""
    data = np.minimum(sizes, blocks * 512)
    rounded = -(-data // block) * block
    extra = np.where(sizes > (1 << 20), block * (1 + sizes // (64 << 20)), 0)
    return np.maximum(block, rounded + extra)


def cache_block(path: str) -> int:
    """The block size of the filesystem that holds (or will hold) ``path``."""
    p = os.path.abspath(path)
    while True:
        try:
            v = os.statvfs(p)
            return max(512, v.f_frsize or v.f_bsize)
        except OSError:
            parent = os.path.dirname(p)
            if parent == p:
                return 4096
            p = parent


def allocated(st: os.stat_result, block: int) -> int:
    """Bytes a file occupies on its disk: its allocated blocks, at least one block."""
    return max(block, st.st_blocks * 512)


@dataclass(eq=False)
class CacheEntry:
    """One cached copy.  ``opens`` pins it; ``doomed`` means delete on the last unpin.

    ``copy_id`` is (inode, ctime_ns) of the copy as committed: anything that rewrites, truncates or replaces
    it changes one of them.  ``verified``: its bytes were hashed since this mount committed or found it
    (``verify=xxhash``, checked on first use)."""

    fidx: int
    name: str
    size: int
    disk: int
    fp: Fingerprint
    digest: int | None
    copy_id: tuple[int, int]
    opens: int = 0
    doomed: bool = False
    verified: bool = False


@dataclass(frozen=True)
class CacheStatistics:
    files: int
    logical_bytes: int  # file sizes of the copies in the index
    disk_bytes: int  # what the cap counts: allocation of every copy on disk (doomed ones too) + reservations
    reserved_bytes: int
    doomed_bytes: int
    capacity: int
    repairs: int  # copies found damaged or missing (and the data dir recreated) since mount
    block: int


class CacheStore:
    """Cached copies and the disk accounting that keeps them under ``capacity`` (see the module docstring)."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path = os.path.abspath(path)
        self.data_path = os.path.join(self.path, "data")
        self.capacity = capacity
        self.entries: OrderedDict[int, CacheEntry] = OrderedDict()  # in LRU order (oldest first)
        self.committed = 0  # disk bytes of every copy on disk, doomed ones included
        self.reserved = 0  # disk bytes promised to copies in flight
        self.doomed_bytes = 0  # disk bytes of evicted copies still open (they go on release)
        self.logical = 0  # file sizes of the indexed copies (what status shows beside the disk bytes)
        self.repairs = 0
        self.block = cache_block(path)  # the cache filesystem's block: the least a copy costs
        self.data_fd = -1
        self._serial = 0
        self._retired: list[int] = []
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
        for name in os.listdir(self.path):
            if name.startswith(TEMP_PREFIX):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.path, name))
        self._open_data_dir()
        listed = os.listdir(self.data_path)
        taken = self._take_indexed(tree, listed, need_digest=need_digest)
        kept, removed = len(taken), 0
        for name in listed:
            if name in taken:
                continue
            parsed = None if name.startswith(TEMP_PREFIX) else _parse_name(name)
            keep = None
            if parsed is not None:
                ph, fph, serial, digest = parsed
                self._serial = max(self._serial, serial)
                for fidx in tree.files_with_path_hash(ph):
                    if fingerprint_hash(tree.fingerprint_of(fidx)) == fph and fidx not in self.entries \
                            and (digest or not need_digest):
                        keep = fidx
                        break
            try:
                est = os.stat(name, dir_fd=self.data_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            fp = tree.fingerprint_of(keep) if keep is not None else None
            if fp is not None and parsed is not None and stat.S_ISREG(est.st_mode) and est.st_size == fp[0] \
                    and est.st_mtime_ns == COPY_MTIME_NS:
                assert keep is not None
                if stat.S_IMODE(est.st_mode) != 0o600:
                    os.chmod(name, 0o600, dir_fd=self.data_fd)
                    est = os.stat(name, dir_fd=self.data_fd, follow_symlinks=False)
                digest = parsed[3]
                disk = allocated(est, self.block)
                self.entries[keep] = CacheEntry(keep, name, fp[0], disk, fp, digest, (est.st_ino, est.st_ctime_ns))
                self.committed += disk
                self.logical += fp[0]
                kept += 1
            else:
                self._unlink(name)
                removed += 1
        return kept, removed

    def _take_indexed(self, tree: Tree, listed: list[str], *, need_digest: bool) -> set[str]:
        """Entries for the listed copies that the index of the last clean unmount describes (cacheindex.py)."""
        taken: set[str] = set()
        for f, name, fp, disk, digest, copy_id in indexed_copies(self.path, tree, listed, need_digest=need_digest):
            if f not in self.entries:
                self.entries[f] = CacheEntry(f, name, fp[0], disk, fp, digest, copy_id)
                self.committed += disk
                self.logical += fp[0]
                self._serial = max(self._serial, int(name.split("-")[2], 16))
                taken.add(name)
        return taken

    def save_index(self, tree: Tree) -> None:
        """Write the index of the copies for the next mount (a clean unmount; see cacheindex.py)."""
        save_index(self.path, ((e.name, int(tree.path_hashes[e.fidx]), e.fp, e.disk, e.digest, e.copy_id)
                               for e in self.entries.values() if not e.doomed))

    def _open_data_dir(self) -> None:
        fd = self.make_data_dir()
        os.chmod(self.data_path, 0o700)
        if self.data_fd >= 0:
            os.close(self.data_fd)
        self.data_fd = fd
        self.block = cache_block(self.data_path)

    def data_dir_lost(self) -> bool:
        """Whether ``data/`` was deleted (or replaced) under us (worker thread)."""
        try:
            held = os.fstat(self.data_fd)
            now = os.stat(self.data_path, follow_symlinks=False)
        except OSError:
            return True
        return held.st_nlink == 0 or (held.st_ino, held.st_dev) != (now.st_ino, now.st_dev)

    def make_data_dir(self) -> int:
        """A fresh ``data/`` (worker thread): its descriptor, for :meth:`replace_data_dir`."""
        os.makedirs(self.data_path, mode=0o700, exist_ok=True)
        return os.open(self.data_path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def replace_data_dir(self, fd: int) -> list[CacheEntry]:
        """``data/`` was gone and ``fd`` is the new one: forget every copy (their bytes went with the old
        dir); returns the entries dropped (the caller re-stages what it still wants)."""
        # The old descriptor stays open until close(): a copy in flight may still be using its number.
        self._retired.append(self.data_fd)
        self.data_fd = fd
        dropped = list(self.entries.values())
        for entry in dropped:
            self._forget(entry)
        self.repairs += 1
        return dropped

    def close(self) -> None:
        for fd in self._retired:
            os.close(fd)
        self._retired.clear()
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

    def estimate(self, size: int, backing_blocks: int | None = None) -> int:
        """Disk bytes to reserve for a copy of a file of ``size`` bytes (``backing_blocks``: its allocation in
        512-byte units when known; a sparse file's copy keeps its holes)."""
        blocks = size // 512 + 1 if backing_blocks is None else backing_blocks
        return int(disk_estimates(np.array([size]), np.array([blocks]), self.block)[0])

    def can_reserve(self, n: int) -> bool:
        return self.used + n <= self.capacity

    def reserve(self, n: int) -> bool:
        """Promise ``n`` disk bytes to a copy about to start; False (and nothing promised) if that passes the cap."""
        if self.used + n > self.capacity:
            return False
        self.reserved += n
        return True

    def unreserve(self, n: int) -> None:
        self.reserved -= n
        assert self.reserved >= 0

    def next_serial(self) -> int:
        self._serial += 1
        return self._serial

    def commit(self, fidx: int, name: str, fp: Fingerprint, digest: int | None, reserved: int, disk: int,
               copy_id: tuple[int, int]) -> CacheEntry | None:
        """A copy promised ``reserved`` disk bytes landed under ``name`` and occupies ``disk``: it now counts as
        committed.  None (the copy deleted) if it occupies more than promised and the rest does not fit."""
        self.reserved -= reserved
        if disk > reserved and self.used + disk > self.capacity:
            self._unlink(name)
            return None
        old = self.entries.pop(fidx, None)
        if old is not None:
            self._drop(old)
        entry = CacheEntry(fidx, name, fp[0], disk, fp, digest, copy_id)
        self.entries[fidx] = entry
        self.committed += disk
        self.logical += entry.size
        return entry

    # ------------------------------------------------------------------------------------------ lookups

    def get(self, fidx: int) -> CacheEntry | None:
        return self.entries.get(fidx)

    def cached(self, files: np.ndarray) -> np.ndarray:
        """Which of ``files`` have a copy, as a mask: one pass over the index, not a lookup per file (a switch
        asks about millions, on the trio thread)."""
        return np.isin(files, np.fromiter(self.entries, np.int64, len(self.entries)))

    def touch(self, entry: CacheEntry) -> None:
        """Mark as most recently used (the LRU policy evicts from the other end)."""
        if self.entries.get(entry.fidx) is entry:
            self.entries.move_to_end(entry.fidx)

    def pin(self, entry: CacheEntry) -> None:
        """Keep ``entry`` on disk: while open, lent (DataPath.lend), hashed or pushed."""
        entry.opens += 1

    def unpin(self, entry: CacheEntry) -> bool:
        """Undo one :meth:`pin`; True if that freed space (a doomed copy went, by its own name)."""
        entry.opens -= 1
        assert entry.opens >= 0
        if entry.doomed and entry.opens == 0:
            entry.doomed = False
            self._unlink(entry.name)
            self.committed -= entry.disk
            self.doomed_bytes -= entry.disk
            return True
        return False

    # --------------------------------------------------------------------------------------------- evict

    def evict(self, fidx: int) -> bool:
        """Remove the copy of ``fidx`` now, or on its last unpin if pinned; True if space was freed now."""
        entry = self.entries.pop(fidx, None)
        if entry is None:
            return False
        return self._drop(entry)

    def repair(self, entry: CacheEntry) -> bool:
        """``entry``'s copy was found damaged or missing: out of the index and the accounting (what is left
        of it is deleted); True if it was still indexed.  Counted in ``repairs``."""
        if self.entries.get(entry.fidx) is not entry:
            return False
        del self.entries[entry.fidx]
        self._drop(entry)
        self.repairs += 1
        return True

    def _forget(self, entry: CacheEntry) -> None:
        # the copy's file is gone already (its directory went): only the accounting is left to undo
        if self.entries.get(entry.fidx) is entry:
            del self.entries[entry.fidx]
            self.logical -= entry.size
        if entry.doomed:
            self.doomed_bytes -= entry.disk
        else:
            entry.doomed = True
        self.committed -= entry.disk
        entry.disk = 0

    def _drop(self, entry: CacheEntry) -> bool:
        """``entry`` just left the index: delete its copy now, or on its last unpin."""
        self.logical -= entry.size
        if entry.opens:
            if not entry.doomed:
                entry.doomed = True
                self.doomed_bytes += entry.disk
            return False
        self._unlink(entry.name)
        self.committed -= entry.disk
        return True

    def evict_lru(self, need: int) -> bool:
        """Evict least recently used, unpinned copies until ``need`` more bytes fit; True if they do."""
        for fidx in list(self.entries):
            if self.can_reserve(need):
                return True
            if not self.entries[fidx].opens:
                self.evict(fidx)
        return self.can_reserve(need)

    def evict_unwanted(self, wanted: Sequence[bool]) -> bool:
        """Evict every copy whose file is not ``wanted[fidx]``; True if any space was freed now."""
        freed = False
        for fidx in [f for f in self.entries if not wanted[f]]:
            freed |= self.evict(fidx)
        return freed

    def discard(self, name: str) -> None:
        """Delete a copy that never made it into the index (staged from a backing file that changed since)."""
        self._unlink(name)

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.data_fd)

    def statistics(self) -> CacheStatistics:
        return CacheStatistics(
            files=len(self.entries),
            logical_bytes=self.logical,
            disk_bytes=self.used,
            reserved_bytes=self.reserved,
            doomed_bytes=self.doomed_bytes,
            capacity=self.capacity,
            repairs=self.repairs,
            block=self.block,
        )

    def disk_bytes(self) -> int:
        """Allocated bytes of every file under ``data/`` as found on disk (temp files included): for checks."""
        total = 0
        for name in os.listdir(self.data_path):
            with contextlib.suppress(FileNotFoundError):
                total += allocated(os.stat(name, dir_fd=self.data_fd, follow_symlinks=False), self.block)
        return total

"""The cache directory: what is cached, how much of the disk it may take, and what may be deleted.

Layout of ``CACHE`` (mode 0700, files 0600)::

    CACHEDIR.TAG    the marker: this dir is tierfs's own (a standard cache tag, so backups skip it too)
    lock            flock'ed for the life of a mount: two daemons never share a cache
    journal.json    the position journal (see journal.py)
    tree.bin        the saved backing tree (see keeper.py), index.npz the copies' index (see index.py)
    data/           one file per cached backing file, named  <pathhash>-<fphash>-<serial>[-<xxh3>]
                    (xxh3 of its path and of its fingerprint: short, so a lent path fits a small buffer)

**The dir is tierfs's own, proven before anything in it is deleted** (:meth:`CacheStore.claim`, before the
mount reads the journal or the saved tree).  tierfs takes a dir it creates, an empty one, or one with its
marker; every name in it must be one tierfs writes (the names above, its ``.tmp-`` names, copy names in
``data/``), every file a regular file and ``data/`` a real directory; anything else -- a user's file, a
subdirectory in ``data/``, a symlink anywhere -- refuses the mount with the names found and nothing is touched.
A cache made by a release without the marker is adopted (marked) only when it passes the same check *and* has
its ``lock`` file, which every tierfs cache has had since the first release; a dir of a user's files that
happens to use these names never has both.  Nothing here is followed through a symlink: the dir and ``data/``
are reached through descriptors opened with ``O_NOFOLLOW``, also when ``data/`` is made again at runtime, and
every file in them -- copies, marker, lock, journal, index, saved tree -- through those descriptors, never a
path: a cache dir swapped for a symlink while mounted redirects no write.  The way to the dir is checked before
it is opened (safepath.py): a cache dir that another user could swap (its parent, or a directory above, is
hers or writable by others without the sticky bit) is refused.

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
``data/`` dir.  :func:`tierfs.daemon.cache.copy_check.open_copy` checks the copy against its entry -- a regular file,
the right size, the same inode and ctime as when it was committed -- and a copy that fails is dropped from the
index and the accounting by :meth:`CacheStore.repair` (a cache miss, never an error or a short read).

A copy that is open (or pinned, see ``DataPath.lend``) is never deleted: eviction marks it doomed and it goes on
the last :meth:`CacheStore.unpin`.

**Deleted off the trio thread.**  An unlink of a copy the disk has written back costs ~0.1 ms, and a switch evicts
a whole mini-epoch: 384 copies froze every request of the mount for ~40 ms, 62,500 (a million files, ``nm`` 16)
would for seconds.  So while the mount runs (:meth:`CacheStore.run_deletes`, a background task) an evicted
copy's name is queued and one worker thread unlinks the queue; its bytes stay counted in ``used`` (as
``deleting_bytes``) until its unlink returned, so the cap holds on disk at every instant, and the stager is told
(:class:`CacheEvents`) when the space is free.  Without the task (engine tests, startup, close) a copy is
unlinked at once.  Everything here runs on the trio thread except the module-level functions,
which only touch the disk and are called from worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, overload

import numpy as np
import trio
import xxhash

from sampler.atomic import TEMP_PREFIX, atomic_write
from tierfs.common.options import format_size
from tierfs.common.protocol import COPY_MTIME_NS
from tierfs.daemon.cache.index import INDEX_NAME, indexed_copies, save_index
from tierfs.daemon.cache.journal import JOURNAL_NAME
from tierfs.daemon.cache.safepath import open_parent
from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.runtime.wakeup import Wakeup
from tierfs.daemon.tree.keeper import OLD_TREE_NAMES, TREE_NAME
from tierfs.daemon.tree.tree import Fingerprint, Tree, path_hash

T = TypeVar("T")

__all__ = ["MARKER_NAME", "CacheEntry", "CacheEvents", "CacheStatistics", "CacheStore", "CopyRegistry", "allocated",
           "cache_block", "disk_estimates", "entry_name", "path_hash", "temp_copy_name"]

#: The marker of a tierfs cache dir: a Cache Directory Tagging Specification tag (backup tools skip the dir)
#: whose comment says it is tierfs's.  A tag written by another program is not tierfs's.
MARKER_NAME = "CACHEDIR.TAG"
_MARKER = (b"Signature: 8a477f597d28d172789f06886806bc55\n"
           b"# This directory is a tierfs cache: tierfs creates, rewrites and deletes the files in it.\n"
           b"# Keep nothing else here.  About cache directory tags: https://bford.info/cachedir/\n")
_MARKER_LINES = 2  # what identifies it: the signature and the tierfs line (the rest is prose)
_LOCK_NAME = "lock"
_DATA_NAME = "data"
#: The files tierfs writes at the top of a cache dir (tree.npz: an earlier release's saved tree).
_TOP_FILES = frozenset({MARKER_NAME, _LOCK_NAME, JOURNAL_NAME, TREE_NAME, INDEX_NAME, *OLD_TREE_NAMES})
#: atomic_write's temp names of those files (``.tmp-NAME.PID``), left behind by a crash
_TOP_TEMP = re.compile(rf"{re.escape(TEMP_PREFIX)}(?:{'|'.join(map(re.escape, sorted(_TOP_FILES)))})\.\d+")
_COPY_NAME = re.compile(r"([0-9a-f]{16})-([0-9a-f]{16})-([0-9a-f]+)(?:-([0-9a-f]{16}))?")
_COPY_TEMP = re.compile(rf"{re.escape(TEMP_PREFIX)}\d+-\d+")
_COPY_NAMES = re.compile(rf"(?:{_COPY_NAME.pattern}|{_COPY_TEMP.pattern})\0")  # (NUL-separated names)
_SHOWN = 3  # foreign names a refusal lists


def fingerprint_hash(fp: Fingerprint) -> int:
    return xxhash.xxh3_64_intdigest(",".join(str(x) for x in fp).encode())


def entry_name(relpath: bytes, fp: Fingerprint, serial: int, digest: int | None) -> str:
    name = f"{path_hash(relpath):016x}-{fingerprint_hash(fp):016x}-{serial:x}"
    return name if digest is None else f"{name}-{digest:016x}"


def temp_copy_name(serial: int) -> str:
    """The name a copy is written under before its atomic rename (removed at the next mount if left)."""
    return f"{TEMP_PREFIX}{os.getpid()}-{serial}"


def _parse_name(name: str) -> tuple[int, int, int, int | None] | None:
    """(path hash, fingerprint hash, serial, digest) of a copy's name; None for anything else."""
    m = _COPY_NAME.fullmatch(name)
    if m is None:
        return None
    return int(m[1], 16), int(m[2], 16), int(m[3], 16), None if m[4] is None else int(m[4], 16)


def _is_marker(dir_fd: int) -> bool:
    """Whether the marker in ``dir_fd`` is tierfs's (a regular file, never followed, with tierfs's lines)."""
    try:
        fd = os.open(MARKER_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        head = os.read(fd, len(_MARKER)) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)
    return head.split(b"\n")[:_MARKER_LINES] == _MARKER.split(b"\n")[:_MARKER_LINES]


def _what(entry: os.DirEntry[str], prefix: str, dir_fd: int) -> str:
    """A foreign entry as a refusal names it."""
    if entry.is_symlink():
        try:
            return f"{prefix}{entry.name} (a symlink to {os.readlink(entry.name, dir_fd=dir_fd)})"
        except OSError:
            return f"{prefix}{entry.name} (a symlink)"
    if entry.is_dir(follow_symlinks=False):
        return f"{prefix}{entry.name}/ (a directory)"
    return prefix + entry.name if entry.is_file(follow_symlinks=False) else f"{prefix}{entry.name} (not a file)"


@dataclass
class _DirScan:
    """What :func:`_scan` found in a cache dir."""

    foreign: list[str] = field(default_factory=list)  # what tierfs cannot account for, as a refusal names it
    names: list[str] = field(default_factory=list)  # every name at the top
    marked: bool = False  # tierfs's marker is there
    data_fd: int = -1  # data/, opened without following a link, when it is a directory
    data_names: list[str] = field(default_factory=list)  # what data/ holds


def _scan(dir_fd: int) -> _DirScan:
    """List the cache dir ``dir_fd`` and say what in it tierfs cannot account for (see the module docstring).
    Reads only; follows no symlink; the entries' types come from the listing (no ``stat`` per copy)."""
    scan = _DirScan()
    with os.scandir(dir_fd) as it:
        top = list(it)
    for entry in top:
        name = entry.name
        scan.names.append(name)
        if name == _DATA_NAME and entry.is_dir(follow_symlinks=False):
            scan.data_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            scan.data_names, odd = _scan_data(scan.data_fd)
            scan.foreign += odd
        elif not (entry.is_file(follow_symlinks=False) and (name in _TOP_FILES or _TOP_TEMP.fullmatch(name))):
            scan.foreign.append(_what(entry, "", dir_fd))
        elif name == MARKER_NAME:
            scan.marked = _is_marker(dir_fd)
            if not scan.marked:
                scan.foreign.append(f"{name} (not tierfs's)")
    scan.foreign.sort()
    return scan


def _scan_data(data_fd: int) -> tuple[list[str], list[str]]:
    """(every name in ``data/``, the ones that are not tierfs's copies or temp copies, or not regular files)."""
    with os.scandir(data_fd) as it:
        entries = list(it)
    names = [e.name for e in entries]
    odd = [e for e in entries if not e.is_file(follow_symlinks=False)]
    # one pass of the regex engine over all names (125,000 copies: milliseconds, not a match call each); a
    # name can hold no NUL, so what is left over is exactly the names that are not tierfs's
    if _COPY_NAMES.sub("", "".join(f"{n}\0" for n in names)):
        odd += [e for e in entries if e.is_file(follow_symlinks=False)
                and not (_COPY_NAME.fullmatch(e.name) or _COPY_TEMP.fullmatch(e.name))]
    return names, [_what(e, "data/", data_fd) for e in odd]


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown if len(names) <= _SHOWN else f"{shown} and {len(names) - _SHOWN} more"


def disk_estimates(sizes: np.ndarray, blocks: np.ndarray, block: int) -> np.ndarray:
    """Disk bytes a copy of each file will occupy: its data (a sparse file's holes stay holes: no more than the
    backing file allocates) rounded up to the cache filesystem's block, at least one block, plus room for
    the filesystem's own extent blocks of a big file (st_blocks counts them too).  What the cap and the plans
    count; int32 while every one fits (4 bytes a file: see ``Schedule.set_disk_size``)."""
    data = np.minimum(sizes, blocks.astype(np.int64) * 512)  # (the tree keeps blocks as uint32 when they fit)
    rounded = -(-data // block) * block
    extra = np.where(sizes > (1 << 20), block * (1 + sizes // (64 << 20)), 0)
    disk = np.maximum(block, rounded + extra)
    return disk.astype(np.int32) if int(disk.max(initial=0)) < 2**31 else disk


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


class CacheEntry:
    """One cached copy.  ``opens`` pins it; ``doomed`` means delete on the last unpin.

    ``copy_id`` is (inode, ctime_ns) of the copy as committed: anything that rewrites, truncates or replaces
    it changes one of them.  ``verified``: its bytes were hashed since this mount committed or found it
    (``verify=xxhash``, checked on first use).

    A cache of small files holds tens of thousands of these (twice a mini-epoch's files: at a million files and
    ``nm=32``, 62,500): the numbers that never change -- file index, size, fingerprint, copy id -- are packed in
    one bytes object and handed out unpacked, not kept as eight int objects (tracemalloc: 226 bytes an entry
    against 464, its name aside; 15 bytes a file there: issue 22, 7)."""

    __slots__ = ("_packed", "advised", "backing_id", "digest", "disk", "doomed", "name", "opens", "verified")

    def __init__(self, fidx: int, name: str, size: int, disk: int, fp: Fingerprint, digest: int | None,
                 copy_id: tuple[int, int]) -> None:
        self._packed = _ENTRY.pack(fidx, size, *fp, *copy_id)
        self.name, self.disk, self.digest = name, disk, digest
        self.opens = 0
        self.doomed = False
        self.verified = False
        self.advised = False  # (its bytes were asked into the page cache once: DataPath's first open of it)
        self.backing_id = 0  # (registered with the kernel for passthrough opens: passthrough.py; 0: not)

    @property
    def fidx(self) -> int:
        return _ENTRY.unpack_from(self._packed)[0]

    @property
    def size(self) -> int:
        return _ENTRY.unpack_from(self._packed)[1]

    @property
    def fp(self) -> Fingerprint:
        return _ENTRY.unpack_from(self._packed)[2:6]

    @property
    def copy_id(self) -> tuple[int, int]:
        return _ENTRY.unpack_from(self._packed)[6:]


#: A CacheEntry's fixed numbers: file index, size, fingerprint (size, mtime_ns, inode, ctime_ns), copy id (inode,
#: ctime_ns); inode numbers unsigned (a filesystem may use all 64 bits), times signed (before 1970)
_ENTRY = struct.Struct("=qqqqQqQq")


@dataclass(frozen=True)
class CacheStatistics:
    files: int
    logical_bytes: int  # file sizes of the copies in the index
    disk_bytes: int  # what the cap counts: allocation of every copy on disk (doomed ones too) + reservations
    reserved_bytes: int
    doomed_bytes: int
    deleting_bytes: int  # evicted copies whose unlink is queued or in flight (still on disk: counted in disk_bytes)
    capacity: int
    repairs: int  # copies found damaged or missing (and the data dir recreated) since mount
    block: int


class _Index(OrderedDict[int, CacheEntry]):
    """The copies by file index, in LRU order (oldest first), with a mask of the files that have one: a switch
    asks which of millions of files are cached, on the trio thread, and a mask answers without a lookup each."""

    def __init__(self) -> None:
        super().__init__()
        self.mask = np.zeros(0, bool)

    def __setitem__(self, fidx: int, entry: CacheEntry) -> None:
        if fidx >= len(self.mask):
            grown = np.zeros(max(fidx + 1, 2 * len(self.mask)), bool)
            grown[:len(self.mask)] = self.mask
            self.mask = grown
        super().__setitem__(fidx, entry)
        self.mask[fidx] = True

    def __delitem__(self, fidx: int) -> None:
        super().__delitem__(fidx)
        self.mask[fidx] = False

    @overload
    def pop(self, fidx: int, /) -> CacheEntry: ...

    @overload
    def pop(self, fidx: int, default: T, /) -> CacheEntry | T: ...

    def pop(self, fidx: int, *default: object) -> object:
        if fidx in self:
            self.mask[fidx] = False
        return super().pop(fidx, *default)

    def having(self, files: np.ndarray) -> np.ndarray:
        """Which of ``files`` have a copy, as a mask."""
        inside = files < len(self.mask)
        if inside.all():
            return self.mask[files]
        out = np.zeros(len(files), bool)
        out[inside] = self.mask[files[inside]]
        return out


class CopyRegistry(Protocol):
    """Who registered copies with the kernel (``backing_ids.BackingIds``): told before a registered copy's file
    is deleted, so that the kernel lets go of it too."""

    def deleted(self, entry: CacheEntry) -> None: ...


class CacheEvents(Protocol):
    """What the cache tells the engine."""

    def space_freed(self) -> None:
        """Copies are gone from the disk (deleted at once, or the queued ones by :meth:`CacheStore.run_deletes`):
        their bytes may be reserved again."""


log = logging.getLogger("tierfs")

#: copies unlinked per hop to the deleting thread
_DELETE_BATCH = 256
#: seconds a stopping mount gives the deletions still queued
_STOP_DELETES_S = 5.0
#: copies a mount's first evictions may delete before it answers; more are left to the deleting thread once the
#: mount runs (an unlink of a written-back copy costs 0.1-2 ms: 34k copies held a remount 72 s, silent)
MOUNT_DELETES_AT_ONCE = 1000


def _unlink_all(data_fd: int, names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(name, dir_fd=data_fd)
        except FileNotFoundError:
            pass
        except OSError as exc:  # (a read-only or failing cache disk: the copy stays until the next mount's check)
            log.warning("cannot delete the cached copy %s: %s", name, exc.strerror or exc)


class CacheStore:
    """Cached copies and the disk accounting that keeps them under ``capacity`` (see the module docstring)."""

    def __init__(self, path: str, capacity: int, events: CacheEvents | None = None,
                 registry: CopyRegistry | None = None) -> None:
        self.path = os.path.abspath(path)
        self.events = events  # told when space is freed (none: engine-less tests)
        self.registry = registry  # who registers copies with the kernel (passthrough)
        self.data_path = os.path.join(self.path, "data")
        self.capacity = capacity
        self.entries = _Index()  # in LRU order (oldest first)
        self.committed = 0  # disk bytes of every copy on disk, doomed ones included
        self.reserved = 0  # disk bytes promised to copies in flight
        self.doomed_bytes = 0  # disk bytes of evicted copies still open (they go on release)
        self.deleting_bytes = 0  # disk bytes of evicted copies queued for the deleting thread (in ``committed``)
        self._deletes: list[tuple[int, str, int]] = []  # (data dir fd, copy name, disk bytes) to unlink
        self._deleting = False  # run_deletes() is running: unlinks are queued for it
        self._delete_wake = Wakeup()
        self._deletes_landed = trio.Event()  # (set, and replaced, after each hop of deletions)
        self._left_by_mount = 0  # copies the mount's first evictions left to the deleting thread (said when gone)
        self.logical = 0  # file sizes of the indexed copies (what status shows beside the disk bytes)
        self.repairs = 0
        self.block = cache_block(path)  # the cache filesystem's block: the least a copy costs
        self.dir_fd = -1  # the cache dir (claim()): every name in it is reached through this, never a path
        self.data_fd = -1
        self._adopt = False  # claim() found an empty dir (or an older release's cache): mark it in open()
        self._data_names: list[str] = []  # what claim() found in data/, for open()
        self._serial = 0
        self._retired: list[int] = []
        self._lock_fd = -1

    # ----------------------------------------------------------------------------------------- lifecycle

    def claim(self) -> None:
        """Make sure the cache dir is tierfs's before anything reads or deletes in it (see the module docstring):
        create it if missing, else refuse (``ValueError`` with what is there and the fix) a dir of someone
        else's, a non-empty dir without tierfs's marker, and a marked one holding names tierfs did not write.
        Reads only; :meth:`open` marks an adopted dir."""
        parent_fd, name = open_parent(self.path, create=True)  # (ValueError: another user could swap it)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            self.dir_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        except OSError as exc:
            raise ValueError(f"cannot open cache dir {self.path}: {exc.strerror} (a symlink is never followed: "
                             f"name the directory itself)") from None
        finally:
            os.close(parent_fd)
        st = os.fstat(self.dir_fd)
        if st.st_uid != os.getuid():
            raise ValueError(f"cache dir {self.path} belongs to uid {st.st_uid}, not to this user ({os.getuid()})")
        scan = _scan(self.dir_fd)
        self.data_fd = scan.data_fd  # (closed by close() whatever happens next)
        self._data_names = scan.data_names
        if scan.foreign and (scan.marked or _LOCK_NAME in scan.names):  # (a cache of tierfs's, by its looks)
            raise ValueError(f"cache dir {self.path} holds what tierfs did not write: {_listing(scan.foreign)}; "
                             f"tierfs deletes nothing it did not create and follows no symlink: move those out of it")
        if scan.foreign:
            raise ValueError(f"cache dir {self.path} is not empty and not a tierfs cache (it holds "
                             f"{_listing(scan.foreign)}); tierfs deletes files in its cache dir, so it takes only a "
                             f"new or empty dir or one it made: give --cache a new directory")
        if not scan.marked and scan.names and _LOCK_NAME not in scan.names:
            raise ValueError(f"cache dir {self.path} is not empty and not a tierfs cache (no {MARKER_NAME}, no "
                             f"lock: it holds {_listing(sorted(scan.names))}); tierfs takes only a new or empty dir "
                             f"or one it made: give --cache a new directory")
        self._adopt = not scan.marked

    def open(self, tree: Tree, *, need_digest: bool) -> tuple[int, int]:
        """Mark (if adopted) and lock the claimed directory and reconcile ``data/`` with ``tree``; returns
        (kept, removed).  Deletes only what tierfs writes: copies not worth keeping and its temp files."""
        assert self.dir_fd >= 0, "claim() first"
        if self._adopt:
            # the marker comes first: a crash right after it leaves a dir that is plainly tierfs's
            atomic_write(MARKER_NAME, _MARKER, dir_fd=self.dir_fd)
            self._adopt = False
        if stat.S_IMODE(os.fstat(self.dir_fd).st_mode) != 0o700:
            os.fchmod(self.dir_fd, 0o700)  # cached data is private to the daemon's user
        self._lock_fd = os.open(_LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                dir_fd=self.dir_fd)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            self._lock_fd = -1
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(f"cache dir {self.path} is in use by another tierfs mount") from None
            raise
        for name in os.listdir(self.dir_fd):
            if _TOP_TEMP.fullmatch(name):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dir_fd)
        if self.data_fd < 0:
            self.data_fd = self.make_data_dir()
        elif stat.S_IMODE(os.fstat(self.data_fd).st_mode) != 0o700:
            os.fchmod(self.data_fd, 0o700)
        st = os.fstatvfs(self.data_fd)
        self.block = max(512, st.f_frsize or st.f_bsize)
        listed, self._data_names = self._data_names, []  # (as claim() listed it, through the same descriptor)
        taken = self._take_indexed(tree, listed, need_digest=need_digest)
        kept, removed = len(taken), 0
        for name in listed:
            if name in taken:
                continue
            parsed = _parse_name(name)
            if parsed is None and not _COPY_TEMP.fullmatch(name):
                continue  # not tierfs's (claim() refused such a dir; this one came since): never deleted
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
            if not stat.S_ISREG(est.st_mode):
                continue  # (likewise: only files tierfs wrote are deleted)
            fp = tree.fingerprint_of(keep) if keep is not None else None
            if fp is not None and parsed is not None and est.st_size == fp[0] \
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
        if removed:
            log.info("deleted %d copies in the cache dir that match no file of the backing as it is now (changed "
                     "or removed files, or copies a crash left unfinished); %d kept", removed, kept)
        return kept, removed

    def _take_indexed(self, tree: Tree, listed: list[str], *, need_digest: bool) -> set[str]:
        """Entries for the listed copies that the index of the last clean unmount describes (index.py)."""
        taken: set[str] = set()
        for f, name, fp, disk, digest, copy_id in indexed_copies(self.dir_fd, tree, listed, need_digest=need_digest):
            if f not in self.entries:
                self.entries[f] = CacheEntry(f, name, fp[0], disk, fp, digest, copy_id)
                self.committed += disk
                self.logical += fp[0]
                self._serial = max(self._serial, int(name.split("-")[2], 16))
                taken.add(name)
        return taken

    def save_index(self, tree: Tree) -> None:
        """Write the index of the copies for the next mount (a clean unmount; see index.py)."""
        save_index(self.dir_fd, ((e.name, tree.path_hash_of(e.fidx), e.fp, e.disk, e.digest, e.copy_id)
                               for e in self.entries.values() if not e.doomed))

    def data_dir_held(self) -> bool:
        """Whether the ``data/`` the copies are in is still linked: an ``fstat`` of its descriptor, no path walk
        and never the disk (the trio thread's quick check; :meth:`data_dir_lost` is the whole one)."""
        try:
            return os.fstat(self.data_fd).st_nlink > 0
        except OSError:
            return False

    def data_dir_lost(self) -> bool:
        """Whether ``data/`` was deleted (or replaced) under us (worker thread)."""
        try:
            held = os.fstat(self.data_fd)
            now = os.stat(_DATA_NAME, dir_fd=self.dir_fd, follow_symlinks=False)
        except OSError:
            return True
        return held.st_nlink == 0 or (held.st_ino, held.st_dev) != (now.st_ino, now.st_dev)

    def make_data_dir(self) -> int:
        """A fresh ``data/`` (worker thread): its descriptor, for :meth:`replace_data_dir`.  Never through a
        symlink: a ``data`` that is not a directory (a symlink or a file someone put there) is left alone and
        this raises ``OSError`` saying so."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(_DATA_NAME, 0o700, dir_fd=self.dir_fd)
        try:
            return os.open(_DATA_NAME, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                           dir_fd=self.dir_fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            raise OSError(exc.errno, f"{self.data_path} is not a directory (a symlink or a file someone put there): "
                                     f"tierfs neither follows nor deletes it; remove it and tierfs makes its data "
                                     f"dir again") from None

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
        if self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    # -------------------------------------------------------------------------------------------- space

    @property
    def used(self) -> int:
        return self.committed + self.reserved

    def estimate(self, size: int, backing_blocks: int | None = None) -> int:
        """Disk bytes to reserve for a copy of a file of ``size`` bytes (``backing_blocks``: its allocation in
        512-byte units when known; a sparse file's copy keeps its holes)."""
        blocks = size // 512 + 1 if backing_blocks is None else backing_blocks
        return int(disk_estimates(np.array([size]), np.array([blocks]), self.block)[0])

    def space_coming(self) -> bool:
        """Space is on its way: evicted copies still open (they go on release) or queued for deletion."""
        return bool(self.doomed_bytes or self.deleting_bytes)

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

    def held(self, n_files: int) -> np.ndarray:
        """Which of the tree's ``n_files`` files have a copy, as a mask (the index's own: read it, never write)."""
        mask = self.entries.mask
        if len(mask) >= n_files:
            return mask[:n_files]
        out = np.zeros(n_files, bool)
        k = min(n_files, len(mask))
        out[:k] = mask[:k]
        return out

    def cached(self, files: np.ndarray) -> np.ndarray:
        """Which of ``files`` have a copy, as a mask: one pass over the index, not a lookup per file (a switch
        asks about millions, on the trio thread)."""
        return self.entries.having(files)

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
            self.doomed_bytes -= entry.disk
            self._deregister(entry)
            return self._delete(entry.name, entry.disk)
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
        if not entry.opens:
            self._deregister(entry)

    def _drop(self, entry: CacheEntry) -> bool:
        """``entry`` just left the index: delete its copy now, or on its last unpin."""
        self.logical -= entry.size
        if entry.opens:
            if not entry.doomed:
                entry.doomed = True
                self.doomed_bytes += entry.disk
            return False
        self._deregister(entry)
        return self._delete(entry.name, entry.disk)

    def _deregister(self, entry: CacheEntry) -> None:
        """``entry``'s copy is deleted now, unpinned: the kernel lets go of it too (its blocks are then free)."""
        if entry.backing_id and self.registry is not None:
            self.registry.deleted(entry)

    def _delete(self, name: str, disk: int) -> bool:
        """Delete the copy ``name`` (``disk`` bytes, counted in ``committed``): queued for the deleting thread
        while :meth:`run_deletes` runs (False: the space is not free yet), else at once (True)."""
        if self._deleting:
            self._deletes.append((self.data_fd, name, disk))
            self.deleting_bytes += disk
            self._delete_wake.notify()
            return False
        self._unlink(name)
        self.committed -= disk
        if self.events is not None:
            self.events.space_freed()
        return True

    def defer_deletes(self) -> None:
        """Queue deletions from now on, before :meth:`run_deletes` runs: the mount's first evictions, which
        :meth:`mount_deletes` then makes at once or leaves to the deleting thread."""
        self._deleting = True

    def mount_deletes(self, why: str) -> None:
        """The mount's first evictions were queued (:meth:`defer_deletes`): say how many and ``why``; delete up to
        :data:`MOUNT_DELETES_AT_ONCE` now, leave more to :meth:`run_deletes` (the mount answers meanwhile; their
        bytes stay counted until gone, so the cap holds)."""
        n = len(self._deletes)
        if n > MOUNT_DELETES_AT_ONCE:
            self._left_by_mount = n
            log.warning("%d cached copies are %s: deleting them in the background (%s stay counted in the cache "
                        "until they are gone; the log says when)", n, why, format_size(self.deleting_bytes))
            return
        self._deleting = False
        if n:
            log.info("deleting %d cached copies: they are %s", n, why)
            for fd, name, _ in self._deletes:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
            self._gone(self._deletes)
            self._deletes = []

    async def run_deletes(self) -> None:
        """Until cancelled: unlink the queued copies in a worker thread and free their bytes once gone."""
        self._deleting = True
        try:
            if self._left_by_mount:  # (the mount's own, left here so that it answered at once)
                n, t0 = self._left_by_mount, time.monotonic()
                await self._unlink_queued()
                self._left_by_mount = 0
                log.info("deleted the %d cached copies left from the mount in %.0f s", n, time.monotonic() - t0)
            while True:
                await self._delete_wake.wait()
                await self._unlink_queued()
        finally:
            # Cancelled (the mount stops): what is left goes in the thread too, within _STOP_DELETES_S -- the rest,
            # if any, is the next mount's (a copy the index does not list is checked then, and kept or deleted).
            self._deleting = False
            with trio.move_on_after(_STOP_DELETES_S, shield=True):
                await self._unlink_queued(abandon_on_cancel=True)
            self._gone(self._deletes)
            self._deletes = []

    async def _unlink_queued(self, *, abandon_on_cancel: bool = False) -> None:
        """Unlink the queued copies, _DELETE_BATCH a hop to the thread, each hop's bytes freed once it returned."""
        while self._deletes:
            fd = self._deletes[0][0]  # (one data dir a hop: a recreated one has another descriptor)
            batch = self._deletes[:_DELETE_BATCH]
            batch = batch[:next((i for i, d in enumerate(batch) if d[0] != fd), len(batch))]
            await in_thread(_unlink_all, fd, [name for _, name, _ in batch], abandon_on_cancel=abandon_on_cancel)
            del self._deletes[:len(batch)]  # (queued only once gone: a cancel before the hop leaves them)
            self._gone(batch)
            if self.events is not None and not abandon_on_cancel:
                self.events.space_freed()

    def _gone(self, deleted: list[tuple[int, str, int]]) -> None:
        """Copies of the queue are off the disk (or left to the next mount): their bytes are free."""
        freed = sum(disk for _, _, disk in deleted)
        self.committed -= freed
        self.deleting_bytes -= freed
        self._deletes_landed.set()
        self._deletes_landed = trio.Event()

    async def deletions_landed(self) -> None:
        """Wait until the copies queued for deletion so far are gone from the disk (at once if none is)."""
        while self.deleting_bytes and self._deleting:
            await self._deletes_landed.wait()

    def evict_lru(self, need: int, among: np.ndarray | None = None) -> bool:
        """Evict least recently used, unpinned copies (of the files ``among`` masks, if given) until ``need`` more
        bytes fit; True if they do."""
        for fidx in list(self.entries):
            if self.used - self.deleting_bytes + need <= self.capacity:  # (fits once the queued deletions land)
                break
            if not self.entries[fidx].opens and (among is None or (fidx < len(among) and among[fidx])):
                self.evict(fidx)
        return self.can_reserve(need)

    def evict_unwanted(self, wanted: np.ndarray) -> bool:
        """Evict every copy whose file is not ``wanted[fidx]`` (a mask per file); True if any space was freed
        now.  One pass over masks: a switch asks this of every copy, on the trio thread."""
        freed = False
        held = self.entries.mask
        keep = np.zeros(len(held), bool)
        n = min(len(held), len(wanted))
        keep[:n] = wanted[:n]
        for fidx in np.flatnonzero(held & ~keep).tolist():
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
            deleting_bytes=self.deleting_bytes,
            capacity=self.capacity,
            repairs=self.repairs,
            block=self.block,
        )

    def disk_bytes(self) -> int:
        """Allocated bytes of every file under ``data/`` as found on disk (temp files included): for checks."""
        total = 0
        for name in os.listdir(self.data_fd):
            with contextlib.suppress(FileNotFoundError):
                total += allocated(os.stat(name, dir_fd=self.data_fd, follow_symlinks=False), self.block)
        return total

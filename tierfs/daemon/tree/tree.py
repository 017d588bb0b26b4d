"""The backing tree: one scan at mount time, inode numbers, and safe opens beneath the backing root.

The scan walks directory file descriptors (``os.scandir(fd)``), so a directory swapped for a symlink while we
walk cannot lead us elsewhere; symlinks are recorded with their own text and never followed, entries on another
filesystem (mount points inside the backing dir) and bind mounts are left out.  FIFOs, sockets and device nodes
are recorded as *special* entries: listed as what they are, never dataset files, never opened.  Files are
numbered in *storage order* (depth-first, names sorted byte-wise): the index the sampler's plans refer to.

The tree is kept as arrays, never as a Python object per entry (a million files must fit in a few hundred
bytes each, the daemon's other state included): node 0 is the root, nodes ``1 .. n_files`` are the files in
storage order (file ``f`` is node ``f + 1``), then the directories, symlinks and special entries.  Per node:
parent, kind, name, and the stat fields a mount shows (mode, link count, owner, group and device number
through a small table of distinct combinations; inode, size, blocks, mtime, ctime); the children of a
directory are contiguous in ``kids`` and sorted by name, so a lookup is a binary search in the arrays.  A
:class:`Node` is made only when asked for (``nodes[i]``) and only a bounded number of them is kept.

Every later access to a backing file goes through :func:`tierfs.daemon.backing.beneath.open_beneath` (no symlink
followed, no filesystem crossed).

**Access changes.**  The kernel checks other users against the modes and owners the mount reports
(``default_permissions``) and keeps them for the attribute timeout.  So the tree counts every change of a node's
mode, owner or group found during the mount (a file's :meth:`Tree.update_stat`, a directory's
:meth:`Tree.update_access`) and keeps, until the kernel has been told (``access_untold``, emptied by the
namespace), which nodes the kernel may still hold older ones of; its :class:`AccessWatcher` hears of each.

**Room to grow.**  A mount's tree keeps room for entries the backing gains while it runs (:meth:`Tree.with_room`):
unused file slots after the files (so every per-file array of the mount is made once, at its size, and file
``f`` stays node ``f + 1``) and unused nodes after the rest, all of kind KIND_HOLE and in no directory.  A
rescan's :meth:`Tree.additions` take them (:meth:`Tree.grow`), hidden -- in no directory, files masked as gone --
until the epoch whose plan was made with them starts (:meth:`Tree.join`): node numbers, and so the kernel's
inode numbers, never change under a running mount.  A node taken keeps its name in ``_late`` (the names of the
scan are one string, read by other threads as it is).  ``n_files`` counts the files in use; ``n_slots`` the
per-file arrays' length.
"""

from __future__ import annotations

import array
import contextlib
import errno
import functools
import itertools
import logging
import os
import stat
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import attrgetter
from typing import BinaryIO, Protocol

import numpy as np
import xxhash

from sampler.atomic import atomic_open
from tierfs.common.mountinfo import mountinfo
from tierfs.common.protocol import CONTROL_DIR, CONTROL_FILES

log = logging.getLogger("tierfs")

__all__ = [
    "CONTROL_INODES",
    "KIND_DIR",
    "KIND_FILE",
    "KIND_HOLE",
    "KIND_LINK",
    "KIND_SPECIAL",
    "NS_MAX",
    "NS_MIN",
    "AccessWatcher",
    "Additions",
    "Attributes",
    "Comparison",
    "Fingerprint",
    "Growth",
    "Node",
    "ScanCount",
    "Tree",
    "clamp_ns",
    "fingerprint",
    "path_hash",
    "path_hashes",
    "stat_fingerprints",
]

KIND_DIR, KIND_FILE, KIND_LINK, KIND_SPECIAL = 0, 1, 2, 3
#: a node kept for an entry the backing may gain during the mount (see "Room to grow"): in no directory yet
KIND_HOLE = 4

#: Inode numbers of ``/.tierfs`` and its files, far above any tree inode (tree inode = node index + 1).
CONTROL_BASE = 1 << 60
CONTROL_INODES = {os.fsencode(name): CONTROL_BASE + i for i, name in enumerate((CONTROL_DIR, *CONTROL_FILES))}


Fingerprint = tuple[int, int, int, int]
#: (mode, nlink, uid, gid, rdev, size, blocks, mtime_ns, ctime_ns) of a node: what a mount shows
Attributes = tuple[int, int, int, int, int, int, int, int, int]


@dataclass(frozen=True)
class Comparison:
    """What a newer scan of the same backing says about a tree's files (:meth:`Tree.compare`)."""

    changed: list[tuple[int, os.stat_result]]  # files whose fingerprint differs there, with their stat there
    gone: list[int]  # files it lacks
    added: np.ndarray  # its files the tree lacks (the newer scan's file indices, in storage order)
    returned: list[tuple[int, os.stat_result]]  # files found gone during the mount that it has again


@dataclass
class Additions:
    """Entries a newer scan found that a tree lacks (:meth:`Tree.additions`), parents before children: each a
    (parent, name, kind, stat, link text), the parent a node of the tree or ``-1 - k`` for the k-th addition."""

    entries: list[tuple[int, bytes, int, os.stat_result, bytes]] = field(default_factory=list)

    def add(self, parent: int, name: bytes, kind: int, st: os.stat_result, text: bytes) -> int:
        self.entries.append((parent, name, kind, st, text))
        return -len(self.entries)

    def __iter__(self) -> Iterator[tuple[int, bytes, int, os.stat_result, bytes]]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def files(self) -> int:
        return sum(kind == KIND_FILE for _, _, kind, _, _ in self.entries)


@dataclass(frozen=True)
class Growth:
    """What :meth:`Tree.grow` took: its number (what :meth:`Tree.join` is given), the files and other entries
    taken into the room, the files left out for want of room, the files back from gone, and the file indices of
    those new and back."""

    number: int
    files: int
    others: int
    left_out: int
    returned: int
    taken: tuple[int, ...] = ()
    #: (directory node, name) of each entry taken into a directory the kernel may have looked it up in before
    #: (not a new one): a negative entry it keeps there is to be dropped before the entry joins
    entries: tuple[tuple[int, bytes], ...] = ()


SCAN_THREADS = 16  # lstat requests in flight while scanning: a network tier answers many at once
SCAN_BATCH = 256
#: Each level's first batches are stat'ed in the scanning thread and timed: where an entry costs less than
#: SCAN_WAITS_S (a local or cached tier: the cost is Python's, under the GIL) the rest are too, since threads
#: would only fight over the GIL (a 1,000,000-entry local scan: 5.7 s in one thread, 16.6 s in 16); where it
#: costs more (a network tier: waiting on the server), the rest go to SCAN_THREADS threads.
SCAN_PROBE = 2
SCAN_WAITS_S = 30e-6
SCAN_REPORT_S = 5.0  # a long scan's progress: in the log and to ``progress`` (systemd's STATUS) this often
#: bytes: the scan's arrays grow a batch at a time, merged into chunks this big: above glibc's mmap threshold
#: (memory.tune_malloc), so that each is a mapping of its own, handed back whole when the tree is made
SCAN_CHUNK = 1 << 18
_PIECES_MERGED = 256  # (or of this many batches: a tree of one file per directory)
UNLISTABLE_SHOWN = 10  # directories a scan cannot list: named in the log and status, then counted only
NODE_CACHE = 4096  # Node objects kept made (the most recently used): a bound, not a per-file cost

#: per entry, the fields kept through the table of distinct combinations (``Tree.meta``) ...
_META_FIELDS = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_rdev")
_META = attrgetter(*_META_FIELDS)
_MODE, _NLINK, _UID, _GID, _RDEV = range(5)
#: ... and those kept per node
_COLUMN_FIELDS = ("st_size", "st_blocks", "st_mtime_ns", "st_ctime_ns")
_COLUMNS = attrgetter(*_COLUMN_FIELDS)
#: what the scan takes of each lstat at once (the device first: entries on another are left out); the inode
#: number apart, as it may not fit an int64
_FIELDS = attrgetter("st_dev", *_META_FIELDS, *_COLUMN_FIELDS)
_N_FIELDS = 1 + len(_META_FIELDS) + len(_COLUMN_FIELDS)
_F_DEV, _F_META, _F_COLUMNS = 0, slice(1, 1 + len(_META_FIELDS)), slice(1 + len(_META_FIELDS), _N_FIELDS)
_INO = attrgetter("st_ino")
_IFMT = stat.S_IFMT(0o177777)  # the file type bits of a mode
_FMT_KIND = {stat.S_IFDIR: KIND_DIR, stat.S_IFREG: KIND_FILE, stat.S_IFLNK: KIND_LINK}


def _access(row: Sequence[int]) -> tuple[int, int, int]:
    """(mode, uid, gid) of a (mode, nlink, uid, gid, rdev) row: what a permission check reads."""
    return row[_MODE], row[_UID], row[_GID]


#: The times the tree's int64 arrays hold: 1677-09-21 to 2262-04-11 in ns since 1970.  ext4, xfs (bigtime) and
#: btrfs store dates beyond (``touch -d 2300-01-01``); :func:`clamp_ns` brings them in.
NS_MIN, NS_MAX = -(2**63), 2**63 - 1


def clamp_ns(ns: int) -> int:
    """A stat's ``st_*_ns`` within the range the tree's arrays hold (:data:`NS_MIN` .. :data:`NS_MAX`): every
    timestamp the tree stores or compares goes through this, so a date past 2262 is stored as the last one, never
    an ``OverflowError``.  Two versions dated past 2262 then differ in ctime still (any write moves it)."""
    return NS_MIN if ns < NS_MIN else NS_MAX if ns > NS_MAX else ns


def fingerprint(st: os.stat_result, inodes: bool = True) -> Fingerprint:
    """What must not change for a cached copy to stay valid: (size, mtime_ns, inode, ctime_ns), the times
    clamped as the tree stores them (:func:`clamp_ns`).  ``inodes=False`` (a backing that numbers inodes per
    mount: :attr:`Tree.stable_inodes`): the inode is 0, so a file renumbered by its server is still itself.

    ctime too: a rewrite that puts the old size and mtime back (``touch -r``, rsync) still moves ctime, and so
    does a ``mv`` of another file over it -- what the inode number would have told."""
    return (st.st_size, clamp_ns(st.st_mtime_ns), st.st_ino if inodes else 0, clamp_ns(st.st_ctime_ns))


_FINGERPRINT_AND_MODE = attrgetter("st_size", "st_mtime_ns", "st_ino", "st_ctime_ns", "st_mode")


def stat_fingerprints(answers: Sequence[os.stat_result | OSError],
                      inodes: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """:func:`fingerprint` (with ``inodes``) of many stat answers at once (int64 [answer, 4]) and which answers
    are regular files; all not regular where one answer is an error or a field does not fit an int64 (judge those
    one at a time)."""
    k = len(answers)
    try:
        fields = np.fromiter(itertools.chain.from_iterable(map(_FINGERPRINT_AND_MODE, answers)), np.int64,
                             5 * k).reshape(k, 5)
    except (AttributeError, OverflowError):  # (an OSError among them, an inode number above 2**63, a time past 2262)
        return np.zeros((k, 4), np.int64), np.zeros(k, bool)
    if not inodes:
        fields[:, 2] = 0
    return fields[:, :4], fields[:, 4] & 0o170000 == stat.S_IFREG


class AccessWatcher(Protocol):
    """Who tells the kernel of changed modes and owners (the namespace implements it)."""

    def access_changed(self) -> None:
        """A node's mode, owner or group changed: it is in ``Tree.access_untold`` (on the trio thread)."""


def _no_progress(count: ScanCount) -> None:
    """A scan's ``progress`` when nobody listens."""


def path_hash(relpath: bytes) -> int:
    """The hash of a file's path that names its copies in the cache (and finds them again at a remount)."""
    return xxhash.xxh3_64_intdigest(relpath)


def path_hashes(relpaths: Iterable[bytes], n: int) -> np.ndarray:
    """:func:`path_hash` of each of ``n`` paths (uint64), with no Python code run per path."""
    return np.fromiter(map(xxhash.xxh3_64_intdigest, relpaths), np.uint64, n)


class Node:
    """One entry of the backing tree, made from the tree's arrays when asked for (``Tree.nodes[i]``); a copy:
    the arrays stay the truth (a file found changed gets a new row, and its next Node shows it)."""

    __slots__ = ("children", "fidx", "kind", "link", "name", "parent", "path", "st")

    def __init__(self, name: bytes, parent: int, kind: int, path: bytes, st: os.stat_result) -> None:
        self.name = name
        self.parent = parent
        self.kind = kind
        self.path = path  # relative to the backing root, b"" for the root
        self.st = st
        self.children: dict[bytes, int] | None = {} if kind == KIND_DIR else None
        self.fidx = -1
        self.link: bytes | None = None


class _Nodes(Sequence[Node]):
    """``Tree.nodes``: node ``i`` made on use; the last NODE_CACHE made are kept (any thread may ask)."""

    def __init__(self, tree: Tree) -> None:
        self._tree = tree
        self._made: OrderedDict[int, Node] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._tree.n_nodes

    def __getitem__(self, i: int) -> Node:  # type: ignore[override]
        n = self._tree.n_nodes
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)  # (what iteration stops on)
        with self._lock:
            node = self._made.get(i)
            if node is not None:
                self._made.move_to_end(i)
                return node
        node = self._tree._make(i)
        with self._lock:
            self._made[i] = node
            if len(self._made) > NODE_CACHE:
                self._made.popitem(last=False)
        return node

    def drop(self, i: int) -> None:
        with self._lock:
            self._made.pop(i, None)

    @property
    def resident(self) -> int:
        """How many Node objects are kept now (bounded by NODE_CACHE)."""
        return len(self._made)


TREE_FORMAT = 5  # of the saved tree: an older one (4: no checksum; 3: path hashes in file order too) is not read
_SAVED = ("parents", "kinds", "names", "name_ends", "link_nodes", "links", "link_ends", "meta", "meta_idx",
          "ino", "size", "blocks", "mtime", "ctime", "kids", "hash_keys", "hash_order")


def _read_array(f: BinaryIO) -> np.ndarray:
    """The next ``.npy`` record of ``f`` (a real file); ``ValueError`` saying what is wrong for anything else.
    Its header is checked against the bytes left before any array is made: a damaged one must neither raise
    whatever numpy's header parser raises (a tokenizer's error) nor make an array of the size it claims."""
    left = os.fstat(f.fileno()).st_size - f.tell()
    if left < 10:
        raise ValueError("it is cut short")
    try:
        version = np.lib.format.read_magic(f)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        shape, fortran, dtype = read_header[version](f)
    except Exception:  # (the header is Python literal text: a flipped byte can make the parser raise anything)
        raise ValueError("a record's header is damaged") from None
    count = 1
    for d in shape:
        count *= d
    if dtype.hasobject or min(shape, default=0) < 0 or count * dtype.itemsize > left:
        raise ValueError(f"a record's header is damaged (it claims {shape} of {dtype.str})")
    a = np.fromfile(f, dtype, count) if count else np.zeros(0, dtype)
    if a.size != count:
        raise ValueError("it is cut short")
    return a.reshape(shape[::-1]).transpose() if fortran else a.reshape(shape)


def _digest(h: xxhash.xxh3_64, a: np.ndarray) -> None:
    """Add an array (its type, shape and elements) to the saved tree's checksum: a flipped bit in a size or a
    name would otherwise load as a wrong tree, served until the rescan's news (names: until the next mount)."""
    h.update(f"{a.dtype.str}{a.shape}".encode())
    # (numpy's stubs give ndarray its buffer, ``__buffer__``, for Python >= 3.12 only)
    h.update(np.ascontiguousarray(a).view(np.uint8) if a.size else b"")  # type: ignore[arg-type]


def _ends(parts: Sequence[bytes]) -> np.ndarray:
    ends = np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)), dtype=np.int64)
    return ends.astype(index_dtype(int(ends[-1]) if len(ends) else 0))


def index_dtype(largest: int) -> type[np.signedinteger]:
    """The dtype of an array of indices (or offsets) up to ``largest``: int32 while it fits.  Per-file arrays
    are most of the daemon's memory (a million files must fit in 200 bytes each, the interpreter included)."""
    return np.int32 if largest < 2**31 else np.int64


def _narrow(a: np.ndarray) -> np.ndarray:
    """``a`` (non-negative integers) as uint32 if they all fit: inode numbers and block counts mostly do.
    :meth:`Tree.update_stat` widens a column again for a value that does not fit."""
    return a.astype(np.uint32) if not a.size or int(a.max()) < 2**32 else a


def _row_dtype(rows: int) -> type[np.unsignedinteger]:
    """The narrowest dtype for an index into ``rows`` rows (of the table of distinct stat fields)."""
    return np.uint8 if rows <= 1 << 8 else np.uint16 if rows <= 1 << 16 else np.uint32


class Tree:
    """See the module docstring.  Node ``i`` is inode ``i + 1``; file ``f`` is node ``f + 1``.

    ``sizes``, ``blocks`` (per file) and ``groups`` (the parent directory per file: the stratified
    composition's groups) are views of the node arrays, so a file found changed shows everywhere at once.

    Only the directories (node 0 and the nodes after the files) have children: per-directory arrays are indexed
    by :meth:`dir_slot` and cost nothing per file.  The path hashes are kept sorted, with the file of each
    (:meth:`path_index`), not also in file order: a file's own hash is :meth:`path_hash_of`.  Only a mount's
    start needs them (the cache finds its copies by them, the saved tree keeps them): then
    :meth:`release_path_index` lets them go, and a later use hashes every path again."""

    #: directories the scan could not list (a permission, an I/O error), left in the tree empty: how many, and
    #: the first UNLISTABLE_SHOWN as (path, errno).  A loaded tree knows of none (its rescan does).
    unlistable: int = 0
    unlistable_dirs: tuple[tuple[bytes, int], ...] = ()
    #: whether the backing keeps a file's inode number (its owner, ``TreeKeeper``, says): if not (sshfs without
    #: ``noforget``, rclone, gcsfuse, s3fs number inodes per mount), fingerprints leave the inode out (0)
    stable_inodes: bool = True

    def __init__(self, *, parents: np.ndarray, kinds: np.ndarray, names: bytes, name_ends: np.ndarray,
                 link_nodes: np.ndarray, links: bytes, link_ends: np.ndarray, meta: np.ndarray,
                 meta_idx: np.ndarray, ino: np.ndarray, size: np.ndarray, blocks: np.ndarray, mtime: np.ndarray,
                 ctime: np.ndarray, kids: np.ndarray, n_files: int, dev: int, hash_keys: np.ndarray,
                 hash_order: np.ndarray) -> None:
        n = len(parents)
        self.n_nodes = n
        self._n_files = n_files
        self.parents = parents  # int32 per node (the root's is 0)
        self.kinds = kinds  # int8 per node
        self._names, self._name_ends = names, name_ends
        self._link_nodes, self._links, self._link_ends = link_nodes, links, link_ends  # symlinks only
        self.meta = meta  # int64 [distinct, (mode, nlink, uid, gid, rdev)]
        self._meta_rows: list[tuple[int, ...]] = [tuple(r) for r in meta.tolist()]
        self.meta_idx = meta_idx.astype(_row_dtype(len(meta)), copy=False)  # per node: its row of ``meta``
        self.size, self.mtime, self.ctime = size, mtime, ctime
        self.ino, self.blocks_ = _narrow(ino), _narrow(blocks)  # (uint32 when they fit)
        self._filled = n_files  # file slots in use (the rest: room for files the backing gains, see with_room)
        self._next_other = n  # the first node of the room for directories, symlinks and special entries
        first = np.zeros(n - n_files + 1, np.int64)
        first[1:] = np.cumsum(np.bincount(self.dir_slots(parents[kids]), minlength=n - n_files))
        #: (kids, first): directory p's children, by name, are kids[first[s]:first[s + 1]], s = dir_slot(p); one
        #: attribute, so that a thread reading it while :meth:`join` links new nodes sees one version of both
        self._children = (kids, first)
        self.dev = dev
        self.sizes = size[1:n_files + 1]
        self.blocks = self.blocks_[1:n_files + 1]
        self.groups = parents[1:n_files + 1]
        self._hard_links()
        #: files found gone from the backing during this mount (a rescan, a re-stat, a copy or an open answered
        #: ENOENT): out of every view and listing from then on, never staged again; one that comes back joins
        #: again as added files do (see "Room to grow"); also, until they join, the files a rescan took
        self.gone = np.zeros(n_files, bool)
        self.gone_files = 0
        #: files masked in ``gone``: those found gone and those not joined yet (what :meth:`present` leaves out)
        self.hidden = 0
        #: growth (see "Room to grow" above): rescans whose news were taken, nodes taken since the scan with
        #: their names and link texts, the nodes not in a directory yet and the files still masked (each with the
        #: growth that took it), and the nodes not in a directory by (parent, name)
        self.growth = 0
        self._late: dict[int, bytes] = {}
        self._late_links: dict[int, bytes] = {}
        self._unlinked: dict[tuple[int, bytes], int] = {}
        self._link_due: list[tuple[int, int]] = []
        self._unmask: dict[int, int] = {}
        #: changes of a node's mode, owner or group found during this mount (see "Access changes" above): how many
        #: so far, the count at each node's last one, and the nodes the kernel has not been told of since
        self.access_serial = 0
        self._access_changed: dict[int, int] = {}
        self.access_untold: dict[int, int] = {}
        self.access_watcher: AccessWatcher | None = None
        self._path_index: tuple[np.ndarray, np.ndarray] | None = (
            hash_keys, hash_order.astype(index_dtype(n_files), copy=False))
        self.nodes = _Nodes(self)
        self._dir_path = functools.lru_cache(maxsize=NODE_CACHE)(self.path)  # (the paths of recent directories)
        #: what the paths of directory i's entries start with (b"" for the root)
        self._dir_prefix = functools.lru_cache(maxsize=NODE_CACHE)(lambda i: self._dir_path(i) + b"/" if i else b"")

    def watch_access(self, watcher: AccessWatcher) -> None:
        """``watcher`` is told when a re-stat finds a file's mode or owner changed (the namespace: the kernel's
        attributes and permission checks follow)."""
        self.access_watcher = watcher

    def _hard_links(self) -> None:
        """Files sharing a backing inode (more than one name in the tree): ``_linked`` (their file indices,
        sorted) and per each the first of its names in storage order (``_canon``).  Few: kept sparse."""
        nf = self._filled
        many = np.flatnonzero(self.meta[self.meta_idx[1:nf + 1], _NLINK] > 1)
        ino = self.ino[many + 1]
        by_ino = np.lexsort((many, ino))
        many, ino = many[by_ino], ino[by_ino]
        new_group = np.r_[True, ino[1:] != ino[:-1]] if many.size else np.zeros(0, bool)
        group = np.cumsum(new_group) - 1
        starts = np.flatnonzero(new_group)
        shared = np.diff(np.r_[starts, len(many)])[group] > 1  # (a name alone in the tree shares nothing)
        canon = many[starts][group]
        keep = np.argsort(many[shared], kind="stable")
        self._linked, self._canon = many[shared][keep], canon[shared][keep]
        second = self._canon != self._linked
        self._first_of = dict(zip(self._linked[second].tolist(), self._canon[second].tolist(), strict=True))

    @functools.cached_property
    def dir_nodes(self) -> np.ndarray:
        """The directories' nodes, the root first (made when first asked for)."""
        return np.flatnonzero(self.kinds == KIND_DIR)

    @functools.cached_property
    def dirs_with_data(self) -> np.ndarray:
        """Per node: a directory holding a file somewhere beneath it (made when first asked for)."""
        out = np.zeros(self.n_nodes, bool)
        up = np.unique(self.groups)
        while up.size:
            up = up[~out[up]]
            out[up] = True
            up = np.unique(self.parents[up[up != 0]])
        return out

    # ----------------------------------------------------------------------------------- per node

    @property
    def n_files(self) -> int:
        """The files the tree has numbered (those found gone and those not joined yet too; not its room)."""
        return self._filled

    @property
    def n_slots(self) -> int:
        """The length of every per-file array: the files and the room for more (see "Room to grow")."""
        return self._n_files

    @property
    def files(self) -> np.ndarray:
        """The node of each file index (file ``f`` is node ``f + 1``)."""
        return np.arange(1, self._filled + 1, dtype=np.int64)

    def name(self, i: int) -> bytes:
        if self._late and i in self._late:
            return self._late[i]
        return self._names[(int(self._name_ends[i - 1]) if i else 0):int(self._name_ends[i])]

    def path(self, i: int) -> bytes:
        """Node ``i``'s path relative to the backing root (b"" for the root)."""
        if i == 0:
            return b""
        parent = int(self.parents[i])
        return self.name(i) if parent == 0 else self._dir_path(parent) + b"/" + self.name(i)

    def link(self, i: int) -> bytes:
        if i in self._late_links:
            return self._late_links[i]
        at = int(np.searchsorted(self._link_nodes, i))
        if at == len(self._link_nodes) or int(self._link_nodes[at]) != i:
            return b""
        return self._links[(int(self._link_ends[at - 1]) if at else 0):int(self._link_ends[at])]

    def kind_of(self, i: int) -> int:
        return int(self.kinds[i])

    def fidx_of(self, i: int) -> int:
        """The file index of node ``i``, -1 for anything but a file."""
        return i - 1 if 0 < i <= self._filled else -1

    @property
    def n_dir_slots(self) -> int:
        return self.n_nodes - self._n_files

    def dir_slot(self, i: int) -> int:
        """Node ``i``'s index in the per-directory arrays (the root, then the nodes after the files)."""
        return i - self._n_files if i > self._n_files else 0

    def dir_slots(self, nodes: np.ndarray) -> np.ndarray:
        """:meth:`dir_slot` of directory nodes (``n_dir_slots`` in all)."""
        return np.where(nodes > self._n_files, nodes - self._n_files, 0)

    def children(self, i: int) -> np.ndarray:
        """The nodes in directory ``i``, sorted by name (empty for anything else)."""
        kids, first = self._children
        if 0 < i <= self._n_files:
            return kids[:0]
        s = self.dir_slot(i)
        return kids[first[s]:first[s + 1]]

    def child(self, i: int, name: bytes) -> int | None:
        """The node called ``name`` in directory ``i`` (a binary search over its sorted names), or None."""
        if 0 < i <= self._n_files:
            return None
        kids, first = self._children
        s = self.dir_slot(i)
        lo, stop = first.item(s), first.item(s + 1)
        if self._late:  # (names taken since the scan: the general way)
            at = self._name_search(kids, lo, stop, name)
            return kids.item(at) if at < stop and self.name(kids.item(at)) == name else None
        hi = stop
        ends, names = self._name_ends, self._names  # (a lookup per open: no Python call a step)
        while lo < hi:
            mid = (lo + hi) >> 1
            k = kids.item(mid)  # (a child is never the root: its name starts where node k - 1's ends)
            if names[ends.item(k - 1):ends.item(k)] < name:
                lo = mid + 1
            else:
                hi = mid
        if lo < stop and self.name(k := kids.item(lo)) == name:
            return k
        return None

    def _name_search(self, kids: np.ndarray, lo: int, hi: int, name: bytes) -> int:
        """Where ``name`` is, or goes, among the names of ``kids[lo:hi]`` (sorted): a binary search."""
        while lo < hi:
            mid = (lo + hi) >> 1
            if self.name(kids.item(mid)) < name:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def names_of(self, nodes: np.ndarray) -> list[bytes]:
        """:meth:`name` of each of ``nodes`` (none the root), with no Python code run per node."""
        ends = self._name_ends[nodes]
        starts = self._name_ends[nodes - 1]
        out = list(map(self._names.__getitem__, map(slice, starts.tolist(), ends.tolist())))
        if self._late:
            late = self._late
            for j in np.flatnonzero(np.isin(nodes, np.fromiter(late, np.int64, len(late)))).tolist():
                out[j] = late[int(nodes[j])]
        return out

    def attributes_of(self, nodes: np.ndarray) -> tuple[np.ndarray, ...]:
        """:meth:`attributes` of each of ``nodes``: (mode, nlink, uid, gid, rdev) per node (int64 [node, 5], a
        copy), then size, blocks, mtime_ns and ctime_ns (int64 each)."""
        return (self.meta[self.meta_idx[nodes]], self.size[nodes], self.blocks_[nodes].astype(np.int64),
                self.mtime[nodes], self.ctime[nodes])

    def attributes(self, i: int) -> Attributes:
        """(mode, nlink, uid, gid, rdev, size, blocks, mtime_ns, ctime_ns) of node ``i``: what a mount shows."""
        mode, nlink, uid, gid, rdev = self._meta_rows[self.meta_idx.item(i)]
        return (mode, nlink, uid, gid, rdev, self.size.item(i), self.blocks_.item(i), self.mtime.item(i),
                self.ctime.item(i))

    def stat_of(self, i: int) -> os.stat_result:
        """Node ``i`` as an ``os.stat_result`` (atime shows the mtime: the tree does not keep atimes)."""
        mode, nlink, uid, gid, rdev, size, blocks, mtime, ctime = self.attributes(i)
        return os.stat_result((mode, int(self.ino[i]), self.dev, nlink, uid, gid, size, mtime // 10**9,
                               mtime // 10**9, ctime // 10**9, mtime / 1e9, mtime / 1e9, ctime / 1e9, mtime,
                               mtime, ctime, 4096, blocks, rdev))

    def _make(self, i: int) -> Node:
        kind = int(self.kinds[i])
        node = Node(self.name(i), int(self.parents[i]), kind, self.path(i), self.stat_of(i))
        node.fidx = self.fidx_of(i)
        if kind == KIND_LINK:
            node.link = self.link(i)
        elif kind == KIND_DIR:
            node.children = {self.name(k): k for k in self.children(i).tolist()}
        return node

    def node_of_inode(self, inode: int) -> Node | None:
        i = inode - 1
        if 0 <= i < self.n_nodes:
            return self.nodes[i]
        return None

    # ----------------------------------------------------------------------------------- per file

    def file_node(self, fidx: int) -> Node:
        return self.nodes[fidx + 1]

    def inode_of(self, fidx: int) -> int:
        """The FUSE inode of file ``fidx`` (a node's inode is its index + 1; 1 is the root)."""
        return fidx + 2

    def file_path(self, fidx: int) -> bytes:
        return self.path(fidx + 1)

    def file_stat(self, fidx: int) -> os.stat_result:
        """File ``fidx``'s stat as the tree has it (``file_node(fidx).st`` without making the node: no path)."""
        return self.stat_of(fidx + 1)

    def dir_paths(self, nodes: np.ndarray) -> list[bytes]:
        """The paths of directory ``nodes`` relative to the backing root, the root's as ``b"."`` (for a stat)."""
        return [self._dir_path(i) or b"." for i in nodes.tolist()]

    def file_paths(self, fidx: np.ndarray) -> list[bytes]:
        """:meth:`file_path` of each of ``fidx``, with no Python code run per file (a directory's path is made
        once, and kept among the recent ones)."""
        nodes = np.asarray(fidx) + 1
        return list(map(bytes.__add__, map(self._dir_prefix, self.parents[nodes].tolist()), self.names_of(nodes)))

    def first_name(self, fidx: int) -> int:
        """The first file (in storage order) of those sharing ``fidx``'s backing inode: ``fidx`` itself unless
        it is a second name of a hard-linked file."""
        return self._first_of.get(fidx, fidx)

    def first_name_of(self, fidx: np.ndarray) -> np.ndarray:
        """:meth:`first_name` of each of ``fidx``."""
        if not self._linked.size:
            return fidx
        at = np.minimum(np.searchsorted(self._linked, fidx), len(self._linked) - 1)
        return np.where(self._linked[at] == fidx, self._canon[at], fidx)

    def first_names(self) -> np.ndarray:
        """The file indices that are no second name of a hard-linked file (all, without hard links)."""
        files = np.arange(self._filled, dtype=index_dtype(self._n_files))
        return files[~np.isin(files, self._linked[self._canon != self._linked])] if self._linked.size else files

    def fingerprints(self, fidx: np.ndarray | None = None) -> np.ndarray:
        """(size, mtime_ns, ino, ctime_ns) per file index (of ``fidx``, or all), as the tree knows them now (ino 0
        unless :attr:`stable_inodes`)."""
        nodes = slice(1, self._filled + 1) if fidx is None else np.asarray(fidx) + 1
        ino = self.ino[nodes].astype(np.int64) if self.stable_inodes else np.zeros(len(self.size[nodes]), np.int64)
        return np.stack([self.size[nodes], self.mtime[nodes], ino, self.ctime[nodes]], axis=-1)

    def path_hash_of(self, fidx: int) -> int:
        """:func:`path_hash` of file ``fidx``'s path."""
        return path_hash(self.file_path(fidx))

    def path_index(self) -> tuple[np.ndarray, np.ndarray]:
        """(the files' path hashes sorted (uint64), the file of each); made again if it was released."""
        if self._path_index is None:
            nf = self._filled
            hashes = np.fromiter((self.path_hash_of(f) for f in range(nf)), np.uint64, nf)
            order = np.argsort(hashes, kind="stable").astype(index_dtype(nf))
            self._path_index = (hashes[order], order)
        return self._path_index

    def release_path_index(self) -> None:
        """The mount's start is over: the path hashes need not stay (12 bytes a file; see the class docstring)."""
        self._path_index = None

    def files_with_path_hash(self, h: int) -> list[int]:
        """The files whose path hashes to ``h`` (one, almost always)."""
        keys, order = self.path_index()
        lo, hi = keys.searchsorted(np.uint64(h)), keys.searchsorted(np.uint64(h), "right")
        return order[lo:hi].tolist()

    def files_of_path_hashes(self, hashes: np.ndarray) -> np.ndarray:
        """Per hash the one file whose path hashes to it; -1 where none does, or more than one."""
        keys, order = self.path_index()
        if not len(keys):
            return np.full(len(hashes), -1, np.int64)
        lo, hi = keys.searchsorted(hashes), keys.searchsorted(hashes, "right")
        return np.where(hi - lo == 1, order[np.minimum(lo, len(keys) - 1)], -1)

    def fingerprint_of(self, fidx: int) -> Fingerprint:
        """:func:`fingerprint` of file ``fidx`` as the tree knows it, without making its node."""
        i = fidx + 1
        return (int(self.size[i]), int(self.mtime[i]), int(self.ino[i]) if self.stable_inodes else 0,
                int(self.ctime[i]))

    def fingerprint(self, st: os.stat_result) -> Fingerprint:
        """:func:`fingerprint` of a stat answer about one of this tree's files, comparable with its own."""
        return fingerprint(st, self.stable_inodes)

    def holds(self, fidx: int, fp: Fingerprint) -> bool:
        """Whether ``fp`` is file ``fidx``'s fingerprint as the tree knows it now: a copy made with ``fp`` is of
        the file the mount serves (a backing answer's is judged by ``Revalidator.verdict``, which asks this)."""
        return self.fingerprint_of(fidx) == fp

    def holds_many(self, files: np.ndarray, fps: Sequence[Fingerprint] | np.ndarray) -> np.ndarray:
        """:meth:`holds` for many files at once, as a mask (a batch plan asks it for a whole pass, a mount for
        every copy of the cache index)."""
        return np.all(self.fingerprints(files) == np.asarray(fps, np.int64).reshape(-1, 4), axis=1)

    def mark_gone(self, fidx: int) -> bool:
        """File ``fidx`` is gone from the backing (see :attr:`gone`); False if it was known gone already."""
        if self._unmask.pop(fidx, None) is not None:  # (not joined yet: it never will)
            self.gone_files += 1
            return True
        if self.gone[fidx]:
            return False
        self.gone[fidx] = True
        self.gone_files += 1
        self.hidden += 1
        return True

    def present(self, files: np.ndarray) -> np.ndarray:
        """``files`` without those found gone and those not joined yet (the array itself when none is)."""
        return files[~self.gone[files]] if self.hidden else files

    def update_stat(self, fidx: int, st: os.stat_result) -> None:
        """File ``fidx`` is now as ``st`` says (a change found in the backing)."""
        i = fidx + 1
        self._set_meta(i, _META(st))
        self._set_stat(i, st)

    def _set_stat(self, i: int, st: os.stat_result) -> None:
        """Node ``i``'s size, blocks, times and inode number are ``st``'s."""
        self.size[i], blocks, mtime, ctime = _COLUMNS(st)
        self.mtime[i], self.ctime[i] = clamp_ns(mtime), clamp_ns(ctime)
        if st.st_ino >= 2**32 and self.ino.dtype == np.uint32:  # (see _narrow)
            self.ino = self.ino.astype(np.uint64)
        if blocks >= 2**32 and self.blocks_.dtype == np.uint32:
            self.blocks_ = self.blocks_.astype(np.int64)
            self.blocks = self.blocks_[1:self._n_files + 1]
        self.ino[i], self.blocks_[i] = st.st_ino, blocks
        self.nodes.drop(i)

    def _set_meta(self, i: int, row: tuple[int, ...]) -> None:
        """Node ``i``'s (mode, nlink, uid, gid, rdev) are now ``row``; a change of its mode, owner or group is
        counted (see "Access changes" in the module docstring)."""
        old = self._meta_rows[self.meta_idx.item(i)]
        if tuple(row) == old:
            return
        self.meta_idx[i] = self._meta_row(row)
        self.nodes.drop(i)
        if _access(old) != _access(row):
            self.access_serial += 1
            self._access_changed[i] = self.access_untold[i] = self.access_serial
            if self.access_watcher is not None:
                self.access_watcher.access_changed()

    def _meta_row(self, row: tuple[int, ...]) -> int:
        """The row of ``meta`` holding ``row``, added if none does."""
        new = np.array(row, np.int64)
        same = np.flatnonzero((self.meta == new).all(axis=1))
        if same.size:
            return int(same[0])
        self.meta = np.vstack([self.meta, new])
        self.meta_idx = self.meta_idx.astype(_row_dtype(len(self.meta)), copy=False)
        self._meta_rows.append(tuple(new.tolist()))
        return len(self.meta) - 1

    def update_access(self, i: int, st: os.stat_result) -> bool:
        """Directory ``i``'s mode, owner and group are now ``st``'s (a backing stat); whether they changed.  Its
        other attributes stay the scan's (a directory's size and times are not served from the backing)."""
        mode, nlink, uid, gid, rdev = self._meta_rows[self.meta_idx.item(i)]
        if (mode, uid, gid) == (st.st_mode, st.st_uid, st.st_gid):
            return False
        self._set_meta(i, (st.st_mode, nlink, st.st_uid, st.st_gid, rdev))
        return True

    def access_of(self, i: int) -> tuple[int, int, int]:
        """Node ``i``'s (mode, uid, gid): what the kernel checks a user against."""
        return _access(self._meta_rows[self.meta_idx.item(i)])

    def access_changed_since(self, i: int, serial: int) -> bool:
        """Whether node ``i``'s mode, owner or group changed after ``access_serial`` was ``serial``."""
        return self._access_changed.get(i, -1) > serial

    def untold_among(self, i: int) -> dict[int, int]:
        """Of node ``i`` and the directories above it, those in ``access_untold`` (with their serials)."""
        untold = self.access_untold
        out: dict[int, int] = {}
        while True:
            if i in untold:
                out[i] = untold[i]
            if i == 0:
                return out
            i = self.parents.item(i)

    def told(self, nodes: dict[int, int]) -> None:
        """The kernel was told the attributes of ``nodes`` as of their serials (from :meth:`untold_among` or
        ``access_untold``): those that did not change again meanwhile are no longer untold."""
        for i, serial in nodes.items():
            if self.access_untold.get(i) == serial:
                del self.access_untold[i]

    def dir_access_news(self, new: Tree) -> list[tuple[int, os.stat_result]]:
        """The directories of this tree whose mode, owner or group differ in ``new`` (a newer scan of the same
        backing), matched by path, with their stat there (a worker thread: a Python step per directory)."""
        theirs = {new.path(j): j for j in new.dir_nodes.tolist()}
        out = []
        for i in self.dir_nodes.tolist():
            j = theirs.get(self.path(i))
            if j is not None and self.access_of(i) != new.access_of(j):
                out.append((i, new.stat_of(j)))
        return out

    # ---------------------------------------------------------------------------------- the saved tree

    def save(self, path: str, *, dir_fd: int | None = None) -> None:
        """Write the tree's arrays to ``path`` (a name in the directory ``dir_fd``, if given) atomically, one
        ``.npy`` record after another (read back at disk speed: a zip of them read at a third of it): a remount
        over the same cache answers from it at once and rescans in the background (see ``opening.TreeKeeper``).
        About 70 bytes per file plus its name.  A tree with room (:meth:`with_room`) is saved without it, as it
        was scanned, one array at a time (no second tree held); one that took entries since (:meth:`grow`) is not
        saved (``ValueError``): a newer scan is (``opening.TreeKeeper``)."""
        if self.growth or self._late:
            raise ValueError("a tree that took entries since its scan is not saved: save a newer scan")
        nf, files, others = self._filled, *self.room
        n = self.n_nodes - files - others

        def per_node(a: np.ndarray) -> np.ndarray:
            return np.concatenate([a[:nf + 1], a[nf + 1 + files:self.n_nodes - others]]) if files or others else a

        def unshifted(nodes: np.ndarray) -> np.ndarray:
            return np.where(nodes > nf, nodes - files, nodes).astype(nodes.dtype) if files else nodes

        keys, order = self.path_index()
        arrays = {"parents": lambda: unshifted(per_node(self.parents)), "kinds": lambda: per_node(self.kinds),
                  "names": lambda: np.frombuffer(self._names, np.uint8),
                  "name_ends": lambda: per_node(self._name_ends), "link_nodes": lambda: unshifted(self._link_nodes),
                  "links": lambda: np.frombuffer(self._links, np.uint8), "link_ends": lambda: self._link_ends,
                  "meta": lambda: self.meta,
                  "meta_idx": lambda: per_node(self.meta_idx), "ino": lambda: per_node(self.ino),
                  "size": lambda: per_node(self.size), "blocks": lambda: per_node(self.blocks_),
                  "mtime": lambda: per_node(self.mtime), "ctime": lambda: per_node(self.ctime),
                  "kids": lambda: unshifted(self._children[0]), "hash_keys": lambda: keys, "hash_order": lambda: order}
        h = xxhash.xxh3_64()
        with atomic_open(path, dir_fd=dir_fd) as f:
            head = np.array([TREE_FORMAT, n, nf, self.dev], np.int64)
            for a in (head, *(arrays[name]() for name in _SAVED)):  # (made one at a time, let go once written)
                np.save(f, a, allow_pickle=False)
                _digest(h, a)
            np.save(f, np.array([h.intdigest()], np.uint64), allow_pickle=False)  # (last: see load)

    @classmethod
    def load(cls, path: str, root_st: os.stat_result, *, dir_fd: int | None = None,
             strict: bool = False) -> Tree | None:
        """The tree saved at ``path`` (a name in the directory ``dir_fd``, if given; never through a symlink) if
        it was saved for this backing root (same device and inode) in this format; else None (the mount scans):
        none there, an earlier release's, another root's.  A damaged one (cut short, bytes changed: its checksum
        differs, anything numpy cannot read) is None too, or with ``strict`` a ``ValueError`` saying what is wrong
        (the mount says so and removes it: ``opening.TreeKeeper``)."""
        try:
            with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd), "rb") as f:
                if f.read(4) == b"PK\x03\x04":
                    return None  # a zip of arrays: an early release's
                f.seek(0)
                head = _read_array(f)
                if head.dtype == np.int64 and head.shape in ((3,), (4,)) and 2 <= int(head[0]) < TREE_FORMAT:
                    return None  # an earlier release's format
                if head.shape != (4,) or head.dtype != np.int64 or int(head[0]) != TREE_FORMAT:
                    raise ValueError("its first record is not a tree's")
                a = {name: _read_array(f) for name in _SAVED}
                saved_digest = _read_array(f)
                if f.read(1):
                    raise ValueError("it goes on past its end")
            h = xxhash.xxh3_64()
            for arr in (head, *a.values()):
                _digest(h, arr)
            if saved_digest.shape != (1,) or saved_digest.dtype != np.uint64 or int(saved_digest[0]) != h.intdigest():
                raise ValueError("its checksum does not match: bytes in it changed")
            n, nf, dev = int(head[1]), int(head[2]), int(head[3])
            per_node = ("parents", "kinds", "name_ends", "meta_idx", "ino", "size", "blocks", "mtime", "ctime")
            if not 0 < nf + 1 <= n or any(len(a[k]) != n for k in per_node) or len(a["kids"]) != n - 1 \
                    or len(a["hash_keys"]) != nf or len(a["hash_order"]) != nf \
                    or len(a["link_ends"]) != len(a["link_nodes"]) or a["meta"].shape[1:] != (5,):
                raise ValueError("its arrays disagree in length")
            if (dev, int(a["ino"][0])) != (root_st.st_dev, root_st.st_ino):
                return None
            return cls(parents=a["parents"], kinds=a["kinds"], names=a["names"].tobytes(), name_ends=a["name_ends"],
                       link_nodes=a["link_nodes"], links=a["links"].tobytes(), link_ends=a["link_ends"],
                       meta=a["meta"], meta_idx=a["meta_idx"], ino=a["ino"], size=a["size"], blocks=a["blocks"],
                       mtime=a["mtime"], ctime=a["ctime"], kids=a["kids"], n_files=nf, dev=dev,
                       hash_keys=a["hash_keys"], hash_order=a["hash_order"])
        except FileNotFoundError:
            return None
        except Exception as exc:  # (whatever a damaged file makes numpy raise: the mount goes on without it)
            if not strict:
                return None
            why = str(exc) if type(exc) is ValueError else f"it cannot be read: {exc.strerror or exc}" \
                if isinstance(exc, OSError) else f"it cannot be read ({type(exc).__name__}: {exc})"
            raise ValueError(why) from None

    def compare(self, new: Tree) -> Comparison:
        """What a newer scan of the same backing says about this tree's files (see :class:`Comparison`).  Matched
        by path hash, then by path, vectorised (a worker thread: what it reads of this tree the trio thread may
        change meanwhile only a file at a time)."""
        (keys, order), (mine, mine_order) = new.path_index(), self.path_index()
        nf = self.n_files
        at = np.minimum(np.searchsorted(keys, mine), max(0, len(keys) - 1))
        found = np.zeros(nf, bool)
        match = np.full(nf, -1, np.int64)
        if len(keys):
            hit = keys[at] == mine
            found[mine_order] = hit
            match[mine_order] = np.where(hit, order[at], -1)
        theirs_found = np.zeros(new.n_files, bool)
        theirs_found[match[found]] = True
        was_gone = self.gone[:nf].copy()  # (found gone during this mount, not only waiting to join)
        joining = list(self._unmask)  # (a snapshot: the trio thread may join files meanwhile)
        was_gone[np.array(joining, np.int64)] = False
        mine_fp, theirs_fp = self.fingerprints(), new.fingerprints()
        differs = found & (np.any(mine_fp != theirs_fp[np.maximum(match, 0)], axis=1) if len(keys) else False)
        changed: list[tuple[int, os.stat_result]] = []
        returned: list[tuple[int, os.stat_result]] = []
        gone: list[int] = np.flatnonzero(~found).tolist()
        for fidx in np.flatnonzero(differs | (found & was_gone)).tolist():
            g = int(match[fidx])
            if new.file_path(g) != self.file_path(fidx):  # (two paths with one 64-bit hash: compare the slow way)
                gone.append(fidx)
            else:
                (returned if was_gone[fidx] else changed).append((fidx, new.stat_of(g + 1)))
        return Comparison(changed, sorted(gone), np.flatnonzero(~theirs_found), returned)

    # -------------------------------------------------------------------------------------- room to grow

    def with_room(self, files: int, others: int, *, consume: bool = False) -> Tree:
        """This tree (as scanned or loaded) with room for ``files`` more files and ``others`` more directories,
        symlinks and special entries (see "Room to grow" in the module docstring); the same numbering for every
        file (file ``f`` is still node ``f + 1``), the other nodes after the room for files.  A new tree.  With
        ``consume`` this one gives up each array as its longer one is made (it is unusable after): the mount's
        peak is this tree and one array, not two trees."""
        nf, n = self._n_files, self.n_nodes
        if not files and not others:
            return self

        def per_node(a: np.ndarray, fill: int) -> np.ndarray:
            return np.concatenate([a[:nf + 1], np.full(files, fill, a.dtype), a[nf + 1:],
                                   np.full(others, fill, a.dtype)])

        def shifted(nodes: np.ndarray, dt: type[np.generic]) -> np.ndarray:
            out = nodes.astype(dt)
            out[out > nf] += files
            return out

        def taken(name: str) -> np.ndarray:
            a = getattr(self, name)
            if consume:
                setattr(self, name, None)
            return a

        keys, order = self.path_index()
        meta = np.vstack([self.meta, np.array([[0, 1, 0, 0, 0]], np.int64)])  # (a hole's: no hard link)
        if consume:
            self.sizes = self.blocks = self.groups = None  # type: ignore[assignment]  # (views of the arrays)
        kids = shifted(self._children[0], np.int32)
        if consume:
            self._children = None  # type: ignore[assignment]
        parents = per_node(shifted(taken("parents"), np.int32), 0)
        kinds = per_node(taken("kinds"), KIND_HOLE)
        ends = taken("_name_ends")  # (a hole's name is empty: its end repeats)
        name_ends = np.concatenate([ends[:nf + 1], np.full(files, ends[nf], ends.dtype), ends[nf + 1:],
                                    np.full(others, ends[-1], ends.dtype)])
        del ends
        columns = {name: per_node(taken(name), 0) for name in ("ino", "size", "blocks_", "mtime", "ctime")}
        tree = Tree(parents=parents, kinds=kinds, names=self._names, name_ends=name_ends,
                    link_nodes=shifted(self._link_nodes, np.int64), links=self._links,
                    link_ends=self._link_ends, meta=meta,
                    meta_idx=per_node(taken("meta_idx").astype(_row_dtype(len(meta))), len(meta) - 1),
                    ino=columns["ino"], size=columns["size"], blocks=columns["blocks_"], mtime=columns["mtime"],
                    ctime=columns["ctime"], kids=kids, n_files=nf + files, dev=self.dev, hash_keys=keys,
                    hash_order=order)
        tree._filled, tree._next_other = nf, n + files
        tree.unlistable, tree.unlistable_dirs, tree.stable_inodes = (self.unlistable, self.unlistable_dirs,
                                                                     self.stable_inodes)
        return tree

    @property
    def room(self) -> tuple[int, int]:
        """(files, other entries) this tree still has room for."""
        return self._n_files - self._filled, self.n_nodes - self._next_other

    def additions(self, new: Tree, files: np.ndarray, *, settled_ns: int | None = None) -> Additions:
        """The entries of ``new`` (a newer scan of the same backing) this tree lacks, parents before children:
        its symlinks and special entries, then ``files`` (its files this tree lacks, in storage order:
        :attr:`Comparison.added`), each new directory with the first entry taken under it (an empty one, or one
        whose files are all still being written, waits: a class directory never joins empty).  A file whose
        mtime or ctime is after ``settled_ns`` (ns since the epoch) is still being written -- a copy under way,
        a writer's temporary file -- and waits for a later rescan.  One whose name this tree holds as another
        kind (a file now a directory) is left out, with what is under it: it shows from the next mount.  A
        worker thread: a Python step per directory of ``new`` (its structure is only read; :meth:`grow` and
        :meth:`join` run on the trio thread, between rescans)."""
        out = Additions()
        unlinked = dict(self._unlinked)  # (first: a join meanwhile moves a node from it into a directory)
        #: new's directories: this tree's node (>= 0), -1 - k for addition k, None for one not taken (yet)
        where: dict[int, int | None] = {0: 0}
        others: list[int] = []

        def mine(parent: int | None, name: bytes) -> int | None:
            if parent is None or parent < 0:
                return None
            at = self.child(parent, name)
            return at if at is not None else unlinked.get((parent, name))

        def taken(j: int) -> int:
            """Directory ``j`` of new as a parent: taken first if it is new."""
            at = where[j]
            if at is None:
                at = where[j] = out.add(taken(int(new.parents[j])), new.name(j), KIND_DIR, new.stat_of(j), b"")
            return at

        for j in range(new._n_files + 1, new.n_nodes):  # (breadth first: a parent before its children)
            up = int(new.parents[j])
            kind = int(new.kinds[j])
            if up not in where or kind == KIND_HOLE:
                continue  # (under a directory left out)
            have = mine(where[up], new.name(j))
            if kind == KIND_DIR:
                if have is None or int(self.kinds[have]) == KIND_DIR:
                    where[j] = have
            elif have is None:
                others.append(j)
        for j in others:
            kind = int(new.kinds[j])
            out.add(taken(int(new.parents[j])), new.name(j), kind, new.stat_of(j),
                    new.link(j) if kind == KIND_LINK else b"")
        for g in files.tolist():
            up = int(new.parents[g + 1])
            if up not in where:
                continue
            st, name = new.stat_of(g + 1), new.name(g + 1)
            if settled_ns is not None and max(st.st_mtime_ns, st.st_ctime_ns) > settled_ns:
                continue
            if mine(where[up], name) is None:
                out.add(taken(up), name, KIND_FILE, st, b"")
        return out

    def grow(self, added: Additions, returned: Sequence[tuple[int, os.stat_result]] = ()) -> Growth:
        """Take ``added`` (:meth:`additions`) into the room, and ``returned`` files (found gone, back in the backing:
        :attr:`Comparison.returned`) back with their stat, all hidden until :meth:`join` is given this growth
        (see "Room to grow").  What does not fit the room is left out (it shows from the next mount).  The trio
        thread."""
        self.growth += 1
        gen = self.growth
        nodes: list[int] = []  # per addition: its node (-1: left out)
        taken: list[int] = []
        entries: list[tuple[int, bytes]] = []
        files = others = left = 0
        for parent, name, kind, st, text in added:
            known_parent = parent >= 0
            if parent < 0:
                parent = nodes[-1 - parent]
            if parent < 0 or (kind == KIND_FILE and self._filled == self._n_files) or (
                    kind != KIND_FILE and self._next_other == self.n_nodes):
                nodes.append(-1)
                left += kind == KIND_FILE
                continue
            if kind == KIND_FILE:
                i = self._filled + 1
                self._filled += 1
                self.gone[i - 1] = True
                self.hidden += 1
                self._unmask[i - 1] = gen
                taken.append(i - 1)
                files += 1
            else:
                i = self._next_other
                self._next_other += 1
                others += 1
                if kind == KIND_LINK:
                    self._late_links[i] = text
            nodes.append(i)
            self.parents[i], self.kinds[i] = parent, kind
            self._late[i] = name
            self._set_stat(i, st)
            self.meta_idx[i] = self._meta_row(_META(st))
            self._unlinked[(parent, name)] = i
            self._link_due.append((gen, i))
            if known_parent:
                entries.append((parent, name))
        for fidx, st in returned:
            self.update_stat(fidx, st)
            self._unmask[fidx] = gen
            self.gone_files -= 1  # (still hidden: it joins as the added files do)
            taken.append(fidx)
            entries.append((int(self.parents[fidx + 1]), self.name(fidx + 1)))
        if files or others:
            self._path_index = None
            if any(_META(st)[_NLINK] > 1 for _, _, kind, st, _ in added if kind == KIND_FILE):
                self._hard_links()
        return Growth(gen, files, others, left, len(returned), tuple(taken), tuple(entries))

    def join(self, growth: int) -> int:
        """The entries taken by growths up to ``growth`` join: into their directories, their files out of the
        mask (the epoch whose plan was made with them starts); how many files joined.  The trio thread."""
        due = [i for g, i in self._link_due if g <= growth]
        if due:
            self._link_due = [(g, i) for g, i in self._link_due if g > growth]
            kids, first = self._children
            nodes = np.array(due, np.int64)
            slots = self.dir_slots(self.parents[nodes].astype(np.int64))
            at = [self._name_search(kids, int(first[s]), int(first[s + 1]), self.name(i))
                  for s, i in zip(slots.tolist(), due, strict=True)]
            slot = slots.tolist()  # (new directories' runs are empty, all at the end: by slot, then name)
            by = sorted(range(len(due)), key=lambda k: (at[k], slot[k], self.name(due[k])))
            grown = np.insert(kids, [at[k] for k in by], nodes[by].astype(kids.dtype))
            more = np.zeros(len(first), np.int64)
            more[1:] = np.cumsum(np.bincount(slots, minlength=len(first) - 1))
            self._children = (grown, first + more)
            for i in due:
                self._unlinked.pop((int(self.parents[i]), self.name(i)), None)
            for cached in ("dir_nodes", "dirs_with_data"):
                self.__dict__.pop(cached, None)
        joined = [f for f, g in self._unmask.items() if g <= growth]
        for f in joined:
            del self._unmask[f]
            self.gone[f] = False
        self.hidden -= len(joined)
        return len(joined)

    def may_come(self, i: int, name: bytes) -> bool:
        """Whether an entry ``name`` of directory ``i`` that a lookup does not find now may be found later in
        this mount: a rescan took it and it has not joined, or it is a file found gone (one may come back)."""
        if (i, name) in self._unlinked:
            return True
        at = self.child(i, name)
        return at is not None and 0 < at <= self._filled and bool(self.gone[at - 1])

    @property
    def joining(self) -> int:
        """Files taken by a growth, not joined yet."""
        return len(self._unmask)

    # ---------------------------------------------------------------------------------------- the scan

    @classmethod
    def scan(cls, root_fd: int, root_path: str | None = None,
             progress: Callable[[ScanCount], None] | None = None, *, unlistable: str = "skip",
             quiet: bool = False) -> Tree:
        """Scan the tree below ``root_fd`` (see the module docstring).  ``root_path``: where it is mounted in
        this process's view, to leave out bind mounts from the same filesystem (same ``st_dev``), and to name
        the directories it cannot list.  ``progress(count)`` hears of it (a :class:`ScanCount`) at the start,
        every SCAN_REPORT_S -- between batches of a directory too, so a huge flat directory still reports -- and
        at the end (the log too).

        A directory it cannot list (a permission: an NFS ``root_squash`` export with a 0700 class dir; an I/O
        error) stays in the tree, empty: its files leave the data set, which a job would never notice.  So each
        is logged (the first UNLISTABLE_SHOWN by name, then one line for them all) and counted on the tree
        (``unlistable``, for ``status.tree``); ``unlistable="refuse"`` makes it a ``ValueError`` naming the
        directory instead (the mount is refused), at the end of the level it is found in.  ``quiet`` (a rescan
        while mounted, again every epoch): its progress and the directories it cannot list go to the debug log
        (the mount's scan said them; ``status.tree`` counts them)."""
        if unlistable not in ("skip", "refuse"):
            raise ValueError(f"unlistable must be skip or refuse, got {unlistable!r}")
        if progress is None:
            progress = _no_progress
        root_st = os.fstat(root_fd)
        prefix = os.fsencode(os.path.realpath(root_path)).rstrip(b"/") + b"/" if root_path else None
        mounted_below: frozenset[bytes] = frozenset()
        if prefix is not None:
            with contextlib.suppress(OSError):
                mounted_below = frozenset(w[len(prefix):] for _, w, _ in mountinfo() if w.startswith(prefix))
        scan = _Scan(root_st, mounted_below, root_path, quiet=quiet)
        last_log = t0 = time.monotonic()
        total = _entries_expected(root_fd, root_st)

        def count(seconds: float) -> ScanCount:
            return ScanCount(scan.count, scan.files, scan.bytes, seconds, total and max(total, scan.count),
                             scan.unlistable)

        progress(ScanCount(0, 0, 0, 0.0, total))  # (the start: nothing found yet)
        # (node, fd, path + "/") to list.  The root through an open of its own, not a dup of ``root_fd``: a dup
        # shares the mount's long-lived directory handle, which sshfs lists as empty once read to its end, rewound
        # and its listing cache expired -- every file "gone" at a rescan)
        try:
            root = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
        except OSError:  # (a root we may read but not search: listed through the mount's handle, or said unlistable)
            root = os.dup(root_fd)
        level: list[tuple[int, int, bytes]] = [(0, root, b"")]
        waits = True  # (a tier that waits, until a level's first batches show it does not)
        with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="tierfs-scan") as pool:
            try:
                while level:
                    # Breadth first, a level at a time: every directory's names at once (NUL-joined, SCAN_BATCH
                    # a piece: no Python object per name waits), then every entry's lstat in batches, in the
                    # pool where the tier waits (a network tier answers many requests at once, not one fast; see
                    # SCAN_PROBE); results are taken in order, so node numbers do not depend on who answered
                    # first.
                    jobs: list[tuple[int, int, bytes, bytes]] = []
                    for (node, fd, at), (pieces, err) in zip(
                            level, (pool.map if waits else map)(_names, [fd for _, fd, _ in level]), strict=True):
                        if err:
                            scan.cannot_list(at, err)
                        jobs += [(node, fd, at, piece) for piece in pieces]
                    nxt: list[tuple[int, int, bytes]] = []
                    try:
                        t_probe = time.perf_counter()
                        probed = [scan.batch(job) for job in jobs[:SCAN_PROBE]]
                        per_entry = (time.perf_counter() - t_probe) / max(1, sum(len(b.names) for b in probed))
                        rest = jobs[SCAN_PROBE:]
                        waits = per_entry > SCAN_WAITS_S  # (and the next level's listings go where these went)
                        batches = itertools.chain(probed, (pool.map if waits else map)(scan.batch, rest))
                        del probed, rest
                        for (node, _, dir_prefix, _), batch in zip(jobs, batches, strict=True):
                            nxt += scan.add(node, dir_prefix, batch)
                            if time.monotonic() - last_log > SCAN_REPORT_S:
                                last_log = time.monotonic()
                                now = count(last_log - t0)
                                (log.debug if quiet else log.info)("%s", now.line())
                                progress(now)
                        del jobs, batches
                        if unlistable == "refuse" and scan.unlistable:
                            raise ValueError(scan.refusal())
                    except BaseException:
                        for _, fd, _ in nxt:
                            os.close(fd)
                        raise
                    for _, fd, _ in level:
                        os.close(fd)
                    level = nxt
                    scan.levels.append(scan.count)
            finally:
                for _, fd, _ in level:
                    os.close(fd)
        done = count(time.monotonic() - t0)
        scan.said_unlistable()
        if scan.unlistable and not done.files:  # (an I/O error of the tier is not an empty data set)
            raise ValueError(scan.nothing_seen())
        tree = scan.tree()
        progress(ScanCount(done.entries, done.files, done.bytes, done.seconds, total and done.entries,
                           done.unlistable))
        return tree


#: what a scan leaves out as gone or replaced meanwhile (a directory renamed, swapped for a file or a symlink)
#: rather than count as a directory it cannot list
_GONE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})


def _names(fd: int) -> tuple[list[bytes], int]:
    """The names in a directory, sorted byte-wise, as pieces of SCAN_BATCH names joined by NUL bytes (a worker
    thread), and 0; or no names and the errno where the directory cannot be listed.  Encoded as ``os.fsencode``
    does, all at once (a name holds no NUL byte): no Python code run per name; the pieces keep no object per
    name (a level of a million entries waits as ~12 bytes each, not ~60)."""
    try:
        listed = os.listdir(fd)
    except OSError as exc:
        return [], exc.errno or errno.EIO
    if not listed:
        return [], 0
    joined = "\0".join(listed).encode(sys.getfilesystemencoding(), sys.getfilesystemencodeerrors())
    del listed
    names = joined.split(b"\0")
    del joined
    names.sort()
    return _batches(names, SCAN_BATCH), 0


def _each_lstat(lstat: Callable[[bytes], os.stat_result],
                names: list[bytes]) -> tuple[list[bytes], list[os.stat_result], int]:
    """``lstat`` of each name, leaving out those it fails for; the errno of the first failure that is not a name
    gone meanwhile (0 if none): a directory we may read but not search (mode 0744 to us) lists names whose
    entries we cannot see."""
    kept, sts, err = [], [], 0
    for name in names:
        try:
            sts.append(lstat(name))
        except OSError as exc:
            if not err and exc.errno not in _GONE:
                err = exc.errno or errno.EIO
            continue
        kept.append(name)
    return kept, sts, err


def _batches(items: list[bytes], n: int) -> list[bytes]:
    """``items`` in pieces of ``n``, each joined by NUL bytes."""
    return [b"\0".join(items[i:i + n]) for i in range(0, len(items), n)]


@dataclass
class _Batch:
    """What a worker thread found of a batch of names in one directory: the entries kept (in name order) as
    arrays, with a small table of their distinct (mode, nlink, uid, gid, rdev)."""

    names: list[bytes]
    kinds: np.ndarray
    meta: list[tuple[int, int, int, int, int]]
    meta_idx: np.ndarray
    ino: np.ndarray
    columns: np.ndarray  # int64 [entry, (size, blocks, mtime_ns, ctime_ns)]
    hashes: np.ndarray  # path hash of each file (0 for the others)
    links: dict[int, bytes] = field(default_factory=dict)  # entry -> link text
    dirs: dict[int, int] = field(default_factory=dict)  # entry -> opened directory fd
    unlistable: dict[int, int] = field(default_factory=dict)  # entry -> errno: a directory that cannot be opened
    denied: int = 0  # the errno of names of the batch's directory that could not be stat'ed (0: none)


@dataclass(frozen=True)
class ScanCount:
    """How far a scan is: what :meth:`Tree.scan`'s ``progress`` hears at the start, every SCAN_REPORT_S and at
    the end.  ``total``: the entries the scan will find, when it can be known before -- the backing dir is a
    filesystem of its own, whose used inodes are its entries (an NFS export's root); None otherwise.
    ``unlistable``: the directories it could not list so far."""

    entries: int
    files: int
    bytes: int
    seconds: float
    total: int | None = None
    unlistable: int = 0

    @property
    def rate(self) -> float:
        """Entries per second so far."""
        return self.entries / self.seconds if self.seconds > 0 else 0.0

    @property
    def eta(self) -> float | None:
        """Seconds left at the rate so far, when the total is known."""
        if self.total is None or self.rate <= 0:
            return None
        return max(0.0, (self.total - self.entries) / self.rate)

    def line(self) -> str:
        """One line for the log, systemd's ``STATUS=`` and a terminal without a bar."""
        eta = self.eta
        left = f", about {eta:.0f} s left" if eta is not None and self.entries < (self.total or 0) else ""
        unlistable = f", {self.unlistable:,} directories it cannot list" if self.unlistable else ""
        return (f"scanning the backing dir: {self.entries:,} entries ({self.files:,} files, "
                f"{_human(self.bytes)}) in {self.seconds:.0f} s, {self.rate:,.0f} entries/s{left}{unlistable}")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _entries_expected(root_fd: int, root_st: os.stat_result) -> int | None:
    """The backing filesystem's used inodes when the backing dir is its root (its parent is on another device
    or it is ``/``): then every entry of it is one the scan finds.  None otherwise, or when it does not say."""
    try:
        parent = os.stat("..", dir_fd=root_fd)
        if (parent.st_dev, parent.st_ino) != (root_st.st_dev, root_st.st_ino) and parent.st_dev == root_st.st_dev:
            return None  # a directory inside a bigger filesystem: its inode count says nothing of this tree
        v = os.fstatvfs(root_fd)
    except OSError:
        return None
    used = v.f_files - v.f_ffree
    return used if v.f_files and used > 0 else None


class _Column:
    """One of the scan's arrays as it grows, a batch's piece at a time (``dtype`` None: its names, as bytes): the
    pieces merged every SCAN_CHUNK bytes (a directory of one file costs no array object of its own), the whole
    made once, at the end."""

    def __init__(self, dtype: type[np.generic] | None) -> None:
        self.dtype = dtype
        self._chunks: list = []
        self._pending: list = []
        self._n_pending = 0

    def _join(self, pieces: list) -> np.ndarray | bytes:
        if self.dtype is None:
            return b"".join(pieces)
        return np.concatenate(pieces, dtype=self.dtype, casting="unsafe") if pieces else np.zeros(0, self.dtype)

    def add(self, piece: np.ndarray | bytes) -> None:
        self._pending.append(piece)
        self._n_pending += piece.nbytes if isinstance(piece, np.ndarray) else len(piece)
        if self._n_pending >= SCAN_CHUNK or len(self._pending) >= _PIECES_MERGED:
            self._merge()

    def _merge(self) -> None:
        if self._pending:
            self._chunks.append(self._join(self._pending))
            self._pending, self._n_pending = [], 0

    def _take(self) -> np.ndarray | bytes:
        self._merge()
        chunks, self._chunks = self._chunks, []
        return chunks[0] if len(chunks) == 1 else self._join(chunks)

    def take(self) -> np.ndarray:
        """The whole column of numbers; the column is empty after."""
        whole = self._take()
        assert isinstance(whole, np.ndarray), "a column of names: take_names"
        return whole

    def take_names(self) -> bytes:
        """The whole column of names (``dtype`` None), joined; the column is empty after."""
        whole = self._take()
        assert isinstance(whole, bytes), "a column of numbers: take"
        return whole


def _gather(blob: bytes, starts: np.ndarray, ends: np.ndarray) -> bytes:
    """``blob[starts[i]:ends[i]]`` for each ``i``, joined: a run of pieces that follow each other in ``blob`` as
    one slice (a directory's files are one run), a chunk of runs at a time."""
    n = len(starts)
    if not n:
        return b""
    brk = np.flatnonzero(starts[1:] != ends[:-1]) + 1
    lo, hi = starts[np.r_[0, brk]], ends[np.r_[brk, n] - 1]
    view = memoryview(blob)
    step = 1 << 16  # (runs a slice object each at a time)
    out = [b"".join(map(view.__getitem__, map(slice, lo[i:i + step].tolist(), hi[i:i + step].tolist())))
           for i in range(0, len(lo), step)]
    return out[0] if len(out) == 1 else b"".join(out)


def _errno_text(err: int) -> str:
    """``EACCES: Permission denied``."""
    return f"{errno.errorcode.get(err, f'errno {err}')}: {os.strerror(err)}"


class _Scan:
    """The arrays of a scan as it goes (nodes in scan order: breadth first, a directory's entries by name).

    Kept about as compact as the tree they become, since the scan, not the mount's steady state, sets the
    memory a node needs: a column per field, the names as one string with their lengths, the parents as runs (a
    batch's entries share one); no Python object per entry.  :meth:`tree` then makes the tree's arrays a column
    at a time, each scan-order column let go as its tree-order one is made.  (Names as objects and every column
    copied at once peaked at 480 bytes a file for 300,000 files, 143 MB: what a 120 MB cgroup killed.)"""

    def __init__(self, root_st: os.stat_result, mounted_below: frozenset[bytes],
                 root_path: str | None = None, *, quiet: bool = False) -> None:
        self.dev = root_st.st_dev
        self.say = log.debug if quiet else log.warning  # (how a directory it cannot list is said)
        self.mounted_below = mounted_below
        self.root_path = root_path
        self.meta: dict[tuple[int, int, int, int, int], int] = {_META(root_st): 0}
        self.run_parents = array.array("q", [0])  # each batch's parent (the root's: 0) ...
        self.run_lengths = array.array("q", [1])  # ... and its entries
        self.kinds = _Column(np.int8)
        self.meta_idx = _Column(np.int32)
        self.ino = _Column(np.uint64)
        self.stat_columns = tuple(_Column(np.int64) for _ in _COLUMN_FIELDS)  # size, blocks, mtime, ctime
        self.hashes = _Column(np.uint64)  # the files' path hashes only
        self.names = _Column(None)
        self.name_lens = _Column(np.uint16)  # (a name is at most 255 bytes: NAME_MAX)
        self.kinds.add(np.array([KIND_DIR], np.int8))
        self.meta_idx.add(np.zeros(1, np.int32))
        self.ino.add(np.array([root_st.st_ino], np.uint64))
        for column, value in zip(self.stat_columns, _COLUMNS(root_st), strict=True):
            column.add(np.array([clamp_ns(value)], np.int64))
        self.names.add(b"")
        self.name_lens.add(np.zeros(1, np.uint16))
        self.links: dict[int, bytes] = {}
        self.count = 1
        self.files = 0
        self.bytes = 0  # logical bytes of the files found so far (what the progress shows)
        self.levels = [1]  # node count at the end of each level
        self.unlistable = 0  # directories that could not be listed ...
        self.unlistable_dirs: list[tuple[bytes, int]] = []  # ... the first UNLISTABLE_SHOWN: (path, errno)
        self._last_unlistable: bytes | None = None

    def batch(self, job: tuple[int, int, bytes, bytes]) -> _Batch:
        """lstat each name of the batch (NUL-joined); a symlink's text; a subdirectory opened (on this device
        only, never through a symlink).  A worker thread.

        A million entries are scanned at mount time, so nothing here runs Python code per entry: the lstat calls
        are mapped over the names, their fields taken out by one ``attrgetter`` into arrays, the entries left
        out, the kinds and the table of distinct (mode, nlink, uid, gid, rdev) found with numpy."""
        node, fd, prefix, piece = job
        names = piece.split(b"\0")
        lstat = functools.partial(os.stat, dir_fd=fd, follow_symlinks=False)
        denied = 0
        try:
            sts = list(map(lstat, names))
        except OSError:  # (one is gone meanwhile, or we may not search the directory: the slow way)
            names, sts, denied = _each_lstat(lstat, names)
        k = len(sts)
        try:
            fields = np.fromiter(itertools.chain.from_iterable(map(_FIELDS, sts)), np.int64, k * _N_FIELDS)
        except OverflowError:  # (a timestamp an int64 of ns cannot hold: see clamp_ns; no other field reaches it)
            fields = np.fromiter(map(clamp_ns, itertools.chain.from_iterable(map(_FIELDS, sts))), np.int64,
                                 k * _N_FIELDS)
        fields = fields.reshape(k, _N_FIELDS)
        ino = np.fromiter(map(_INO, sts), np.uint64, k)
        del sts
        # never cross into another filesystem, nor into a bind mount; the control dir shadows
        keep = fields[:, _F_DEV] == self.dev
        if node == 0 or self.mounted_below:
            keep &= np.fromiter((not (node == 0 and name == b".tierfs") and prefix + name not in self.mounted_below
                                 for name in names), bool, k)
        if not keep.all():
            names = list(itertools.compress(names, keep.tolist()))
            fields, ino = fields[keep], ino[keep]
        rows = fields[:, _F_META]
        idx: np.ndarray  # (each entry's row of ``table``)
        if len(rows) and (rows == rows[0]).all():  # (a directory of like files: one row)
            table, idx = rows[:1], np.zeros(len(rows), np.int32)
        else:
            table, idx = np.unique(rows, axis=0, return_inverse=True)
        fmt = rows[:, 0] & _IFMT
        kinds = np.full(len(rows), KIND_SPECIAL, np.int8)
        for mode_fmt, kind in _FMT_KIND.items():
            kinds[fmt == mode_fmt] = kind
        is_file = kinds == KIND_FILE
        hashes = np.zeros(len(names), np.uint64)
        hashes[is_file] = path_hashes(map(prefix.__add__, itertools.compress(names, is_file.tolist())),
                                      int(is_file.sum()))
        out = _Batch(names, kinds, list(map(tuple, table.tolist())), idx.reshape(-1).astype(np.int32), ino,
                     np.ascontiguousarray(fields[:, _F_COLUMNS]), hashes, denied=denied)
        for j in np.flatnonzero(kinds == KIND_LINK).tolist():
            try:
                out.links[j] = os.readlink(names[j], dir_fd=fd)
            except OSError:
                out.links[j] = b""
        for j in np.flatnonzero(kinds == KIND_DIR).tolist():
            try:
                cfd = os.open(names[j], os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:  # (listed, empty; said unless it is gone meanwhile)
                if exc.errno not in _GONE:
                    out.unlistable[j] = exc.errno or errno.EIO
                continue
            if os.fstat(cfd).st_dev != self.dev:
                os.close(cfd)
                continue
            out.dirs[j] = cfd
        return out

    def add(self, parent: int, prefix: bytes, b: _Batch) -> list[tuple[int, int, bytes]]:
        """Take a batch's entries as the next nodes; the directories among them to list next."""
        if b.denied:
            self.cannot_list(prefix, b.denied)
        for j, err in b.unlistable.items():
            self.cannot_list(prefix + b.names[j] + b"/", err)
        base = self.count
        k = len(b.names)
        if not k:
            return []
        to_global = np.array([self.meta.setdefault(m, len(self.meta)) for m in b.meta], np.int32)
        self.run_parents.append(parent)
        self.run_lengths.append(k)
        self.kinds.add(b.kinds)
        self.meta_idx.add(to_global[b.meta_idx])
        self.ino.add(b.ino)
        for j, column in enumerate(self.stat_columns):
            column.add(b.columns[:, j])
        is_file = b.kinds == KIND_FILE
        self.hashes.add(b.hashes[is_file])
        self.names.add(b"".join(b.names))
        self.name_lens.add(np.fromiter(map(len, b.names), np.uint16, k))
        self.files += int(is_file.sum())
        self.bytes += int(b.columns[is_file, 0].sum())
        for j, text in b.links.items():
            self.links[base + j] = text
        self.count += k
        return [(base + j, fd, prefix + b.names[j] + b"/") for j, fd in b.dirs.items()]

    def shown(self, path: bytes) -> str:
        """A directory's path as a person reads it: under the backing dir's path when it is known."""
        full = os.path.join(os.fsencode(self.root_path), path).rstrip(b"/") if self.root_path else path or b"."
        return os.fsdecode(full).encode("utf-8", "backslashreplace").decode()

    def cannot_list(self, at: bytes, err: int) -> None:
        """The directory at ``at`` (its path and a slash; b"" for the root) could not be listed, or its entries
        not be seen (a directory we may read but not search): counted, and said while few (see Tree.scan)."""
        path = at.rstrip(b"/")
        if path == self._last_unlistable:
            return  # (a directory's next batch)
        self._last_unlistable = path
        self.unlistable += 1
        if len(self.unlistable_dirs) < UNLISTABLE_SHOWN:
            self.unlistable_dirs.append((path, err))
            self.say("cannot list %s (%s): the files under it are left out of the mount and its data set",
                        self.shown(path), _errno_text(err))

    def said_unlistable(self) -> None:
        """The scan's end: the directories it could not list, in one line, where there were more than it named."""
        if self.unlistable > len(self.unlistable_dirs):
            self.say("%d directories of the backing dir could not be listed (the first %d named above): the "
                        "files under them are left out of the mount and its data set (status: tree.unlistable)",
                        self.unlistable, len(self.unlistable_dirs))

    def refusal(self) -> str:
        """The one line that refuses a mount with ``unlistable=refuse``."""
        path, err = self.unlistable_dirs[0]
        more = f" (and {self.unlistable - 1} more)" if self.unlistable > 1 else ""
        return (f"cannot list {self.shown(path)} ({_errno_text(err)}){more}: unlistable=refuse refuses the mount "
                f"rather than leave its files out of the data set; let this daemon's user read and search it, or "
                f"mount with unlistable=skip")

    def nothing_seen(self) -> str:
        """The one line that refuses a mount whose scan saw no file, some directory unlistable."""
        path, err = self.unlistable_dirs[0]
        more = f" (and {self.unlistable - 1} more)" if self.unlistable > 1 else ""
        return (f"no file of the backing dir could be seen: cannot list {self.shown(path)} ({_errno_text(err)})"
                f"{more}")

    def tree(self) -> Tree:
        """Renumber (root, files in storage order, the rest in scan order) and make the tree."""
        n = self.count
        dt = index_dtype(n)
        parents = np.repeat(np.frombuffer(self.run_parents, np.int64).astype(dt),
                            np.frombuffer(self.run_lengths, np.int64))
        self.run_parents, self.run_lengths = array.array("q"), array.array("q")
        kinds = self.kinds.take()
        is_file = kinds == KIND_FILE
        # Storage order = a depth-first walk with names sorted: each node's rank in that walk, from subtree
        # sizes (bottom up, a level at a time) and the sizes of the siblings before it (top down).
        sub = np.ones(n, dt)
        bounds = list(zip([0, *self.levels[:-1]], self.levels, strict=True))
        for lo, hi in reversed(bounds[1:]):
            np.add.at(sub, parents[lo:hi], sub[lo:hi])
        rank = np.zeros(n, dt)
        for lo, hi in bounds[1:]:
            if hi == lo:
                continue
            p, s = parents[lo:hi], sub[lo:hi]
            before = np.cumsum(s, dtype=dt) - s
            group_start = np.r_[True, p[1:] != p[:-1]]
            before -= np.maximum.accumulate(np.where(group_start, before, 0))
            rank[lo:hi] = rank[p] + 1 + before
        del sub
        order = np.empty(n, dt)  # (the ranks are a permutation: the walk is their inverse, no sort needed)
        order[rank] = np.arange(n, dtype=dt)
        del rank
        files = order[is_file[order]]  # the files' scan indices, in storage order
        del order
        perm = np.concatenate([np.zeros(1, dt), files, np.flatnonzero(~is_file)[1:].astype(dt)])  # new -> scan
        new_of = np.empty(n, dt)
        new_of[perm] = np.arange(n, dtype=dt)
        hashes = self.hashes.take()[(np.cumsum(is_file, dtype=dt) - 1)[files]]  # (the files' only, scan order)
        del files, is_file
        parents = new_of[parents[perm]].astype(np.int32, copy=False)
        kinds = kinds[perm]
        # (each in the dtype the tree keeps it in, the wider one let go at once: see Tree's _narrow, index_dtype)
        meta_idx = self.meta_idx.take()[perm].astype(_row_dtype(len(self.meta)), copy=False)
        ino = _narrow(self.ino.take()[perm])
        size, blocks, mtime, ctime = (column.take()[perm] for column in self.stat_columns)
        blocks = _narrow(blocks)
        lens = self.name_lens.take()
        ends = np.cumsum(lens, dtype=np.int64)
        names = _gather(self.names.take_names(), (ends - lens)[perm], ends[perm])
        del ends
        name_ends = np.cumsum(lens[perm], dtype=index_dtype(len(names)))
        del lens, perm
        link_scan = np.array(sorted(self.links), np.int64)
        link_nodes = new_of[link_scan].astype(np.int64) if link_scan.size else np.zeros(0, np.int64)
        by_node = np.argsort(link_nodes, kind="stable")
        link_texts = [self.links[s] for s in link_scan[by_node].tolist()]
        self.links = {}
        meta = np.array(list(self.meta), np.int64).reshape(-1, 5)
        hash_order = np.argsort(hashes, kind="stable").astype(index_dtype(self.files), copy=False)
        hash_keys = hashes[hash_order]
        del hashes
        tree = Tree(parents=parents, kinds=kinds, names=names, name_ends=name_ends,
                    link_nodes=link_nodes[by_node], links=b"".join(link_texts), link_ends=_ends(link_texts),
                    meta=meta, meta_idx=meta_idx, ino=ino, size=size, blocks=blocks, mtime=mtime, ctime=ctime,
                    kids=new_of[1:].astype(np.int32, copy=False), n_files=self.files, dev=self.dev,
                    hash_keys=hash_keys, hash_order=hash_order)
        tree.unlistable, tree.unlistable_dirs = self.unlistable, tuple(self.unlistable_dirs)
        return tree

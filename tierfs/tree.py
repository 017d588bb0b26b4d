"""The backing tree: one scan at mount time, inode numbers, and safe opens beneath the backing root.

The scan walks directory file descriptors (``os.scandir(fd)``), so a directory swapped for a symlink while we
walk cannot lead us elsewhere; symlinks are recorded with their own text and never followed, entries on another
filesystem (mount points inside the backing dir) are left out, and anything that is not a directory, a regular
file or a symlink is skipped.  Files are numbered in *storage order* (depth-first, names sorted byte-wise): the
index the sampler's plans refer to.

Every later access to a backing file goes through :func:`tierfs.beneath.open_beneath` (no symlink followed,
no filesystem crossed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import numpy as np
import xxhash

from sampler.atomic import atomic_open

log = logging.getLogger("tierfs")

__all__ = [
    "CONTROL_INODES",
    "KIND_DIR",
    "KIND_FILE",
    "KIND_LINK",
    "Fingerprint",
    "Node",
    "Tree",
    "fingerprint",
    "path_hash",
]

KIND_DIR, KIND_FILE, KIND_LINK = 0, 1, 2

#: Inode numbers of ``/.tierfs`` and its files, far above any tree inode (tree inode = node index + 1).
CONTROL_BASE = 1 << 60
CONTROL_INODES = {
    b".tierfs": CONTROL_BASE,
    b"control": CONTROL_BASE + 1,
    b"status": CONTROL_BASE + 2,
    b"order": CONTROL_BASE + 3,
    b"metrics": CONTROL_BASE + 4,
    b"order0": CONTROL_BASE + 5,
    b"plan": CONTROL_BASE + 6,
}


Fingerprint = tuple[int, int, int, int]


def mountinfo() -> list[tuple[str, bytes, str]]:
    """(``major:minor``, mount point, filesystem type) of every mount this process sees (/proc/self/mountinfo,
    whose paths escape blanks and backslashes as octal: ``\\040``)."""
    out = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            where = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])
            out.append((fields[2].decode(), where, fields[fields.index(b"-") + 1].decode()))
    return out


#: stat fields saved with a tree, in os.stat_result's order from st_mode on (what load() rebuilds)
_STAT_FIELDS = ("st_mode", "st_ino", "st_dev", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns",
                "st_mtime_ns", "st_ctime_ns", "st_blksize", "st_blocks", "st_rdev")
SCAN_THREADS = 16  # lstat requests in flight while scanning: a network tier answers many at once
SCAN_BATCH = 256
SCAN_REPORT_S = 5.0  # a long scan's progress: in the log and to ``progress`` (systemd's STATUS) this often


def _names(fd: int) -> list[bytes]:
    """The names in a directory, sorted byte-wise (a worker thread)."""
    with os.scandir(fd) as it:
        return sorted(os.fsencode(e.name) for e in it)


def _batches(items: list[bytes], n: int) -> list[list[bytes]]:
    return [items[i:i + n] for i in range(0, len(items), n)]


def _stat_batch(fd: int, names: list[bytes], dev: int) -> list[tuple[os.stat_result | None, bytes | None, int | None]]:
    """lstat each name in directory ``fd``; a symlink's text; a subdirectory opened (on ``dev`` only, never
    through a symlink).  A worker thread."""
    out: list[tuple[os.stat_result | None, bytes | None, int | None]] = []
    for name in names:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            out.append((None, None, None))
            continue
        link = cfd = None
        if stat.S_ISLNK(st.st_mode):
            try:
                link = os.readlink(name, dir_fd=fd)
            except OSError:
                link = b""
        elif stat.S_ISDIR(st.st_mode) and st.st_dev == dev:
            try:
                cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                if os.fstat(cfd).st_dev != dev:
                    os.close(cfd)
                    cfd = None
            except OSError:
                cfd = None
        out.append((st, link, cfd))
    return out


def _kind(st: os.stat_result) -> int:
    if stat.S_ISDIR(st.st_mode):
        return KIND_DIR
    if stat.S_ISREG(st.st_mode):
        return KIND_FILE
    if stat.S_ISLNK(st.st_mode):
        return KIND_LINK
    return -1  # devices, fifos, sockets: not dataset files


def fingerprint(st: os.stat_result) -> Fingerprint:
    """What must not change for a cached copy to stay valid: (size, mtime_ns, inode, ctime_ns).

    ctime too: a rewrite that puts the old size and mtime back (``touch -r``, rsync) still moves ctime."""
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


class Node:
    """One entry of the backing tree, made from the tree's arrays the first time it is asked for (a remount of a
    big tree makes only the nodes its readers touch).  ``st`` is refreshed when a file is found changed."""

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
    """``Tree.nodes``: node ``i`` is made on first use (and kept)."""

    def __init__(self, tree: Tree, made: list[Node | None]) -> None:
        self._tree = tree
        self._made = made

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, i: int) -> Node:  # type: ignore[override]
        node = self._made[i]  # (IndexError past the end: what iteration stops on)
        if node is None:
            node = self._made[i] = self._tree._make(i if i >= 0 else i + len(self._made))
        return node


#: columns of the saved stats that a file's fingerprint is made of: (size, mtime_ns, ino, ctime_ns)
_FP_COLUMNS = [_STAT_FIELDS.index(f) for f in ("st_size", "st_mtime_ns", "st_ino", "st_ctime_ns")]
_SIZE, _BLOCKS = _STAT_FIELDS.index("st_size"), _STAT_FIELDS.index("st_blocks")
TREE_FORMAT = 2  # of the saved tree: 1 (tree.npz, no path hashes) is not read: the mount scans instead


def path_hash(relpath: bytes) -> int:
    """The hash of a file's path that names its copies in the cache (and finds them again at a remount)."""
    return xxhash.xxh3_64_intdigest(relpath)


def _read_array(f: BinaryIO) -> np.ndarray:
    """The next ``.npy`` record of ``f``; ``ValueError`` for anything else (a zip of arrays: an old tree)."""
    a = np.load(f, allow_pickle=False)
    if not isinstance(a, np.ndarray):
        raise ValueError("not a .npy record")
    return a


def _stat_row(row: list[int]) -> os.stat_result:
    return os.stat_result((*row[:7], row[7] // 10**9, row[8] // 10**9, row[9] // 10**9, row[7] / 1e9, row[8] / 1e9,
                           row[9] / 1e9, *row[7:]))


class Tree:
    """The scanned backing tree, kept as arrays: per node its parent, kind, name, link text and stat fields;
    per file (storage order) its node.  ``nodes[i]`` is the :class:`Node` of node ``i``, made when first used;
    node ``i`` is inode ``i + 1``.  Children of a directory are found through a parent index, so nothing here
    costs a Python object per node until that node is used."""

    def __init__(self, *, parents: np.ndarray, kinds: np.ndarray, names: bytes, name_ends: np.ndarray,
                 links: bytes, link_ends: np.ndarray, stats: np.ndarray, files: np.ndarray, dev: int,
                 path_hashes: np.ndarray, made: list[Node | None] | None = None) -> None:
        n = len(parents)
        self.parents = parents
        self.kinds = kinds
        self._names, self._name_ends = names, name_ends
        self._links, self._link_ends = links, link_ends
        self.stats = stats  # int64 [node, _STAT_FIELDS]; a file found changed gets its new row
        self.files = files  # node index per file index
        self.dev = dev
        self.path_hashes = path_hashes  # uint64 per file index
        self.sizes = stats[files, _SIZE] if n else np.zeros(0, np.int64)  # (kept in step with update_stat)
        self.blocks = stats[files, _BLOCKS] if n else np.zeros(0, np.int64)
        self.groups = parents[files]  # parent node per file: the stratified composition's groups
        self.fidx_of = np.full(n, -1, np.int64)
        self.fidx_of[files] = np.arange(len(files))
        self.dirs_with_data = np.zeros(n, bool)  # a directory holding a file somewhere beneath it
        up = np.unique(self.groups)
        while up.size:
            up = up[~self.dirs_with_data[up]]
            self.dirs_with_data[up] = True
            up = np.unique(parents[up[up != 0]])
        # children of node p: _by_parent[_first[p]:_first[p + 1]] (nodes below the root, grouped by parent)
        self._by_parent = np.argsort(parents[1:], kind="stable") + 1
        self._first = np.searchsorted(parents[self._by_parent], np.arange(n + 1))
        self._hash_order: np.ndarray | None = None
        self._hash_keys = np.zeros(0, np.uint64)
        self.nodes = _Nodes(self, made if made is not None else [None] * n)

    @property
    def n_files(self) -> int:
        return int(self.files.shape[0])

    def _name(self, i: int) -> bytes:
        return self._names[(int(self._name_ends[i - 1]) if i else 0):int(self._name_ends[i])]

    def _make(self, i: int) -> Node:
        parent = int(self.parents[i])
        name = self._name(i)
        path = b"" if i == 0 else (name if parent == 0 else self.nodes[parent].path + b"/" + name)
        node = Node(name, parent, int(self.kinds[i]), path, _stat_row(self.stats[i].tolist()))
        node.fidx = int(self.fidx_of[i])
        if node.kind == KIND_LINK:
            node.link = self._links[(int(self._link_ends[i - 1]) if i else 0):int(self._link_ends[i])]
        elif node.kind == KIND_DIR:
            kids = self._by_parent[self._first[i]:self._first[i + 1]].tolist()
            node.children = {self._name(k): k for k in kids}
        return node

    def node_of_inode(self, inode: int) -> Node | None:
        i = inode - 1
        if 0 <= i < len(self.nodes):
            return self.nodes[i]
        return None

    def kind_of(self, i: int) -> int:
        return int(self.kinds[i])

    def file_node(self, fidx: int) -> Node:
        return self.nodes[int(self.files[fidx])]

    def inode_of(self, fidx: int) -> int:
        """The FUSE inode of file ``fidx`` (a node's inode is its index + 1; 1 is the root)."""
        return int(self.files[fidx]) + 1

    def file_path(self, fidx: int) -> bytes:
        return self.nodes[int(self.files[fidx])].path

    def fingerprints(self, fidx: np.ndarray | None = None) -> np.ndarray:
        """(size, mtime_ns, ino, ctime_ns) per file index (of ``fidx``, or all), as the tree knows them now."""
        nodes = self.files if fidx is None else self.files[fidx]
        return self.stats[nodes[:, None], _FP_COLUMNS]

    def files_with_path_hash(self, h: int) -> list[int]:
        """The files whose path hashes to ``h`` (one, almost always)."""
        if self._hash_order is None:
            self._hash_order = np.argsort(self.path_hashes, kind="stable")
            self._hash_keys = self.path_hashes[self._hash_order]
        lo, hi = self._hash_keys.searchsorted(np.uint64(h)), self._hash_keys.searchsorted(np.uint64(h), "right")
        return self._hash_order[lo:hi].tolist()

    def files_of_path_hashes(self, hashes: np.ndarray) -> np.ndarray:
        """Per hash the one file whose path hashes to it; -1 where none does, or more than one."""
        if self._hash_order is None:
            self.files_with_path_hash(0)  # (builds the sorted keys)
        keys = self._hash_keys
        if not len(keys):
            return np.full(len(hashes), -1, np.int64)
        lo, hi = keys.searchsorted(hashes), keys.searchsorted(hashes, "right")
        return np.where(hi - lo == 1, self._hash_order[np.minimum(lo, len(keys) - 1)], -1)

    def fingerprint_of(self, fidx: int) -> Fingerprint:
        """:func:`fingerprint` of file ``fidx`` as the tree knows it, without making its node."""
        size, mtime, ino, ctime = self.stats[int(self.files[fidx]), _FP_COLUMNS].tolist()
        return (size, mtime, ino, ctime)

    def update_stat(self, fidx: int, st: os.stat_result) -> None:
        i = int(self.files[fidx])
        self.stats[i] = [getattr(st, f) for f in _STAT_FIELDS]
        self.file_node(fidx).st = st
        self.sizes[fidx] = st.st_size
        self.blocks[fidx] = st.st_blocks

    # ---------------------------------------------------------------------------------- the saved tree

    def save(self, path: str) -> None:
        """Write the tree's arrays to ``path`` atomically, one ``.npy`` record after another (read back at disk
        speed: a zip of them read at a third of it): a remount over the same cache answers from it at once and
        rescans in the background (see ``opening.TreeKeeper``)."""
        if self._hash_order is None:
            self.files_with_path_hash(0)  # (the sorted path hashes are saved too)
        arrays = [np.array([TREE_FORMAT, len(self.parents), len(self.files)], np.int64), self.parents, self.kinds,
                  np.frombuffer(self._names, np.uint8), self._name_ends, np.frombuffer(self._links, np.uint8),
                  self._link_ends, self.stats, self.files, self.path_hashes, self._hash_order]
        with atomic_open(path) as f:
            for a in arrays:
                np.save(f, a, allow_pickle=False)

    @classmethod
    def load(cls, path: str, root_st: os.stat_result) -> Tree | None:
        """The tree saved at ``path`` if it was saved for this backing root (same device and inode) in this
        format; else None (the mount scans)."""
        try:
            with open(path, "rb") as f:
                head = _read_array(f)
                if head.shape != (3,) or int(head[0]) != TREE_FORMAT:
                    return None
                (parents, kinds, names, name_ends, links, link_ends, stats, files, hashes,
                 order) = (_read_array(f) for _ in range(10))
            n, nf = int(head[1]), int(head[2])
            if not n or stats.shape != (n, len(_STAT_FIELDS)) or len(parents) != n or len(files) != nf \
                    or len(hashes) != nf or len(order) != nf:
                return None
            if (int(stats[0][2]), int(stats[0][1])) != (root_st.st_dev, root_st.st_ino):
                return None
            tree = cls(parents=parents, kinds=kinds, names=names.tobytes(), name_ends=name_ends,
                       links=links.tobytes(), link_ends=link_ends, stats=stats, files=files, dev=root_st.st_dev,
                       path_hashes=hashes)
            tree._hash_order, tree._hash_keys = order, hashes[order]
            return tree
        except (OSError, ValueError, EOFError, IndexError):
            return None

    def compare(self, new: Tree) -> tuple[list[tuple[int, os.stat_result]], list[int], int]:
        """What a newer scan of the same backing says about this tree's files: (changed files with their new
        stat, files gone, how many files it has that this tree lacks).  Matched by path hash, then by path."""
        order = np.argsort(new.path_hashes, kind="stable")
        keys = new.path_hashes[order]
        at = np.minimum(np.searchsorted(keys, self.path_hashes), max(0, len(keys) - 1))
        found = (keys[at] == self.path_hashes) if len(keys) else np.zeros(self.n_files, bool)
        match = np.where(found, order[at] if len(keys) else 0, -1)
        mine, theirs = self.fingerprints(), new.fingerprints()
        differs = found & (np.any(mine != theirs[np.maximum(match, 0)], axis=1) if len(keys) else False)
        changed, gone = [], np.flatnonzero(~found).tolist()
        for fidx in np.flatnonzero(differs).tolist():
            g = int(match[fidx])
            if new.file_path(g) == self.file_path(fidx):
                changed.append((fidx, new.file_node(g).st))
            else:  # (two paths with one 64-bit hash: compare the slow way)
                gone.append(fidx)
        return changed, sorted(gone), len(new.files) - int(found.sum())

    @classmethod
    def scan(cls, root_fd: int, root_path: str | None = None,
             progress: Callable[[int, float], None] = lambda entries, seconds: None) -> Tree:
        """Scan the tree below ``root_fd`` (see the module docstring).  ``root_path``: where it is mounted in
        this process's view, to leave out bind mounts from the same filesystem (same ``st_dev``).
        ``progress(entries, seconds)`` hears of it at the start, every SCAN_REPORT_S and at the end (the log
        too)."""
        root_st = os.fstat(root_fd)
        prefix = os.fsencode(os.path.realpath(root_path)).rstrip(b"/") + b"/" if root_path else None
        mounted_below: set[bytes] = set()
        if prefix is not None:
            with contextlib.suppress(OSError):
                mounted_below = {w[len(prefix):] for _, w, _ in mountinfo() if w.startswith(prefix)}
        nodes: list[Node] = [Node(b"", 0, KIND_DIR, b"", root_st)]
        file_nodes: list[int] = []
        dev = root_st.st_dev
        level: list[tuple[int, int]] = [(0, os.dup(root_fd))]  # (node index, fd) of the directories to list
        last_log = t0 = time.monotonic()
        progress(0, 0.0)
        with ThreadPoolExecutor(SCAN_THREADS, thread_name_prefix="tierfs-scan") as pool:
            try:
                while level:
                    # Breadth first, a level at a time: every directory's names at once, then every entry's
                    # lstat in batches, all in the pool (a network tier answers many requests at once, not one
                    # fast); results are taken in order, so node numbers do not depend on who answered first.
                    names = list(pool.map(_names, [fd for _, fd in level]))
                    jobs = [(fd, batch) for (_, fd), ns in zip(level, names, strict=True)
                            for batch in _batches(ns, SCAN_BATCH)]
                    chunks = pool.map(lambda job: _stat_batch(job[0], job[1], dev), jobs)
                    answers = iter([a for chunk in chunks for a in chunk])
                    nxt: list[tuple[int, int]] = []
                    for (idx, _fd), ns in zip(level, names, strict=True):
                        parent = nodes[idx]
                        for name in ns:
                            st, link, cfd = next(answers)
                            if st is None or (idx == 0 and name == b".tierfs"):
                                if cfd is not None:
                                    os.close(cfd)
                                continue  # gone meanwhile, or the mount's control dir (it shadows it)
                            path = name if idx == 0 else parent.path + b"/" + name
                            if st.st_dev != dev or path in mounted_below:
                                if cfd is not None:
                                    os.close(cfd)
                                continue  # never cross into another filesystem, nor into a bind mount
                            kind = _kind(st)
                            if kind < 0:
                                continue
                            node = Node(name, idx, kind, path, st)
                            child = len(nodes)
                            nodes.append(node)
                            assert parent.children is not None
                            parent.children[name] = child
                            if kind == KIND_FILE:
                                file_nodes.append(child)
                            elif kind == KIND_LINK:
                                node.link = link
                            elif cfd is not None:
                                nxt.append((child, cfd))
                    for _, fd in level:
                        os.close(fd)
                    level = nxt
                    if time.monotonic() - last_log > SCAN_REPORT_S:
                        last_log = time.monotonic()
                        log.info("tierfs: scanning the backing dir: %d entries in %.0f s", len(nodes), last_log - t0)
                        progress(len(nodes), last_log - t0)
            finally:
                for _, fd in level:
                    os.close(fd)
        # Depth-first order of *files* across directories: sort by path so storage order is the path order.
        file_nodes.sort(key=lambda i: nodes[i].path.split(b"/"))
        tree = cls._of_nodes(nodes, file_nodes, dev)
        progress(len(nodes), time.monotonic() - t0)
        return tree

    @classmethod
    def _of_nodes(cls, nodes: list[Node], file_nodes: list[int], dev: int) -> Tree:
        """The arrays of a scanned tree (its nodes are made again when used: a Python object per node of a big
        tree costs hundreds of bytes that most of them never need)."""
        names = [n.name for n in nodes]
        links = [n.link or b"" for n in nodes]
        for fidx, i in enumerate(file_nodes):
            nodes[i].fidx = fidx
        return cls(parents=np.fromiter((n.parent for n in nodes), np.int64, len(nodes)),
                   kinds=np.fromiter((n.kind for n in nodes), np.int8, len(nodes)),
                   names=b"".join(names), name_ends=np.cumsum([len(x) for x in names], dtype=np.int64),
                   links=b"".join(links), link_ends=np.cumsum([len(x) for x in links], dtype=np.int64),
                   stats=np.array([[getattr(n.st, f) for f in _STAT_FIELDS] for n in nodes], dtype=np.int64),
                   files=np.asarray(file_nodes, dtype=np.int64), dev=dev,
                   path_hashes=np.fromiter((path_hash(nodes[i].path) for i in file_nodes), np.uint64,
                                           len(file_nodes)))

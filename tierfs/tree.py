"""The backing tree: one scan at mount time, inode numbers, and safe opens beneath the backing root.

The scan walks directory file descriptors (``os.scandir(fd)``), so a directory swapped for a symlink while we
walk cannot lead us elsewhere; symlinks are recorded with their own text and never followed, entries on another
filesystem (mount points inside the backing dir) are left out, and anything that is not a directory, a regular
file or a symlink is skipped.  Files are numbered in *storage order* (depth-first, names sorted byte-wise): the
index the sampler's plans refer to.

Every later access to a backing file goes through :func:`open_beneath`: ``openat2`` with ``RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`` relative to a descriptor of the backing root held for the life of the
mount, or, where the kernel lacks ``openat2``, a component-by-component walk with ``O_NOFOLLOW`` that checks
the device of every step.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import re
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

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
    "open_beneath",
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
    """One entry of the backing tree.  ``st`` is refreshed when a file is found changed on open."""

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


@dataclass
class Tree:
    """The scanned backing tree.  ``files[i]`` is the node of file ``i`` (storage order)."""

    nodes: list[Node]
    files: np.ndarray  # node index per file index
    sizes: np.ndarray  # int64 size per file index (kept in step with node.st)
    groups: np.ndarray  # parent node index per file: the stratified composition's groups
    dev: int
    dirs_with_data: np.ndarray  # bool per node: a directory holding a file somewhere beneath it
    blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # st_blocks per file index

    @property
    def n_files(self) -> int:
        return int(self.files.shape[0])

    def node_of_inode(self, inode: int) -> Node | None:
        i = inode - 1
        if 0 <= i < len(self.nodes):
            return self.nodes[i]
        return None

    def file_node(self, fidx: int) -> Node:
        return self.nodes[int(self.files[fidx])]

    def inode_of(self, fidx: int) -> int:
        """The FUSE inode of file ``fidx`` (a node's inode is its index + 1; 1 is the root)."""
        return int(self.files[fidx]) + 1

    def file_path(self, fidx: int) -> bytes:
        return self.nodes[int(self.files[fidx])].path

    # ---------------------------------------------------------------------------------- the saved tree

    def save(self, path: str) -> None:
        """Write the tree (names, kinds, stats, link texts) to ``path`` atomically: a remount over the same cache
        answers from it at once and rescans in the background (see ``Engine.open``)."""
        names = [n.name for n in self.nodes]
        links = [n.link or b"" for n in self.nodes]
        stats = np.array([[getattr(n.st, f) for f in _STAT_FIELDS] for n in self.nodes], dtype=np.int64)
        with atomic_open(path) as f:
            np.savez(f, names=np.frombuffer(b"".join(names), np.uint8), name_ends=np.cumsum([len(x) for x in names]),
                     links=np.frombuffer(b"".join(links), np.uint8), link_ends=np.cumsum([len(x) for x in links]),
                     parents=np.array([n.parent for n in self.nodes], np.int64),
                     kinds=np.array([n.kind for n in self.nodes], np.int8), stats=stats,
                     files=self.files)

    @classmethod
    def load(cls, path: str, root_st: os.stat_result) -> Tree | None:
        """The tree saved at ``path`` if it was saved for this backing root (same device and inode); else None."""
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError, KeyError, EOFError):
            return None
        stats, parents, kinds = arrays["stats"], arrays["parents"], arrays["kinds"]
        if not len(stats) or (int(stats[0][2]), int(stats[0][1])) != (root_st.st_dev, root_st.st_ino):
            return None
        names, name_ends = arrays["names"].tobytes(), arrays["name_ends"].tolist()
        links, link_ends = arrays["links"].tobytes(), arrays["link_ends"].tolist()
        nodes: list[Node] = []
        for i, row in enumerate(stats.tolist()):
            name = names[(name_ends[i - 1] if i else 0):name_ends[i]]
            kind, parent = int(kinds[i]), int(parents[i])
            st = os.stat_result((*row[:7], row[7] // 10**9, row[8] // 10**9, row[9] // 10**9, row[7] / 1e9,
                                 row[8] / 1e9, row[9] / 1e9, *row[7:]))
            node = Node(name, parent, kind, b"" if i == 0 else (name if parent == 0 else nodes[parent].path + b"/" +
                                                                name), st)
            if kind == KIND_LINK:
                node.link = links[(link_ends[i - 1] if i else 0):link_ends[i]]
            if i:
                children = nodes[parent].children
                assert children is not None
                children[name] = i
            nodes.append(node)
        return cls._assemble(nodes, arrays["files"].tolist(), root_st.st_dev)

    def compare(self, new: Tree) -> tuple[list[tuple[int, os.stat_result]], list[int], int]:
        """What a newer scan of the same backing says about this tree's files: (changed files with their new
        stat, files gone, how many files it has that this tree lacks)."""
        new_files = {new.file_path(f): f for f in range(new.n_files)}
        changed, gone = [], []
        for fidx in range(self.n_files):
            g = new_files.pop(self.file_path(fidx), None)
            if g is None:
                gone.append(fidx)
            elif fingerprint(st := new.file_node(g).st) != fingerprint(self.file_node(fidx).st):
                changed.append((fidx, st))
        return changed, gone, len(new_files)

    def update_stat(self, fidx: int, st: os.stat_result) -> None:
        self.file_node(fidx).st = st
        self.sizes[fidx] = st.st_size
        self.blocks[fidx] = st.st_blocks

    @classmethod
    def scan(cls, root_fd: int, root_path: str | None = None) -> Tree:
        """Scan the tree below ``root_fd`` (see the module docstring).  ``root_path``: where it is mounted in
        this process's view, to leave out bind mounts from the same filesystem (same ``st_dev``)."""
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
                    if time.monotonic() - last_log > 5:
                        last_log = time.monotonic()
                        log.info("tierfs: scanning the backing dir: %d entries in %.0f s", len(nodes), last_log - t0)
            finally:
                for _, fd in level:
                    os.close(fd)
        # Depth-first order of *files* across directories: sort by path so storage order is the path order.
        file_nodes.sort(key=lambda i: nodes[i].path.split(b"/"))
        return cls._assemble(nodes, file_nodes, dev)

    @classmethod
    def _assemble(cls, nodes: list[Node], file_nodes: list[int], dev: int) -> Tree:
        for fidx, i in enumerate(file_nodes):
            nodes[i].fidx = fidx
        files = np.asarray(file_nodes, dtype=np.int64)
        sizes = np.fromiter((nodes[i].st.st_size for i in file_nodes), dtype=np.int64, count=len(file_nodes))
        groups = np.fromiter((nodes[i].parent for i in file_nodes), dtype=np.int64, count=len(file_nodes))
        has_data = np.zeros(len(nodes), dtype=bool)
        for i in file_nodes:
            p = nodes[i].parent
            while not has_data[p]:
                has_data[p] = True
                if p == 0:
                    break
                p = nodes[p].parent
        blocks = np.fromiter((nodes[i].st.st_blocks for i in file_nodes), dtype=np.int64, count=len(file_nodes))
        return cls(nodes=nodes, files=files, sizes=sizes, groups=groups, dev=dev, dirs_with_data=has_data,
                   blocks=blocks)


# ------------------------------------------------------------------------------------------ opens beneath root

_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every architecture that has it (asm-generic)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # pragma: no cover - no libc symbol table
    _libc = None
_have_openat2 = _libc is not None


def _openat2(root_fd: int, relpath: bytes) -> int:
    how = _OpenHow(os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0,
                   _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_XDEV | _RESOLVE_NO_MAGICLINKS)
    fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(root_fd), ctypes.c_char_p(relpath),
                  ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), os.fsdecode(relpath))
    return int(fd)


def _open_walk(root_fd: int, relpath: bytes, dev: int) -> int:
    parts = relpath.split(b"/")
    fd = root_fd
    try:
        for i, part in enumerate(parts):
            if part in (b"", b".", b".."):
                raise OSError(errno.EINVAL, "bad path component", os.fsdecode(relpath))
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (0 if last else os.O_DIRECTORY)
            nfd = os.open(part, flags, dir_fd=fd)
            if fd != root_fd:
                os.close(fd)
            fd = nfd
            if os.fstat(fd).st_dev != dev:
                raise OSError(errno.EXDEV, "crosses into another filesystem", os.fsdecode(relpath))
        return fd
    except BaseException:
        if fd != root_fd:
            os.close(fd)
        raise


def open_beneath(root_fd: int, relpath: bytes, dev: int) -> int:
    """Open ``relpath`` read-only beneath ``root_fd`` without following any symlink or crossing filesystems.

    A symlink anywhere on the way fails with ``ELOOP``, a mount point with ``EXDEV``.
    """
    global _have_openat2
    if _have_openat2:
        try:
            return _openat2(root_fd, relpath)
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM):
                raise
            _have_openat2 = False  # old kernel or a seccomp filter: walk instead
    return _open_walk(root_fd, relpath, dev)

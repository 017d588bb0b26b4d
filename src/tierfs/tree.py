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

import ctypes
import errno
import os
import stat
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CONTROL_INODES",
    "KIND_DIR",
    "KIND_FILE",
    "KIND_LINK",
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
}


def fingerprint(st: os.stat_result) -> tuple[int, int, int]:
    """What must not change for a cached copy to stay valid: (size, mtime_ns, inode)."""
    return (st.st_size, st.st_mtime_ns, st.st_ino)


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

    def file_path(self, fidx: int) -> bytes:
        return self.nodes[int(self.files[fidx])].path

    def update_stat(self, fidx: int, st: os.stat_result) -> None:
        self.file_node(fidx).st = st
        self.sizes[fidx] = st.st_size

    @classmethod
    def scan(cls, root_fd: int) -> Tree:
        """Scan the tree below ``root_fd`` (see the module docstring)."""
        root_st = os.fstat(root_fd)
        nodes: list[Node] = [Node(b"", 0, KIND_DIR, b"", root_st)]
        file_nodes: list[int] = []
        # (node index, fd) of directories still to list; depth-first in name order keeps storage order.
        stack: list[tuple[int, int]] = [(0, os.dup(root_fd))]
        try:
            while stack:
                idx, fd = stack.pop()
                try:
                    with os.scandir(fd) as it:
                        entries = sorted(it, key=lambda e: os.fsencode(e.name))
                    subdirs: list[tuple[int, bytes]] = []
                    for entry in entries:
                        name = os.fsencode(entry.name)
                        if idx == 0 and name == b".tierfs":
                            continue  # the mount's control dir shadows it: it could never be read
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if st.st_dev != root_st.st_dev:
                            continue  # never cross into another filesystem
                        parent = nodes[idx]
                        path = name if idx == 0 else parent.path + b"/" + name
                        if stat.S_ISDIR(st.st_mode):
                            kind = KIND_DIR
                        elif stat.S_ISREG(st.st_mode):
                            kind = KIND_FILE
                        elif stat.S_ISLNK(st.st_mode):
                            kind = KIND_LINK
                        else:
                            continue
                        node = Node(name, idx, kind, path, st)
                        child = len(nodes)
                        nodes.append(node)
                        assert parent.children is not None
                        parent.children[name] = child
                        if kind == KIND_FILE:
                            node.fidx = len(file_nodes)
                            file_nodes.append(child)
                        elif kind == KIND_LINK:
                            try:
                                node.link = os.fsencode(os.readlink(entry.name, dir_fd=fd))
                            except OSError:
                                node.link = b""
                        else:
                            subdirs.append((child, name))
                    # Push in reverse so the first name is listed next: depth-first, sorted.
                    opened: list[tuple[int, int]] = []
                    for child, name in subdirs:
                        try:
                            cfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                        except OSError:
                            continue
                        if os.fstat(cfd).st_dev != root_st.st_dev:
                            os.close(cfd)
                            continue
                        opened.append((child, cfd))
                    stack.extend(reversed(opened))
                finally:
                    os.close(fd)
        finally:
            for _, fd in stack:
                os.close(fd)
        # Depth-first order of *files* across directories: sort by path so storage order is the path order.
        file_nodes.sort(key=lambda i: nodes[i].path.split(b"/"))
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
        return cls(nodes=nodes, files=files, sizes=sizes, groups=groups, dev=root_st.st_dev, dirs_with_data=has_data)


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

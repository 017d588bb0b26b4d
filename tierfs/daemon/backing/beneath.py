"""Opens beneath the backing root: never through a symlink, never into another filesystem.

Every access to a backing file after the scan goes through :func:`open_beneath`: ``openat2`` with
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`` relative to a descriptor of the backing root held
for the life of the mount, or, where the kernel lacks ``openat2`` (or a seccomp filter refuses it), a
component-by-component walk with ``O_NOFOLLOW`` that checks the device of every step.

Dataset files are opened by :func:`open_regular`: with ``O_NONBLOCK | O_NOCTTY``, so that whatever has taken a
file's name in the backing dir since the scan (a FIFO, which blocks an open until a writer comes; a device) is
opened without waiting and refused by its type, never read.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat

__all__ = ["open_beneath", "open_regular"]

_RESOLVE_NO_XDEV = 0x01
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_SYS_OPENAT2 = 437  # the same number on every architecture that has it (asm-generic)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _syscall = _libc.syscall
    _syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # pragma: no cover - no libc symbol table
    _libc = None
_have_openat2 = _libc is not None


_NOT_REGULAR = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symlink"}


def _openat2(root_fd: int, relpath: bytes, flags: int) -> int:
    how = _OpenHow(os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | flags, 0,
                   _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_XDEV | _RESOLVE_NO_MAGICLINKS)
    fd = _syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(root_fd), ctypes.c_char_p(relpath),
                  ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), os.fsdecode(relpath))
    return int(fd)


def _open_walk(root_fd: int, relpath: bytes, dev: int, flags: int) -> int:
    parts = relpath.split(b"/")
    fd = root_fd
    try:
        for i, part in enumerate(parts):
            if part in (b"", b".", b".."):
                raise OSError(errno.EINVAL, "bad path component", os.fsdecode(relpath))
            last = i == len(parts) - 1
            how = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (flags if last else os.O_DIRECTORY)
            nfd = os.open(part, how, dir_fd=fd)
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


def open_beneath(root_fd: int, relpath: bytes, dev: int, flags: int = 0) -> int:
    """Open ``relpath`` read-only beneath ``root_fd`` without following any symlink or crossing filesystems;
    ``flags`` are added to the last component's open.

    A symlink anywhere on the way fails with ``ELOOP``, a mount point with ``EXDEV``.
    """
    global _have_openat2
    if _have_openat2:
        try:
            return _openat2(root_fd, relpath, flags)
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EPERM):
                raise
            _have_openat2 = False  # old kernel or a seccomp filter: walk instead
    return _open_walk(root_fd, relpath, dev, flags)


def open_regular(root_fd: int, relpath: bytes, dev: int) -> tuple[int, os.stat_result]:
    """Open the regular file ``relpath`` as :func:`open_beneath` does, without ever blocking on what is not one;
    returns the descriptor and its ``fstat``.

    Anything else at that name fails with ``ENOENT`` (the dataset file is gone), its type in the message.
    ``O_NONBLOCK`` is cleared again on the regular file: a hierarchical storage manager's filesystem answers a
    non-blocking read of a file on tape with ``EAGAIN`` instead of fetching it.
    """
    fd = open_beneath(root_fd, relpath, dev, os.O_NONBLOCK | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            what = _NOT_REGULAR.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise OSError(errno.ENOENT, f"{what}, no longer a regular file", os.fsdecode(relpath))
        fcntl.fcntl(fd, fcntl.F_SETFL, 0)  # (of the flags F_SETFL changes, only O_NONBLOCK was set)
        return fd, st
    except BaseException:
        os.close(fd)
        raise

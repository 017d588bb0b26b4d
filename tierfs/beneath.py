"""Opens beneath the backing root: never through a symlink, never into another filesystem.

Every access to a backing file after the scan goes through :func:`open_beneath`: ``openat2`` with
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`` relative to a descriptor of the backing root held
for the life of the mount, or, where the kernel lacks ``openat2`` (or a seccomp filter refuses it), a
component-by-component walk with ``O_NOFOLLOW`` that checks the device of every step.
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["open_beneath"]

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

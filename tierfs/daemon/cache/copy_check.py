"""A copy on the cache disk, checked: is it still the file that was committed
(:func:`tierfs.common.protocol.copy_matches`, the check a loader makes too), and what are its bytes' hash.

The cache dir is not trusted (see store.py): cleaners and admins can delete, truncate or replace copies.  These
functions only touch the disk (a local ``open`` + ``fstat``, an ``lstat``, a read) and are called inline or
from cache threads; a copy that fails is dropped by :meth:`~tierfs.daemon.cache.store.CacheStore.repair`.
"""

from __future__ import annotations

import errno
import os
import stat

import xxhash

from tierfs.common.protocol import COPY_OPEN_FLAGS, copy_matches

__all__ = ["CopyDamaged", "hash_copy", "open_copy"]


class CopyDamaged(Exception):
    """A cached copy is missing, not a regular file, or not the file that was committed."""


def open_copy(data_fd: int, entry_name_: str, size: int, copy_id: tuple[int, int]) -> int:
    """Open a copy and check it is the one committed (worker thread); :class:`CopyDamaged` if not."""
    try:
        fd = os.open(entry_name_, COPY_OPEN_FLAGS, dir_fd=data_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
            raise CopyDamaged(f"copy {entry_name_} is gone") from None
        raise
    try:
        if not copy_matches(os.fstat(fd), size, copy_id):
            raise CopyDamaged(f"copy {entry_name_} was changed in the cache dir")
        return fd
    except BaseException:
        os.close(fd)
        raise


def hash_copy(data_fd: int, name: str) -> int:
    """xxh3 of a copy's bytes (worker thread)."""
    fd = os.open(name, COPY_OPEN_FLAGS, dir_fd=data_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"copy {name} is not a regular file")
        h = xxhash.xxh3_64()
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
        return h.intdigest()
    finally:
        os.close(fd)

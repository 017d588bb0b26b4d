"""The one atomic-write helper: a reader sees the old file or the new one, never a part.

Used for the cache's journal, index and saved tree (tierfs) and for checkpoints (dslide).  It lives in
``sampler``, the package both depend on, so dslide writes its checkpoints without importing the FUSE package.
The data goes to a temp name in the same directory, is fsynced, renamed over the target with ``os.replace``,
and the directory is fsynced so the rename itself survives a crash.

The directory is opened once and every step goes through that descriptor (``openat``, ``renameat``, ``fsync``
of the directory).  Given ``dir_fd`` -- a directory the caller opened once and checked, as tierfs opens its
cache dir -- ``path`` is a plain name in it, and nothing is reached by a path at all: a directory swapped for a
symlink after it was opened is never written through (issue 46, 11).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import BinaryIO

__all__ = ["TEMP_PREFIX", "atomic_open", "atomic_write", "fsync_dir"]

#: Temp files start with this, so a restart can find and remove the ones a crash left behind.
TEMP_PREFIX = ".tmp-"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: int = 0o600, *, dir_fd: int | None = None
                ) -> Iterator[BinaryIO]:
    """Open a temp file beside ``path`` for binary writing; on a clean exit it replaces ``path``.  With
    ``dir_fd``, ``path`` is a name in that directory (no ``/``)."""
    path = os.fspath(path)
    if dir_fd is None:
        directory, name = os.path.split(os.path.abspath(path))
        with _opened_dir(directory) as fd, _replacing(fd, name, mode) as f:
            yield f
        return
    if not path or "/" in path or path in (".", ".."):
        raise ValueError(f"with dir_fd, path must be a name in that directory, got {path!r}")
    with _replacing(dir_fd, path, mode) as f:
        yield f


def atomic_write(path: str | os.PathLike[str], data: bytes, mode: int = 0o600, *, dir_fd: int | None = None) -> None:
    """Write ``data`` to ``path`` atomically (see the module docstring); with ``dir_fd``, ``path`` is a name in
    that directory."""
    with atomic_open(path, mode, dir_fd=dir_fd) as f:
        f.write(data)


@contextlib.contextmanager
def _opened_dir(directory: str) -> Iterator[int]:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replacing(dir_fd: int, name: str, mode: int) -> Iterator[BinaryIO]:
    """The temp file of ``name`` in ``dir_fd``; on a clean exit renamed over ``name``, and the rename fsynced."""
    tmp = f"{TEMP_PREFIX}{name}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=dir_fd)  # (a crash's: made afresh, so no link someone put there is written through)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)

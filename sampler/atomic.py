"""The one atomic-write helper: a reader sees the old file or the new one, never a part.

Used for the cache's journal and saved tree (tierfs) and for checkpoints (dslide).  It lives in ``sampler``,
the package both depend on, so dslide writes its checkpoints without importing the FUSE package.  The data
goes to a temp name in the same directory, is fsynced, renamed over the target with ``os.replace``, and the
directory is fsynced so the rename itself survives a crash.
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
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: int = 0o600) -> Iterator[BinaryIO]:
    """Open a temp file beside ``path`` for binary writing; on a clean exit it replaces ``path``."""
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f"{TEMP_PREFIX}{name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


def atomic_write(path: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` atomically (see the module docstring)."""
    with atomic_open(path, mode) as f:
        f.write(data)

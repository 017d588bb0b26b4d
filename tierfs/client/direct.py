"""Open a dataset file's cached copy directly, skipping the FUSE data path.

Through the mount every read of a file is a round trip through the daemon (or a copy out of the mount's page
cache); the fast tier itself is faster.  A loader that runs as the daemon's user (or root) can ask the mount
for the path of a file's cached copy and open that instead::

    from tierfs.direct import open_cached

    with open_cached("/mnt/imagenet/train/n01440764/x.JPEG") as f:   # any path, on a tierfs mount or not
        data = f.read()

``open_cached`` asks with one ``getxattr(path, "user.tierfs.cache_path")``, which the daemon answers only for
a file it can vouch for: cached, complete, and still matching its backing file (the same check an ``open``
makes).  The answer counts as an open served from the cache (``reads.hits`` and ``reads.direct`` in
``status``; passes and ``rf`` move as with any open).  Anything else — not cached yet, not a tierfs mount,
another user, a copy evicted between the answer and the open — falls back to a plain ``open(path)``, so the
bytes are always the ones the mount serves.

A cached copy never changes once written (it lands by an atomic rename under a name carrying its backing
file's fingerprint) and the daemon keeps it for a moment after answering, so the open finds it; a copy
evicted while a reader still holds it open keeps its disk blocks until that reader closes it, as with any
deleted open file, which is the one way a direct reader can hold the cache dir above its cap (by the files it
has open at a mini-epoch switch).
"""

from __future__ import annotations

import errno
import os
from typing import IO, Any

from tierfs.common.protocol import CACHE_PATH_XATTR

__all__ = ["CACHE_PATH_XATTR", "cached_path", "open_cached"]

# No such attribute (not cached, another user), no xattrs at all here (not tierfs), gone.
_FALLBACK = {errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOENT, errno.EACCES, errno.EPERM}


def cached_path(path: str | os.PathLike[str]) -> str | None:
    """The path of ``path``'s cached copy if its tierfs mount lends it now; None otherwise."""
    try:
        return os.fsdecode(os.getxattr(path, CACHE_PATH_XATTR))
    except OSError as exc:
        if exc.errno in _FALLBACK:
            return None
        raise


def open_cached(path: str | os.PathLike[str], mode: str = "rb", **kwargs: Any) -> IO[Any]:
    """``open(path, mode)``, reading the file's cached copy directly when its tierfs mount lends it.

    Read-only modes only (``"rb"``, ``"r"``); ``kwargs`` go to :func:`open`.
    """
    if any(c in mode for c in "wax+"):
        raise ValueError(f"open_cached reads only; mode {mode!r} writes")
    copy = cached_path(path)
    if copy is not None:
        try:
            return open(copy, mode, **kwargs)
        except (FileNotFoundError, PermissionError):
            pass  # evicted after the answer, or not ours to open: read through the mount
    return open(path, mode, **kwargs)

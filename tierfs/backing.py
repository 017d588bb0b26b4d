"""The backing dir, seen from the trio thread: every call in a worker thread, bounded, timed and watched.

The backing dir is the slow tier -- often a network filesystem whose server can stop answering for minutes
(``hard`` NFS mounts block in the kernel, unkillably).  So nothing that answers the kernel may wait on it: every
backing call (stat, open, read, statvfs) runs in a worker thread drawn from this object's own
:class:`trio.CapacityLimiter`, separate from the threads that touch the cache disk, and a call that does not come
back within its timeout is abandoned (its thread keeps its limiter token until the kernel lets it go, so a stall
can never pile up more than ``threads`` stuck threads).

This object owns the answer to "is the backing answering?": a request outstanding for longer than
:data:`STALL_AFTER` seconds marks the backing as stalled, since the oldest such request, until one comes back.
``status`` reads that from :meth:`statistics` without touching the backing.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import trio

from tierfs.beneath import open_beneath

__all__ = ["STALL_AFTER", "Backing", "BackingError", "BackingStatistics", "backing_error"]

T = TypeVar("T")

#: A backing request outstanding this long (seconds) without progress means the backing is stalled.
STALL_AFTER = 1.0

#: errnos that mean "this path is gone" (when the backing root itself still answers).
_VANISHED = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV)


class BackingError(OSError):
    """A dataset file cannot be served; ``errno`` is what the reader gets (ENOENT, EIO, EMFILE, ...)."""


def backing_error(exc: OSError, root_alive: bool) -> BackingError:
    """The reader's error for a failed backing call: ENOENT for a path that is gone from a live backing root,
    the descriptor errors as they are (that caller only), EIO for everything else (an unreachable backing)."""
    if exc.errno in _VANISHED and root_alive:
        return BackingError(errno.ENOENT, "vanished from the backing dir")
    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
        return BackingError(exc.errno, os.strerror(exc.errno))
    return BackingError(errno.EIO, f"backing dir unreachable: {exc.strerror or exc}")


STATFS_TIMEOUT = 1.0  # statfs answers from the last good figures when the backing takes longer


@dataclass(frozen=True)
class BackingStatistics:
    """What ``status`` shows under ``backing``."""

    state: str  # "ok" or "stalled"
    stalled_since: float | None  # wall-clock time of the oldest outstanding request, when stalled
    waiting: int  # requests outstanding now
    threads: int  # the limiter's size
    requests: int  # requests made since mount
    timeouts: int  # requests abandoned after their timeout


class Backing:
    """Worker-thread access to the backing dir (see the module docstring).  ``root_fd`` stays owned by the
    caller; ``dev`` is the backing root's device (opens never cross into another filesystem)."""

    def __init__(self, root_fd: int, dev: int, *, threads: int = 32,
                 bandwidth: Callable[[], int] = lambda: 0) -> None:
        self.root_fd = root_fd
        self.dev = dev
        self._statvfs: os.statvfs_result | None = None  # the last good answer (statfs never waits on a stall)
        self._bandwidth = bandwidth  # the ``bandwidth`` cap in force (bytes/s, 0: none)
        self._bw_next = 0.0
        self.limiter = trio.CapacityLimiter(threads)
        self._outstanding: dict[int, float] = {}  # request id -> monotonic start (or last progress)
        self._local = threading.local()
        self._ids = itertools.count()
        self._requests = 0
        self._timeouts = 0

    async def call(self, fn: Callable[..., T], *args: object, timeout: float | None) -> T:
        """Run ``fn(*args)`` in a backing thread; ``timeout`` seconds (None: wait as long as it takes).

        Raises :class:`BackingError` (EIO) when the timeout passes; the thread is abandoned, not killed.
        """
        rid = next(self._ids)
        self._outstanding[rid] = time.monotonic()
        self._requests += 1
        try:
            if timeout is None:
                return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter, abandon_on_cancel=True)
            with trio.move_on_after(timeout):
                return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter, abandon_on_cancel=True)
            self._timeouts += 1
            raise BackingError(errno.EIO, f"backing dir not answering within {timeout:g} s")
        finally:
            del self._outstanding[rid]

    def run_in_thread(self, fn: Callable[..., T]) -> Callable[..., T]:
        """``fn`` for a thread that the caller already runs under :attr:`limiter` (the stager's copies):
        counted as outstanding while it runs, so a copy stuck on the backing shows as a stall."""

        @functools.wraps(fn)
        def tracked(*args: object, **kwargs: object) -> T:
            rid = next(self._ids)
            self._outstanding[rid] = time.monotonic()  # dict ops are atomic under the GIL
            self._requests += 1
            self._local.rid = rid
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.rid = None
                self._outstanding.pop(rid, None)

        return tracked

    def progress(self) -> None:
        """Called from a thread run by :meth:`run_in_thread` whenever a backing call came back (a copy's
        read): a long copy that moves is not a stall, one call that hangs is."""
        rid = getattr(self._local, "rid", None)
        if rid is not None and rid in self._outstanding:
            self._outstanding[rid] = time.monotonic()

    # -------------------------------------------------------------------------------------------- calls

    async def stat(self, relpath: bytes, *, timeout: float | None) -> os.stat_result:
        return await self.call(_lstat_at, self.root_fd, relpath, timeout=timeout)

    async def stat_many(self, relpaths: Sequence[bytes], *, timeout: float | None) -> list[os.stat_result | OSError]:
        """lstat every path in one thread hop (a batch of the revalidator); per path a stat or its error."""
        return await self.call(_lstat_many, self.root_fd, list(relpaths), timeout=timeout)

    async def open(self, relpath: bytes, *, timeout: float | None) -> tuple[int, os.stat_result]:
        """Open a dataset file beneath the root (no symlink followed, no mount crossed) and fstat it."""
        return await self.call(_open_regular, self.root_fd, relpath, self.dev, timeout=timeout)

    async def pread(self, fd: int, size: int, offset: int, *, timeout: float | None) -> bytes:
        return await self.call(os.pread, fd, size, offset, timeout=timeout)

    async def statvfs(self, *, timeout: float | None = STATFS_TIMEOUT) -> os.statvfs_result | None:
        """The backing filesystem's figures; the last good ones when it does not answer within ``timeout``
        (None before any answer)."""
        with contextlib.suppress(OSError):
            self._statvfs = await self.call(os.fstatvfs, self.root_fd, timeout=timeout)
        return self._statvfs

    async def parent_alive(self, relpath: bytes, *, timeout: float | None) -> bool:
        """Whether the backing root and the directory holding ``relpath`` are still there: a file gone from a
        live directory is ENOENT; a directory (or the root) gone or unreachable is EIO."""
        try:
            return await self.call(_alive, self.root_fd, os.path.dirname(relpath), timeout=timeout)
        except OSError:
            return False

    async def error_for(self, exc: OSError, relpath: bytes, *, timeout: float | None) -> BackingError:
        """The reader's error for ``exc`` on ``relpath`` (see :func:`backing_error`)."""
        if isinstance(exc, BackingError):
            return exc
        alive = exc.errno in _VANISHED and await self.parent_alive(relpath, timeout=timeout)
        return backing_error(exc, alive)

    async def throttle(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more backing reads fit under the ``bandwidth`` cap (one token bucket for
        readers and staging alike)."""
        bw = self._bandwidth()
        if bw <= 0:
            return
        now = trio.current_time()
        start = max(now, self._bw_next)
        self._bw_next = start + nbytes / bw
        if start > now:
            await trio.sleep(start - now)

    def throttle_from_thread(self, nbytes: int) -> None:
        """:meth:`throttle` from a staging thread."""
        if self._bandwidth() > 0:
            trio.from_thread.run(self.throttle, nbytes)

    # ------------------------------------------------------------------------------------------ watching

    def stalled_since(self, now: float | None = None) -> float | None:
        """Monotonic start of the oldest request outstanding for over STALL_AFTER s; None when answering."""
        if not self._outstanding:
            return None
        now = time.monotonic() if now is None else now
        oldest = min(self._outstanding.values(), default=now)
        return oldest if now - oldest > STALL_AFTER else None

    def statistics(self) -> BackingStatistics:
        now = time.monotonic()
        since = self.stalled_since(now)
        return BackingStatistics(
            state="ok" if since is None else "stalled",
            stalled_since=None if since is None else time.time() - (now - since),
            waiting=len(self._outstanding),
            threads=int(self.limiter.total_tokens),
            requests=self._requests,
            timeouts=self._timeouts,
        )


def _lstat_at(root_fd: int, relpath: bytes) -> os.stat_result:
    return os.stat(relpath or b".", dir_fd=root_fd, follow_symlinks=False)


def _lstat_many(root_fd: int, relpaths: list[bytes]) -> list[os.stat_result | OSError]:
    out: list[os.stat_result | OSError] = []
    for p in relpaths:
        try:
            out.append(os.stat(p, dir_fd=root_fd, follow_symlinks=False))
        except OSError as exc:
            out.append(exc)
    return out


def _alive(root_fd: int, parent: bytes) -> bool:
    if os.fstat(root_fd).st_nlink == 0:
        return False
    return not parent or stat.S_ISDIR(os.stat(parent, dir_fd=root_fd, follow_symlinks=False).st_mode)


def _open_regular(root_fd: int, relpath: bytes, dev: int) -> tuple[int, os.stat_result]:
    fd = open_beneath(root_fd, relpath, dev)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.ENOENT, "no longer a regular file", os.fsdecode(relpath))
        return fd, st
    except BaseException:
        os.close(fd)
        raise

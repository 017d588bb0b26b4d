"""The backing dir, seen from the trio thread: every call in a worker thread, bounded, timed and watched.

The backing dir is the slow tier -- often a network filesystem whose server can stop answering for minutes
(``hard`` NFS mounts block in the kernel, unkillably), or a FUSE filesystem whose daemon can die.  So nothing
that answers the kernel may wait on it: every backing call (stat, open, read, statvfs) runs in a worker thread
drawn from this object's own :class:`trio.CapacityLimiter`, separate from the threads that touch the cache
disk, and a call that does not come back within its timeout is abandoned (its thread keeps its limiter token
until the kernel lets it go, so a stall can never pile up more than ``threads`` stuck threads).

**One file cannot take the threads.**  At most :data:`PER_FILE` calls on one file run in threads at once
(abandoned ones included, until the kernel lets them go); a further call on that file waits for one of them
without a thread, and fails with ``EIO`` at once when the oldest has been stuck for over :data:`STALL_AFTER`
seconds.  So a file whose calls hang holds at most ``PER_FILE`` threads, and the other files are served.

This object owns the answer to "is the backing answering?" -- ``state`` in ``status``:

* ``ok``;
* ``stalled``: a request outstanding for longer than :data:`STALL_AFTER` seconds, since the oldest such
  request, until one comes back (a server that stopped answering: calls time out after ``backing_timeout``);
* ``lost``: the backing filesystem itself is gone -- a call failed with ``ENOTCONN``/``ECONNABORTED`` (a FUSE
  backing whose daemon died or whose connection was aborted), or with ``EIO``/``ESTALE`` while the root does
  not answer ``statfs`` either.  Every call then fails with ``EIO`` at once, without a thread or a request
  (cached copies are still served: only an answer "changed" or "gone" drops one), and :meth:`run` re-opens the
  backing dir by its path, first after :data:`PROBE_FIRST` seconds, then backing off to every
  :data:`PROBE_MAX` seconds.  It takes the directory back only if it holds the same dataset (most of a sample of
  the tree's files are there with their size and mtime: an empty mountpoint left by a lazy unmount is not the
  dataset), puts it behind the root descriptor's number (``dup2``: whoever holds the number reaches the new
  root) and is ``ok`` again; the revalidator then asks every fingerprint again.

``status`` reads all this from :meth:`statistics` without touching the backing.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import math
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import trio

from tierfs.common.options import LiveSettings
from tierfs.daemon.backing.beneath import open_regular
from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.tree.tree import Tree

__all__ = ["PER_FILE", "PROBE_MAX", "STALL_AFTER", "Backing", "BackingError", "BackingLost", "BackingStatistics",
           "answered_gone", "backing_error"]

T = TypeVar("T")

log = logging.getLogger("tierfs")

#: A backing request outstanding this long (seconds) without progress means the backing is stalled.
STALL_AFTER = 1.0
#: Backing calls on one file that may run in threads at once (so one stuck file holds at most this many).
PER_FILE = 4
#: Seconds before the first attempt to re-open a lost backing, and the most between two attempts (doubling).
PROBE_FIRST = 0.1
PROBE_MAX = 4.0
PROBE_TIMEOUT = 5.0  # an attempt that takes longer is abandoned (and no other starts while its thread runs)
SAMPLE = 8  # files of the tree a re-opened root must hold (most of them, same size and mtime) to be taken back

#: errnos that mean "this path is gone" (when the backing root itself still answers).
_VANISHED = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV)
#: errnos that mean the backing filesystem itself is gone (a FUSE daemon that died, its connection aborted).
_GONE = (errno.ENOTCONN, errno.ECONNABORTED, errno.ENODEV, errno.EHOSTDOWN, errno.ESHUTDOWN)
#: errnos that mean it when the root does not answer ``statfs`` either (else: that file's own trouble).
_GONE_IF_ROOT_SILENT = (errno.EIO, errno.ESTALE)


class BackingError(OSError):
    """A dataset file cannot be served; ``errno`` is what the reader gets (ENOENT, EIO, EMFILE, ...)."""


class BackingLost(BackingError):
    """The backing filesystem itself is gone (``EIO`` for the reader); see the module docstring."""


def backing_error(exc: OSError, root_alive: bool) -> BackingError:
    """The reader's error for a failed backing call: ENOENT for a path that is gone from a live backing root,
    the descriptor errors as they are (that caller only), EIO for everything else (an unreachable backing)."""
    if exc.errno in _VANISHED and root_alive:
        return BackingError(errno.ENOENT, "vanished from the backing dir")
    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
        return BackingError(exc.errno, os.strerror(exc.errno))
    return BackingError(errno.EIO, f"backing dir unreachable: {exc.strerror or exc}")


def answered_gone(exc: OSError) -> bool:
    """Whether ``exc`` is the backing's answer that a path is not there (not a failure to answer)."""
    return not isinstance(exc, BackingError) and exc.errno in _VANISHED


STATFS_TIMEOUT = 1.0  # statfs answers from the last good figures when the backing takes longer


@dataclass(frozen=True)
class BackingStatistics:
    """What ``status`` shows under ``backing``."""

    state: str  # "ok", "stalled" or "lost"
    stalled_since: float | None  # wall-clock time of the oldest outstanding request, when stalled
    lost_since: float | None  # wall-clock time the backing was found gone, when lost
    reason: str | None  # why it is lost ("Transport endpoint is not connected")
    waiting: int  # requests outstanding now
    threads: int  # the limiter's size
    requests: int  # requests made since mount
    timeouts: int  # requests abandoned after their timeout
    refused: int  # calls failed at once, without a request: the backing lost, or a file whose calls are stuck
    probes: int  # attempts to re-open a lost backing
    recoveries: int  # times a lost backing was taken back
    bytes_read: int = 0  # every byte read from backing files: readers, staging, copies that failed or were abandoned


@dataclass(eq=False)
class _Ticket:
    """One call on a file, counted against :data:`PER_FILE` until it has really ended (``_files_lock``)."""

    file: bytes
    rid: int
    running: bool = False  # its thread started
    abandoned: bool = False  # given up before its thread started: it never will


class Backing:
    """Worker-thread access to the backing dir (see the module docstring).

    ``root_fd`` (a descriptor of ``path``, the backing dir's real path) stays owned by the caller, who closes it;
    a recovery puts the re-opened root behind the same number.  ``dev`` is the backing root's device (opens
    never cross into another filesystem).  ``tree`` is what a re-opened root must still hold; ``settings`` the
    mount's, whose ``bandwidth`` caps every backing read."""

    def __init__(self, root_fd: int, path: str, tree: Tree, settings: LiveSettings, *, threads: int = 32) -> None:
        self.root_fd = root_fd
        self.path = path
        self.tree = tree
        self.dev = tree.dev
        self._statvfs: os.statvfs_result | None = None  # the last good answer (statfs never waits on a stall)
        self.settings = settings  # (its ``bandwidth``: the cap in force, bytes/s, 0: none)
        self._bw_next = 0.0
        self.limiter = trio.CapacityLimiter(threads)
        self._outstanding: dict[int, float] = {}  # request id -> monotonic start (or last progress)
        self._ids = itertools.count()
        self._requests = 0
        self._timeouts = 0
        self._refused = 0
        self._bytes_read = 0  # (counted in the threads that read: under _bytes_lock)
        self._bytes_lock = threading.Lock()
        # calls per file still running in threads, abandoned ones too (threads end them: hence the lock)
        self._files: dict[bytes, dict[int, float]] = {}
        self._files_lock = threading.Lock()
        self._lost: tuple[float, str] | None = None  # (wall-clock time, reason) while lost
        self._went_lost = trio.Event()
        self._back = trio.Event()  # set while not lost
        self._back.set()
        self._probing = False  # an attempt to re-open the root is running in a thread
        self._probes = 0
        self.recoveries = 0  # times a lost backing was taken back (the revalidator then asks everything again)

    @property
    def lost(self) -> bool:
        return self._lost is not None

    async def wait_answering(self) -> None:
        """Return once the backing is not lost (at once if it is not)."""
        await self._back.wait()

    async def call(self, fn: Callable[..., T], *args: object, timeout: float | None,
                   file: bytes | None = None) -> T:
        """Run ``fn(*args)`` in a backing thread; ``timeout`` seconds (None: wait as long as it takes); ``file``:
        the dataset file it is about (bounded to :data:`PER_FILE` threads).

        Raises :class:`BackingError` (EIO) when the timeout passes (the thread is abandoned, not killed), when the
        file's calls are stuck, and :class:`BackingLost` while the backing is lost (at once, no request made).
        """
        if self._lost is not None:
            self._refused += 1
            raise BackingLost(errno.EIO, f"backing dir lost: {self._lost[1]}")
        return await self._run(fn, args, timeout, file)

    async def _run(self, fn: Callable[..., T], args: tuple[object, ...], timeout: float | None,
                   file: bytes | None) -> T:
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        ticket = None if file is None else await self._file_slot(file, deadline)
        rid = next(self._ids) if ticket is None else ticket.rid
        self._outstanding[rid] = time.monotonic()
        self._requests += 1
        job = functools.partial(self._guarded, ticket, fn, *args)
        try:
            with trio.move_on_at(deadline):
                return await in_thread(job, limiter=self.limiter, abandon_on_cancel=True)
            self._timeouts += 1
            raise BackingError(errno.EIO, f"backing dir not answering within {timeout:g} s")
        except BackingLost as exc:
            self._mark_lost(exc.strerror or "gone")
            raise
        finally:
            del self._outstanding[rid]
            if ticket is not None:
                with self._files_lock:
                    if not ticket.running:
                        ticket.abandoned = True
                        self._end(ticket)

    async def _file_slot(self, file: bytes, deadline: float) -> _Ticket:
        """A place among the :data:`PER_FILE` calls on ``file``: at once, after one ends (polled: this only waits
        while that many calls on one file are in flight), or ``EIO`` if its calls are stuck or ``deadline``
        passes."""
        while True:
            with self._files_lock:
                calls = self._files.setdefault(file, {})
                if len(calls) < PER_FILE:
                    ticket = _Ticket(file, next(self._ids))
                    calls[ticket.rid] = time.monotonic()
                    return ticket
                stuck = time.monotonic() - min(calls.values())
            if stuck > STALL_AFTER and deadline < math.inf:
                self._refused += 1
                raise BackingError(errno.EIO, f"backing dir not answering for this file ({len(calls)} calls "
                                              f"outstanding, the oldest for {stuck:.0f} s)")
            if trio.current_time() >= deadline:
                self._timeouts += 1
                raise BackingError(errno.EIO, "backing dir not answering for this file in time")
            await trio.sleep(0.005)

    def _end(self, ticket: _Ticket) -> None:
        """(under ``_files_lock``) ``ticket``'s call is over."""
        calls = self._files.get(ticket.file)
        if calls is not None:
            calls.pop(ticket.rid, None)
            if not calls:
                del self._files[ticket.file]

    def _guarded(self, ticket: _Ticket | None, fn: Callable[..., T], *args: object) -> T:
        """(a backing thread) ``fn(*args)``; an error that says the backing is gone becomes :class:`BackingLost`."""
        if ticket is not None:
            with self._files_lock:
                if ticket.abandoned:
                    raise BackingError(errno.EIO, "abandoned")  # (nobody waits for this answer any more)
                ticket.running = True
        try:
            return fn(*args)
        except OSError as exc:
            if isinstance(exc, BackingError):
                raise
            if exc.errno in _GONE or (exc.errno in _GONE_IF_ROOT_SILENT and not _root_answers(self.root_fd)):
                raise BackingLost(errno.EIO, exc.strerror or str(exc)) from exc
            raise
        finally:
            if ticket is not None:
                with self._files_lock:
                    self._end(ticket)

    def track(self) -> int:
        """(a thread the caller runs under its own limiter: the stager's copies) A backing request starts: it counts
        as outstanding until :meth:`untrack`, so a copy stuck on the backing shows as a stall.  Its id."""
        rid = next(self._ids)
        self._outstanding[rid] = time.monotonic()  # dict operations are atomic under the GIL
        self._requests += 1
        return rid

    def moved(self, rid: int, nbytes: int = 0) -> None:
        """(that thread) A backing call of request ``rid`` came back (a copy's read, of ``nbytes``): a long copy
        that moves is not a stall, one call that hangs is."""
        if rid in self._outstanding:
            self._outstanding[rid] = time.monotonic()
        self._count_read(nbytes)

    def _count_read(self, nbytes: int) -> None:
        """(any thread) ``nbytes`` were read from a backing file: counted where they arrive, so a read whose caller
        gave up on it (a timeout, an abandoned copy) counts too -- the figure is what the backing served."""
        if nbytes:
            with self._bytes_lock:
                self._bytes_read += nbytes

    def _pread(self, fd: int, size: int, offset: int) -> bytes:
        data = os.pread(fd, size, offset)
        self._count_read(len(data))
        return data

    def untrack(self, rid: int, *, abandoned: bool = False) -> None:
        """Request ``rid`` is over -- or ``abandoned`` (the stager gave it up: counted in ``timeouts``, its thread
        left to the kernel, as a call past its timeout is); once, whoever comes first."""
        if self._outstanding.pop(rid, None) is not None and abandoned:
            self._timeouts += 1

    # -------------------------------------------------------------------------------------------- calls

    async def stat(self, relpath: bytes, *, timeout: float | None) -> os.stat_result:
        return await self.call(_lstat_at, self.root_fd, relpath, timeout=timeout, file=relpath)

    async def stat_many(self, relpaths: Sequence[bytes], *, timeout: float | None) -> list[os.stat_result | OSError]:
        """lstat every path in one thread hop (a batch of the revalidator); per path a stat or its error."""
        return await self.call(_lstat_many, self.root_fd, list(relpaths), timeout=timeout)

    async def open(self, relpath: bytes, *, timeout: float | None) -> tuple[int, os.stat_result]:
        """Open a dataset file beneath the root (no symlink followed, no mount crossed, never a wait on a FIFO or
        a device that took its name) and fstat it."""
        return await self.call(open_regular, self.root_fd, relpath, self.dev, timeout=timeout, file=relpath)

    async def pread(self, fd: int, size: int, offset: int, *, timeout: float | None, file: bytes) -> bytes:
        return await self.call(self._pread, fd, size, offset, timeout=timeout, file=file)

    async def close(self, fd: int) -> None:
        """Close a backing file's descriptor (a network filesystem may talk to its server on close), also while
        the backing is lost: a descriptor is never leaked."""
        with contextlib.suppress(OSError):
            await self._run(os.close, (fd,), None, None)

    async def statvfs(self, *, timeout: float | None = STATFS_TIMEOUT) -> os.statvfs_result | None:
        """The backing filesystem's figures; the last good ones when it does not answer within ``timeout``
        (None before any answer)."""
        with contextlib.suppress(OSError):
            self._statvfs = await self.call(os.fstatvfs, self.root_fd, timeout=timeout)
        return self._statvfs

    async def answering(self, *, timeout: float) -> bool:
        """Whether the backing root answers ``statfs`` within ``timeout`` seconds: a copy that hangs while it does
        hangs on its own file, not on a stalled backing.  At most :data:`PER_FILE` such questions hold threads."""
        try:
            await self.call(os.fstatvfs, self.root_fd, timeout=timeout, file=b"")
        except OSError:
            return False
        return True

    async def root_alive(self, *, timeout: float | None) -> bool:
        """Whether the backing root is still there and answers: a file or a directory gone from a live root is
        gone (ENOENT, and out of the mini-epochs: a data set reshaped); the root gone or unreachable is EIO (an
        unmounted or lost share: nothing is taken for gone)."""
        try:
            return await self.call(_alive, self.root_fd, timeout=timeout)
        except OSError:
            return False

    async def error_for(self, exc: OSError, relpath: bytes, *, timeout: float | None) -> BackingError:
        """The reader's error for ``exc`` on ``relpath`` (see :func:`backing_error`)."""
        if isinstance(exc, BackingError):
            return exc
        alive = exc.errno in _VANISHED and await self.root_alive(timeout=timeout)
        return backing_error(exc, alive)

    async def lost_by(self, exc: OSError) -> bool:
        """Whether ``exc`` (a copy's error, met in the stager's own thread) says the backing is gone; if so it is
        marked lost."""
        if self._lost is None and (exc.errno in _GONE or exc.errno in _GONE_IF_ROOT_SILENT):
            with contextlib.suppress(OSError):
                await self.call(_check_root, self.root_fd, exc, timeout=PROBE_TIMEOUT)
        return self._lost is not None

    async def throttle(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more backing reads fit under the ``bandwidth`` cap (one token bucket for
        readers and staging alike)."""
        bw = self.settings.current.bandwidth
        if bw <= 0:
            return
        now = trio.current_time()
        start = max(now, self._bw_next)
        self._bw_next = start + nbytes / bw
        if start > now:
            await trio.sleep(start - now)

    def throttle_from_thread(self, nbytes: int) -> None:
        """:meth:`throttle` from a staging thread."""
        if self.settings.current.bandwidth > 0:
            trio.from_thread.run(self.throttle, nbytes)

    # ----------------------------------------------------------------------------------- lost and back

    def _mark_lost(self, reason: str) -> None:
        if self._lost is not None:
            return
        self._lost = (time.time(), reason)
        self._back = trio.Event()
        self._went_lost.set()
        log.warning("the backing dir %s is lost (%s): cached copies are served, everything else fails "
                    "with EIO until it is back at that path (tried every %g s at most)", self.path, reason,
                    PROBE_MAX)

    async def run(self) -> None:
        """The mount's background job: while the backing is lost, try to take it back (see the module
        docstring), backing off from PROBE_FIRST to PROBE_MAX seconds between attempts."""
        while True:
            await self._went_lost.wait()
            delay = PROBE_FIRST
            while self._lost is not None:
                await trio.sleep(delay)
                delay = min(2 * delay, PROBE_MAX)
                if not self._probing:
                    await self._probe()
            self._went_lost = trio.Event()

    async def _probe(self) -> None:
        """One attempt to re-open the backing root by its path (a backing thread, never two at once)."""
        n = self.tree.n_files
        picks = np.unique(np.linspace(0, n - 1, min(SAMPLE, n)).astype(np.int64)).tolist() if n else []
        sample = [(self.tree.file_path(f), *self.tree.fingerprint_of(f)[:2]) for f in picks]
        self._probes += 1
        self._probing = True

        def attempt() -> os.stat_result | None:
            try:
                return _reopen(self.path, self.root_fd, sample)
            except OSError:
                return None
            finally:
                self._probing = False

        st = None
        with trio.move_on_after(PROBE_TIMEOUT):
            st = await in_thread(attempt, limiter=self.limiter, abandon_on_cancel=True)
        if st is None or self._lost is None:
            return
        self.dev = st.st_dev
        since, reason = self._lost
        self._lost = None
        self.recoveries += 1
        self._back.set()
        log.warning("the backing dir %s is back after %.1f s (lost: %s); every fingerprint is asked again",
                    self.path, time.time() - since, reason)

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
        lost = self._lost
        return BackingStatistics(
            state="lost" if lost is not None else "ok" if since is None else "stalled",
            stalled_since=None if since is None else time.time() - (now - since),
            lost_since=None if lost is None else lost[0],
            reason=None if lost is None else lost[1],
            waiting=len(self._outstanding),
            threads=int(self.limiter.total_tokens),
            requests=self._requests,
            timeouts=self._timeouts,
            refused=self._refused,
            probes=self._probes,
            recoveries=self.recoveries,
            bytes_read=self._bytes_read,
        )


def _root_answers(root_fd: int) -> bool:
    """Whether the backing root answers ``statfs`` (never served from a cache, unlike ``fstat``)."""
    try:
        os.fstatvfs(root_fd)
    except OSError:
        return False
    return True


def _check_root(root_fd: int, exc: OSError) -> None:
    """Raise ``exc`` again if the backing root does not answer (the thread's guard then marks it lost)."""
    if exc.errno in _GONE or not _root_answers(root_fd):
        raise exc


def _reopen(path: str, root_fd: int, sample: list[tuple[bytes, int, int]]) -> os.stat_result | None:
    """Open ``path`` again and, if it holds the dataset (most of ``sample``'s files there with their size and
    mtime), put it behind ``root_fd``'s number; its stat, or None (not the dataset, not there yet)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        found = 0
        for rel, size, mtime in sample:
            try:
                s = os.stat(rel, dir_fd=fd, follow_symlinks=False)
            except (FileNotFoundError, NotADirectoryError):
                continue
            found += stat.S_ISREG(s.st_mode) and (s.st_size, s.st_mtime_ns) == (size, mtime)
        if 2 * found < len(sample) or (sample and not found):
            return None
        # (the number stays: the rescan and copies in flight hold it; a call in the kernel keeps the old root)
        os.dup2(fd, root_fd, inheritable=False)
        return st
    finally:
        os.close(fd)


def _lstat_at(root_fd: int, relpath: bytes) -> os.stat_result:
    return os.stat(relpath or b".", dir_fd=root_fd, follow_symlinks=False)


def _lstat_many(root_fd: int, relpaths: list[bytes]) -> list[os.stat_result | OSError]:
    out: list[os.stat_result | OSError] = []
    for p in relpaths:
        try:
            out.append(os.stat(p, dir_fd=root_fd, follow_symlinks=False))
        except OSError as exc:
            if exc.errno in _GONE:
                raise  # the backing itself, not this path (the guard makes it BackingLost)
            out.append(exc)
    return out


def _alive(root_fd: int) -> bool:
    return os.fstat(root_fd).st_nlink != 0

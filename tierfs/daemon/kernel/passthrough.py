"""Kernel passthrough for cached copies: the kernel reads and maps a cached file's copy itself.

With Linux 6.9+ FUSE passthrough an open may be answered with a *backing id*: a file the daemon registered with
the kernel (``FUSE_DEV_IOC_BACKING_OPEN``), which the kernel then reads, maps and caches as if the reader had
opened it -- no READ reaches the daemon, and the file's pages sit in the page cache once (the copy's), not twice
(the copy's and the mount's).  pyfuse3 gets it from scripts/pyfuse3 (passthrough.patch): ``init(...,
passthrough=True)``, ``backing_open(fd)``, ``backing_close(id)``, ``FileInfo(backing_id=)``,
``passthrough_active()``.

:class:`BackingIds` owns the ids.  A committed copy is registered once, at its first passthrough open, and its id
kept on its cache entry (``CacheEntry.backing_id``; the daemon's descriptor of it is closed); the id is dropped
when the copy's file is deleted -- evicted or replaced, once no handle pins it (the cache tells :meth:`deleted`),
so an evicted copy's blocks are never held by the kernel past its last open.

The kernel's rule, kept here: while a passthrough open of an inode exists, every other open of it must be a
passthrough open of the same backing file, and while a plain open exists (served by the daemon: a file not cached
yet, a copy being made), no passthrough open -- either way the kernel answers the open with EIO.  So per file this
part knows the copy its passthrough opens share (a new open joins them: the old copy until their last release,
even if the file changed or the copy was evicted meanwhile) and how many plain opens it has (a new open stays
plain until they are released).

What tierfs no longer sees are the READs of passthrough opens: the bytes served are counted at the open (the
copy's size), and everything that works from opens -- passes, out-of-view reads, the loader watch -- works as
before.  A copy is checked (and with ``verify=xxhash`` hashed) before it is registered, as a pushed copy is
before it is pushed; one changed on the cache disk after that is read as it is (the kernel reads it).

It is off, and ``status.passthrough`` says why, where it cannot work: ``passthrough=off``; pyfuse3 without the
patch; a kernel that did not offer it (before 6.9, or built without ``CONFIG_FUSE_PASSTHROUGH``); a daemon
without CAP_SYS_ADMIN (EPERM); a cache dir on a stacked filesystem (overlayfs, ecryptfs: ELOOP).  The first
failure turns it off for the mount and is logged once; every open then takes the daemon's path.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from typing import Protocol

from tierfs.daemon.cache.store import CacheEntry

__all__ = ["BackingIds", "KernelBackings", "PassthroughStatistics"]

log = logging.getLogger("tierfs")

#: why the kernel refused a registration, as status says it
_WHY = {errno.EPERM: "the daemon lacks CAP_SYS_ADMIN: mount as root",
        errno.ELOOP: "the cache dir is on a stacked filesystem (overlayfs, ecryptfs)",
        errno.ENOTTY: "the kernel has no passthrough ioctls (Linux 6.9+)",
        errno.EOPNOTSUPP: "the kernel did not enable passthrough for this mount"}


class KernelBackings(Protocol):
    """What passthrough asks of pyfuse3 (the build of scripts/pyfuse3): the module itself."""

    def backing_open(self, fd: int) -> int: ...

    def backing_close(self, backing_id: int) -> None: ...

    def passthrough_active(self) -> bool | None: ...


@dataclass(frozen=True)
class PassthroughStatistics:
    state: str  # "on", or "off (why)"
    opens: int  # opens answered in passthrough
    plain_opens: int  # opens of dataset files served by the daemon (not cached, a copy being made, sharing)
    registered: int  # copies registered with the kernel now
    registrations: int  # registrations made since the mount


class BackingIds:
    """See the module docstring.  ``kernel`` is None until the mount is up (:meth:`attach`), and for good where
    passthrough is off (``why_off`` says why)."""

    def __init__(self, *, asked: bool, min_size: int = 0) -> None:
        self._kernel: KernelBackings | None = None
        self._why_off = "off (not mounted yet)" if asked else "off (passthrough=off)"
        self._asked = asked
        self.min_size = min_size  # (copies smaller are served by the daemon: passthrough=auto, see serves())
        self._shared: dict[int, tuple[CacheEntry, int]] = {}  # file -> (the copy its passthrough opens share, opens)
        self._plain: dict[int, int] = {}  # file -> its plain opens
        self.opens = 0
        self.plain_opens = 0
        self.registered = 0
        self.registrations = 0

    def attach(self, kernel: KernelBackings | None, why_not: str = "pyfuse3 without the passthrough patch") -> None:
        """The mount is up: ``kernel`` registers copies (None: passthrough stays off, ``why_not``)."""
        if not self._asked:
            return
        self._kernel, self._why_off = kernel, ""
        if kernel is None:
            self._off(why_not)

    def _off(self, why: str) -> None:
        """Off for the rest of the mount (ids registered so far are still dropped with their copies)."""
        if self._why_off:
            return
        self._why_off = f"off ({why})"
        log.warning("passthrough is off: %s; cached files are served by the daemon", why)

    @property
    def on(self) -> bool:
        """Whether a cached open may be answered in passthrough now (the kernel agreed at its INIT)."""
        if self._why_off or self._kernel is None:
            return False
        active = self._kernel.passthrough_active()
        if active is None:
            return False  # (before the kernel's INIT: no open comes then)
        if not active:
            self._off("the kernel did not offer it: Linux 6.9+ built with CONFIG_FUSE_PASSTHROUGH")
        return not self._why_off

    def serves(self, entry: CacheEntry) -> bool:
        """Whether an open of ``entry``'s copy is answered in passthrough (when :attr:`on`): copies of at least
        ``min_size`` bytes.  Under ``passthrough=auto`` that is 1 MiB: below it, a warm pass is faster through
        the mount's own page cache (the pusher's, ``keep_cache``), and a kernel passthrough open costs ~30 µs
        more (docs/benchmarks.md); ``passthrough=all`` serves every copy so."""
        return entry.size >= self.min_size

    # ------------------------------------------------------------------------------------------- opens

    def shared(self, fidx: int) -> CacheEntry | None:
        """The copy that passthrough opens of ``fidx`` now share: a new open must be one of them (the kernel)."""
        shared = self._shared.get(fidx)
        return shared[0] if shared is not None else None

    def plain_open(self, fidx: int) -> bool:
        """Whether ``fidx`` has opens the daemon serves: a new open must be one too (the kernel)."""
        return fidx in self._plain

    def register(self, entry: CacheEntry, fd: int) -> int:
        """The backing id of ``entry``'s copy (``fd``, opened and checked by the caller), registered now if it is
        not yet; 0 where the kernel refuses (passthrough is then off for the mount, said once)."""
        if entry.backing_id:
            return entry.backing_id
        assert self._kernel is not None
        try:
            entry.backing_id = self._kernel.backing_open(fd)
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            self._off(f"{name}: {_WHY.get(exc.errno or 0, exc.strerror or str(exc))}")
            return 0
        self.registered += 1
        self.registrations += 1
        return entry.backing_id

    def opened(self, fidx: int, entry: CacheEntry) -> None:
        """A passthrough open of ``fidx`` through ``entry``'s id was answered."""
        _, n = self._shared.get(fidx, (entry, 0))
        self._shared[fidx] = (entry, n + 1)
        self.opens += 1

    def opened_plain(self, fidx: int) -> None:
        self._plain[fidx] = self._plain.get(fidx, 0) + 1
        self.plain_opens += 1

    def released(self, fidx: int) -> None:
        entry, n = self._shared[fidx]
        if n > 1:
            self._shared[fidx] = (entry, n - 1)
        else:
            del self._shared[fidx]

    def released_plain(self, fidx: int) -> None:
        n = self._plain[fidx]
        if n > 1:
            self._plain[fidx] = n - 1
        else:
            del self._plain[fidx]

    # ------------------------------------------------------------------------------------- (CopyRegistry)

    def deleted(self, entry: CacheEntry) -> None:
        """(the cache) ``entry``'s copy is being deleted, no handle pinning it: its id goes."""
        if not entry.backing_id:
            return
        backing_id, entry.backing_id = entry.backing_id, 0
        self.registered -= 1
        if self._kernel is not None:
            try:
                self._kernel.backing_close(backing_id)
            except OSError as exc:  # (the connection went: the kernel dropped every id with it)
                log.debug("backing_close(%d): %s", backing_id, os.strerror(exc.errno or 0))

    def statistics(self) -> PassthroughStatistics:
        return PassthroughStatistics(self._why_off or "on", self.opens, self.plain_opens, self.registered,
                                     self.registrations)

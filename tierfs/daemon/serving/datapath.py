"""The data path: every open, read, release and lend of a dataset file.

It owns the open handles and what is counted of them: the read counters and the descriptors the handles hold
per user (a :class:`~tierfs.daemon.access.FdBudget`: one user's opens cannot exhaust the daemon's descriptors),
and the batch plans (batch_plans.py).  The engine gives it the parts it works with -- tree, cache, backing,
revalidator (the fingerprint verdict), stager, pusher and its :class:`~tierfs.daemon.kernel.pusher.KernelVersions`
(which version of a file the kernel holds: an open asks it whether to bypass the page cache), schedule, policy,
the :class:`~tierfs.daemon.serving.pins.PinKeeper` (lent copies stay pinned there), the settings, the pass rule
(:class:`OpenCounter`: who opened what) -- and :class:`DataPathEvents`, what it tells the engine: a file changed,
a file needs staging again, the cache's ``data/`` is gone.

**Never waits on the slow tier for the fast one.**  An open of a cached file whose fingerprint is fresh (see
revalidator.py) makes no backing call; the copy is opened and checked (size, inode, ctime, mtime) with one
local ``open`` + ``fstat``; a damaged copy is a cache miss (:meth:`DataPath.repair`).  A copy whose bytes the
pusher gave the kernel is only pinned at the open, and opened and checked at the first read that reaches the
daemon: its reads are served from the mount's page cache, so most opens make no call on a copy at all.
Backing calls go through :class:`~tierfs.daemon.backing.calls.Backing` with ``backing_timeout``.

**Never the new bytes on the old permission check.**  The kernel let the requester in on the mode and owner it
had been told.  An open that finds its file changed in the backing dir with another mode, owner or group (a file
replaced by a private one, or ``chmod 600``'d after a rewrite) serves nothing: it fails with
:class:`AccessChanged` (``ESTALE``), and the kernel, told the new attributes (operations.py, namespace.py), checks
them itself and opens again -- or refuses.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from dataclasses import dataclass
from typing import Protocol

import trio

from tierfs.common.options import LiveSettings
from tierfs.daemon.access import OWNER_UID, FdBudget, FdBudgetStatistics
from tierfs.daemon.backing.calls import Backing, BackingError
from tierfs.daemon.backing.revalidator import Revalidator, Verdict
from tierfs.daemon.cache.copy_check import CopyDamaged, hash_copy, open_copy
from tierfs.daemon.cache.store import CacheEntry, CacheStore
from tierfs.daemon.kernel.passthrough import BackingIds
from tierfs.daemon.kernel.pusher import Pusher
from tierfs.daemon.runtime.jobs import Background
from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.schedule.consumers import ANONYMOUS
from tierfs.daemon.schedule.policy import ADVISE_WHOLE, CachePolicy
from tierfs.daemon.schedule.schedule import Schedule
from tierfs.daemon.serving.batch_plans import BatchPlans, PlanStatistics
from tierfs.daemon.serving.pins import LEND_SECONDS, PinKeeper
from tierfs.daemon.staging.stager import Stager
from tierfs.daemon.tree.tree import Node, Tree

__all__ = ["LEND_SECONDS", "AccessChanged", "DataPath", "DataPathEvents", "DataPathStatistics", "FileHandle",
           "OpenCounter", "Reads"]

log = logging.getLogger("tierfs")


@dataclass(frozen=True)
class Reads:
    """Opens of dataset files: served from the cache (hits) or the backing dir (misses); outside the view;
    hits answered with the cached copy's path for the reader to open itself (``direct``, see lend)."""

    hits: int = 0
    misses: int = 0
    out_of_view: int = 0
    direct: int = 0
    plan: int = 0  # hits read from a batch plan's copies, as reported (see batch_plans.py)


@dataclass(frozen=True)
class DataPathStatistics:
    """What the data path reports (``DataPath.statistics()``)."""

    reads: Reads
    served_bytes: int
    opened_bytes: int
    stall_seconds: float
    handles: int
    plans: PlanStatistics
    fd_budget: FdBudgetStatistics


@dataclass(eq=False)
class FileHandle:
    """One open dataset file: a descriptor of the cached copy (``entry``) or of the backing file, held for the
    user ``uid`` (counted in the data path's :class:`~tierfs.daemon.access.FdBudget`); ``_NOT_OPEN`` while the
    copy is pinned but not opened (its bytes were pushed: reads may never come)."""

    fidx: int
    fd: int
    entry: CacheEntry | None
    keep_cache: bool
    direct_io: bool
    uid: int
    opening: trio.Event | None = None  # set while a read opens the pinned copy (the other reads wait for it)
    backing_id: int = 0  # a passthrough open: the kernel reads its copy itself (passthrough.py), no READ comes


class AccessChanged(BackingError):
    """An open found its file's mode, owner or group changed in the backing dir: the kernel let the requester
    in on the old ones (see the module docstring).  ``ESTALE``."""

    def __init__(self) -> None:
        super().__init__(errno.ESTALE, "its mode or owner changed in the backing dir: the kernel checks again")


#: a handle's ``fd`` while its copy is pinned but not opened (``DataPath._open_file``)
_NOT_OPEN = -1


def _pread_rest(fd: int, buf: bytearray, done: int, offset: int) -> int:
    """Fill ``buf[done:]`` from ``offset + done`` (blocking; in a worker thread); returns the bytes in ``buf``."""
    view = memoryview(buf)
    while done < len(buf):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class OpenCounter(Protocol):
    """Who counts the opens for the passes (the pass rule: :class:`~tierfs.daemon.schedule.passes.PassRule`)."""

    def file_opened(self, fidx: int, size: int, uid: int, who: str = ANONYMOUS) -> None:
        """User ``uid``, consumer ``who``, opened ``fidx`` (``size`` bytes)."""


class DataPathEvents(Protocol):
    """What the data path tells the engine (the engine implements it)."""

    def changed(self, fidx: int, st: os.stat_result) -> None:
        """The backing file now has stat ``st``: the tree takes it, the old copy and pages go, it is staged again."""

    def restage(self, fidx: int) -> None:
        """``fidx`` has no valid copy any more: stage it again if it is wanted ahead."""

    def gone(self, fidx: int) -> None:
        """The backing said ``fidx`` is gone: its copy goes, and it leaves the mini-epochs."""

    async def data_dir_lost(self) -> str | None:
        """The cache's ``data/`` is gone: make it again; why it could not be (None once it is)."""


class DataPath:
    """See the module docstring."""

    def __init__(self, *, tree: Tree, cache: CacheStore, cache_limiter: trio.CapacityLimiter, backing: Backing,
                 reval: Revalidator, stager: Stager, pusher: Pusher, schedule: Schedule, policy: CachePolicy,
                 pins: PinKeeper, settings: LiveSettings, passes: OpenCounter, events: DataPathEvents,
                 passthrough: BackingIds | None = None) -> None:
        self.tree = tree
        self.passthrough = passthrough or BackingIds(asked=False)  # (which opens the kernel serves itself)
        self.cache = cache
        self.cache_limiter = cache_limiter
        self.backing = backing
        self.reval = reval
        self.stager = stager
        self.pusher = pusher
        self.versions = pusher.versions
        self.schedule = schedule
        self.policy = policy
        self.pins = pins
        self.settings = settings
        self.passes = passes
        self.events = events
        self._tasks = Background()  # (run()) copies made beside their readers, closes after a reply
        self._lent_recently: dict[int, tuple[float, CacheEntry]] = {}  # fidx -> (until, copy) just lent
        self._repair_logged: set[str] = set()
        self.hits = self.misses = self.out_of_view = self.lent = 0
        self.served_bytes = 0  # returned by the daemon; page-cache hits never reach it
        self.opened_bytes = 0  # sizes of dataset files opened: what loaders consume
        self.stall_seconds = 0.0
        self.handles = 0  # dataset files open now
        self.fd_budget = FdBudget()  # the descriptors those handles hold, per user
        #: batch plans for direct readers (batch_plans.py), their copies pinned until their pass ends
        self.batch = BatchPlans(tree=tree, cache=cache, reval=reval, schedule=schedule, settings=settings, pins=pins,
                                reads=self)

    def _opened(self, fidx: int, size: int, uid: int, who: str = ANONYMOUS) -> None:
        self.stager.serving()  # staging yields to readers
        self.opened_bytes += size
        view = self.schedule.view
        if view is None or not view.mask[fidx]:
            self.out_of_view += 1
        self.passes.file_opened(fidx, size, uid, who)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """For the life of the mount: the copies made beside their readers and the backing closes left until after
        a reply (without it, in engine tests, a close is inline and no copy is made beside its reader)."""
        await self._tasks.run(task_status=task_status)

    def statistics(self) -> DataPathStatistics:
        plans = self.batch.statistics()
        return DataPathStatistics(Reads(self.hits, self.misses, self.out_of_view, self.lent, plans.reported),
                                  self.served_bytes, self.opened_bytes, self.stall_seconds,
                                  self.handles, plans, self.fd_budget.statistics())

    async def repair(self, entry: CacheEntry, reason: str) -> None:
        """A copy was found damaged or missing: a cache miss, counted and logged; stage it again."""
        if self.cache.repair(entry):
            self.log_repair(entry.name, f"cache repair: {reason}")
            self.pusher.forget(entry.fidx)
            self.events.restage(entry.fidx)
        if await in_thread(self.cache.data_dir_lost, limiter=self.cache_limiter):
            await self.events.data_dir_lost()

    def log_repair(self, key: str, message: str) -> None:
        if key not in self._repair_logged:  # once per event
            self._repair_logged.add(key)
            log.warning("%s", message)

    def _timeout(self) -> float | None:
        return self.settings.current.backing_timeout_s

    async def open_copy(self, entry: CacheEntry) -> int | None:
        """Open (and pin) a cached copy and check it against its entry; None if it is damaged or gone (repaired
        here).  Inline, not in a cache thread: a local ``open`` + ``fstat`` costs microseconds, a thread hop per
        open cost 1.3-1.8x on a pass of small files (docs/benchmarks.md, "Before/after the engine split")."""
        self.cache.pin(entry)
        try:
            return open_copy(self.cache.data_fd, entry.name, entry.size, entry.copy_id)
        except CopyDamaged as exc:
            self.cache.unpin(entry)
            await self.repair(entry, str(exc))
            return None
        except BaseException:
            self.cache.unpin(entry)
            raise

    def release_copy(self, entry: CacheEntry, fd: int) -> None:
        if fd != _NOT_OPEN:
            os.close(fd)  # a local file opened read-only: closing never waits on the disk
        self.cache.unpin(entry)

    async def _confirm(self, fidx: int) -> os.stat_result | None:
        """Ask the backing for ``fidx``'s stat before an open uses a fingerprint older than ``revalidate``.

        Returns the new stat if the file changed (the tree is updated, the old copy dropped); None if it did
        not, or if the backing could not say (stalled, lost, an error other than "gone") while a copy is there to
        serve: a copy is dropped only on the backing's answer that the file changed or is gone (the
        revalidator's verdict)."""
        verdict, answer = await self.reval.ask(fidx, timeout=self._timeout())
        if isinstance(answer, OSError):
            err = await self.backing.error_for(answer, self.tree.file_path(fidx), timeout=self._timeout())
            if verdict is Verdict.GONE:  # (the file, or its directory or the whole dataset, is not there)
                if err.errno == errno.ENOENT:  # (the file or its directory: the backing itself answers)
                    self.events.gone(fidx)
                self.cache.evict(fidx)
                raise err from None
            if self.cache.get(fidx) is not None:
                self.reval.served_unconfirmed()  # the copy is whole, and the last word we had
                return None
            raise err from None
        if verdict is Verdict.GONE:
            self.events.gone(fidx)
            raise BackingError(errno.ENOENT, "no longer a regular file in the backing dir")
        if verdict is Verdict.SAME:
            return None
        await self.pusher.wait_landed(fidx)  # its old bytes must land before the invalidation, never after
        self.events.changed(fidx, answer)
        return answer

    async def open_file(self, fidx: int, uid: int = OWNER_UID, who: str = ANONYMOUS) -> FileHandle:
        """Open dataset file ``fidx`` for reading by user ``uid``, consumer ``who`` (consumers.py): from the cache
        if a valid copy is there, else the backing; ``EMFILE`` for that user alone once it holds its share of the
        daemon's descriptors."""
        self.fd_budget.take(uid)
        try:
            return await self._open_file(fidx, uid, who)
        except BaseException:
            self.fd_budget.give(uid)
            raise

    async def _open_file(self, fidx: int, uid: int, who: str) -> FileHandle:
        pt_on = self.passthrough.on
        shared = self.passthrough.shared(fidx) if pt_on else None
        if shared is not None:  # (the kernel takes no other file for an inode its passthrough opens read)
            return self._pass_through(fidx, shared, uid, who)
        access = self.tree.access_serial  # (a change of this file's mode or owner found from here on: refused)
        entry = self.cache.get(fidx)
        if entry is not None and not self.reval.fresh(fidx):
            # (an uncached file needs no separate check: its copy, or its backing open, compares fingerprints)
            await self._confirm(fidx)
            entry = self.cache.get(fidx)  # (gone if the backing file changed)
        was_cached = entry is not None
        # (the tree's node, the file's path, only where the backing file may be read: not on a hit)
        if entry is None and self.policy.copies_beside(self.tree.file_stat(fidx).st_size) and self._tasks.running:
            # Served from the backing file at once while the copy is made beside it; later opens find the copy.
            self._tasks.start_soon(self._fetch_beside, fidx)
        elif entry is None and self.policy.fetches_on_open(fidx):
            entry = await self._fetch(fidx)
        fd = None
        if entry is not None and self.settings.current.verify == "xxhash" and not entry.verified:
            entry = await self._verify(entry)
        passthrough = pt_on and entry is not None and self.passthrough.serves(entry)  # (its size: passthrough=)
        if entry is not None and (entry.backing_id if passthrough else self.pusher.holds(fidx)) \
                and self.cache.data_dir_held():
            # Its bytes, checked, are in the mount's own page cache (pushed), or the kernel reads the copy itself
            # (registered for passthrough, checked then): the reads stay in the kernel, so the copy is only pinned
            # here, and opened (and checked) at the first read that reaches us, should one (_open_pinned; a file
            # found changed meanwhile is read with direct_io, from the copy of the version it was opened at, as
            # an opened copy would be).  (A data dir someone deleted is found here, as the open of a copy would
            # find it: then made again.)
            self.cache.pin(entry)
            fd = _NOT_OPEN
        elif entry is not None:
            fd = await self.open_copy(entry)
        if fd is None:
            entry = None
            fd, size = await self._open_backing(fidx, self.tree.file_node(fidx))
        if self.tree.access_serial != access and self.tree.access_changed_since(fidx + 1, access):
            await self._let_go(entry, fd)
            raise AccessChanged
        # From here to the reply nothing waits: what the kernel allows beside the other opens of this inode is
        # decided now (passthrough.py).
        if pt_on and (shared := self.passthrough.shared(fidx)) is not None:
            if entry is not None:
                self.release_copy(entry, fd)
            # (a backing close may wait on its server: after this reply, where the mount runs)
            elif not self._tasks.start_soon(self.backing.close, fd):
                await self.backing.close(fd)
            return self._pass_through(fidx, shared, uid, who)
        if passthrough and entry is not None and not self.passthrough.plain_open(fidx) and (
                entry.backing_id or (fd != _NOT_OPEN and self.passthrough.register(entry, fd))):
            if fd != _NOT_OPEN:
                os.close(fd)  # (the kernel holds the copy: the daemon's descriptor is not needed; the pin stays)
            return self._pass_through(fidx, entry, uid, who, hit=was_cached, pinned=True)
        self.passthrough.opened_plain(fidx)
        if entry is not None:
            self.cache.touch(entry)
            if was_cached:
                self.hits += 1
            else:
                self.misses += 1  # fetched on demand: the reader waited on the backing dir
            size = entry.size
        else:
            self.misses += 1
        try:
            direct = await self.versions.opened(fidx)
        except BaseException:  # (cancelled at unmount: this open is never answered, nor released)
            self.passthrough.released_plain(fidx)
            raise
        # (a changed file can change again between this open and its reads, and the kernel keeps one size and
        # one page cache per inode, not per open: direct_io makes this handle's reads end where its version ends)
        handle = FileHandle(fidx, fd, entry, keep_cache=not direct, direct_io=direct, uid=uid)
        self.handles += 1
        if fd != _NOT_OPEN and entry is not None and not entry.advised and size <= ADVISE_WHOLE:
            # Start reading a small copy into the page cache now, while the open's reply travels: the read that
            # follows then mostly finds it there and needs no thread hop (big files get the kernel's read-ahead).
            # WILLNEED on a local copy only queues read-ahead on the fast tier and returns: never the backing.
            # Once a copy: later opens find its bytes in the mount's own page cache (keep_cache), or the copy's.
            entry.advised = True
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_WILLNEED)
        self._opened(fidx, size, uid, who)
        return handle

    def _pass_through(self, fidx: int, entry: CacheEntry, uid: int, who: str, *, hit: bool = True,
                      pinned: bool = False) -> FileHandle:
        """A passthrough open of ``entry``'s copy (registered): pinned while open, as an opened copy is; no READ
        comes, so its bytes count as served now."""
        if not pinned:
            self.cache.pin(entry)
        self.cache.touch(entry)
        if hit:
            self.hits += 1
        else:
            self.misses += 1  # (fetched on demand)
        self.passthrough.opened(fidx, entry)
        self.handles += 1
        self.served_bytes += entry.size
        self._opened(fidx, entry.size, uid, who)
        return FileHandle(fidx, _NOT_OPEN, entry, keep_cache=False, direct_io=False, uid=uid,
                          backing_id=entry.backing_id)

    async def _let_go(self, entry: CacheEntry | None, fd: int) -> None:
        """Close what an open opened: its copy (``entry``), or its backing file (in a backing thread: a network
        filesystem may ask its server)."""
        if entry is not None:
            self.release_copy(entry, fd)
        else:
            await self.backing.close(fd)

    async def _open_backing(self, fidx: int, node: Node) -> tuple[int, int]:
        t0 = time.monotonic()
        try:
            fd, st = await self.backing.open(node.path, timeout=self._timeout())
        except OSError as exc:
            err = await self.backing.error_for(exc, node.path, timeout=self._timeout())
            if err.errno == errno.ENOENT:  # (gone from a live root: out of the mini-epochs)
                self.events.gone(fidx)
            raise err from None
        finally:
            self.stall_seconds += time.monotonic() - t0
        if self.reval.verdict(fidx, st) is Verdict.CHANGED:
            self.events.changed(fidx, st)
            self.reval.confirm(fidx)
        return fd, st.st_size

    async def _fetch(self, fidx: int) -> CacheEntry | None:
        t0 = time.monotonic()
        try:
            entry = await self.stager.fetch_now(fidx)
        finally:
            self.stall_seconds += time.monotonic() - t0
        if entry is not None and not self.tree.holds(fidx, entry.fp):
            return None
        return entry

    async def _fetch_beside(self, fidx: int) -> None:
        """Copy a miss into the cache while its reader is served from the backing (a background task: a
        failure is the stager's to report, never the mount's end)."""
        try:
            await self.stager.fetch_now(fidx)
        except Exception:  # (OSErrors are handled by the stager; anything else is a bug, logged)
            log.exception("copying %s in the background failed", os.fsdecode(self.tree.file_path(fidx)))

    async def _verify(self, entry: CacheEntry) -> CacheEntry | None:
        """``verify=xxhash``: hash the copy once before its first use and compare with the staging hash."""
        self.cache.pin(entry)  # kept on disk while hashed
        try:
            ok = entry.digest is not None and await in_thread(
                hash_copy, self.cache.data_fd, entry.name, limiter=self.cache_limiter) == entry.digest
        except OSError:
            ok = False
        finally:
            self.cache.unpin(entry)
        if ok:
            entry.verified = True
            return entry
        why = f"cached copy of {os.fsdecode(self.tree.file_path(entry.fidx))} failed xxhash check"
        self.stager.copy_found_bad(why)
        await self.repair(entry, why)
        return None

    async def lend(self, fidx: int, uid: int = OWNER_UID, who: str = ANONYMOUS) -> bytes | None:
        """The absolute path of a valid cached copy of ``fidx``, for a reader that opens it itself; or None.

        The copy is complete and never changes (copies land by rename under a fresh name), so a reader that
        opens it gets exactly the bytes the mount would serve, at the fast tier's own speed.  It is checked as
        an open checks it (fingerprint within ``revalidate``, the copy as committed, ``verify=xxhash`` done) and
        pinned for ``LEND_SECONDS`` so an eviction cannot unlink it between this answer and the reader's open.
        None (read through the mount) when the file is not cached, changed, or awaits its xxhash check.
        Counted as an open by ``uid`` served from the cache, like :meth:`open_file`.
        """
        self.pins.return_leases()
        entry = self.cache.get(fidx)
        if entry is None:
            return None
        if not self.reval.fresh(fidx):
            try:
                if await self._confirm(fidx) is not None:
                    return None
            except OSError:
                return None
        entry = self.cache.get(fidx)
        if entry is None or (self.settings.current.verify == "xxhash" and not entry.verified):
            return None
        fd = await self.open_copy(entry)  # the copy is what was committed (and pinned from here on)
        if fd is None:
            return None
        os.close(fd)
        self.cache.touch(entry)
        now = time.monotonic()
        self.pins.lease(entry, now)  # (the pin open_copy made)
        recent = self._lent_recently.get(fidx)
        if recent is None or recent[1] is not entry or recent[0] <= now:
            # (the same question again at once is the kernel retrying with a bigger buffer, not another open)
            self._lent_recently = {f: r for f, r in self._lent_recently.items() if r[0] > now}
            self._lent_recently[fidx] = (now + 0.2, entry)
            self.hits += 1
            self.lent += 1
            self._opened(fidx, entry.size, uid, who)
        return os.fsencode(os.path.join(self.cache.data_path, entry.name))

    def served_from_copies(self, reads: list[tuple[int, CacheEntry]]) -> None:
        """Direct reads of copies were reported (a batch plan's): count each as an open served from the cache,
        in the order given (a pass that ends on one of them has the rest in the next).  Reported over
        ``control``, which only the owner and root may write: theirs."""
        self.hits += len(reads)
        touch, opened = self.cache.touch, self._opened
        for fidx, entry in reads:
            touch(entry)
            opened(fidx, entry.size, OWNER_UID)

    async def read(self, handle: FileHandle, offset: int, size: int) -> bytes | bytearray:
        if handle.fd == _NOT_OPEN:
            await self._open_pinned(handle)
        entry = handle.entry
        if entry is not None:
            # The cached copy: bytes already in the page cache are copied right here (RWF_NOWAIT never blocks
            # on the disk, and starts the read-ahead of what is missing); only the rest goes to a worker thread,
            # so a warm read costs no thread hop and a cold one never stalls the other requests.
            want = max(0, min(size, entry.size - offset))
            data = bytearray(want)
            try:
                n = os.preadv(handle.fd, [data], offset, os.RWF_NOWAIT) if want else 0
            except OSError:  # EAGAIN: not in the page cache (or a cache fs without RWF_NOWAIT)
                n = 0
            if n < want:
                n = await in_thread(_pread_rest, handle.fd, data, n, offset, limiter=self.cache_limiter)
            if n == want:
                self.served_bytes += n
                return data
            # The copy shrank under an open handle (someone truncated it): never a short read; the rest of
            # this handle's reads come from the backing file, if it is still the file the copy was made of.
            await self.repair(entry, f"copy {entry.name} shrank while open")
            await self._handle_to_backing(handle)
        await self.backing.throttle(size)
        t0 = time.monotonic()
        try:
            got = await self.backing.pread(handle.fd, size, offset, timeout=self._timeout(),
                                           file=self.tree.file_path(handle.fidx))
        except OSError as exc:
            raise BackingError(errno.EIO, f"backing read failed: {exc.strerror or exc}") from None
        finally:
            self.stall_seconds += time.monotonic() - t0
        self.served_bytes += len(got)
        return got

    async def _open_pinned(self, handle: FileHandle) -> None:
        """Open the pinned copy of a handle opened without it; a damaged copy is repaired, and the handle's
        reads come from the backing file (if it is still the file the copy was made of)."""
        while handle.fd == _NOT_OPEN:
            if handle.opening is not None:  # (the kernel's read-ahead sends a handle's reads side by side)
                await handle.opening.wait()
                continue
            entry = handle.entry
            assert entry is not None
            handle.opening = opening = trio.Event()
            try:
                handle.fd = open_copy(self.cache.data_fd, entry.name, entry.size, entry.copy_id)
            except CopyDamaged as exc:
                await self.repair(entry, str(exc))
                await self._handle_to_backing(handle)
            finally:
                handle.opening = None
                opening.set()

    async def _handle_to_backing(self, handle: FileHandle) -> None:
        entry = handle.entry
        assert entry is not None
        fd, _ = await self._open_backing(handle.fidx, self.tree.file_node(handle.fidx))
        if not self.tree.holds(handle.fidx, entry.fp):
            os.close(fd)
            raise BackingError(errno.EIO, "the file changed in the backing dir and its cached copy was damaged")
        self.release_copy(entry, handle.fd)
        handle.fd, handle.entry = fd, None

    async def release(self, handle: FileHandle) -> None:
        self.handles -= 1
        if handle.backing_id:
            self.passthrough.released(handle.fidx)
        else:
            self.passthrough.released_plain(handle.fidx)
            self.versions.released(handle.fidx, handle.direct_io)
        try:
            await self._let_go(handle.entry, handle.fd)
        finally:
            self.fd_budget.give(handle.uid)  # once the descriptor is closed: it counts while a close hangs

"""The data path: every open, read, release and lend of a dataset file, and what the kernel caches of them.

It owns the open handles and everything tied to them: the handles that read through the kernel's page cache
(per file), the files whose kernel attributes and pages are another version's, the copies lent to direct
readers (leases), the read counters, and the descriptors the handles hold per user (a
:class:`~tierfs.users.FdBudget`: one user's opens cannot exhaust the daemon's descriptors).  The engine gives
it the parts it reads from (tree, cache, backing, revalidator, stager, pusher, schedule) and four things to
tell: a file was opened, and by whom (pass accounting), a file changed, a file needs staging again, the cache's
``data/`` is gone.

**Versions.**  A file changed in the backing dir has attributes and pages in the kernel that belong to the old
version, which handles opened before the change may still be reading through the page cache: they are
invalidated once no such handle is open (``_stale`` until then, see :meth:`DataPath.mark_stale`), and every
later handle of a changed file bypasses the page cache (``direct_io``): the kernel keeps one size and one
page cache per inode, not per open, so this is what makes each reader get exactly its own version, whole.
Until then the kernel is also *told* the old version's attributes (:meth:`DataPath.kernel_stat`): it asks
again whenever it likes (an ``fstat`` after any read), and a new size in the answer would cut or pad the old
version's page-cache reads at that size.

**Never waits on the slow tier for the fast one.**  An open of a cached file whose fingerprint is fresh (see
revalidate.py) makes no backing call; the copy is opened and checked (size, inode, ctime, mtime) with one
local ``open`` + ``fstat``; a damaged copy is a cache miss (:meth:`DataPath.repair`).  Backing calls go through
:class:`~tierfs.backing.Backing` with ``backing_timeout``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from tierfs.backing import Backing, BackingError, answered_gone
from tierfs.cache import CacheEntry, CacheStore
from tierfs.consumers import ANONYMOUS
from tierfs.copies import CopyDamaged, hash_copy, open_copy
from tierfs.options import Settings
from tierfs.plans import BatchPlans
from tierfs.policy import ADVISE_WHOLE, CachePolicy
from tierfs.pusher import Pusher
from tierfs.revalidate import Revalidator
from tierfs.schedule import Schedule
from tierfs.staging import Stager
from tierfs.stats import DataPathStatistics, Reads
from tierfs.tree import Node, Tree, fingerprint
from tierfs.users import OWNER_UID, FdBudget
from tierfs.wakeup import Wakeup

__all__ = ["LEND_SECONDS", "DataPath", "FileHandle"]

log = logging.getLogger("tierfs")

LEND_SECONDS = 2.0  # a lent copy stays pinned this long: the reader opens it right after asking


@dataclass(eq=False)
class FileHandle:
    """One open dataset file: a descriptor of the cached copy (``entry``) or of the backing file, held for the
    user ``uid`` (counted in the data path's :class:`~tierfs.users.FdBudget`)."""

    fidx: int
    fd: int
    entry: CacheEntry | None
    keep_cache: bool
    direct_io: bool
    uid: int


def _pread_rest(fd: int, buf: bytearray, done: int, offset: int) -> int:
    """Fill ``buf[done:]`` from ``offset + done`` (blocking; in a worker thread); returns the bytes in ``buf``."""
    view = memoryview(buf)
    while done < len(buf):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class DataPath:
    """See the module docstring."""

    def __init__(self, *, tree: Tree, cache: CacheStore, cache_limiter: trio.CapacityLimiter, backing: Backing,
                 reval: Revalidator, stager: Stager, pusher: Pusher, schedule: Schedule, policy: CachePolicy,
                 settings: Callable[[], Settings], opened: Callable[[int, int, int, str], None],
                 changed: Callable[[int, os.stat_result], None], restage: Callable[[int], None],
                 data_dir_lost: Callable[[], Awaitable[str | None]]) -> None:
        self.tree = tree
        self.cache = cache
        self.cache_limiter = cache_limiter
        self.backing = backing
        self.reval = reval
        self.stager = stager
        self.pusher = pusher
        self.schedule = schedule
        self.policy = policy
        self.kernel = pusher.kernel
        self._settings = settings
        self._opened_cb = opened
        self._on_changed = changed
        self._on_restage = restage
        self._on_data_dir_lost = data_dir_lost
        self.nursery: trio.Nursery | None = None  # set while the mount runs: background invalidations
        self.changed_files: set[int] = set()  # files whose backing fingerprint changed during this mount
        self._stale: set[int] = set()
        self._page_handles: dict[int, int] = {}  # fidx -> open handles that read through the page cache
        self._page_stat: dict[int, os.stat_result] = {}  # fidx -> the version those handles read (kernel_stat)
        self._invalidating: dict[int, trio.Event] = {}  # invalidations on their way to the kernel
        self._leases: deque[tuple[float, CacheEntry]] = deque()  # (deadline, copy) pinned by lend, in time order
        self._lease_wake = Wakeup()
        self._lent_recently: dict[int, tuple[float, CacheEntry]] = {}  # fidx -> (until, copy) just lent
        self._repair_logged: set[str] = set()
        self.hits = self.misses = self.out_of_view = self.lent = 0
        self.served_bytes = 0  # returned by the daemon; page-cache hits never reach it
        self.opened_bytes = 0  # sizes of dataset files opened: what loaders consume
        self.stall_seconds = 0.0
        self.handles = 0  # dataset files open now
        self.fd_budget = FdBudget()  # the descriptors those handles hold, per user
        #: batch plans for direct readers (plans.py), their copies pinned until their pass ends
        self.batch = BatchPlans(tree=tree, cache=cache, backing=backing, reval=reval, schedule=schedule,
                                settings=settings, timeout=self._timeout, return_leases=self._return_leases,
                                served=self.served_from_copies, freed=stager.notify)

    @property
    def settings(self) -> Settings:
        return self._settings()

    def _opened(self, fidx: int, size: int, uid: int, who: str = ANONYMOUS) -> None:
        self.stager.serving()  # staging yields to readers
        self.opened_bytes += size
        view = self.schedule.view
        if view is None or not view.mask[fidx]:
            self.out_of_view += 1
        self._opened_cb(fidx, size, uid, who)

    def statistics(self) -> DataPathStatistics:
        plans = self.batch.statistics()
        return DataPathStatistics(Reads(self.hits, self.misses, self.out_of_view, self.lent, plans.reported),
                                  self.served_bytes, self.opened_bytes, self.stall_seconds,
                                  self.handles, plans, self.fd_budget.statistics())

    def kernel_stat(self, fidx: int) -> os.stat_result:
        """The attributes the kernel is given for ``fidx``: those of the version its page-cache handles read while
        any is open, else the tree's.  (A file found changed keeps its old size for the kernel until its last
        page-cache reader closes: the kernel cuts page-cache reads at the size it was last told.)"""
        st = self._page_stat.get(fidx)
        return self.tree.file_node(fidx).st if st is None else st

    @property
    def versions_held(self) -> bool:
        """Whether some file's kernel attributes are held at an older version (see :meth:`kernel_stat`)."""
        return bool(self._page_stat)

    def kernel_attributes(self, fidx: int, attrs: tuple[int, ...]) -> tuple[int, ...]:
        """``attrs`` (mode, nlink, uid, gid, rdev, size, blocks, mtime_ns, ctime_ns, as the tree has them) as the
        kernel must be told them: size, blocks and times of :meth:`kernel_stat`'s version."""
        st = self._page_stat.get(fidx)
        if st is None:
            return attrs
        return (*attrs[:5], st.st_size, st.st_blocks, st.st_mtime_ns, st.st_ctime_ns)

    def mark_stale(self, fidx: int) -> None:
        """The kernel's attributes and pages of ``fidx`` are another version's: drop them as soon as no handle
        reading through the page cache is open (now, from the kernel's thread, or on that handle's release)."""
        self._stale.add(fidx)
        if not self._page_handles.get(fidx) and self.nursery is not None and self.kernel.live \
                and fidx not in self._invalidating:
            self._stale.discard(fidx)
            self._invalidating[fidx] = trio.Event()
            self.nursery.start_soon(self._invalidate, fidx)

    async def _invalidate(self, fidx: int) -> None:
        try:
            await self.pusher.wait_landed(fidx)  # a push of the old bytes in flight lands first, then goes
            await self.kernel.invalidate(self.tree.inode_of(fidx))
        finally:
            self._invalidating.pop(fidx).set()

    async def repair(self, entry: CacheEntry, reason: str) -> None:
        """A copy was found damaged or missing: a cache miss, counted and logged; stage it again."""
        if self.cache.repair(entry):
            self.log_repair(entry.name, f"cache repair: {reason}")
            self.pusher.forget(entry.fidx)
            self._on_restage(entry.fidx)
        if await trio.to_thread.run_sync(self.cache.data_dir_lost, limiter=self.cache_limiter):
            await self._on_data_dir_lost()

    def log_repair(self, key: str, message: str) -> None:
        if key not in self._repair_logged:  # once per event
            self._repair_logged.add(key)
            log.warning("tierfs: %s", message)

    def _timeout(self) -> float | None:
        t = self.settings.backing_timeout
        return None if t == "hard" else float(t)

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
            if self.cache.unpin(entry):
                self.stager.notify()
            raise

    def release_copy(self, entry: CacheEntry, fd: int) -> None:
        os.close(fd)  # a local file opened read-only: closing never waits on the disk
        if self.cache.unpin(entry):
            self.stager.notify()

    async def _confirm(self, fidx: int) -> os.stat_result | None:
        """Ask the backing for ``fidx``'s stat before an open uses a fingerprint older than ``revalidate``.

        Returns the new stat if the file changed (the tree is updated, the old copy dropped); None if it did
        not, or if the backing could not say (stalled, lost, an error other than "gone") while a copy is there to
        serve: a copy is dropped only on the backing's answer that the file changed or is gone."""
        node = self.tree.file_node(fidx)
        self.reval.open_checks += 1  # (the revalidator's counters; only the engine knows when an open asks)
        try:
            st = await self.backing.stat(node.path, timeout=self._timeout())
        except OSError as exc:
            err = await self.backing.error_for(exc, node.path, timeout=self._timeout())
            if answered_gone(exc):  # (the file, or its directory or the whole dataset, is not there)
                self.cache.evict(fidx)
                raise err from None
            if self.cache.get(fidx) is not None:
                self.reval.unconfirmed += 1  # the copy is whole, and the last word we had
                return None
            raise err from None
        if not stat.S_ISREG(st.st_mode):
            self.cache.evict(fidx)
            raise BackingError(errno.ENOENT, "no longer a regular file in the backing dir")
        self.reval.confirm(fidx)
        if fingerprint(st) == fingerprint(node.st):
            return None
        await self.pusher.wait_landed(fidx)  # its old bytes must land before the invalidation, never after
        self._on_changed(fidx, st)
        return st

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
        if not self.reval.fresh(fidx) and self.cache.get(fidx) is not None:
            # (an uncached file needs no separate check: its copy, or its backing open, compares fingerprints)
            await self._confirm(fidx)
        node = self.tree.file_node(fidx)
        entry = self.cache.get(fidx)
        was_cached = entry is not None
        if entry is None and self.policy.copies_beside(node.st.st_size) and self.nursery is not None:
            # Served from the backing file at once while the copy is made beside it; later opens find the copy.
            self.nursery.start_soon(self._fetch_beside, fidx)
        elif entry is None and self.policy.fetches_on_open(fidx):
            entry = await self._fetch(fidx)
        fd = None
        if entry is not None and self.settings.verify == "xxhash" and not entry.verified:
            entry = await self._verify(entry)
        if entry is not None:
            fd = await self.open_copy(entry)
        if fd is not None:
            assert entry is not None
            self.cache.touch(entry)
            if was_cached:
                self.hits += 1
            else:
                self.misses += 1  # fetched on demand: the reader waited on the backing dir
            size = entry.size
        else:
            entry = None
            fd, size = await self._open_backing(fidx, node)
            self.misses += 1
        direct = fidx in self.changed_files
        pending = self._invalidating.get(fidx)
        if pending is not None:
            await pending.wait()  # the old version's attributes and pages go before this reply does
        if fidx in self._stale and not self._page_handles.get(fidx):
            # nobody reads the old version through the page cache any more: drop it before this reply goes out
            self._stale.discard(fidx)
            await self.kernel.invalidate(self.tree.inode_of(fidx))
        if not direct:
            if fidx not in self._page_handles:
                # (never found changed, so the tree's stat is this handle's version, and every other one's)
                self._page_stat[fidx] = self.tree.file_node(fidx).st
            self._page_handles[fidx] = self._page_handles.get(fidx, 0) + 1
        # (a changed file can change again between this open and its reads, and the kernel keeps one size and
        # one page cache per inode, not per open: direct_io makes this handle's reads end where its version ends)
        handle = FileHandle(fidx, fd, entry, keep_cache=not direct, direct_io=direct, uid=uid)
        self.handles += 1
        if entry is not None and entry.size <= ADVISE_WHOLE:
            # Start reading a small copy into the page cache now, while the open's reply travels: the read that
            # follows then mostly finds it there and needs no thread hop (big files get the kernel's read-ahead).
            # WILLNEED on a local copy only queues read-ahead on the fast tier and returns: never the backing.
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, entry.size, os.POSIX_FADV_WILLNEED)
        self._opened(fidx, size, uid, who)
        return handle

    async def _open_backing(self, fidx: int, node: Node) -> tuple[int, int]:
        t0 = time.monotonic()
        try:
            fd, st = await self.backing.open(node.path, timeout=self._timeout())
        except OSError as exc:
            raise await self.backing.error_for(exc, node.path, timeout=self._timeout()) from None
        finally:
            self.stall_seconds += time.monotonic() - t0
        if fingerprint(st) != fingerprint(node.st):
            self._on_changed(fidx, st)
            self.reval.confirm(fidx)
        return fd, st.st_size

    async def _fetch(self, fidx: int) -> CacheEntry | None:
        t0 = time.monotonic()
        try:
            entry = await self.stager.fetch_now(fidx)
        finally:
            self.stall_seconds += time.monotonic() - t0
        if entry is not None and entry.fp != fingerprint(self.tree.file_node(fidx).st):
            return None
        return entry

    async def _fetch_beside(self, fidx: int) -> None:
        """Copy a miss into the cache while its reader is served from the backing (a background task: a
        failure is the stager's to report, never the mount's end)."""
        try:
            await self.stager.fetch_now(fidx)
        except Exception:  # (OSErrors are handled by the stager; anything else is a bug, logged)
            log.exception("tierfs: copying %s in the background failed", os.fsdecode(self.tree.file_path(fidx)))

    async def _verify(self, entry: CacheEntry) -> CacheEntry | None:
        """``verify=xxhash``: hash the copy once before its first use and compare with the staging hash."""
        self.cache.pin(entry)  # kept on disk while hashed
        try:
            ok = entry.digest is not None and await trio.to_thread.run_sync(
                hash_copy, self.cache.data_fd, entry.name, limiter=self.cache_limiter) == entry.digest
        except OSError:
            ok = False
        finally:
            if self.cache.unpin(entry):
                self.stager.notify()
        if ok:
            entry.verified = True
            return entry
        self.stager.error = f"cached copy of {os.fsdecode(self.tree.file_path(entry.fidx))} failed xxhash check"
        await self.repair(entry, self.stager.error)
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
        self._return_leases()
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
        if entry is None or (self.settings.verify == "xxhash" and not entry.verified):
            return None
        fd = await self.open_copy(entry)  # the copy is what was committed (and pinned from here on)
        if fd is None:
            return None
        os.close(fd)
        self.cache.touch(entry)
        now = time.monotonic()
        self._leases.append((now + LEND_SECONDS, entry))
        if len(self._leases) == 1:
            self._lease_wake.notify()
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

    def _return_leases(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        freed = False
        while self._leases and self._leases[0][0] <= now:
            freed |= self.cache.unpin(self._leases.popleft()[1])
        if freed:
            self.stager.notify()

    async def lease_keeper(self) -> None:
        """Unpin lent copies when their time is up, also when no further ``lend`` comes to do it."""
        while True:
            if not self._leases:
                await self._lease_wake.wait()
                continue
            await trio.sleep(max(0.0, self._leases[0][0] - time.monotonic()))
            self._return_leases()

    async def read(self, handle: FileHandle, offset: int, size: int) -> bytes | bytearray:
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
                n = await trio.to_thread.run_sync(_pread_rest, handle.fd, data, n, offset, limiter=self.cache_limiter)
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
            data = await self.backing.pread(handle.fd, size, offset, timeout=self._timeout(),
                                            file=self.tree.file_path(handle.fidx))
        except OSError as exc:
            raise BackingError(errno.EIO, f"backing read failed: {exc.strerror or exc}") from None
        finally:
            self.stall_seconds += time.monotonic() - t0
        self.served_bytes += len(data)
        return data

    async def _handle_to_backing(self, handle: FileHandle) -> None:
        entry = handle.entry
        assert entry is not None
        fd, _ = await self._open_backing(handle.fidx, self.tree.file_node(handle.fidx))
        if fingerprint(self.tree.file_node(handle.fidx).st) != entry.fp:
            os.close(fd)
            raise BackingError(errno.EIO, "the file changed in the backing dir and its cached copy was damaged")
        self.release_copy(entry, handle.fd)
        handle.fd, handle.entry = fd, None

    async def release(self, handle: FileHandle) -> None:
        self.handles -= 1
        if not handle.direct_io:
            left = self._page_handles[handle.fidx] - 1
            if left:
                self._page_handles[handle.fidx] = left
            else:
                del self._page_handles[handle.fidx]
                del self._page_stat[handle.fidx]
                if handle.fidx in self._stale:
                    self.mark_stale(handle.fidx)
        try:
            if handle.entry is not None:
                self.release_copy(handle.entry, handle.fd)
            else:
                await self.backing.close(handle.fd)  # (a backing thread: a network filesystem may ask its server)
        finally:
            self.fd_budget.give(handle.uid)  # once the descriptor is closed: it counts while a close hangs

"""The kernel's caches of the mount: page-cache pushes of staged copies, invalidations (of pages, attributes and
entries) off the trio thread, and which version of each file the kernel holds.

**Never from the trio thread.**  ``notify_store`` and ``invalidate_inode`` lock the kernel's pages of an inode;
a page may be locked by a READ of that file that waits for this daemon, and only the trio thread can answer
it.  Called on the trio thread, either call deadlocks the whole mount (issue 11, A).  So :class:`KernelCache`
makes every such call in one worker thread of its own: one at a time and in the order asked, so the bytes of
an old push always land before the invalidation that follows them.

**Closed before the main loop stops.**  For the same reason a call in flight at shutdown returns only while the
trio thread still answers READs: ended first, the call stays in the kernel for good, and its reference to
``/dev/fuse`` keeps the connection (and every reader waiting on it) alive after the unmount.  So the mount
stops by :meth:`KernelCache.close` -- no new call, and a wait for the one in flight -- while it still serves.

:class:`Pusher` (a background task, started in the engine's nursery) pushes the staged copies of the current
and next mini-epochs into the page cache, so a first pass over a mini-epoch is served like a repeated one (no
READ requests): current mini-epoch first (what a switch left unpushed), then the next as its copies land, at
most ``budget`` bytes of the two.  The kernel must know the inode (from a lookup or a listing); a file it does
not know waits for its next lookup (:meth:`Pusher.looked_up`) or its directory's next listing
(:meth:`Pusher.listed`).

**Versions** (:class:`KernelVersions`, the pusher's).  A file changed in the backing dir has attributes and
pages in the kernel that belong to the old version, which handles opened before the change may still be
reading through the page cache: they are invalidated once no such handle is open (``_stale`` until then, see
:meth:`KernelVersions.mark_stale`), and every later handle of a changed file bypasses the page cache
(``direct_io``; nor is it pushed again): the kernel keeps one size and one page cache per inode, not per open,
so this is what makes each reader get exactly its own version, whole.  Until then the kernel is also *told* the
old version's attributes (:meth:`KernelVersions.kernel_stat`): it asks again whenever it likes (an ``fstat``
after any read), and a new size in the answer would cut or pad the old version's page-cache reads at that size.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import trio

from tierfs.daemon.cache.copy_check import CopyDamaged, open_copy
from tierfs.daemon.cache.store import CacheEntry, CacheStore
from tierfs.daemon.kernel.passthrough import BackingIds
from tierfs.daemon.runtime.jobs import Background
from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.runtime.wakeup import Wakeup
from tierfs.daemon.schedule.schedule import Schedule
from tierfs.daemon.staging.filequeue import FileQueue
from tierfs.daemon.tree.tree import Attributes, Tree

__all__ = ["KernelCache", "KernelCalls", "KernelVersions", "Pusher", "PusherEvents", "PusherStatistics",
           "push_budget"]

log = logging.getLogger("tierfs")

_PUSH_CHUNK = 1 << 20  # bytes per notify_store message
_PUSH_BUDGET_MAX = 1 << 30
_PUSH_BATCH_FILES = 32  # files per worker-thread hop
_DROP_BATCH = 256  # kernel entries dropped per worker-thread hop
#: A push of a file the kernel was just told about (its lookup or listing is answered in the same handler that
#: tells the pusher, before the kernel has read the reply and made the inode) may still find no inode: it is
#: tried again this much later, up to _LEARN_TRIES times, before it waits for the next lookup or listing.
_LEARN_DELAY = 0.02
_LEARN_TRIES = 25


def push_budget() -> int:
    """Bytes of the current and next mini-epochs that may be pushed into the kernel page cache: 10 % of RAM,
    at most 1 GiB.  (A first pass would put the same pages there; pushing only moves that ahead of the reader.)"""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 0
    return min(_PUSH_BUDGET_MAX, ram // 10)


class KernelCalls(Protocol):
    """The calls into the kernel's caches: the ``pyfuse3`` module itself has them."""

    def notify_store(self, inode: int, offset: int, data: bytes) -> None:
        """Put ``data`` into the page cache of ``inode`` at ``offset``."""

    def invalidate_inode(self, inode: int, attr_only: bool = False) -> None:
        """Make the kernel forget the inode's attributes (and pages, unless ``attr_only``)."""

    def invalidate_entry(self, inode_p: int, name: bytes) -> None:
        """Make the kernel drop its entry ``name`` of directory ``inode_p`` (its next open looks it up)."""


class KernelCache:
    """The kernel side of the mount, reached from one worker thread only (see the module docstring).

    ``calls``: pyfuse3 (``notify_store``, ``invalidate_inode``, ``invalidate_entry``); None (engine tests without
    a mount): nothing to notify."""

    def __init__(self, calls: KernelCalls | None = None) -> None:
        #: pushes go to this (None once the kernel said it cannot: ENOSYS)
        self.store: Callable[[int, int, bytes], None] | None = calls.notify_store if calls is not None else None
        self._invalidate = calls.invalidate_inode if calls is not None else None
        self._drop_entry = calls.invalidate_entry if calls is not None else None
        self.limiter = trio.CapacityLimiter(1)
        self.invalidations = 0
        self.closed = False  # read by the worker thread too: a bool, atomic under the GIL
        self._in_kernel = 0  # calls now inside the kernel (counted by the worker thread itself)

    @property
    def live(self) -> bool:
        return self._invalidate is not None

    @property
    def in_kernel(self) -> bool:
        """A call is inside the kernel now (one abandoned by a cancelled caller included)."""
        return self._in_kernel > 0

    async def invalidate(self, inode: int, *, attr_only: bool = False) -> None:
        """Make the kernel forget the inode's attributes (and pages, unless ``attr_only``); waits until it did.
        Nothing once closed (the kernel's caches go with the connection)."""
        if self._invalidate is None or self.closed:
            return
        self.invalidations += 1
        await in_thread(self._invalidate_now, inode, attr_only, limiter=self.limiter,
                        abandon_on_cancel=True)

    async def drop_entries(self, entries: list[tuple[int, bytes]]) -> int:
        """Make the kernel drop its entries (directory inode, name), _DROP_BATCH per hop to the thread (pushes
        go on between them); how many it had.  A drop waits for the directory's lookups in flight, never for
        the caller: nothing once closed."""
        dropped = 0
        for lo in range(0, len(entries), _DROP_BATCH):
            if self._drop_entry is None or self.closed:
                break
            dropped += await in_thread(self._drop_now, entries[lo:lo + _DROP_BATCH],
                                       limiter=self.limiter, abandon_on_cancel=True)
        return dropped

    async def store_files(self, data_fd: int, jobs: list[tuple[str, int, tuple[int, int], int]]) -> list[int | str]:
        """Push cached copies' bytes into the page cache; ``jobs``: (copy name in ``data_fd``, size, copy id,
        inode).  Per job the bytes pushed, ``-errno`` (``-ENOENT``: the kernel has no inode for it; the copy
        was not even opened; ``-ESHUTDOWN``: closed), or the reason the copy is damaged
        (:class:`~tierfs.daemon.cache.copy_check.CopyDamaged`)."""
        assert self.store is not None
        if self.closed:
            return [-errno.ESHUTDOWN] * len(jobs)
        return await in_thread(_store_files, self._store_now, data_fd, jobs, limiter=self.limiter,
                               abandon_on_cancel=True)

    async def close(self, timeout: float) -> bool:
        """No call from now on, and wait up to ``timeout`` seconds for the one in flight to come back (the
        main loop must still serve meanwhile).  False when one is still inside the kernel."""
        self.closed = True
        with trio.move_on_after(timeout):
            # the worker thread gives its token back only when its call returned, abandoned or not; the calls
            # queued before this one find ``closed`` set and return at once
            await self.limiter.acquire_on_behalf_of(self)
            return True
        return not self.in_kernel

    @contextlib.contextmanager
    def _inside(self) -> Iterator[None]:
        """Around each call into the kernel, in the worker thread (only this thread writes the counter: one
        worker at a time)."""
        self._in_kernel += 1
        try:
            yield
        finally:
            self._in_kernel -= 1

    def _store_now(self, inode: int, offset: int, data: bytes) -> None:
        if self.closed:  # between the messages of a batch: stop there
            raise OSError(errno.ESHUTDOWN, "the mount is stopping")
        assert self.store is not None
        with self._inside():
            self.store(inode, offset, data)

    def _drop_now(self, entries: list[tuple[int, bytes]]) -> int:
        assert self._drop_entry is not None
        dropped = 0
        for inode_p, name in entries:
            if self.closed:
                break
            with self._inside(), contextlib.suppress(OSError):  # ENOENT: no such entry (never made, or dropped)
                self._drop_entry(inode_p, name)
                dropped += 1
        return dropped

    def _invalidate_now(self, inode: int, attr_only: bool) -> None:
        if self.closed:
            return
        assert self._invalidate is not None
        with self._inside(), contextlib.suppress(OSError):  # ENOENT: the kernel never saw this inode
            self._invalidate(inode, attr_only)


def _store_files(store: Callable[[int, int, bytes], None], data_fd: int,
                 jobs: list[tuple[str, int, tuple[int, int], int]]) -> list[int | str]:
    out: list[int | str] = []
    for name, size, copy_id, inode in jobs:
        try:
            store(inode, 0, b"")  # a probe: fails at once, before any open or read, when the kernel lacks the inode
            fd = open_copy(data_fd, name, size, copy_id)
        except CopyDamaged as exc:
            out.append(str(exc))
            continue
        except OSError as exc:
            out.append(-(exc.errno or errno.EIO))
            continue
        try:
            off = 0
            while off < size:
                data = os.pread(fd, min(_PUSH_CHUNK, size - off), off)
                if not data:
                    break
                store(inode, off, data)
                off += len(data)
            out.append(off)
        except OSError as exc:
            out.append(-(exc.errno or errno.EIO))
        finally:
            os.close(fd)
    return out


@dataclass(frozen=True)
class PusherStatistics:
    pushed_bytes: int
    window_bytes: int
    budget: int
    queued: int
    waiting_for_inode: int  # staged copies the kernel has no inode for yet (pushed on lookup or listing)


class PusherEvents(Protocol):
    """What the pusher tells the engine (the engine implements it)."""

    async def copy_damaged(self, entry: CacheEntry, reason: str) -> None:
        """A copy the kernel thread opened failed its check: repair it (a cache miss; staged again)."""


class Pusher:
    """See the module docstring.  A file is pushed while the ``schedule`` wants it (current or next mini-epoch)
    and it never changed in this mount (:class:`KernelVersions`, owned here: ``versions``); a copy the kernel reads
    itself (``passthrough``) is not pushed; a damaged copy goes to ``events``.  Copies are pinned here (on the trio
    thread) while the kernel thread opens, checks, pushes and closes them."""

    def __init__(self, tree: Tree, cache: CacheStore, kernel: KernelCache, *, schedule: Schedule,
                 passthrough: BackingIds, budget: int, verify: bool, events: PusherEvents) -> None:
        self.tree = tree
        self.cache = cache
        self.kernel = kernel
        self.schedule = schedule
        self.budget = budget
        self.verify = verify
        self.events = events
        self.versions = KernelVersions(tree, self)
        self.passthrough = passthrough
        self.pushed_bytes = 0
        self.pushed: set[int] = set()  # files of the current/next mini-epoch whose bytes were pushed
        self.window = 0  # their bytes, held under budget
        self.queue = FileQueue()
        self.unknown: dict[int, set[int]] = {}  # dir node -> files whose inode the kernel lacked
        self.inflight: dict[int, trio.Event] = {}
        self._known_meanwhile: set[int] = set()  # looked up or listed since their push was queued again
        self._later: deque[tuple[float, int]] = deque()  # (when, file): pushes to try again (_LEARN_DELAY)
        self._tries: dict[int, int] = {}  # file -> pushes that found no inode although the kernel was told of it
        self._wake = Wakeup()

    def attach(self, kernel: KernelCache) -> None:
        """The mount is up: pushes and invalidations go to its kernel from now on."""
        self.kernel = kernel

    @property
    def enabled(self) -> bool:
        """Whether pushes reach the kernel."""
        return self.kernel.store is not None

    def _wanted(self, fidx: int) -> bool:
        return bool(self.schedule.wanted[fidx]) and fidx not in self.versions.changed_files

    def reset(self, files: np.ndarray, wanted_now: np.ndarray | None) -> None:
        """A new current mini-epoch: push what ``files`` (current, then next) still lack; what was pushed stays
        counted only where ``wanted_now`` (a mask per file) says.  Masks, not a lookup per file: a switch of a
        big tree hands over millions, on the trio thread."""
        if wanted_now is not None:
            self.pushed = {f for f in self.pushed if wanted_now[f]}
        self.window = sum(int(self.tree.sizes[f]) for f in self.pushed)
        self.unknown = {}
        have = files[self.cache.cached(files)]
        if self.pushed:
            have = have[~np.isin(have, np.fromiter(self.pushed, np.int64, len(self.pushed)))]
        self.queue = FileQueue(have)
        self._later.clear()  # (every file still wanted is queued again)
        self._tries.clear()
        self.wake()

    def want(self, fidx: int) -> None:
        """A copy of a wanted file landed."""
        if self.enabled and fidx not in self.pushed:
            self.queue.append(fidx)
            self.wake()

    def forget(self, fidx: int) -> None:
        """``fidx``'s backing file changed: its pushed bytes are stale (the engine invalidates them)."""
        if fidx in self.pushed:
            self.pushed.discard(fidx)
            self.window -= int(self.tree.sizes[fidx])

    def holds(self, fidx: int) -> bool:
        """Whether the kernel was given ``fidx``'s bytes (checked, of its copy now): its reads stay in the mount's
        page cache unless the kernel let the inode go since (then they reach the daemon, as any read does)."""
        return fidx in self.pushed

    def wake(self) -> None:
        self._wake.notify()

    async def wait_landed(self, fidx: int) -> None:
        """Wait until a push of ``fidx`` in flight has landed (its old bytes must land before an invalidation)."""
        ev = self.inflight.get(fidx)
        if ev is not None:
            await ev.wait()

    def looked_up(self, dir_node: int, fidx: int) -> None:
        """The kernel now has an inode for this file: push it if an earlier push found none."""
        if self.unknown or self.inflight:
            self._kernel_learnt(dir_node, {fidx})

    def listed(self, dir_node: int, shown: Callable[[int], bool]) -> None:
        """The kernel got the entries (and so the inodes) of this directory: push what it lacked an inode for;
        ``shown(fidx)``: the listing showed it (the others' inodes are still unknown to the kernel)."""
        if not (self.unknown or self.inflight):
            return
        candidates = self.unknown.get(dir_node, set()) | self.inflight.keys()
        files = {f for f in candidates if shown(f) and int(self.tree.groups[f]) == dir_node}
        if files:
            self._kernel_learnt(dir_node, files)

    def _kernel_learnt(self, dir_node: int, files: set[int]) -> None:
        # A push still travelling, or one queued now, may come back -ENOENT although the kernel has been told of
        # the inode (the reply that tells it is not read yet): remember, so that it is tried again.
        self._known_meanwhile |= files & self.inflight.keys()
        waiting = self.unknown.get(dir_node)
        if waiting and files & waiting:
            found = files & waiting
            waiting -= found
            self._known_meanwhile |= found
            self.queue.extendleft(found)
            self.wake()

    def _take_batch(self) -> list[tuple[int, CacheEntry]]:
        batch: list[tuple[int, CacheEntry]] = []
        taken: set[int] = set()
        size = 0
        while self.queue and self.enabled and len(batch) < _PUSH_BATCH_FILES and size < _PUSH_CHUNK * 8:
            fidx = self.queue.popleft()
            entry = self.cache.get(fidx)
            if (entry is None or fidx in self.pushed or fidx in self.inflight or fidx in taken
                    or not self._wanted(fidx)
                    or entry.doomed or self.window + size + entry.size > self.budget
                    or (self.passthrough.on and self.passthrough.serves(entry))
                    or (self.verify and not entry.verified)):  # only checked bytes
                continue
            batch.append((fidx, entry))
            taken.add(fidx)
            size += entry.size
        return batch

    async def run(self) -> None:
        while True:
            now = trio.current_time()
            while self._later and self._later[0][0] <= now:
                self.queue.append(self._later.popleft()[1])
            batch = self._take_batch()
            if not batch:
                with trio.move_on_at(self._later[0][0] if self._later else math.inf):
                    await self._wake.wait()
                continue
            for fidx, entry in batch:
                self.inflight[fidx] = trio.Event()
                self.cache.pin(entry)  # on disk until its bytes were pushed
            try:
                jobs = [(entry.name, entry.size, entry.copy_id, self.tree.inode_of(fidx)) for fidx, entry in batch]
                results = await self.kernel.store_files(self.cache.data_fd, jobs)
            finally:
                for fidx, entry in batch:
                    self.inflight.pop(fidx).set()
                    self.cache.unpin(entry)  # (space it frees: the cache tells the stager)
            for (fidx, entry), n in zip(batch, results, strict=True):
                if isinstance(n, str):
                    await self.events.copy_damaged(entry, n)
                else:
                    self._landed(fidx, entry, n)

    def _landed(self, fidx: int, entry: CacheEntry, n: int) -> None:
        known_meanwhile = fidx in self._known_meanwhile
        self._known_meanwhile.discard(fidx)
        tries = self._tries.pop(fidx, 0)
        if self.cache.get(fidx) is not entry or not self.tree.holds(fidx, entry.fp):
            return  # the backing changed (or the copy went) while its bytes travelled: the engine invalidated
        if n == -errno.ENOENT:
            if known_meanwhile and tries < _LEARN_TRIES:  # the kernel was told of the inode: soon it has it
                self._tries[fidx] = tries + 1
                self._known_meanwhile.add(fidx)
                self._later.append((trio.current_time() + _LEARN_DELAY, fidx))
                self.wake()
            else:
                self.unknown.setdefault(int(self.tree.groups[fidx]), set()).add(fidx)
        elif n == -errno.ENOSYS:
            self.kernel.store = None  # the kernel cannot: stop trying
        elif n < 0:
            log.debug("notify_store of %s: %s", os.fsdecode(self.tree.file_path(fidx)), os.strerror(-n))
        else:
            self.pushed_bytes += n
            if self._wanted(fidx):
                self.pushed.add(fidx)
                self.window += entry.size

    def statistics(self) -> PusherStatistics:
        return PusherStatistics(self.pushed_bytes, self.window, self.budget, len(self.queue),
                                sum(len(v) for v in self.unknown.values()))


class KernelVersions:
    """Which version of each file the kernel holds attributes and pages of (see "Versions" in the module
    docstring): the files changed in this mount, those whose old version's pages are still to be invalidated,
    and the handles reading through the page cache with the version they read.  The pusher's (``versions``):
    an invalidation waits for a push of the old bytes in flight, which must land first."""

    def __init__(self, tree: Tree, pusher: Pusher) -> None:
        self.tree = tree
        self.pusher = pusher  # (its ``kernel`` is the mount's once it is up)
        self._tasks = Background()  # (run()) invalidations of old versions
        self.changed_files: set[int] = set()  # files whose backing fingerprint changed during this mount
        self._stale: set[int] = set()
        self._page_handles: dict[int, int] = {}  # fidx -> open handles that read through the page cache
        self._page_stat: dict[int, os.stat_result] = {}  # fidx -> the version those handles read (kernel_stat)
        self._invalidating: dict[int, trio.Event] = {}  # invalidations on their way to the kernel

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """For the life of the mount: the invalidations of old versions (without it, in engine tests, an old
        version is invalidated on its handle's release)."""
        await self._tasks.run(task_status=task_status)

    def kernel_stat(self, fidx: int) -> os.stat_result:
        """The attributes the kernel is given for ``fidx``: those of the version its page-cache handles read while
        any is open, else the tree's.  (A file found changed keeps its old size for the kernel until its last
        page-cache reader closes: the kernel cuts page-cache reads at the size it was last told.)"""
        st = self._page_stat.get(fidx)
        return self.tree.file_stat(fidx) if st is None else st

    @property
    def versions_held(self) -> bool:
        """Whether some file's kernel attributes are held at an older version (see :meth:`kernel_stat`)."""
        return bool(self._page_stat)

    def kernel_attributes(self, fidx: int, attrs: Attributes) -> Attributes:
        """``attrs`` (mode, nlink, uid, gid, rdev, size, blocks, mtime_ns, ctime_ns, as the tree has them) as the
        kernel must be told them: size, blocks and times of :meth:`kernel_stat`'s version."""
        st = self._page_stat.get(fidx)
        if st is None:
            return attrs
        return (*attrs[:5], st.st_size, st.st_blocks, st.st_mtime_ns, st.st_ctime_ns)

    def changed(self, fidx: int) -> None:
        """The backing file changed: its later handles bypass the page cache, and the old version goes."""
        self.changed_files.add(fidx)
        self.mark_stale(fidx)

    def mark_stale(self, fidx: int) -> None:
        """The kernel's attributes and pages of ``fidx`` are another version's: drop them as soon as no handle
        reading through the page cache is open (now, from the kernel's thread, or on that handle's release)."""
        self._stale.add(fidx)
        if not self._page_handles.get(fidx) and self._tasks.running and self.pusher.kernel.live \
                and fidx not in self._invalidating:
            self._stale.discard(fidx)
            self._invalidating[fidx] = trio.Event()
            self._tasks.start_soon(self._invalidate, fidx)

    async def _invalidate(self, fidx: int) -> None:
        try:
            await self.pusher.wait_landed(fidx)  # a push of the old bytes in flight lands first, then goes
            await self.pusher.kernel.invalidate(self.tree.inode_of(fidx))
        finally:
            self._invalidating.pop(fidx).set()

    async def opened(self, fidx: int) -> bool:
        """A handle of ``fidx`` is about to be answered: the old version's attributes and pages go first (if no
        page-cache reader holds them); True if it must bypass the page cache (``direct_io``: changed)."""
        direct = fidx in self.changed_files
        pending = self._invalidating.get(fidx)
        if pending is not None:
            await pending.wait()  # the old version's attributes and pages go before this reply does
        if fidx in self._stale and not self._page_handles.get(fidx):
            # nobody reads the old version through the page cache any more: drop it before this reply goes out
            self._stale.discard(fidx)
            await self.pusher.kernel.invalidate(self.tree.inode_of(fidx))
        if not direct:
            if fidx not in self._page_handles:
                # (never found changed, so the tree's stat is this handle's version, and every other one's)
                self._page_stat[fidx] = self.tree.file_stat(fidx)
            self._page_handles[fidx] = self._page_handles.get(fidx, 0) + 1
        return direct

    def released(self, fidx: int, direct: bool) -> None:
        """A handle of ``fidx`` was released (``direct``: it bypassed the page cache)."""
        if direct:
            return
        left = self._page_handles[fidx] - 1
        if left:
            self._page_handles[fidx] = left
        else:
            del self._page_handles[fidx]
            del self._page_stat[fidx]
            if fidx in self._stale:
                self.mark_stale(fidx)

"""The tiering engine: every decision of a tierfs mount, none of the FUSE plumbing.

The engine owns the backing tree (:mod:`tree`), the cache (:mod:`cache`), the plan of mini-epochs (from
:mod:`sampler.plan`), the view of the current pass (:mod:`view`), the staging task (:mod:`staging`) and the
position journal (:mod:`journal`).  Control-file writes are parsed and applied by :mod:`control` (settings,
commands, ``feedback`` to ARF) through the small interface below; ``status`` and ``metrics`` are a
:mod:`stats` snapshot of it.  ``fs.TierOperations`` only translates FUSE requests into calls on it, so tests
drive the engine without a mount.

Everything here runs on the one trio thread (FUSE handlers and staging tasks alike); worker threads only copy
and read bytes and hand results back.  So state needs no locks, and a status snapshot taken between two
awaits is consistent.

How a mount moves (policy ``met``):

* The position is (epoch, mini-epoch, pass).  The *current* mini-epoch is what the root shows (``view``
  ``mini-epoch``); the *next* one is staged meanwhile, in storage order, behind any file of the current one
  that is not cached yet (right after mount).
* A pass ends when every file of the view was opened since it began, on ``next-pass``, or when the root is
  listed again after at least one open.  After ``rf`` passes (``auto``: the smallest stall-free rf from the
  measured staging and consumption rates) the next mini-epoch takes over: with ``advance=ready`` only once it
  is fully cached (until then the current one is repeated), with ``strict`` at once.  ``advance`` (the
  command, or an ARF controller fed by ``feedback``) leaves as soon as the next one is cached.
* On a switch the previous mini-epoch is evicted, except open files, which go on their last release.
* An open of a file of the current mini-epoch that is not cached fetches it on demand (so each epoch reads the
  backing once); any other uncached file is read from the backing dir directly.

Policy ``lru`` has no plan: every open of an uncached file copies it in (read-through), evicting the least
recently used unopened copies to make room under the same cap.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import trio
import xxhash

from sampler.arf import auto_rf
from sampler.plan import min_mini_epochs, plan_epoch
from tierfs.cache import CacheEntry, CacheStore
from tierfs.control import Arf, apply_control
from tierfs.journal import Position, load_position, save_position
from tierfs.options import MountConfig, Settings, format_size
from tierfs.staging import BackingChanged, Stager, copy_into_cache
from tierfs.stats import Status, snapshot
from tierfs.tree import CONTROL_INODES, KIND_DIR, KIND_FILE, KIND_LINK, Node, Tree, fingerprint, open_beneath
from tierfs.view import View

__all__ = ["BackingError", "Engine", "FileHandle"]

log = logging.getLogger("tierfs")

_VANISHED = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV)
_ARF_HISTORY_KEPT = 1000
_ADVISE_WHOLE = 1 << 20  # cached copies up to this size are read ahead whole on open
_PUSH_CHUNK = 1 << 20  # bytes per notify_store message
_PUSH_BUDGET_MAX = 1 << 30
_PUSH_BATCH_FILES = 32  # files per worker-thread hop
LEND_SECONDS = 2.0  # a lent copy stays pinned this long: the reader opens it right after asking


def push_budget() -> int:
    """Bytes of the current and next mini-epochs that may be pushed into the kernel page cache: 10 % of RAM,
    at most 1 GiB.  (A first pass would put the same pages there; pushing only moves that ahead of the reader.)"""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 0
    return min(_PUSH_BUDGET_MAX, ram // 10)


def _store_files(store: Callable[[int, int, bytes], None], jobs: list[tuple[int, int, int]]) -> list[int]:
    """Push cached copies' bytes into the kernel page cache (worker thread).  ``jobs``: (fd, inode, size); per
    job, the bytes pushed, or ``-errno`` (``-ENOENT``: the kernel has no inode for it: never listed or looked up,
    or forgotten)."""
    out = []
    for fd, inode, size in jobs:
        try:
            store(inode, 0, b"")  # a probe: fails at once, before any read, when the kernel lacks the inode
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
    return out


class BackingError(OSError):
    """A dataset file cannot be served; ``errno`` is what the reader gets (ENOENT, EIO)."""


@dataclass(eq=False)
class FileHandle:
    """One open dataset file: a descriptor of the cached copy (``entry``) or of the backing file."""

    fidx: int
    fd: int
    entry: CacheEntry | None
    keep_cache: bool


def _pread_rest(fd: int, buf: bytearray, done: int, offset: int) -> int:
    """Fill ``buf[done:]`` from ``offset + done`` (blocking; in a worker thread); returns the bytes in ``buf``."""
    view = memoryview(buf)
    while done < len(buf):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class Engine:
    """See the module docstring.  ``mount.py``: ``open()``, then ``run()`` beside ``pyfuse3.main()``, ``close()``."""

    def __init__(self, config: MountConfig) -> None:
        self.config = config
        self.settings: Settings = config.settings
        self.cache = CacheStore(config.cache, config.capacity)
        self.tree: Tree = Tree([], np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), 0,
                               np.zeros(0, bool))
        self.root_fd = -1
        self.pos = Position()
        self.view: View | None = None
        self.changed = trio.Event()  # set (and replaced) whenever staging should look again
        self.last_error: str | None = None
        #: (epoch, mini_epoch) of the last completed pass: what a ``feedback`` line is about (see control.py)
        self.last_pass: tuple[int, int] | None = None
        #: Called with an inode whose kernel-cached attributes and data are stale (set by fs once mounted).
        self.invalidate_inode: Callable[[int], None] = lambda inode: None
        #: Stores bytes in the kernel page cache of an inode (``pyfuse3.notify_store``, set by fs once mounted;
        #: None: no kernel, nothing pushed).  Called from a worker thread only (see _pusher).
        self.store_pages: Callable[[int, int, bytes], None] | None = None
        self.push_budget = push_budget()
        self.pushed_bytes = 0  # counter: bytes pushed into the kernel page cache
        self._pushed: set[int] = set()  # files of the current/next mini-epoch whose bytes were pushed
        self._pushed_window = 0  # their bytes, held under push_budget
        self._push_queue: deque[int] = deque()
        self._push_unknown: dict[int, set[int]] = {}  # dir node -> files whose inode the kernel lacked
        self._push_inflight: dict[int, trio.Event] = {}
        self._known_while_pushed: set[int] = set()  # looked up or listed while their push was in flight
        self._push_wake = trio.Event()
        self._plans: dict[int, list[np.ndarray]] = {}
        self._cur = np.zeros(0, np.int64)
        self._cur_mask = np.zeros(0, bool)
        self.next_files = np.zeros(0, np.int64)
        self._next_coords = (0, 0)
        self._wanted = np.zeros(0, bool)
        self.pending_next: set[int] = set()
        self._queue: deque[int] = deque()
        self._inflight: dict[int, trio.Event] = {}
        self._failed: set[int] = set()
        self._read_mark = np.zeros(0, bool)
        self._unread = 0
        self._reads_in_pass = 0
        self._advance_requested = False
        self._blocked = False
        self.arf = Arf()  # the configured controller is made in open()
        self._bw_next = 0.0
        self._opened = False
        self._closed = False
        # counters
        self.hits = self.misses = self.out_of_view = 0
        self.lent = 0  # opens answered with the cached copy's path (lend), a subset of hits
        self._leases: deque[tuple[float, CacheEntry]] = deque()  # (deadline, copy) pinned by lend, in time order
        self._lease_wake = trio.Event()
        self.backing_bytes_read = 0
        self.served_bytes = 0  # returned by the daemon; page-cache hits never reach it
        self.opened_bytes = 0  # sizes of dataset files opened: what loaders consume
        self.stall_seconds = 0.0
        self._staged_bytes = 0
        self._staging_busy = 0.0
        self._staging_since: float | None = None
        self._pass_started: float | None = None
        self._pass_served = 0
        self._prev_pass: tuple[float, int] | None = None  # (first open, bytes opened) of the pass just ended
        self._consumption_measured = False
        self.consumption_bps = 0.0

    # ========================================================================================= lifecycle

    @property
    def fuse_options(self) -> set[str]:
        """FUSE mount options the engine needs beyond mount.py's own (fsname, subtype, allow_other): none."""
        return set()

    def open(self) -> None:
        """Scan the backing tree, refuse configurations that cannot work, open the cache, resume the position."""
        cfg = self.config
        backing = os.path.realpath(cfg.backing)
        cache = os.path.realpath(cfg.cache)
        mountpoint = os.path.realpath(cfg.mountpoint) if cfg.mountpoint else ""
        if not os.path.isdir(backing):
            raise ValueError(f"backing dir {cfg.backing} does not exist or is not a directory")
        for name, path in (("cache dir", cache), ("mountpoint", mountpoint)):
            if path and (path == backing or path.startswith(backing + os.sep)):
                raise ValueError(f"the {name} ({path}) must not be inside the backing dir ({backing})")
        if mountpoint and (cache == mountpoint or cache.startswith(mountpoint + os.sep)):
            raise ValueError(f"the cache dir ({cache}) must not be inside the mountpoint ({mountpoint})")
        self.root_fd = os.open(backing, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.tree = Tree.scan(self.root_fd)
            self._check_fits()
            self.cache.open(self.tree, need_digest=self.settings.verify == "xxhash")
        except BaseException:
            os.close(self.root_fd)
            self.root_fd = -1
            self.cache.close()
            raise
        n = self.tree.n_files
        self._read_mark = np.zeros(n, bool)
        pos = load_position(cfg.cache)
        if pos is not None:
            self.pos = pos
            self.last_pass = tuple(pos.last_pass) if pos.last_pass else None  # type: ignore[assignment]
        self.arf = Arf(Arf.controller_for(self.settings), self.pos.arf_history)
        if self.settings.policy == "lru":
            self._cur = np.arange(n, dtype=np.int64)
            self._cur_mask = np.ones(n, bool)
            self._wanted = np.zeros(n, bool)
            self._new_view()
        else:
            plan = self._plan(self.pos.epoch)
            if self.pos.mini_epoch >= len(plan) or not len(plan[self.pos.mini_epoch]):
                # the plan changed under the journal (other nm, or an empty share): go on from the next one
                e, m = self._coords_after(self.pos.epoch, min(self.pos.mini_epoch, len(plan)) - 1)
                self.pos.epoch, self.pos.mini_epoch, self.pos.pass_index = e, m, 0
            self._enter(self.pos.epoch, self.pos.mini_epoch)
            self._evict_unwanted()
        self._opened = True
        self.save_journal()
        log.info("tierfs: %d files, %s in the backing dir; %d copies kept in the cache",
                 n, format_size(int(self.tree.sizes.sum())), len(self.cache.entries))

    def _check_fits(self) -> None:
        cap = self.config.capacity
        sizes = self.tree.sizes
        if sizes.size and int(sizes.max()) * 2 > cap:
            i = int(np.argmax(sizes))
            raise ValueError(
                f"capacity must be at least 2 x the largest file ({os.fsdecode(self.tree.file_path(i))}: "
                f"{int(sizes[i])} bytes), got {cap} ({format_size(cap)})"
            )
        if self.settings.policy == "met":
            self._plan_for(self.settings, self.pos.epoch)  # raises ValueError with the reason

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Stage in the background until cancelled (the journal is written as the position moves)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._lease_keeper)
            if self.settings.policy == "lru":
                task_status.started()
                await trio.sleep_forever()
            nursery.start_soon(self._pusher)
            await Stager(self).run(task_status=task_status)

    def close(self) -> None:
        """Persist the journal and release the cache; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._opened:
            with contextlib.suppress(OSError):
                self.save_journal()
        self.cache.close()
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    # ============================================================================================= plans

    def _plan_for(self, settings: Settings, epoch: int, *, budget_only: bool = False) -> list[np.ndarray]:
        budget = self.config.capacity // 2
        nm: int | None = None if budget_only else settings.nm
        if settings.mini_epoch_size:
            budget, nm = min(budget, settings.mini_epoch_size), None
        groups = self.tree.groups if settings.composition == "stratified" else None
        args = dict(seed=settings.seed, epoch=epoch, composition=settings.composition, groups=groups,
                    rank=settings.rank, world_size=settings.world_size)
        try:
            return plan_epoch(self.tree.sizes, nm=nm, budget=budget, **args)
        except ValueError as exc:
            total = int(self.tree.sizes.sum())
            biggest = int(self.tree.sizes.max(initial=0))
            if nm is not None and total <= (budget + biggest) * nm * settings.world_size:
                # On average a mini-epoch fits half the cache (within a file), but no cut keeps every one under
                # it.  Take the balanced cut: the stager never passes the cap, and a mini-epoch a little over
                # half is finished after the switch (see next_ready).
                return plan_epoch(self.tree.sizes, nm=nm, **args)
            try:
                need = min_mini_epochs(self.tree.sizes, budget=budget, seed=settings.seed, epoch=epoch,
                                       composition=settings.composition, groups=groups,
                                       world_size=settings.world_size)
            except ValueError:
                need = -(-total // max(1, budget * settings.world_size))
            what = f"nm={nm}" if nm is not None else f"mini_epoch_size={settings.mini_epoch_size}"
            per = -(-total // ((nm or need) * settings.world_size))
            raise ValueError(
                f"{what} does not fit capacity={format_size(self.config.capacity)}: a mini-epoch must fit in "
                f"half the cache ({budget} bytes) and the data set holds {total} bytes "
                f"({per} per mini-epoch{' per rank' if settings.world_size > 1 else ''}); "
                f"use nm >= {need} or capacity >= {format_size(2 * per)} ({exc})"
            ) from None

    def _plan(self, epoch: int) -> list[np.ndarray]:
        plan = self._plans.get(epoch)
        if plan is None:
            try:
                plan = self._plan_for(self.settings, epoch)
            except ValueError as exc:
                # A random cut of a later epoch can miss the budget with this nm: take as many as it needs.
                self.last_error = f"epoch {epoch}: {exc}; this epoch uses more mini-epochs"
                plan = self._plan_for(Settings(**{**self.settings.__dict__, "mini_epoch_size": None}), epoch,
                                      budget_only=True)
            for old in [e for e in self._plans if e < epoch - 1]:
                del self._plans[old]
            self._plans[epoch] = plan
        return plan

    def _coords_after(self, epoch: int, me: int) -> tuple[int, int]:
        """The mini-epoch after (epoch, me), skipping empty shares (fewer files than nm x world_size)."""
        for _ in range(4 * max(1, len(self._plan(epoch))) + 4):
            me += 1
            if me >= len(self._plan(epoch)):
                epoch, me = epoch + 1, 0
            if len(self._plan(epoch)[me]):
                return epoch, me
        return epoch, me

    # ======================================================================================= position

    def _enter(self, epoch: int, me: int) -> None:
        """Make (epoch, me) current (keeping the journalled pass) and recompute next, wanted and the view."""
        self.pos.epoch, self.pos.mini_epoch = epoch, me
        self._cur = self._plan(epoch)[me]
        n = self.tree.n_files
        self._cur_mask = np.zeros(n, bool)
        self._cur_mask[self._cur] = True
        self._next_coords = self._coords_after(epoch, me)
        self.next_files = self._plan(self._next_coords[0])[self._next_coords[1]]
        if self._next_coords == (epoch, me):
            self.next_files = np.zeros(0, np.int64)
        self._wanted = self._cur_mask.copy()
        self._wanted[self.next_files] = True
        self.pending_next = {f for f in self.next_files.tolist() if self.cache.get(f) is None}
        self._blocked = False
        self._failed.clear()
        self._new_view()
        self._rebuild_queue()
        self._rebuild_push_queue()

    def _new_view(self) -> None:
        s = self.settings
        files = np.arange(self.tree.n_files, dtype=np.int64) if s.view == "full" else self._cur
        if s.policy == "lru":
            self.view = View(self.tree, files, seed=s.seed, epoch=0, mini_epoch=0, pass_index=self.pos.passes_total)
        else:
            self.view = View(self.tree, files, seed=s.seed, epoch=self.pos.epoch, mini_epoch=self.pos.mini_epoch,
                             pass_index=self.pos.pass_index)
        self._read_mark[:] = False
        self._unread = len(self.view)
        self._reads_in_pass = 0
        self._pass_started = None
        self._pass_served = 0

    def rf_now(self) -> int:
        """The rf in force: the setting, or with ``auto`` the smallest stall-free one measured so far."""
        rf = self.settings.rf
        if rf == "auto":
            staging = self.staging_bytes_per_s()
            if staging > 0 and self.consumption_bps > 0:
                return auto_rf(staging, self.consumption_bps)
            return 1
        return int(rf)

    def next_ready(self) -> bool:
        """The next mini-epoch is cached, or as much of it as fits: staging is stuck on space that only a
        switch can free (a mini-epoch a little over half the cache)."""
        if not self.pending_next:
            return True
        return self._blocked and not self._inflight and not self.cache.doomed_bytes

    def staging_blocked(self) -> None:
        """The stager found no room for the next file even after evicting everything unwanted."""
        self._blocked = True
        if self._advance_requested and self.next_ready():
            self._switch()

    def end_pass(self) -> None:
        """The current pass is over (all read, ``next-pass``, or the root listed again): count it, move on."""
        self.last_pass = self.current_mini_epoch
        now = time.monotonic()
        if self._pass_started is not None and self._pass_served:
            self._prev_pass = (self._pass_started, self._pass_served)
            if not self._consumption_measured and now > self._pass_started:
                # until the next pass starts, first to last open is the only estimate (an overestimate)
                self.consumption_bps = self._pass_served / (now - self._pass_started)
        self.pos.pass_index += 1
        self.pos.passes_total += 1
        if self.settings.policy == "lru":
            self.pos.rf_effective[-1] += 1
            self._new_view()
            self.save_journal()
            return
        self.pos.rf_effective[-1] += 1
        limit = self.pos.pass_index >= self.rf_now()
        if (limit and (self.settings.advance == "strict" or self.next_ready())) or (
            self._advance_requested and self.next_ready()
        ):
            self._switch()
        else:
            self._new_view()
            self.save_journal()

    def _switch(self) -> None:
        """The next mini-epoch takes over; the previous one is evicted (open files on release)."""
        epoch, me = self._next_coords
        self.pos.pass_index = 0
        self.pos.rf_effective.append(0)
        self._advance_requested = False
        self._enter(epoch, me)
        self._evict_unwanted()
        self.save_journal()
        self.notify()
        log.debug("tierfs: mini-epoch %d of epoch %d", me, epoch)

    def request_advance(self) -> None:
        """Leave the current mini-epoch as soon as the next one is cached (now, if it is)."""
        if self.settings.policy == "lru":
            return
        self._advance_requested = True
        if self.next_ready():
            self._switch()

    def _record_open(self, fidx: int, size: int) -> None:
        if self._pass_started is None:
            now = self._pass_started = time.monotonic()
            if self._prev_pass is not None:
                # Consumption from one pass's first open to the next one's: the reading of the last files opened
                # counts too (a pass of a few big shards is all opened long before it is consumed).
                started, served = self._prev_pass
                self._prev_pass = None
                if now > started:
                    self.consumption_bps = served / (now - started)
                    self._consumption_measured = True
        self._reads_in_pass += 1
        # Consumption counts bytes opened, not bytes read: repeated passes may be served by the page cache.
        self._pass_served += size
        self.opened_bytes += size
        if not self._read_mark[fidx] and self.view is not None and self.view.mask[fidx]:
            self._read_mark[fidx] = True
            self._unread -= 1
            if self._unread == 0:
                self.end_pass()

    def save_journal(self) -> None:
        self.pos.arf_history = self.arf.history[-_ARF_HISTORY_KEPT:]
        self.pos.last_pass = list(self.last_pass) if self.last_pass is not None else None
        save_position(self.config.cache, self.pos)

    # ========================================================================================= staging

    def notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def _rebuild_queue(self) -> None:
        if self.settings.policy == "lru":
            self._queue = deque()
            return
        self._queue = deque(f for f in (*self._cur.tolist(), *self.next_files.tolist()) if self.cache.get(f) is None)
        self.notify()

    def next_to_stage(self) -> tuple[int, int] | None:
        """The next file the stager should copy, as (file index, size); None when everything wanted is cached."""
        while self._queue:
            fidx = self._queue[0]
            if (self.cache.get(fidx) is not None or fidx in self._inflight or fidx in self._failed
                    or not self._wanted[fidx]):
                self._queue.popleft()
                continue
            return fidx, int(self.tree.sizes[fidx])
        return None

    def begin_staging(self, fidx: int) -> None:
        self._blocked = False
        if self._queue and self._queue[0] == fidx:
            self._queue.popleft()
        self._inflight[fidx] = trio.Event()
        if self._staging_since is None:
            self._staging_since = time.monotonic()

    def make_room(self, size: int) -> bool:
        """Evict copies no longer wanted (and, under lru, the least recently used) until ``size`` fits."""
        if self.settings.policy == "lru":
            return self.cache.evict_lru(size)
        self._evict_unwanted()
        return self.cache.can_reserve(size)

    def _evict_unwanted(self) -> None:
        freed = False
        for fidx in [f for f in self.cache.entries if not self._wanted[f]]:
            freed |= self.cache.evict(fidx)
        if freed:
            self.notify()

    def staging_bytes_per_s(self) -> float:
        busy = self._staging_busy
        if self._staging_since is not None:
            busy += time.monotonic() - self._staging_since
        return self._staged_bytes / busy if busy > 0 else 0.0

    async def throttle(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more backing reads fit under the ``bandwidth`` cap (a shared token bucket)."""
        bw = self.settings.bandwidth
        if bw <= 0:
            return
        now = trio.current_time()
        start = max(now, self._bw_next)
        self._bw_next = start + nbytes / bw
        if start > now:
            await trio.sleep(start - now)

    def _throttle_from_thread(self, nbytes: int) -> None:
        if self.settings.bandwidth > 0:
            trio.from_thread.run(self.throttle, nbytes)

    async def stage_file(self, fidx: int, reserved: int) -> None:
        """Copy file ``fidx`` into the cache under a reservation of ``reserved`` bytes (see begin_staging)."""
        node = self.tree.file_node(fidx)
        ok = False
        try:
            if not self._wanted[fidx] and self.settings.policy != "lru":
                return
            copy = functools.partial(
                copy_into_cache, self.root_fd, self.tree.dev, node.path, fingerprint(node.st), self.cache.data_fd,
                hash_content=self.settings.verify == "xxhash", throttle=self._throttle_from_thread,
            )
            try:
                name, fp, digest = await trio.to_thread.run_sync(copy)
            except BackingChanged as exc:
                if exc.st is not None and stat.S_ISREG(exc.st.st_mode):
                    self._backing_changed(fidx, exc.st)
                else:
                    self._give_up(fidx)
                return
            except OSError as exc:
                self._give_up(fidx)
                self.last_error = f"staging {os.fsdecode(node.path)}: {exc.strerror or exc}"
                log.warning("tierfs: %s", self.last_error)
                return
            if fingerprint(node.st) != fp or fp[0] != reserved:
                # Found changed by an open while we copied, or bigger than what was reserved: this copy may
                # not count against the cap; stage it again under a fresh reservation.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self.cache.data_fd)
                if self._wanted.size and self._wanted[fidx]:
                    self._queue.appendleft(fidx)
                return
            self.cache.commit(fidx, name, fp, digest, reserved)
            ok = True
            self._staged_bytes += fp[0]
            self.backing_bytes_read += fp[0]
            self.pending_next.discard(fidx)
            if not self._wanted[fidx] and self.settings.policy != "lru":
                self.cache.evict(fidx)  # the view moved on while we copied
            elif self.settings.policy != "lru":
                self._want_push(fidx)
        finally:
            if not ok:
                self.cache.unreserve(reserved)
            ev = self._inflight.pop(fidx, None)
            if ev is not None:
                ev.set()
            if not self._inflight and self._staging_since is not None:
                self._staging_busy += time.monotonic() - self._staging_since
                self._staging_since = None
            self.notify()
            if ok and self._advance_requested and self.next_ready():
                self._switch()

    def _give_up(self, fidx: int) -> None:
        """This file cannot be staged now (unreadable, ENOSPC, ...): it is served from the backing dir, and the
        mini-epoch counts as staged without it, so ``advance=ready`` never waits for it."""
        self._failed.add(fidx)
        self.pending_next.discard(fidx)

    async def _fetch_now(self, fidx: int) -> CacheEntry | None:
        """Stage ``fidx`` for a reader waiting on it; None if it cannot be cached right now."""
        t0 = time.monotonic()
        try:
            ev = self._inflight.get(fidx)
            if ev is not None:
                await ev.wait()
                return self.cache.get(fidx)
            size = int(self.tree.sizes[fidx])
            if not self.cache.reserve(size):
                self.make_room(size)
                if not self.cache.reserve(size):
                    return None
            self.begin_staging(fidx)
            await self.stage_file(fidx, size)
            return self.cache.get(fidx)
        finally:
            self.stall_seconds += time.monotonic() - t0

    def _backing_changed(self, fidx: int, st: os.stat_result) -> None:
        """The backing file now has stat ``st``: forget the old copy, stage it again if wanted."""
        self.tree.update_stat(fidx, st)
        if self.cache.get(fidx) is not None:
            self.cache.evict(fidx)
        self._failed.discard(fidx)
        if fidx in self._pushed:
            self._pushed.discard(fidx)
            self._pushed_window -= int(self.tree.sizes[fidx])
        if self._wanted.size and self._wanted[fidx]:
            if fidx in set(self.next_files.tolist()):
                self.pending_next.add(fidx)
            self._queue.appendleft(fidx)
            self.notify()
        self.invalidate_inode(self.file_inode(fidx))

    # ==================================================================================== page cache

    def _rebuild_push_queue(self) -> None:
        """A new current mini-epoch: push what it still lacks, then the next one (within push_budget)."""
        self._pushed &= set(np.flatnonzero(self._wanted).tolist()) if self._pushed else set()
        self._pushed_window = int(self.tree.sizes[list(self._pushed)].sum()) if self._pushed else 0
        self._push_unknown = {}
        if self.settings.policy == "lru":
            self._push_queue = deque()
            return
        self._push_queue = deque(f for f in (*self._cur.tolist(), *self.next_files.tolist())
                                 if f not in self._pushed and self.cache.get(f) is not None)
        self._wake_pusher()

    def _want_push(self, fidx: int) -> None:
        if self.store_pages is not None and fidx not in self._pushed:
            self._push_queue.append(fidx)
            self._wake_pusher()

    def _wake_pusher(self) -> None:
        self._push_wake.set()
        self._push_wake = trio.Event()

    def listed(self, dir_inode: int) -> None:
        """The kernel got the entries (and so the inodes) of this directory: push what it lacked an inode for."""
        if (self._push_unknown or self._push_inflight) and self.view is not None:
            # only the files this listing showed: the others' inodes are still unknown to the kernel
            mask = self.view.mask
            candidates = self._push_unknown.get(dir_inode - 1, set()) | self._push_inflight.keys()
            shown = {f for f in candidates if mask[f] and int(self.tree.groups[f]) == dir_inode - 1}
            if shown:
                self._kernel_learnt(dir_inode - 1, shown)

    async def _pusher(self) -> None:
        """Push staged copies of the current and next mini-epochs into the kernel page cache, so a first pass
        over a mini-epoch is served like a repeated one (no READ requests).

        Current mini-epoch first (what a switch left unpushed), then the next as its copies land, at most
        ``push_budget`` bytes of the two.  Batches of files go to one worker thread, never the trio thread:
        ``notify_store`` locks the kernel's pages, and a page locked by a READ waiting for this daemon must not
        block the thread that answers it.  The kernel must know the inode (from a lookup or a listing); a file it
        does not know waits for its next lookup (``lookup``) or its directory's next listing (``listed``)."""
        limiter = trio.CapacityLimiter(1)
        while True:
            wake = self._push_wake
            batch: list[tuple[int, CacheEntry, int]] = []
            size = 0
            while self._push_queue and self.store_pages is not None and len(batch) < _PUSH_BATCH_FILES \
                    and size < _PUSH_CHUNK * 8:
                fidx = self._push_queue.popleft()
                entry = self.cache.get(fidx)
                if (entry is None or fidx in self._pushed or fidx in self._push_inflight or not self._wanted[fidx]
                        or entry.doomed or self._pushed_window + size + entry.size > self.push_budget
                        or (self.settings.verify == "xxhash" and not entry.verified)):  # only checked bytes
                    continue
                batch.append((fidx, entry, self.cache.open_entry(entry)))  # pinned while pushed
                self._push_inflight[fidx] = trio.Event()
                size += entry.size
            if not batch:
                await wake.wait()
                continue
            store = self.store_pages
            assert store is not None
            jobs = [(fd, self.file_inode(fidx), entry.size) for fidx, entry, fd in batch]
            stopped = True
            try:
                # abandoned on cancel: at shutdown a store may wait on a page lock until the unmount aborts the
                # connection; the descriptors are then left to the exit, since the thread may still read them
                results = await trio.to_thread.run_sync(_store_files, store, jobs, limiter=limiter,
                                                        abandon_on_cancel=True)
                stopped = False
            finally:
                for fidx, entry, fd in batch:
                    self._push_inflight.pop(fidx).set()
                    if not stopped and self.cache.release_entry(entry, fd):
                        self.notify()
            for (fidx, entry, _fd), n in zip(batch, results, strict=True):
                inode = self.file_inode(fidx)
                known_meanwhile = fidx in self._known_while_pushed
                self._known_while_pushed.discard(fidx)
                if self.cache.get(fidx) is not entry or entry.fp != fingerprint(self.tree.file_node(fidx).st):
                    # The backing changed (or the copy went) while its bytes travelled: never leave them there.
                    self.invalidate_inode(inode)
                elif n == -errno.ENOENT:
                    if known_meanwhile:  # the kernel learnt the inode while the push travelled: try again
                        self._push_queue.append(fidx)
                        self._wake_pusher()
                    else:
                        self._push_unknown.setdefault(int(self.tree.groups[fidx]), set()).add(fidx)
                elif n == -errno.ENOSYS:
                    self.store_pages = None  # the kernel cannot: stop trying
                elif n < 0:
                    log.debug("tierfs: notify_store of %s: %s", os.fsdecode(self.tree.file_path(fidx)),
                              os.strerror(-n))
                else:
                    self.pushed_bytes += n
                    if self._wanted[fidx]:
                        self._pushed.add(fidx)
                        self._pushed_window += entry.size

    # ========================================================================================== reads

    def _root_alive(self) -> bool:
        try:
            return os.fstat(self.root_fd).st_nlink > 0
        except OSError:
            return False

    def _backing_error(self, exc: OSError) -> BackingError:
        if exc.errno in _VANISHED and self._root_alive():
            return BackingError(errno.ENOENT, "vanished from the backing dir")
        return BackingError(errno.EIO, f"backing dir unreachable: {exc.strerror or exc}")

    async def open_file(self, fidx: int) -> FileHandle:
        """Open dataset file ``fidx`` for reading: from the cache if a valid copy is there, else the backing."""
        node = self.tree.file_node(fidx)
        try:
            st = os.stat(node.path, dir_fd=self.root_fd, follow_symlinks=False)
        except OSError as exc:
            if self.cache.get(fidx) is not None:
                self.cache.evict(fidx)
            raise self._backing_error(exc) from None
        if not stat.S_ISREG(st.st_mode):
            if self.cache.get(fidx) is not None:
                self.cache.evict(fidx)
            raise BackingError(errno.ENOENT, "no longer a regular file in the backing dir")
        keep_cache = True
        if fingerprint(st) != fingerprint(node.st):
            pushing = self._push_inflight.get(fidx)
            if pushing is not None:
                await pushing.wait()  # its old bytes must land before the invalidation, never after
            node = self.tree.file_node(fidx)
            if fingerprint(st) != fingerprint(node.st):
                self._backing_changed(fidx, st)
            keep_cache = False
        entry = self.cache.get(fidx)
        was_cached = entry is not None
        if entry is None and (self.settings.policy == "lru" or self._cur_mask[fidx]):
            entry = await self._fetch_now(fidx)
            if entry is not None and entry.fp != fingerprint(self.tree.file_node(fidx).st):
                entry = None
        if entry is not None and not entry.verified and self.settings.verify == "xxhash":
            entry = await self._verify(entry)
        if entry is not None:
            fd = self.cache.open_entry(entry)
            self.cache.touch(entry)
        if entry is not None and was_cached:
            self.hits += 1
        elif entry is not None:
            self.misses += 1  # fetched on demand: the reader waited on the backing dir
        else:
            t0 = time.monotonic()
            try:
                fd = await trio.to_thread.run_sync(open_beneath, self.root_fd, node.path, self.tree.dev)
            except OSError as exc:
                raise self._backing_error(exc) from None
            finally:
                self.stall_seconds += time.monotonic() - t0
            self.misses += 1
        handle = FileHandle(fidx, fd, entry, keep_cache)
        if entry is not None and entry.size <= _ADVISE_WHOLE:
            # Start reading a small copy into the page cache now, while the open's reply travels: the read that
            # follows then mostly finds it there and needs no thread hop (big files get the kernel's read-ahead).
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, entry.size, os.POSIX_FADV_WILLNEED)
        self._count_open(fidx, int(st.st_size))
        return handle

    def _count_open(self, fidx: int, size: int) -> None:
        if self.view is None or not self.view.mask[fidx]:
            self.out_of_view += 1
        self._record_open(fidx, size)

    def lend(self, fidx: int) -> bytes | None:
        """The absolute path of a valid cached copy of ``fidx``, for a reader that opens it itself; or None.

        The copy is complete and never changes (copies land by rename, named by the backing file's fingerprint),
        so a reader that opens it gets exactly the bytes the mount would serve, at the fast tier's own speed and
        with no FUSE round trip per read.  It is pinned for ``LEND_SECONDS`` so an eviction cannot unlink it
        between this answer and the reader's open; once opened, a descriptor outlives any later unlink.  None
        (read through the mount) when the file is not cached, changed in the backing dir, or awaits its
        ``verify=xxhash`` check: those go through :meth:`open_file`, which fetches, re-checks or verifies.
        Counted as an open served from the cache, like :meth:`open_file`.
        """
        self._return_leases()
        entry = self.cache.get(fidx)
        if entry is None or (self.settings.verify == "xxhash" and not entry.verified):
            return None
        node = self.tree.file_node(fidx)
        try:
            st = os.stat(node.path, dir_fd=self.root_fd, follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or fingerprint(st) != fingerprint(node.st) or entry.fp != fingerprint(st):
            return None
        self.cache.pin(entry)
        self.cache.touch(entry)
        self._leases.append((time.monotonic() + LEND_SECONDS, entry))
        if len(self._leases) == 1:
            self._lease_wake.set()
        self.hits += 1
        self.lent += 1
        self._count_open(fidx, int(st.st_size))
        return os.fsencode(os.path.join(self.cache.data_path, entry.name))

    def _return_leases(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        freed = False
        while self._leases and self._leases[0][0] <= now:
            freed |= self.cache.unpin(self._leases.popleft()[1])
        if freed:
            self.notify()

    async def _lease_keeper(self) -> None:
        """Unpin lent copies when their time is up, also when no further ``lend`` comes to do it."""
        while True:
            if not self._leases:
                self._lease_wake = trio.Event()
                await self._lease_wake.wait()
                continue
            await trio.sleep(max(0.0, self._leases[0][0] - time.monotonic()))
            self._return_leases()

    async def _verify(self, entry: CacheEntry) -> CacheEntry | None:
        """``verify=xxhash``: hash the cached copy once and compare it with the hash taken while staging."""
        def digest() -> int:
            fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.cache.data_fd)
            try:
                h = xxhash.xxh3_64()
                while chunk := os.read(fd, 1 << 20):
                    h.update(chunk)
                return h.intdigest()
            finally:
                os.close(fd)

        entry.opens += 1  # pinned while hashed
        try:
            ok = entry.digest is not None and await trio.to_thread.run_sync(digest) == entry.digest
        except OSError:
            ok = False
        finally:
            entry.opens -= 1
        if ok:
            entry.verified = True
            return entry
        self.last_error = f"cached copy of {os.fsdecode(self.tree.file_path(entry.fidx))} failed xxhash check"
        if self.cache.get(entry.fidx) is entry:
            self.cache.evict(entry.fidx)
            if self._wanted.size and self._wanted[entry.fidx]:
                self._queue.appendleft(entry.fidx)
                self.notify()
        return None

    async def read(self, handle: FileHandle, offset: int, size: int) -> bytes | bytearray:
        if handle.entry is not None:
            # The cached copy: bytes already in the page cache are copied right here (RWF_NOWAIT never blocks
            # on the disk, and starts the read-ahead of what is missing); only the rest goes to a worker thread,
            # so a warm read costs no thread hop and a cold one never stalls the other requests.
            want = max(0, min(size, handle.entry.size - offset))
            data = bytearray(want)
            try:
                n = os.preadv(handle.fd, [data], offset, os.RWF_NOWAIT) if want else 0
            except OSError:  # EAGAIN: not in the page cache (or a cache fs without RWF_NOWAIT)
                n = 0
            if n < want:
                n = await trio.to_thread.run_sync(_pread_rest, handle.fd, data, n, offset)
                del data[n:]
        else:
            await self.throttle(size)
            t0 = time.monotonic()
            try:
                data = await trio.to_thread.run_sync(os.pread, handle.fd, size, offset)
            except OSError as exc:
                raise BackingError(errno.EIO, f"backing read failed: {exc.strerror or exc}") from None
            finally:
                self.stall_seconds += time.monotonic() - t0
            self.backing_bytes_read += len(data)
        self.served_bytes += len(data)
        return data

    def release(self, handle: FileHandle) -> None:
        if handle.entry is not None:
            if self.cache.release_entry(handle.entry, handle.fd):
                self.notify()
        else:
            os.close(handle.fd)

    # ==================================================================================== namespace

    def file_inode(self, fidx: int) -> int:
        return int(self.tree.files[fidx]) + 1

    def node(self, inode: int) -> Node | None:
        return self.tree.node_of_inode(inode)

    def lookup(self, parent_inode: int, name: bytes) -> int | None:
        """Inode of ``name`` in directory ``parent_inode``, in view or not; None if there is none."""
        if parent_inode == 1 and name == b".tierfs":
            return CONTROL_INODES[b".tierfs"]
        if parent_inode == CONTROL_INODES[b".tierfs"]:
            return CONTROL_INODES.get(name) if name != b".tierfs" else None
        node = self.node(parent_inode)
        if node is None or node.children is None:
            return None
        i = node.children.get(name)
        if i is None:
            return None
        if self._push_unknown or self._push_inflight:
            self._looked_up(parent_inode - 1, i + 1)
        return i + 1

    def _looked_up(self, dir_node: int, inode: int) -> None:
        """The kernel now has an inode for this entry: push it if an earlier push found none."""
        child = self.node(inode)
        if child is None or child.kind != KIND_FILE:
            return
        self._kernel_learnt(dir_node, {child.fidx})

    def _kernel_learnt(self, dir_node: int, files: set[int]) -> None:
        # A push still travelling may come back -ENOENT although the kernel knows the inode by now: remember.
        self._known_while_pushed |= files & self._push_inflight.keys()
        waiting = self._push_unknown.get(dir_node)
        if waiting and files & waiting:
            found = files & waiting
            waiting -= found
            self._push_queue.extendleft(found)
            self._wake_pusher()

    def list_dir(self, inode: int) -> list[tuple[bytes, int]]:
        """A frozen listing (name, inode) for one ``opendir``; listing the root again ends a pass with reads."""
        if inode == CONTROL_INODES[b".tierfs"]:
            return [(n, i) for n, i in CONTROL_INODES.items() if n != b".tierfs"]
        node = self.node(inode)
        if node is None or node.kind != KIND_DIR:
            raise BackingError(errno.ENOTDIR, "not a directory")
        if inode == 1 and self._reads_in_pass:
            self.end_pass()
        assert self.view is not None
        return [(name, i + 1) for name, i in self.view.listing(inode - 1)]

    def file_index(self, inode: int) -> int:
        node = self.node(inode)
        if node is None:
            raise BackingError(errno.ENOENT, "no such inode")
        if node.kind != KIND_FILE:
            raise BackingError(errno.EISDIR if node.kind == KIND_DIR else errno.ELOOP, "not a regular file")
        return node.fidx

    def readlink(self, inode: int) -> bytes:
        node = self.node(inode)
        if node is None or node.kind != KIND_LINK:
            raise BackingError(errno.EINVAL, "not a symlink")
        return node.link or b""

    # ================================================================================ control & status

    def control_text(self) -> bytes:
        return self.settings.as_lines().encode()

    def order_text(self) -> bytes:
        return self.view.order_text() if self.view is not None else b""

    def control_write(self, data: bytes) -> None:
        """Apply one write to the control file (see :func:`tierfs.control.apply_control`)."""
        apply_control(self, data)

    def status(self) -> Status:
        """One consistent snapshot of everything ``status`` and ``metrics`` show."""
        return snapshot(self)

    @property
    def current_mini_epoch(self) -> tuple[int, int]:
        return self.pos.epoch, self.pos.mini_epoch

    def nm_in_force(self) -> int:
        return len(self._plans.get(self.pos.epoch, ())) if self.settings.policy == "met" else 1

    def check_plan(self, settings: Settings) -> None:
        """``ValueError`` if ``settings`` cannot plan the next epoch (a control write is then refused)."""
        self._plan_for(settings, self.pos.epoch + 1)

    def apply_settings(self, new: Settings, *, replan: bool) -> None:
        """Settings from a validated control write; ``replan``: nm/mini_epoch_size/composition changed."""
        self.settings = new
        if replan:
            # The current epoch keeps its plan; the new settings take effect from the next epoch on.
            self._plans = {e: p for e, p in self._plans.items() if e <= self.pos.epoch}
            self._enter_keep_view()

    def rf_changed(self) -> None:
        """A new ``rf``: under ``advance=strict`` a mini-epoch already past it leaves at once."""
        if self.settings.advance == "strict" and self.pos.pass_index >= self.rf_now():
            self._switch()

    def _enter_keep_view(self) -> None:
        """Recompute next/wanted after a plan change without touching the current view or pass."""
        epoch, me = self.pos.epoch, self.pos.mini_epoch
        self._next_coords = self._coords_after(epoch, me)
        self.next_files = self._plan(self._next_coords[0])[self._next_coords[1]]
        self._wanted = self._cur_mask.copy()
        self._wanted[self.next_files] = True
        self.pending_next = {f for f in self.next_files.tolist() if self.cache.get(f) is None}
        self._evict_unwanted()
        self._rebuild_queue()

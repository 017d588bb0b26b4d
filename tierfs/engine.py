"""The tiering engine: the coordinator of a mount's parts, and every answer ``fs.py`` needs.

Parts, each owning its state and reporting its own ``statistics()``:

* :class:`~tierfs.schedule.Schedule` -- plans, the position (epoch, mini-epoch, pass), the view, what is wanted;
* :class:`~tierfs.cache.CacheStore` -- the copies, their pins and the disk accounting under the cap;
* :class:`~tierfs.staging.Stager` -- the staging queue, copies in flight, failures and retries, streams;
* :class:`~tierfs.pusher.Pusher` -- pushes of staged copies into the kernel page cache;
* :class:`~tierfs.revalidate.Revalidator` -- how fresh each backing fingerprint is, renewed ahead of readers;
* :class:`~tierfs.backing.Backing` -- every call into the backing dir, in its own threads, with stall watch;
* :class:`~tierfs.pusher.KernelCache` -- every call into the kernel's caches, in a thread of its own.

Everything here runs on the one trio thread; worker threads only touch the disks and hand results back.  So
state needs no locks and a status snapshot taken between two awaits is consistent.  Nothing on the trio thread
waits on the backing dir or the kernel (slow cache-disk work goes to cache threads): an open of a cached file
whose fingerprint is fresh (see revalidate.py) makes no backing call at all, and one backing call that hangs
holds one backing thread.

How a mount moves (policy ``met``): the *current* mini-epoch is what the root shows; the *next* one is staged
meanwhile, behind any file of the current one that is not cached yet.  A pass ends when every file of the
view was opened since it began, on ``next-pass``, or when the root is listed again after at least one open.
After ``rf`` passes the next mini-epoch takes over: with ``advance=ready`` only once it is fully cached, with
``strict`` at once; ``advance`` (the command, or ARF) leaves as soon as the next one is cached.  On a switch
the previous mini-epoch is evicted, except open files, which go on their last release.  An open of a file of
the current mini-epoch that is not cached fetches it on demand; any other uncached file is read from the
backing dir directly.  Policy ``lru``: every open of an uncached file copies it in, evicting the least
recently used unpinned copies to make room under the same cap.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable

import numpy as np
import trio

from sampler.iomodel import stall_free_rf
from tierfs.backing import Backing, BackingError
from tierfs.cache import CacheEntry, CacheStore, disk_estimates
from tierfs.control import Arf, apply_control
from tierfs.datapath import DataPath, FileHandle
from tierfs.journal import JournalWriter, Position, load_position
from tierfs.options import MountConfig, Settings, format_size
from tierfs.pusher import KernelCache, Pusher, push_budget
from tierfs.revalidate import Revalidator
from tierfs.schedule import Schedule
from tierfs.staging import Stager
from tierfs.stats import Status, build_status
from tierfs.tree import CONTROL_INODES, KIND_DIR, KIND_FILE, KIND_LINK, Node, Tree, fingerprint
from tierfs.view import View

__all__ = ["BackingError", "Engine", "FileHandle"]

log = logging.getLogger("tierfs")

_ARF_HISTORY_KEPT = 1000
_ADVISE_WHOLE = 1 << 20  # cached copies up to this size are read ahead whole on open
LEND_SECONDS = 2.0  # a lent copy stays pinned this long: the reader opens it right after asking
STATFS_TIMEOUT = 1.0  # statfs answers from its last good figures when the backing takes longer
TREE_NAME = "tree.npz"  # the saved tree in the cache dir


async def _supervised(name: str, task: Callable[[], Awaitable[None]]) -> None:
    """Run a background task for the life of the mount; a bug in it is logged and the task started again
    (after a second), never a dead mount: readers are served whether or not staging or pushing works."""
    while True:
        try:
            await task()
        except Exception:
            log.exception("tierfs: the %s failed; restarting it", name)
        await trio.sleep(1.0)


async def _once(name: str, task: Callable[[], Awaitable[None]]) -> None:
    """A background job that runs once: a failure is logged, never a dead mount."""
    try:
        await task()
    except OSError as exc:  # a full or failing disk: said once, the mount goes on
        log.warning("tierfs: the %s failed: %s", name, exc.strerror or exc)
    except ValueError:
        log.exception("tierfs: the %s failed", name)


class Engine:
    """See the module docstring.  ``mount.py``: ``open()``, then ``run()`` beside ``pyfuse3.main()``, ``close()``."""

    def __init__(self, config: MountConfig) -> None:
        self.config = config
        self.settings: Settings = config.settings
        self.cache = CacheStore(config.cache, config.capacity)
        self.cache_limiter = trio.CapacityLimiter(16)  # threads for cache-disk work (opens, hashes)
        self.tree = Tree([], np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), 0,
                         np.zeros(0, bool))
        self.root_fd = -1
        self.kernel = KernelCache()  # fs.init() replaces it with the mount's kernel
        self.arf = Arf()  # the configured controller is made in open()
        self.control_error: str | None = None
        self.tree_info: dict[str, object] = {}
        self.journal = JournalWriter(config.cache)
        self._nursery: trio.Nursery | None = None
        self._opened = self._closed = False
        self._statvfs: os.statvfs_result | None = None

    # ========================================================================================= lifecycle

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
        pos = load_position(cfg.cache) or Position()
        try:
            t0 = time.monotonic()
            saved = Tree.load(os.path.join(cfg.cache, TREE_NAME), os.fstat(self.root_fd)) \
                if load_position(cfg.cache) is not None else None
            self.tree = saved or Tree.scan(self.root_fd, backing)
            self.tree_info = {"source": "saved" if saved else "scan", "seconds": round(time.monotonic() - t0, 3),
                              "rescan": "pending" if saved else "done", "added": 0, "removed": 0, "changed": 0}
            disk = disk_estimates(self.tree.sizes, self.tree.blocks, self.cache.block)
            self.schedule = Schedule(self.tree, self.settings, cfg.capacity, pos, disk)
            self._check_fits()
            self.cache.open(self.tree, need_digest=self.settings.verify == "xxhash")
        except BaseException:
            os.close(self.root_fd)
            self.root_fd = -1
            self.cache.close()
            raise
        s = self.settings
        self.backing = Backing(self.root_fd, self.tree.dev, bandwidth=lambda: self.settings.bandwidth)
        self.arf = Arf(Arf.controller_for(s), pos.arf_history)
        self.stager = Stager(self.tree, self.cache, self.backing, streams=s.staging_streams,
                             hash_content=s.verify == "xxhash", throttle=self.backing.throttle_from_thread,
                             disk_size=lambda f: int(self.schedule.disk_sizes[f]),
                             ahead=lambda: self.schedule.staging_ahead(self.rf_now()), wanted=self._stage_wanted,
                             make_room=self.make_room, landed=self._landed,
                             changed=self._changed, blocked=self._staging_blocked,
                             data_dir_lost=self._data_dir_lost, gave_up=self._stage_gave_up)
        self.pusher = Pusher(self.tree, self.cache, self.kernel, budget=push_budget(), verify=s.verify == "xxhash",
                             wanted=lambda f: bool(self.schedule.wanted[f]) and f not in self.data.changed_files,
                             inode=self.tree.inode_of, freed=lambda: self.stager.notify(),
                             repair=lambda e, why: self.data.repair(e, why))
        self.reval = Revalidator(self.tree.n_files, self.backing, self.tree.file_path, setting=s.revalidate,
                                 candidates=self._revalidation_candidates, result=self._revalidated)
        self.data = DataPath(tree=self.tree, cache=self.cache, cache_limiter=self.cache_limiter, backing=self.backing,
                             reval=self.reval, stager=self.stager, pusher=self.pusher, schedule=self.schedule,
                             settings=lambda: self.settings, opened=self._opened_file, changed=self._changed,
                             restage=self._restage, data_dir_lost=self._data_dir_lost)
        if self.tree_info["source"] == "scan":
            self.reval.confirmed[:] = time.monotonic()  # the scan just read every fingerprint
        # (a saved tree's fingerprints are unconfirmed: opens ask until the revalidator or the rescan confirms)
        self.schedule.start(self._is_cached)
        self._entered()
        self._opened = True
        self.save_journal()
        log.info("tierfs: %d files, %s in the backing dir; %d copies kept in the cache",
                 self.tree.n_files, format_size(int(self.tree.sizes.sum())), len(self.cache.entries))

    def _check_fits(self) -> None:
        if self.settings.policy != "met":
            # lru is a read-through cache: a file too big for it gets no reservation and is served from the
            # backing dir, so no size rule applies
            return
        cap = self.config.capacity
        disk = self.schedule.disk_sizes
        if disk.size and int(disk.max()) * 2 > cap:
            i = int(np.argmax(disk))
            raise ValueError(
                f"capacity must be at least 2 x the largest file's copy ({os.fsdecode(self.tree.file_path(i))}: "
                f"{int(disk[i])} bytes on the cache disk), got {cap} ({format_size(cap)})"
            )
        self.schedule.plan_for(self.settings, self.schedule.pos.epoch)  # raises ValueError with the reason

    def attach_kernel(self, kernel: KernelCache) -> None:
        """The mount is up (fs.init): pushes and invalidations now reach the kernel."""
        self.kernel = kernel
        self.pusher.kernel = kernel
        self.data.kernel = kernel

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Stage, push, revalidate and return leases in the background until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = self.data.nursery = nursery
                self._start_background(nursery)
                task_status.started()
        finally:
            self._nursery = self.data.nursery = None
            self.journal.flush()  # what the writer had not written yet

    async def _rescan(self) -> None:
        """After a mount from the saved tree: scan the backing in the background and take its news -- changed
        files like any change, files gone as gone; files added show at the next mount (the tree's numbering
        is fixed for the life of a mount), from the saved tree written here.  After a fresh scan: save it."""
        backing = os.path.realpath(self.config.backing)
        if self.tree_info["rescan"] == "pending":
            self.tree_info["rescan"] = "running"
            # (abandoned on unmount: it works on its own dup of the root descriptor)
            new = await trio.to_thread.run_sync(Tree.scan, self.root_fd, backing, abandon_on_cancel=True)
            changed, gone, added = self.tree.compare(new)
            now = time.monotonic()
            self.reval.confirmed[:] = now  # the rescan read every fingerprint
            for fidx, st in changed:
                self._changed(fidx, st)
            for fidx in gone:
                self.cache.evict(fidx)
                self.data.mark_stale(fidx)
            self.tree_info.update(rescan="done", changed=len(changed), removed=len(gone), added=added)
            if added or gone:
                log.warning("tierfs: the backing tree changed since the last mount: %d files added, %d removed "
                            "(added files show from the next mount)", added, len(gone))
            tree = new
        else:
            tree = self.tree
        await trio.to_thread.run_sync(tree.save, os.path.join(self.config.cache, TREE_NAME),
                                      limiter=self.cache_limiter, abandon_on_cancel=True)

    def _start_background(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(_once, "tree rescan", self._rescan)
        nursery.start_soon(_supervised, "lease keeper", self.data.lease_keeper)
        nursery.start_soon(_supervised, "journal writer", functools.partial(self.journal.run, self.cache_limiter))
        nursery.start_soon(_supervised, "revalidator", self.reval.run)
        if self.settings.policy == "met":
            nursery.start_soon(_supervised, "pusher", self.pusher.run)
            nursery.start_soon(_supervised, "stager", self.stager.run)

    def close(self) -> None:
        """Persist the journal and release the cache; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._opened:
            self._nursery = None
            self.save_journal()
        self.cache.close()
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    # ============================================================================================ schedule

    @property
    def pos(self) -> Position:
        return self.schedule.pos

    @property
    def view(self) -> View | None:
        return self.schedule.view

    @property
    def last_pass(self) -> tuple[int, int] | None:
        return self.schedule.last_pass

    @property
    def current_mini_epoch(self) -> tuple[int, int]:
        return self.pos.epoch, self.pos.mini_epoch

    def _is_cached(self, fidx: int) -> bool:
        return self.cache.get(fidx) is not None

    def _entered(self) -> None:
        """A mini-epoch became current (mount, switch, replan): evict, re-queue staging and pushes."""
        sch = self.schedule
        if self.cache.evict_unwanted(sch.wanted) and not sch.lru:
            self.stager.notify()
        order = sch.staging_order()
        self.stager.reset(order)
        self.pusher.reset(order, set(np.flatnonzero(sch.wanted).tolist()) if self.pusher.pushed else set())

    def rf_now(self) -> int:
        """The rf in force: the setting, or with ``auto`` the smallest stall-free one measured so far."""
        rf = self.settings.rf
        if rf == "auto":
            staging = self.stager.bytes_per_s()
            consumption = self.schedule.consumption_bps
            return stall_free_rf(consumption, staging) if staging > 0 and consumption > 0 else 1
        return int(rf)

    def next_ready(self) -> bool:
        """The next mini-epoch is cached, or as much of it as fits: staging is stuck on space that only a
        switch can free (a mini-epoch a little over half the cache)."""
        if not self.schedule.pending_next:
            return True
        return self.stager.blocked and not self.stager.inflight and not self.cache.doomed_bytes

    def _staging_blocked(self) -> None:
        if self.schedule.advance_requested and self.next_ready():
            self._switch()

    def end_pass(self) -> None:
        """The current pass is over (all read, ``next-pass``, or the root listed again): count it, move on."""
        sch = self.schedule
        limit = sch.end_pass(self.rf_now())
        self.data.pass_over()
        if not sch.lru and ((limit and (self.settings.advance == "strict" or self.next_ready()))
                            or (sch.advance_requested and self.next_ready())):
            self._switch()
        else:
            sch.new_view()
            self.save_journal()

    def _switch(self) -> None:
        """The next mini-epoch takes over; the previous one is evicted (open files on release)."""
        self.schedule.switch(self._is_cached)
        self._entered()
        self.data.pass_over()  # (after the eviction: a copy a plan named goes now, by its own name)
        self.save_journal()
        log.debug("tierfs: mini-epoch %d of epoch %d", self.pos.mini_epoch, self.pos.epoch)

    def request_advance(self) -> None:
        """Leave the current mini-epoch as soon as the next one is cached (now, if it is)."""
        if self.schedule.lru:
            return
        self.schedule.advance_requested = True
        if self.next_ready():
            self._switch()

    def save_journal(self) -> None:
        """Journal the position: handed to the background writer while mounted (never a disk write on the trio
        thread), written at once otherwise (engine tests, close)."""
        pos = self.pos
        pos.arf_history = self.arf.history[-_ARF_HISTORY_KEPT:]
        pos.last_pass = list(self.last_pass) if self.last_pass is not None else None
        self.journal.save(pos)
        if self._nursery is None:
            self.journal.flush()

    def _opened_file(self, fidx: int, size: int) -> None:
        if self.schedule.record_open(fidx, size):
            self.end_pass()

    # ============================================================================================= staging

    def _stage_wanted(self, fidx: int) -> bool:
        return self.schedule.lru or bool(self.schedule.wanted[fidx])

    def make_room(self, size: int) -> bool:
        """Evict copies no longer wanted (and, under lru, the least recently used) until ``size`` fits."""
        if self.schedule.lru:
            return self.cache.evict_lru(size)
        self.cache.evict_unwanted(self.schedule.wanted)
        return self.cache.can_reserve(size)

    def _landed(self, fidx: int, entry: CacheEntry) -> None:
        """A copy was committed: its fingerprint was confirmed by the copy itself."""
        self.reval.confirm(fidx)
        sch = self.schedule
        sch.pending_next.discard(fidx)
        if sch.lru:
            return
        if not sch.wanted[fidx]:
            self.cache.evict(fidx)  # the view moved on while we copied
            return
        self.pusher.want(fidx)
        if sch.advance_requested and self.next_ready():
            self._switch()

    def _stage_gave_up(self, fidx: int) -> None:
        """A file of the next mini-epoch could not be staged (gone, unreadable, no room on the cache disk): the
        mini-epoch counts as staged without it, so ``advance=ready`` never waits for it (it is retried, and
        read from the backing meanwhile)."""
        self.schedule.pending_next.discard(fidx)
        if self.schedule.advance_requested and self.next_ready():
            self._switch()

    def _restage(self, fidx: int) -> None:
        """``fidx`` has no valid copy any more: stage it again if it is wanted."""
        sch = self.schedule
        if not sch.lru and sch.wanted[fidx]:
            if fidx in sch.next_files:
                sch.pending_next.add(fidx)
            self.stager.push_front(fidx)

    def _changed(self, fidx: int, st: os.stat_result) -> None:
        """The backing file now has stat ``st``: forget the old copy and pushed pages, stage it again."""
        self.tree.update_stat(fidx, st)
        self.data.changed_files.add(fidx)
        self.schedule.disk_sizes[fidx] = self.cache.estimate(st.st_size, st.st_blocks)
        self.cache.evict(fidx)
        self.pusher.forget(fidx)
        self._restage(fidx)
        self.data.mark_stale(fidx)



    def _revalidation_candidates(self) -> np.ndarray:
        sch = self.schedule
        if sch.lru:
            return np.fromiter(self.cache.entries.keys(), np.int64, len(self.cache.entries))
        if sch.view is None:
            return np.zeros(0, np.int64)
        nxt = [f for f in sch.next_files.tolist() if self.cache.get(f) is not None] if sch.next_files.size else []
        return np.concatenate([sch.unread(), np.asarray(nxt, np.int64)])

    def _revalidated(self, fidx: int, answer: object) -> str:
        """A background stat of ``fidx`` came back (see revalidate.py)."""
        if isinstance(answer, OSError):
            if answer.errno in (errno.ENOENT, errno.ENOTDIR):
                self.cache.evict(fidx)  # gone: the next open finds that out from the backing (ENOENT)
                self.data.mark_stale(fidx)
                return "changed"
            return "unknown"
        assert isinstance(answer, os.stat_result)
        if not stat.S_ISREG(answer.st_mode):
            self.cache.evict(fidx)
            self.data.mark_stale(fidx)
            return "changed"
        if fingerprint(answer) != fingerprint(self.tree.file_node(fidx).st):
            self._changed(fidx, answer)
            return "changed"
        return "same"

    async def _data_dir_lost(self) -> None:
        fd = await trio.to_thread.run_sync(self.cache.make_data_dir, limiter=self.cache_limiter)
        dropped = self.cache.replace_data_dir(fd)
        self.data.log_repair("data", f"the cache's data dir {self.cache.data_path} was removed: recreated, "
                         f"{len(dropped)} copies to stage again")
        self._entered()



    # =============================================================================================== reads

    async def open_file(self, fidx: int) -> FileHandle:
        return await self.data.open_file(fidx)

    async def read(self, handle: FileHandle, offset: int, size: int) -> bytes | bytearray:
        return await self.data.read(handle, offset, size)

    async def release(self, handle: FileHandle) -> None:
        await self.data.release(handle)

    async def lend(self, fidx: int) -> bytes | None:
        return await self.data.lend(fidx)

    def may_read_directly(self, uid: int) -> bool:
        """Whether a reader with ``uid`` may be given cached copies (the cache dir is 0700: ours, or root)."""
        return uid in (0, os.getuid())

    async def plan_text(self, uid: int) -> bytes:
        """The ``plan`` file for a reader with ``uid`` (see plans.py); ``EACCES`` for anyone who cannot open
        the copies."""
        if not self.may_read_directly(uid):
            raise PermissionError(errno.EACCES, "the batch plan is for the mount's user and root")
        return await self.data.plan()

    def check_consumed(self, plan_id: int, indices: list[int]) -> None:
        self.data.check_consumed(plan_id, indices)

    def consumed(self, plan_id: int, indices: list[int]) -> None:
        self.data.consumed(plan_id, indices)















    # =========================================================================================== namespace

    def file_inode(self, fidx: int) -> int:
        return self.tree.inode_of(fidx)

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
        child = self.tree.nodes[i]
        if child.kind == KIND_FILE:
            self.pusher.looked_up(parent_inode - 1, child.fidx)
        return i + 1

    def list_dir(self, inode: int) -> list[tuple[bytes, int]]:
        """A frozen listing (name, inode) for one ``opendir``; listing the root again ends a pass with reads."""
        if inode == CONTROL_INODES[b".tierfs"]:
            return [(n, i) for n, i in CONTROL_INODES.items() if n != b".tierfs"]
        node = self.node(inode)
        if node is None or node.kind != KIND_DIR:
            raise BackingError(errno.ENOTDIR, "not a directory")
        if inode == 1 and self.schedule.reads_in_pass:
            self.end_pass()
        assert self.view is not None
        return [(name, i + 1) for name, i in self.view.listing(inode - 1)]

    def listed(self, dir_inode: int) -> None:
        """The kernel got this directory's entries (readdirplus): push what lacked an inode."""
        if self.view is not None:
            mask = self.view.mask
            self.pusher.listed(dir_inode - 1, lambda f: bool(mask[f]))

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

    async def statvfs(self) -> os.statvfs_result | None:
        """The backing filesystem's figures; the last good ones while the backing does not answer."""
        with contextlib.suppress(OSError):
            self._statvfs = await self.backing.statvfs(timeout=STATFS_TIMEOUT)
        return self._statvfs

    # ==================================================================================== control & status

    @property
    def last_error(self) -> str | None:
        """What ``status`` shows: a staging error until staging works again, else the last control error."""
        return self.stager.error or self.journal.error or self.control_error or self.schedule.plan_note

    def control_text(self) -> bytes:
        return self.settings.as_lines().encode()

    def order_text(self) -> bytes:
        return self.view.order_text() if self.view is not None else b""

    def order0_text(self) -> bytes:
        return self.view.order0_text() if self.view is not None else b""

    def control_write(self, data: bytes) -> None:
        """Apply one write to the control file (see :func:`tierfs.control.apply_control`)."""
        apply_control(self, data)

    def check_plan(self, settings: Settings) -> None:
        """``ValueError`` if ``settings`` cannot plan the next epoch (a control write is then refused)."""
        self.schedule.plan_for(settings, self.pos.epoch + 1)

    def apply_settings(self, new: Settings, *, replan: bool) -> None:
        """Settings from a validated control write; ``replan``: nm/mini_epoch_size/composition changed."""
        old, self.settings = self.settings, new
        self.schedule.settings = new
        if new.revalidate != old.revalidate:
            self.reval.set(new.revalidate)
        if new.staging_streams != old.staging_streams:
            self.stager.tuner.set(new.staging_streams)
            self.stager.notify()
        if replan:
            self.schedule.replan(new, self._is_cached)
            self._entered()

    def rf_changed(self) -> None:
        """A new ``rf``: under ``advance=strict`` a mini-epoch already past it leaves at once."""
        if self.settings.advance == "strict" and self.pos.pass_index >= self.rf_now():
            self._switch()

    def notify(self) -> None:
        self.stager.notify()

    def status(self) -> Status:
        """One consistent snapshot of everything ``status`` and ``metrics`` show, from the parts' statistics."""
        return build_status(
            settings=self.settings, rf=self.rf_now(), next_ready=self.next_ready() if not self.schedule.lru else True,
            schedule=self.schedule.statistics(), data=self.data.statistics(), cache=self.cache.statistics(),
            stager=self.stager.statistics(), pusher=self.pusher.statistics(), backing=self.backing.statistics(),
            revalidation=self.reval.statistics(), arf=self.arf, last_error=self.last_error,
            tree=dict(self.tree_info),
        )

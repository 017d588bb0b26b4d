"""The tiering engine: the coordinator of a mount's parts.  It opens them and wires them together, runs their
background jobs, and tells each part what a landed, changed or gone file means for it; when a pass ends and the
next mini-epoch takes over is the pass rule's (:class:`~tierfs.daemon.schedule.passes.PassRule`).  operations.py
asks the :class:`~tierfs.daemon.serving.datapath.DataPath` (``data``) for file data, the
:class:`~tierfs.daemon.serving.namespace.Namespace` (``names``) for names, and the engine for settings, control
writes (:class:`~tierfs.daemon.coordinator.control_file.ControlTarget`) and the status snapshot.

**Wiring.**  :meth:`Engine.open` gives each part the parts it works with, as objects, and a typed events
interface, the Protocol in the part's own module (``StagerEvents``, ``DataPathEvents``, ``RevalidatorEvents``,
``PusherEvents``, ``PlannerEvents``, ``RescanEvents``, ``CacheEvents``, ``PassEvents``: this engine; the
namespace's ``NamespaceEvents`` and the data path's ``OpenCounter``: the pass rule).  No part is handed a
callable or imports this module, and mypy checks every events interface.  The settings in force live in one
:class:`~tierfs.common.options.LiveSettings` (``live``) that the parts read and a control write replaces.

Everything here runs on the one trio thread; worker threads only touch the disks and hand results back, so
state needs no locks and a status snapshot taken between two awaits is consistent.  Nothing on the trio thread
waits on the backing dir or the kernel (see datapath.py, pusher.py, calls.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable

import trio

from tierfs.common.options import LiveSettings, MountConfig, Settings, format_size
from tierfs.daemon.access import Steering
from tierfs.daemon.backing.calls import Backing
from tierfs.daemon.backing.revalidator import Revalidator
from tierfs.daemon.cache.journal import JournalWriter, Position, load_position
from tierfs.daemon.cache.store import CacheEntry, CacheStore, disk_estimates
from tierfs.daemon.coordinator.control_file import ControlWriter, apply_control
from tierfs.daemon.coordinator.status import Status, build_status
from tierfs.daemon.kernel.passthrough import BackingIds, KernelBackings
from tierfs.daemon.kernel.pusher import KernelCache, Pusher, push_budget
from tierfs.daemon.runtime.jobs import once, supervised
from tierfs.daemon.runtime.memory import HeapTrimmer
from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.schedule.arfs import Arf
from tierfs.daemon.schedule.consumers import ANONYMOUS, Consumers
from tierfs.daemon.schedule.loader_watch import LoaderWatch
from tierfs.daemon.schedule.passes import PassRule, rf_ceiling
from tierfs.daemon.schedule.planner import Planner
from tierfs.daemon.schedule.policy import ADVISE_WHOLE, POLICIES
from tierfs.daemon.schedule.schedule import Schedule, fit_default_nm, fit_remount_nm
from tierfs.daemon.serving.datapath import DataPath
from tierfs.daemon.serving.namespace import Namespace
from tierfs.daemon.serving.pins import PinKeeper
from tierfs.daemon.staging.peers import PeerGroup, PeerLink, PeerServer, plan_owners
from tierfs.daemon.staging.stager import Stager
from tierfs.daemon.tree.keeper import TreeKeeper, check_dirs
from tierfs.daemon.tree.tree import Growth, ScanCount, Tree

__all__ = ["Engine"]

log = logging.getLogger("tierfs")


class Engine:
    """See the module docstring.  ``mount.py``: ``open()``, then ``run()`` beside ``pyfuse3.main()``, ``close()``."""

    def __init__(self, config: MountConfig, link: PeerLink | None = None) -> None:
        self.config = config
        self.link = link  # (peers=mpi: this node's place in its group, joined before the mount opens)
        self.live = LiveSettings(config.settings)  # the one holder of the settings in force: the parts read it
        s = config.settings
        # (the kernel reads cached copies itself: those of 1 MiB or more under passthrough=auto, all under all)
        self.passthrough = BackingIds(asked=s.passthrough != "off",
                                      min_size=ADVISE_WHOLE if s.passthrough == "auto" else 0)
        self.cache = CacheStore(config.cache, config.capacity, events=self, registry=self.passthrough)
        self.cache_limiter = trio.CapacityLimiter(16)  # threads for cache-disk work (opens, hashes)
        self.root_fd = -1
        self.control_error: str | None = None
        self.task_failures: dict[str, str] = {}  # background tasks failing now, and why (jobs.supervised)
        self.journal = JournalWriter(self.cache)  # (through the cache dir's descriptor, once claim() opened it)
        self._opened = self._closed = False

    @property
    def settings(self) -> Settings:
        return self.live.current

    # ========================================================================================= lifecycle

    def open(self, scan_progress: Callable[[ScanCount], None] | None = None) -> None:
        """Load or scan the backing tree, refuse configurations that cannot work, open the cache, wire the
        parts, resume the journalled position."""
        cfg, s = self.config, self.settings
        self.steering = Steering.of_group(s.group)  # (who moves the schedule; a group that is not: refused now)
        backing = check_dirs(cfg)
        try:
            self.cache.claim()  # before the journal or the saved tree is read, and before anything is deleted
        except BaseException:
            self.cache.close()
            raise
        self.root_fd = os.open(backing, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        journalled = load_position(self.cache.dir_fd)
        same_nm = journalled is not None and journalled.nm_asked == s.nm
        pos = dataclasses.replace(journalled or Position(), nm_asked=s.nm)  # (the option: see fit_remount_nm)
        self.trees = TreeKeeper(self.root_fd, backing, self.cache.dir_fd, unlistable=s.unlistable,
                                stable_inodes=s.stable_inodes, rescan=s.rescan)
        try:
            self.tree = tree = self.trees.load(resumed=journalled is not None, progress=scan_progress)
            self.live.current = s = fit_default_nm(s, tree.n_files)
            disk = disk_estimates(tree.sizes, tree.blocks, self.cache.block)
            policy = POLICIES[s.policy]
            n = tree.n_files  # (plans cover the files, not the tree's room: see Schedule.planned_sizes)
            if same_nm and policy.walks_plans:
                self.live.current = s = fit_remount_nm(s, disk[:n], cfg.capacity)
            self.schedule = Schedule(tree, self.live, cfg.capacity, pos, disk, walks_plans=policy.walks_plans)
            # Peers: who owns each file (staged it in epoch 0), the same on every node; kept beyond its mini-epochs
            owners = plan_owners(disk[:n], tree.groups[:n], s, cfg.capacity,
                                 tree.n_slots) if self.link is not None else None
            self.peers = PeerGroup(self.link, tree, owners=owners, settings=s)
            self.policy = policy(self.schedule, self.cache, owned=self.peers.owned())
            self.policy.check_fits()
            self.cache.open(tree, need_digest=s.verify == "xxhash")
        except BaseException:
            os.close(self.root_fd)
            self.root_fd = -1
            self.cache.close()
            raise
        self._wire(backing, tree, pos)
        if self.trees.scanned:
            self.reval.confirm_all()  # the scan just read every fingerprint
        # (a saved tree's fingerprints are unconfirmed: opens ask until the revalidator or the rescan confirms)
        self.schedule.start(self.cache, rf_ceiling(s))
        # the copies a resumed cache holds of files no longer wanted: counted and said, thousands deleted after the
        # mount answers (cache.MOUNT_DELETES_AT_ONCE)
        self.cache.defer_deletes()
        self.entered()
        me, nm = self.schedule.pos, self.schedule.nm_in_force()
        self.cache.mount_deletes(f"of files outside the mini-epochs now wanted (mini-epoch {me.mini_epoch + 1}/{nm} "
                                 f"of epoch {me.epoch + 1}, where the mount resumes, and the next)")
        self._opened = True
        self.passes.save_journal()
        log.info("%d files, %s in the backing dir; %d copies kept in the cache",
                 tree.n_files, format_size(int(tree.sizes.sum())), len(self.cache.entries))

    def _wire(self, backing: str, tree: Tree, pos: Position) -> None:
        """The parts get the parts they work with, and this engine as their typed events (StagerEvents, ...)."""
        s, policy = self.settings, self.policy
        self.backing = Backing(self.root_fd, backing, tree, self.live)
        self.stager = Stager(tree, self.cache, self.backing, schedule=self.schedule, policy=self.policy,
                             settings=self.live, events=self, peers=self.peers)
        # (the kernel's caches are reached once the mount is up: attach_kernel)
        self.pusher = Pusher(tree, self.cache, KernelCache(), schedule=self.schedule, passthrough=self.passthrough,
                             budget=push_budget(), verify=s.verify == "xxhash", events=self)
        self.versions = self.pusher.versions  # which version of each file the kernel holds
        self.reval = Revalidator(tree, self.backing, policy=self.policy, settings=self.live, events=self)
        self.pins = PinKeeper(self.cache)  # lent copies, the batch plans' pass pins, peers' sends
        self.peer_server = PeerServer(self.peers, tree, self.cache, self.pins)
        self.consumers = Consumers(self.schedule, self.steering)  # (only those who steer are named)
        self.trimmer = HeapTrimmer()  # the heap's freed memory back to the system after the peaks
        self.planner = Planner(self.schedule, self.cache, events=self)
        self.loader_watch = LoaderWatch(enabled=policy.walks_plans, listing=s.listing, substitute=s.substitute)
        substitute = s.substitute and policy.walks_plans
        self.passes = PassRule(schedule=self.schedule, consumers=self.consumers, cache=self.cache, stager=self.stager,
                               planner=self.planner, loader_watch=self.loader_watch, journal=self.journal,
                               policy=policy, tree=tree, settings=self.live, steering=self.steering,
                               capacity=self.config.capacity, arf=Arf(Arf.controller_for(s), pos.arf_history),
                               substitute=substitute, events=self)
        self.data = DataPath(tree=tree, cache=self.cache, cache_limiter=self.cache_limiter, backing=self.backing,
                             reval=self.reval, stager=self.stager, pusher=self.pusher, schedule=self.schedule,
                             policy=self.policy, pins=self.pins, settings=self.live, passes=self.passes,
                             events=self, passthrough=self.passthrough)
        self.batch = self.data.batch  # the batch plans (control_file.py reports ``consumed`` to them)
        self.names = Namespace(tree, self.schedule, self.pusher, self.consumers, events=self.passes,
                               substitute=substitute)

    def attach_kernel(self, kernel: KernelCache, *, caches_listings: bool = False,
                      backings: KernelBackings | None = None) -> None:
        """The mount is up (fs.init): pushes and invalidations now reach the kernel, it may cache listings if
        pyfuse3 can ask it to, and read cached copies itself if pyfuse3 can register them (``backings``)."""
        self.pusher.attach(kernel)
        self.names.attach_kernel(caches_listings)
        self.passthrough.attach(backings)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Stage, push, revalidate, rescan, watch for a lost backing and for stuck copies, and return leases in the
        background until cancelled."""
        rescan = functools.partial(self.trees.run, self.tree, limiter=self.cache_limiter, events=self)
        self.schedule.plan_ahead(True)  # from now on a missing plan is the planner's, never a request's
        supervise = functools.partial(supervised, failures=self.task_failures)  # (one that keeps failing: last_error)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.data.run)  # (copies made beside their readers, closes after a reply)
                await nursery.start(self.versions.run)  # (old versions' invalidations)
                nursery.start_soon(once, "tree rescan", rescan)
                nursery.start_soon(supervise, "rescanner", functools.partial(
                    self.trees.follow, self.tree, limiter=self.cache_limiter, events=self))
                nursery.start_soon(supervise, "pin keeper", self.pins.run)
                nursery.start_soon(supervise, "cache deleter", self.cache.run_deletes)
                nursery.start_soon(supervise, "journal writer", functools.partial(self.journal.run,
                                                                                  self.cache_limiter))
                nursery.start_soon(supervise, "revalidator", self.reval.run)
                nursery.start_soon(supervise, "heap trimmer", self.trimmer.run)
                nursery.start_soon(supervise, "backing watch", self.backing.run)
                nursery.start_soon(supervise, "staging watch", self.stager.watch)  # (readers' copies too)
                if self.peers.enabled:
                    nursery.start_soon(supervise, "peer server", self.peer_server.run)
                if self.policy.walks_plans:
                    nursery.start_soon(supervise, "planner", self.planner.run)
                    nursery.start_soon(supervise, "pusher", self.pusher.run)
                    nursery.start_soon(supervise, "stager", self.stager.run)
                # (changed modes and owners told to the kernel; under substitute, stale entries dropped)
                nursery.start_soon(supervise, "kernel entries", self.names.run)
                task_status.started()
        finally:
            self.schedule.plan_ahead(False)
            self.journal.flush()  # what the writer had not written yet (and from now on, each save at once)

    def close(self) -> None:
        """Persist the journal and release the cache; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._opened:
            self.passes.save_journal()
            self.cache.save_index(self.tree)
        self.cache.close()
        if self._opened:
            self.peers.close()  # (its kept connections; an open that failed made none)
        if self.link is not None:
            self.link.close()
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    # ================================================================ the pass rule's and the parts' events

    def entered(self) -> None:
        """(PassEvents) A mini-epoch became current (mount, switch, replan): evict, re-queue staging and pushes."""
        sch = self.schedule
        self.policy.drop_unwanted()  # (the space it frees: the cache tells the stager)
        order = sch.staging_order()
        self.stager.reset(order)
        self.pusher.reset(order, sch.wanted)
        self.planner.notify()  # (a new epoch: plan the next one now, ready when its last mini-epoch needs it)

    def pass_ended(self) -> None:
        """(PassEvents) The batch plans' pins of the pass go."""
        self.batch.pass_over()

    def space_freed(self) -> None:
        """(CacheEvents) Copies are gone from the disk: staging may reserve their bytes (and, if it is still short
        of room, says so again: stage_blocked).  (Before the mount is open no stager waits.)"""
        if self._opened:
            self.stager.notify()

    def stage_blocked(self) -> None:
        """(StagerEvents) Nothing more fits until a switch frees space: the next mini-epoch may be as ready as it
        gets."""
        self.passes.advance_if_ready()

    def rf_now(self) -> int:
        """(StagerEvents) The rf in force, the pass rule's."""
        return self.passes.rf_now()

    def plan_landed(self) -> None:
        """(PlannerEvents) The plan the next mini-epoch waited for landed: the pass rule's to act on."""
        self.passes.plan_landed()

    # ==================================================================== what files mean for the parts
    # (the parts' events: StagerEvents, RevalidatorEvents, DataPathEvents, PusherEvents, RescanEvents)

    def landed(self, fidx: int, entry: CacheEntry) -> None:
        """A copy was committed: its fingerprint was confirmed by the copy itself."""
        self.reval.confirm(fidx)
        self.schedule.staged(fidx)
        if not self.policy.keeps(fidx):
            self.cache.evict(fidx)  # the view moved on while we copied
            return
        if self.policy.walks_plans:
            self.pusher.want(fidx)
        self.passes.advance_if_ready()

    def gave_up(self, fidx: int) -> None:
        """A file of the next mini-epoch could not be staged (gone, unreadable, no room on the cache disk, its copy
        stuck on the backing): the mini-epoch counts as staged without it, so ``advance=ready`` never waits for it
        (it is retried, and read from the backing meanwhile)."""
        self.schedule.staged(fidx)
        self.passes.advance_if_ready()

    def restage(self, fidx: int) -> None:
        """``fidx`` has no valid copy any more: stage it again if it is wanted ahead."""
        if self.policy.walks_plans and self.policy.keeps(fidx):
            self.schedule.unstaged(fidx)
            self.stager.push_front(fidx)

    def changed(self, fidx: int, st: os.stat_result) -> None:
        """The backing file now has stat ``st``: forget the old copy and pushed pages, stage it again."""
        self.cache.evict(fidx)  # (first: the old copy never outlives a change that failed to apply)
        self.tree.update_stat(fidx, st)
        self.schedule.set_disk_size(fidx, self.cache.estimate(st.st_size, st.st_blocks))
        self.pusher.forget(fidx)
        self.restage(fidx)
        self.versions.changed(fidx)  # (later handles bypass the page cache; the old version's pages go)
        self.planner.notify()  # (a plan that failed on its size may fit now)

    def drop_copy(self, fidx: int) -> None:
        """(RevalidatorEvents) ``fidx``'s copy and the kernel's pages may be an old version's: they go."""
        self.cache.evict(fidx)
        self.versions.mark_stale(fidx)
        self.restage(fidx)

    def gone(self, fidx: int) -> None:
        """The backing file is gone (or no longer a regular file): its copy goes; from now on it is in no view,
        listing or ``order``, never staged, and its open answers ENOENT; the pass that runs ends without it."""
        self.cache.evict(fidx)
        self.versions.mark_stale(fidx)
        if not self.tree.mark_gone(fidx):
            return
        if self.tree.gone_files == 1 or self.tree.gone_files % 1000 == 0:
            log.warning("%s is gone from the backing dir (%d files so far): left out of the mini-epochs; one that "
                        "comes back joins them again, as new files do, at a later epoch (rescan=epoch) or the next "
                        "mount", os.fsdecode(self.tree.file_path(fidx)), self.tree.gone_files)
        sch = self.schedule
        in_view = sch.view is not None and bool(sch.view.mask[fidx])
        sch.file_gone(fidx)
        self.passes.file_gone(fidx, in_view)
        self.planner.notify()  # (the next pass's view: made again without it)

    def grew(self, growth: Growth) -> None:
        """(RescanEvents) The tree took files new in the backing or back in it: their copies' sizes; the epochs
        after the next mini-epoch's are planned again with them, and they join as the first of those starts
        (policy=lru: at once, the next pass shows them)."""
        tree = self.tree
        for fidx in growth.taken:
            self.schedule.set_disk_size(fidx, self.cache.estimate(int(tree.sizes[fidx]), int(tree.blocks[fidx])))
        self.names.grew(growth.entries)
        if self.policy.walks_plans:
            self.schedule.grew()
        else:
            tree.join(growth.number)
        self.planner.notify()

    def running_epoch(self) -> int:
        """(RescanEvents) The epoch the position is in."""
        return self.schedule.pos.epoch

    def all_confirmed(self) -> None:
        """The rescan read every fingerprint."""
        self.reval.confirm_all()

    async def copy_damaged(self, entry: CacheEntry, reason: str) -> None:
        """The pusher found a copy damaged: a cache miss, repaired by the data path."""
        await self.data.repair(entry, reason)

    async def data_dir_lost(self) -> str | None:
        """``data/`` went: make it again and stage everything again; why not if it cannot be (None: done)."""
        try:
            fd = await in_thread(self.cache.make_data_dir, limiter=self.cache_limiter)
        except OSError as exc:
            why = exc.strerror or str(exc)
            self.data.log_repair("data-not-made", why)
            return why
        dropped = self.cache.replace_data_dir(fd)
        self.data.log_repair("data", f"the cache's data dir {self.cache.data_path} was removed: recreated, "
                             f"{len(dropped)} copies to stage again")
        self.entered()
        return None

    # ==================================================================================== control & status

    @property
    def last_error(self) -> str | None:
        """What ``status`` shows: a background task failing (a bug), a staging error until staging works again,
        else the last control error."""
        sch = self.schedule
        failing = next(iter(self.task_failures.values()), None)
        return failing or self.stager.error or self.journal.error or self.control_error or sch.plan_error \
            or sch.plan_note

    def control_text(self) -> bytes:
        return self.settings.as_lines().encode()

    def control_write(self, data: bytes, who: str = ANONYMOUS) -> None:
        """Apply one write to the control file (see :func:`tierfs.daemon.coordinator.control_file.apply_control`)."""
        apply_control(self, data, who)

    def control_writer(self, who: str = ANONYMOUS) -> ControlWriter:
        """What takes the writes of one open control file by consumer ``who`` (the kernel's pieces: see
        :mod:`tierfs.daemon.coordinator.control_file`)."""
        return ControlWriter(self, who)

    def check_plan(self, settings: Settings) -> None:
        """``ValueError`` if ``settings`` cannot plan the next epoch (a control write is then refused); a sum
        and a max over the sizes, no plan: the plan is made off the trio thread (planner.py)."""
        self.schedule.check(settings)

    def apply_settings(self, new: Settings, *, replan: bool) -> None:
        """Settings from a validated control write; ``replan``: nm/mini_epoch_size/composition changed."""
        old, self.live.current = self.live.current, new  # (every part reads the new ones from here on)
        if new.revalidate != old.revalidate:
            self.reval.notify()
        if new.staging_streams != old.staging_streams:
            self.stager.tuner.set(new.staging_streams)
            self.stager.notify()
        if replan:
            self.schedule.replan(self.cache)
            self.entered()
        self.passes.settings_changed()

    def notify(self) -> None:
        self.stager.notify()

    def status(self) -> Status:
        """One consistent snapshot of everything ``status`` and ``metrics`` show, from the parts' statistics."""
        passes = self.passes
        return build_status(
            mountpoint=self.config.mountpoint, settings=self.settings, rf=passes.rf_now(),
            rf_wanted=passes.rf_wanted(), rf_max=passes.rf_ceiling(), next_ready=passes.next_ready(),
            schedule=self.schedule.statistics(), data=self.data.statistics(), cache=self.cache.statistics(),
            stager=self.stager.statistics(), pusher=self.pusher.statistics(), backing=self.backing.statistics(),
            revalidation=self.reval.statistics(), pace=passes.pace.statistics(), arf=passes.arf,
            last_error=self.last_error, tree=self.trees.statistics(), loader=self.loader_watch.statistics(),
            substitution=self.names.substitution_statistics(),
            consumers=self.consumers.statistics(self.settings.consumer_timeout),
            peers=self.peers.statistics(self.cache),
            listings=self.names.listings.statistics(), memory=self.trimmer.statistics(),
            passthrough=self.passthrough.statistics(),
        )

"""The tiering engine: the coordinator of a mount's parts -- it wires them together and decides when the mount
moves on.

Its parts each own their state and report it (``statistics()``): the :class:`~tierfs.daemon.schedule.schedule.Schedule`
(plans, position, view, what is wanted), the cache policy (policy.py: ``met`` or ``lru``), the
:class:`~tierfs.daemon.cache.store.CacheStore`, the :class:`~tierfs.daemon.staging.stager.Stager`, the
:class:`~tierfs.daemon.kernel.pusher.Pusher` and
its :class:`~tierfs.daemon.kernel.pusher.KernelCache`, the :class:`~tierfs.daemon.backing.revalidator.Revalidator`, the
:class:`~tierfs.daemon.backing.calls.Backing`, the :class:`~tierfs.daemon.tree.keeper.TreeKeeper` and the journal
writer.  ``operations.py`` asks the :class:`~tierfs.daemon.serving.datapath.DataPath` (``data``) for file data and the
:class:`~tierfs.daemon.serving.namespace.Namespace`
(``names``) for names.  What is left here needs several parts at once: when a pass ends and the next
mini-epoch takes over, what a landed, changed or gone file means for each part, the control interface
(:class:`~tierfs.daemon.coordinator.control_file.ControlTarget`) and the status snapshot.

**Wiring.**  :meth:`Engine.open` gives each part the parts it works with, as objects, and this engine as its
typed events interface -- the Protocol in the part's own module that the engine implements
(:class:`~tierfs.daemon.staging.stager.StagerEvents`, :class:`~tierfs.daemon.serving.datapath.DataPathEvents`,
:class:`~tierfs.daemon.backing.revalidator.RevalidatorEvents`, :class:`~tierfs.daemon.kernel.pusher.PusherEvents`,
:class:`~tierfs.daemon.serving.namespace.NamespaceEvents`, :class:`~tierfs.daemon.schedule.planner.PlannerEvents`,
:class:`~tierfs.daemon.tree.keeper.RescanEvents`, :class:`~tierfs.daemon.cache.store.CacheEvents`): no part is handed a
callable, so
every call from one part to another is a method of a typed collaborator, and no part imports this module.  The
settings in force live in one :class:`~tierfs.common.options.LiveSettings` (``live``) that the parts read and a control
write replaces.

Everything here runs on the one trio thread; worker threads only touch the disks and hand results back, so
state needs no locks and a status snapshot taken between two awaits is consistent.  Nothing on the trio thread
waits on the backing dir or the kernel (see datapath.py, pusher.py, calls.py).

How a mount moves (policy ``met``): the *current* mini-epoch is what the root shows; the *next* one is staged
meanwhile, behind any file of the current one that is not cached yet.  A pass ends when every file of the
view was opened since it began, on ``next-pass``, or when the root is listed again after at least one open --
opens and listings by the mount's owner or root, who may write ``control`` (access.py); other users are served
without moving anyone's schedule.  Several jobs on one mount each count their own passes (consumers.py): the
mount's pass ends with the last live consumer's (``_catch_up``), and a job ahead waits in ``begin_pass``.
After ``rf`` passes the next mini-epoch takes over: with ``advance=ready`` once it is fully cached or at the
ceiling ``rf_max``, whichever comes first, with ``strict`` at once; ``advance`` (the command, or ARF) leaves as
soon as the next one is cached.  On a switch the previous mini-epoch is evicted, except open files, which go on
their last release.  Whether staging kept up is the :class:`~tierfs.daemon.schedule.pace_watch.PaceWatch`'s to show.
``lru``: policy.py.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable

import numpy as np
import trio

from sampler.iomodel import stall_free_rf
from tierfs.common.options import LiveSettings, MountConfig, Settings, format_size
from tierfs.common.protocol import RankShare
from tierfs.daemon.access import Steering
from tierfs.daemon.backing.calls import Backing
from tierfs.daemon.backing.revalidator import Revalidator
from tierfs.daemon.cache.journal import JournalWriter, Position, load_position
from tierfs.daemon.cache.store import CacheEntry, CacheStore, disk_estimates
from tierfs.daemon.coordinator.control_file import Arf, ConsumerArfs, ControlWriter, apply_control
from tierfs.daemon.coordinator.status import Status, build_status
from tierfs.daemon.kernel.passthrough import BackingIds, KernelBackings
from tierfs.daemon.kernel.pusher import KernelCache, Pusher, push_budget
from tierfs.daemon.runtime.memory import HeapTrimmer
from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.schedule.consumers import ALIVE_EVERY, ANONYMOUS, Consumer, Consumers
from tierfs.daemon.schedule.loader_watch import LoaderWatch
from tierfs.daemon.schedule.pace_watch import PaceWatch, Rates
from tierfs.daemon.schedule.planner import Planner
from tierfs.daemon.schedule.policy import ADVISE_WHOLE, POLICIES
from tierfs.daemon.schedule.schedule import Schedule, check_fits, fewest_mini_epochs
from tierfs.daemon.serving.datapath import DataPath
from tierfs.daemon.serving.namespace import Namespace
from tierfs.daemon.serving.pins import PinKeeper
from tierfs.daemon.staging.peers import PeerGroup, PeerLink, PeerServer, plan_owners
from tierfs.daemon.staging.stager import Stager
from tierfs.daemon.tree.keeper import TreeKeeper, check_dirs, once, supervised
from tierfs.daemon.tree.tree import Growth, ScanCount

__all__ = ["Engine"]

log = logging.getLogger("tierfs")


class Engine:
    """See the module docstring.  ``mount.py``: ``open()``, then ``run()`` beside ``pyfuse3.main()``, ``close()``."""

    def __init__(self, config: MountConfig, link: PeerLink | None = None) -> None:
        self.config = config
        self.link = link  # (peers=mpi: this node's place in its group, joined before the mount opens)
        self.live = LiveSettings(config.settings)  # the one holder of the settings in force: the parts read it
        self.cache = CacheStore(config.cache, config.capacity)
        self.cache_limiter = trio.CapacityLimiter(16)  # threads for cache-disk work (opens, hashes)
        self.root_fd = -1
        self.arf = Arf()  # the configured controller is made in open()
        self.control_error: str | None = None
        self.task_failures: dict[str, str] = {}  # background tasks failing now, and why (opening.supervised)
        self.journal = JournalWriter(self.cache)  # (through the cache dir's descriptor, once claim() opened it)
        self.pace = PaceWatch()  # whether staging keeps up: repeats beyond rf and stalls, put down to the tier
        self.consumer_arfs = ConsumerArfs()  # the named consumers' ARF controllers (the anonymous one's: ``arf``)
        self._moved = trio.Event()  # set when the mount's pass ends or its settings change: waiting consumers look
        self._nursery: trio.Nursery | None = None
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
        pos = journalled or Position()
        self.trees = TreeKeeper(self.root_fd, backing, self.cache.dir_fd, unlistable=s.unlistable,
                                stable_inodes=s.stable_inodes, rescan=s.rescan)
        same_nm = journalled is not None and journalled.nm_asked == s.nm  # (before it is overwritten)
        pos.nm_asked = s.nm  # (the option, journalled: see _fit_remount_nm)
        try:
            self.tree = tree = self.trees.load(resumed=journalled is not None, progress=scan_progress)
            s = self._fit_default_nm(tree.n_files)
            disk = disk_estimates(tree.sizes, tree.blocks, self.cache.block)
            policy = POLICIES[s.policy]
            n = tree.n_files  # (plans cover the files, not the tree's room: see Schedule.planned_sizes)
            if same_nm and policy.walks_plans:
                s = self._fit_remount_nm(disk[:n])
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
        # The parts get the parts they work with, and this engine as their typed events (StagerEvents, ...).
        self.backing = Backing(self.root_fd, backing, tree, self.live)
        self.arf = Arf(Arf.controller_for(s), pos.arf_history)
        self.stager = Stager(tree, self.cache, self.backing, schedule=self.schedule, policy=self.policy,
                             settings=self.live, events=self, peers=self.peers)
        # (the kernel's caches are reached once the mount is up: attach_kernel)
        self.pusher = Pusher(tree, self.cache, KernelCache(), schedule=self.schedule, stager=self.stager,
                             budget=push_budget(), verify=s.verify == "xxhash", events=self)
        self.versions = self.pusher.versions  # which version of each file the kernel holds
        self.reval = Revalidator(tree, self.backing, policy=self.policy, settings=self.live, events=self)
        self.pins = PinKeeper(self.cache, self.stager)  # lent copies, the batch plans' pass pins, peers' sends
        self.peer_server = PeerServer(self.peers, tree, self.cache, self.pins)
        # (the kernel reads cached copies itself: those of 1 MiB or more under passthrough=auto, all under all)
        self.passthrough = BackingIds(asked=s.passthrough != "off",
                                      min_size=ADVISE_WHOLE if s.passthrough == "auto" else 0)
        self.data = DataPath(tree=tree, cache=self.cache, cache_limiter=self.cache_limiter, backing=self.backing,
                             reval=self.reval, stager=self.stager, pusher=self.pusher, schedule=self.schedule,
                             policy=self.policy, pins=self.pins, settings=self.live, events=self,
                             passthrough=self.passthrough)
        self.batch = self.data.batch  # the batch plans (control.py reports ``consumed`` to them)
        self.consumers = Consumers(self.schedule, self.steering)  # (only those who steer are named)
        self.trimmer = HeapTrimmer()  # the heap's freed memory back to the system after the peaks
        self.names = Namespace(tree, self.schedule, self.pusher, self.consumers, events=self,
                               substitute=s.substitute and policy.walks_plans)
        self.planner = Planner(self.schedule, self.cache, events=self)
        self.loader_watch = LoaderWatch(enabled=policy.walks_plans, listing=s.listing, substitute=s.substitute)
        if self.trees.scanned:
            self.reval.confirm_all()  # the scan just read every fingerprint
        # (a saved tree's fingerprints are unconfirmed: opens ask until the revalidator or the rescan confirms)
        self.schedule.start(self.cache)
        # the copies a resumed cache holds of files no longer wanted: counted and said, thousands deleted after the
        # mount answers (cache.MOUNT_DELETES_AT_ONCE)
        self.cache.defer_deletes()
        self._entered()
        me, nm = self.schedule.pos, self.schedule.nm_in_force()
        self.cache.mount_deletes(f"of files outside the mini-epochs now wanted (mini-epoch {me.mini_epoch + 1}/{nm} "
                                 f"of epoch {me.epoch + 1}, where the mount resumes, and the next)")
        self._opened = True
        self.save_journal()
        log.info("%d files, %s in the backing dir; %d copies kept in the cache",
                 tree.n_files, format_size(int(tree.sizes.sum())), len(self.cache.entries))

    def _fit_default_nm(self, n_files: int) -> Settings:
        """The default nm on a data set of fewer files is lowered to one file a mini-epoch, and said: defaults
        must work on any data set.  An nm that was given (any other value) and is too large is refused with
        the most that works (``Schedule.check``)."""
        s = self.settings
        default = Settings().nm
        if s.mini_epoch_size is None and s.nm == default and 0 < n_files < default:
            log.warning("nm=%d (the default) is more mini-epochs than the data set has files: mounted with nm=%d, "
                        "one file each", default, n_files)
            self.live.current = s = dataclasses.replace(s, nm=n_files)
        return s

    def _fit_remount_nm(self, disk: np.ndarray) -> Settings:
        """A remount (the cache dir has a journal) with the nm option of the mount before, over a data set that
        changed so that nm no longer fits the capacity (it grew) or exceeds its files (it shrank): mounted with
        the fewest mini-epochs that fit, and said, so that an fstab or systemd mount keeps coming back.  A first
        mount, or one given another nm than the last, is refused instead, with the fix: its settings are the
        user's choice of a moment ago (``policy.check_fits``)."""
        s, capacity = self.settings, self.config.capacity
        if s.mini_epoch_size is not None:
            return s  # (the planner picks the count: it always fits)
        try:
            check_fits(disk, s, capacity)
            return s
        except ValueError as exc:
            why = str(exc)
        try:
            nm = fewest_mini_epochs(disk, s, capacity)
        except ValueError:
            return s  # (nothing fits: the refusal says why)
        log.warning("the data set changed since this cache dir was last mounted: %s; mounted with nm=%d instead of "
                    "%d (give nm=%d, or a larger capacity, to keep this from being said)", why, nm, s.nm, nm)
        self.live.current = s = dataclasses.replace(s, nm=nm)
        return s

    def attach_kernel(self, kernel: KernelCache, *, caches_listings: bool = False,
                      backings: KernelBackings | None = None) -> None:
        """The mount is up (fs.init): pushes and invalidations now reach the kernel, it may cache listings if
        pyfuse3 can ask it to, and read cached copies itself if pyfuse3 can register them (``backings``)."""
        self.pusher.kernel = kernel
        self.names.listings.available = caches_listings
        self.passthrough.attach(backings)
        self.cache.registry = self.passthrough
        self.pusher.passthrough = self.passthrough

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Stage, push, revalidate, rescan, watch for a lost backing and for stuck copies, and return leases in the
        background until cancelled."""
        rescan = functools.partial(self.trees.run, self.tree, limiter=self.cache_limiter, events=self)
        self.schedule.plans_ahead = True  # from now on a missing plan is the planner's, never a request's
        supervise = functools.partial(supervised, failures=self.task_failures)  # (one that keeps failing: last_error)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = self.data.nursery = self.versions.nursery = nursery
                nursery.start_soon(once, "tree rescan", rescan)
                nursery.start_soon(supervise, "rescanner", functools.partial(
                    self.trees.follow, self.tree, limiter=self.cache_limiter, events=self))
                nursery.start_soon(supervise, "pin keeper", self.pins.run)
                nursery.start_soon(supervise, "cache deleter", functools.partial(self.cache.run_deletes, self))
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
            self._nursery = self.data.nursery = self.versions.nursery = None
            self.schedule.plans_ahead = False
            self.journal.flush()  # what the writer had not written yet

    async def stop_kernel_calls(self, timeout: float) -> bool:
        """The mount is stopping: no more pushes or invalidations, and up to ``timeout`` seconds for the one in
        flight to return while the main loop still serves (see pusher.py).  False if one is still in the
        kernel: only aborting the connection frees it then."""
        return await self.pusher.kernel.close(timeout)

    @property
    def kernel_call_stuck(self) -> bool:
        """A push or an invalidation is still inside the kernel (after :meth:`stop_kernel_calls` gave up)."""
        return self.pusher.kernel.in_kernel

    def close(self) -> None:
        """Persist the journal and release the cache; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._opened:
            self._nursery = None
            self.save_journal()
            self.cache.save_index(self.tree)
        self.cache.close()
        if self.link is not None:
            self.link.close()
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    # ====================================================================================== moving on

    @property
    def last_pass(self) -> tuple[int, int] | None:
        return self.schedule.last_pass

    @property
    def current_mini_epoch(self) -> tuple[int, int]:
        return self.schedule.pos.epoch, self.schedule.pos.mini_epoch

    def _entered(self) -> None:
        """A mini-epoch became current (mount, switch, replan): evict, re-queue staging and pushes."""
        sch = self.schedule
        if self.policy.drop_unwanted():
            self.stager.notify()
        order = sch.staging_order()
        self.stager.reset(order)
        self.pusher.reset(order, sch.wanted)
        self.planner.notify()  # (a new epoch: plan the next one now, ready when its last mini-epoch needs it)

    def rf_now(self) -> int:
        """The rf in force: the setting, or with ``auto`` the IO model's (:meth:`rf_wanted`) within the ceiling."""
        rf = self.settings.rf
        if rf == "auto":
            return min(self.rf_wanted() or 1, self.rf_ceiling())
        return int(rf)

    def rf_wanted(self) -> int | None:
        """The smallest stall-free rf from the rates measured so far (the paper's ``rf >= EB1/B2``, no ceiling);
        None until both are measured."""
        staging, consumption = self.stager.bytes_per_s(), self.schedule.consumption_bps
        return stall_free_rf(consumption, staging) if staging > 0 and consumption > 0 else None

    def rf_ceiling(self) -> int:
        """The most passes a mini-epoch gets, whatever ``advance=ready`` waits for: ``rf_max``, never below an
        integer ``rf`` (what the user set is what they get)."""
        rf = self.settings.rf
        return self.settings.rf_max if rf == "auto" else max(self.settings.rf_max, int(rf))

    def next_ready(self) -> bool:
        """The next mini-epoch is cached, or as much of it as fits: staging is stuck on space that only a
        switch can free (a mini-epoch a little over half the cache).  Never while its epoch is being planned;
        always under lru (no next one)."""
        if self.schedule.next_coords is None:
            return False
        if not self.schedule.pending_next:
            return True
        return (self.stager.blocked and not self.stager.inflight and not self.cache.doomed_bytes
                and not self.cache.deleting_bytes)

    def _advance_if_ready(self) -> None:
        """An ``advance`` waits for the next mini-epoch: go now if it is ready (staging landed, gave up or
        stopped on space)."""
        if self.schedule.advance_requested and self.next_ready():
            self._switch()

    def space_freed(self) -> None:
        """(CacheEvents) Evicted copies are gone from the disk: staging may reserve their bytes (and, if it is
        still short of room, says so again: stage_blocked)."""
        self.stager.notify()

    def stage_blocked(self) -> None:
        """(StagerEvents) Nothing more fits until a switch frees space: the next mini-epoch may be as ready as it
        gets."""
        self._advance_if_ready()

    def end_pass(self) -> None:
        """The current pass is over (all read, ``next-pass``, the root listed again): count it, move on.

        After ``rf`` passes the next mini-epoch takes over: at once under ``advance=strict``, once it is staged
        under ``ready`` -- but never past the ceiling (:meth:`rf_ceiling`): there the switch is made all the same,
        and what is not staged yet is fetched as readers open it (their wait counts in ``stall_seconds``)."""
        sch = self.schedule
        limit = sch.end_pass(self.rf_now())  # (never under lru: its passes do not switch)
        self.batch.pass_over()
        forced = limit and (self.settings.advance == "strict" or sch.pos.pass_index >= self.rf_ceiling())
        if limit and sch.next_coords is not None:  # (a next mini-epoch waiting for its plan: the planner's)
            if not self.next_ready():
                self.pace.behind(self._rates(), stalled=forced)
            elif sch.pos.pass_index <= self.rf_now():
                self.pace.kept_up()
        if ((forced or ((limit or sch.advance_requested) and self.next_ready()))
                and self._switch_when_planned()):
            return
        sch.new_view()
        self.planner.notify()  # (the view of the pass after this one: made ahead)
        self.consumers.mount_pass_over()
        self._wake_waiters()
        self.save_journal()

    def _rates(self) -> Rates:
        s = self.settings
        return Rates(self.stager.bytes_per_s(), self.schedule.consumption_bps, self.rf_now(), s.rf,
                     self.rf_ceiling(), s.bandwidth, self.config.capacity, int(self.tree.sizes.sum()))

    def _switch_when_planned(self) -> bool:
        """Switch now (True), or, while the next epoch is being planned (only ``advance=strict`` switches then),
        mark the switch due: the last mini-epoch is shown again meanwhile, and the switch is made when the plan
        lands (:meth:`_planned`) or at the end of that pass.  The request that ended the pass never plans."""
        if self.schedule.next_coords is None:
            self.schedule.pos.switch_due = True
            return False
        self._switch()
        return True

    def plan_landed(self) -> None:
        """(PlannerEvents) The plan the next mini-epoch waited for landed: make the switch that was due if no file
        of the pass shown meanwhile was opened yet (never under a reader's feet: else at that pass's end), or
        stage it."""
        sch = self.schedule
        if sch.pos.switch_due and not sch.reads_in_pass:
            self._switch()
        else:
            self._entered()
            self._advance_if_ready()

    def _switch(self) -> None:
        """The next mini-epoch takes over; the previous one is evicted (open files on release)."""
        self.schedule.switch(self.cache)
        self.consumers.mini_epoch_over()
        self._wake_waiters()
        self._entered()
        self.batch.pass_over()  # (after the eviction: a copy a plan named goes now, by its own name)
        self.save_journal()
        log.debug("mini-epoch %d of epoch %d", self.schedule.pos.mini_epoch, self.schedule.pos.epoch)

    def request_advance(self) -> None:
        """Leave the current mini-epoch as soon as the next one is cached (now, if it is)."""
        if self.policy.walks_plans:
            self.schedule.advance_requested = True
            self._advance_if_ready()

    def save_journal(self) -> None:
        """Journal the position: handed to the background writer while mounted (never a disk write on the trio
        thread), written at once otherwise (engine tests, close)."""
        pos = self.schedule.pos
        pos.arf_history = list(self.arf.history)  # (the controller keeps the last HISTORY_KEPT)
        pos.last_pass = list(self.last_pass) if self.last_pass is not None else None
        self.journal.save(pos)
        if self._nursery is None:
            self.journal.flush()

    def file_opened(self, fidx: int, size: int, uid: int, who: str = ANONYMOUS) -> None:
        """(DataPathEvents) User ``uid``, consumer ``who``, opened ``fidx``: pass accounting."""
        # Only those who may write ``control`` move the schedule: another user's reads are served, not counted.
        if not self.steering.steers(uid):
            return
        sch = self.schedule
        in_view = sch.view is not None and bool(sch.view.mask[fidx])
        readers = max(1, len(self.consumers.live()))
        if sch.view is not None:
            # A pass-worth of opens: every consumer's pass.  Under substitute a loader reads every name, and a
            # pass ends once each view file was served in its folder: a pass-worth is the names, not the view.
            worth = self.tree.n_files if self.names.substitutions is not None else len(sch.view)
            self.loader_watch.opened(in_view, sch.pos.passes_total, worth * readers)
        sch.record_open(fidx, size / readers)  # (consumption: one consumer's pass per pass of the mount)
        if sch.whole_view_due():
            sch.want_whole_view(self.rf_now())
            self.planner.notify()  # (view=full: the next pass's order, made ahead while this pass ends)
        c = self.consumers.get(who)
        if self.consumers.opened(c, fidx, in_view):
            self._consumer_pass_over(c)

    def root_relisted(self, uid: int, who: str = ANONYMOUS) -> None:
        """(NamespaceEvents) The root was listed: that ends the lister's pass if it opened a file in it.  (The same
        rule for listings as for opens: another user's ``ls`` of the root never ends anyone's pass.)"""
        if self._relisting_ends_passes(uid):
            c = self.consumers.get(who)
            if c.reads_in_pass:
                self._consumer_pass_over(c)

    def _relisting_ends_passes(self, uid: int) -> bool:
        # Under listing=all a root listing is a dataset being built once -- each rank of a job builds its own, a
        # late one after the others began the pass -- never the start of an epoch: it ends nothing.
        return self.settings.listing != "all" and self.steering.steers(uid)

    def _consumer_pass_over(self, c: Consumer) -> None:
        """Consumer ``c``'s pass ended: the mount's ends with the last live consumer's (see consumers.py)."""
        if c.state != "live":
            c.new_pass(self.schedule.view_files())
            return
        self.consumers.pass_over(c)
        self._catch_up()

    def _catch_up(self) -> None:
        """End the mount's pass as long as every live consumer is past it (after a pass end or a drop: a switch
        makes them all start again at 0)."""
        while True:
            fewest = self.consumers.min_passes()
            if fewest is None or fewest <= self.schedule.pos.pass_index:
                return
            self.end_pass()

    def _wake_waiters(self) -> None:
        self._moved.set()
        self._moved = trio.Event()

    def _ahead(self, c: Consumer) -> bool:
        """``c`` made its rf passes and is ahead of the mount: its next pass waits for the others."""
        return (self.policy.walks_plans and c.state == "live" and c.passes >= self.rf_now()
                and c.passes > self.schedule.pos.pass_index)

    async def begin_pass(self, uid: int, who: str, *, relisted: bool) -> None:
        """(NamespaceEvents) Consumer ``who`` starts reading a view: it listed the root (``relisted``: that ends its
        pass if it opened a file in it) or opened ``order``.  Ahead of the others, it waits here for the mount to
        move on, at most ``consumer_timeout`` seconds: then the live consumers that hold the mount back are
        dropped -- at once those none of whose processes is alive (looked at every ``ALIVE_EVERY`` seconds)."""
        if not self.steering.steers(uid):
            return
        c = self.consumers.get(who)
        self.consumers.rejoin(c)
        if relisted and c.reads_in_pass and self._relisting_ends_passes(uid):
            self._consumer_pass_over(c)
        if not self._ahead(c):
            return
        c.waiting_since = time.monotonic()
        try:
            with trio.move_on_after(self.settings.consumer_timeout):
                while self._ahead(c):
                    self._drop_gone(self.consumers.behind(self.schedule.pos.pass_index))
                    if self._ahead(c):
                        with trio.move_on_after(ALIVE_EVERY):
                            await self._moved.wait()
            if self._ahead(c):
                self._drop_laggards(c)
        finally:
            c.waiting_since = None

    def _drop_laggards(self, waiter: Consumer) -> None:
        """``waiter`` waited ``consumer_timeout``: every live consumer the mount's pass waits for is dropped."""
        for c in self.consumers.behind(self.schedule.pos.pass_index):
            self.consumers.drop(c, f"{waiter.name} waited {self.settings.consumer_timeout:g} s (consumer_timeout) "
                                   f"while it had made {c.passes} of {self.rf_now()} passes (its last open or "
                                   f"listing {time.time() - c.last_seen:.0f} s ago)")
        self._catch_up()

    def _drop_gone(self, among: list[Consumer]) -> None:
        """Drop the consumers of ``among`` none of whose processes is alive (exited, killed): waiting for them would
        wait ``consumer_timeout`` for nobody."""
        gone = [(c, why) for c in among if (why := self.consumers.gone(c)) is not None]
        for c, why in gone:
            self.consumers.drop(c, why)
        if gone:
            self._catch_up()

    def next_pass(self, who: str = ANONYMOUS) -> None:
        """``next-pass`` written by consumer ``who``: its pass ends; written by anyone else (an operator), every
        live consumer's; with no consumer live, the mount's."""
        c = self.consumers.get(who)
        if c.state == "live":
            self._consumer_pass_over(c)
        elif self.consumers.live():
            for x in self.consumers.live():
                self.consumers.pass_over(x)
            self._catch_up()
        else:
            self.end_pass()

    def rank_share_done(self, share: RankShare, who: str = ANONYMOUS) -> None:
        """``next-pass pass=P rank=R/W`` written by consumer ``who``: once all its W ranks said so about the pass
        that runs, its pass ends as on ``next-pass`` (the files their loaders dropped will not be read)."""
        if self.consumers.share_done(self.consumers.get(who), share):
            log.info("pass %d ended: all %d ranks of consumer %s finished their shares", share.passes_total,
                     share.world, who)
            self.next_pass(who)

    def arf_of(self, who: str) -> Arf:
        """The ARF controller fed by consumer ``who``'s ``feedback`` (the anonymous consumer's is the mount's)."""
        return self.arf if who == ANONYMOUS else self.consumer_arfs.of(who, self.settings)

    def arf_advance(self, who: str) -> None:
        """Consumer ``who``'s ARF says advance: leave the mini-epoch when every live consumer's ARF says so."""
        if self.consumers.vote_advance(self.consumers.get(who)):
            self.request_advance()

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
        self._advance_if_ready()

    def gave_up(self, fidx: int) -> None:
        """A file of the next mini-epoch could not be staged (gone, unreadable, no room on the cache disk, its copy
        stuck on the backing): the mini-epoch counts as staged without it, so ``advance=ready`` never waits for it
        (it is retried, and read from the backing meanwhile)."""
        self.schedule.staged(fidx)
        self._advance_if_ready()

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
        if in_view:
            for c in self.consumers.file_gone(fidx):
                self._consumer_pass_over(c)
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
        self._entered()
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
            self._entered()
        self._wake_waiters()  # (a new rf: a waiting consumer looks again)

    def rf_changed(self) -> None:
        """A new ``rf``, ``rf_max`` or ``advance``: a mini-epoch already past what it may get now (``rf`` under
        ``strict``, the ceiling under ``ready``) leaves at once."""
        limit = self.rf_now() if self.settings.advance == "strict" else self.rf_ceiling()
        if self.policy.walks_plans and self.schedule.pos.pass_index >= limit:
            self._switch_when_planned()

    def notify(self) -> None:
        self.stager.notify()

    def status(self) -> Status:
        """One consistent snapshot of everything ``status`` and ``metrics`` show, from the parts' statistics."""
        return build_status(
            mountpoint=self.config.mountpoint, settings=self.settings, rf=self.rf_now(), rf_wanted=self.rf_wanted(),
            rf_max=self.rf_ceiling(), next_ready=self.next_ready(),
            schedule=self.schedule.statistics(), data=self.data.statistics(), cache=self.cache.statistics(),
            stager=self.stager.statistics(), pusher=self.pusher.statistics(), backing=self.backing.statistics(),
            revalidation=self.reval.statistics(), pace=self.pace.statistics(), arf=self.arf,
            last_error=self.last_error, tree=self.trees.statistics(), loader=self.loader_watch.statistics(),
            substitution=self.names.substitution_statistics(),
            consumers=self.consumers.statistics(self.settings.consumer_timeout),
            peers=self.peers.statistics(self.cache),
            listings=self.names.listings.statistics(), memory=self.trimmer.statistics(),
            passthrough=self.passthrough.statistics(),
        )

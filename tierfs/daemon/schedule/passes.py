"""The pass rule: when a pass ends, how many passes a mini-epoch gets, when the next one takes over, whose turn it
is, and what the ARF controllers vote.  One part, :class:`PassRule`, decides all of it; it hears the opens (the
data path) and the listings (the namespace) itself, and is the one that moves the schedule's position.

**A pass** ends when every file of the view was opened since it began, on ``next-pass``, or when the root is
listed again after at least one open -- opens and listings by the mount's owner or root, who may write
``control``, or by the steering group (access.py); other users are served without moving anyone's schedule.
Under ``listing=all`` a root listing ends nothing: it is a dataset being built once.

**Several jobs on one mount** each count their own passes (consumers.py): the mount's pass ends with the last
live consumer's (:meth:`PassRule._catch_up`); a job that made its ``rf`` passes and is ahead of the mount waits in
:meth:`PassRule.begin_pass` for the others, at most ``consumer_timeout`` seconds, after which the consumers it
waited for are dropped (at once those none of whose processes is alive).

**After ``rf`` passes** (``rf=auto``: the IO model's stall-free rf from the measured rates, within the ceiling)
the next mini-epoch takes over: with ``advance=ready`` once it is fully cached (or staging is stuck on space only
a switch frees), but never past the ceiling ``rf_max``; with ``strict`` at once.  ``advance`` (the command, or
every live consumer's ARF controller voting so after ``feedback``) leaves as soon as the next one is cached.
While the next epoch is being planned the switch is marked due (journalled) and made when the plan lands, or at
the end of the pass shown meanwhile (never under a reader's feet).  On a switch the engine evicts the previous
mini-epoch and re-queues staging and pushes (:class:`PassEvents`).  Whether staging kept up is told to the
:class:`~tierfs.daemon.schedule.pace_watch.PaceWatch` at each pass end.

Everything here runs on the trio thread and never waits on a disk; the journal is handed to its writer.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import trio

from sampler.iomodel import stall_free_rf
from tierfs.common.options import LiveSettings, Settings
from tierfs.common.protocol import RankShare
from tierfs.daemon.access import Steering
from tierfs.daemon.cache.journal import JournalWriter
from tierfs.daemon.cache.store import CacheStore
from tierfs.daemon.schedule.arfs import Arf, ConsumerArfs
from tierfs.daemon.schedule.consumers import ALIVE_EVERY, ANONYMOUS, Consumer, Consumers
from tierfs.daemon.schedule.loader_watch import LoaderWatch
from tierfs.daemon.schedule.pace_watch import PaceWatch, Rates
from tierfs.daemon.schedule.planner import Planner
from tierfs.daemon.schedule.policy import CachePolicy
from tierfs.daemon.schedule.schedule import Schedule
from tierfs.daemon.tree.tree import Tree

__all__ = ["PassEvents", "PassRule", "StagingProgress", "rf_ceiling"]

log = logging.getLogger("tierfs")


class PassEvents(Protocol):
    """What the pass rule tells the engine."""

    def entered(self) -> None:
        """A mini-epoch became current (a switch, or the plan it waited for landed): evict and re-queue."""

    def pass_ended(self) -> None:
        """A pass ended (and, after a switch, the previous mini-epoch was evicted): its pass pins go."""


class StagingProgress(Protocol):
    """What the pass rule asks the stager (:class:`~tierfs.daemon.staging.stager.Stager`)."""

    def bytes_per_s(self) -> float: ...

    def stuck_on_space(self) -> bool: ...


def rf_ceiling(settings: Settings) -> int:
    """The most passes a mini-epoch gets, whatever ``advance=ready`` waits for: ``rf_max``, never below an integer
    ``rf`` (what the user set is what they get)."""
    rf = settings.rf
    return settings.rf_max if rf == "auto" else max(settings.rf_max, int(rf))


class PassRule:
    """See the module docstring.  Made by the engine once the schedule, the consumers, the stager and the
    planner are; the namespace and the data path report listings and opens to it."""

    def __init__(self, *, schedule: Schedule, consumers: Consumers, cache: CacheStore, stager: StagingProgress,
                 planner: Planner, loader_watch: LoaderWatch, journal: JournalWriter, policy: CachePolicy,
                 tree: Tree, settings: LiveSettings, steering: Steering, capacity: int, arf: Arf,
                 substitute: bool, events: PassEvents) -> None:
        self.schedule = schedule
        self.consumers = consumers
        self.cache = cache
        self.stager = stager
        self.planner = planner
        self.loader_watch = loader_watch
        self.journal = journal
        self.policy = policy
        self.tree = tree
        self.live = settings
        self.steering = steering
        self.capacity = capacity
        self.arf = arf  # the anonymous consumer's ARF controller: the mount's own
        self.consumer_arfs = ConsumerArfs()  # the named consumers'
        self.substitute = substitute  # (names served as view files: a pass-worth of opens is the names)
        self.events = events
        self.pace = PaceWatch()  # whether staging keeps up: repeats beyond rf and stalls, put down to the tier
        self._moved = trio.Event()  # set when the mount's pass ends or its settings change: waiting consumers look

    @property
    def settings(self) -> Settings:
        return self.live.current

    @property
    def last_pass(self) -> tuple[int, int] | None:
        return self.schedule.last_pass

    @property
    def current_mini_epoch(self) -> tuple[int, int]:
        return self.schedule.pos.epoch, self.schedule.pos.mini_epoch

    # ================================================================================= rf and its ceiling

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
        return rf_ceiling(self.settings)

    def next_ready(self) -> bool:
        """The next mini-epoch is cached, or as much of it as fits: staging is stuck on space that only a
        switch can free (a mini-epoch a little over half the cache).  Never while its epoch is being planned;
        always under lru (no next one)."""
        if self.schedule.next_coords is None:
            return False
        if not self.schedule.pending_next:
            return True
        return self.stager.stuck_on_space() and not self.cache.space_coming()

    def rf_changed(self) -> None:
        """A new ``rf``, ``rf_max`` or ``advance``: a mini-epoch already past what it may get now (``rf`` under
        ``strict``, the ceiling under ``ready``) leaves at once."""
        limit = self.rf_now() if self.settings.advance == "strict" else self.rf_ceiling()
        if self.policy.walks_plans and self.schedule.pos.pass_index >= limit:
            self._switch_when_planned()

    # ============================================================================== a pass ends, a switch

    def end_pass(self) -> None:
        """The mount's pass is over (all read, ``next-pass``, the root listed again): count it, move on.

        After ``rf`` passes the next mini-epoch takes over: at once under ``advance=strict``, once it is staged
        under ``ready`` -- but never past the ceiling: there the switch is made all the same, and what is not
        staged yet is fetched as readers open it (their wait counts in ``stall_seconds``)."""
        sch = self.schedule
        limit = sch.end_pass(self.rf_now())  # (never under lru: its passes do not switch)
        self.events.pass_ended()
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
                     self.rf_ceiling(), s.bandwidth, self.capacity, int(self.tree.sizes.sum()))

    def _switch_when_planned(self) -> bool:
        """Switch now (True), or, while the next epoch is being planned (only ``advance=strict`` switches then),
        mark the switch due: the last mini-epoch is shown again meanwhile, and the switch is made when the plan
        lands (:meth:`plan_landed`) or at the end of that pass.  The request that ended the pass never plans."""
        if self.schedule.next_coords is None:
            self.schedule.mark_switch_due()
            return False
        self._switch()
        return True

    def plan_landed(self) -> None:
        """The plan the next mini-epoch waited for landed: make the switch that was due if no file of the pass
        shown meanwhile was opened yet (never under a reader's feet: else at that pass's end), or stage it."""
        sch = self.schedule
        if sch.pos.switch_due and not sch.reads_in_pass:
            self._switch()
        else:
            self.events.entered()
            self.advance_if_ready()

    def _switch(self) -> None:
        """The next mini-epoch takes over; the previous one is evicted (open files on release)."""
        self.schedule.switch(self.cache)
        self.consumers.mini_epoch_over()
        self._wake_waiters()
        self.events.entered()
        self.events.pass_ended()  # (after the eviction: a copy a plan named goes now, by its own name)
        self.save_journal()
        log.debug("mini-epoch %d of epoch %d", self.schedule.pos.mini_epoch, self.schedule.pos.epoch)

    def advance_if_ready(self) -> None:
        """An ``advance`` waits for the next mini-epoch: go now if it is ready (staging landed, gave up or
        stopped on space)."""
        if self.schedule.advance_requested and self.next_ready():
            self._switch()

    def request_advance(self) -> None:
        """Leave the current mini-epoch as soon as the next one is cached (now, if it is)."""
        if self.policy.walks_plans:
            self.schedule.request_advance()
            self.advance_if_ready()

    def settings_changed(self) -> None:
        """New settings are in force: a consumer waiting for its turn looks again (a new rf)."""
        self._wake_waiters()

    def save_journal(self) -> None:
        """Journal the position, with the ARF history (handed to the background writer while it runs)."""
        self.journal.save(self.schedule.journal_position(self.arf.history))

    # ======================================================================= opens and listings: turns

    def file_opened(self, fidx: int, size: int, uid: int, who: str = ANONYMOUS) -> None:
        """(the data path's OpenCounter) User ``uid``, consumer ``who``, opened ``fidx``: pass accounting."""
        # Only those who may write ``control`` move the schedule: another user's reads are served, not counted.
        if not self.steering.steers(uid):
            return
        sch = self.schedule
        in_view = sch.view is not None and bool(sch.view.mask[fidx])
        readers = max(1, len(self.consumers.live()))
        if sch.view is not None:
            # A pass-worth of opens: every consumer's pass.  Under substitute a loader reads every name, and a
            # pass ends once each view file was served in its folder: a pass-worth is the names, not the view.
            worth = self.tree.n_files if self.substitute else len(sch.view)
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
        self.consumers.waits(c, True)
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
            self.consumers.waits(c, False)

    def file_gone(self, fidx: int, in_view: bool) -> None:
        """``fidx`` left the backing (the schedule forgot it): the consumers whose pass waited only for it are
        through."""
        if in_view:
            for c in self.consumers.file_gone(fidx):
                self._consumer_pass_over(c)

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

    # ================================================================================ control commands

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

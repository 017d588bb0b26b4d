"""The schedule: plans per epoch, the position (epoch, mini-epoch, pass), and what the mount shows and wants.

Plain Python and numpy, no trio and no I/O: the engine asks it what the current view is, which files are
wanted (the current and the next mini-epoch), which of the next one are still to be staged, and tells it what
was opened and staged.  The decision *when* to switch needs the cache's state too, so :meth:`end_pass` only
says whether the pass limit is reached and the pass rule decides (passes.py); it is the one that moves the
position (``end_pass``, ``switch``, ``mark_switch_due``, ``request_advance``).

With ``walks_plans`` (policy ``met``) it walks the mini-epochs of the sampler's plans.  Without (``lru``) there
is no plan: the view is the whole tree and nothing is wanted ahead (copies are made on open); its passes are
counted all the same.

Plans are made ahead, off the trio thread, while the mount runs: planning 10 million files takes 0.25-2.6 s
(docs/benchmarks.md), too long for a FUSE request to wait.  From the moment an epoch starts the schedule hands
out a :class:`PlanJob` for the next one (``plan_job``), which the :class:`~tierfs.daemon.schedule.planner.Planner` makes
in a worker thread and hands back (``adopt``).  Until it lands, the next mini-epoch of an epoch's last one is unknown
(``next_coords`` is None): nothing of it is staged, ``advance=ready`` waits, and a switch that is due is recorded
(``pos.switch_due``, journalled) and made by the pass rule when the plan lands or at the end of the pass shown
meanwhile.  Before the mount serves (``start``) and where no planner runs (engine tests), a missing plan is made
at once.

The views the next pass may show -- this mini-epoch's next pass, the next mini-epoch's first -- are made ahead
the same way (``view_job``, ``adopt_view``): a view of a million files is a permutation and a mask, 20-30 ms on
the trio thread inside the request that ended the pass.  That request takes the view ready-made; if a reader
raced through the pass before it was, it is made there, as before, and counted (``views_inline``).  Under
``view=full`` the view is the whole tree in a new order each pass: a second order of every file is 4 bytes a
file, which the memory budget of a whole-tree mount has no room for all the time, so the next pass's is made
only once the pass is in its last eighth (``whole_view_due``, ``want_whole_view``) and lives until the pass
ends.  (Under ``lru`` the view is still made in the request.)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sampler.plan import plan_epoch
from tierfs.common.options import LiveSettings, Settings, format_size, format_size_at_least
from tierfs.daemon.cache.journal import Position, fit_to_plan
from tierfs.daemon.schedule.view import View
from tierfs.daemon.tree.tree import Tree, index_dtype

__all__ = ["HeldCopies", "Pending", "PlanJob", "Schedule", "ScheduleStatistics", "ViewJob", "check_fits",
           "fewest_mini_epochs", "fit_default_nm", "fit_remount_nm", "make_plan"]

log = logging.getLogger("tierfs")

class HeldCopies(Protocol):
    """Which files have a copy in the cache (the :class:`~tierfs.daemon.cache.store.CacheStore` answers)."""

    def held(self, n_files: int) -> np.ndarray:
        """A mask over the tree's ``n_files`` files: True where a copy is cached."""


class Pending:
    """Files of a mini-epoch not staged yet: a mask over the tree's files, with their count and bytes kept as
    they change.  Made at every switch from up to millions of files, on the trio thread, with array operations
    (a set of ints cost 0.2 s a million files there, and every reader waited for it)."""

    def __init__(self, sizes: np.ndarray, mask: np.ndarray | None = None) -> None:
        self._sizes = sizes
        self.mask = mask if mask is not None else np.zeros(len(sizes), bool)
        self._n = int(np.count_nonzero(self.mask))
        self._bytes: int | None = 0 if not self._n else None  # (summed when status first asks)

    @property
    def bytes(self) -> int:
        if self._bytes is None:
            self._bytes = int(np.sum(self._sizes, where=self.mask, dtype=np.int64))
        return self._bytes

    def __len__(self) -> int:
        return self._n

    def __contains__(self, fidx: int) -> bool:
        return bool(self.mask[fidx])

    def add(self, fidx: int) -> None:
        if not self.mask[fidx]:
            self.mask[fidx] = True
            self._n += 1
            if self._bytes is not None:
                self._bytes += int(self._sizes[fidx])

    def discard(self, fidx: int) -> None:
        if self.mask[fidx]:
            self.mask[fidx] = False
            self._n -= 1
            if self._bytes is not None:
                self._bytes -= int(self._sizes[fidx])


@dataclass(frozen=True)
class ScheduleStatistics:
    epoch: int
    mini_epoch: int
    pass_index: int
    passes_total: int
    rf_effective: tuple[int, ...]
    nm: int
    view_files: int
    view_bytes: int
    dataset_files: int
    dataset_bytes: int
    next_files: int
    next_pending: int
    next_bytes: int
    next_pending_bytes: int
    consumption_bytes_per_s: float
    current_files: int = 0  # the current mini-epoch (the view, unless view=full)
    current_bytes: int = 0
    current_pending: int = 0  # files of it not cached yet (right after a mount, a switch)
    current_pending_bytes: int = 0
    views_ahead: int = 0  # passes whose view was made ahead, in a worker thread
    views_inline: int = 0  # passes whose view the request that began them made (not ready, or view=full)


def _budget(settings: Settings, capacity: int) -> tuple[int, int | None]:
    """(bytes a mini-epoch may take, nm or None): half the cache, or ``mini_epoch_size`` (then no nm)."""
    if settings.mini_epoch_size:
        return min(capacity // 2, settings.mini_epoch_size), None
    return capacity // 2, settings.nm


def check_fits(sizes: np.ndarray, settings: Settings, capacity: int) -> None:
    """``ValueError`` with the reason and the fix if ``settings`` cannot plan an epoch of files of ``sizes`` (on
    the cache disk) in ``capacity``; a sum and a max, no plan (a control write validates with it).

    Exactly when :func:`make_plan` takes the settings: with ``mini_epoch_size`` (no nm) the planner picks the
    count and fails only on a file larger than a mini-epoch; with ``nm`` a plan whose mini-epochs all fit half
    the cache has ``total <= budget x nm x world_size``, and when no cut fits, the balanced cut is taken as
    long as a mini-epoch fits on average within one file: ``total <= (budget + biggest) x nm x world_size``."""
    budget, nm = _budget(settings, capacity)
    if not len(sizes):
        raise ValueError("the backing dir holds no file (or lists none: a network file system's fault?)")
    if nm is not None and nm > len(sizes):
        raise ValueError(f"nm={nm} is more mini-epochs than the data set has files: use at most {len(sizes):,}")
    ws = settings.world_size
    total, biggest = int(sizes.sum()), int(sizes.max(initial=0))
    if (biggest <= budget) if nm is None else (total <= (budget + biggest) * nm * ws):
        return
    need = max(1, -(-total // max(1, budget * ws)))  # nm >= this always fits (the formula of docs/tuning.md)
    what = f"nm={nm}" if nm is not None else f"mini_epoch_size={settings.mini_epoch_size}"
    per = -(-total // ((nm or need) * ws))
    rank_note = " per rank" if ws > 1 else ""
    raise ValueError(
        f"{what} does not fit capacity={format_size(capacity)}: a mini-epoch must fit in half the "
        f"cache, {format_size(budget)}, but the copies of the data set take {format_size(total)} of the "
        f"cache disk, in {nm or need} mini-epochs {format_size(per)} each{rank_note}; use nm >= {need} or "
        f"capacity >= {format_size_at_least(capacity_needed(sizes, nm or need, ws))}"
    )


def fewest_mini_epochs(sizes: np.ndarray, settings: Settings, capacity: int) -> int:
    """The smallest nm that :func:`check_fits` accepts for files of ``sizes`` (on the cache disk) in ``capacity``
    with ``settings``'s other values; ``ValueError`` when none does."""
    ws = settings.world_size
    lo = max(1, -(-2 * int(sizes.sum()) // (ws * capacity)))  # (below this the sum cannot fit)
    for nm in range(lo, len(sizes) + 1):
        try:
            check_fits(sizes, dataclasses.replace(settings, nm=nm, mini_epoch_size=None), capacity)
            return nm
        except ValueError:
            continue
    raise ValueError(f"no nm fits capacity {format_size(capacity)}: each file would need a mini-epoch of its own; "
                     f"use a larger capacity")


def fit_default_nm(settings: Settings, n_files: int) -> Settings:
    """The default nm on a data set of fewer files is lowered to one file a mini-epoch, and said: defaults must
    work on any data set.  An nm that was given (any other value) and is too large is refused with the most that
    works (``Schedule.check``)."""
    default = Settings().nm
    if settings.mini_epoch_size is None and settings.nm == default and 0 < n_files < default:
        log.warning("nm=%d (the default) is more mini-epochs than the data set has files: mounted with nm=%d, "
                    "one file each", default, n_files)
        return dataclasses.replace(settings, nm=n_files)
    return settings


def fit_remount_nm(settings: Settings, sizes: np.ndarray, capacity: int) -> Settings:
    """A remount (the cache dir has a journal) with the nm option of the mount before, over a data set that
    changed so that nm no longer fits the capacity (it grew) or exceeds its files (it shrank): mounted with the
    fewest mini-epochs that fit, and said, so that an fstab or systemd mount keeps coming back.  A first mount,
    or one given another nm than the last, is refused instead, with the fix: its settings are the user's choice
    of a moment ago (``policy.check_fits``)."""
    if settings.mini_epoch_size is not None:
        return settings  # (the planner picks the count: it always fits)
    try:
        check_fits(sizes, settings, capacity)
        return settings
    except ValueError as exc:
        why = str(exc)
    try:
        nm = fewest_mini_epochs(sizes, settings, capacity)
    except ValueError:
        return settings  # (nothing fits: the refusal says why)
    log.warning("the data set changed since this cache dir was last mounted: %s; mounted with nm=%d instead of "
                "%d (give nm=%d, or a larger capacity, to keep this from being said)", why, nm, settings.nm, nm)
    return dataclasses.replace(settings, nm=nm)


def capacity_needed(sizes: np.ndarray, nm: int, world_size: int) -> int:
    """The least capacity that holds two mini-epochs of an even cut of ``sizes`` into ``nm`` (per rank) and twice
    the largest copy: what a refusal suggests, and what :func:`check_fits` then accepts."""
    return 2 * max(-(-int(sizes.sum()) // (nm * world_size)), int(sizes.max(initial=0)))


def make_plan(sizes: np.ndarray, groups: np.ndarray, settings: Settings, capacity: int,
              epoch: int) -> tuple[list[np.ndarray], str | None]:
    """The plan of ``epoch`` and, if ``settings`` cannot plan it (the sizes changed since they were checked),
    why: it then takes as many mini-epochs as half the cache needs.  Pure: a worker thread runs it."""
    budget, nm = _budget(settings, capacity)
    plan = functools.partial(plan_epoch, sizes, seed=settings.seed, epoch=epoch, composition=settings.composition,
                             groups=groups if settings.composition == "stratified" else None, rank=settings.rank,
                             world_size=settings.world_size)
    try:
        check_fits(sizes, settings, capacity)
    except ValueError as exc:
        note = f"epoch {epoch}: {exc}; this epoch uses more mini-epochs"
        return _narrow_plan(plan(budget=capacity // 2), len(sizes)), note
    try:
        return _narrow_plan(plan(nm=nm, budget=budget), len(sizes)), None
    except ValueError:
        # (nm is given: without it the planner picks a count that fits.)  On average a mini-epoch fits half the
        # cache (within a file), but no cut keeps every one under it.  Take the balanced cut: the stager never
        # passes the cap, and a mini-epoch a little over half is finished after the switch (PassRule.next_ready).
        return _narrow_plan(plan(nm=nm), len(sizes)), None


def _narrow_plan(plan: list[np.ndarray], n_files: int) -> list[np.ndarray]:
    """The plan's file indices in the narrowest dtype (a plan is kept per epoch: a million files, 4 MB)."""
    return [p.astype(index_dtype(n_files), copy=False) for p in plan]


@dataclass(frozen=True)
class PlanJob:
    """One epoch's plan to make in a worker thread, with what it reads: ``sizes`` is not written while a job
    holds it (:meth:`Schedule.set_disk_size` copies it first), the rest never changes."""

    epoch: int
    settings: Settings
    capacity: int
    sizes: np.ndarray
    groups: np.ndarray
    generation: int
    n_files: int  # the files it plans (the tree's then: not its room)
    growth: int  # the tree's growth then (Schedule._join)

    def make(self) -> tuple[list[np.ndarray], str | None]:
        n = self.n_files
        return make_plan(self.sizes[:n], self.groups[:n], self.settings, self.capacity, self.epoch)


#: which view: (plan generation, epoch, mini-epoch, pass) -- the seed and listing are no live settings
ViewKey = tuple[int, int, int, int]
#: Mini-epochs whose passes ``rf_effective`` keeps (the newest): its length must not grow with the mount's life.
RF_EFFECTIVE_KEPT = 1000


@dataclass(frozen=True)
class ViewJob:
    """One pass's view, made where it is needed or ahead in a worker thread: ``files`` is a plan's array (or the
    tree's first names), never written; ``mask`` the current view's when the files are its own (the next
    pass); the tree's sizes are only read (a change meanwhile is caught by ``sizes_version``)."""

    tree: Tree
    files: np.ndarray
    seed: int
    epoch: int
    mini_epoch: int
    pass_index: int
    hard_links: bool
    lists_all: bool
    mask: np.ndarray | None
    generation: int
    sizes_version: int

    @property
    def key(self) -> ViewKey:
        return self.generation, self.epoch, self.mini_epoch, self.pass_index

    def make(self) -> View:
        return View(self.tree, self.files, seed=self.seed, epoch=self.epoch, mini_epoch=self.mini_epoch,
                    pass_index=self.pass_index, hard_links=self.hard_links, lists_all=self.lists_all,
                    mask=self.mask)


class Schedule:
    """See the module docstring.  ``pos`` is the journalled position (owned here from now on); ``live`` the
    mount's settings (read as they are now: :attr:`settings`)."""

    def __init__(self, tree: Tree, live: LiveSettings, capacity: int, pos: Position, disk_sizes: np.ndarray, *,
                 walks_plans: bool) -> None:
        self.tree = tree
        #: the cache policy's (see policy.py): mini-epochs of plans, or (lru) the whole tree and no plan
        self.walks_plans = walks_plans
        #: what each file's copy will occupy on the cache disk: plans cut by this (the cap is kept on disk)
        self.disk_sizes = disk_sizes
        self.live = live
        self.capacity = capacity
        self.pos = pos
        self.plans: dict[int, list[np.ndarray]] = {}
        #: per planned epoch, the tree's growth its plan was made with: the files it took join as it starts
        self._plan_growth: dict[int, int] = {}
        #: set while the engine runs (``Engine.run``): a missing plan is left to its planner, never made here
        self.plans_ahead = False
        self._awaited: int | None = None  # the epoch whose plan the walk to the next mini-epoch waits for
        self._joined = 0  # the tree growth whose files joined last (see _join)
        self._sums: tuple[int, int, int] | None = None  # _bytes(), until the next mini-epoch or changed file
        self._generation = 0  # bumped by a replan: plans made from older settings are not kept
        self._sizes_lent = False  # disk_sizes is read by a plan job (copy before writing)
        self._sizes_version = 0  # bumped by a changed file: a view made from older sizes has the wrong bytes
        self._views: dict[ViewKey, View] = {}  # made ahead (adopt_view), until a pass takes or no longer wants one
        self._whole_next: ViewKey | None = None  # (view=full) the next pass's, once this one is in its last eighth
        self.views_ahead = 0
        self.views_inline = 0
        n = tree.n_slots
        self.current = np.zeros(0, np.int64)
        self.current_mask = np.zeros(n, bool)
        self.next_files = np.zeros(0, np.int64)
        self.next_mask = np.zeros(n, bool)
        #: the mini-epoch after the current one; None while its epoch's plan is being made
        self.next_coords: tuple[int, int] | None = (0, 0)
        self.wanted = np.zeros(n, bool)
        self.pending_next = Pending(tree.sizes)  # files of the next mini-epoch not cached yet
        self.pending_current = Pending(tree.sizes)  # and of the current one (what status shows staging of)
        self.view: View | None = None
        self.advance_requested = False
        self.plan_note: str | None = None  # why a later epoch needed more mini-epochs (shown as last_error)
        self.plan_error: str | None = None  # why the planner could not plan the next epoch (until it can)
        #: (epoch, mini_epoch) of the last completed pass: what a ``feedback`` line is about (see control_file.py)
        self.last_pass: tuple[int, int] | None = tuple(pos.last_pass) if pos.last_pass else None  # type: ignore
        self._read_mark = np.zeros(n, bool)
        self._unread = 0
        self.reads_in_pass = 0
        self._pass_started: float | None = None
        self._opens_per_s = 0.0  # the last pass's (see opens_per_s)
        self._pass_opened = 0.0
        self._prev_pass: tuple[float, float] | None = None  # (first open, bytes opened) of the pass just ended
        self._consumption_measured = False
        self.consumption_bps = 0.0

    @property
    def settings(self) -> Settings:
        return self.live.current

    # ============================================================================================= plans

    def check(self, settings: Settings) -> None:
        """``ValueError`` with the reason and the fix if ``settings`` cannot plan an epoch (no plan is made)."""
        check_fits(self.planned_sizes(), settings, self.capacity)

    def capacity_needed(self, nm: int, world_size: int) -> int:
        """:func:`capacity_needed` of this data set's copies."""
        return capacity_needed(self.planned_sizes(), nm, world_size)

    def planned_sizes(self) -> np.ndarray:
        """The copies' sizes of the files a plan made now covers: the tree's, not its room (a view)."""
        return self.disk_sizes[:self.tree.n_files]

    def plan(self, epoch: int) -> list[np.ndarray]:
        """The plan of ``epoch``, made now if it is missing: only where nothing waits on the trio thread for it
        (before the mount serves, engine tests without a planner); see :meth:`_plan_or_none`."""
        plan = self.plans.get(epoch)
        if plan is None:
            n = self.tree.n_files
            plan, note = make_plan(self.disk_sizes[:n], self.tree.groups[:n], self.settings, self.capacity, epoch)
            self._keep(epoch, plan, note, self.tree.growth)
        return plan

    def _plan_or_none(self, epoch: int) -> list[np.ndarray] | None:
        """The plan of ``epoch``; while a planner runs, None if it is not made yet (the planner is asked for it)."""
        if epoch in self.plans or not self.plans_ahead:
            return self.plan(epoch)
        self._awaited = epoch
        return None

    def _keep(self, epoch: int, plan: list[np.ndarray], note: str | None, growth: int) -> None:
        self.plan_error = None
        if note is not None:
            self.plan_note = note
        for old in [e for e in self.plans if e < min(epoch, self.pos.epoch)]:
            del self.plans[old]  # (the position never goes back)
            self._plan_growth.pop(old, None)
        self.plans[epoch] = plan
        self._plan_growth[epoch] = growth

    def plan_job(self) -> PlanJob | None:
        """The plan to make next off the trio thread: the next epoch's from the moment an epoch starts (ready
        when its last mini-epoch is entered), or a later one the walk to the next mini-epoch waits for."""
        if not self.walks_plans:
            return None
        for epoch in range(self.pos.epoch + 1, max(self.pos.epoch + 1, self._awaited or 0) + 1):
            if epoch not in self.plans:
                self._sizes_lent = True  # (copied before it is written: set_disk_size)
                return PlanJob(epoch, self.settings, self.capacity, self.disk_sizes, self.tree.groups,
                               self._generation, self.tree.n_files, self.tree.growth)
        return None

    def adopt(self, job: PlanJob, plan: list[np.ndarray], note: str | None, cached: HeldCopies) -> bool:
        """Keep a plan made from ``job``, unless the settings changed meanwhile (the planner is then asked for a
        new one); True if it made the next mini-epoch known (its files are now wanted and pending)."""
        if job.sizes is self.disk_sizes:
            self._sizes_lent = False
        if job.generation != self._generation or job.epoch in self.plans or job.epoch <= self.pos.epoch:
            return False
        self._keep(job.epoch, plan, note, job.growth)
        if self.next_coords is not None or self._awaited != job.epoch:
            return False
        self.enter(self.pos.epoch, self.pos.mini_epoch, cached, keep_view=True)
        return self.next_coords is not None

    def plan_failed(self, job: PlanJob, reason: str) -> None:
        """No plan fits (``status.last_error`` says why); the position stays until one does."""
        self.plan_error = f"epoch {job.epoch} cannot be planned: {reason}"

    def set_disk_size(self, fidx: int, size: int) -> None:
        """A file changed: its copy's new estimate.  An array a plan job reads is copied first (never written
        under a worker thread); a plan under way stays one of the sizes when it started, as a plan made earlier
        stays one of its own (epochs are never replanned for a changed size: the stager keeps the cap)."""
        if self._sizes_lent or (size >= 2**31 and self.disk_sizes.dtype != np.int64):
            # (int32 until a copy does not fit: per-file arrays are most of a big mount's memory)
            self.disk_sizes = self.disk_sizes.astype(np.int64 if size >= 2**31 else self.disk_sizes.dtype)
            self._sizes_lent = False
        self.disk_sizes[fidx] = size
        self._sizes_version += 1
        self._sums = None  # (the tree took the file's new size first: Engine.changed)

    def coords_after(self, epoch: int, me: int) -> tuple[int, int] | None:
        """The mini-epoch after (epoch, me), skipping empty shares (fewer files than nm x world_size); None while
        the plan of a later epoch it needs is being made."""
        plan = self.plans[epoch]
        for _ in range(4 * max(1, len(plan)) + 4):
            me += 1
            if me >= len(plan):
                nxt = self._plan_or_none(epoch + 1)
                if nxt is None:
                    return None
                epoch, me, plan = epoch + 1, 0, nxt
            if len(plan[me]):
                return epoch, me
        return epoch, me

    def nm_in_force(self) -> int:
        return len(self.plans.get(self.pos.epoch, ())) if self.walks_plans else 1

    # ========================================================================================= position

    def start(self, cached: HeldCopies, rf_ceiling: int) -> None:
        """Enter the journalled position (or the next valid one, if the plan changed under the journal; a
        position past ``rf_ceiling`` passes, the most a mini-epoch gets now, is at its last)."""
        if not self.walks_plans:
            n = self.tree.n_files
            self.current = np.arange(n, dtype=index_dtype(n))
            self.current_mask[:] = True
            self._sums = None
            self.new_view()
            return
        plan = self.plan(self.pos.epoch)
        fit_to_plan(self.pos, len(plan), rf_ceiling)
        if self.pos.mini_epoch >= len(plan) or not len(plan[self.pos.mini_epoch]):
            coords = self.coords_after(self.pos.epoch, min(self.pos.mini_epoch, len(plan)) - 1)
            assert coords is not None  # (no planner runs yet: a missing plan is made at once)
            self.pos.epoch, self.pos.mini_epoch = coords
            self.pos.pass_index, self.pos.switch_due = 0, False
        self.enter(self.pos.epoch, self.pos.mini_epoch, cached)
        if self.pos.switch_due:
            self.switch(cached)  # due when the mount stopped, waiting for the next epoch's plan

    def enter(self, epoch: int, me: int, cached: HeldCopies, *, keep_view: bool = False) -> None:
        """Make (epoch, me) current and recompute next, wanted and pending; a new view unless ``keep_view``
        (a plan change keeps the view and pass it is in).  The one way into a mini-epoch."""
        if not keep_view:
            self._join(epoch)
            self.current = self.plans[epoch][me]
            if (epoch, me) == self.next_coords and self.next_files is self.current:
                # (a switch: the next mini-epoch's mask is made; the old current one's array takes the next's)
                self.current_mask, self.next_mask = self.next_mask, self.current_mask
            else:
                self.current_mask[:] = False
                self.current_mask[self.current] = True
            self.pos.epoch, self.pos.mini_epoch = epoch, me
        self._awaited = None
        self._sums = None
        self.next_coords = self.coords_after(self.pos.epoch, self.pos.mini_epoch)
        if self.next_coords is None or self.next_coords == (self.pos.epoch, self.pos.mini_epoch):
            self.next_files = np.zeros(0, np.int64)  # (not planned yet, or no other mini-epoch)
        else:
            self.next_files = self.plans[self.next_coords[0]][self.next_coords[1]]
        self.next_mask[:] = False
        self.next_mask[self.next_files] = True
        # (masks, not the files: a switch makes these from millions of files while every reader waits; written
        # into the arrays the last switch left, not into fresh pages; only this schedule reads them)
        np.logical_or(self.current_mask, self.next_mask, out=self.wanted)
        held, sizes = cached.held(self.tree.n_slots), self.tree.sizes
        if self.tree.gone_files:  # (a file found gone: nothing to copy, nothing to wait for)
            self.wanted &= ~self.tree.gone
            held = held | self.tree.gone
        self.pending_next = Pending(sizes, np.greater(self.next_mask, held, out=self.pending_next.mask))  # (& ~held)
        self.pending_current = Pending(sizes, np.greater(self.current_mask, held, out=self.pending_current.mask)
                                       if self.walks_plans else None)
        if not keep_view:
            self.new_view()
        self._drop_unwanted_views()  # (a replan, a plan landed: the next mini-epoch may be another now)

    def mark_switch_due(self) -> None:
        """The pass rule would switch, but the next epoch is being planned: the switch is due (journalled), made
        when the plan lands or at the end of the pass shown meanwhile."""
        self.pos.switch_due = True

    def request_advance(self) -> None:
        """``advance``: the pass rule leaves the mini-epoch as soon as the next one is ready (until a switch)."""
        self.advance_requested = True

    def plan_ahead(self, on: bool) -> None:
        """While the mount runs (``on``) a missing plan is the planner's, made in a worker thread, never a
        request's; without one (engine tests, close) it is made at once."""
        self.plans_ahead = on

    def journal_position(self, arf_history: list[dict[str, Any]]) -> Position:
        """The position as journalled: a copy, with the ARF controller's history and the last completed pass."""
        return dataclasses.replace(self.pos, arf_history=list(arf_history), rf_effective=list(self.pos.rf_effective),
                                   last_pass=list(self.last_pass) if self.last_pass is not None else None)

    def switch(self, cached: HeldCopies) -> None:
        """The next mini-epoch takes over (it must be known: ``next_coords``)."""
        assert self.next_coords is not None
        epoch, me = self.next_coords
        self.pos.pass_index = 0
        self.pos.switch_due = False
        self.pos.rf_effective.append(0)
        del self.pos.rf_effective[:-RF_EFFECTIVE_KEPT]  # (switches as fast as "advance" lines come: bounded)
        self.advance_requested = False
        self.enter(epoch, me, cached)

    def grew(self) -> None:
        """The tree took new files (``Tree.grow``, their disk sizes set): the epochs after the one the next
        mini-epoch is in are planned again, with them (they join as the first of those starts)."""
        keep = self.pos.epoch if self.next_coords is None else max(self.pos.epoch, self.next_coords[0])
        for epoch in [e for e in self.plans if e > keep]:
            del self.plans[epoch]
            self._plan_growth.pop(epoch, None)
        self._generation += 1  # (a plan under way without them is not kept)
        self._drop_unwanted_views()

    def _join(self, epoch: int) -> None:
        """Entering ``epoch``: the files its plan was made with join the tree (``Tree.join``); views made ahead
        without them are made again."""
        growth = self._plan_growth.get(epoch, 0)
        if growth > self._joined:
            self._joined = growth
            if self.tree.join(growth):
                self._sizes_version += 1
                self._views.clear()

    def replan(self, cached: HeldCopies) -> None:
        """New nm/mini_epoch_size/composition (in the settings now): the current epoch keeps its plan, later epochs
        use the new one."""
        self.plans = {e: p for e, p in self.plans.items() if e <= self.pos.epoch}
        self._generation += 1  # a plan under way with the old settings is not kept
        self.enter(self.pos.epoch, self.pos.mini_epoch, cached, keep_view=True)

    def view_for(self, *, seed: int, pass_index: int) -> View:
        """The view of the current mini-epoch in the order of (``seed``, ``pass_index``): the mount's own pass
        with its seed, a consumer's with its (consumers.py)."""
        whole = self.settings.view == "full" or not self.walks_plans
        epoch, me = (self.pos.epoch, self.pos.mini_epoch) if self.walks_plans else (0, 0)
        mask = self.view.mask if whole and self.view is not None else None  # (the whole tree's: always the same)
        return self._view_job(epoch, me, pass_index, seed=seed, files=None if whole else self.current,
                              mask=mask).make()

    def _view_job(self, epoch: int, me: int, pass_index: int, *, seed: int, files: np.ndarray | None,
                  mask: np.ndarray | None = None) -> ViewJob:
        """The view of pass ``pass_index`` of (epoch, me) in ``seed``'s order: of ``files`` (a mini-epoch's), or
        of the whole tree (None)."""
        whole = files is None
        # (the whole tree looks like the backing: a hard-linked file is one file, shown under each of its names)
        files = self.tree.first_names() if files is None else files
        if self.tree.gone_files:  # (files found gone are in no view: the pass ends without them)
            files, mask = self.tree.present(files), None
        return ViewJob(self.tree, files, seed, epoch, me, pass_index, hard_links=whole,
                       lists_all=self.settings.listing == "all" and self.walks_plans, mask=mask,
                       generation=self._generation, sizes_version=self._sizes_version)

    def new_view(self) -> None:
        pos = self.pos
        self._whole_next = None
        view = self._views.pop(self._view_key(pos.epoch, pos.mini_epoch, pos.pass_index), None)
        if view is not None:
            self.views_ahead += 1
        else:
            view = self.view_for(seed=self.settings.seed,
                                 pass_index=pos.pass_index if self.walks_plans else pos.passes_total)
            if self.plans_ahead:  # (the mount serves: a request waited for it)
                self.views_inline += 1
        self.view = view
        self._drop_unwanted_views()
        self._read_mark[:] = False
        self._unread = len(self.view)
        self.reads_in_pass = 0
        self._pass_started = None
        self._pass_opened = 0.0

    def _view_key(self, epoch: int, me: int, pass_index: int) -> ViewKey:
        return self._generation, epoch, me, pass_index

    def _views_wanted(self) -> list[tuple[ViewKey, np.ndarray | None]]:
        """The views a pass may show next, with their files: this mini-epoch's next pass, the next one's first
        (under ``view=full``: the one :meth:`want_whole_view` named; see the module docstring)."""
        if not self.walks_plans or self.view is None:
            return []
        if self.settings.view == "full":
            return [(self._whole_next, None)] if self._whole_next is not None else []
        pos = self.pos
        wanted: list[tuple[ViewKey, np.ndarray | None]] = [
            (self._view_key(pos.epoch, pos.mini_epoch, pos.pass_index + 1), self.current)]
        if self.next_coords is not None and self.next_coords != (pos.epoch, pos.mini_epoch):
            wanted.append((self._view_key(*self.next_coords, 0), self.next_files))
        return wanted

    def _drop_unwanted_views(self) -> None:
        wanted = {key for key, _ in self._views_wanted()}
        self._views = {key: v for key, v in self._views.items() if key in wanted}

    def view_job(self) -> ViewJob | None:
        """A view the next pass may show that is not made yet, to make off the trio thread (no side effect)."""
        view = self.view
        for key, files in self._views_wanted():  # (none without a view)
            if key not in self._views and view is not None:
                # (the next pass: the same files; a whole-tree view: the tree's)
                mask = view.mask if files is self.current or files is None else None
                return self._view_job(*key[1:], seed=self.settings.seed, files=files, mask=mask)
        return None

    def adopt_view(self, job: ViewJob, view: View) -> bool:
        """Keep a view made from ``job`` if a pass may still show it and no file changed size meanwhile."""
        if job.sizes_version != self._sizes_version or job.key not in {k for k, _ in self._views_wanted()}:
            return False
        self._views[job.key] = view
        return True

    def staging_order(self) -> np.ndarray:
        """What the stager should copy, in order: what the current mini-epoch lacks, then the next one."""
        if not self.walks_plans:
            return np.zeros(0, np.int64)
        return np.concatenate([self.current, self.next_files])

    def staged(self, fidx: int) -> None:
        """``fidx`` has a copy now, or staging gave up on it (read from the backing: nothing to wait for)."""
        self.pending_next.discard(fidx)
        self.pending_current.discard(fidx)

    def unstaged(self, fidx: int) -> None:
        """``fidx``'s copy went (changed, damaged): pending again in whichever mini-epoch wants it."""
        if self.tree.gone[fidx]:
            return
        if self.next_mask[fidx]:
            self.pending_next.add(fidx)
        elif self.current_mask[fidx]:
            self.pending_current.add(fidx)

    def _bytes(self) -> tuple[int, int, int]:
        """(data set, current, next mini-epoch) bytes: summed once per mini-epoch, not at every status read (a
        scraper reads status often; at millions of files each sum is a gather of millions of sizes)."""
        if self._sums is None:
            sizes, nxt = self.tree.sizes, self.next_files
            self._sums = (int(sizes.sum()), int(sizes[self.current].sum()),
                          int(sizes[nxt].sum()) if len(nxt) else 0)
        return self._sums

    def statistics(self) -> ScheduleStatistics:
        pos, view, nxt = self.pos, self.view, self.next_files
        dataset_bytes, current_bytes, next_bytes = self._bytes()
        return ScheduleStatistics(
            epoch=pos.epoch, mini_epoch=pos.mini_epoch, pass_index=pos.pass_index, passes_total=pos.passes_total,
            rf_effective=tuple(pos.rf_effective), nm=self.nm_in_force(),
            view_files=len(view) if view is not None else 0, view_bytes=view.bytes if view is not None else 0,
            dataset_files=self.tree.n_files, dataset_bytes=dataset_bytes,
            next_files=len(nxt), next_pending=len(self.pending_next), next_bytes=next_bytes,
            next_pending_bytes=self.pending_next.bytes,
            consumption_bytes_per_s=self.consumption_bps, current_files=len(self.current),
            current_bytes=current_bytes, current_pending=len(self.pending_current),
            current_pending_bytes=self.pending_current.bytes, views_ahead=self.views_ahead,
            views_inline=self.views_inline,
        )

    # ============================================================================================ passes

    def opens_per_s(self) -> float:
        """Opens per second in this pass so far, or in the one before (0.0 before any pass was read)."""
        if self._pass_started is not None and self.reads_in_pass:
            elapsed = time.monotonic() - self._pass_started
            if elapsed > 1.0:
                return self.reads_in_pass / elapsed
        return self._opens_per_s

    def unread(self) -> np.ndarray:
        """Files of the view not opened yet this pass, in serving order (what readers open next)."""
        assert self.view is not None
        order = self.view.order
        return order[~self._read_mark[order]]

    def view_files(self) -> int:
        """The files of the current view that a pass reads: those not found gone since it was made."""
        view = self.view
        if view is None:
            return 0
        return len(view) - int(self.tree.gone[view.order].sum()) if self.tree.gone_files else len(view)

    def file_gone(self, fidx: int) -> None:
        """``fidx`` was found gone (``Tree.mark_gone``): not wanted any more; the pass that runs counts it as
        read (its readers cannot open it), and views made ahead with it are made again without it."""
        self.wanted[fidx] = False
        self.staged(fidx)  # (nothing to wait for)
        self._sizes_version += 1
        self._views.clear()  # (made with it: made again, without)
        if self.view is not None and self.view.mask[fidx] and not self._read_mark[fidx]:
            self._read_mark[fidx] = True
            self._unread -= 1

    def opened_in_pass(self, fidx: int) -> bool:
        """Whether ``fidx`` (a view file) was opened since this pass began."""
        return bool(self._read_mark[fidx])

    def record_open(self, fidx: int, size: float) -> bool:
        """Count one open (``size``: its bytes, shared among the consumers reading); True when it was the last
        file of the view that nobody had opened this pass (with one consumer: its pass is over)."""
        if self._pass_started is None:
            now = self._pass_started = time.monotonic()
            if self._prev_pass is not None:
                # Consumption from one pass's first open to the next one's: the reading of the last files opened
                # counts too (a pass of a few big shards is all opened long before it is consumed).
                started, opened = self._prev_pass
                self._prev_pass = None
                if now > started:
                    self.consumption_bps = opened / (now - started)
                    self._consumption_measured = True
        self.reads_in_pass += 1
        # Consumption counts bytes opened, not bytes read: repeated passes may be served by the page cache.
        self._pass_opened += size
        if not self._read_mark[fidx] and self.view is not None and self.view.mask[fidx]:
            self._read_mark[fidx] = True
            self._unread -= 1
            return self._unread == 0
        return False

    def whole_view_due(self) -> bool:
        """(``view=full``, after an open) Whether that open brought the pass into its last eighth: the moment to
        make the next pass's order of the whole tree ahead (see the module docstring)."""
        return (self.walks_plans and self.settings.view == "full" and self.view is not None
                and self._whole_next is None and self._unread == len(self.view) // 8)

    def want_whole_view(self, rf: int) -> None:
        """(``view=full``) Have the next pass's view made ahead: this mini-epoch's next pass while ``rf`` passes
        are not made, else the next mini-epoch's first (a guess: a switch may come sooner or later; the pass
        then makes its view in the request, as without)."""
        pos = self.pos
        if pos.pass_index + 1 < rf or self.next_coords is None:
            self._whole_next = self._view_key(pos.epoch, pos.mini_epoch, pos.pass_index + 1)
        else:
            self._whole_next = self._view_key(*self.next_coords, 0)

    def staging_ahead(self, rf: int) -> bool:
        """Whether staging may yield to readers: the next mini-epoch (as a fraction of its files) is staged
        further than it must be for it to be complete when three quarters of the current one's ``rf`` passes
        are read (passes made, and this pass's files opened).  Behind that, staging goes at full speed, so the
        next one is ready when the passes end."""
        if self.view is None or not len(self.next_files):
            return False  # staging what the current view lacks: readers need it now
        view = len(self.view)
        read = (self.pos.pass_index + (view - self._unread) / max(1, view)) / max(1, rf)
        staged = 1.0 - len(self.pending_next) / len(self.next_files)
        return staged >= min(1.0, read / 0.75 + 0.05)

    def end_pass(self, rf: int) -> bool:
        """Count the pass that just ended; True if it reached ``rf`` passes (a switch is due)."""
        self.last_pass = (self.pos.epoch, self.pos.mini_epoch)
        now = time.monotonic()
        if self._pass_started is not None and now > self._pass_started:
            self._opens_per_s = self.reads_in_pass / (now - self._pass_started)
        if self._pass_started is not None and self._pass_opened:
            self._prev_pass = (self._pass_started, self._pass_opened)
            if not self._consumption_measured and now > self._pass_started:
                # until the next pass starts, first to last open is the only estimate (an overestimate)
                self.consumption_bps = self._pass_opened / (now - self._pass_started)
        self.pos.pass_index += 1
        self.pos.passes_total += 1
        self.pos.rf_effective[-1] += 1
        return self.walks_plans and self.pos.pass_index >= rf

"""The schedule: plans per epoch, the position (epoch, mini-epoch, pass), and what the mount shows and wants.

Plain Python and numpy, no trio and no I/O: the engine asks it what the current view is, which files are
wanted (the current and the next mini-epoch), which of the next one are still to be staged, and tells it what
was opened and staged.  The decision *when* to switch needs the cache's state too, so :meth:`end_pass` only
says whether the pass limit is reached and the engine decides (see ``Engine.end_pass``).

With ``walks_plans`` (policy ``met``) it walks the mini-epochs of the sampler's plans.  Without (``lru``) there
is no plan: the view is the whole tree and nothing is wanted ahead (copies are made on open); its passes are
counted all the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from sampler.plan import min_mini_epochs, plan_epoch
from tierfs.journal import Position
from tierfs.options import Settings, format_size
from tierfs.tree import Tree, index_dtype
from tierfs.view import View

__all__ = ["Schedule", "ScheduleStatistics"]


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


class Schedule:
    """See the module docstring.  ``pos`` is the journalled position (owned here from now on)."""

    def __init__(self, tree: Tree, settings: Settings, capacity: int, pos: Position, disk_sizes: np.ndarray, *,
                 walks_plans: bool) -> None:
        self.tree = tree
        #: the cache policy's (see policy.py): mini-epochs of plans, or (lru) the whole tree and no plan
        self.walks_plans = walks_plans
        #: what each file's copy will occupy on the cache disk: plans cut by this (the cap is kept on disk)
        self.disk_sizes = disk_sizes
        self.settings = settings
        self.capacity = capacity
        self.pos = pos
        self.plans: dict[int, list[np.ndarray]] = {}
        n = tree.n_files
        self.current = np.zeros(0, np.int64)
        self.current_mask = np.zeros(n, bool)
        self.next_files = np.zeros(0, np.int64)
        self.next_coords = (0, 0)
        self.wanted = np.zeros(n, bool)
        self.pending_next: set[int] = set()  # files of the next mini-epoch not cached yet
        self.view: View | None = None
        self.advance_requested = False
        self.plan_note: str | None = None  # why a later epoch needed more mini-epochs (shown as last_error)
        #: (epoch, mini_epoch) of the last completed pass: what a ``feedback`` line is about (see control.py)
        self.last_pass: tuple[int, int] | None = tuple(pos.last_pass) if pos.last_pass else None  # type: ignore
        self._read_mark = np.zeros(n, bool)
        self._unread = 0
        self.reads_in_pass = 0
        self._pass_started: float | None = None
        self._pass_opened = 0
        self._prev_pass: tuple[float, int] | None = None  # (first open, bytes opened) of the pass just ended
        self._consumption_measured = False
        self.consumption_bps = 0.0

    # ============================================================================================= plans

    def plan_for(self, settings: Settings, epoch: int, *, budget_only: bool = False) -> list[np.ndarray]:
        """The plan of ``epoch`` under ``settings``; ``ValueError`` with the reason and the fix if none fits."""
        budget = self.capacity // 2
        nm: int | None = None if budget_only else settings.nm
        if settings.mini_epoch_size:
            budget, nm = min(budget, settings.mini_epoch_size), None
        sizes = self.disk_sizes
        groups = self.tree.groups if settings.composition == "stratified" else None
        args = dict(seed=settings.seed, epoch=epoch, composition=settings.composition, groups=groups,
                    rank=settings.rank, world_size=settings.world_size)
        try:
            return plan_epoch(sizes, nm=nm, budget=budget, **args)
        except ValueError:
            total = int(sizes.sum())
            biggest = int(sizes.max(initial=0))
            if nm is not None and total <= (budget + biggest) * nm * settings.world_size:
                # On average a mini-epoch fits half the cache (within a file), but no cut keeps every one under
                # it.  Take the balanced cut: the stager never passes the cap, and a mini-epoch a little over
                # half is finished after the switch (see Engine.next_ready).
                return plan_epoch(sizes, nm=nm, **args)
            try:
                need = min_mini_epochs(sizes, budget=budget, seed=settings.seed, epoch=epoch,
                                       composition=settings.composition, groups=groups,
                                       world_size=settings.world_size)
            except ValueError:
                need = -(-total // max(1, budget * settings.world_size))
            what = f"nm={nm}" if nm is not None else f"mini_epoch_size={settings.mini_epoch_size}"
            per = -(-total // ((nm or need) * settings.world_size))
            rank_note = " per rank" if settings.world_size > 1 else ""
            raise ValueError(
                f"{what} does not fit capacity={format_size(self.capacity)}: a mini-epoch must fit in half the "
                f"cache, {format_size(budget)}, but the copies of the data set take {format_size(total)} of the "
                f"cache disk, in {nm or need} mini-epochs {format_size(per)} each{rank_note}; use nm >= {need} or "
                f"capacity >= {format_size(2 * per)}"
            ) from None

    def plan(self, epoch: int) -> list[np.ndarray]:
        plan = self.plans.get(epoch)
        if plan is None:
            try:
                plan = self.plan_for(self.settings, epoch)
            except ValueError as exc:
                # A random cut of a later epoch can miss the budget with this nm: take as many as it needs.
                self.plan_note = f"epoch {epoch}: {exc}; this epoch uses more mini-epochs"
                plan = self.plan_for(Settings(**{**self.settings.__dict__, "mini_epoch_size": None}), epoch,
                                     budget_only=True)
            for old in [e for e in self.plans if e < epoch - 1]:
                del self.plans[old]
            self.plans[epoch] = plan = [p.astype(index_dtype(self.tree.n_files), copy=False) for p in plan]
        return plan

    def coords_after(self, epoch: int, me: int) -> tuple[int, int]:
        """The mini-epoch after (epoch, me), skipping empty shares (fewer files than nm x world_size)."""
        for _ in range(4 * max(1, len(self.plan(epoch))) + 4):
            me += 1
            if me >= len(self.plan(epoch)):
                epoch, me = epoch + 1, 0
            if len(self.plan(epoch)[me]):
                return epoch, me
        return epoch, me

    def nm_in_force(self) -> int:
        return len(self.plans.get(self.pos.epoch, ())) if self.walks_plans else 1

    # ========================================================================================= position

    def start(self, is_cached: Callable[[int], bool]) -> None:
        """Enter the journalled position (or the next valid one, if the plan changed under the journal)."""
        if not self.walks_plans:
            n = self.tree.n_files
            self.current = np.arange(n, dtype=index_dtype(n))
            self.current_mask[:] = True
            self.new_view()
            return
        plan = self.plan(self.pos.epoch)
        if self.pos.mini_epoch >= len(plan) or not len(plan[self.pos.mini_epoch]):
            e, m = self.coords_after(self.pos.epoch, min(self.pos.mini_epoch, len(plan)) - 1)
            self.pos.epoch, self.pos.mini_epoch, self.pos.pass_index = e, m, 0
        self.enter(self.pos.epoch, self.pos.mini_epoch, is_cached)

    def enter(self, epoch: int, me: int, is_cached: Callable[[int], bool], *, keep_view: bool = False) -> None:
        """Make (epoch, me) current and recompute next, wanted and pending; a new view unless ``keep_view``
        (a plan change keeps the view and pass it is in).  The one way into a mini-epoch."""
        if not keep_view:
            self.pos.epoch, self.pos.mini_epoch = epoch, me
            self.current = self.plan(epoch)[me]
            self.current_mask[:] = False
            self.current_mask[self.current] = True
        self.next_coords = self.coords_after(self.pos.epoch, self.pos.mini_epoch)
        self.next_files = self.plan(self.next_coords[0])[self.next_coords[1]]
        if self.next_coords == (self.pos.epoch, self.pos.mini_epoch):
            self.next_files = np.zeros(0, np.int64)
        self.wanted = self.current_mask.copy()
        self.wanted[self.next_files] = True
        self.pending_next = {f for f in self.next_files.tolist() if not is_cached(f)}
        if not keep_view:
            self.new_view()

    def switch(self, is_cached: Callable[[int], bool]) -> None:
        """The next mini-epoch takes over."""
        epoch, me = self.next_coords
        self.pos.pass_index = 0
        self.pos.rf_effective.append(0)
        self.advance_requested = False
        self.enter(epoch, me, is_cached)

    def replan(self, settings: Settings, is_cached: Callable[[int], bool]) -> None:
        """New nm/mini_epoch_size/composition: the current epoch keeps its plan, later epochs use the new one."""
        self.settings = settings
        self.plans = {e: p for e, p in self.plans.items() if e <= self.pos.epoch}
        self.enter(self.pos.epoch, self.pos.mini_epoch, is_cached, keep_view=True)

    def new_view(self) -> None:
        s = self.settings
        whole = s.view == "full" or not self.walks_plans
        # (the whole tree looks like the backing: a hard-linked file is one file, shown under each of its names)
        files = self.tree.first_names() if whole else self.current
        if not self.walks_plans:
            self.view = View(self.tree, files, seed=s.seed, epoch=0, mini_epoch=0, pass_index=self.pos.passes_total,
                             hard_links=whole)
        else:
            self.view = View(self.tree, files, seed=s.seed, epoch=self.pos.epoch, mini_epoch=self.pos.mini_epoch,
                             pass_index=self.pos.pass_index, hard_links=whole)
        self._read_mark[:] = False
        self._unread = len(self.view)
        self.reads_in_pass = 0
        self._pass_started = None
        self._pass_opened = 0

    def set_disk_size(self, fidx: int, n: int) -> None:
        """A changed file's copy will take ``n`` bytes (``disk_sizes`` is int32 until one does not fit)."""
        if n >= 2**31 and self.disk_sizes.dtype != np.int64:
            self.disk_sizes = self.disk_sizes.astype(np.int64)
        self.disk_sizes[fidx] = n

    def staging_order(self) -> list[int]:
        """What the stager should copy, in order: what the current mini-epoch lacks, then the next one."""
        if not self.walks_plans:
            return []
        return [*self.current.tolist(), *self.next_files.tolist()]

    def statistics(self) -> ScheduleStatistics:
        pos, view, sizes, nxt = self.pos, self.view, self.tree.sizes, self.next_files
        return ScheduleStatistics(
            epoch=pos.epoch, mini_epoch=pos.mini_epoch, pass_index=pos.pass_index, passes_total=pos.passes_total,
            rf_effective=tuple(pos.rf_effective), nm=self.nm_in_force(),
            view_files=len(view) if view is not None else 0, view_bytes=view.bytes if view is not None else 0,
            dataset_files=self.tree.n_files, dataset_bytes=int(sizes.sum()),
            next_files=len(nxt), next_pending=len(self.pending_next),
            next_bytes=int(sizes[nxt].sum()) if len(nxt) else 0,
            next_pending_bytes=int(sizes[np.fromiter(self.pending_next, np.int64, len(self.pending_next))].sum()),
            consumption_bytes_per_s=self.consumption_bps,
        )

    # ============================================================================================ passes

    def unread(self) -> np.ndarray:
        """Files of the view not opened yet this pass, in serving order (what readers open next)."""
        assert self.view is not None
        order = self.view.order
        return order[~self._read_mark[order]]

    def record_open(self, fidx: int, size: int) -> bool:
        """Count one open; True when it was the last unread file of the view (the pass is over)."""
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
        if self._pass_started is not None and self._pass_opened:
            self._prev_pass = (self._pass_started, self._pass_opened)
            if not self._consumption_measured and now > self._pass_started:
                # until the next pass starts, first to last open is the only estimate (an overestimate)
                self.consumption_bps = self._pass_opened / (now - self._pass_started)
        self.pos.pass_index += 1
        self.pos.passes_total += 1
        self.pos.rf_effective[-1] += 1
        return self.walks_plans and self.pos.pass_index >= rf

"""Batch plans: one read of ``/.tierfs/plan`` gives a direct reader the whole pass, copies pinned until it ends.

A reader that opens cached copies itself (see :mod:`tierfs.direct`) still pays one ``getxattr`` round trip per
file.  A *plan* removes that: it lists every file of the current pass in serving order, with, for each file
the daemon would serve from its cache, the absolute path of the copy and the fingerprint it was made from.  The
reader then makes no FUSE request per cached file at all.

Three promises keep that as safe as ``open()``:

* **The copies stay.**  Every copy a plan names is pinned (:meth:`~tierfs.daemon.cache.store.CacheStore.pin`) from the
  moment the plan is rendered until its pass ends (all read, ``next-pass``, the root listed again, a switch):
  an eviction, a switch request that cannot happen yet or a change of the backing file only *dooms* it, and
  its name (never reused) is unlinked on the last unpin, after the pass.
* **No changed file.**  A copy is named only if an ``open`` would serve it at that moment: its fingerprint is
  within ``revalidate`` (or confirmed by a ``stat`` while the plan is built) and, with ``verify=xxhash``, the
  copy was hashed.  Anything else is listed without a copy, and the reader opens it through the mount, which
  fetches, re-stages and counts it as usual.  The cache dir is not trusted: each copy is named with its
  identity as committed (size, ``copy_id`` = inode and ctime, and the mtime every copy lands with), and the
  reader checks the copy against it right before it reads (``tierfs.loaders`` does; an open through the mount
  checks the same with ``fstat``); a copy that fails is read through the mount, which repairs it.
* **Exact accounting.**  The daemon does not see a direct read, so the reader reports it:
  ``consumed PLAN INDICES`` on the control file (indices into the plan's file list, ``0-63,65``), after the
  reads.  Each reported file counts as one open served from the cache at the time of the report (``reads.hits``,
  ``reads.plan``, ``opened_bytes``, pass ends, ``rf=auto``'s consumption), and each index of a plan counts at
  most once, so a report sent twice (a loader's worker and its main process) changes nothing the second time.
  Files read through the mount are counted by their ``open`` and must not be reported.

A :class:`PlanBook` owns the plans issued; the :class:`~tierfs.daemon.serving.pins.PinKeeper` the pass's pins;
:class:`BatchPlans` (the data path's) builds plans and counts reports.
"""

from __future__ import annotations

import errno
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tierfs.common.options import LiveSettings
from tierfs.common.protocol import plan_copy_prefix, plan_document, plan_entry
from tierfs.daemon.access import privileged
from tierfs.daemon.backing.revalidator import Revalidator
from tierfs.daemon.cache.store import CacheEntry, CacheStore
from tierfs.daemon.schedule.schedule import Schedule
from tierfs.daemon.serving.pins import PinKeeper
from tierfs.daemon.tree.tree import Tree

__all__ = ["KEEP_PLANS", "BatchPlans", "Plan", "PlanBook", "PlanReads", "PlanRenderer", "PlanStatistics"]

#: Plans kept for late reports once their pass is over (a report about an older one fails with EINVAL); the
#: plans of the pass that runs are all kept.
KEEP_PLANS = 64


@dataclass(eq=False)
class Plan:
    """One plan: the files of one pass in serving order, and the copies it names (pinned while ``pinned``)."""

    id: int
    epoch: int
    mini_epoch: int
    pass_index: int
    passes_total: int
    files: np.ndarray  # fidx, serving order
    copies: list[CacheEntry | None]  # per position: the pinned copy, or None (read through the mount)
    reported: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))
    pinned: bool = True  # its pass still runs (its copies are pinned for that pass: the pin keeper's)


@dataclass(frozen=True)
class PlanStatistics:
    issued: int  # plans rendered since mount
    pinned_plans: int  # plans whose pass still runs
    pinned_copies: int  # copies pinned for them (once each, however many plans name it)
    reported: int  # files reported consumed (each counted as an open served from the cache)


class PlanBook:
    """The plans issued (the last :data:`KEEP_PLANS`) and what was reported of each."""

    def __init__(self) -> None:
        self._plans: OrderedDict[int, Plan] = OrderedDict()
        self._serial = 0
        self.issued = 0
        self.reported = 0

    def issue(self, *, epoch: int, mini_epoch: int, pass_index: int, passes_total: int, files: np.ndarray,
              copies: list[CacheEntry | None]) -> Plan:
        """Record a plan of the pass that runs (its copies pinned by the pin keeper)."""
        self._serial += 1
        self.issued += 1
        plan = Plan(self._serial, epoch, mini_epoch, pass_index, passes_total, files, copies,
                    np.zeros(len(files), bool))
        self._plans[plan.id] = plan
        if len(self._plans) > KEEP_PLANS:
            # forget the oldest plans whose pass is over; a plan of the pass that runs keeps its pins (and its
            # place) however many readers ask, until the pass ends
            for old in [p for p in self._plans.values() if not p.pinned][: len(self._plans) - KEEP_PLANS]:
                del self._plans[old.id]
        return plan

    def get(self, plan_id: int) -> Plan:
        plan = self._plans.get(plan_id)
        if plan is None:
            raise ValueError(f"consumed: no plan {plan_id} (unknown, or older than the last {KEEP_PLANS} of passes "
                             "over)")
        return plan

    def pass_over(self) -> None:
        """The pass the plans were issued in is over."""
        for plan in self._plans.values():
            plan.pinned = False

    @property
    def pinned_plans(self) -> int:
        return sum(p.pinned for p in self._plans.values())


class PlanReads(Protocol):
    """Where reported reads are counted (the data path implements it)."""

    def served_from_copies(self, reads: list[tuple[int, CacheEntry]]) -> None:
        """Count direct reads of copies ((fidx, copy) pairs, in order) as opens served from the cache."""


class BatchPlans:
    """Renders the ``plan`` file of the current pass and counts the reports about it; owns the :class:`PlanBook`.

    The parts it reads (tree, cache, revalidator, schedule, settings) are the data path's; the copies it names
    are pinned by the ``pins`` keeper; reported reads are counted by ``reads``."""

    def __init__(self, *, tree: Tree, cache: CacheStore, reval: Revalidator, schedule: Schedule,
                 settings: LiveSettings, pins: PinKeeper, reads: PlanReads) -> None:
        self.tree = tree
        self.cache = cache
        self.reval = reval
        self.schedule = schedule
        self.settings = settings
        self.pins = pins
        self.reads = reads
        self.book = PlanBook()
        self.renderer = PlanRenderer(cache.data_path)

    def statistics(self) -> PlanStatistics:
        book = self.book
        return PlanStatistics(book.issued, book.pinned_plans, self.pins.statistics().pass_pins, book.reported)

    async def plan_text(self, uid: int) -> bytes:
        """The ``plan`` file for a reader with ``uid``: a batch plan of the current pass, every copy it names
        pinned until the pass ends; ``EACCES`` for anyone who cannot open the copies.

        A copy is named only where :meth:`open_file` would serve it now: indexed, fingerprint within
        ``revalidate`` (the older ones are confirmed here, in batches, and left out if the backing disagrees or
        does not answer), ``verify=xxhash`` done.  The copy's own identity (``copy_id``, its size) goes with
        it: the cache dir is not trusted, and the reader checks what it opens against it (``tierfs.loaders``
        does), as an open checks a copy with ``fstat`` -- no ``lstat`` per copy here, on every plan."""
        if not privileged(uid):
            raise PermissionError(errno.EACCES, "the batch plan is for the mount's user and root")
        self.pins.return_leases()
        verify = self.settings.current.verify == "xxhash"
        while True:
            view = self.schedule.view
            assert view is not None
            order = view.order.tolist()
            get = self.cache.get
            cands = [(f, e) for f, e in zip(order, map(get, order), strict=True)
                     if e is not None and (e.verified or not verify)]
            fidx = np.fromiter((f for f, _ in cands), np.int64, len(cands))
            fresh = self.reval.fresh_mask(fidx).tolist()
            # (a file changed, gone or unanswered is left out: its open through the mount handles it)
            confirmed = await self.reval.confirm_many([f for (f, _), ok in zip(cands, fresh, strict=True) if not ok],
                                                      timeout=self.settings.current.backing_timeout_s)
            if self.schedule.view is not view:  # the pass ended meanwhile: plan the new one
                continue
            # (after the await: still the indexed copy, and still of the backing file the tree knows)
            holds = self.tree.holds_many(fidx, [e.fp for _, e in cands]).tolist()
            by_fidx = {f: e for (f, e), ok, same in zip(cands, fresh, holds, strict=True)
                       if get(f) is e and (ok or f in confirmed) and same}
            copies = [by_fidx.get(f) for f in order]
            self.pins.pin_for_pass(by_fidx.values())
            pos = self.schedule.pos
            plan = self.book.issue(epoch=view.epoch, mini_epoch=view.mini_epoch, pass_index=pos.pass_index,
                                   passes_total=pos.passes_total, files=view.order, copies=copies)
            return self.renderer.render(plan, self.tree.file_path, self.tree.sizes[view.order].tolist())

    def check_consumed(self, plan_id: int, indices: list[int]) -> None:
        """``ValueError`` unless every index names a copy of plan ``plan_id`` (a report is all or nothing)."""
        plan = self.book.get(plan_id)
        for i in indices:
            if not 0 <= i < len(plan.copies):
                raise ValueError(f"consumed: plan {plan_id} has {len(plan.copies)} files, no index {i}")
            if plan.copies[i] is None:
                raise ValueError(f"consumed: file {i} of plan {plan_id} has no copy in it: its open through the "
                                 "mount counts it")

    def consumed(self, plan_id: int, indices: list[int]) -> None:
        """Count reported direct reads of a plan's copies as opens served from the cache, each index once."""
        plan = self.book.get(plan_id)
        files, copies, reported = plan.files.tolist(), plan.copies, plan.reported
        new = [i for i in dict.fromkeys(indices) if copies[i] is not None and not reported[i]]
        reported[new] = True
        self.book.reported += len(new)
        self.reads.served_from_copies([(files[i], copies[i]) for i in new])  # type: ignore[misc]

    def pass_over(self) -> None:
        """The pass ended: the copies its plans named are no longer pinned for them."""
        self.book.pass_over()
        self.pins.pass_over()


class PlanRenderer:
    """Renders ``plan`` files (the format is the protocol's: :func:`tierfs.common.protocol.plan_entry`,
    :func:`~tierfs.common.protocol.plan_document`), keeping each file's rendered entry while its copy (or its having
    none) and its size stay the same: the passes of a mini-epoch list the same files, and rendering costs more
    per file than anything else a plan does.  Entries are kept for the files of the last plan rendered (about
    that plan's size)."""

    def __init__(self, data_path: str) -> None:
        self.data_path = data_path
        self._kept: dict[int, tuple[CacheEntry | None, int, str]] = {}  # fidx -> (copy, size, entry text)

    def render(self, plan: Plan, path_of: Callable[[int], bytes], sizes: list[int]) -> bytes:
        kept, made = self._kept, {}
        copy_prefix: str | None = None
        parts = []
        for f, size, entry in zip(plan.files.tolist(), sizes, plan.copies, strict=True):
            k = kept.get(f)
            if k is None or k[0] is not entry or k[1] != size:
                if copy_prefix is None:
                    copy_prefix = plan_copy_prefix(self.data_path)
                k = (entry, size, plan_entry(path_of(f), size, entry, copy_prefix))
            made[f] = k
            parts.append(k[2])
        self._kept = made  # (files of older plans are forgotten)
        return plan_document(plan.id, plan.epoch, plan.mini_epoch, plan.pass_index, plan.passes_total, parts)

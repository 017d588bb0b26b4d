"""Batch plans: one read of ``/.tierfs/plan`` gives a direct reader the whole pass, copies pinned until it ends.

A reader that opens cached copies itself (see :mod:`tierfs.direct`) still pays one ``getxattr`` round trip per
file.  A *plan* removes that: it lists every file of the current pass in serving order, with, for each file
the daemon would serve from its cache, the absolute path of the copy and the fingerprint it was made from.  The
reader then makes no FUSE request per cached file at all.

Three promises keep that as safe as ``open()``:

* **The copies stay.**  Every copy a plan names is pinned (:meth:`~tierfs.cache.CacheStore.pin`) from the
  moment the plan is rendered until its pass ends (all read, ``next-pass``, the root listed again, a switch):
  an eviction, a switch request that cannot happen yet or a change of the backing file only *dooms* it, and
  its name (never reused) is unlinked on the last unpin, after the pass.
* **No changed file.**  A copy is named only if an ``open`` would serve it at that moment: its fingerprint is
  within ``revalidate`` (or confirmed by a ``stat`` while the plan is built), the copy is what was committed
  (checked like an open checks it) and, with ``verify=xxhash``, hashed.  Anything else is listed without a
  copy, and the reader opens it through the mount, which fetches, re-stages and counts it as usual.
* **Exact accounting.**  The daemon does not see a direct read, so the reader reports it:
  ``consumed PLAN INDICES`` on the control file (indices into the plan's file list, ``0-63,65``), after the
  reads.  Each reported file counts as one open served from the cache at the time of the report (``reads.hits``,
  ``reads.plan``, ``opened_bytes``, pass ends, ``rf=auto``'s consumption), and each index of a plan counts at
  most once, so a report sent twice (a loader's worker and its main process) changes nothing the second time.
  Files read through the mount are counted by their ``open`` and must not be reported.

A :class:`PlanBook` owns the plans issued and their pins; :class:`BatchPlans` (the data path's) builds plans and
counts reports.
"""

from __future__ import annotations

import errno
import os
import stat
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]

import numpy as np
import trio

from tierfs.backing import Backing
from tierfs.cache import CacheEntry, CacheStore
from tierfs.copies import copy_matches
from tierfs.options import Settings
from tierfs.revalidate import Revalidator
from tierfs.schedule import Schedule
from tierfs.tree import Tree, fingerprint

__all__ = ["KEEP_PLANS", "BatchPlans", "Plan", "PlanBook", "PlanStatistics", "check_copies", "may_read_directly",
           "render_plan"]

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
    pinned: bool = True


@dataclass(frozen=True)
class PlanStatistics:
    issued: int  # plans rendered since mount
    pinned_plans: int  # plans whose pass still runs
    pinned_copies: int  # copies named by those plans (a copy in two plans counts twice)
    reported: int  # files reported consumed (each counted as an open served from the cache)


def check_copies(data_fd: int, copies: list[tuple[str, int, tuple[int, int]]]) -> list[bool]:
    """Check each (name, size, copy_id) as an open checks it -- a regular file, the committed size, inode, ctime
    and the landing mtime -- with one ``lstat`` each (the reader opens it, not us), in one worker thread."""
    ok = []
    for name, size, copy_id in copies:
        try:
            st = os.stat(name, dir_fd=data_fd, follow_symlinks=False)
        except OSError:
            ok.append(False)
            continue
        ok.append(copy_matches(st, size, copy_id))
    return ok


class PlanBook:
    """The plans issued (the last :data:`KEEP_PLANS`), their pins, and what was reported of each."""

    def __init__(self, cache: CacheStore) -> None:
        self.cache = cache
        self._plans: OrderedDict[int, Plan] = OrderedDict()
        self._serial = 0
        self.issued = 0
        self.reported = 0

    def issue(self, *, epoch: int, mini_epoch: int, pass_index: int, passes_total: int, files: np.ndarray,
              copies: list[CacheEntry | None]) -> Plan:
        """Record a plan whose ``copies`` the caller has pinned (one pin each); they are unpinned at pass end."""
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

    def _unpin(self, plan: Plan) -> bool:
        freed = False
        if plan.pinned:
            plan.pinned = False
            for entry in plan.copies:
                if entry is not None:
                    freed |= self.cache.unpin(entry)
        return freed

    def pass_over(self) -> bool:
        """The pass the plans were issued in is over: unpin their copies; True if that freed space."""
        freed = False
        for plan in self._plans.values():
            freed |= self._unpin(plan)
        return freed

    def statistics(self) -> PlanStatistics:
        pinned = [p for p in self._plans.values() if p.pinned]
        return PlanStatistics(self.issued, len(pinned), sum(sum(c is not None for c in p.copies) for p in pinned),
                              self.reported)



def may_read_directly(uid: int) -> bool:
    """Whether a reader with ``uid`` may be given cached copies (the cache dir is 0700: ours, or root)."""
    return uid in (0, os.getuid())


class BatchPlans:
    """Renders the ``plan`` file of the current pass and counts the reports about it; owns the :class:`PlanBook`.

    The parts it reads (tree, cache, revalidator, backing, schedule) are the data path's; ``served(fidx, copy)``
    counts a reported read as an open served from the cache, ``freed()`` says an unpin freed space,
    ``repair(copy, reason)`` handles a damaged copy, ``return_leases()`` unpins expired leases first."""

    def __init__(self, *, tree: Tree, cache: CacheStore, cache_limiter: trio.CapacityLimiter, backing: Backing,
                 reval: Revalidator, schedule: Schedule, settings: Callable[[], Settings],
                 timeout: Callable[[], float | None], return_leases: Callable[[], None],
                 served: Callable[[int, CacheEntry], None], freed: Callable[[], None],
                 repair: Callable[[CacheEntry, str], Awaitable[None]]) -> None:
        self.tree = tree
        self.cache = cache
        self.cache_limiter = cache_limiter
        self.backing = backing
        self.reval = reval
        self.schedule = schedule
        self._settings = settings
        self._timeout = timeout
        self._return_leases = return_leases
        self._served = served
        self._freed = freed
        self._repair = repair
        self.book = PlanBook(cache)

    @property
    def settings(self) -> Settings:
        return self._settings()

    def statistics(self) -> PlanStatistics:
        return self.book.statistics()

    async def plan_text(self, uid: int) -> bytes:
        """The ``plan`` file for a reader with ``uid``: a batch plan of the current pass, every copy it names
        pinned until the pass ends; ``EACCES`` for anyone who cannot open the copies.

        A copy is named only where :meth:`open_file` would serve it now: fingerprint within ``revalidate`` (the
        older ones are confirmed here, in batches, and left out if the backing disagrees or does not answer),
        the copy as committed (checked in one cache thread), ``verify=xxhash`` done.  Pins are taken before the
        check and kept only for copies that pass it while the view is still the one the plan is about."""
        if not may_read_directly(uid):
            raise PermissionError(errno.EACCES, "the batch plan is for the mount's user and root")
        self._return_leases()
        verify = self.settings.verify == "xxhash"
        while True:
            view = self.schedule.view
            assert view is not None
            order = view.order.tolist()
            get = self.cache.get
            cands = [(f, e) for f, e in zip(order, map(get, order), strict=True)
                     if e is not None and (e.verified or not verify)]
            fresh = self.reval.fresh_mask(np.fromiter((f for f, _ in cands), np.int64, len(cands))).tolist()
            confirmed = await self._confirm_many([f for (f, _), ok in zip(cands, fresh, strict=True) if not ok])
            pinned: list[CacheEntry] = []
            for (f, e), ok in zip(cands, fresh, strict=True):
                # (after the awaits: still the indexed copy, and still the backing file's fingerprint)
                if get(f) is e and (ok or f in confirmed) and e.fp == fingerprint(self.tree.file_node(f).st):
                    self.cache.pin(e)
                    pinned.append(e)
            try:
                ok = await trio.to_thread.run_sync(
                    check_copies, self.cache.data_fd, [(e.name, e.size, e.copy_id) for e in pinned],
                    limiter=self.cache_limiter)
            except BaseException:
                self._unpin_all(pinned)
                raise
            if self.schedule.view is not view:  # the pass ended meanwhile: plan the new one
                self._unpin_all(pinned)
                continue
            by_fidx: dict[int, CacheEntry] = {}
            damaged: list[CacheEntry] = []
            for e, good in zip(pinned, ok, strict=True):
                if good and self.cache.get(e.fidx) is e:  # (still indexed: not evicted or changed meanwhile)
                    by_fidx[e.fidx] = e
                else:
                    self._unpin_all([e])
                    if not good:
                        damaged.append(e)
            pos = self.schedule.pos
            plan = self.book.issue(epoch=view.epoch, mini_epoch=view.mini_epoch, pass_index=pos.pass_index,
                                    passes_total=pos.passes_total, files=view.order,
                                    copies=[by_fidx.get(f) for f in order])
            text = render_plan(plan, [self.tree.file_path(f) for f in order], self.tree.sizes[view.order].tolist(),
                               self.cache.data_path)
            for e in damaged:
                await self._repair(e, f"copy {e.name} was changed in the cache dir")
            return text

    def _unpin_all(self, entries: list[CacheEntry]) -> None:
        if any([self.cache.unpin(e) for e in entries]):
            self._freed()

    async def _confirm_many(self, stale: list[int]) -> set[int]:
        """Of ``stale``, the files whose backing fingerprint is still the tree's (asked in batches now).

        A file that changed, vanished or did not answer within ``backing_timeout`` is left out: the reader opens
        it through the mount, whose open handles the change (or the stall) as it always does."""
        ok: set[int] = set()
        for start in range(0, len(stale), 256):
            batch = stale[start:start + 256]
            self.reval.open_checks += len(batch)
            try:
                answers = await self.backing.stat_many([self.tree.file_path(f) for f in batch],
                                                       timeout=self._timeout())
            except OSError:
                return ok
            for f, st in zip(batch, answers, strict=True):
                if isinstance(st, os.stat_result) and stat.S_ISREG(st.st_mode) \
                        and fingerprint(st) == fingerprint(self.tree.file_node(f).st):
                    self.reval.confirm(f)
                    ok.add(f)
        return ok

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
        for i in indices:
            entry = plan.copies[i]
            if plan.reported[i] or entry is None:
                continue
            plan.reported[i] = True
            self.book.reported += 1
            self._served(int(plan.files[i]), entry)

    def pass_over(self) -> None:
        """The pass ended: the copies its plans named are no longer pinned for them."""
        if self.book.pass_over():
            self._freed()


def render_plan(plan: Plan, paths: list[bytes], sizes: list[int], data_path: str) -> bytes:
    """The ``plan`` file: one JSON object (see docs/tierfs.md, "Batch plans").

    Paths are mount-relative; a name that is not UTF-8 is decoded with ``surrogateescape`` (``os.fsdecode``)
    and written with its lone surrogates escaped (``\\udcff``), so ``os.fsencode(json.loads(...))`` gives the
    name's bytes back.  Written piece by piece with the json module's own string encoder: a plan is rendered
    per read, for every file of the pass, and ``json.dumps`` of a list of dicts costs several times more."""
    enc = encode_basestring_ascii
    copy_prefix = enc(data_path + os.sep)[:-1]  # the opening quote and the dir; a copy's name is [0-9a-f-]
    parts = []
    for rel, size, entry in zip(paths, sizes, plan.copies, strict=True):
        head = f'{{"path":{enc(rel.decode("utf-8", "surrogateescape"))},"size":{size},"copy":'
        if entry is None:
            parts.append(head + "null}")
        else:
            fp = entry.fp
            parts.append(f'{head}{copy_prefix}{entry.name}","fingerprint":[{fp[0]},{fp[1]},{fp[2]},{fp[3]}]}}')
    return (f'{{"plan":{plan.id},"epoch":{plan.epoch},"mini_epoch":{plan.mini_epoch},"pass":{plan.pass_index},'
            f'"passes_total":{plan.passes_total},"files":[' + ",".join(parts) + "]}\n").encode()

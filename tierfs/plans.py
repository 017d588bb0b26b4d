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

A :class:`PlanBook` owns the plans issued and their pins; ``DataPath`` builds plans and counts reports.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]

import numpy as np

from tierfs.cache import CacheEntry, CacheStore, copy_matches

__all__ = ["KEEP_PLANS", "Plan", "PlanBook", "PlanStatistics", "check_copies", "render_plan"]

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

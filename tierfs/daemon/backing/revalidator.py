"""Revalidation: how old a backing file's fingerprint may be when an open uses it, and keeping it young.

An open of a cached file must not wait on the slow tier.  So the fingerprint an open compares against is the
one the tree holds, and this object keeps, per file, when that fingerprint was last confirmed by the backing
(a ``stat`` that agreed, or a staging copy that read the file).  ``revalidate`` bounds its age:

* seconds (the default, see ``docs/tierfs.md``): an open uses a fingerprint confirmed within that many seconds
  without asking the backing; an older one is checked first (a backing round trip, once);
* ``open``: every open checks (close-to-open consistency, NFS's default);
* ``never``: the scan's fingerprints are trusted until a remount.

Because tierfs knows the serving order, :meth:`Revalidator.run` re-stats ahead of the readers, in bulk and in
backing threads: the files of the view not yet opened this pass (in serving order) and the copies of the next
mini-epoch, every one whose confirmation is older than half of ``revalidate``.  So an open finds a fingerprint
checked moments ago and makes no backing call at all, and a change in the backing is still seen within
``revalidate`` seconds.

**Directories too.**  The kernel checks other users against a directory's mode and owner (``default_permissions``),
so a ``chmod 700`` of a class directory on the backing must close it through the mount as well: every directory
is re-stat'ed like the files, once its mode and owner are older than half of ``revalidate`` (under ``open``, of
the default 30 s; under ``never``, not at all), and a change goes straight to the tree
(:meth:`~tierfs.daemon.tree.tree.Tree.update_access`), which has the kernel told (see the namespace).  A directory's
other attributes, and its entries, stay the scan's.

While the backing is lost (see calls.py) nothing is asked -- an open serves its copy, unconfirmed -- and once
it is back every fingerprint counts as unconfirmed: it may have changed while nobody could see it.

**One verdict.**  Whether a backing answer (a stat, or the error asking for one) still describes the file the
tree knows is decided in one place, :meth:`Revalidator.verdict`, for the background re-stats, an open's own check
(:meth:`Revalidator.ask`), a batch plan's (:meth:`Revalidator.confirm_many`) and an open of the backing file;
whether a *copy* is still of that file is :meth:`~tierfs.daemon.tree.tree.Tree.holds` (the copy's fingerprint against
the tree's).  What a changed or vanished file means for the other parts is the engine's
(:class:`RevalidatorEvents`).
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import os
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import trio

from tierfs.common.options import LiveSettings
from tierfs.daemon.backing.calls import Backing, answered_gone
from tierfs.daemon.runtime.wakeup import Wakeup
from tierfs.daemon.schedule.policy import CachePolicy
from tierfs.daemon.tree.tree import Tree, stat_fingerprints

__all__ = ["BATCH", "Revalidator", "RevalidatorEvents", "RevalidatorStatistics", "Verdict"]

log = logging.getLogger("tierfs")

BATCH = 256  # paths per thread hop
PARALLEL = 8  # batches in flight at once
#: Confirmation times are float32 (4 bytes a file): seconds after a base that moves on this often, so recent
#: ones stay below 2**12 s, where float32 resolves 0.5 ms.
REBASE_S = float(1 << 12)
#: ``revalidate`` for directories under ``revalidate=open`` (the default's: every open checks its file, not the
#: directories above it)
DIRS_UNDER_OPEN_S = 30.0


@dataclass(frozen=True)
class RevalidatorStatistics:
    setting: float | str
    checked: int  # backing stats made to confirm fingerprints
    changed: int  # files found changed by them
    open_checks: int  # opens that had to ask the backing first (fingerprint too old)
    unconfirmed: int  # of those, opens served from the copy because a stalled backing did not answer in time


class Verdict(enum.Enum):
    """What a backing answer says of a file the tree knows (:meth:`Revalidator.verdict`)."""

    SAME = "same"  # still the file the tree knows
    CHANGED = "changed"  # a regular file with another fingerprint
    GONE = "gone"  # not there, or no longer a regular file
    UNKNOWN = "unknown"  # the backing could not say (an error other than "not there"): nothing confirmed


class RevalidatorEvents(Protocol):
    """What the background re-stats find, for the engine (it implements this)."""

    def changed(self, fidx: int, st: os.stat_result) -> None:
        """The backing file now has stat ``st`` (the tree takes it, the old copy goes, it is staged again)."""

    def gone(self, fidx: int) -> None:
        """The backing file is gone from a live backing root, or no longer a regular file: out of the
        mini-epochs (its open answers ENOENT)."""

    def drop_copy(self, fidx: int) -> None:
        """``fidx``'s copy and the kernel's pages of it may be of an old version: they go."""


class Revalidator:
    """Per-file confirmation times and the background task that renews them (see the module docstring).

    The cache ``policy`` gives the files worth renewing, most urgent first (``revalidation_candidates``); the
    ``revalidate`` setting is read from the mount's ``settings`` (:meth:`notify` when it changed).  Every answer
    is judged on the trio thread (:meth:`verdict`): a file gone or changed goes to ``events``; an error other
    than "gone" confirms nothing."""

    def __init__(self, tree: Tree, backing: Backing, *, policy: CachePolicy, settings: LiveSettings,
                 events: RevalidatorEvents) -> None:
        #: time of the last agreeing backing answer per file: seconds after ``_base`` (see :meth:`_now`)
        self.confirmed = np.full(tree.n_slots, -math.inf, np.float32)
        self._dirs = tree.dir_nodes  # ... and per directory (the same units)
        self.dir_confirmed = np.full(len(self._dirs), -math.inf, np.float32)
        self._base = time.monotonic()
        self.tree = tree
        self.backing = backing
        self.policy = policy
        self.settings = settings
        self.events = events
        self._wake = Wakeup()
        self.checked = 0
        self.changed = 0
        self.open_checks = 0
        self.unconfirmed = 0
        self.dirs_changed = 0  # directories whose mode or owner changed
        self._unapplied = 0  # changes found that could not be applied (their copies dropped: see _apply_change)
        self._recoveries = backing.recoveries  # the backing's recoveries seen so far

    @property
    def setting(self) -> float | str:
        """``revalidate`` now: seconds, ``open`` or ``never``."""
        return self.settings.current.revalidate

    def notify(self) -> None:
        """``revalidate`` changed: the background task looks again."""
        self._wake.notify()

    def _now(self, now: float | None = None) -> float:
        """``now`` (monotonic, default the present) in the units of ``confirmed``; a value from before a
        rebase means nothing after it, so none is kept across an ``await``."""
        now = time.monotonic() if now is None else now
        if now - self._base > REBASE_S:
            self.confirmed -= np.float32(now - self._base)
            self.dir_confirmed -= np.float32(now - self._base)
            self._base = now
        return now - self._base

    def fresh(self, fidx: int, now: float | None = None) -> bool:
        """Whether an open may use ``fidx``'s fingerprint without asking the backing."""
        s = self.setting
        if s == "never":
            return True
        if s == "open":
            return False
        return self._now(now) - self.confirmed[fidx] <= float(s)

    def fresh_mask(self, files: np.ndarray) -> np.ndarray:
        """:meth:`fresh` for many files at once (a batch plan asks for a whole pass)."""
        s = self.setting
        if s in ("never", "open"):
            return np.full(files.shape, s == "never", bool)
        return self._now() - self.confirmed[files] <= float(s)

    def confirm(self, fidx: int, now: float | None = None) -> None:
        self.confirmed[fidx] = self._now(now)

    def confirm_all(self) -> None:
        """A scan just read every fingerprint (and every directory's mode and owner)."""
        self.confirmed[:] = self.dir_confirmed[:] = self._now()

    def forget(self, fidx: int) -> None:
        """The fingerprint changed: nothing confirms the new one yet."""
        self.confirmed[fidx] = -math.inf

    async def run(self) -> None:
        slots = trio.Semaphore(PARALLEL)
        async with trio.open_nursery() as nursery:
            while True:
                if self.backing.lost:
                    await self.backing.wait_answering()  # (no re-stat storm against a backing that is gone)
                if self.backing.recoveries != self._recoveries:
                    self._recoveries = self.backing.recoveries
                    self.confirmed[:] = self.dir_confirmed[:] = -math.inf
                s = self.setting
                if s == "never":
                    await self._wake.wait()
                    continue
                # (files: under open, each open checks its own; directories: see the module docstring)
                horizon = float(s) / 2 if s != "open" else math.inf
                dir_horizon = (float(s) if s != "open" else DIRS_UNDER_OPEN_S) / 2
                now = self._now()
                due = self._due(now, horizon) if s != "open" else np.zeros(0, np.int64)
                dirs_due = np.flatnonzero(now - self.dir_confirmed > dir_horizon)
                if not due.size and not dirs_due.size:
                    with trio.move_on_after(max(0.05, min(horizon / 2, dir_horizon / 2, 1.0))):
                        await self._wake.wait()
                    continue
                for start in range(0, int(dirs_due.size), BATCH):
                    batch = dirs_due[start:start + BATCH]
                    self.dir_confirmed[batch] = self._now()  # (in hand, as the files below)
                    await slots.acquire()
                    nursery.start_soon(self._check_dirs, batch, slots)
                for start in range(0, int(due.size), BATCH):
                    batch = due[start:start + BATCH].tolist()
                    # mark them as in hand so the next round does not ask again while these travel (the time
                    # taken again: the base may have moved while this loop waited for a slot); an unanswered
                    # batch is forgotten again.  (Marked ``horizon`` ago they would be due again at once.)
                    self.confirmed[batch] = self._now()
                    await slots.acquire()
                    nursery.start_soon(self._check, batch, slots)
                await trio.sleep(0)

    def _due(self, now: float, horizon: float) -> np.ndarray:
        """The candidates confirmed longer than ``horizon`` ago (the candidates themselves -- a whole view of
        file indices -- are not kept while those are checked)."""
        # (ahead: what the readers may open before the next round comes back to it, twice over)
        cand = self.policy.revalidation_candidates(4 * horizon)
        return cand[now - self.confirmed[cand] > horizon] if cand.size else cand

    async def _check(self, batch: list[int], slots: trio.Semaphore) -> None:
        files = np.asarray(batch, np.int64)
        try:
            answers = await self.backing.stat_many(self.tree.file_paths(files), timeout=None)
        except OSError:
            for f in batch:
                self.forget(f)  # unanswered: not confirmed
            return
        finally:
            slots.release()
        now = self._now()
        self.checked += len(batch)
        # A round re-stats every unread file of the view (a million for a whole-tree view, every ``revalidate / 2``
        # seconds), on the trio thread: the answers that agree with the tree are found with numpy (the one
        # verdict's "same", for a whole batch: ``stat_fingerprints`` + ``Tree.holds_many``), only the others
        # are judged one at a time.
        fps, regular = stat_fingerprints(answers, self.tree.stable_inodes)
        same = regular & self.tree.holds_many(files, fps)
        self.confirmed[files[same]] = now
        gone = []
        for fidx, answer in itertools.compress(zip(batch, answers, strict=True), (~same).tolist()):
            verdict = self.verdict(fidx, answer)
            if verdict is Verdict.UNKNOWN:
                self.forget(fidx)
                continue
            if verdict is Verdict.GONE:
                gone.append(fidx)
            elif verdict is Verdict.CHANGED:
                assert isinstance(answer, os.stat_result)
                self._apply_change(fidx, answer)
            self.confirmed[fidx] = now
            self.changed += verdict is not Verdict.SAME
        # (gone only from a live root: a backing whose root went -- an unmounted share -- takes nothing for gone)
        if gone and await self.backing.root_alive(timeout=self.settings.current.backing_timeout_s):
            for fidx in gone:
                self.events.gone(fidx)
        else:
            for fidx in gone:
                self.forget(fidx)

    def _apply_change(self, fidx: int, st: os.stat_result) -> None:
        """Hand a change found to ``events``.  One that cannot be applied (a bug: the tree refused the stat, as a
        date past 2262 once made it) drops the copy all the same -- the old bytes are never served for a file
        known changed -- and is logged, the first time with its traceback; the round goes on with the other
        files (a task that died here would leave every answer of its batch unapplied, every second)."""
        try:
            self.events.changed(fidx, st)
        except Exception:
            self.events.drop_copy(fidx)  # (the copy and the kernel's pages of the old version go)
            self._unapplied += 1
            if self._unapplied == 1:
                log.exception("%s: changed in the backing dir, and the change could not be applied: its copy "
                              "dropped (further such failures are counted, not logged)",
                              os.fsdecode(self.tree.file_path(fidx)))

    async def _check_dirs(self, batch: np.ndarray, slots: trio.Semaphore) -> None:
        """Re-stat the directories at ``batch`` (indices into ``_dirs``); a changed mode or owner goes to the tree."""
        nodes = self._dirs[batch]
        try:
            answers = await self.backing.stat_many(self.tree.dir_paths(nodes), timeout=None)
        except OSError:
            self.dir_confirmed[batch] = -math.inf  # unanswered: not confirmed
            return
        finally:
            slots.release()
        now = self._now()
        for k, node, answer in zip(batch.tolist(), nodes.tolist(), answers, strict=True):
            if isinstance(answer, OSError) and not answered_gone(answer):
                self.dir_confirmed[k] = -math.inf
                continue
            # (a directory gone, or no longer one, has nothing to apply: the opens beneath it find out)
            if isinstance(answer, os.stat_result) and stat.S_ISDIR(answer.st_mode) \
                    and self.tree.update_access(node, answer):
                self.dirs_changed += 1
                log.info("%s: mode %o, owner %d:%d in the backing dir now: applied",
                         os.fsdecode(self.tree.path(node) or b"."), stat.S_IMODE(answer.st_mode), answer.st_uid,
                         answer.st_gid)
            self.dir_confirmed[k] = now

    def verdict(self, fidx: int, answer: os.stat_result | OSError) -> Verdict:
        """Whether the backing's ``answer`` about ``fidx`` -- its stat, or the error asking for it -- says it is
        still the file the tree knows: the one decision "is this still our backing file" (see the module
        docstring).  Judges only; what follows is the caller's."""
        if isinstance(answer, OSError):
            return Verdict.GONE if answered_gone(answer) else Verdict.UNKNOWN
        if not stat.S_ISREG(answer.st_mode):
            return Verdict.GONE
        return Verdict.SAME if self.tree.holds(fidx, self.tree.fingerprint(answer)) else Verdict.CHANGED

    async def ask(self, fidx: int, *, timeout: float | None) -> tuple[Verdict, os.stat_result | OSError]:
        """An open's own check, before it uses a fingerprint older than ``revalidate``: the backing's answer and
        its verdict (a regular file's fingerprint, changed or not, is confirmed)."""
        self.open_checks += 1
        answer: os.stat_result | OSError
        try:
            answer = await self.backing.stat(self.tree.file_path(fidx), timeout=timeout)
        except OSError as exc:
            answer = exc
        verdict = self.verdict(fidx, answer)
        if verdict in (Verdict.SAME, Verdict.CHANGED):
            self.confirm(fidx)
        return verdict, answer

    def served_unconfirmed(self) -> None:
        """An open served a copy although its check got no answer (a stalled backing): counted."""
        self.unconfirmed += 1

    async def confirm_many(self, files: Sequence[int], *, timeout: float | None) -> set[int]:
        """Of ``files``, those the backing still holds as the tree knows them (asked now, in batches, each
        counted as an open's check, and confirmed); a file changed, gone or unanswered is left out, and its
        open through the mount finds out (a batch plan asks this for the copies it names)."""
        ok: set[int] = set()
        for start in range(0, len(files), BATCH):
            batch = files[start:start + BATCH]
            self.open_checks += len(batch)
            try:
                answers = await self.backing.stat_many([self.tree.file_path(f) for f in batch], timeout=timeout)
            except OSError:
                return ok
            for f, answer in zip(batch, answers, strict=True):
                if self.verdict(f, answer) is Verdict.SAME:
                    self.confirm(f)
                    ok.add(f)
        return ok

    def statistics(self) -> RevalidatorStatistics:
        return RevalidatorStatistics(self.setting, self.checked, self.changed, self.open_checks, self.unconfirmed)

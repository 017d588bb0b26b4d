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

While the backing is lost (see backing.py) nothing is asked -- an open serves its copy, unconfirmed -- and once
it is back every fingerprint counts as unconfirmed: it may have changed while nobody could see it.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import trio

from tierfs.backing import Backing
from tierfs.tree import Tree, fingerprint

__all__ = ["BATCH", "Revalidator", "RevalidatorStatistics"]

BATCH = 256  # paths per thread hop
PARALLEL = 8  # batches in flight at once
#: Confirmation times are float32 (4 bytes a file): seconds after a base that moves on this often, so recent
#: ones stay below 2**12 s, where float32 resolves 0.5 ms.
REBASE_S = float(1 << 12)
_IFMT = stat.S_IFMT(0o177777)  # the file type bits of a mode


@dataclass(frozen=True)
class RevalidatorStatistics:
    setting: float | str
    checked: int  # backing stats made to confirm fingerprints
    changed: int  # files found changed by them
    open_checks: int  # opens that had to ask the backing first (fingerprint too old)
    unconfirmed: int  # of those, opens served from the copy because a stalled backing did not answer in time


class Revalidator:
    """Per-file confirmation times and the background task that renews them (see the module docstring).

    ``candidates()`` gives the files worth renewing, most urgent first (the cache policy's).  Every answer is
    compared with the tree on the trio thread: a file gone or no longer regular goes to ``gone(fidx)``, one
    whose fingerprint differs to ``changed(fidx, stat)`` (the engine re-stages it and the tree takes the new
    stat); an error other than "gone" confirms nothing."""

    def __init__(self, tree: Tree, backing: Backing, *, setting: float | str, candidates: Callable[[], np.ndarray],
                 changed: Callable[[int, os.stat_result], None], gone: Callable[[int], None]) -> None:
        #: time of the last agreeing backing answer per file: seconds after ``_base`` (see :meth:`_now`)
        self.confirmed = np.full(tree.n_files, -math.inf, np.float32)
        self._base = time.monotonic()
        self.tree = tree
        self.backing = backing
        self.setting: float | str = setting
        self._candidates = candidates
        self._changed = changed
        self._gone = gone
        self._wake = trio.Event()
        self.checked = 0
        self.changed = 0
        self.open_checks = 0
        self.unconfirmed = 0
        self._recoveries = backing.recoveries  # the backing's recoveries seen so far

    def set(self, setting: float | str) -> None:
        self.setting = setting
        self._wake.set()
        self._wake = trio.Event()

    def _now(self, now: float | None = None) -> float:
        """``now`` (monotonic, default the present) in the units of ``confirmed``; a value from before a
        rebase means nothing after it, so none is kept across an ``await``."""
        now = time.monotonic() if now is None else now
        if now - self._base > REBASE_S:
            self.confirmed -= np.float32(now - self._base)
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
        """A scan just read every fingerprint."""
        self.confirmed[:] = self._now()

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
                    self.confirmed[:] = -math.inf
                wake = self._wake
                s = self.setting
                if s in ("open", "never"):
                    await wake.wait()
                    continue
                horizon = float(s) / 2
                due = self._due(self._now(), horizon)
                if not due.size:
                    with trio.move_on_after(max(0.05, min(horizon / 2, 1.0))):
                        await wake.wait()
                    continue
                for start in range(0, int(due.size), BATCH):
                    batch = due[start:start + BATCH].tolist()
                    # mark them as in hand so the next round does not ask again while these travel (the time
                    # taken again: the base may have moved while this loop waited for a slot)
                    self.confirmed[batch] = self._now() - horizon
                    await slots.acquire()
                    nursery.start_soon(self._check, batch, slots)
                await trio.sleep(0)

    def _due(self, now: float, horizon: float) -> np.ndarray:
        """The candidates confirmed longer than ``horizon`` ago (the candidates themselves -- a whole view of
        file indices -- are not kept while those are checked)."""
        cand = self._candidates()
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
        # seconds), on the trio thread: the answers that agree with the tree are found with numpy, only the others
        # one at a time.
        same = _agrees(answers, self.tree.fingerprints(files))
        self.confirmed[files[same]] = now
        for fidx, answer in itertools.compress(zip(batch, answers, strict=True), (~same).tolist()):
            verdict = self._verdict(fidx, answer)
            if verdict == "unknown":
                self.forget(fidx)
            else:
                self.confirmed[fidx] = now
                self.changed += verdict == "changed"

    def _verdict(self, fidx: int, answer: object) -> str:
        """``"same"``, ``"changed"`` (handed on) or ``"unknown"`` (the backing could not say: not confirmed)."""
        if isinstance(answer, OSError):
            if answer.errno in (errno.ENOENT, errno.ENOTDIR):
                self._gone(fidx)  # the next open finds that out from the backing (ENOENT)
                return "changed"
            return "unknown"
        assert isinstance(answer, os.stat_result)
        if not stat.S_ISREG(answer.st_mode):
            self._gone(fidx)
            return "changed"
        if fingerprint(answer) != self.tree.fingerprint_of(fidx):
            self._changed(fidx, answer)
            return "changed"
        return "same"

    def statistics(self) -> RevalidatorStatistics:
        return RevalidatorStatistics(self.setting, self.checked, self.changed, self.open_checks, self.unconfirmed)


#: what an answer must show to agree with the tree: its fingerprint (see ``tree.fingerprint``), and a regular file
_AGREES = attrgetter("st_size", "st_mtime_ns", "st_ino", "st_ctime_ns", "st_mode")


def _agrees(answers: list[os.stat_result | OSError], fingerprints: np.ndarray) -> np.ndarray:
    """Per answer: a regular file's stat with the fingerprint of its row of ``fingerprints`` (int64 [file, 4]).
    All False where one is an error, or a field does not fit an int64: those are judged one at a time."""
    k = len(answers)
    try:
        fields = np.fromiter(itertools.chain.from_iterable(map(_AGREES, answers)), np.int64, 5 * k).reshape(k, 5)
    except (AttributeError, OverflowError):  # (an OSError among them, or an inode number above 2**63)
        return np.zeros(k, bool)
    return (fields[:, :4] == fingerprints).all(axis=1) & (fields[:, 4] & _IFMT == stat.S_IFREG)

"""Whether the loader follows the view: a loader that built its file list once is told so, with the fix.

A loader that lists the dataset once, before its epoch loop (torchvision's reference scripts, timm, Lightning,
a WebDataset brace URL), keeps reading the files it listed: out of view as soon as the mini-epoch moves on (or
from the start, if it listed the whole tree), every read a miss from the slow tier, and the pass never ends,
so the position freezes.  Nothing fails; only the counters say so.  The :class:`LoaderWatch` looks at the
opens that move the schedule (the mount's owner, root, the steering group) pass by pass and raises a warning
when

* ``off-view``: a pass-worth of opens (as many as the view has files, at least :data:`MIN_OPENS`) was made in
  the pass and most of them were outside the view, or
* ``stuck``: the pass has seen :data:`STUCK_FACTOR` pass-worths of opens without ending (a loader that reads a
  part of the view again and again, or drops some of its files every pass).

Each kind is logged once per mount (at warning level, with the fix for this mount's own options: ``listing``
and ``substitute``, :func:`off_view_fix`); ``status`` shows the standing warning (``loader``) until a pass
ends with most of its opens in view.  Plain Python, owned by the engine, fed by its
open callback; under ``policy=lru`` (no mini-epochs to follow) it never warns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["LoaderStatistics", "LoaderWatch", "off_view_fix"]

log = logging.getLogger("tierfs")

#: opens a pass must have seen before either warning is considered (a tiny view says little)
MIN_OPENS = 16
#: pass-worths of opens in one pass that make it ``stuck``
STUCK_FACTOR = 3



def off_view_fix(listing: str, substitute: bool) -> str:
    """The fix an ``off-view`` warning gives on a mount with these options (only what is wrong there)."""
    if substitute:  # (names resolve in view, but for a directory with no file in the view)
        return ("fix: remount with composition=stratified (every directory gets files of each mini-epoch), or give "
                "the DataLoader sampler=tierfs.torch.MountSampler(dataset) (README.md)")
    if listing == "all":  # (every file listed: a dataset built once holds them all; re-listing reads everything)
        return ("fix: this mount lists every file (listing=all): keep the dataset built once and give the DataLoader "
                "sampler=tierfs.torch.MountSampler(dataset); a loader that re-creates its dataset each pass must "
                "not use listing=all (remount without it), or (labels from class folders or inside the files "
                "only) remount with --substitute (README.md)")
    return ("fix: remount with listing=all (--listing all), build the dataset once after it and give the "
            "DataLoader sampler=tierfs.torch.MountSampler(dataset); or re-create the dataset each pass; or (labels "
            "from class folders or inside the files only) remount with listing=all and substitute (README.md)")


@dataclass(frozen=True)
class LoaderStatistics:
    """``status``'s ``loader``: whether the loader follows the view, the standing warning, how many times the
    watch warned (each kind logged the first time only)."""

    follows_view: bool = True
    warning: str | None = None
    warnings: int = 0


class LoaderWatch:
    """See the module docstring."""

    def __init__(self, *, enabled: bool, listing: str = "view", substitute: bool = False) -> None:
        self.enabled = enabled
        self._fix = off_view_fix(listing, substitute)
        self._pass: int | None = None  # passes_total of the pass being counted
        self._opens = self._outside = 0
        self._raised = False  # a warning was raised in this pass
        self._logged: set[str] = set()
        self.warning: str | None = None
        self.warnings = 0

    def opened(self, in_view: bool, passes_total: int, pass_worth: int) -> None:
        """A steering open, before it is counted: ``in_view`` of the view of pass ``passes_total``, which a loader
        that follows the view reads in about ``pass_worth`` opens."""
        if not self.enabled:
            return
        if passes_total != self._pass:
            self._pass_over()
            self._pass = passes_total
        self._opens += 1
        self._outside += not in_view
        if self._raised or self._opens < max(MIN_OPENS, pass_worth):
            return
        if 2 * self._outside > self._opens:
            self._raise("off-view", f"the loader does not follow the view: {self._outside:,} of {self._opens:,} "
                        "opens this pass were outside the current mini-epoch and the "
                        "pass never ends: a file list built once? " + self._fix)
        elif self._opens >= STUCK_FACTOR * max(MIN_OPENS, pass_worth):
            self._raise("stuck", f"the pass does not end: {self._opens:,} opens, {STUCK_FACTOR}x a pass-worth "
                        f"({pass_worth:,}), some of the view still unread (the loader drops or repeats files); fix: "
                        "read every file of .tierfs/order each pass, or use tierfs.torch.MountSampler (it ends a "
                        "pass left unread) (README.md)")

    def _pass_over(self) -> None:
        """The counted pass ended: a pass read mostly in view clears a standing warning."""
        if self._opens and 2 * self._outside <= self._opens and not self._raised:
            self.warning = None
        self._opens = self._outside = 0
        self._raised = False

    def _raise(self, kind: str, message: str) -> None:
        self._raised = True
        self.warning = message
        self.warnings += 1
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("%s", message)

    def statistics(self) -> LoaderStatistics:
        return LoaderStatistics(self.warning is None, self.warning, self.warnings)

"""Substitution (mount option ``substitute``, off by default): a loader built once gets mini-epochs unchanged.

A loader that listed the dataset once keeps opening the names it listed.  With ``substitute`` every dataset
file name resolves, for the current pass, to a file of the current view *in the same directory*: its own file
if that is in the view and not yet served this pass, else the next one of the directory's view files, in
serving order, not yet served (drawn without replacement: every view file of the directory is served once
before any is served again).  The name's entry then *is* the substitute's inode for that pass -- its size,
blocks, times and bytes -- so a reader that trusts ``st_size`` and one that reads to EOF both get the
substitute whole.  Opens count as opens of the substitute, so passes, ``rf`` and staging follow the reads.

The kernel must ask again for each path resolution: ``fs.py`` gives file entries an entry timeout of 0 under
this mode (a ``LOOKUP`` per open; attributes keep their long timeout, they are the inode's own).  The same name
looked up twice in one pass (a ``stat`` then an ``open``, or the kernel revalidating its entry and looking up
again) resolves to the same file: the choice is kept per name until the pass ends.

A directory with no file in the view serves the name's own file (out of view, counted as such).  A lookup and
its open are two requests: a name resolved just before a switch (another reader ended the mini-epoch's last
pass in between) opens the previous mini-epoch's file, whole and of the right folder, counted out of view.

The one risk, stated in the docs: a label kept outside the directory structure -- a side file keyed by file
name -- no longer matches the bytes read.  Class folders, tar shards and files that carry their labels are safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierfs.schedule import Schedule
from tierfs.view import View

__all__ = ["SubstitutionStatistics", "Substitutions"]


@dataclass(frozen=True)
class SubstitutionStatistics:
    """``status``'s ``substitution``: whether it is on, names resolved to another file, rounds restarted (a
    directory whose view files were all served this pass and was asked for more)."""

    enabled: bool = False
    substituted: int = 0
    rounds: int = 0


class _Dir:
    """One directory's view files in serving order, and which were served this round."""

    def __init__(self, files: np.ndarray) -> None:
        self.files = files.tolist()
        self.served: set[int] = set()
        self.cursor = 0
        self.round = 0  # rounds restarted this pass (from the second on, files opened by their names count)


class Substitutions:
    """See the module docstring.  The ``schedule`` has the view of the pass now and says whether a file was
    opened in it already (served by its own name, or by another's: ``opened_in_pass``)."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self._view: View | None = None
        self._dirs: dict[int, _Dir] = {}
        self._chosen: dict[tuple[int, int], int] = {}  # (dir node, name node) -> file, this pass
        self.substituted = self.rounds = 0

    def resolve(self, dir_node: int, name_node: int, fidx: int) -> int:
        """The file that name ``name_node`` (file ``fidx``) of directory ``dir_node`` is served as now."""
        view = self.schedule.view
        if view is None:
            return fidx
        if view is not self._view:  # a new pass (or a new mini-epoch): everything is drawn again
            self._view, self._dirs, self._chosen = view, {}, {}
        key = (dir_node, name_node)
        chosen = self._chosen.get(key)
        if chosen is not None:
            return chosen
        d = self._dirs.get(dir_node)
        if d is None:
            d = self._dirs[dir_node] = _Dir(view.files_in(dir_node))
        if not d.files:
            chosen = fidx  # no file of this directory in the view: its own (out of view)
        elif view.mask[fidx] and fidx not in d.served and not self.schedule.opened_in_pass(fidx):
            chosen = fidx
        else:
            chosen = self._draw(d)
        d.served.add(chosen)
        self._chosen[key] = chosen
        self.substituted += chosen != fidx
        return chosen

    def _draw(self, d: _Dir) -> int:
        """The next view file of ``d`` not served yet (in the first round: nor opened by its own name); once all
        were, a new round in the same order."""
        while True:
            while d.cursor < len(d.files):
                f = d.files[d.cursor]
                d.cursor += 1
                if f not in d.served and (d.round or not self.schedule.opened_in_pass(f)):
                    return f
            d.served, d.cursor = set(), 0
            d.round += 1
            self.rounds += 1

    def statistics(self) -> SubstitutionStatistics:
        return SubstitutionStatistics(True, self.substituted, self.rounds)

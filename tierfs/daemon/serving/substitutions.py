"""Substitution (mount option ``substitute``, off by default): a loader built once gets mini-epochs unchanged.

A loader that listed the dataset once keeps opening the names it listed.  With ``substitute`` every dataset
file name resolves, for the current pass, to a file of the current view *in the same directory*: its own file
if that is in the view and not yet served this pass, else the next one of the directory's view files, in
serving order, not yet served (drawn without replacement: every view file of the directory is served once
before any is served again).  The name's entry then *is* the substitute's inode for that pass -- its size,
blocks, times and bytes -- so a reader that trusts ``st_size`` and one that reads to EOF both get the
substitute whole.  Opens count as opens of the substitute, so passes, ``rf`` and staging follow the reads.

The kernel must ask again for each path resolution: ``operations.py`` gives file entries an entry timeout of 0 under
this mode (a ``LOOKUP`` per open; attributes keep their long timeout, they are the inode's own).  The same name
looked up twice in one pass (a ``stat`` then an ``open``, or the kernel revalidating its entry and looking up
again) resolves to the same file: the choice is kept per name until the pass ends.

**Stale entries.**  A kernel that still holds a name's entry asks about it again at the next open (the timeout
of 0), gets another inode -- this pass's substitute -- drops that answer (a ``FORGET``) and looks the name up
once more: two ``LOOKUP``s and a ``FORGET`` per open where one ``LOOKUP`` would do.  So when a pass begins, the entries
of names served as another file two passes ago, and not looked up since, are :attr:`Substitutions.stale`: the
namespace has the kernel drop them (off the trio thread), and their next open is one ``LOOKUP``.  Not the last
pass's: an entry holds its inode, and with it the inode's pages, which the substitutes of this pass are read
from (every file of the view was served in the last pass, under some name).  Nor a name served as its own file:
its entry points at the file it is most likely served as again.  When a new mini-epoch begins, the entries of
the last pass, and those of names served as their own file, are stale too where their file left the view (all
of them between two mini-epochs of one epoch; none with ``nm`` 1, where every name stays its own file).  A listing
gives the kernel an entry of every name it shows, at the name's own file (readdirplus): when the listing is
closed, the entries of names whose file is out of the view are stale too -- else the first open of each name of
a data set built once would be two lookups.  A drop that comes late (the name was looked up again meanwhile)
costs that name one lookup more, never a wrong file.

A directory with no file in the view serves the name's own file (out of view, counted as such).  A lookup and
its open are two requests: a name resolved just before a switch (another reader ended the mini-epoch's last
pass in between) opens the previous mini-epoch's file, whole and of the right folder, counted out of view.

The one risk, stated in the docs: a label kept outside the directory structure -- a side file keyed by file
name -- no longer matches the bytes read.  Class folders, tar shards and files that carry their labels are safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierfs.daemon.schedule.schedule import Schedule
from tierfs.daemon.schedule.view import View

__all__ = ["SubstitutionStatistics", "Substitutions"]


@dataclass(frozen=True)
class SubstitutionStatistics:
    """``status``'s ``substitution``: whether it is on, names resolved to another file, rounds restarted (a
    directory whose view files were all served this pass and was asked for more), and kernel entries of names
    dropped before their next lookup (see the module docstring)."""

    enabled: bool = False
    substituted: int = 0
    rounds: int = 0
    entries_dropped: int = 0


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
        self._others: set[tuple[int, int]] = set()  # the names of _chosen served as another file
        self._others_before: set[tuple[int, int]] = set()  # and those of the pass before
        #: names served as their own file in this mini-epoch (-> that file); none while the view is every file
        self._own: dict[tuple[int, int], int] = {}
        #: (dir node, name node) of names whose kernel entry is stale: the namespace takes them (take_stale)
        self.stale: list[tuple[int, int]] = []
        self.substituted = self.rounds = self.entries_dropped = 0

    def resolve(self, dir_node: int, name_node: int, fidx: int) -> int:
        """The file that name ``name_node`` (file ``fidx``) of directory ``dir_node`` is served as now."""
        view = self.schedule.view
        if view is None:
            return fidx
        if view is not self._view:  # a new pass (or a new mini-epoch): everything is drawn again
            if self._view is not None:
                self._new_pass(self._view, view)
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
        if chosen != fidx:
            self.substituted += 1
            self._others.add(key)
            self._own.pop(key, None)
        elif len(view) < view.mask.size:
            self._own[key] = fidx
        return chosen

    def _new_pass(self, old: View, new: View) -> None:
        """The pass of ``_chosen`` (in view ``old``) ended: which entries are stale now (module docstring)."""
        chosen = self._chosen
        self.stale.extend(key for key in self._others_before if key not in chosen)
        if (new.epoch, new.mini_epoch) == (old.epoch, old.mini_epoch):
            self._others_before = self._others
        else:  # a new mini-epoch: also the entries whose file left the view
            kept = new.mask
            self.stale.extend(key for key, f in chosen.items() if not kept[f])
            self.stale.extend(key for key, f in self._own.items() if key not in chosen and not kept[f])
            self._own = {}  # (one whose file stays in view: its entry is right, and no longer watched)
            self._others_before = {key for key in self._others if kept[chosen[key]]}
        self._others = set()

    def listed(self, dir_node: int, names: np.ndarray) -> None:
        """A listing of directory ``dir_node`` gave the kernel an entry of each of its file names ``names``
        (nodes) at the name's own file: stale where that file is out of the view (module docstring)."""
        view = self.schedule.view
        if view is not None and names.size:
            out = names[~view.mask[names - 1]].tolist()  # (file node i is file i - 1)
            self.stale.extend(zip([dir_node] * len(out), out, strict=True))

    def take_stale(self) -> list[tuple[int, int]]:
        """The stale entries found so far, handed over once."""
        stale, self.stale = self.stale, []
        return stale

    def dropped(self, entries: int) -> None:
        """The kernel dropped this many of the stale entries it was given (it had no entry for the others)."""
        self.entries_dropped += entries

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
        return SubstitutionStatistics(True, self.substituted, self.rounds, self.entries_dropped)

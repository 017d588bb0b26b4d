"""The view: which files the mount shows during one pass, in which order, and how each directory lists.

A :class:`View` is built once per pass (the serving order is reshuffled every pass) and never changes -- so it is
made ahead, in a worker thread, from the plan's immutable arrays (``Schedule.view_job``); a
directory listing is a snapshot taken from it at ``opendir``.  Directories and symlinks are always listed
(class folders keep their names, so label indices derived from sorted folder names never shift); regular
files only when they are in the view, in serving order.  FIFOs, sockets and device nodes are listed like
symlinks (never dataset files).  With ``listing=all`` the files out of view follow, by name (a dataset built
once sees every file; the view, its order and its passes stay the mini-epoch's).  A view that shares hard
links (``view=full``) holds the first name of each hard-linked file and lists its other names beside it (they
show its inode, see ``Namespace``).
"""

from __future__ import annotations

import itertools

import numpy as np

from sampler.plan import serving_order
from tierfs.daemon.tree.tree import KIND_DIR, KIND_FILE, Tree

__all__ = ["View"]

_serials = itertools.count(1)


class View:
    def __init__(self, tree: Tree, files: np.ndarray, *, seed: int, epoch: int, mini_epoch: int,
                 pass_index: int, hard_links: bool = False, lists_all: bool = False,
                 mask: np.ndarray | None = None) -> None:
        """``mask``: the files' mask if another view of the same files has one (shared, never written)."""
        self.tree = tree
        self.epoch = epoch
        self.mini_epoch = mini_epoch
        self.pass_index = pass_index
        self.hard_links = hard_links  # the other names of a file in view are listed, showing its inode
        self.lists_all = lists_all  # (listing=all) files out of view are listed too, after the view's
        #: tells views apart for the mount's life (never reused, unlike ``id``): a directory's listing is the
        #: same for the same view, so the kernel may keep one it cached from this serial (namespace.py)
        self.serial = next(_serials)
        self.order = serving_order(files, seed=seed, epoch=epoch, mini_epoch=mini_epoch, pass_index=pass_index)
        if mask is None:
            mask = np.zeros(tree.n_slots, dtype=bool)
            mask[files] = True
        self.mask = mask
        self.bytes = int(tree.sizes[files].sum()) if files.size else 0
        # (``files`` is not kept: ``order`` holds the same indices, and a whole-tree view's are its own array)
        self._by_dir: np.ndarray | None = None  # the order grouped by directory (made at the first listing)
        self._dir_start = np.zeros(0, np.int64)  # per directory (``Tree.dir_slot``): where its files start there

    @property
    def files(self) -> np.ndarray:
        """The files in view, in storage order."""
        return np.sort(self.order)

    def __len__(self) -> int:
        return int(self.order.shape[0])

    def _files_of(self, dir_node: int) -> np.ndarray:
        if self._by_dir is None:
            tree = self.tree
            groups = tree.dir_slots(tree.groups[self.order])
            self._by_dir = self.order[np.argsort(groups, kind="stable")]
            self._dir_start = np.zeros(tree.n_dir_slots + 1, np.int64)
            self._dir_start[1:] = np.cumsum(np.bincount(groups, minlength=tree.n_dir_slots))
        s = self.tree.dir_slot(dir_node)
        return self._by_dir[self._dir_start[s]:self._dir_start[s + 1]]

    def files_in(self, dir_node: int) -> np.ndarray:
        """The view's files directly in directory ``dir_node``, in serving order."""
        return self._files_of(dir_node)

    def listing(self, dir_node: int) -> np.ndarray:
        """The nodes directory ``dir_node`` shows, in order: dirs, then links and special files, by name; then
        view files in serving order (and, sharing hard links, the other names of view files)."""
        tree = self.tree
        kids = tree.children(dir_node)
        kinds = tree.kinds[kids]
        others = kids[kinds != KIND_FILE]
        is_dir = tree.kinds[others] == KIND_DIR
        parts = [others[is_dir], others[~is_dir], tree.present(self._files_of(dir_node)) + 1]
        if self.hard_links or self.lists_all:
            here = tree.present(kids[kinds == KIND_FILE] - 1)
            out = here[~self.mask[here]]
            if not self.lists_all:
                out = out[self.mask[tree.first_name_of(out)]]
            parts.append(out + 1)
        return np.concatenate(parts).astype(np.int64)

    def _order_paths(self, listable: np.ndarray | None) -> list[bytes]:
        order = self.tree.present(self.order)  # (a file found gone since the view was made: not read any more)
        order = order if listable is None else order[listable[self.tree.groups[order]]]
        return [self.tree.file_path(f) for f in order.tolist()]

    def order_text(self, listable: np.ndarray | None = None) -> bytes:
        """The ``order`` file: view paths in serving order, one per line, relative to the mount root.

        A path that a line cannot carry as it is -- one holding a newline or a carriage return (which
        ``splitlines`` and most line readers also split on), or one starting with ``"`` -- is written as git
        writes such names: in double quotes, with ``\\``, ``\"``, ``\n`` and ``\r`` escaped.  So the file has
        exactly one line per file, an unquoted line is always the path itself, and a loader that does not decode
        quotes fails loudly on the odd file instead of skipping it.  ``order0`` carries every name as it is.

        ``listable`` (per tree node: may the reader list that directory) leaves out the files of the
        directories it may not list (:func:`tierfs.daemon.access.listable_dirs`).
        """
        return b"".join(_order_line(p) + b"\n" for p in self._order_paths(listable))

    def order0_text(self, listable: np.ndarray | None = None) -> bytes:
        """The ``order0`` file: the same paths, each ended by a NUL byte (like ``find -print0``), never escaped."""
        return b"".join(p + b"\0" for p in self._order_paths(listable))


def _order_line(path: bytes) -> bytes:
    if b"\n" not in path and b"\r" not in path and not path.startswith(b'"'):
        return path
    quoted = path.replace(b"\\", b"\\\\").replace(b'"', b'\\"').replace(b"\n", b"\\n").replace(b"\r", b"\\r")
    return b'"' + quoted + b'"'

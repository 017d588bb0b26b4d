"""The view: which files the mount shows during one pass, in which order, and how each directory lists.

A :class:`View` is built once per pass (the serving order is reshuffled every pass) and never changes; a
directory listing is a snapshot taken from it at ``opendir``.  Directories and symlinks are always listed
(class folders keep their names, so label indices derived from sorted folder names never shift); regular
files only when they are in the view, in serving order.
"""

from __future__ import annotations

import numpy as np

from sampler.plan import serving_order
from tierfs.tree import KIND_DIR, KIND_FILE, Tree

__all__ = ["View"]


class View:
    def __init__(self, tree: Tree, files: np.ndarray, *, seed: int, epoch: int, mini_epoch: int,
                 pass_index: int) -> None:
        self.tree = tree
        self.files = files  # storage order
        self.epoch = epoch
        self.mini_epoch = mini_epoch
        self.pass_index = pass_index
        self.order = serving_order(files, seed=seed, epoch=epoch, mini_epoch=mini_epoch, pass_index=pass_index)
        self.mask = np.zeros(tree.n_files, dtype=bool)
        self.mask[files] = True
        self.bytes = int(tree.sizes[files].sum()) if files.size else 0
        self._by_dir: dict[int, list[int]] | None = None

    def __len__(self) -> int:
        return int(self.files.shape[0])

    def _files_by_dir(self) -> dict[int, list[int]]:
        if self._by_dir is None:
            by_dir: dict[int, list[int]] = {}
            groups = self.tree.groups
            for fidx in self.order.tolist():
                by_dir.setdefault(int(groups[fidx]), []).append(fidx)
            self._by_dir = by_dir
        return self._by_dir

    def listing(self, dir_node: int) -> list[tuple[bytes, int]]:
        """(name, node index) of what directory ``dir_node`` shows: dirs and links by name, then view files."""
        tree = self.tree
        children = tree.nodes[dir_node].children or {}
        out = [(name, i) for name, i in sorted(children.items()) if tree.kind_of(i) != KIND_FILE]
        out.sort(key=lambda e: (tree.kind_of(e[1]) != KIND_DIR, e[0]))
        for fidx in self._files_by_dir().get(dir_node, ()):
            i = int(tree.files[fidx])
            out.append((tree.nodes[i].name, i))
        return out

    def _order_paths(self) -> list[bytes]:
        return [self.tree.file_path(f) for f in self.order.tolist()]

    def order_text(self) -> bytes:
        """The ``order`` file: view paths in serving order, one per line, relative to the mount root.

        A path that a line cannot carry as it is -- one holding a newline or a carriage return (which
        ``splitlines`` and most line readers also split on), or one starting with ``"`` -- is written as git
        writes such names: in double quotes, with ``\\``, ``\"``, ``\n`` and ``\r`` escaped.  So the file has
        exactly one line per file, an unquoted line is always the path itself, and a loader that does not decode
        quotes fails loudly on the odd file instead of skipping it.  ``order0`` carries every name as it is.
        """
        return b"".join(_order_line(p) + b"\n" for p in self._order_paths())

    def order0_text(self) -> bytes:
        """The ``order0`` file: the same paths, each ended by a NUL byte (like ``find -print0``), never escaped."""
        return b"".join(p + b"\0" for p in self._order_paths())


def _order_line(path: bytes) -> bytes:
    if b"\n" not in path and b"\r" not in path and not path.startswith(b'"'):
        return path
    quoted = path.replace(b"\\", b"\\\\").replace(b'"', b'\\"').replace(b"\n", b"\\n").replace(b"\r", b"\\r")
    return b'"' + quoted + b'"'

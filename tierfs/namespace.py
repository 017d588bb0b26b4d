"""The names the mount shows: lookups, listings, links and the ``order`` files, over the tree and the view.

It owns no state of its own: the tree (fixed for the mount's life) says what exists, the schedule's view what
the root lists in this pass.  Every name of the tree can be looked up and opened, in view or not; only the
view is listed.  Two things here are news for other parts: a lookup or a listing tells the pusher the kernel
now has an inode (pushes wait for one), and listing the root again after reads may end the pass
(``root_relisted``: the engine decides, by who listed).
"""

from __future__ import annotations

import errno
from collections.abc import Callable

from tierfs.backing import BackingError
from tierfs.pusher import Pusher
from tierfs.schedule import Schedule
from tierfs.tree import CONTROL_INODES, KIND_DIR, KIND_FILE, KIND_LINK, Node, Tree
from tierfs.users import OWNER_UID

__all__ = ["Namespace"]

_CTL_DIR = CONTROL_INODES[b".tierfs"]


class Namespace:
    """See the module docstring.  Inodes are tree node + 1 (the root is 1); ``.tierfs`` and its files have
    fixed inodes above the tree's (``CONTROL_INODES``)."""

    def __init__(self, tree: Tree, schedule: Schedule, pusher: Pusher, *,
                 root_relisted: Callable[[int], None]) -> None:
        self.tree = tree
        self.schedule = schedule
        self.pusher = pusher
        self._root_relisted = root_relisted

    def file_inode(self, fidx: int) -> int:
        return self.tree.inode_of(fidx)

    def node(self, inode: int) -> Node | None:
        return self.tree.node_of_inode(inode)

    def lookup(self, parent_inode: int, name: bytes) -> int | None:
        """Inode of ``name`` in directory ``parent_inode``, in view or not; None if there is none."""
        if parent_inode == 1 and name == b".tierfs":
            return _CTL_DIR
        if parent_inode == _CTL_DIR:
            return CONTROL_INODES.get(name) if name != b".tierfs" else None
        node = self.node(parent_inode)
        if node is None or node.children is None:
            return None
        i = node.children.get(name)
        if i is None:
            return None
        child = self.tree.nodes[i]
        if child.kind == KIND_FILE:
            self.pusher.looked_up(parent_inode - 1, child.fidx)
        return i + 1

    def list_dir(self, inode: int, uid: int = OWNER_UID) -> list[tuple[bytes, int]]:
        """A frozen listing (name, inode) for one ``opendir`` by user ``uid``; listing the root again after reads
        may end the pass (the engine's ``root_relisted(uid)`` decides)."""
        if inode == _CTL_DIR:
            return [(n, i) for n, i in CONTROL_INODES.items() if n != b".tierfs"]
        node = self.node(inode)
        if node is None or node.kind != KIND_DIR:
            raise BackingError(errno.ENOTDIR, "not a directory")
        if inode == 1 and self.schedule.reads_in_pass:
            self._root_relisted(uid)
        view = self.schedule.view
        assert view is not None
        return [(name, i + 1) for name, i in view.listing(inode - 1)]

    def listed(self, dir_inode: int) -> None:
        """The kernel got this directory's entries (readdirplus): push what lacked an inode."""
        view = self.schedule.view
        if view is not None:
            mask = view.mask
            self.pusher.listed(dir_inode - 1, lambda f: bool(mask[f]))

    def file_index(self, inode: int) -> int:
        """The file index of a dataset file's inode; ENOENT, EISDIR or ELOOP for anything else."""
        node = self.node(inode)
        if node is None:
            raise BackingError(errno.ENOENT, "no such inode")
        if node.kind != KIND_FILE:
            raise BackingError(errno.EISDIR if node.kind == KIND_DIR else errno.ELOOP, "not a regular file")
        return node.fidx

    def readlink(self, inode: int) -> bytes:
        node = self.node(inode)
        if node is None or node.kind != KIND_LINK:
            raise BackingError(errno.EINVAL, "not a symlink")
        return node.link or b""

    def order_text(self) -> bytes:
        """``/.tierfs/order``: this pass's serving order."""
        view = self.schedule.view
        return view.order_text() if view is not None else b""

    def order0_text(self) -> bytes:
        """``/.tierfs/order0``: the same paths, NUL-terminated."""
        view = self.schedule.view
        return view.order0_text() if view is not None else b""

"""The names the mount shows: lookups, listings, links and the ``order`` files, over the tree and the view.

It owns no state of its own but, under ``substitute``, the :class:`~tierfs.daemon.serving.substitutions.Substitutions`
(which view file each name is served as this pass; the kernel entries they find stale are dropped in the background by
:meth:`Namespace.run`, through the pusher's :class:`~tierfs.daemon.kernel.pusher.KernelCache`): the tree (whose numbers
are fixed for the mount's life; entries the backing gains join as an epoch starts) says what exists, the schedule's
view what the root lists in this pass.  Every name of the tree can be looked up and opened, in view or not; only
the view is listed (every file with ``listing=all``).  Two
things here are news for other parts: a lookup or a listing tells the pusher the kernel now has an inode (pushes
wait for one), and a listing of the root (or an ``order`` file) starts a consumer's pass -- listing it again
after reads may end the pass -- which is the pass rule's to decide, by who listed (:class:`NamespaceEvents`).

**Modes and owners the kernel checked.**  On an ``allow_other`` mount the kernel checks other users against the
attributes the mount reported, kept for the attribute timeout.  When a node's mode, owner or group changes in
the backing dir (the tree counts it: "Access changes" in tree.py), the kernel is told at once -- its cached
attributes of the node invalidated, from the pusher's kernel thread (:meth:`Namespace.run`) -- and until it has
been, an open of the node or of anything beneath it (:meth:`Namespace.ensure_kernel_checked`) tells it first and
answers ``ESTALE``: the kernel then looks the path up again and checks the new attributes itself, with everything
it knows of the requester (its groups, its capabilities); a reader who may still read gets in on that retry,
unaware.  The daemon judges no user itself.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import trio

from tierfs.daemon.access import OWNER_UID, Reader, listable_dirs, privileged
from tierfs.daemon.backing.calls import BackingError
from tierfs.daemon.kernel.pusher import Pusher
from tierfs.daemon.runtime.wakeup import Wakeup
from tierfs.daemon.schedule.consumers import ANONYMOUS, Consumers
from tierfs.daemon.schedule.schedule import Schedule
from tierfs.daemon.serving.substitutions import Substitutions, SubstitutionStatistics
from tierfs.daemon.tree.tree import CONTROL_INODES, KIND_DIR, KIND_FILE, KIND_LINK, Attributes, Node, Tree

__all__ = ["KernelListings", "Listing", "ListingStatistics", "Namespace", "NamespaceEvents"]

_CTL_DIR = CONTROL_INODES[b".tierfs"]


class NamespaceEvents(Protocol):
    """What listings and ``order`` files mean for the passes (the pass rule hears them:
    :class:`~tierfs.daemon.schedule.passes.PassRule`)."""

    async def begin_pass(self, uid: int, who: str, *, relisted: bool) -> None:
        """Consumer ``who`` (user ``uid``) starts reading a view: it listed the root (``relisted``) or opened
        ``order``; ahead of the others, it waits here."""

    def root_relisted(self, uid: int, who: str) -> None:
        """The root was listed: that ends the lister's pass if it opened a file in it."""


class Listing(Sequence[tuple[bytes, int]]):
    """One ``opendir``'s snapshot of a directory: (name, inode) per entry, in listing order.  Kept as an array of
    inodes and a way to name a range of entries (from the tree's arrays: a node's name never changes): a directory
    of a million files is listed without a Python object per entry, each ``readdir`` makes the names it sends."""

    def __init__(self, inodes: np.ndarray, *, tree: Tree | None = None, nodes: np.ndarray | None = None,
                 names: list[bytes] | None = None, key: int | None = None) -> None:
        self.inodes = inodes
        #: the same for every listing of this directory with the same entries at the same offsets (the view's
        #: serial), so the kernel may serve one from what it cached of another; None: never cached
        self.key = key
        self._tree, self.nodes = tree, nodes  # the entries' tree nodes, named when sent
        self._names = names  # (or their names, for a listing that is not the tree's: /.tierfs)

    def names(self, lo: int, hi: int) -> list[bytes]:
        """The names of entries ``lo`` to ``hi``."""
        if self._names is not None:
            return self._names[lo:hi]
        assert self._tree is not None and self.nodes is not None
        return self._tree.names_of(self.nodes[lo:hi])

    def __len__(self) -> int:
        return len(self.inodes)

    def __getitem__(self, i: int) -> tuple[bytes, int]:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.names(i, i + 1)[0], int(self.inodes[i])


@dataclass(frozen=True)
class ListingStatistics:
    """``status``'s ``listings``: whether the kernel may cache listings (pyfuse3 with ``cache_readdir``,
    scripts/pyfuse3), directories opened, how many of those kept the listing the kernel had cached, and the
    READDIR requests answered (what the kernel did not take from its cache)."""

    kernel_cache: bool = False
    opened: int = 0
    kept: int = 0
    readdirs: int = 0


class KernelListings:
    """Which directory listings the kernel may cache (``FOPEN_CACHE_DIR``) and keep (``FOPEN_KEEP_CACHE``).

    The kernel caches one listing per directory inode, filled by whichever open handle reads at the cache's end,
    and serves it to every later open that keeps it: so every handle that may fill or read it must list the same
    entries at the same offsets.  A listing's ``key`` says which (the view's serial; the root and ``/.tierfs`` have
    none: the root's listing is per consumer and pass).  Per directory this remembers the key the kernel's cache
    was filled from and how many handles of that key are open: an open of the same key keeps the cache; one of
    another key drops it (no ``keep_cache``: the kernel empties it) when no handle of the old key is open, and is
    left uncached otherwise (the two would fill one cache with two orders).  Every open still reaches the daemon
    (a listing of the root still starts and ends passes).  Two small arrays per directory, made at the first
    cacheable open."""

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        #: pyfuse3 can ask for the kernel's readdir cache (operations.py finds out at init; off in engine tests)
        self.available = False
        self._key = np.zeros(0, np.int64)  # per dir slot: the key the kernel's cache holds (0: none)
        self._open = np.zeros(0, np.int32)  # per dir slot: open handles that may fill or read that cache
        self._opened = self._kept = self._readdirs = 0

    def opened(self, inode: int, listing: Listing) -> tuple[bool, bool]:
        """(cache, keep) for an opendir of ``inode`` that got ``listing``; :meth:`released` when it closes."""
        self._opened += 1
        if not self.available or listing.key is None:
            return False, False
        if not self._key.size:
            self._key = np.zeros(self.tree.n_dir_slots, np.int64)
            self._open = np.zeros(self.tree.n_dir_slots, np.int32)
        s = self.tree.dir_slot(inode - 1)
        if self._key[s] == listing.key:
            self._open[s] += 1
            self._kept += 1
            return True, True
        if self._open[s]:
            return False, True  # (the other key's handles may still fill the cache: leave it and them alone)
        self._key[s], self._open[s] = listing.key, 1
        return True, False

    def released(self, inode: int, listing: Listing, cached: bool) -> None:
        """The handle of an :meth:`opened` that answered ``cached`` closed."""
        if cached:
            self._open[self.tree.dir_slot(inode - 1)] -= 1

    def answered(self) -> None:
        """A READDIR was answered (the kernel filled its cache, or listed without one)."""
        self._readdirs += 1

    def statistics(self) -> ListingStatistics:
        return ListingStatistics(kernel_cache=self.available, opened=self._opened, kept=self._kept,
                                 readdirs=self._readdirs)


class Namespace:
    """See the module docstring.  Inodes are tree node + 1 (the root is 1); ``.tierfs`` and its files have
    fixed inodes above the tree's (``CONTROL_INODES``).  In a view that shares hard links (``view=full``) the
    names of one backing inode are one inode: the first name's (see :meth:`Tree.first_name`).  Everything here
    answers from the tree's arrays: a lookup, an attribute or a listing makes no Python object per file."""

    def __init__(self, tree: Tree, schedule: Schedule, pusher: Pusher, consumers: Consumers, *,
                 events: NamespaceEvents, substitute: bool = False) -> None:
        self.tree = tree
        self.schedule = schedule
        self.pusher = pusher
        self.consumers = consumers  # who asks, and each one's order of the view
        self.events = events
        #: ``substitute``: file names resolve per pass to view files (substitutions.py); the kernel must not keep
        #: a file's entry (operations.py gives it an entry timeout of 0)
        self.substitutions = Substitutions(schedule) if substitute else None
        self._stale = Wakeup()  # (the substitutions found stale kernel entries: run() drops them)
        self._access = Wakeup()  # (the tree found a mode or owner changed: run() tells the kernel)
        self._absences: list[tuple[int, bytes]] = []  # (entries a rescan took: run() drops negative ones)
        self._grown = Wakeup()
        tree.watch_access(self)
        self.listings = KernelListings(tree)  # which listings the kernel may cache

    def attach_kernel(self, caches_listings: bool) -> None:
        """The mount is up: the kernel may keep listings if pyfuse3 can ask it to (``cache_readdir``)."""
        self.listings.available = caches_listings

    def substitution_statistics(self) -> SubstitutionStatistics:
        subs = self.substitutions
        return subs.statistics() if subs is not None else SubstitutionStatistics()

    def _shares_links(self) -> bool:
        view = self.schedule.view
        return view is not None and view.hard_links

    def _file(self, i: int) -> int:
        """The file index node ``i`` (a file) is served as."""
        fidx = i - 1
        return self.tree.first_name(fidx) if self._shares_links() else fidx

    def _inode(self, i: int, kind: int) -> int:
        return self.tree.inode_of(self._file(i)) if kind == KIND_FILE else i + 1

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
        tree = self.tree
        if not 0 < parent_inode <= tree.n_nodes or tree.kinds[parent_inode - 1] != KIND_DIR:
            return None
        i = tree.child(parent_inode - 1, name)
        if i is None:
            return None
        kind = int(tree.kinds[i])
        if kind != KIND_FILE:
            return i + 1
        fidx = self._file(i)
        if self.tree.gone[fidx]:
            return None  # (found gone from the backing: ENOENT, as it is listed nowhere)
        if self.substitutions is not None:
            fidx = self.substitutions.resolve(parent_inode - 1, i, fidx)
            if self.substitutions.stale:
                self._stale.notify()
        self.pusher.looked_up(int(tree.groups[fidx]), fidx)
        return tree.inode_of(fidx)

    async def run(self) -> None:
        """Until cancelled: tell the kernel of changed modes and owners (see the module docstring) and, under
        ``substitute``, have it drop the entries the substitutions found stale (substitutions.py); from the pusher's
        kernel thread (a drop waits for the lookups of its directory in flight, which only the trio thread
        answers)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._tell_access_changes)
            nursery.start_soon(self._drop_absences)
            if self.substitutions is not None:
                nursery.start_soon(self._drop_stale_entries)

    def absence_lasts(self, parent_inode: int, name: bytes) -> bool:
        """Whether the kernel may keep the answer that ``name`` is not in directory ``parent_inode`` (a negative
        entry): not for a name a rescan took that has not joined yet, nor for a file found gone (it may come
        back: ``Tree.may_come``)."""
        tree = self.tree
        return not (0 < parent_inode <= tree.n_nodes and tree.may_come(parent_inode - 1, name))

    def grew(self, entries: tuple[tuple[int, bytes], ...]) -> None:
        """A rescan took these (directory node, name) entries (``Growth.entries``): the kernel is to drop any
        negative entry it keeps for them (answered before), well before they join."""
        self._absences += entries
        self._grown.notify()

    async def _drop_absences(self) -> None:
        while True:
            await self._grown.wait()
            entries, self._absences = self._absences, []
            await self.pusher.kernel.drop_entries([(i + 1, name) for i, name in entries])

    def access_changed(self) -> None:
        """(AccessWatcher) A node's mode, owner or group changed: the kernel is to be told."""
        self._access.notify()

    async def _tell_access_changes(self) -> None:
        while True:
            await self._access.wait()
            untold = dict(self.tree.access_untold)
            if untold:
                await self._tell_kernel(untold)

    async def _tell_kernel(self, nodes: dict[int, int]) -> None:
        """Invalidate the kernel's attributes of ``nodes`` (as of their serials), waiting until it did: its next
        permission check asks for the ones the tree has now.  Attributes only: a file's pages are its versions'
        (pusher.py)."""
        for i in nodes:
            await self.pusher.kernel.invalidate(i + 1, attr_only=True)
        self.tree.told(nodes)

    async def ensure_kernel_checked(self, inode: int) -> None:
        """Before an open of ``inode`` is served: if the kernel may have checked it against older modes or owners
        than the tree's (it or a directory above changed, and the kernel was not told yet), tell it and raise
        ``ESTALE``, so that it checks the new ones itself (see the module docstring).  Costs nothing while no
        mode or owner changed."""
        if not self.tree.access_untold or not 0 < inode <= self.tree.n_nodes:
            return
        untold = self.tree.untold_among(inode - 1)
        if untold:
            await self._tell_kernel(untold)
            raise BackingError(errno.ESTALE, "a mode or owner changed in the backing dir: the kernel checks again")

    async def _drop_stale_entries(self) -> None:
        subs = self.substitutions
        assert subs is not None
        while True:
            await self._stale.wait()
            stale = np.array(subs.take_stale(), np.int64).reshape(-1, 2)  # (dir node, name node) rows
            entries = list(zip((stale[:, 0] + 1).tolist(), self.tree.names_of(stale[:, 1]), strict=True))
            subs.dropped(await self.pusher.kernel.drop_entries(entries))

    def attributes(self, inode: int) -> Attributes | None:
        """(mode, nlink, uid, gid, rdev, size, blocks, mtime_ns, ctime_ns) of a tree inode; None for none.  A
        file shows one link unless hard links are shared (each name is its own inode otherwise)."""
        i = inode - 1
        if not 0 <= i < self.tree.n_nodes:
            return None
        a = self.tree.attributes(i)
        if self.tree.kinds.item(i) == KIND_FILE and not self._shares_links():
            return (a[0], 1, *a[2:])
        return a

    async def open_dir(self, inode: int, uid: int, pid: int) -> Listing:
        """The listing for one ``opendir`` by process ``pid`` of user ``uid``: a listing of the root starts a
        pass of its consumer, which may first wait for the other consumers (the pass rule's ``begin_pass``).
        ``ESTALE`` where the kernel let it in on an older mode or owner (:meth:`ensure_kernel_checked`)."""
        await self.ensure_kernel_checked(inode)
        who = await self.consumers.name_of(pid, uid)
        if inode == 1:
            await self.events.begin_pass(uid, who, relisted=True)
        return self.list_dir(inode, uid, who)

    def list_dir(self, inode: int, uid: int = OWNER_UID, who: str = ANONYMOUS) -> Listing:
        """A frozen listing (name, inode) for one ``opendir`` by user ``uid``, consumer ``who``, in that
        consumer's order; listing the root again after reads may end its pass (the pass rule's
        ``root_relisted(uid, who)`` decides)."""
        if inode == _CTL_DIR:
            ctl = [(n, i) for n, i in CONTROL_INODES.items() if n != b".tierfs"]
            return Listing(np.array([i for _, i in ctl], np.int64), names=[n for n, _ in ctl])
        if not 0 < inode <= self.tree.n_nodes or self.tree.kinds[inode - 1] != KIND_DIR:
            raise BackingError(errno.ENOTDIR, "not a directory")
        if inode == 1:
            self.events.root_relisted(uid, who)
        view = self.consumers.view_of(who)
        assert view is not None
        tree = self.tree
        nodes = view.listing(inode - 1)
        inodes = nodes + 1
        if self._shares_links():  # (a file's other names show its first name's inode)
            files = tree.kinds[nodes] == KIND_FILE
            inodes[files] = tree.first_name_of(nodes[files] - 1) + 2
        # The kernel may cache a directory of the whole tree (view=full: its entries are the backing's, only
        # their order is the view's) but never the root, whose listings start and end passes per consumer.
        key = view.serial if view.hard_links and inode != 1 else None
        return Listing(inodes, tree=tree, nodes=nodes, key=key)

    def attributes_of(self, inodes: np.ndarray) -> tuple[np.ndarray, ...]:
        """:meth:`attributes` of tree inodes, made at once for a listing's entries: (mode, nlink, uid, gid, rdev)
        per inode (int64 [inode, 5]), then size, blocks, mtime_ns and ctime_ns (int64 each)."""
        nodes = inodes - 1
        meta, *columns = self.tree.attributes_of(nodes)
        if not self._shares_links():
            meta[self.tree.kinds[nodes] == KIND_FILE, 1] = 1
        return (meta, *columns)

    def dir_released(self, inode: int, listing: Listing, cached: bool) -> None:
        """The handle of an ``opendir`` of ``inode`` that got ``listing`` (the kernel may cache it: ``cached``)
        closed.  Under ``substitute`` the entries that listing gave the kernel -- each name at its own file --
        are stale where the name resolves to another file (substitutions.py, ``listed``)."""
        self.listings.released(inode, listing, cached)
        subs = self.substitutions
        if subs is not None and listing.nodes is not None:
            subs.listed(inode - 1, listing.nodes[self.tree.kinds[listing.nodes] == KIND_FILE])
            if subs.stale:
                self._stale.notify()

    def listed(self, dir_inode: int) -> None:
        """The kernel got this directory's entries (readdirplus): push what lacked an inode."""
        self.listings.answered()
        view = self.schedule.view
        if view is not None:
            mask = view.mask
            self.pusher.listed(dir_inode - 1, lambda f: bool(mask[f]))

    def file_index(self, inode: int) -> int:
        """The file index of a dataset file's inode; ENOENT, EISDIR, ELOOP or ENXIO (a FIFO, socket or device:
        never opened through the mount) for anything else."""
        i = inode - 1
        if not 0 <= i < self.tree.n_nodes:
            raise BackingError(errno.ENOENT, "no such inode")
        kind = int(self.tree.kinds[i])
        if kind != KIND_FILE:
            raise BackingError({KIND_DIR: errno.EISDIR, KIND_LINK: errno.ELOOP}.get(kind, errno.ENXIO),
                               "not a regular file")
        return i - 1

    def readlink(self, inode: int) -> bytes:
        i = inode - 1
        if not 0 <= i < self.tree.n_nodes or self.tree.kinds[i] != KIND_LINK:
            raise BackingError(errno.EINVAL, "not a symlink")
        return self.tree.link(i)

    async def order_file(self, uid: int, pid: int, *, nul: bool) -> bytes:
        """``order`` (``order0`` if ``nul``) opened by process ``pid`` of user ``uid``: its consumer starts a
        pass (it may wait for the others first, like a listing of the root) and gets its own order."""
        who = await self.consumers.name_of(pid, uid)
        await self.events.begin_pass(uid, who, relisted=False)
        # a steering group's member reads it too: it names no file in a directory the member may not list
        listable = None if privileged(uid) else self.listable_by(Reader.of(uid, pid))
        return self.order0_text(who, listable) if nul else self.order_text(who, listable)

    def listable_by(self, reader: Reader) -> np.ndarray:
        """Per tree node, whether ``reader`` may list it, from the attributes the mount shows (the revalidator
        keeps directories' current)."""
        tree = self.tree
        return listable_dirs(reader, tree.parents, tree.meta, tree.meta_idx)

    def order_text(self, who: str = ANONYMOUS, listable: np.ndarray | None = None) -> bytes:
        """``/.tierfs/order``: this pass's serving order for consumer ``who`` (only the files of the directories
        marked in ``listable``, if given)."""
        view = self.consumers.view_of(who)
        return view.order_text(listable) if view is not None else b""

    def order0_text(self, who: str = ANONYMOUS, listable: np.ndarray | None = None) -> bytes:
        """``/.tierfs/order0``: the same paths, NUL-terminated."""
        view = self.consumers.view_of(who)
        return view.order0_text(listable) if view is not None else b""

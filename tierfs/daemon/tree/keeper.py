"""The backing tree's keeper: what a mount does before it serves, and the rescans while it does.

* :func:`check_dirs` refuses a backing dir, cache dir and mountpoint that cannot work together;
* :class:`TreeKeeper` owns the backing tree's provenance: loaded from the saved tree (``tree.bin`` in the cache
  dir, when a position was journalled; read and written through the dir's descriptor, see store.py) or scanned,
  given room to grow (``Tree.with_room``), rescanned in the background -- after a load, and as each epoch
  starts (``rescan=epoch``) -- whose news it hands to the engine (:class:`RescanEvents`): files changed, gone,
  back, and new ones taken into the room; it reports what ``status`` shows as ``tree``;
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import trio

from tierfs.common.mountinfo import fstype_of_dev
from tierfs.common.options import MountConfig, check_layout
from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.tree.tree import Additions, Growth, ScanCount, Tree

__all__ = ["OLD_TREE_NAMES", "TREE_NAME", "RescanEvents", "TreeKeeper", "TreeStatistics", "check_dirs"]

log = logging.getLogger("tierfs")

TREE_NAME = "tree.bin"  # the saved tree in the cache dir
OLD_TREE_NAMES = ("tree.npz",)  # what earlier releases saved it as: removed at mount
#: a mount's room for entries the backing gains (Tree.with_room): a tenth more files, at least ROOM_FILES, and a
#: tenth more directories, symlinks and special entries, at least ROOM_OTHERS (about 30 bytes a file of room)
ROOM_SHARE, ROOM_FILES, ROOM_OTHERS = 10, 1024, 64
RESCAN_POLL_S = 1.0  # how often rescan=epoch looks whether an epoch started
#: a file a rescan finds changed less than this long before it started is being written (a copy under way, a
#: writer's temporary file): it is taken by a later rescan
ADD_SETTLE_S = 2.0


def check_dirs(config: MountConfig) -> str:
    """The backing dir's real path; ``ValueError`` if it is missing or the three dirs nest the wrong way
    (:func:`~tierfs.common.options.check_layout`)."""
    backing = os.path.realpath(config.backing)
    if not os.path.isdir(backing):
        raise ValueError(f"backing dir {config.backing} does not exist or is not a directory")
    check_layout(backing, os.path.realpath(config.cache),
                 os.path.realpath(config.mountpoint) if config.mountpoint else "")
    return backing


@dataclass(frozen=True)
class TreeStatistics:
    source: str  # "saved" or "scan"
    seconds: float  # to load or scan it at mount
    rescan: str  # "pending", "running" or "done"
    added: int  # files the rescans found new in the backing dir, taken into this mount (they join an epoch)
    removed: int  # files the rescans found gone
    changed: int  # files the rescans found changed
    #: directories of the backing dir the last scan (the mount's, or the rescan after a load) could not list: the
    #: files under them are not in the data set (Tree.scan; ``unlistable=refuse`` refuses the mount instead) ...
    unlistable: int = 0
    unlistable_dirs: tuple[str, ...] = ()  # ... the first of them: "PATH (EACCES: Permission denied)"
    #: whether the backing keeps inode numbers, so that they are part of a copy's identity (``stable_inodes``)
    stable_inodes: bool = True
    gone: int = 0  # files of the mount's tree found gone from the backing since it mounted (Tree.gone)
    rescans: int = 0  # rescans done since the mount
    joining: int = 0  # files taken by a rescan that join when the epoch planned with them starts
    #: files the rescans found new that did not fit the mount's room (Tree.with_room): they show from the next mount
    left_out: int = 0

    def with_unlistable(self, tree: Tree) -> TreeStatistics:
        """These statistics with what scanning ``tree`` could not list (none for a loaded tree)."""
        return replace(self, unlistable=tree.unlistable, unlistable_dirs=tuple(
            f"{os.fsdecode(path) or '.'} ({errno.errorcode.get(err, err)}: {os.strerror(err)})"
            for path, err in tree.unlistable_dirs))


class RescanEvents(Protocol):
    """The news of a rescan after a load (the engine implements it)."""

    def all_confirmed(self) -> None:
        """The rescan read every fingerprint of the backing."""

    def changed(self, fidx: int, st: os.stat_result) -> None:
        """The backing file now has stat ``st``."""

    def gone(self, fidx: int) -> None:
        """The backing file is gone (or no longer a regular file)."""

    def running_epoch(self) -> int:
        """The epoch the mount's position is in."""

    def grew(self, growth: Growth) -> None:
        """The tree took files new in the backing, or back in it (``Tree.grow``): they join when an epoch planned
        with them starts."""


def inodes_kept(option: str, dev: int) -> bool:
    """Whether the backing of device ``dev`` keeps a file's inode number (``stable_inodes``): ``auto`` says no
    for a FUSE filesystem (sshfs without ``noforget``, rclone, gcsfuse and s3fs number inodes per mount: one
    forget, and the old code copied the data set again), yes for any other (NFS keeps its file ids)."""
    if option != "auto":
        return option == "yes"
    fstype = fstype_of_dev(dev) or ""
    kept = not (fstype == "fuse" or fstype.startswith("fuse."))
    if not kept:
        log.info("the backing dir is on a %s filesystem, which may number inodes per mount: copies are known by "
                 "size, mtime and ctime (stable_inodes=auto; stable_inodes=yes if its inode numbers are kept)", fstype)
    return kept


class TreeKeeper:
    """See the module docstring.  ``root_fd`` is the backing dir's, ``backing`` its real path, ``cache_fd`` the
    cache dir's."""

    def __init__(self, root_fd: int, backing: str, cache_fd: int, *, unlistable: str = "skip",
                 stable_inodes: str = "auto", rescan: str = "epoch") -> None:
        self.root_fd = root_fd
        self.unlistable = unlistable  # (the option: what a scan does with a directory it cannot list)
        self.rescan = rescan  # (the option: epoch = again as each epoch starts; never = only after a load)
        self.backing = backing
        self.cache_fd = cache_fd
        self.stable_inodes = inodes_kept(stable_inodes, os.fstat(root_fd).st_dev)
        self.stats = TreeStatistics("scan", 0.0, "done", 0, 0, 0, stable_inodes=self.stable_inodes)
        self._tree: Tree | None = None
        self._one = trio.Lock()  # (one rescan at a time)

    def load(self, *, resumed: bool, progress: Callable[[ScanCount], None] | None = None) -> Tree:
        """The saved tree if the mount resumes a journalled position and it is still valid, else a scan
        (``progress`` hears how far it is: the rescan after a load only logs).  A damaged saved tree is said once
        and removed (it only caches what the backing says: the scan makes it again), never a refused mount."""
        t0 = time.monotonic()
        for old in OLD_TREE_NAMES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old, dir_fd=self.cache_fd)
        saved = None
        if resumed:
            try:
                saved = Tree.load(TREE_NAME, os.fstat(self.root_fd), dir_fd=self.cache_fd, strict=True)
            except ValueError as exc:
                with contextlib.suppress(OSError):  # (through the dir's descriptor, as it was read)
                    os.unlink(TREE_NAME, dir_fd=self.cache_fd)
                log.warning("the cache dir's %s is damaged (%s): removed; the backing dir is scanned instead, as at "
                            "a first mount, and the tree saved again", TREE_NAME, exc)
        plain = saved or Tree.scan(self.root_fd, self.backing, progress, unlistable=self.unlistable)
        plain.stable_inodes = self.stable_inodes
        tree = plain if self.rescan == "never" else plain.with_room(
            max(ROOM_FILES, plain.n_files // ROOM_SHARE),
            max(ROOM_OTHERS, (plain.n_nodes - 1 - plain.n_files) // ROOM_SHARE), consume=True)
        del plain  # (the mount's tree saves itself without its room: Tree.save)
        self._tree = tree  # (the mount's: its files found gone are counted in statistics())
        self.stats = TreeStatistics("saved" if saved else "scan", round(time.monotonic() - t0, 3),
                                    "pending" if saved else "done", 0, 0, 0,
                                    stable_inodes=self.stable_inodes).with_unlistable(tree)
        return tree

    @property
    def scanned(self) -> bool:
        """The tree was scanned at this mount: every fingerprint in it was just read from the backing."""
        return self.stats.source == "scan"

    async def run(self, tree: Tree, *, limiter: trio.CapacityLimiter, events: RescanEvents) -> None:
        """After a load: rescan at once; after a scan: save it."""
        async with self._one:
            if self.stats.rescan == "pending":
                await self._rescan(tree, limiter, events)
            else:
                # (the save's own descriptor: one abandoned at unmount never writes through a number reused since)
                await in_thread(_save, tree, os.dup(self.cache_fd), limiter=limiter, abandon_on_cancel=True)
        # the mount's tree needs its path hashes no more: the cache found its copies by them, the rescan compared
        tree.release_path_index()

    async def follow(self, tree: Tree, *, limiter: trio.CapacityLimiter, events: RescanEvents) -> None:
        """With ``rescan=epoch``: rescan as each epoch starts (``events.running_epoch()``), for the life of the
        mount; one rescan at a time (:meth:`run`'s too)."""
        if self.rescan != "epoch":
            return
        last = events.running_epoch()
        while True:
            await trio.sleep(RESCAN_POLL_S)
            if events.running_epoch() != last:
                last = events.running_epoch()
                async with self._one:
                    await self._rescan(tree, limiter, events)

    async def _rescan(self, tree: Tree, limiter: trio.CapacityLimiter, events: RescanEvents) -> None:
        """Scan the backing and hand its news to ``events``: files changed, gone, back and new (taken into the
        tree's room: ``Tree.grow``); save the scan if it found any (a remount loads it)."""
        first = self.stats.rescan == "pending"
        self.stats = replace(self.stats, rescan="running")
        settled_ns = time.time_ns() - int(ADD_SETTLE_S * 1e9)
        # (abandoned on unmount: it works on its own dup of the root descriptor)
        try:
            new = await in_thread(_scan_live, self.root_fd, self.backing, not first, abandon_on_cancel=True)
        except ValueError as exc:  # (no file seen, a directory unlistable: the tier failed, not the data set)
            log.warning("rescan: %s; the mount keeps the files it knows", exc)
            self.stats = replace(self.stats, rescan="done")
            return
        if new is None:  # (the root itself was removed: a lost backing, nothing is taken for gone)
            self.stats = replace(self.stats, rescan="done")
            return
        if not new.n_files and tree.n_files:
            # (a network tier that lists a directory empty for a moment -- seen of sshfs under load, on four
            # nodes at once -- must not take the data set away; a file really gone is found at its next open)
            log.warning("rescan: the backing dir lists no file where %d were: taken for a fault of the tier; the "
                        "mount keeps the files it knows", tree.n_files)
            self.stats = replace(self.stats, rescan="done")
            return
        new.stable_inodes = self.stable_inodes  # (compared as this mount's tree is)
        # (a worker thread: ~0.25 s at a million files, which every request would wait out on the trio thread; a
        # fingerprint the trio thread changes meanwhile is at worst a copy made again)
        news = await in_thread(tree.compare, new, abandon_on_cancel=True)
        # (directories' modes and owners too: a chmod 700 made while unmounted closes them from this mount on)
        for i, st in await in_thread(tree.dir_access_news, new, abandon_on_cancel=True):
            tree.update_access(i, st)
        added = Additions() if self.rescan == "never" else await in_thread(
            functools.partial(tree.additions, new, news.added, settled_ns=settled_ns), abandon_on_cancel=True)
        events.all_confirmed()
        for fidx, st in news.changed:
            events.changed(fidx, st)
        for fidx in news.gone:
            events.gone(fidx)
        growth = tree.grow(added, news.returned) if len(added) or news.returned else None
        if growth is not None:
            events.grew(growth)
        left = growth.left_out if growth is not None else len(news.added) if self.rescan == "never" else 0
        was = self.stats
        self.stats = replace(was, rescan="done", rescans=was.rescans + 1, changed=was.changed + len(news.changed),
                             removed=was.removed + len(news.gone), added=was.added + (growth.files if growth else 0),
                             left_out=was.left_out + left).with_unlistable(new)
        if growth is not None and (growth.files or growth.others):
            log.info("the backing dir gained %d files and %d other entries: they join the mini-epochs as the next "
                     "epoch planned with them starts", growth.files, growth.others)
        if left:
            log.warning("the backing dir gained %d files this mount has no room for (room is kept for a tenth "
                        "more): they show from the next mount", left)
        if first and news.gone:
            log.warning("the backing tree changed since the last mount: %d files removed", len(news.gone))
        if first or news.changed or news.gone or len(news.added) or news.returned:
            news = None  # type: ignore[assignment]  # (the save below needs the memory more)
            await in_thread(_save, new, os.dup(self.cache_fd), limiter=limiter, abandon_on_cancel=True)
        new.release_path_index()

    def statistics(self) -> TreeStatistics:
        tree = self._tree
        if tree is None or not (tree.gone_files or tree.joining):
            return self.stats
        return replace(self.stats, gone=tree.gone_files, joining=tree.joining)


def _scan_live(root_fd: int, backing: str, quiet: bool) -> Tree | None:
    """A scan of the backing root, or None if the root was removed meanwhile (its link count is 0)."""
    tree = Tree.scan(root_fd, backing, quiet=quiet)
    return tree if os.fstat(root_fd).st_nlink else None


def _save(tree: Tree, cache_fd: int) -> None:
    try:
        tree.save(TREE_NAME, dir_fd=cache_fd)
    finally:
        os.close(cache_fd)

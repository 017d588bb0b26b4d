"""What a mount does before it serves, and the background jobs' harness.

* :func:`check_dirs` refuses a backing dir, cache dir and mountpoint that cannot work together;
* :class:`TreeKeeper` owns the backing tree's provenance: loaded from the saved tree (``tree.bin`` in the cache
  dir, when a position was journalled; read and written through the dir's descriptor, see cache.py) or scanned,
  and -- after a load -- rescanned in the background, whose news it hands to the engine
  (:class:`RescanEvents`); it reports what ``status`` shows as ``tree``;
* :func:`supervised` and :func:`once` run the mount's background jobs so that a failure is logged, never a
  dead mount.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

import trio

from tierfs.options import MountConfig, check_layout
from tierfs.threads import in_thread
from tierfs.tree import ScanCount, Tree

__all__ = ["OLD_TREE_NAMES", "TREE_NAME", "RescanEvents", "TreeKeeper", "TreeStatistics", "check_dirs", "once",
           "supervised"]

log = logging.getLogger("tierfs")

TREE_NAME = "tree.bin"  # the saved tree in the cache dir
OLD_TREE_NAMES = ("tree.npz",)  # what earlier releases saved it as: removed at mount


def check_dirs(config: MountConfig) -> str:
    """The backing dir's real path; ``ValueError`` if it is missing or the three dirs nest the wrong way
    (:func:`~tierfs.options.check_layout`)."""
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
    added: int  # files in the backing dir the rescan found that this mount does not show (the next one will)
    removed: int  # files the rescan found gone
    changed: int  # files the rescan found changed


class RescanEvents(Protocol):
    """The news of a rescan after a load (the engine implements it)."""

    def all_confirmed(self) -> None:
        """The rescan read every fingerprint of the backing."""

    def changed(self, fidx: int, st: os.stat_result) -> None:
        """The backing file now has stat ``st``."""

    def gone(self, fidx: int) -> None:
        """The backing file is gone (or no longer a regular file)."""


class TreeKeeper:
    """See the module docstring.  ``root_fd`` is the backing dir's, ``backing`` its real path, ``cache_fd`` the
    cache dir's."""

    def __init__(self, root_fd: int, backing: str, cache_fd: int) -> None:
        self.root_fd = root_fd
        self.backing = backing
        self.cache_fd = cache_fd
        self.stats = TreeStatistics("scan", 0.0, "done", 0, 0, 0)

    def load(self, *, resumed: bool, progress: Callable[[ScanCount], None] | None = None) -> Tree:
        """The saved tree if the mount resumes a journalled position and it is still valid, else a scan
        (``progress`` hears how far it is: the rescan after a load only logs)."""
        t0 = time.monotonic()
        for old in OLD_TREE_NAMES:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(old, dir_fd=self.cache_fd)
        saved = Tree.load(TREE_NAME, os.fstat(self.root_fd), dir_fd=self.cache_fd) if resumed else None
        tree = saved or Tree.scan(self.root_fd, self.backing, progress)
        self.stats = TreeStatistics("saved" if saved else "scan", round(time.monotonic() - t0, 3),
                                    "pending" if saved else "done", 0, 0, 0)
        return tree

    @property
    def scanned(self) -> bool:
        """The tree was scanned at this mount: every fingerprint in it was just read from the backing."""
        return self.stats.source == "scan"

    async def run(self, tree: Tree, *, limiter: trio.CapacityLimiter, events: RescanEvents) -> None:
        """After a load: scan the backing and hand over its news to ``events`` -- files changed, files gone;
        files added show at the next mount (the tree's numbering is fixed for the life of a mount), from the saved
        tree written here.  After a scan: save it."""
        if self.stats.rescan == "pending":
            self.stats = replace(self.stats, rescan="running")
            # (abandoned on unmount: it works on its own dup of the root descriptor)
            new = await in_thread(Tree.scan, self.root_fd, self.backing, abandon_on_cancel=True)
            news, lost, added = tree.compare(new)
            # (directories' modes and owners too: a chmod 700 made while unmounted closes them from this mount on)
            for i, st in await in_thread(tree.dir_access_news, new, abandon_on_cancel=True):
                tree.update_access(i, st)
            events.all_confirmed()
            for fidx, st in news:
                events.changed(fidx, st)
            for fidx in lost:
                events.gone(fidx)
            self.stats = replace(self.stats, rescan="done", changed=len(news), removed=len(lost), added=added)
            if added or lost:
                log.warning("the backing tree changed since the last mount: %d files added, %d removed "
                            "(added files show from the next mount)", added, len(lost))
            tree.release_path_index()  # (see below)
            tree = new
        # (the save's own descriptor: one abandoned at unmount never writes through a number reused since)
        await in_thread(_save, tree, os.dup(self.cache_fd), limiter=limiter, abandon_on_cancel=True)
        # the mount's tree needs its path hashes no more: the cache found its copies by them, the rescan compared
        tree.release_path_index()

    def statistics(self) -> TreeStatistics:
        return self.stats


def _save(tree: Tree, cache_fd: int) -> None:
    try:
        tree.save(TREE_NAME, dir_fd=cache_fd)
    finally:
        os.close(cache_fd)


async def supervised(name: str, task: Callable[[], Awaitable[None]]) -> None:
    """Run a background task for the life of the mount; a bug in it is logged and the task started again
    (after a second), never a dead mount: readers are served whether or not staging or pushing works."""
    while True:
        try:
            await task()
        except Exception:
            log.exception("the %s failed; restarting it", name)
        await trio.sleep(1.0)


async def once(name: str, task: Callable[[], Awaitable[None]]) -> None:
    """A background job that runs once: a failure is logged, never a dead mount."""
    try:
        await task()
    except OSError as exc:  # a full or failing disk: said once, the mount goes on
        log.warning("the %s failed: %s", name, exc.strerror or exc)
    except ValueError:
        log.exception("the %s failed", name)

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
import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

import trio

from tierfs.mounts import fstype_of_dev
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
    #: directories of the backing dir the last scan (the mount's, or the rescan after a load) could not list: the
    #: files under them are not in the data set (Tree.scan; ``unlistable=refuse`` refuses the mount instead) ...
    unlistable: int = 0
    unlistable_dirs: tuple[str, ...] = ()  # ... the first of them: "PATH (EACCES: Permission denied)"
    #: whether the backing keeps inode numbers, so that they are part of a copy's identity (``stable_inodes``)
    stable_inodes: bool = True
    gone: int = 0  # files of the mount's tree found gone from the backing since it mounted (Tree.gone)

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
                 stable_inodes: str = "auto") -> None:
        self.root_fd = root_fd
        self.unlistable = unlistable  # (the option: what a scan does with a directory it cannot list)
        self.backing = backing
        self.cache_fd = cache_fd
        self.stable_inodes = inodes_kept(stable_inodes, os.fstat(root_fd).st_dev)
        self.stats = TreeStatistics("scan", 0.0, "done", 0, 0, 0, stable_inodes=self.stable_inodes)
        self._tree: Tree | None = None

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
        tree = saved or Tree.scan(self.root_fd, self.backing, progress, unlistable=self.unlistable)
        tree.stable_inodes = self.stable_inodes
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
        """After a load: scan the backing and hand over its news to ``events`` -- files changed, files gone;
        files added show at the next mount (the tree's numbering is fixed for the life of a mount), from the saved
        tree written here.  After a scan: save it."""
        if self.stats.rescan == "pending":
            self.stats = replace(self.stats, rescan="running")
            # (abandoned on unmount: it works on its own dup of the root descriptor)
            new = await in_thread(Tree.scan, self.root_fd, self.backing, abandon_on_cancel=True)
            new.stable_inodes = self.stable_inodes  # (compared as this mount's tree is)
            news, lost, added = tree.compare(new)
            # (directories' modes and owners too: a chmod 700 made while unmounted closes them from this mount on)
            for i, st in await in_thread(tree.dir_access_news, new, abandon_on_cancel=True):
                tree.update_access(i, st)
            events.all_confirmed()
            for fidx, st in news:
                events.changed(fidx, st)
            for fidx in lost:
                events.gone(fidx)
            self.stats = replace(self.stats, rescan="done", changed=len(news), removed=len(lost),
                                 added=added).with_unlistable(new)
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
        tree = self._tree
        return replace(self.stats, gone=tree.gone_files) if tree is not None and tree.gone_files else self.stats


def _save(tree: Tree, cache_fd: int) -> None:
    try:
        tree.save(TREE_NAME, dir_fd=cache_fd)
    finally:
        os.close(cache_fd)


async def supervised(name: str, task: Callable[[], Awaitable[None]], failures: dict[str, str] | None = None) -> None:
    """Run a background task for the life of the mount; a bug in it is logged and the task started again
    (after a second), never a dead mount: readers are served whether or not staging or pushing works.

    A task that keeps failing is said once, not every second: its first failure with the traceback, then a line
    a minute with the count.  While it fails, ``failures[name]`` says so (the engine shows it as
    ``status.last_error``); once a run of it has lasted a minute, that goes, and the log says it runs again."""
    quiet_s = 60.0  # a failing task is logged again at most this often; a run this long ends its failures
    failed = 0  # failures in a row
    said = -quiet_s  # (monotonic) when the last of them was logged

    async def forgive() -> None:
        nonlocal failed
        await trio.sleep(quiet_s)
        log.info("the %s runs again (after %d failures)", name, failed)
        failed = 0
        if failures is not None:
            failures.pop(name, None)

    while True:
        error: Exception | None = None
        async with trio.open_nursery() as nursery:
            if failed:
                nursery.start_soon(forgive)
            try:
                await task()
            except Exception as exc:
                error = exc
            nursery.cancel_scope.cancel()
        if error is None:  # (it returned: it works)
            failed = 0
            if failures is not None:
                failures.pop(name, None)
        else:
            cause: BaseException = error
            # (the one exception inside the task's own nurseries' groups: what went wrong, not "1 sub-exception";
            # Python 3.10 has no BaseExceptionGroup to test for)
            while len(inner := getattr(cause, "exceptions", ())) == 1 and isinstance(inner[0], BaseException):
                cause = inner[0]
            failed += 1
            why = f"{type(cause).__name__}: {cause}"
            if failures is not None:
                failures[name] = (f"the {name} failed{f' {failed} times in a row' if failed > 1 else ''} "
                                  f"(restarted every second): {why}")
            if failed == 1:
                log.error("the %s failed; restarting it", name, exc_info=error)
                said = time.monotonic()
            elif time.monotonic() - said >= quiet_s:
                log.error("the %s keeps failing (%d times in a row, restarted every second): %s", name, failed,
                          why)
                said = time.monotonic()
        await trio.sleep(1.0)


async def once(name: str, task: Callable[[], Awaitable[None]]) -> None:
    """A background job that runs once: a failure is logged, never a dead mount."""
    try:
        await task()
    except OSError as exc:  # a full or failing disk: said once, the mount goes on
        log.warning("the %s failed: %s", name, exc.strerror or exc)
    except ValueError:
        log.exception("the %s failed", name)

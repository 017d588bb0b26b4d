"""The FUSE operations: translate each request into one call on the engine or the part that answers it.

The names come from the :class:`~tierfs.daemon.serving.namespace.Namespace` (``engine.names``), file data from the
:class:`~tierfs.daemon.serving.datapath.DataPath` (``engine.data``), batch plans from ``engine.batch``, everything else
from the
:class:`~tierfs.daemon.coordinator.engine.Engine`.  No decision is made here.  One error rule: an ``OSError`` from any
of them (``BackingError`` included) becomes ``FUSEError(errno)``; every mutating request is ``EROFS``.

Caveats worth knowing:

* Names that do not exist get negative entries with the same timeout, except those that may join later (see
  :meth:`lookup`).
* With a pyfuse3 that passes ``cache_readdir`` (``CACHES_LISTINGS``: the build of scripts/pyfuse3), ``opendir``
  also tells the kernel whether it may cache the listing and keep what it cached; the namespace's
  :class:`~tierfs.daemon.serving.namespace.KernelListings` decides (``view=full`` directories but the root, per view).
* Dataset files get long entry and attribute timeouts and ``keep_cache`` (the kernel page cache stays valid
  across opens); when the engine finds a backing file changed on open it invalidates the inode, so the next
  read sees the new size and bytes.
* An ``allow_other`` mount's permission checks are the kernel's, on the attributes it was told: an open or
  ``opendir`` it let in on a mode or owner that has changed since (in the backing dir: a file replaced by a
  private one, a ``chmod 700`` of a directory) is answered ``ESTALE`` once the kernel has been told the new ones,
  and the kernel checks again (namespace.py, datapath.py).
* ``/.tierfs/status``, ``order``, ``metrics``, ``control`` and ``plan`` are rendered once per open into a buffer
  (``direct_io``, size 0 like /proc files), so one ``cat`` sees one consistent snapshot.  Opening ``plan``
  pins the copies it names until the pass ends (see :mod:`tierfs.daemon.serving.batch_plans`).  Those that name files
  (``status``, ``order``, ``order0``, ``plan``) are the mount's owner's and root's, and so are writes to ``control``
  (:mod:`tierfs.daemon.access`).
* The requester (``ctx.uid``, and the consumer of ``ctx.pid``: consumers.py) goes with every open and listing to
  the part that answers it: who may steer the schedule, whose pass an open counts in, and how many descriptors
  a user may hold, are decided there.
* ``getxattr(user.tierfs.cache_path)`` on a dataset file answers the path of its cached copy (see
  :mod:`tierfs.direct`); every other attribute does not exist, and the kernel asks again each time.
* Writes to ``control`` are applied per ``write()`` call, whole or not at all (the handle's
  :class:`~tierfs.daemon.coordinator.control_file.ControlWriter` decides): ``echo rf=8 > control`` is one write; a bad
  one fails that
  ``write()`` with ``EINVAL`` and changes nothing; one longer than ``CONTROL_WRITE_MAX`` (64 KiB), which the
  kernel would send in pieces, fails with ``EFBIG`` at its first piece and changes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio

from tierfs.common.mountinfo import mountinfo
from tierfs.common.protocol import CACHE_PATH_XATTR
from tierfs.daemon.access import privileged
from tierfs.daemon.coordinator.control_file import ControlWriter
from tierfs.daemon.coordinator.engine import Engine
from tierfs.daemon.kernel.pusher import KernelCache
from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.serving.datapath import AccessChanged, FileHandle
from tierfs.daemon.serving.namespace import Listing
from tierfs.daemon.tree.tree import CONTROL_INODES, KIND_FILE

__all__ = ["ATTR_TIMEOUT", "TierOperations"]

log = logging.getLogger("tierfs")
T = TypeVar("T")
P = ParamSpec("P")

#: Seconds the kernel may cache names and attributes.  Long: the tree only changes by backing-file changes,
#: which the engine notices on open and invalidates explicitly.
ATTR_TIMEOUT = 300.0

#: Entries whose names and attributes one readdir makes at once (the kernel asks for up to 128 KiB of entries, ~750
#: of a short name each; what does not fit is made for nothing).
READDIR_CHUNK = 256

#: The mount's kernel read-ahead in KiB.  FUSE's default of 128 KiB turns a sequential read into 128 KiB
#: requests, each a round trip through the daemon; a wider window lets the kernel send the largest requests
#: FUSE allows (1 MiB) and keep a few in flight.  Only root may set it; otherwise the default stays.
READ_AHEAD_KB = 4096

#: pyfuse3 passes an opendir's ``cache_readdir`` to the kernel (the build of scripts/pyfuse3; stock 3.5 does not):
#: the kernel may then keep a listing and serve the next ones itself (see
#: :class:`~tierfs.daemon.serving.namespace.KernelListings`)
CACHES_LISTINGS = hasattr(pyfuse3.FileInfo(), "cache_readdir")
#: pyfuse3 registers backing files and asks the kernel for passthrough (the build of scripts/pyfuse3, its third
#: patch): cached opens are answered with their copy's backing id (passthrough.py)
PASSTHROUGH = hasattr(pyfuse3, "backing_open")

_CTL_DIR = CONTROL_INODES[b".tierfs"]
_CTL_CONTROL = CONTROL_INODES[b"control"]
_CTL_PLAN = CONTROL_INODES[b"plan"]
_CTL_NAMES = {inode: name for name, inode in CONTROL_INODES.items()}
_VIRTUAL = {CONTROL_INODES[n] for n in (b"control", b"status", b"order", b"order0", b"metrics", b"plan")}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


@dataclass(eq=False)
class _Virtual:
    """An open virtual file: the bytes rendered at open, and what takes its writes (the control file's)."""

    data: bytes
    control: ControlWriter | None


async def _erofs(*_args: Any, **_kwargs: Any) -> Any:
    raise pyfuse3.FUSEError(errno.EROFS)


def _errors(handler: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T]]:
    """The one error rule: ``OSError`` becomes its errno, a bug becomes ``EIO`` (logged), never a dead mount.
    The wrapper keeps the handler's signature (``P``), so the type check still compares each handler with the
    ``pyfuse3.Operations`` method it overrides."""

    @functools.wraps(handler)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await handler(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("%s failed", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def _set_read_ahead(mountpoint: bytes) -> None:
    """Raise the read-ahead of the FUSE mount at ``mountpoint`` (root only; a worker thread)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for dev, where, fstype in mountinfo():
            if where == mountpoint and fstype.startswith("fuse"):
                with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as ra:
                    ra.write(f"{READ_AHEAD_KB}\n")
                log.debug("read-ahead of %s set to %d KiB", os.fsdecode(mountpoint), READ_AHEAD_KB)


class TierOperations(pyfuse3.Operations):
    """pyfuse3 operations over an opened :class:`Engine`."""

    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        #: every call into the kernel's caches, from a thread of its own (no-ops until init: no kernel yet)
        self.kernel = KernelCache()
        self._handles: dict[int, FileHandle | _Virtual] = {}
        self._dirs: dict[int, tuple[int, Listing, bool]] = {}  # (inode, listing, kernel may cache it)
        self._fh = itertools.count(1)
        self._uid = os.getuid()
        self._gid = os.getgid()

    def init(self) -> None:
        # Only now is there a kernel to notify (engine tests without a mount keep a KernelCache of no-ops).
        # Both calls can wait on the kernel's page locks: KernelCache makes them from a thread of its own.
        self.kernel = KernelCache(pyfuse3)
        self.engine.attach_kernel(self.kernel, caches_listings=CACHES_LISTINGS,
                                  backings=pyfuse3 if PASSTHROUGH else None)
        # The kernel sets the read-ahead from our INIT reply, which goes out after this returns: tune it then.
        with contextlib.suppress(RuntimeError):  # no trio run (a test calling init() directly)
            trio.lowlevel.spawn_system_task(self._widen_read_ahead)

    async def _widen_read_ahead(self) -> None:
        # abspath, never realpath: a stat of our own mountpoint from the thread that serves it would deadlock
        # (mount.py already resolved the path).  The /proc and /sys files are read in a worker thread.
        mountpoint = os.fsencode(os.path.abspath(self.engine.config.mountpoint or "/"))
        await in_thread(_set_read_ahead, mountpoint)

    # ================================================================================ attributes

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.entry_timeout = ATTR_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        if inode >= _CTL_DIR:
            steering = self.engine.steering  # (the files that name files: the owner's and its group's, access.py)
            a.st_mode = steering.mode(_CTL_NAMES[inode])
            a.st_nlink = 2 if inode == _CTL_DIR else 1
            a.st_uid, a.st_gid = self._uid, self._gid if steering.gid is None else steering.gid
            a.st_size = 0
            # (their attributes never change -- size 0, fixed modes, the root's times -- so the kernel may keep
            # them like any other: an open of ``status`` or a ``consumed`` report costs no GETATTR; what changes
            # is their content, rendered per open and read with direct_io)
            root = self.engine.names.attributes(1)
            if root is not None:
                a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = root[7]
            return a
        attrs = self.engine.names.attributes(inode)
        if attrs is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if self.engine.versions.versions_held:  # (a changed file's old version still read through the page cache)
            with contextlib.suppress(OSError):  # (not a dataset file)
                attrs = self.engine.versions.kernel_attributes(self.engine.names.file_index(inode), attrs)
        # the backing entry's own type, modes and device number: writes are refused with EROFS, as ro mounts do
        a.st_mode, a.st_nlink, a.st_uid, a.st_gid, a.st_rdev, a.st_size, a.st_blocks, mtime, a.st_ctime_ns = attrs
        a.st_blksize = 1 << 17
        a.st_atime_ns = a.st_mtime_ns = mtime  # (st_blocks: what du and tar see on the backing dir)
        return a

    @_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        inode = self.engine.names.lookup(parent_inode, name)
        if inode is None:
            # A negative entry the kernel keeps (st_ino 0): loaders probe for names that do not exist (``.tierfs``
            # in a sub-directory, ``__init__.py``, sidecar files).  Not for a name that may join later (a rescan
            # took it, or a file found gone): the kernel asks again.  A name the backing gains later has its
            # negative entry dropped when a rescan takes it (Namespace.grew), an epoch before it joins.
            a = pyfuse3.EntryAttributes()
            a.st_ino = 0
            a.entry_timeout = ATTR_TIMEOUT if self.engine.names.absence_lasts(parent_inode, name) else 0.0
            return a
        return self._entry(inode)

    def _entry(self, inode: int) -> pyfuse3.EntryAttributes:
        """A directory entry's attributes (see :meth:`_entry_timeout`)."""
        a = self._attr(inode)
        if inode < _CTL_DIR:
            a.entry_timeout = self._entry_timeout(a.st_mode)
        return a

    def _entry_timeout(self, mode: int) -> float:
        """How long the kernel may keep a tree entry: a file's not at all under ``substitute`` (each path resolution
        asks again: the name's file changes with the pass, see substitutions.py)."""
        return 0.0 if self.engine.names.substitutions is not None and stat.S_ISREG(mode) else ATTR_TIMEOUT

    @_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(inode)

    @_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return self.engine.names.readlink(inode)

    @_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        # The backing filesystem's own figures (a read-only dataset is not "100 % full"); the last good ones
        # while the backing does not answer, never a wait on it.
        s = pyfuse3.StatvfsData()
        v = await self.engine.backing.statvfs()
        s.f_namemax = 255
        if v is not None:
            s.f_bsize, s.f_frsize = v.f_bsize, v.f_frsize
            s.f_blocks, s.f_bfree, s.f_bavail = v.f_blocks, v.f_bfree, v.f_bavail
            s.f_files, s.f_ffree, s.f_favail = v.f_files, v.f_ffree, v.f_favail
            s.f_namemax = v.f_namemax
        return s

    # =============================================================================== directories

    # (the FileInfo answer is the cache-readdir patch's, scripts/pyfuse3: its stub still says a handle alone)
    @_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int | pyfuse3.FileInfo:  # type: ignore[override]
        names = self.engine.names
        listing = await names.open_dir(inode, ctx.uid, ctx.pid)
        fh = next(self._fh)
        cache, keep = names.listings.opened(inode, listing)
        self._dirs[fh] = (inode, listing, cache)
        if not names.listings.available:
            return fh  # (stock pyfuse3 takes a handle only)
        return pyfuse3.FileInfo(fh=fh, cache_readdir=cache, keep_cache=keep)

    @_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        dir_inode, listing, _ = self._dirs[fh]
        if start_id >= len(listing):
            return
        if dir_inode == _CTL_DIR or self.engine.versions.versions_held:
            for off, name, inode in zip(itertools.count(start_id + 1), listing.names(start_id, len(listing)),
                                        listing.inodes[start_id:].tolist()):
                if not pyfuse3.readdir_reply(token, name, self._entry(inode), off):
                    break
        else:
            self._reply_entries(listing, start_id, token)
        # readdirplus: the kernel now holds these inodes, so their pages can be pushed (after this reply)
        self.engine.names.listed(dir_inode)

    def _reply_entries(self, listing: Listing, start: int, token: pyfuse3.ReaddirToken) -> None:
        """:meth:`_entry` of each tree entry from ``start`` on, as many as the kernel's buffer takes (a ``find``
        of a million files asks for a million): the names and attributes of READDIR_CHUNK entries are made at
        once from the tree's arrays, and one ``EntryAttributes`` is filled again for each (``readdir_reply``
        copies it), so the loop runs no Python code per entry but the assignments -- and in a chunk of like
        entries (one mode, link count, owner, group, device: a directory of files) not even those."""
        names = self.engine.names
        a = pyfuse3.EntryAttributes()
        a.attr_timeout = ATTR_TIMEOUT
        a.st_blksize = 1 << 17
        for lo in range(start, len(listing), READDIR_CHUNK):
            hi = min(lo + READDIR_CHUNK, len(listing))
            inodes = listing.inodes[lo:hi]
            meta, size, blocks, mtime, ctime = names.attributes_of(inodes)
            entries = zip(itertools.count(lo + 1), listing.names(lo, hi), inodes.tolist(), size.tolist(),
                          blocks.tolist(), mtime.tolist(), ctime.tolist())
            if (meta == meta[0]).all():
                a.st_mode, a.st_nlink, a.st_uid, a.st_gid, a.st_rdev = meta[0].tolist()
                a.entry_timeout = self._entry_timeout(a.st_mode)
                for off, name, a.st_ino, a.st_size, a.st_blocks, m, a.st_ctime_ns in entries:
                    a.st_atime_ns = a.st_mtime_ns = m
                    if not pyfuse3.readdir_reply(token, name, a, off):
                        return
            else:
                rows = meta.tolist()
                for (off, name, a.st_ino, a.st_size, a.st_blocks, m, a.st_ctime_ns), (
                        a.st_mode, a.st_nlink, a.st_uid, a.st_gid, a.st_rdev) in zip(entries, rows, strict=True):
                    a.st_atime_ns = a.st_mtime_ns = m
                    a.entry_timeout = self._entry_timeout(a.st_mode)
                    if not pyfuse3.readdir_reply(token, name, a, off):
                        return

    @_errors
    async def releasedir(self, fh: int) -> None:
        opened = self._dirs.pop(fh, None)
        if opened is not None:
            self.engine.names.dir_released(*opened)

    # ===================================================================================== files

    @_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        eng = self.engine
        if inode in _VIRTUAL:
            writes = bool(flags & _WRITE_FLAGS)
            # The modes we report, checked here too: the kernel checks them only under default_permissions
            # (always with allow_other), and lets root write a 0444 file.
            if not eng.steering.may_open(_CTL_NAMES[inode], ctx.uid, write=writes):
                raise pyfuse3.FUSEError(errno.EACCES)
            if inode == _CTL_CONTROL:
                data = eng.control_text()
            elif inode == CONTROL_INODES[b"status"]:
                data = eng.status().to_json().encode()
            elif inode == CONTROL_INODES[b"metrics"]:
                data = eng.status().to_prometheus().encode()
            elif inode == _CTL_PLAN:
                data = await eng.batch.plan_text(ctx.uid)
            else:
                data = await eng.names.order_file(ctx.uid, ctx.pid, nul=inode == CONTROL_INODES[b"order0"])
            fh = next(self._fh)
            # (a control write is its writer's consumer's: whose pass next-pass ends, whose ARF feedback feeds)
            writer = eng.control_writer(await eng.consumers.name_of(ctx.pid, ctx.uid)) if writes else None
            self._handles[fh] = _Virtual(data, writer)
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False, nonseekable=False)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        if inode == _CTL_DIR:
            raise pyfuse3.FUSEError(errno.EISDIR)
        fidx = eng.names.file_index(inode)
        await eng.names.ensure_kernel_checked(inode)  # (ESTALE: the kernel let it in on an older mode or owner)
        try:
            handle = await eng.data.open_file(fidx, ctx.uid, await eng.consumers.name_of(ctx.pid, ctx.uid))
        except AccessChanged:
            await eng.names.ensure_kernel_checked(inode)  # (this open found it: the kernel is told before ESTALE)
            raise
        fh = next(self._fh)
        self._handles[fh] = handle
        if handle.backing_id:  # (the kernel reads the copy itself: keep_cache and direct_io do not apply)
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, backing_id=handle.backing_id)
        return pyfuse3.FileInfo(fh=fh, keep_cache=handle.keep_cache, direct_io=handle.direct_io)

    # (pyfuse3 replies with any contiguous buffer, PyObject_GetBuffer in handlers.pxi; its stub says bytes)
    @_errors
    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray:  # type: ignore[override]
        h = self._handles[fh]
        if isinstance(h, _Virtual):
            return h.data[off:off + size]
        return await self.engine.data.read(h, off, size)

    @_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handles.get(fh)
        if not isinstance(h, _Virtual) or h.control is None:
            raise pyfuse3.FUSEError(errno.EROFS)
        try:
            return h.control.write(off, buf)
        except ValueError:
            raise pyfuse3.FUSEError(errno.EINVAL) from None

    async def flush(self, fh: int) -> None:
        # Nothing to flush on a read-only mount.  ENOSYS (once) makes the kernel stop sending FLUSH at all: one
        # round trip less on every close().
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @_errors
    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if isinstance(h, FileHandle):
            await self.engine.data.release(h)

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        # Nothing may change, the control file included: ``echo x > control`` opens with O_TRUNC, which the
        # kernel passes to open (atomic O_TRUNC, libfuse's default) and never turns into a truncate.
        raise pyfuse3.FUSEError(errno.EROFS)

    # Every other mutating request: the mount is read-only and the backing dir is never written.
    mknod = mkdir = unlink = rmdir = symlink = rename = link = create = _erofs

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    @_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        # The one attribute: the path of a dataset file's cached copy, for a reader that opens it itself
        # (tierfs.direct).  Only for readers that may open the cache dir (0700): the daemon's user and root; for
        # anyone else, and for a file that must go through the mount, there is no such attribute.
        if name != CACHE_PATH_XATTR or inode >= _CTL_DIR or not privileged(ctx.uid):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        node = self.engine.names.node(inode)
        if node is None or node.kind != KIND_FILE:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        path = await self.engine.data.lend(node.fidx, ctx.uid, await self.engine.consumers.name_of(ctx.pid, ctx.uid))
        if path is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return path

    async def fsync(self, fh: int, datasync: bool) -> None:
        pass

    @_errors
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        # ``test -w`` must say no, like on any read-only mount; the control file is the one writable file.
        if mode & os.W_OK and inode != _CTL_CONTROL:
            raise pyfuse3.FUSEError(errno.EROFS)
        return True

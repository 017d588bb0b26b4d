"""The FUSE operations: translate each request into a call on the :class:`~tierfs.engine.Engine`.

No decision is made here.  One error rule: an ``OSError`` from the engine (``BackingError`` included) becomes
``FUSEError(errno)``; every mutating request is ``EROFS``.

Caveats worth knowing:

* Dataset files get long entry and attribute timeouts and ``keep_cache`` (the kernel page cache stays valid
  across opens); when the engine finds a backing file changed on open it invalidates the inode, so the next
  read sees the new size and bytes.
* ``/.tierfs/status``, ``order``, ``metrics`` and ``control`` are rendered once per open into a buffer
  (``direct_io``, size 0 like /proc files), so one ``cat`` sees one consistent snapshot.
* ``getxattr(user.tierfs.cache_path)`` on a dataset file answers the path of its cached copy (see
  :mod:`tierfs.direct`); every other attribute does not exist, and the kernel asks again each time.
* Writes to ``control`` are applied per ``write()`` call: ``echo rf=8 > control`` is one write; a bad one fails
  that ``write()`` with ``EINVAL`` and changes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import logging
import os
import re
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pyfuse3
import trio

from tierfs.direct import CACHE_PATH_XATTR
from tierfs.engine import Engine, FileHandle
from tierfs.tree import CONTROL_INODES, KIND_DIR, KIND_FILE

__all__ = ["ATTR_TIMEOUT", "TierOperations"]

log = logging.getLogger("tierfs")
T = TypeVar("T")

#: Seconds the kernel may cache names and attributes.  Long: the tree only changes by backing-file changes,
#: which the engine notices on open and invalidates explicitly.
ATTR_TIMEOUT = 300.0

#: The mount's kernel read-ahead in KiB.  FUSE's default of 128 KiB turns a sequential read into 128 KiB
#: requests, each a round trip through the daemon; a wider window lets the kernel send the largest requests
#: FUSE allows (1 MiB) and keep a few in flight.  Only root may set it; otherwise the default stays.
READ_AHEAD_KB = 4096

_CTL_DIR = CONTROL_INODES[b".tierfs"]
_CTL_CONTROL = CONTROL_INODES[b"control"]
_VIRTUAL = {CONTROL_INODES[n] for n in (b"control", b"status", b"order", b"metrics")}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


@dataclass(eq=False)
class _Virtual:
    """An open virtual file: the bytes rendered at open, and whether writes go to the control file."""

    data: bytes
    writable: bool


async def _erofs(*_args: Any, **_kwargs: Any) -> Any:
    raise pyfuse3.FUSEError(errno.EROFS)


def _errors(handler: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    """The one error rule: ``OSError`` becomes its errno, a bug becomes ``EIO`` (logged), never a dead mount."""

    @functools.wraps(handler)
    async def wrapper(*args: Any) -> T:
        try:
            return await handler(*args)
        except pyfuse3.FUSEError:
            raise
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("tierfs: %s failed", handler.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


class TierOperations(pyfuse3.Operations):
    """pyfuse3 operations over an opened :class:`Engine`."""

    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.engine = engine
        self._handles: dict[int, FileHandle | _Virtual] = {}
        self._dirs: dict[int, tuple[int, list[tuple[bytes, int]]]] = {}
        self._fh = itertools.count(1)
        self._uid = os.getuid()
        self._gid = os.getgid()

    def init(self) -> None:
        # Only now is there a kernel to notify; engine tests without a mount keep the no-op.
        def invalidate(inode: int) -> None:
            # OSError: the kernel never saw this inode, so it has nothing cached to drop
            with contextlib.suppress(OSError):
                pyfuse3.invalidate_inode(inode, attr_only=False)

        self.engine.invalidate_inode = invalidate
        self.engine.store_pages = pyfuse3.notify_store
        # The kernel sets the read-ahead from our INIT reply, which goes out after this returns: tune it then.
        with contextlib.suppress(RuntimeError):  # no trio run (a test calling init() directly)
            trio.lowlevel.spawn_system_task(self._widen_read_ahead)

    async def _widen_read_ahead(self) -> None:
        # abspath, never realpath: a stat of our own mountpoint from the thread that serves it would deadlock
        # (mount.py already resolved the path)
        mountpoint = os.fsencode(os.path.abspath(self.engine.config.mountpoint or "/"))
        with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/self/mountinfo", "rb") as f:
            for line in f:
                fields = line.split()
                # mountinfo writes blanks and backslashes in paths as octal escapes (\040)
                where = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m[1], 8)]), fields[4])
                if where == mountpoint and fields[fields.index(b"-") + 1].startswith(b"fuse"):
                    with open(f"/sys/class/bdi/{fields[2].decode()}/read_ahead_kb", "w") as ra:
                        ra.write(f"{READ_AHEAD_KB}\n")
                    log.debug("tierfs: read-ahead of %s set to %d KiB", os.fsdecode(mountpoint), READ_AHEAD_KB)

    # ================================================================================ attributes

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.entry_timeout = ATTR_TIMEOUT
        a.attr_timeout = ATTR_TIMEOUT
        if inode >= _CTL_DIR:
            a.st_mode = (stat.S_IFDIR | 0o555) if inode == _CTL_DIR else (
                stat.S_IFREG | (0o644 if inode == _CTL_CONTROL else 0o444))
            a.st_nlink = 2 if inode == _CTL_DIR else 1
            a.st_uid, a.st_gid = self._uid, self._gid
            a.st_size = 0
            # virtual files change all the time: never let the kernel keep their attributes
            a.attr_timeout = 0
            root = self.engine.tree.nodes[0].st if self.engine.tree.nodes else None
            if root is not None:
                a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = root.st_mtime_ns
            return a
        node = self.engine.node(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        st = node.st
        a.st_mode = st.st_mode & ~0o222  # read-only filesystem
        a.st_nlink = st.st_nlink if node.kind == KIND_DIR else 1
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_size = st.st_size
        a.st_blksize = 1 << 17
        a.st_blocks = (st.st_size + 511) // 512
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        return a

    @_errors
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        inode = self.engine.lookup(parent_inode, name)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode)

    @_errors
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(inode)

    @_errors
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return self.engine.readlink(inode)

    @_errors
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        s = pyfuse3.StatvfsData()
        v = os.fstatvfs(self.engine.root_fd)
        s.f_bsize, s.f_frsize = v.f_bsize, v.f_frsize
        s.f_blocks, s.f_bfree, s.f_bavail = v.f_blocks, 0, 0
        s.f_files, s.f_ffree, s.f_favail = v.f_files, 0, 0
        s.f_namemax = v.f_namemax
        return s

    # =============================================================================== directories

    @_errors
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        listing = self.engine.list_dir(inode)
        fh = next(self._fh)
        self._dirs[fh] = (inode, listing)
        return fh

    @_errors
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        dir_inode, listing = self._dirs[fh]
        for i in range(start_id, len(listing)):
            name, inode = listing[i]
            if not pyfuse3.readdir_reply(token, name, self._attr(inode), i + 1):
                break
        if start_id < len(listing):
            # readdirplus: the kernel now holds these inodes, so their pages can be pushed (after this reply)
            self.engine.listed(dir_inode)

    @_errors
    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    # ===================================================================================== files

    @_errors
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        eng = self.engine
        if inode in _VIRTUAL:
            writes = bool(flags & _WRITE_FLAGS)
            if writes and inode != _CTL_CONTROL:
                raise pyfuse3.FUSEError(errno.EACCES)
            if inode == _CTL_CONTROL:
                data = eng.control_text()
            elif inode == CONTROL_INODES[b"status"]:
                data = eng.status().to_json().encode()
            elif inode == CONTROL_INODES[b"metrics"]:
                data = eng.status().to_prometheus().encode()
            else:
                data = eng.order_text()
            fh = next(self._fh)
            self._handles[fh] = _Virtual(data, writes)
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False, nonseekable=False)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        if inode == _CTL_DIR:
            raise pyfuse3.FUSEError(errno.EISDIR)
        handle = await eng.open_file(eng.file_index(inode))
        fh = next(self._fh)
        self._handles[fh] = handle
        return pyfuse3.FileInfo(fh=fh, keep_cache=handle.keep_cache)

    @_errors
    async def read(self, fh: int, off: int, size: int) -> bytes | bytearray:
        h = self._handles[fh]
        if isinstance(h, _Virtual):
            return h.data[off:off + size]
        return await self.engine.read(h, off, size)

    @_errors
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handles.get(fh)
        if not isinstance(h, _Virtual) or not h.writable:
            raise pyfuse3.FUSEError(errno.EROFS)
        try:
            self.engine.control_write(buf)
        except ValueError:
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        return len(buf)

    async def flush(self, fh: int) -> None:
        # Nothing to flush on a read-only mount.  ENOSYS (once) makes the kernel stop sending FLUSH at all: one
        # round trip less on every close().
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @_errors
    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if isinstance(h, FileHandle):
            self.engine.release(h)

    @_errors
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        # Truncating the control file (``>`` without atomic O_TRUNC) is the one change allowed, and a no-op.
        only_size = fields.update_size and not (fields.update_mode or fields.update_uid or fields.update_gid
                                                or fields.update_atime or fields.update_mtime)
        if inode == _CTL_CONTROL and only_size and attr.st_size == 0:
            return self._attr(inode)
        raise pyfuse3.FUSEError(errno.EROFS)

    # Every other mutating request: the mount is read-only and the backing dir is never written.
    mknod = mkdir = unlink = rmdir = symlink = rename = link = create = _erofs  # type: ignore[assignment]

    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    @_errors
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        # The one attribute: the path of a dataset file's cached copy, for a reader that opens it itself
        # (tierfs.direct).  Only for readers that may open the cache dir (0700): the daemon's user and root; for
        # anyone else, and for a file that must go through the mount, there is no such attribute.
        if name != CACHE_PATH_XATTR or inode >= _CTL_DIR or ctx.uid not in (0, self._uid):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        node = self.engine.node(inode)
        if node is None or node.kind != KIND_FILE:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        path = self.engine.lend(node.fidx)
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

"""A read-only passthrough FUSE filesystem of a directory: a backing dir that tests and benchmarks can kill.

``python -m tierfs.testing.mirrorfs SOURCE MOUNTPOINT [--hang LIST]`` shows ``SOURCE`` at ``MOUNTPOINT`` until it is
stopped -- as sshfs or rclone show a remote tree.  Killed with SIGKILL, its mount answers ``ENOTCONN`` to every
call (a network FUSE daemon that crashed); started again at the same mountpoint (after ``fusermount3 -uz``) it
shows the same inode numbers, sizes and times, so a tree scanned through the first one still matches.
``--hang LIST``: opens of the files whose paths (relative to ``SOURCE``) are lines of the file ``LIST`` do not
answer while they are listed (a file whose server hangs; taking the line out lets them go on); a line ``.``
does the same to ``statfs`` (a server that stopped answering altogether), and a line ``read:PATH`` to the reads
of that file past its first byte (a server that hangs in the middle of a file).  ``--count FILE``: after every
read, FILE holds the bytes served so far (what crossed the "wire" of this backing: tests compare it with what
tierfs counts), and no page cache is kept from one open of a file to the next.  ``--renumber``: inode numbers are
handed out as files are looked up, from a random base, and a number the kernel forgets is never handed out again
(sshfs without ``-o noforget``, rclone, gcsfuse and s3fs number inodes per mount this way): a file keeps its bytes
and times but shows a new inode number after each forget and each start.

Not part of a mount: tierfs never imports it (see :func:`tierfs.testing.harness.passthrough`).
"""

from __future__ import annotations

import argparse
import errno
import os
import random
import stat
from collections.abc import Sequence

import pyfuse3
import trio

__all__ = ["Passthrough"]


class Passthrough(pyfuse3.Operations):
    """Inodes are the source's (the root is pyfuse3's ROOT_INODE); every error is the source's errno."""

    def __init__(self, source: str, hang: str | None, count: str | None = None, renumber: bool = False) -> None:
        super().__init__()
        self.source = source
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: source}
        self.hang = hang
        self.count = count
        self.served = 0
        self.fd_paths: dict[int, str] = {}
        self.renumber = renumber
        self._numbers: dict[int, int] = {}  # (renumber) the source's inode -> the number shown now
        self._next = random.randrange(1 << 20, 1 << 40)

    def _number(self, path: str) -> int:
        """The inode number shown for ``path``: the source's, or (renumber) one handed out until forgotten."""
        try:
            ino = os.lstat(path).st_ino
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        if self.renumber:
            if ino not in self._numbers:
                self._numbers[ino], self._next = self._next, self._next + 1
            ino = self._numbers[ino]
        self.paths[ino] = path
        return ino

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        if not self.renumber:
            return
        gone = {inode for inode, _ in inode_list} - {pyfuse3.ROOT_INODE}
        for src in [s for s, n in self._numbers.items() if n in gone]:
            del self._numbers[src]
        for inode in gone:
            self.paths.pop(inode, None)

    def _hangs(self, path: str, prefix: str = "") -> bool:
        if self.hang is None:
            return False
        try:
            with open(self.hang) as f:
                return prefix + os.path.relpath(path, self.source) in f.read().split("\n")
        except FileNotFoundError:
            return False

    def _path(self, inode: int) -> str:
        try:
            return self.paths[inode]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ESTALE) from None

    def _attr(self, path: str, inode: int) -> pyfuse3.EntryAttributes:
        try:
            st = os.lstat(path)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        a = pyfuse3.EntryAttributes()
        for f in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime_ns", "st_mtime_ns",
                  "st_ctime_ns"):
            setattr(a, f, getattr(st, f))
        a.st_ino = inode
        a.st_blksize, a.st_blocks = st.st_blksize, st.st_blocks
        a.entry_timeout = a.attr_timeout = 1.0
        return a

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        path = os.path.join(self._path(parent_inode), os.fsdecode(name))
        return self._attr(path, self._number(path))

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr(self._path(inode), inode)

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return os.fsencode(os.readlink(self._path(inode)))

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        self._path(inode)
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        base = self._path(fh)
        names = sorted(os.listdir(base))
        for i, name in enumerate(names[start_id:], start_id):
            path = os.path.join(base, name)
            try:
                ino = self._number(path)
            except pyfuse3.FUSEError:
                continue
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attr(path, ino), i + 1):
                return

    async def _hang(self, path: str, prefix: str = "") -> None:
        """Wait while ``path`` (with ``prefix``) is listed in the hang file."""
        while self._hangs(path, prefix):
            await trio.sleep(0.1)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        path = self._path(inode)
        await self._hang(path)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        self.fd_paths[fd] = path
        # Counting: no page cache kept from one open to the next (sshfs's default), so every read a client makes
        # after an open reaches this daemon and is counted.
        return pyfuse3.FileInfo(fh=fd, keep_cache=self.count is None)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        if off > 0:
            await self._hang(self.fd_paths[fh], "read:")
        data = os.pread(fh, size, off)
        if self.count is not None and data:
            self.served += len(data)
            tmp = f"{self.count}.tmp"
            with open(tmp, "w") as f:
                f.write(str(self.served))
            os.replace(tmp, self.count)
        return data

    async def release(self, fh: int) -> None:
        self.fd_paths.pop(fh, None)
        os.close(fh)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        await self._hang(self.source)
        v = os.statvfs(self.paths[pyfuse3.ROOT_INODE])
        out = pyfuse3.StatvfsData()
        for f in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
                  "f_namemax"):
            setattr(out, f, getattr(v, f))
        return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--hang", help="a file listing paths (one a line) whose opens do not answer while listed")
    ap.add_argument("--count", help="a file that holds the bytes served by reads so far")
    ap.add_argument("--renumber", action="store_true", help="new inode numbers after each forget and each start")
    args = ap.parse_args(argv)
    if not stat.S_ISDIR(os.stat(args.source).st_mode):
        ap.error(f"{args.source} is not a directory")
    ops = Passthrough(os.path.realpath(args.source), args.hang, args.count, args.renumber)
    pyfuse3.init(ops, args.mountpoint, {"fsname=passthrough", "ro", "default_permissions"})
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()

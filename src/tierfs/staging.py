"""Copying backing files into the cache: the worker-thread copy and the trio task that schedules copies.

*What* to stage is the engine's decision (:meth:`Engine.next_to_stage`); this module only does it: one copy
per file, in the order given (storage order), at most ``concurrency`` at a time, never more than the byte
budget reserved before the copy starts, and never faster than the ``bandwidth`` cap.

A copy reads through :func:`open_beneath` (no symlink is followed, no filesystem crossed), writes a ``.tmp-``
file in the cache and renames it into place only once complete and only if the backing file did not change
while it was read, so a partial or torn copy is never visible.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio
import xxhash

from tierfs.atomic import TEMP_PREFIX
from tierfs.cache import entry_name
from tierfs.tree import fingerprint, open_beneath

if TYPE_CHECKING:
    from tierfs.engine import Engine

__all__ = ["BackingChanged", "Stager", "copy_into_cache"]

CHUNK = 1 << 20


class BackingChanged(Exception):
    """The backing file is not what the scan (or the reservation) assumed; ``st`` is what it is now."""

    def __init__(self, st: os.stat_result | None) -> None:
        super().__init__("backing file changed while staging")
        self.st = st


def copy_into_cache(
    root_fd: int,
    dev: int,
    relpath: bytes,
    expected: tuple[int, int, int],
    data_fd: int,
    *,
    hash_content: bool,
    throttle: Callable[[int], None] | None,
) -> tuple[str, tuple[int, int, int], int | None]:
    """Copy one backing file into ``data_fd`` (runs in a worker thread); returns (name, fingerprint, digest).

    Raises :class:`BackingChanged` when the file's fingerprint differs from ``expected`` or changes during
    the copy, ``OSError`` when it cannot be read.
    """
    src = open_beneath(root_fd, relpath, dev)
    tmp = None
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.ENOENT, "no longer a regular file", os.fsdecode(relpath))
        if fingerprint(st) != expected:
            raise BackingChanged(st)
        tmp = f"{TEMP_PREFIX}{os.getpid()}-{relpath.hex()[:32]}-{id(st):x}"
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=data_fd)
        hasher = xxhash.xxh3_64() if hash_content else None
        total = 0
        try:
            buf = bytearray(CHUNK)
            view = memoryview(buf)
            while True:
                want = min(CHUNK, st.st_size - total)
                if throttle is not None and want > 0:
                    throttle(want)  # pay for the bytes expected, not the buffer size
                n = os.readv(src, [buf])
                if n == 0:
                    break
                total += n
                if total > st.st_size:
                    raise BackingChanged(None)
                chunk = view[:n]
                if hasher is not None:
                    hasher.update(chunk)
                while chunk:
                    w = os.write(dst, chunk)
                    chunk = chunk[w:]
        finally:
            os.close(dst)
        after = os.fstat(src)
        if total != st.st_size or fingerprint(after) != expected:
            raise BackingChanged(after)
        digest = hasher.intdigest() if hasher is not None else None
        name = entry_name(relpath, expected, digest)
        os.rename(tmp, name, src_dir_fd=data_fd, dst_dir_fd=data_fd)
        tmp = None
        return name, expected, digest
    finally:
        os.close(src)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=data_fd)


class Stager:
    """The background task: keeps asking the engine what to stage next and copies it."""

    def __init__(self, engine: Engine, concurrency: int = 4) -> None:
        self.engine = engine
        self.slots = trio.Semaphore(concurrency)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        engine = self.engine
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                changed = engine.changed
                job = engine.next_to_stage()
                if job is None:
                    await changed.wait()
                    continue
                fidx, size = job
                if not engine.cache.reserve(size):
                    engine.make_room(size)
                    if not engine.cache.reserve(size):
                        engine.staging_blocked()
                        await changed.wait()  # space frees on an eviction, a release or a switch
                        continue
                engine.begin_staging(fidx)
                await self.slots.acquire()
                nursery.start_soon(self._stage, fidx, size)

    async def _stage(self, fidx: int, size: int) -> None:
        try:
            await self.engine.stage_file(fidx, size)
        finally:
            self.slots.release()

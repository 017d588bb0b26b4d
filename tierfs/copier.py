"""One backing file copied into the cache, in a worker thread: the only code that writes copies.

A copy reads through :func:`~tierfs.beneath.open_regular` (no symlink followed, no filesystem crossed, never a
wait on a FIFO or a device that took the file's name), writes a ``.tmp-`` file in the cache's ``data/`` and
renames it into place only once complete and only if the backing file is, after the last read, still the
version the tree knows (size, mtime, inode and ctime: any write in between moves ctime), so a partial or torn
copy is never visible.  Holes of a sparse backing file stay holes.

Round trips to the backing: one ``open`` (the ``fstat`` that checks its type is answered from the attributes
the open brought), the reads (exactly the file's size: no read at EOF, the ``fstat`` after them sees a file
that grew) and one ``fstat`` -- on a network filesystem each is a request, and a latency-bound tier is paid
per request.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from tierfs.beneath import open_regular
from tierfs.cache import COPY_MTIME_NS, allocated, entry_name, temp_copy_name
from tierfs.tree import Fingerprint, fingerprint

__all__ = ["CHUNK", "BackingChanged", "Copied", "copy_into_cache", "run_copies"]

CHUNK = 1 << 20


class BackingChanged(Exception):
    """The backing file is not what the scan (or the reservation) assumed; ``st`` is what it is now."""

    def __init__(self, st: os.stat_result | None) -> None:
        super().__init__("backing file changed while staging")
        self.st = st


@dataclass(frozen=True)
class Copied:
    name: str
    fp: Fingerprint
    digest: int | None
    disk: int
    copy_id: tuple[int, int]


def copy_into_cache(root_fd: int, dev: int, relpath: bytes, expected: Fingerprint, data_fd: int, serial: int, *,
                    sparse: bool, hash_content: bool, throttle: Callable[[int], None] | None, block: int,
                    progress: Callable[[], None] = lambda: None) -> Copied:
    """Copy one backing file of fingerprint ``expected`` into ``data_fd`` (a worker thread).

    ``sparse``: the tree saw fewer blocks than bytes (its holes are looked for with ``SEEK_DATA``).  Raises
    :class:`BackingChanged` when the file is not ``expected`` after the copy, ``OSError`` when it cannot be
    read or written.
    """
    size = expected[0]
    src, _ = open_regular(root_fd, relpath, dev)
    tmp: str | None = temp_copy_name(serial)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=data_fd)
        hasher = xxhash.xxh3_64() if hash_content else None
        try:
            total = _copy_data(src, dst, size, sparse, hasher, throttle, progress)
            os.utime(dst, ns=(COPY_MTIME_NS, COPY_MTIME_NS))
        finally:
            os.close(dst)
        after = os.fstat(src)
        if total != size or fingerprint(after) != expected:
            raise BackingChanged(after)
        digest = hasher.intdigest() if hasher is not None else None
        name = entry_name(relpath, expected, serial, digest)
        os.rename(tmp, name, src_dir_fd=data_fd, dst_dir_fd=data_fd)
        tmp = None
        cst = os.stat(name, dir_fd=data_fd, follow_symlinks=False)  # (after the rename: it moves ctime)
        return Copied(name, expected, digest, allocated(cst, block), (cst.st_ino, cst.st_ctime_ns))
    finally:
        os.close(src)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=data_fd)


def _copy_data(src: int, dst: int, size: int, sparse: bool, hasher: xxhash.xxh3_64 | None,
               throttle: Callable[[int], None] | None, progress: Callable[[], None]) -> int:
    """Copy up to ``size`` bytes from ``src`` to ``dst``; returns the bytes found (less: the file shrank)."""
    buf = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buf)
    total = 0
    seg_end = 0 if sparse else size  # where the data segment being copied ends (a sparse file: SEEK_HOLE)
    while total < size:
        if total >= seg_end:
            # a sparse file's next data segment: holes stay holes (a filesystem without SEEK_DATA answers
            # "all data")
            try:
                data_at = min(os.lseek(src, total, os.SEEK_DATA), size)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: nothing but a hole up to the end
                    raise
                data_at = size
            if data_at > total:
                if hasher is not None:
                    _hash_zeros(hasher, data_at - total)
                total = data_at
                os.lseek(dst, total, os.SEEK_SET)
                if total >= size:
                    break
            seg_end = min(os.lseek(src, total, os.SEEK_HOLE), size)
            os.lseek(src, total, os.SEEK_SET)
        want = min(len(buf), seg_end - total)
        if throttle is not None:
            throttle(want)
        n = os.readv(src, [view[:want]])
        progress()
        if n == 0:
            break  # shrank: the fstat after the copy says how
        total += n
        chunk = view[:n]
        if hasher is not None:
            hasher.update(chunk)
        while chunk:
            w = os.write(dst, chunk)
            chunk = chunk[w:]
    if sparse:
        os.ftruncate(dst, total)
    return total


def _hash_zeros(hasher: xxhash.xxh3_64, n: int) -> None:
    zeros = bytes(min(n, CHUNK))
    while n > 0:
        k = min(n, CHUNK)
        hasher.update(zeros[:k])
        n -= k


def run_copies(jobs: list[Callable[[], Copied] | None]) -> tuple[list[Copied | BaseException | None], float]:
    """Run copies one after the other (a worker thread): per job its result or the exception it raised, and
    the CPU seconds this thread spent on them."""
    cpu0 = time.thread_time()
    out: list[Copied | BaseException | None] = []
    for job in jobs:
        if job is None:
            out.append(None)
            continue
        try:
            out.append(job())
        except (BackingChanged, OSError) as exc:
            out.append(exc)
    return out, time.thread_time() - cpu0

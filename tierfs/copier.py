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

A copy may be offered a *peer* (peers.py, ``peers=mpi``): its bytes are then asked of the node that holds the
file, for the version the tree knows, into the same temp file; whatever the peer does not give exactly (a miss)
starts the copy over from the backing.  The backing file is opened and ``fstat``-ed after the bytes landed all
the same: a peer's copy is renamed into place only if the backing file is still that version (a peer never
makes a wrong byte possible), and the backing's bytes are not read.

Copies run in batches, one after the other in one worker thread (:class:`CopyBatch`), watched from the trio
thread: a copy whose backing call hangs can be *abandoned* (see staging.py).  An abandoned copy's thread stops
after it, and the copy never lands -- it asks the batch immediately before its rename, and deletes its temp file
instead -- so whenever the kernel lets the thread go, nothing appears in ``data/`` that the cache does not count.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import xxhash

from tierfs.backing import Backing
from tierfs.beneath import open_regular
from tierfs.cache import allocated, entry_name, temp_copy_name
from tierfs.protocol import COPY_MTIME_NS
from tierfs.tree import Fingerprint, fingerprint

__all__ = ["CHUNK", "BackingChanged", "Copied", "CopyAbandoned", "CopyBatch", "PeerMissed", "PeerSource",
           "copy_into_cache"]

CHUNK = 1 << 20


class BackingChanged(Exception):
    """The backing file is not what the scan (or the reservation) assumed; ``st`` is what it is now."""

    def __init__(self, st: os.stat_result | None) -> None:
        super().__init__("backing file changed while staging")
        self.st = st


class CopyAbandoned(Exception):
    """The stager gave the copy up while it waited on the backing: its temp file is deleted, never renamed."""


class PeerMissed(Exception):
    """A peer did not give the file (peers.py raises its ``PeerMiss``, a subclass): copy it from the backing."""


class PeerSource(Protocol):
    """One file to ask of a peer (peers.py's ``PeerFetch``), in the copy's worker thread."""

    def fetch_into(self, dst: int, expected: Fingerprint, hasher: xxhash.xxh3_64 | None,
                   alive: Callable[[], None]) -> int:
        """Write the peer's bytes of version ``expected`` to ``dst``; their count, or :class:`PeerMissed`."""


@dataclass(frozen=True)
class Copied:
    name: str
    fp: Fingerprint
    digest: int | None
    disk: int
    copy_id: tuple[int, int]
    from_peer: bool = False  # the bytes came from a peer's cache, not the backing


def copy_into_cache(root_fd: int, dev: int, relpath: bytes, expected: Fingerprint, data_fd: int, serial: int, *,
                    sparse: bool, hash_content: bool, throttle: Callable[[int], None] | None, block: int,
                    progress: Callable[[int], None] = lambda nbytes: None,
                    may_commit: Callable[[], bool] = lambda: True, peer: PeerSource | None = None) -> Copied:
    """Copy one backing file of fingerprint ``expected`` into ``data_fd`` (a worker thread).

    ``sparse``: the tree saw fewer blocks than bytes (its holes are looked for with ``SEEK_DATA``).
    ``progress(nbytes)`` is called after every read with the bytes it brought (whatever becomes of the copy:
    the backing served them), ``may_commit()`` right before the rename (False: the copy was
    abandoned).  ``peer``: ask it for the bytes first (the backing only if it misses).
    Raises :class:`BackingChanged` when the file is not ``expected`` after the copy,
    :class:`CopyAbandoned`, ``OSError`` when it cannot be read or written.
    """
    size = expected[0]
    src, _ = open_regular(root_fd, relpath, dev)
    tmp: str | None = temp_copy_name(serial)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                      dir_fd=data_fd)
        hasher = xxhash.xxh3_64() if hash_content else None
        from_peer = False
        try:
            total = -1
            if peer is not None:
                try:
                    total = peer.fetch_into(dst, expected, hasher, lambda: progress(0))
                    from_peer = True
                except PeerMissed:
                    os.ftruncate(dst, 0)  # (what the peer sent goes: the backing's bytes from the start)
                    os.lseek(dst, 0, os.SEEK_SET)
                    hasher = xxhash.xxh3_64() if hash_content else None
            if not from_peer:
                total = _copy_data(src, dst, size, sparse, hasher, throttle, progress)
            os.utime(dst, ns=(COPY_MTIME_NS, COPY_MTIME_NS))
        finally:
            os.close(dst)
        after = os.fstat(src)
        if total != size or fingerprint(after) != expected:
            raise BackingChanged(after)
        digest = hasher.intdigest() if hasher is not None else None
        name = entry_name(relpath, expected, serial, digest)
        if not may_commit():
            raise CopyAbandoned  # (the temp file goes in the finally below)
        os.rename(tmp, name, src_dir_fd=data_fd, dst_dir_fd=data_fd)
        tmp = None
        cst = os.stat(name, dir_fd=data_fd, follow_symlinks=False)  # (after the rename: it moves ctime)
        return Copied(name, expected, digest, allocated(cst, block), (cst.st_ino, cst.st_ctime_ns), from_peer)
    finally:
        os.close(src)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=data_fd)


def _copy_data(src: int, dst: int, size: int, sparse: bool, hasher: xxhash.xxh3_64 | None,
               throttle: Callable[[int], None] | None, progress: Callable[[int], None]) -> int:
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
        progress(n)
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


class CopyBatch:
    """Copies run one after the other in one worker thread (:meth:`run`), watched from the trio thread.

    ``jobs``: per file a copy (:func:`copy_into_cache` with everything but ``progress`` and ``may_commit``), or
    None (no longer wanted).  The stager's watcher asks :meth:`waiting` how long the copy in progress has waited on
    one backing call and may :meth:`abandon` it: the thread then starts no further copy and that one never lands
    (:meth:`_may_commit`, asked right before the rename, says no).  The two sides meet under a lock held for a few
    assignments only, never across a disk or backing call: the trio thread never waits on the copying thread.

    After the thread returned, or after :meth:`abandon`: ``outcomes[:done]`` are the stager's to take (a
    :class:`Copied`, the exception raised, or None), ``stuck`` is the index of the abandoned copy (None if none),
    and the files after it were never copied.  ``ended`` says the thread has returned (an abandoned copy's
    reservation is given back then: its temp file may hold disk until that moment).
    """

    def __init__(self, jobs: list[Callable[..., Copied] | None], backing: Backing) -> None:
        self.jobs = jobs
        self.outcomes: list[Copied | BaseException | None] = [None] * len(jobs)
        self.done = 0
        self.stuck: int | None = None
        self.ended = False
        self._backing = backing
        self._lock = threading.Lock()
        self._rid: int | None = None  # the backing request the batch counts as (set once the thread runs)
        self._since = 0.0  # monotonic: the copy in progress started, or its last backing call came back
        self._committing = False  # the copy in progress is past the backing: renaming into place
        self._stopped = False  # abandoned (or cancelled): no further copy starts, the one in progress never lands

    def run(self) -> float:
        """(a worker thread) Run the copies; the CPU seconds this thread spent."""
        cpu0 = time.thread_time()
        self._since = time.monotonic()
        rid = self._rid = self._backing.track()
        try:
            for i, job in enumerate(self.jobs):
                with self._lock:
                    if self._stopped:
                        break
                    self._since, self._committing = time.monotonic(), False
                outcome: Copied | BaseException | None = None
                if job is not None:
                    try:
                        outcome = job(progress=self._progress, may_commit=self._may_commit)
                    except (BackingChanged, CopyAbandoned, OSError) as exc:
                        outcome = exc
                with self._lock:
                    if self._stopped:
                        break  # (abandoned: its outcome is nobody's; its copy did not land)
                    self.outcomes[i] = outcome
                    self.done = i + 1
                    self._since, self._committing = time.monotonic(), False
        finally:
            with self._lock:
                self.ended = True
            self._backing.untrack(rid)
        return time.thread_time() - cpu0

    def _progress(self, nbytes: int) -> None:
        self._since = time.monotonic()  # (one attribute store: atomic under the GIL)
        if self._rid is not None:
            self._backing.moved(self._rid, nbytes)

    def _may_commit(self) -> bool:
        with self._lock:
            self._committing = not self._stopped
            return self._committing

    def waiting(self, now: float) -> float:
        """Seconds the copy in progress has waited on one backing call (0: not started, renaming, or over)."""
        if self._rid is None or self.ended or self._committing or self._stopped:
            return 0.0
        return max(0.0, now - self._since)

    def abandon(self, bound: float) -> bool:
        """Give up the copy in progress if it has waited on the backing for over ``bound`` seconds (its thread is
        left to the kernel; the copies after it were never made); True if it was given up."""
        with self._lock:
            if self.waiting(time.monotonic()) <= bound:
                return False
            self._stopped = True
            self.stuck = self.done
            rid = self._rid
        assert rid is not None  # (waiting() is 0 until the thread runs)
        self._backing.untrack(rid, abandoned=True)  # (no longer a stall of the backing: a skipped file)
        return True

    def stop(self) -> None:
        """The stager stops waiting (the mount ends): no further copy starts, none that has not begun its rename
        lands."""
        with self._lock:
            self._stopped = True

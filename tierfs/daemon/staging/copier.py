"""One backing file copied into the cache, in a worker thread: the only code that writes copies.

A copy reads through :func:`~tierfs.daemon.backing.beneath.open_regular` (no symlink followed, no filesystem crossed,
never a wait on a FIFO or a device that took the file's name), writes a ``.tmp-`` file in the cache's ``data/`` and
renames it into place only once complete and only if the backing file is, after the last read, still the
version the tree knows (size, mtime, inode and ctime: any write in between moves ctime), so a partial or torn
copy is never visible.  Holes of a sparse backing file stay holes.

Round trips to the backing: one ``open`` (the ``fstat`` that checks its type is answered from the attributes
the open brought), the reads (exactly the file's size: no read at EOF, the ``fstat`` after them sees a file
that grew) and one ``fstat`` -- on a network filesystem each is a request, and a latency-bound tier is paid
per request.

**Racy clean.**  A fingerprint cannot tell apart two versions written within one tick of the backing's clock (a
second on ext4 with 128-byte inodes, Lustre, s3fs, rclone; a jiffy, 1-10 ms, on the others, whatever they store):
a copy of the first, checked against a fingerprint the second leaves unchanged, would be served for the mount's
life (git's "racy clean" problem).  So a copy never reads a file whose mtime or ctime lies in the current tick:
it is made once that tick is over (:func:`settling_ns`; the tick is learned from the timestamp itself), and any
change after that moves the fingerprint.  Only a file changed within the last tick is concerned: on a backing with
fine timestamps its copy waits a few tens of milliseconds; on one with 1-second timestamps it is put off
(:class:`CopyTooSoon`, nothing read) and its readers read the backing file meanwhile.

A copy may be offered a *peer* (peers.py, ``peers=mpi``): its bytes are then asked of the node that holds the
file, for the version the tree knows, into the same temp file; whatever the peer does not give exactly (a miss)
starts the copy over from the backing.  The backing file is opened and ``fstat``-ed after the bytes landed all
the same: a peer's copy is renamed into place only if the backing file is still that version (a peer never
makes a wrong byte possible), and the backing's bytes are not read.

Copies run in batches, one after the other in one worker thread (:class:`CopyBatch`), watched from the trio
thread: a copy whose backing call hangs can be *abandoned* (see stager.py).  An abandoned copy's thread stops
after it, and the copy never lands -- it asks the batch immediately before its rename, and deletes its temp file
instead -- so whenever the kernel lets the thread go, nothing appears in ``data/`` that the cache does not count.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from tierfs.common.protocol import COPY_MTIME_NS
from tierfs.daemon.backing.beneath import open_regular
from tierfs.daemon.backing.calls import Backing
from tierfs.daemon.cache.store import allocated, entry_name, temp_copy_name
from tierfs.daemon.tree.tree import Fingerprint, fingerprint

__all__ = ["CHUNK", "BackingChanged", "Copied", "CopyAbandoned", "CopyBatch", "CopyTooSoon", "PeerMissed",
           "PeerSource", "copy_into_cache", "settling_ns", "timestamp_tick"]

CHUNK = 1 << 20
#: The tick of a timestamp is the coarsest of these that divides it: a backing with 1-second timestamps stores
#: whole seconds, one with finer ones almost never does.
TICKS_NS = tuple(10**k for k in range(9, -1, -1))
#: Past a timestamp's tick, how long a copy still waits: the kernel stamps a change from a clock that moves once
#: a jiffy (1-10 ms) whatever the filesystem stores, and a backing server's clock may be a little behind ours.
#: A timestamp further ahead of our clock than this is a date set by hand (``touch -d``), not the present.
CLOCK_SLACK_NS = 50_000_000
#: A copy that must wait this long at most (a backing with fine timestamps: the slack) waits in its thread; one
#: that must wait longer (a 1-second backing) is put off (:class:`CopyTooSoon`), its readers served meanwhile.
SETTLE_IN_THREAD_NS = 100_000_000


class BackingChanged(Exception):
    """The backing file is not what the scan (or the reservation) assumed; ``st`` is what it is now."""

    def __init__(self, st: os.stat_result | None) -> None:
        super().__init__("backing file changed while staging")
        self.st = st


class CopyAbandoned(Exception):
    """The stager gave the copy up while it waited on the backing: its temp file is deleted, never renamed."""


class CopyTooSoon(Exception):
    """The backing file changed within the current tick of the backing's clock (see "Racy clean"): not copied
    now, since a rewrite later in that tick would keep its fingerprint; ``wait_s``: until the tick is over."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(f"changed within the backing's current timestamp tick: copied in {wait_s:.3f} s")
        self.wait_s = wait_s


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


def timestamp_tick(ns: int) -> int:
    """The granularity a timestamp shows (ns): the coarsest power of ten up to a second that divides it."""
    return next(tick for tick in TICKS_NS if ns % tick == 0)


def settling_ns(st: os.stat_result, now_ns: int) -> int:
    """How long after ``now_ns`` (wall clock) a copy of the file ``st`` describes must be put off, so that any
    change after it moves the fingerprint: 0 unless its mtime or ctime lies in the current tick of the backing's
    clock (see "Racy clean" in the module docstring)."""
    wait = 0
    for ns in (st.st_mtime_ns, st.st_ctime_ns):
        ends = ns + timestamp_tick(ns) + CLOCK_SLACK_NS  # (a tick's stamp is its start)
        if ns <= now_ns + CLOCK_SLACK_NS and ends > now_ns:
            wait = max(wait, ends - now_ns)
    return wait


def copy_into_cache(root_fd: int, dev: int, relpath: bytes, expected: Fingerprint, data_fd: int, serial: int, *,
                    sparse: bool, hash_content: bool, throttle: Callable[[int], None] | None, block: int,
                    inodes: bool = True, progress: Callable[[int], None] = lambda nbytes: None,
                    may_commit: Callable[[], bool] = lambda: True, peer: PeerSource | None = None) -> Copied:
    """Copy one backing file of fingerprint ``expected`` into ``data_fd`` (a worker thread).

    ``inodes``: ``expected`` holds the inode number (else 0: ``Tree.stable_inodes``).
    ``sparse``: the tree saw fewer blocks than bytes (its holes are looked for with ``SEEK_DATA``).
    ``progress(nbytes)`` is called after every read with the bytes it brought (whatever becomes of the copy:
    the backing served them), ``may_commit()`` right before the rename (False: the copy was
    abandoned).  ``peer``: ask it for the bytes first (the backing only if it misses).
    Raises :class:`BackingChanged` when the file is not ``expected`` after the copy, :class:`CopyTooSoon` (before
    any read) when it changed within the backing's current tick, :class:`CopyAbandoned`, ``OSError`` when it cannot
    be read or written.
    """
    size = expected[0]
    src, st = open_regular(root_fd, relpath, dev)
    tmp = temp_copy_name(serial)
    renamed = False
    try:
        wait_ns = settling_ns(st, time.time_ns()) if fingerprint(st, inodes) == expected else 0  # (else: changed)
        if wait_ns > SETTLE_IN_THREAD_NS:
            raise CopyTooSoon(wait_ns / 1e9)
        if wait_ns:
            time.sleep(wait_ns / 1e9)
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
        if total != size or fingerprint(after, inodes) != expected:
            raise BackingChanged(after)
        digest = hasher.intdigest() if hasher is not None else None
        name = entry_name(relpath, expected, serial, digest)
        if not may_commit():
            raise CopyAbandoned  # (the temp file goes in the finally below)
        os.rename(tmp, name, src_dir_fd=data_fd, dst_dir_fd=data_fd)
        renamed = True
        cst = os.stat(name, dir_fd=data_fd, follow_symlinks=False)  # (after the rename: it moves ctime)
        return Copied(name, expected, digest, allocated(cst, block), (cst.st_ino, cst.st_ctime_ns), from_peer)
    finally:
        os.close(src)
        if not renamed:
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

    def __init__(self, jobs: Sequence[Callable[..., Copied] | None], backing: Backing) -> None:
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
                    except (BackingChanged, CopyTooSoon, CopyAbandoned, OSError) as exc:
                        outcome = exc
                if not self._record(i, outcome):
                    break
        finally:
            with self._lock:
                self.ended = True
            self._backing.untrack(rid)
        return time.thread_time() - cpu0

    def _record(self, i: int, outcome: Copied | BaseException | None) -> bool:
        """Keep copy ``i``'s outcome, unless the batch was abandoned or stopped meanwhile (its outcome is nobody's;
        its copy did not land); whether the thread goes on."""
        with self._lock:
            if self._stopped:
                return False
            self.outcomes[i] = outcome
            self.done = i + 1
            self._since, self._committing = time.monotonic(), False
            return True

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

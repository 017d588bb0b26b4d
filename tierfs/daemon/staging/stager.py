"""The :class:`Stager`: which copies run, how many at once, and what becomes of each (the copy itself is
:mod:`tierfs.daemon.staging.copier`).

*What* to stage is the schedule's decision (the engine hands the stager files, in order, and the cache policy
says which are still wanted); the stager owns everything about *doing* it: its queue, the copies in flight, the
files that failed and when to retry them, the staging rate, and how many copies run at once.  It reserves each
copy's disk bytes before it starts (evicting what the policy gives up if it must: one "reserve, else make room"
path, also for a reader fetching a file on demand), and never goes faster than the ``bandwidth`` cap.  What
becomes of each file it tells the engine through :class:`StagerEvents`.

**Readers first.**  While readers are active (an open within the last :data:`READERS_ACTIVE_S`) and staging is
ahead of them (``Schedule.staging_ahead``: the next mini-epoch is staged further than the current one is read),
the copies get at most :data:`SHARE_WHILE_SERVING` of one core's time (the CPU their threads and the trio
thread's bookkeeping used, measured per batch):
a fast tier copied at full speed takes the cores and the interpreter lock that serving needs (a pass of small
files ran at 0.2-0.6x while the next mini-epoch staged from a local disk).  Over a network tier the copies
spend their time waiting on the tier, not on the CPU, so this never slows them; and staging that falls behind
the readers runs at full speed, so that the next mini-epoch is ready when the current one's passes end.

**Streams.**  A latency-bound tier (NFS, a parallel filesystem, object storage) delivers its bandwidth only
to many requests at once; a disk that reads best sequentially wants few.  With ``staging_streams=auto`` the
stager climbs: it doubles the number of copies in flight while the measured rate rises by at least 10 %,
steps back when it falls, and probes again later (:class:`StreamTuner`); ``staging_streams=N`` fixes it.

**A file that cannot be staged is skipped, never waited for** (gone, no longer a regular file -- a FIFO, a
device --, unreadable, no room): it is served from the backing dir meanwhile, tried again after
:data:`RETRY_AFTER` seconds, and its mini-epoch counts as staged without it.  ``status`` counts the skips and
names the files whose last try failed, with the reason (``staging.unstaged``); the newest of those reasons stays
the staging error (``last_error``) until each of them is staged.  A backing that is *lost* (calls.py) is not
a reason to skip anything: staging waits for it to come back and goes on where it was.

**A copy stuck on the backing is abandoned.**  A copy whose backing call (its open, a read) has not come back
for ``backing_timeout`` seconds (at least :data:`STUCK_AFTER_MIN`; never with ``backing_timeout=hard``) while
the backing root still answers ``statfs`` -- one file whose server hangs, not a stalled backing, for which
staging waits -- is given up by a watcher (:meth:`Stager.watch`): the file is skipped as above (the reason says
so), readers waiting on its copy read from the backing themselves, the copies of its batch that landed are
taken, and the files after it are queued again.  Its thread stays in the kernel, holding one of the
:data:`MAX_STREAMS` staging threads and the copy's disk reservation (its temp file may hold disk) until the
kernel lets it go; the copy then never lands (:class:`~tierfs.daemon.staging.copier.CopyBatch`), the reservation is
given back
and the file may be tried again.  A file is never copied again while an abandoned copy of it holds a thread, so
stuck threads are at most one per file; copies run at most ``min(streams, MAX_STREAMS - stuck)`` at once, and
only :data:`MAX_STREAMS` files stuck at the same time stop staging (``status``: ``staging.stuck``,
``staging.threads_left``).
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import stat
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import trio

from tierfs.common.options import LiveSettings
from tierfs.daemon.backing.calls import Backing, answered_gone
from tierfs.daemon.cache.store import CacheEntry, CacheStore
from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.runtime.wakeup import Wakeup
from tierfs.daemon.schedule.policy import CachePolicy
from tierfs.daemon.schedule.schedule import Schedule
from tierfs.daemon.staging.copier import BackingChanged, Copied, CopyBatch, CopyTooSoon, copy_into_cache
from tierfs.daemon.staging.filequeue import FileQueue
from tierfs.daemon.staging.peers import PeerGroup
from tierfs.daemon.tree.tree import Tree

__all__ = ["Stager", "StagerEvents", "StagerStatistics", "StreamTuner", "Unstaged"]

MAX_STREAMS = 64
AUTO_START = 16  # a latency-bound tier is served well from the start; a disk that wants fewer steps down
RETRY_AFTER = 5.0  # seconds before a file that failed to stage (ENOSPC, EMFILE, EIO) is tried again
SMALL_FILE = 256 << 10  # files below this are copied several to a thread hop
BATCH_FILES = 16  # at most this many to one hop
UNSTAGED_SHOWN = 8  # files status names under staging.unstaged
READERS_ACTIVE_S = 0.5  # readers count as active this long after an open
SHARE_WHILE_SERVING = 0.15  # of one core: what the copies may use while readers are active
STUCK_AFTER_MIN = 1.0  # seconds: a copy is never abandoned sooner, whatever backing_timeout says
WATCH_EVERY = 0.25  # seconds between two looks of the watcher at the copies in flight


class StreamTuner:
    """How many copies may run at once: fixed, or (``auto``) a hill climb on the measured staging rate.

    The rate of a window counts files as well as bytes (a file's fixed cost is what a latency-bound tier
    charges); a window closes after at least ``window_s`` seconds and as many copies as streams, and only
    windows with more work queued than streams count (otherwise the rate says nothing about the tier)."""

    def __init__(self, setting: int | str, *, window_s: float = 0.5) -> None:
        self.auto = setting == "auto"
        self.limit = MAX_STREAMS if self.auto else int(setting)
        self.streams = AUTO_START if self.auto else int(setting)
        self.window_s = window_s
        self._rates: dict[int, float] = {}  # streams -> last rate measured with that many
        self._t0 = time.monotonic()
        self._work = 0.0
        self._files = 0
        self._saturated = True
        self._settled_windows = 0

    def set(self, setting: int | str) -> None:
        self.__init__(setting, window_s=self.window_s)  # type: ignore[misc]

    def done(self, nbytes: int, queued: int) -> None:
        """One copy finished; ``queued``: copies waiting for a stream now."""
        self._work += nbytes + (64 << 10)
        self._files += 1
        self._saturated &= queued > 0
        now = time.monotonic()
        if now - self._t0 < self.window_s or self._files < self.streams:
            return
        rate = self._work / (now - self._t0)
        saturated = self._saturated
        self._t0, self._work, self._files, self._saturated = now, 0.0, 0, True
        if self.auto and saturated:
            self.observe(rate)

    def observe(self, rate: float) -> None:
        """One window's rate with ``streams`` copies in flight and more queued: climb, hold or step back."""
        n = self.streams
        self._rates[n] = rate
        lower = self._rates.get(n // 2) if n > 1 else None
        upper = self._rates.get(n * 2) if n * 2 <= self.limit else None
        if lower is not None and rate < lower * 1.1:
            self.streams = n // 2  # more streams did not help: back to fewer
            self._settled_windows = 0
        elif n * 2 <= self.limit and (upper is None or self._settled_windows >= 8):
            self._rates.pop(n * 2, None)  # probe upward (again now and then: the tier may have changed)
            self.streams = n * 2
            self._settled_windows = 0
        elif n > 1 and lower is None and upper is not None and upper < rate * 1.1:
            self.streams = n // 2  # more did not pay and fewer was never tried: probe downward
            self._settled_windows = 0
        else:
            self._settled_windows += 1

    def back_off(self) -> None:
        """The backing pushed back (EAGAIN, EMFILE, a timeout): fewer streams for now."""
        if self.auto and self.streams > 1:
            self.streams //= 2
            self._settled_windows = 0


@dataclass(frozen=True)
class Unstaged:
    """A file whose last staging try failed: its path in the backing dir and why."""

    file: str
    why: str


@dataclass(frozen=True)
class StagerStatistics:
    streams: int
    streams_limit: int | str
    inflight: int
    queued: int
    failed: int
    bytes_staged: int
    files_staged: int
    bytes_per_s: float
    files_per_s: float
    yielded_seconds: float  # waited so that readers kept the CPU (see "Readers first")
    skipped: int  # times a file could not be staged and was skipped (since mount)
    unstaged: tuple[Unstaged, ...]  # the files whose last try failed, newest first (at most UNSTAGED_SHOWN)
    unstaged_files: int  # how many files that is in all
    stuck: int  # copies abandoned on a backing call that has not come back: each holds a staging thread
    threads_left: int  # staging threads not held by stuck copies (MAX_STREAMS - stuck; 0: staging stops)
    error: str | None  # the last staging error, kept while a file it names is not staged (or a copy succeeds)


class StagerEvents(Protocol):
    """What the stager tells the engine (the engine implements it), and the one figure it asks for."""

    def landed(self, fidx: int, entry: CacheEntry) -> None:
        """A copy of ``fidx`` was committed (its fingerprint confirmed by the copy itself)."""

    def changed(self, fidx: int, st: os.stat_result) -> None:
        """The copy found the backing file changed: it now has stat ``st``."""

    def stage_blocked(self) -> None:
        """Nothing more fits in the cache until a switch frees space."""

    async def data_dir_lost(self) -> str | None:
        """The cache's ``data/`` is gone: make it again; why it could not be (None once it is)."""

    def gave_up(self, fidx: int) -> None:
        """``fidx`` could not be staged now: it is served from the backing meanwhile, and a mini-epoch never
        waits for it."""

    def gone(self, fidx: int) -> None:
        """The copy found ``fidx`` gone from the backing: out of the mini-epochs from now on."""

    def rf_now(self) -> int:
        """The rf in force (whether staging is ahead of the readers depends on it)."""


class Stager:
    """The background task that copies what the schedule wants (see the module docstring).

    The cache ``policy`` says whether a file is still worth copying (``keeps``) and evicts what it gives up
    first to make room (``make_room``); the ``schedule`` says what each copy occupies on the cache disk and
    whether staging is ahead of the readers; what becomes of each file goes to ``events``.  The ``settings``
    are the mount's: ``backing_timeout`` (how long a copy may wait on one backing call before it is abandoned)
    is read from them."""

    def __init__(self, tree: Tree, cache: CacheStore, backing: Backing, *, schedule: Schedule, policy: CachePolicy,
                 settings: LiveSettings, events: StagerEvents, peers: PeerGroup) -> None:
        self.tree = tree
        self.cache = cache
        self.backing = backing
        self.peers = peers  # (peers=mpi: a copy asks the file's owner first; peers.py)
        self.schedule = schedule
        self.policy = policy
        self.settings = settings
        self.events = events
        s = settings.current
        self.hash_content = s.verify == "xxhash"  # (verify is fixed at mount)
        self.tuner = StreamTuner(s.staging_streams)
        self.limiter = trio.CapacityLimiter(MAX_STREAMS)
        self.queue = FileQueue()
        self.inflight: dict[int, trio.Event] = {}
        self.failed: dict[int, float] = {}  # fidx -> monotonic time it may be tried again
        self.unstaged: dict[int, str] = {}  # fidx -> why its last try failed (insertion order: oldest first)
        self.skipped = 0
        self.running: dict[CopyBatch, trio.CancelScope] = {}  # batches in threads; the scope lets the watcher go
        self.stuck: dict[int, tuple[CopyBatch, int]] = {}  # fidx -> its abandoned batch, the bytes still reserved
        self.blocked = False
        self.error: str | None = None
        self._jobs = 0  # copy jobs (threads) running: what ``streams`` bounds
        self._wake = Wakeup()
        self._bytes = 0
        self._files = 0
        self._busy = 0.0
        self._since: float | None = None
        # (bytes, files, busy seconds) staged by the last two switches: the rate is measured since the one before
        # last (see :meth:`rate`)
        self._marks: deque[tuple[int, int, float]] = deque(maxlen=2)
        self._readers_at = -1e9  # monotonic time of the last open a reader made
        self._cpu_debt = 0.0  # copy CPU seconds not yet paid for while readers are active
        self._paid_at = time.monotonic()
        self.yielded_s = 0.0  # seconds staging waited for readers

    # ------------------------------------------------------------------------------------- the queue

    def reset(self, files: np.ndarray) -> None:
        """Stage these files, in this order, instead of whatever was queued (copies in flight go on)."""
        self._marks.append((self._bytes, self._files, self._busy_s()))
        self.queue = FileQueue(files[~self.cache.cached(files)])
        self.failed.clear()
        self.unstaged = {f: why for f, why in self.unstaged.items() if self.policy.keeps(f)}  # (what status names)
        self.blocked = False
        self.notify()

    def push_front(self, fidx: int) -> None:
        """Stage ``fidx`` next (found changed, or its copy damaged)."""
        self.failed.pop(fidx, None)
        self.queue.appendleft(fidx)
        self.notify()

    def notify(self) -> None:
        """Something changed that may let staging go on (space freed, files queued, a switch)."""
        self._wake.notify()

    def next_job(self) -> int | None:
        """The next file to copy; None when everything queued is cached, copying, failed or unwanted."""
        while self.queue:
            fidx = self.queue.first()
            if self.cache.get(fidx) is not None or fidx in self.inflight or fidx in self.failed \
                    or fidx in self.stuck or not self.policy.keeps(fidx):
                self.queue.popleft()  # (a failed or stuck file comes back through _retry_timer)
                continue
            return fidx
        return None

    def settled(self) -> bool:
        """Nothing queued and nothing in flight (tests and benchmarks wait for this)."""
        return self.next_job() is None and not self.inflight

    # ------------------------------------------------------------------------------------------- running

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._retry_timer)
            task_status.started()
            while True:
                if self.backing.lost:
                    await self.backing.wait_answering()  # (its files are not skipped: they are staged after)
                    continue
                if self._jobs >= min(self.tuner.streams, MAX_STREAMS - len(self.stuck)):
                    await self._wake.wait()
                    continue
                fidx = self.next_job()
                if fidx is None:
                    await self._wake.wait()
                    continue
                pause = self._pause()
                if pause > 0:
                    self.yielded_s += pause
                    await trio.sleep(pause)
                    continue
                reserved = self._reserve(fidx)
                if reserved is None:
                    self.blocked = True
                    self.events.stage_blocked()
                    await self._wake.wait()  # space frees on an eviction, a release or a switch
                    continue
                self._begin(fidx)
                batch = [(fidx, reserved)]
                # Small files go several to a thread hop: per file the trio thread then does a few dict
                # operations, not a task and a hop, so serving does not slow down while a mini-epoch stages.
                size = int(self.tree.sizes[fidx])
                while size < SMALL_FILE and len(batch) < BATCH_FILES:
                    nxt = self.next_job()
                    if nxt is None or int(self.tree.sizes[nxt]) >= SMALL_FILE:
                        break
                    more = self._reserve(nxt)
                    if more is None:
                        break
                    self._begin(nxt)
                    batch.append((nxt, more))
                    size += int(self.tree.sizes[nxt])
                self._jobs += 1
                nursery.start_soon(self._stage, batch)

    async def _retry_timer(self) -> None:
        """Queue the files whose staging failed again once their time is up (a full disk may have room now)."""
        while True:
            await trio.sleep(RETRY_AFTER / 2)
            now = time.monotonic()
            due = [f for f, t in self.failed.items() if t <= now]
            for fidx in due:
                del self.failed[fidx]
                if self.policy.keeps(fidx) and self.cache.get(fidx) is None:
                    self.queue.append(fidx)
            if due:
                self.notify()

    # ------------------------------------------------------------------------------------ stuck copies

    def stuck_after(self) -> float | None:
        """Seconds a copy may wait on one backing call before it is abandoned; None: never (``hard``)."""
        t = self.settings.current.backing_timeout_s
        return None if t is None else max(t, STUCK_AFTER_MIN)

    async def watch(self) -> None:
        """Abandon the copies stuck on one backing call for longer than :meth:`stuck_after` while the backing
        root answers; give back what an abandoned copy held once its thread returns (see the module docstring).
        A background job of its own: under ``lru`` only readers' copies run, and :meth:`run` does not."""
        while True:
            await trio.sleep(WATCH_EVERY)
            self._reap()
            bound = self.stuck_after()
            if bound is None:
                continue
            now = time.monotonic()
            late = [b for b in self.running if b.waiting(now) > bound]
            # (a backing that answers nothing is stalled, not one file: staging waits for it, skipping nothing)
            if late and await self.backing.answering(timeout=bound):
                for batch in late:
                    scope = self.running.get(batch)
                    if scope is not None and batch.abandon(bound):
                        scope.cancel()  # _stage takes what landed, skips the stuck file, queues the rest

    def _reap(self) -> None:
        """The abandoned copies whose thread has returned: their reservation goes back (their copy did not land)
        and their file may be tried again."""
        for fidx, (batch, reserved) in list(self.stuck.items()):
            if batch.ended:
                del self.stuck[fidx]
                self.cache.unreserve(reserved)
                self.failed[fidx] = time.monotonic()  # (the retry timer's next round queues it, if wanted)
                self.notify()

    def _abandoned(self, fidx: int, reserved: int, batch: CopyBatch) -> None:
        """The copy of ``fidx`` was abandoned: skipped; readers waiting on it are let go (to the backing)."""
        self.stuck[fidx] = (batch, reserved)  # (its reservation stays until its thread returns: _reap)
        self._finished(fidx, 0)
        bound = self.stuck_after()
        self._fail(fidx, f"the backing did not answer for {bound:g} s (backing_timeout): copy abandoned, its "
                         "thread held until the backing lets go")

    # ---------------------------------------------------------------------------------- readers first

    def serving(self) -> None:
        """A reader opened a file (the data path calls this): staging yields to readers for a while."""
        self._readers_at = time.monotonic()

    def _pause(self) -> float:
        """Seconds to wait before the next copy starts, so that while readers are active the copies use at most
        SHARE_WHILE_SERVING of a core (a token bucket in CPU seconds, refilled at that rate)."""
        now = time.monotonic()
        self._cpu_debt = max(0.0, self._cpu_debt - (now - self._paid_at) * SHARE_WHILE_SERVING)
        self._paid_at = now
        if now - self._readers_at > READERS_ACTIVE_S or not self.schedule.staging_ahead(self.events.rf_now()):
            self._cpu_debt = 0.0
            return 0.0
        return min(0.05, self._cpu_debt / SHARE_WHILE_SERVING)

    def _charge(self, cpu_s: float) -> None:
        if time.monotonic() - self._readers_at <= READERS_ACTIVE_S:
            self._cpu_debt += cpu_s

    # ------------------------------------------------------------------------------------------ copying

    def _reserve(self, fidx: int) -> int | None:
        """Disk bytes reserved for a copy of ``fidx``: the one "reserve, else make room" path."""
        need = int(self.schedule.disk_sizes[fidx])
        if self.cache.reserve(need):
            return need
        if self.policy.make_room(need) and self.cache.reserve(need):
            return need
        return None

    def _begin(self, fidx: int) -> None:
        self.blocked = False
        if self.queue and self.queue.first() == fidx:
            self.queue.popleft()
        self.inflight[fidx] = trio.Event()
        if self._since is None:
            self._since = time.monotonic()

    async def fetch_now(self, fidx: int) -> CacheEntry | None:
        """Copy ``fidx`` for a reader waiting on it (or wait for the copy in flight); None if it cannot be
        cached right now (no room, or the copy failed): the reader is then served from the backing."""
        ev = self.inflight.get(fidx)
        if ev is not None:
            await ev.wait()
            return self.cache.get(fidx)
        if self.failed.get(fidx, 0.0) > time.monotonic() or self.backing.lost or fidx in self.stuck \
                or len(self.stuck) >= MAX_STREAMS:
            return None  # it failed moments ago (a full cache disk, say; a copy stuck): not again for every reader
        reserved = self._reserve(fidx)
        if reserved is None and self.cache.deleting_bytes:
            # evictions (this one's included) are on their way off the disk: their room, not the backing
            await self.cache.deletions_landed()
            ev = self.inflight.get(fidx)
            if ev is not None:  # (another reader's fetch of it began meanwhile)
                await ev.wait()
            if ev is not None or self.cache.get(fidx) is not None:
                return self.cache.get(fidx)
            reserved = self._reserve(fidx)
        if reserved is None:
            return None
        self._begin(fidx)
        self._jobs += 1
        await self._stage([(fidx, reserved)], for_reader=True)
        return self.cache.get(fidx)

    async def _stage(self, batch: list[tuple[int, int]], *, for_reader: bool = False) -> None:
        """Copy the files of ``batch`` (file index, reserved disk bytes) in one worker thread, one after the
        other, and take each result.  ``for_reader``: a reader waits for it (not background work to pace).
        The watcher may abandon a copy stuck on the backing: what landed before it is taken, it is skipped, the
        files after it are queued again."""
        taken = 0  # files of the batch handed on (taken, or stuck): the rest are given back in the finally
        copies: CopyBatch | None = None
        cpu0 = time.thread_time()  # the trio thread's own work for this batch counts as staging's too
        try:
            jobs = []
            for fidx, _ in batch:
                node = self.tree.file_node(fidx)
                sparse = node.st.st_blocks * 512 < node.st.st_size
                wanted = self.policy.keeps(fidx)
                jobs.append(None if not wanted else functools.partial(
                    copy_into_cache, self.backing.root_fd, self.backing.dev, node.path, self.tree.fingerprint_of(fidx),
                    self.cache.data_fd, self.cache.next_serial(),
                    sparse=sparse, hash_content=self.hash_content, inodes=self.tree.stable_inodes,
                    throttle=self.backing.throttle_from_thread, block=self.cache.block,
                    # (a sparse file's holes are kept by the backing copy only: its reservation counts on them)
                    peer=None if sparse else self.peers.source_for(fidx)))
            copies = CopyBatch(jobs, self.backing)
            cpu_s = time.thread_time() - cpu0
            copy_s = 0.0
            scope = self.running[copies] = trio.CancelScope()  # (the watcher cancels it when it abandons a copy)
            try:
                with scope:
                    copy_s = await in_thread(copies.run, limiter=self.limiter, abandon_on_cancel=True)
            finally:
                del self.running[copies]
            cpu0 = time.thread_time()
            for fidx, reserved in batch[:copies.done]:
                taken += 1
                await self._take(fidx, reserved, copies.outcomes[taken - 1])  # (no checkpoint unless one failed)
            if copies.stuck is not None:
                taken += 1
                self._abandoned(*batch[copies.stuck], copies)
                self.queue.extendleft(f for f, _ in reversed(batch[taken:]))  # (never copied: their turn again)
            elif not for_reader:
                self._charge(cpu_s + copy_s + time.thread_time() - cpu0)
        finally:
            if copies is not None and copies.stuck is None:
                copies.stop()  # (if cancelled -- the mount ends -- nothing more lands; else a no-op)
            for fidx, reserved in batch[taken:]:  # given back: cancelled, or never copied
                self._finished(fidx, reserved)
            self._jobs -= 1
            self.notify()

    async def _take(self, fidx: int, reserved: int, outcome: Copied | BaseException | None) -> None:
        """One copy's result: commit it, or find out why not."""
        try:
            if outcome is None:
                return  # no longer wanted when its turn came
            if isinstance(outcome, BackingChanged):
                if outcome.st is not None and stat.S_ISREG(outcome.st.st_mode):
                    self.events.changed(fidx, outcome.st)
                else:
                    self._fail(fidx, "changed while staged")
                return
            if isinstance(outcome, OSError):
                await self._copy_failed(fidx, outcome)
                return
            if isinstance(outcome, CopyTooSoon):
                # changed within the backing's current timestamp tick: copied once it is over (the retry timer),
                # read from the backing meanwhile -- neither a skip nor an error
                self.failed[fidx] = time.monotonic() + outcome.wait_s
                return
            assert isinstance(outcome, Copied)
            if not self.tree.holds(fidx, outcome.fp):
                # Found changed by an open while we copied: this copy is of the old file; stage it again.
                self.cache.discard(outcome.name)
                self.push_front(fidx)
                return
            entry = self.cache.commit(fidx, outcome.name, outcome.fp, outcome.digest, reserved, outcome.disk,
                                      outcome.copy_id)
            reserved = 0
            if entry is None:
                self._fail(fidx, "the copy took more disk than reserved and the cache is full")
                return
            self.unstaged.pop(fidx, None)
            self.error = self._persistent_error()
            self._bytes += outcome.fp[0]
            self._files += 1
            self.tuner.done(outcome.fp[0], len(self.queue))
            self.events.landed(fidx, entry)
        finally:
            self._finished(fidx, reserved)

    def _finished(self, fidx: int, reserved: int) -> None:
        if reserved:
            self.cache.unreserve(reserved)
        ev = self.inflight.pop(fidx, None)
        if ev is not None:
            ev.set()
        if not self.inflight and self._since is not None:
            self._busy += time.monotonic() - self._since
            self._since = None

    async def _copy_failed(self, fidx: int, exc: OSError) -> None:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR) and await in_thread(self.cache.data_dir_lost):
            why = await self.events.data_dir_lost()  # the engine recreates it and queues everything again
            if why is None:
                self.error = "the cache dir's data/ was removed: recreated"
                return
            self._fail(fidx, why)  # (not recreated: tried again with this file, after RETRY_AFTER)
            return
        if await self.backing.lost_by(exc):
            self.queue.appendleft(fidx)  # staged once the backing is back: never skipped for its absence
            return
        if exc.errno in (errno.ENOENT, errno.ENOTDIR) and await self._gone_from_backing(fidx):
            self.events.gone(fidx)  # (the file, or its directory, is gone from a live root: never tried again)
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ETIMEDOUT):
            self.tuner.back_off()
        self._fail(fidx, exc.strerror or str(exc))

    async def _gone_from_backing(self, fidx: int) -> bool:
        """Whether the backing itself says ``fidx`` is not there while its root is (a copy's ENOENT may be the
        cache dir's, or a moment of a rename: asked again, of the backing alone)."""
        timeout = self.stuck_after()
        try:
            (answer,) = await self.backing.stat_many([self.tree.file_path(fidx)], timeout=timeout)
        except OSError:
            return False
        if isinstance(answer, OSError):
            return answered_gone(answer) and await self.backing.root_alive(timeout=timeout)
        return not stat.S_ISREG(answer.st_mode)  # (no longer a regular file: a FIFO took its name)

    def _fail(self, fidx: int, why: str) -> None:
        """This file cannot be staged now (gone, not a regular file, unreadable, ENOSPC, EMFILE, ...): skipped --
        served from the backing dir, tried again after RETRY_AFTER seconds; the error stays in status while the
        file is not staged."""
        self.failed[fidx] = time.monotonic() + RETRY_AFTER
        self.unstaged.pop(fidx, None)
        self.unstaged[fidx] = why
        self.skipped += 1
        self.error = self._persistent_error()
        self.events.gave_up(fidx)

    def copy_found_bad(self, why: str) -> None:
        """A staged copy failed a reader's check (``verify=xxhash``): the staging error until the next copy lands
        or fails (the copy is repaired, and staged again, by the data path)."""
        self.error = why

    def _persistent_error(self) -> str | None:
        """The staging error to show: the newest failure of a file still not staged."""
        for fidx, why in reversed(self.unstaged.items()):
            return f"staging {os.fsdecode(self.tree.file_path(fidx))}: {why}"
        return None

    # ------------------------------------------------------------------------------------------- figures

    def _busy_s(self) -> float:
        """Seconds with a copy in flight since the mount."""
        return self._busy + (time.monotonic() - self._since if self._since is not None else 0.0)

    def rate(self) -> tuple[float, float]:
        """(bytes/s, files/s) staged of late: over the seconds a copy was in flight since the switch before last,
        i.e. the staging of this mini-epoch and the last -- the tier the next one comes from now, which may not be
        the first epoch's (with peers, after the first epoch a node stages from the others' caches: a mount's
        average would keep the slow tier's rate, and ``rf=auto`` its rf, for as many epochs again).  The mount's
        average while nothing has landed since that switch."""
        busy = self._busy_s()
        b0, f0, t0 = self._marks[0] if self._marks else (0, 0, 0.0)
        if self._bytes > b0 and busy > t0:
            return (self._bytes - b0) / (busy - t0), (self._files - f0) / (busy - t0)
        return (self._bytes / busy, self._files / busy) if busy > 0 else (0.0, 0.0)

    def bytes_per_s(self) -> float:
        return self.rate()[0]

    def stuck_on_space(self) -> bool:
        """Nothing more fits until a switch frees space, and no copy is in flight (whose landing could change
        that)."""
        return self.blocked and not self.inflight

    def statistics(self) -> StagerStatistics:
        bytes_per_s, files_per_s = self.rate()
        return StagerStatistics(
            streams=self.tuner.streams,
            streams_limit="auto" if self.tuner.auto else self.tuner.limit,
            inflight=len(self.inflight),
            queued=len(self.queue),
            failed=len(self.failed),
            bytes_staged=self._bytes,
            files_staged=self._files,
            bytes_per_s=bytes_per_s,
            files_per_s=files_per_s,
            yielded_seconds=round(self.yielded_s, 3),
            skipped=self.skipped,
            unstaged=tuple(Unstaged(os.fsdecode(self.tree.file_path(f)), why)
                           for f, why in itertools.islice(reversed(self.unstaged.items()), UNSTAGED_SHOWN)),
            unstaged_files=len(self.unstaged),
            stuck=len(self.stuck),
            threads_left=MAX_STREAMS - len(self.stuck),
            error=self.error,
        )

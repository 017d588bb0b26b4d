"""Consumers: several jobs on one mount, each with its own passes, its own order and its own pace.

A hyperparameter sweep runs 4-8 training jobs over the same data set at once.  One mount serves them all -- one
cache, one read of the slow tier per epoch -- if passes are counted per job: a *consumer*.

**Who is who.**  A job names itself with ``TIERFS_CONSUMER=NAME`` in its environment (``TIERFS_CONSUMER=lr0.1
python train.py``): every process started with it -- the DataLoader's workers inherit it -- is that consumer.
The daemon reads the variable from ``/proc/PID/environ`` of the requesting process (the environment the process
was started with, so it must be set on the job's command line, not changed from inside).  Readers without it are
the one *anonymous* consumer: a mount used by one job, or by readers that never name themselves, counts passes
exactly as before.  Neither the process group nor the session tells jobs apart (measured: two jobs started from
one non-interactive shell script share both with each other and with their DataLoader workers), so the name is
explicit.

**Names, safely** (:meth:`Consumers.name_of`).  Only the users who steer (``Steering.steers``: the owner, root,
the steering group) have names: everyone else's opens are served uncounted, so their environments are never read
and they are all the anonymous consumer.  A name is kept per *process*, not per pid: the key is (uid, pid, the
process's start time from ``/proc/PID/stat``, which never waits on the process's memory), read again after
:data:`PID_TTL` seconds, so a pid reused by another job -- of another user or the same -- is read afresh.
Reading another process's environment waits on that process's memory map, which its owner can hold at will (a
page fault into a FUSE mount that never answers; a hung NFS mount does it by accident): each read runs in a
worker thread, each user has its own :data:`READS_PER_USER` of them, and a read that takes over
:data:`_ENV_READ_TIMEOUT` seconds is left behind (the process reads as anonymous).  So a user's wedged processes
hold at most that user's threads and delay only that user's new processes; no other user's open waits on them.
Warnings about one user's names (a name that is not one, a read left behind, a cap reached) are rate-limited per
user: the first at once, then at most one per :data:`WARN_EVERY` seconds with the count of those left out.

**Passes.**  A consumer's pass ends when it has opened every file of the view since its pass began, or when it
lists the root again after opening at least one file, or on ``next-pass`` written by it.  Its listings and its
``order`` file are in its own shuffle (a seed of its own, from its name), so jobs do not read in lockstep and a
listing by one never ends another's pass.  A consumer takes part in the count -- is *live* -- from its first
open of a view file; it joins at the mount's current pass (``Schedule.pos.pass_index``).  The mount's pass count
is the smallest of the live consumers' (the pass rule's ``PassRule._catch_up``): the mini-epoch moves on, as
``advance`` rules, once every live consumer has made its ``rf`` passes.

**The anonymous readers hold no named job.**  The anonymous consumer is live only while no named one that is
alive is: an operator's ``cat`` or ``ls`` on a mount read by named jobs joins nothing (it would hold every job
for a whole ``consumer_timeout``: measured 60 s) and never waits; a named job's first open sets a live anonymous
consumer aside (the job joins at the mount's pass: nothing moves).  It takes part again once no named job is
live, or all the live ones are gone (below: an unnamed job after a sweep moves the mount, its wait drops them).

**Waiting, bounded.**  A consumer that has made its ``rf`` passes and is ahead of the others waits when it starts
another pass (its root listing, or its open of ``order``/``order0``) until the mount moves on -- so each job makes
exactly ``rf`` passes per mini-epoch.  The wait lasts at most ``consumer_timeout`` seconds: then every live
consumer that holds the mount back is *dropped* from the count (killed, paused, finished, or just that much
slower), the mount moves on, and the waiter goes on.  A dropped consumer is served as before; it rejoins at the
mount's current position with its next root listing (or ``order`` open) and first open of a view file.

**A job that is gone is dropped at once.**  Each named consumer keeps the processes (and threads: a FUSE request
carries the thread's id) that presented its name, by (pid, start time), the :data:`PROCESSES_KEPT` most recently
seen.  When none of them is alive -- gone, a zombie, or its pid reused (``/proc/PID/stat``, which never waits on
the process) -- the job exited or was killed: a waiter drops it at once instead of after ``consumer_timeout``
(measured: 10 s at a 10 s timeout, a minute by default, for every finished job of an early-stopping sweep).  A
waiter looks every :data:`ALIVE_EVERY` seconds, so a job that exits during the wait costs at most that; the log
line names the consumer and says why.  A consumer with no process known (made by the engine itself) is never
taken for gone.

**The table, bounded.**  It keeps :data:`MAX_CONSUMERS` consumers, at most :data:`MAX_CONSUMERS_PER_USER`
named by any one user (the user whose process named it first; a name is one consumer whichever steering user's
process presents it).  A new name past either cap first forgets the consumer seen longest ago that is not live
(of that user, for the user's cap); when every one is live, the new name's processes read as the anonymous
consumer (logged) until one is dropped or forgotten -- a job reads, counted with the anonymous readers, never
refused.

This module owns the table of consumers and their pass state and reports them (``status.consumers``); the
engine decides what a consumer's pass end means for the mount.  Plain Python and numpy on the trio thread, but
for the environment read.
"""

from __future__ import annotations

import logging
import os
import re
import time
import zlib
from dataclasses import dataclass

import numpy as np
import trio

from tierfs.common.protocol import RankShare
from tierfs.daemon.access import Steering
from tierfs.daemon.runtime.threads import in_thread
from tierfs.daemon.schedule.schedule import Schedule
from tierfs.daemon.schedule.view import View

__all__ = ["ANONYMOUS", "CONSUMER_ENV", "Consumer", "ConsumerStatistics", "Consumers", "ConsumersStatistics",
           "consumer_name", "process_alive", "process_start"]

log = logging.getLogger("tierfs")

#: The environment variable a job names itself with.
CONSUMER_ENV = "TIERFS_CONSUMER"
#: The consumer of every reader that does not name itself.
ANONYMOUS = "anonymous"
#: What a name may be: it shows in status, metrics labels and the log.
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+=-]{0,63}")
#: Seconds a process's name is kept before it is read again.
PID_TTL = 30.0
#: Consumers kept in the table; beyond it the one seen longest ago that is not live is forgotten.
MAX_CONSUMERS = 64
#: Named consumers one user may hold in the table (see the module docstring: past it, anonymous).
MAX_CONSUMERS_PER_USER = 16
#: Environment reads in flight per user, each a worker thread: what one user's wedged processes can hold.
READS_PER_USER = 4
#: Seconds between two warnings about one user's consumer names (the first is logged at once).
WARN_EVERY = 60.0
#: Requesters (processes and threads) kept per named consumer to tell whether it is still alive: the most
#: recently seen; dead ones are pruned first.
PROCESSES_KEPT = 256
#: Seconds between two looks whether the jobs a wait is for are alive (how late it notices that one exited); an
#: anonymous reader's opens look no more often than that either.
ALIVE_EVERY = 0.25
_PIDS_KEPT = 4096
_ENV_READ_TIMEOUT = 2.0  # a process whose memory map stays locked that long is taken as anonymous
_KEY = (CONSUMER_ENV + "=").encode()

NEW, LIVE, DROPPED = "new", "live", "dropped"


def consumer_name(pid: int) -> tuple[str, str | None]:
    """(name, None): the consumer name in the environment process ``pid`` was started with, :data:`ANONYMOUS`
    if it has none or it cannot be read (gone, another user's); (:data:`ANONYMOUS`, the value) for a value that
    is not a valid name (the caller logs it).  Blocking, and may block for good on a process whose memory map
    is held: a worker thread that may be left behind."""
    if pid <= 0:
        return ANONYMOUS, None
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read(1 << 20)
    except OSError:
        return ANONYMOUS, None
    for item in env.split(b"\0"):
        if item.startswith(_KEY):
            name = item[len(_KEY):].decode("utf-8", "replace")
            return (name, None) if NAME.fullmatch(name) else (ANONYMOUS, name)
    return ANONYMOUS, None


def _stat(pid: int) -> tuple[bytes, int] | None:
    """Process (or thread) ``pid``'s state letter and start time, in clock ticks since boot (fields 3 and 22 of
    ``/proc/PID/stat``); None if it is gone.  Read on the trio thread: unlike ``environ`` and ``cmdline``,
    ``stat`` never waits on the process's memory map (tested with a wedged one)."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    fields = data.rpartition(b")")[2].split()  # (the command name before it may hold spaces and parentheses)
    try:
        return fields[0], int(fields[19])  # (fields 3 and 22; the fields after the name start at field 3)
    except (IndexError, ValueError):
        return None


def process_start(pid: int) -> int | None:
    """When process (or thread) ``pid`` started (see :func:`_stat`): with the pid, one process for the life of
    the system.  None if it is gone."""
    st = _stat(pid)
    return None if st is None else st[1]


def process_alive(pid: int, start: int) -> bool:
    """Process (or thread) ``pid`` that started at ``start`` still runs: not gone, not another process under a
    reused pid, not a zombie (a job that exited and its launcher has not reaped yet is gone all the same)."""
    st = _stat(pid)
    return st is not None and st[1] == start and st[0] not in (b"Z", b"X")


class _Warnings:
    """Warnings about one user's consumer names, rate-limited per uid: the first at once, then at most one per
    :data:`WARN_EVERY` seconds, which says how many were left out since the last.  Only users who steer are ever
    warned about, so the map stays as small as the steering group."""

    def __init__(self) -> None:
        self._by_uid: dict[int, tuple[float, int]] = {}  # uid -> (monotonic time of its last warning, left out)

    def warn(self, uid: int, message: str, *args: object) -> None:
        now = time.monotonic()
        last = self._by_uid.get(uid)
        if last is not None and now - last[0] < WARN_EVERY:
            self._by_uid[uid] = (last[0], last[1] + 1)
            return
        self._by_uid[uid] = (now, 0)
        left_out = last[1] if last is not None else 0
        tail = f" ({left_out} more such warnings about uid {uid} left out)" if left_out else ""
        log.warning("consumer names of uid %d: " + message + "%s", uid, *args, tail)


@dataclass(frozen=True)
class ConsumerStatistics:
    """One consumer in ``status.consumers``: ``passes`` made in the current mini-epoch, ``position`` the view
    files opened in its current pass, ``samples_per_s`` its last pass's opens per second (its pass so far until
    one ended), ``last_seen`` the wall-clock time of its last open or listing, ``waiting_s`` how long it has
    waited for the others (None: not waiting)."""

    name: str
    state: str
    passes: int
    passes_total: int
    position: int
    opens: int
    samples_per_s: float
    last_seen: float
    waiting_s: float | None
    drops: int
    advance_vote: bool = False  # its ARF said advance in this mini-epoch


@dataclass(frozen=True)
class ConsumersStatistics:
    """``status.consumers``: the bound on a wait, how many are live, every consumer in the table."""

    timeout: float
    live: int
    drops: int
    consumers: tuple[ConsumerStatistics, ...] = ()


class Consumer:
    """One job's pass state.  ``passes``: passes made in the current mini-epoch (from the mount's count when it
    joined); the marks say which view files it opened in its current pass."""

    def __init__(self, name: str, seed: int, n_files: int, view_files: int) -> None:
        self.name = name
        self.seed = seed
        self.state = NEW
        self.passes = 0
        self.passes_total = 0
        self.drops = 0
        self.opens = 0
        self.reads_in_pass = 0
        self.n_files = n_files
        self.marks: np.ndarray | None = None  # (made at its first open: a lister that never reads costs nothing)
        self.view_files = self.unread = view_files
        self.view: View | None = None  # its own order of the view, made when it lists (None: not made yet)
        self.last_seen = time.time()
        self.pass_started: float | None = None  # monotonic time of its pass's first open
        self.rate = 0.0
        self.waiting_since: float | None = None
        self.advance_vote = False  # its ARF said advance in the current mini-epoch
        self.uid: int | None = None  # the user whose process named it first (None: made by the engine itself)
        # (the mount's pass and rank count ``next-pass pass=P rank=R/W`` spoke of, and the ranks that said it)
        self.shares_of: tuple[int, int] | None = None
        self.shares_done: set[int] = set()
        # (pid, start time) of the processes and threads that presented its name, least recently seen first
        # (PROCESSES_KEPT of them): none alive, the job is gone (:meth:`Consumers.gone`); none known, never gone
        self.processes: dict[tuple[int, int], None] = {}
        self.looked_at = float("-inf")  # monotonic time of the last look whether one of them is alive ...
        self.gone_why: str | None = None  # ... and what it found (None: one is)
        self.swept_at = float("-inf")  # monotonic time the dead ones were last pruned from a full set

    def new_pass(self, view_files: int) -> None:
        if self.marks is not None:
            self.marks[:] = False
        self.view_files = self.unread = view_files
        self.reads_in_pass = 0
        self.pass_started = None
        self.view = None

    def statistics(self, now: float) -> ConsumerStatistics:
        rate = self.rate
        if self.pass_started is not None and not self.passes_total and now > self.pass_started:
            rate = self.reads_in_pass / (now - self.pass_started)  # (no pass ended yet: this one so far)
        return ConsumerStatistics(
            name=self.name, state=self.state, passes=self.passes, passes_total=self.passes_total,
            position=self.view_files - self.unread, opens=self.opens, samples_per_s=rate, last_seen=self.last_seen,
            waiting_s=None if self.waiting_since is None else now - self.waiting_since, drops=self.drops,
            advance_vote=self.advance_vote,
        )


class Consumers:
    """See the module docstring: the consumers of one mount, by name, and the names of the requesting pids."""

    def __init__(self, schedule: Schedule, steering: Steering | None = None) -> None:
        self.schedule = schedule
        self.steering = steering if steering is not None else Steering()
        self._table: dict[str, Consumer] = {}
        # (uid, pid, start time) -> (name, monotonic time it was read): a process, not a pid (pids are reused)
        self._pids: dict[tuple[int, int, int], tuple[str, float]] = {}
        self._readers: dict[int, trio.CapacityLimiter] = {}  # uid -> its environment reads (users who steer)
        self._warnings = _Warnings()
        self.drops = 0

    # ============================================================================================ names

    async def name_of(self, pid: int, uid: int) -> str:
        """The consumer that process ``pid`` of user ``uid`` reads as (see the module docstring): anonymous for a
        user who does not steer (nothing read), else from its environment once per :data:`PID_TTL`, within
        ``uid``'s own :data:`READS_PER_USER` reads and at most :data:`_ENV_READ_TIMEOUT` seconds."""
        if pid <= 0 or not self.steering.steers(uid):
            return ANONYMOUS  # (served uncounted: a name would name nothing)
        start = process_start(pid)
        if start is None:
            return ANONYMOUS
        key = (uid, pid, start)
        now = time.monotonic()
        known = self._pids.get(key)
        if known is not None and now - known[1] < PID_TTL:
            return self._seen(self.admit(known[0], uid), pid, start)
        readers = self._readers.get(uid)
        if readers is None:
            readers = self._readers[uid] = trio.CapacityLimiter(READS_PER_USER)
        name, invalid = ANONYMOUS, None
        with trio.move_on_after(_ENV_READ_TIMEOUT) as waited:
            # (left behind on timeout: the thread keeps its slot of this user's until the read returns)
            name, invalid = await in_thread(consumer_name, pid, limiter=readers, abandon_on_cancel=True)
        if waited.cancelled_caught:
            self._warnings.warn(uid, "the environment of process %d was not read within %g s (its memory map is "
                                "held: a hung mount?); it reads as the anonymous consumer", pid, _ENV_READ_TIMEOUT)
        elif invalid is not None:
            self._warnings.warn(uid, "process %d: %s=%r is not a consumer name (letters, digits, _.:@+=- up to 64 "
                                "characters); it reads as the anonymous consumer", pid, CONSUMER_ENV, invalid[:80])
        if len(self._pids) >= _PIDS_KEPT:
            self._pids = {k: v for k, v in self._pids.items() if now - v[1] < PID_TTL}
            if len(self._pids) >= _PIDS_KEPT:  # (all fresh: the older half goes, they are read again if asked)
                self._pids = dict(list(self._pids.items())[len(self._pids) // 2:])
        self._pids[key] = (name, now)
        return self._seen(self.admit(name, uid), pid, start)

    def _seen(self, name: str, pid: int, start: int) -> str:
        """``name``, whose process ``pid`` (started at ``start``) just asked: kept among its processes, the most
        recently seen :data:`PROCESSES_KEPT` (when full, the dead go first, looked for at most once a second;
        then the one seen longest ago).  Not for the anonymous consumer: it never holds anyone."""
        c = self._table.get(name)
        if c is None or name == ANONYMOUS:
            return name
        procs, key = c.processes, (pid, start)
        if key in procs:
            del procs[key]  # (put back at the end: the most recently seen)
        elif len(procs) >= PROCESSES_KEPT:
            now = time.monotonic()
            if now - c.swept_at >= 1.0:
                c.swept_at = now
                for k in [k for k in procs if not process_alive(*k)]:
                    del procs[k]
            if len(procs) >= PROCESSES_KEPT:
                del procs[next(iter(procs))]
        procs[key] = None
        return name

    def admit(self, name: str, uid: int) -> str:
        """``name`` if it is in the table or joins it now as ``uid``'s; past ``uid``'s or the table's cap (when
        no consumer that is not live can be forgotten for it): :data:`ANONYMOUS`, logged (module docstring)."""
        if name == ANONYMOUS or name in self._table:
            return name
        mine = [c for c in self._table.values() if c.uid == uid]
        if len(mine) >= MAX_CONSUMERS_PER_USER and not self._forget_one(mine):
            self._warnings.warn(uid, "%d consumers named already (the most one user may have); %s reads as the "
                                "anonymous consumer until one of them is dropped or forgotten", len(mine), name)
            return ANONYMOUS
        if len(self._table) >= MAX_CONSUMERS and not self._forget_one(list(self._table.values())):
            self._warnings.warn(uid, "the table holds %d consumers, all live; %s reads as the anonymous consumer "
                                "until one is dropped", len(self._table), name)
            return ANONYMOUS
        self.get(name).uid = uid
        return name

    def _forget_one(self, among: list[Consumer]) -> bool:
        """Forget the consumer of ``among`` seen longest ago that is neither live nor waiting; False: none."""
        idle = [c for c in among if c.state != LIVE and c.waiting_since is None and c.name != ANONYMOUS]
        if not idle:
            return False
        del self._table[min(idle, key=lambda x: x.last_seen).name]
        return True

    def get(self, name: str) -> Consumer:
        """The consumer ``name`` (made now if new; the table keeps :data:`MAX_CONSUMERS`)."""
        c = self._table.get(name)
        if c is None:
            if len(self._table) >= MAX_CONSUMERS:
                self._forget_one(list(self._table.values()))
            seed = self.schedule.settings.seed
            if name != ANONYMOUS:  # (the anonymous consumer's order is the mount's own: as before consumers)
                seed += (zlib.crc32(name.encode()) + 1) << 32
            c = self._table[name] = Consumer(name, seed, self.schedule.tree.n_slots, self.schedule.view_files())
            c.passes = self.schedule.pos.pass_index
        c.last_seen = time.time()
        return c

    # =========================================================================================== passes

    def live(self) -> list[Consumer]:
        return [c for c in self._table.values() if c.state == LIVE]

    def behind(self, pass_index: int) -> list[Consumer]:
        """The live consumers that hold the mount at pass ``pass_index``: not past it yet."""
        return [c for c in self._table.values() if c.state == LIVE and c.passes <= pass_index]

    def kept_out(self, c: Consumer) -> bool:
        """``c`` is the anonymous consumer and a named one is live and not gone: its opens join nothing (module
        docstring).  (Named jobs that are all gone let it join: its wait, once ahead, drops them at once.)"""
        return c.name == ANONYMOUS and c.state == NEW and any(
            x.name != ANONYMOUS and self.gone(x, within=ALIVE_EVERY) is None for x in self.live())

    def gone(self, c: Consumer, *, within: float = 0.0) -> str | None:
        """Why ``c`` is gone -- none of its processes is alive: it exited or was killed -- or None: one is, or
        none is known (a consumer made by the engine itself, the anonymous one).  ``within``: the verdict of a
        look at most that many seconds old will do (a bound on the ``/proc`` reads of a caller that asks often).
        Most recently seen first; the dead seen before a live one are forgotten."""
        now = time.monotonic()
        if not c.processes:
            return None
        if now - c.looked_at < within:
            return c.gone_why
        c.looked_at, c.gone_why = now, None
        dead: list[tuple[int, int]] = []
        for key in reversed(list(c.processes)):
            if process_alive(*key):
                for k in dead:
                    del c.processes[k]
                return None
            dead.append(key)
        pids = sorted({pid for pid, _ in dead})
        shown = ", ".join(map(str, pids[:8])) + (f" and {len(pids) - 8} more" if len(pids) > 8 else "")
        c.gone_why = (f"none of its processes is alive (it exited or was killed: pid{'s' if len(pids) > 1 else ''} "
                      f"{shown}, last seen {time.time() - c.last_seen:.0f} s ago)")
        return c.gone_why

    def min_passes(self) -> int | None:
        """The fewest passes a live consumer made in this mini-epoch (None: no consumer is live)."""
        return min((c.passes for c in self._table.values() if c.state == LIVE), default=None)

    def view_of(self, name: str) -> View | None:
        """The view as consumer ``name`` lists it now: the same files, in its own order for its pass."""
        sch = self.schedule
        c = self._table.get(name)
        if sch.view is None or (c is None and name == ANONYMOUS):
            return sch.view
        c = c or self.get(name)
        # (one that is not live yet joins at the mount's pass: its count may be a pass the mount has left)
        passes = sch.pos.pass_index if c.state == NEW else c.passes
        if c.seed == sch.settings.seed and passes == sch.pos.pass_index:
            return sch.view  # (the anonymous consumer in step with the mount: the very same view, made ahead)
        if c.view is None or c.view.pass_index != passes:
            c.view = sch.view_for(seed=c.seed, pass_index=passes)
        return c.view

    def opened(self, c: Consumer, fidx: int, in_view: bool) -> bool:
        """Consumer ``c`` opened file ``fidx``; True when that was the last view file of its pass (it ends)."""
        c.opens += 1
        if in_view and c.state == NEW and not self.kept_out(c):
            self._join(c)
        now = time.monotonic()
        if c.pass_started is None:
            c.pass_started = now
        c.reads_in_pass += 1
        if c.marks is None:
            c.marks = np.zeros(c.n_files, bool)
        if in_view and not c.marks[fidx]:
            c.marks[fidx] = True
            c.unread -= 1
            return c.unread <= 0 and c.state == LIVE
        return False

    def file_gone(self, fidx: int) -> list[Consumer]:
        """View file ``fidx`` was found gone: each live consumer that had not opened it in its pass counts it as
        read (it cannot be opened); the consumers whose pass that ends."""
        done = []
        for c in self.live():
            if c.marks is None:
                c.marks = np.zeros(c.n_files, bool)
            if not c.marks[fidx]:
                c.marks[fidx] = True
                c.unread -= 1
                if c.unread <= 0:
                    done.append(c)
        return done

    def _join(self, c: Consumer) -> None:
        """``c`` takes part from now on, at the mount's current pass."""
        sch = self.schedule
        c.state = LIVE
        c.passes = sch.pos.pass_index
        c.new_pass(sch.view_files())
        log.info("consumer %s joined at epoch %d, mini-epoch %d, pass %d", c.name, sch.pos.epoch,
                 sch.pos.mini_epoch, c.passes)
        anonymous = self._table.get(ANONYMOUS)
        if c.name != ANONYMOUS and anonymous is not None and anonymous.state == LIVE:
            # (``c`` joins at the mount's pass, so the fewest passes stay the mount's: setting it aside moves nothing)
            anonymous.state = NEW
            anonymous.advance_vote = False
            anonymous.new_pass(sch.view_files())
            log.info("the readers that name no consumer no longer count passes while %s (a named job) reads: "
                     "they hold no named job (a job to keep in step names itself: %s=NAME)", c.name, CONSUMER_ENV)

    def pass_over(self, c: Consumer) -> None:
        """``c``'s pass ended (all read, listed again, ``next-pass``)."""
        now = time.monotonic()
        if c.pass_started is not None and now > c.pass_started:
            c.rate = c.reads_in_pass / (now - c.pass_started)
        c.passes += 1
        c.passes_total += 1
        c.new_pass(self.schedule.view_files())

    def share_done(self, c: Consumer, share: RankShare) -> bool:
        """Rank ``share.rank`` of ``c``'s ``share.world`` ranks finished its share of the mount's pass
        ``share.passes_total``: True once all of them said so about the pass that runs (a report about a pass
        that is over, or of another count of ranks than the reports before it about this pass, starts afresh)."""
        if share.passes_total != self.schedule.pos.passes_total:
            return False
        if c.shares_of != (share.passes_total, share.world):
            c.shares_of, c.shares_done = (share.passes_total, share.world), set()
        c.shares_done.add(share.rank)
        return len(c.shares_done) == share.world

    def mount_pass_over(self) -> None:
        """The mount's pass ended: a live consumer behind it (the pass was ended for everyone: ``next-pass``
        from someone who is not a consumer, engine calls) starts a new pass at the mount's count."""
        sch = self.schedule
        for c in self._table.values():
            if c.state == LIVE and c.passes < sch.pos.pass_index:
                c.passes = sch.pos.pass_index
                c.new_pass(sch.view_files())

    def mini_epoch_over(self) -> None:
        """A new mini-epoch: every consumer starts its first pass over it."""
        files = self.schedule.view_files()
        for c in self._table.values():
            c.passes = 0
            c.advance_vote = False
            c.new_pass(files)

    def drop(self, c: Consumer, why: str) -> None:
        c.state = DROPPED
        c.drops += 1
        self.drops += 1
        c.advance_vote = False
        log.warning("consumer %s dropped, the mount goes on without it: %s; it rejoins with its next listing of the "
                    "root", c.name, why)

    def waits(self, c: Consumer, waiting: bool) -> None:
        """``c``, ahead of the mount, waits for its turn (the pass rule's ``begin_pass``), or no longer does."""
        c.waiting_since = time.monotonic() if waiting else None

    def rejoin(self, c: Consumer) -> None:
        """A dropped consumer starts a pass again (lists the root, opens ``order``): it becomes live at its first
        open of a view file."""
        if c.state == DROPPED:
            c.state = NEW
            c.passes = self.schedule.pos.pass_index
            c.new_pass(self.schedule.view_files())

    def vote_advance(self, c: Consumer) -> bool:
        """``c``'s ARF says advance; True when every live consumer's does (or ``c`` is not live and no one is)."""
        if c.state == LIVE:
            c.advance_vote = True
        live = self.live()
        return all(x.advance_vote for x in live) if live else True

    def statistics(self, timeout: float) -> ConsumersStatistics:
        now = time.monotonic()
        cs = tuple(c.statistics(now) for c in sorted(self._table.values(), key=lambda x: x.name))
        return ConsumersStatistics(timeout, sum(c.state == LIVE for c in cs), self.drops, cs)

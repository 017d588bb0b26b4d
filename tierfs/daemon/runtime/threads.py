"""The daemon's worker threads: blocking work handed off the trio thread, never ahead of it.

Everything the daemon does that may block -- staging copies, page-cache pushes, backing stats, unlinks, the
journal -- runs through :func:`in_thread`: trio's own thread cache (``trio.to_thread.run_sync``, with its limiters
and cancellation), each thread put under ``SCHED_BATCH`` (``SCHED_IDLE`` on a CPU of the daemon's own, below)
before its first job.  A batch thread that wakes does not
preempt the thread running on its CPU (the kernel leaves it to the next tick or the next wait); it gets the same
share of the CPU as before, only not at the wake-up.  What that changes: handing a job to a thread wakes that
thread, and where it wakes on the trio thread's CPU -- a daemon with a CPU of its own, or a busy node -- a
normal thread would take the CPU from the trio thread then and there, in the middle of answering requests, for
as long as its copy or push runs.  Measured on the 2-CPU dev box, the daemon on a CPU of its own under a
``substitute`` reader: 38 % of the trio thread's samples outside its wait for requests were at that hand-off, none
under ``SCHED_BATCH`` (docs/dev/benchmarks-history.md, "Worker threads behind the trio thread").  The trio
thread itself stays a normal thread: it answers every request.

**A CPU of its own: ``SCHED_IDLE``.**  Where the daemon was given one CPU inside a larger cpuset (``taskset
-c 0``, systemd's ``CPUAffinity=0``: operations.md, "A core for the daemon"), its worker threads share that CPU
with the trio thread alone, and ``SCHED_BATCH`` still gives each of them the trio thread's share of it: at a
mini-epoch's burst of copies and pushes a dozen of them are runnable at once, and the trio thread, woken by a
request, waited its turn behind them 4-8 ms at a time (``perf sched`` on the dev box; every open of the burst
waited with it).  Under ``SCHED_IDLE`` they run whenever the trio thread waits and never while it has work.
Anywhere else they stay ``SCHED_BATCH``: on a CPU shared with the loader (a one-CPU container, or the loader
and the daemon pinned together) ``SCHED_IDLE`` would give the copies next to nothing beside its busy workers
-- measured, the staging fell behind and 5 % of the opens became misses (docs/dev/benchmarks-history.md,
"The trio thread behind its own copies").  Which one (:func:`worker_policy`) is decided by each thread at its
first job.

Changing to either needs no privilege (and it can be changed back); where it is refused (a seccomp filter, a
platform without it) the thread stays as it was and the job runs all the same.

**Kept, not made again** (:func:`keep_idle_threads`).  trio lets a worker thread go after 10 s without a job,
and making one blocks the thread that asks for it until the new thread has run (``Thread.start`` waits for it):
on the trio thread, behind the daemon's busy threads on its CPU, that held it 4-31 ms at a time, the requests of
every reader waiting meanwhile -- at each mini-epoch's burst of copies, which comes every few seconds to
minutes, so the threads the last burst used had gone.  The daemon keeps idle threads for ``IDLE_THREAD_S``
(docs/dev/benchmarks-history.md, "The open()'s own request").
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import trio

from tierfs.common.protocol import parse_indices

__all__ = ["IDLE_THREAD_S", "cpuset_cpus", "in_thread", "keep_idle_threads", "worker_policy"]

T = TypeVar("T")

#: how long the daemon keeps a worker thread without a job (trio's own default: 10 s)
IDLE_THREAD_S = 600.0

_local = threading.local()


def keep_idle_threads(seconds: float) -> bool:
    """Keep trio's idle worker threads ``seconds`` before they end (every thread of the process; see the module
    docstring).  trio has no public setting for it: False (and nothing changed) where its thread cache lacks the
    one it reads (the unit test says so when a trio changes it)."""
    try:
        from trio._core import _thread_cache
    except ImportError:  # (a trio that moved it)
        return False
    if not isinstance(getattr(_thread_cache, "IDLE_TIMEOUT", None), (int, float)):
        return False
    # (trio's own value is the int 10, so its type information says int; the cache waits on any number)
    _thread_cache.IDLE_TIMEOUT = seconds  # type: ignore[assignment]
    return True


def cpuset_cpus(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> set[int] | None:
    """The CPUs this process's cgroup lets it use (cgroup v2's ``cpuset.cpus.effective``, from its own cgroup up
    to the root; v1's cpuset hierarchy), whatever its own affinity; None where that cannot be read."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if "cpuset" in controllers.split(","):  # (v1)
            candidates = [os.path.join(root, "cpuset", *[p for p in path.split("/") if p], "cpuset.effective_cpus")]
        elif controllers == "":  # (v2: the nearest cgroup that has the controller)
            parts = [p for p in path.split("/") if p]
            candidates = [os.path.join(root, *parts[:i], "cpuset.cpus.effective") for i in range(len(parts), -1, -1)]
        else:
            continue
        for name in candidates:
            try:
                with open(name) as f:
                    return set(parse_indices(f.read().strip()))  # (the kernel's CPU lists: "0-3,8")
            except (OSError, ValueError):
                continue
    return None


def worker_policy() -> int:
    """The calling thread's worker policy: ``SCHED_IDLE`` where it may run on one CPU only while its cgroup
    allows more (a CPU given to the daemon), else ``SCHED_BATCH`` (see the module docstring)."""
    if len(os.sched_getaffinity(0)) == 1 and len(cpuset_cpus() or ()) > 1:
        return os.SCHED_IDLE
    return os.SCHED_BATCH


def _demote_once() -> None:
    """Put the calling thread under its :func:`worker_policy` (once per thread)."""
    if getattr(_local, "tried", False):
        return
    _local.tried = True
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, worker_policy(), os.sched_param(0))  # (pid 0: the calling thread)


def _run(fn: Callable[..., T], args: tuple[object, ...]) -> T:
    _demote_once()
    return fn(*args)


async def in_thread(fn: Callable[..., T], *args: object, limiter: trio.CapacityLimiter | None = None,
                    abandon_on_cancel: bool = False) -> T:
    """``fn(*args)`` in a worker thread (``trio.to_thread.run_sync``'s ``limiter`` and ``abandon_on_cancel``)."""
    return await trio.to_thread.run_sync(_run, fn, args, limiter=limiter, abandon_on_cancel=abandon_on_cancel,
                                         thread_name=getattr(fn, "__name__", "tierfs job"))

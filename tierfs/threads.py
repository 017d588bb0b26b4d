"""The daemon's worker threads: blocking work handed off the trio thread, never ahead of it.

Everything the daemon does that may block -- staging copies, page-cache pushes, backing stats, unlinks, the
journal -- runs through :func:`in_thread`: trio's own thread cache (``trio.to_thread.run_sync``, with its limiters
and cancellation), each thread put under ``SCHED_BATCH`` before its first job.  A batch thread that wakes does not
preempt the thread running on its CPU (the kernel leaves it to the next tick or the next wait); it gets the same
share of the CPU as before, only not at the wake-up.  What that changes: handing a job to a thread wakes that
thread, and where it wakes on the trio thread's CPU -- a daemon with a CPU of its own, or a busy node -- a
normal thread would take the CPU from the trio thread then and there, in the middle of answering requests, for
as long as its copy or push runs.  Measured on the 2-CPU dev box, the daemon on a CPU of its own under a
``substitute`` reader: 38 % of the trio thread's samples outside its wait for requests were at that hand-off, none
under ``SCHED_BATCH`` (docs/dev/benchmarks-history.md, "Worker threads behind the trio thread").  The trio
thread itself stays a normal thread: it answers every request.

Changing to ``SCHED_BATCH`` needs no privilege (and it can be changed back); where it is refused (a seccomp
filter, a platform without it) the thread stays as it was and the job runs all the same.

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

__all__ = ["IDLE_THREAD_S", "in_thread", "keep_idle_threads"]

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
    _thread_cache.IDLE_TIMEOUT = seconds
    return True


def _batch_once() -> None:
    """Put the calling thread under ``SCHED_BATCH`` (once per thread)."""
    if getattr(_local, "tried", False):
        return
    _local.tried = True
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # (pid 0: the calling thread)


def _run(fn: Callable[..., T], args: tuple[object, ...]) -> T:
    _batch_once()
    return fn(*args)


async def in_thread(fn: Callable[..., T], *args: object, limiter: trio.CapacityLimiter | None = None,
                    abandon_on_cancel: bool = False) -> T:
    """``fn(*args)`` in a worker thread (``trio.to_thread.run_sync``'s ``limiter`` and ``abandon_on_cancel``)."""
    return await trio.to_thread.run_sync(_run, fn, args, limiter=limiter, abandon_on_cancel=abandon_on_cancel,
                                         thread_name=getattr(fn, "__name__", "tierfs job"))

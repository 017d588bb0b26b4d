"""``tierfs.threads.in_thread``: trio's worker threads, each under ``SCHED_BATCH`` from its first job on."""

from __future__ import annotations

import os
import threading

import pytest
import trio

from tierfs.threads import in_thread


def _policy_and_thread() -> tuple[int, int]:
    return os.sched_getscheduler(0), threading.get_native_id()


def test_a_job_runs_in_a_batch_thread_with_its_arguments_and_its_result_while_the_caller_stays_normal():
    async def main() -> None:
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
        policy, tid = await in_thread(_policy_and_thread)
        assert policy == os.SCHED_BATCH and tid != threading.get_native_id()
        assert await in_thread(divmod, 17, 5) == (3, 2)
        limiter = trio.CapacityLimiter(1)
        assert (await in_thread(_policy_and_thread, limiter=limiter))[0] == os.SCHED_BATCH
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # (the caller's own thread is left as it was)

    trio.run(main)


def test_a_jobs_exception_reaches_the_caller():
    async def main() -> None:
        with pytest.raises(FileNotFoundError):
            await in_thread(os.stat, "/nonexistent/tierfs-threads-test")

    trio.run(main)


def test_idle_threads_are_kept_as_long_as_asked_then_let_go():
    """``keep_idle_threads`` reaches trio's thread cache: a thread idle for less than the time asked is used
    again, one idle for longer has ended (a new thread takes the next job)."""
    from trio._core import _thread_cache

    from tierfs.threads import keep_idle_threads

    before = _thread_cache.IDLE_TIMEOUT

    async def two_jobs(gap: float) -> tuple[int, int]:
        first = (await in_thread(_policy_and_thread))[1]
        await trio.sleep(gap)
        return first, (await in_thread(_policy_and_thread))[1]

    try:
        assert keep_idle_threads(0.1)
        first, second = trio.run(two_jobs, 0.6)
        assert first != second  # (the first thread let go after 0.1 s)
        assert keep_idle_threads(30.0)
        first, second = trio.run(two_jobs, 0.6)
        assert first == second
    finally:
        keep_idle_threads(before)

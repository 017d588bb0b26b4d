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

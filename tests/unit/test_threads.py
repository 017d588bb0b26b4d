"""``tierfs.daemon.runtime.threads.in_thread``: trio's worker threads, each under ``SCHED_BATCH`` from its first job on
(under ``SCHED_IDLE`` where the process runs on one CPU of a larger cpuset)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import trio

from tierfs.daemon.runtime.threads import cpuset_cpus, in_thread


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

    from tierfs.daemon.runtime.threads import keep_idle_threads

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


def test_the_cpuset_is_read_from_cgroup_v1_or_from_the_nearest_v2_cgroup_that_has_it(tmp_path: Path):
    proc = tmp_path / "cgroup"
    root = tmp_path / "fs"
    # v1 (a hybrid box: the v1 cpuset line comes first and wins)
    proc.write_text("4:memory:/job\n3:cpuset:/job/step\n0::/job\n")
    (root / "cpuset/job/step").mkdir(parents=True)
    (root / "cpuset/job/step/cpuset.effective_cpus").write_text("0-3,8\n")
    assert cpuset_cpus(str(proc), str(root)) == {0, 1, 2, 3, 8}
    # v2: the process's own cgroup has no cpuset controller, its parent's answer holds
    proc.write_text("0::/system.slice/tierfs@data.service\n")
    (root / "system.slice/tierfs@data.service").mkdir(parents=True)
    assert cpuset_cpus(str(proc), str(root)) is None  # (nothing anywhere up to the root)
    (root / "system.slice/cpuset.cpus.effective").write_text("2,5-6\n")
    assert cpuset_cpus(str(proc), str(root)) == {2, 5, 6}
    (root / "system.slice/tierfs@data.service/cpuset.cpus.effective").write_text("5\n")
    assert cpuset_cpus(str(proc), str(root)) == {5}
    assert cpuset_cpus(str(tmp_path / "missing"), str(root)) is None
    proc.write_text("garbage\n0::/system.slice/tierfs@data.service\n")  # (a line it cannot read is passed over)
    assert cpuset_cpus(str(proc), str(root)) == {5}


_POLICY_IN_A_PINNED_PROCESS = """
import os, sys, trio
from tierfs.daemon.runtime.threads import in_thread
os.sched_setaffinity(0, {int(sys.argv[1])})
print(trio.run(in_thread, os.sched_getscheduler, 0), os.sched_getscheduler(0))
"""


def test_on_one_cpu_of_a_larger_cpuset_the_worker_threads_run_under_sched_idle_and_the_caller_stays_normal():
    """A daemon given a CPU of its own: its threads take that CPU only when the trio thread waits.  (A process
    of its own: the thread cache of this one keeps threads that already chose.)"""
    allowed = cpuset_cpus()
    if allowed is None or len(allowed) < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip(f"needs a cpuset of 2 CPUs or more (here {allowed}, affinity {os.sched_getaffinity(0)})")
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", _POLICY_IN_A_PINNED_PROCESS, str(cpu)], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    assert [int(x) for x in out] == [os.SCHED_IDLE, os.SCHED_OTHER]

"""The daemon's worker threads run behind its trio thread (``tierfs.daemon.runtime.threads``): every thread that did
blocking work for the mount -- staging copies, page-cache pushes, backing stats -- is under ``SCHED_BATCH``, which never
preempts at a wake-up, or, where the daemon runs on one CPU of a larger cpuset, under ``SCHED_IDLE``, which
takes that CPU only while the trio thread waits; the trio thread, which answers every request, stays a normal
thread."""

from __future__ import annotations

import os

import pytest

from tierfs.daemon.runtime.threads import cpuset_cpus
from tierfs.testing.harness import wait_until, within

DEADLINE = 60.0


def _policies(pid: int) -> dict[int, tuple[str, int]]:
    """The daemon's threads: {tid: (name, scheduling policy)}."""
    out = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[tid] = (f.read().strip(), os.sched_getscheduler(tid))
        except (FileNotFoundError, ProcessLookupError):
            continue  # (a worker that timed out and ended meanwhile)
    return out


def _listed(mnt: str) -> list[str]:
    """The view, as the mount lists it (relative paths)."""
    return sorted(os.path.relpath(os.path.join(d, n), mnt) for d, dirs, names in os.walk(mnt)
                  for n in names if ".tierfs" not in d)


def _read_both_mini_epochs_then_check_the_threads(m, backing, files, policy: int) -> None:
    """Read every file of both mini-epochs (the second one's copies are made while the first is read), then
    every worker thread of the daemon is under ``policy`` and the trio thread a normal one."""
    want = {rel: (backing / rel).read_bytes() for rel in files}

    def read_all() -> list[str]:
        bad = []
        for _ in range(2):
            for rel in _listed(m.mountpoint):
                with open(os.path.join(m.mountpoint, rel), "rb") as f:
                    if f.read() != want[rel]:
                        bad.append(rel)
        return bad

    assert within(m.mountpoint, read_all, DEADLINE) == []
    pid = m.process.pid
    assert m.status()["staging"]["files_staged"] > 0  # (copies were made: in worker threads)

    def settled() -> bool:
        threads = _policies(pid)
        # (trio names its threads; a thread still named as the process is a library's: numpy's BLAS pool)
        workers = {tid: p for tid, (name, p) in threads.items() if name != threads[pid][0]}
        return bool(workers) and all(p == policy for p in workers.values())

    wait_until(settled, 10, f"every worker thread under policy {policy}: {_policies(pid)}")
    assert _policies(pid)[pid][1] == os.SCHED_OTHER  # the trio thread: requests first


def test_threads_that_did_the_mounts_blocking_work_never_preempt_the_trio_thread(dataset, tierfs_mount):
    backing, files = dataset
    with tierfs_mount(capacity="1M", nm=2, rf=1) as m:
        _read_both_mini_epochs_then_check_the_threads(m, backing, files, os.SCHED_BATCH)


def test_a_daemon_on_a_cpu_of_its_own_runs_its_worker_threads_only_while_the_trio_thread_waits(dataset,
                                                                                               tierfs_mount):
    """``taskset -c N`` (systemd's ``CPUAffinity=N``) inside a larger cpuset: the worker threads are
    ``SCHED_IDLE``, the bytes as ever."""
    allowed = cpuset_cpus()
    if allowed is None or len(allowed) < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip(f"needs a cpuset of 2 CPUs or more (here {allowed}, affinity {os.sched_getaffinity(0)})")
    backing, files = dataset
    cpu = min(os.sched_getaffinity(0))
    with tierfs_mount(capacity="1M", nm=2, rf=1, wrapper=("taskset", "-c", str(cpu))) as m:
        assert os.sched_getaffinity(m.process.pid) == {cpu}
        _read_both_mini_epochs_then_check_the_threads(m, backing, files, os.SCHED_IDLE)

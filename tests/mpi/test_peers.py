"""Peers over real mounts (issue 27): ``mpiexec -n 4 tierfs mount ... --peers mpi``, four mounts and four
cache dirs on this machine over one backing dir, the caps together holding the data set but singly its quarter
plus two mini-epochs.  Every read has a deadline (``within``: a hang aborts that mount's connection); the
cleanup stops the job and aborts and unmounts every mount left."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from dslide.mpirun import MpiJob, parent
from tierfs.testing.harness import end_mount_job, is_mounted, make_dataset, within

N, NM, FILES, SIZE = 4, 4, 64, 16 << 10  # 16 KiB files: whole blocks, so the caps below are exact


@pytest.fixture
def group(tmp_path):
    """Start the job; yields (backing, mountpoints, job, capacity) once the four mounts answer."""
    backing = tmp_path / "backing"
    make_dataset(backing, dirs=4, files_per_dir=FILES // 4, min_size=SIZE, max_size=SIZE, seed=11)
    # owned: a quarter of the data set; working set: the current and the next mini-epoch's share; a little more
    capacity = FILES * SIZE // N + 2 * FILES * SIZE // (N * NM) + 2 * SIZE
    mnts = [tmp_path / f"mnt{r}" for r in range(N)]
    rank_argv = {}
    for r, m in enumerate(mnts):
        m.mkdir()
        rank_argv[r] = ["-m", "tierfs", "mount", str(backing), str(m), "--cache", str(tmp_path / f"cache{r}"),
                        "--capacity", str(capacity), "--nm", str(NM), "--rf", "50", "--seed", "3",
                        "--peers", "mpi", "--peer-addr", "127.0.0.1", "--peer-timeout", "2"]
    job = MpiJob(N, [], rank_argv=rank_argv, launcher_args=["-disable-auto-cleanup"])
    try:
        deadline = time.monotonic() + 180
        while not all(is_mounted(m) and (m / ".tierfs" / "status").exists() for m in mnts):
            job.track()
            assert job.proc.poll() is None, f"the job ended: {job.wait(1).stderr[-3000:]}"
            assert time.monotonic() < deadline, "the four mounts did not answer within 180 s"
            time.sleep(0.1)
        job.track()
        yield backing, mnts, job, capacity
    finally:
        end_mount_job(job, mnts)


def _status(m: Path) -> dict:
    return json.loads(within(str(m), (m / ".tierfs" / "status").read_bytes, 30))


def _at(m: Path, want: tuple[int, int], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = _status(m)
        if (st["epoch"], st["mini_epoch"]) == want:
            return st
        assert time.monotonic() < deadline, f"{m} did not reach {want}: {st['epoch'], st['mini_epoch']}"
        time.sleep(0.05)


def _read_view(m: Path, backing: Path) -> None:
    """Read every file of ``m``'s view, each within a deadline, and compare it with the backing's bytes."""
    names = [p.decode() for p in within(str(m), (m / ".tierfs" / "order0").read_bytes, 30).split(b"\0")[:-1]]
    assert names
    for name in names:
        assert within(str(m), (m / name).read_bytes, 30) == (backing / name).read_bytes(), name


def _mini_epoch(mnts: list[Path], backing: Path, at: tuple[int, int]) -> None:
    """Every mount reads its share of mini-epoch ``at``, then moves on once its next one is staged."""
    for m in mnts:
        _at(m, at)
        _read_view(m, backing)
    for m in mnts:
        (m / ".tierfs" / "control").write_text("advance\n")


def _processes_of_rank(job: MpiJob, rank: int) -> list[int]:
    """Every process of ``rank``: the one the launcher started and the daemon it forked."""
    pids = job.processes_of_rank(rank)
    assert len(pids) == 2, pids
    return pids


def _disk(cache: Path) -> int:
    """The cache's data on disk (a copy being staged is renamed, or dropped, between the listing and its stat)."""
    total = 0
    for p in (cache / "data").iterdir():
        with contextlib.suppress(FileNotFoundError):
            total += p.stat().st_blocks * 512
    return total


def test_after_the_first_epoch_the_slow_tier_is_read_no_byte(group, tmp_path):
    backing, mnts, _, capacity = group
    for me in range(NM):
        _mini_epoch(mnts, backing, (0, me))
    before = sum(_at(m, (1, 0))["backing_bytes_read"] for m in mnts)
    for epoch in (1, 2, 3):
        for me in range(NM):
            _mini_epoch(mnts, backing, (epoch, me))
    statuses = [_at(m, (4, 0)) for m in mnts]
    assert sum(st["backing_bytes_read"] for st in statuses) == before  # (without peers: the data set, each epoch)
    assert sum(st["peers"]["fetched_bytes"] for st in statuses) >= 3 * FILES * SIZE * (N - 1) // N
    for r, st in enumerate(statuses):
        assert st["peers"]["rank"] == r and st["peers"]["alive"] == N - 1
        assert st["peers"]["owned_cached_files"] == st["peers"]["owned_files"] > 0
        assert _disk(tmp_path / f"cache{r}") <= capacity  # the cap, on disk


def test_a_killed_peer_is_a_miss_and_the_others_finish_from_the_slow_tier(group):
    backing, mnts, job, _ = group
    for me in range(NM):
        _mini_epoch(mnts, backing, (0, me))
    _mini_epoch(mnts, backing, (1, 0))
    before = [_at(m, (1, 1))["backing_bytes_read"] for m in mnts[:3]]
    rank3 = _processes_of_rank(job, 3)
    # mid-epoch: rank 3's daemon (and its rank's process) die -- the rank's process first: killed after the daemon,
    # its child, it would have exited by itself (and been reaped by the launcher) before its own kill
    for pid in sorted(rank3, key=lambda pid: parent(pid) in rank3):
        os.kill(pid, signal.SIGKILL)
    alive = mnts[:3]
    for epoch, me in [(1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]:
        _mini_epoch(alive, backing, (epoch, me))  # correct bytes, every read within its deadline
    statuses = [_at(m, (2, 2)) for m in alive]
    misses = sum(st["peers"]["misses"]["refused"] + st["peers"]["misses"]["down"] for st in statuses)
    assert misses > 0  # what rank 3 owned ...
    assert sum(st["backing_bytes_read"] for st in statuses) > sum(before)  # ... came from the slow tier
    assert all(st["peers"]["alive"] == N - 2 for st in statuses)


def test_a_stalled_peer_costs_the_others_about_one_timeout_per_window(group):
    # rank 3's daemon stops (SIGSTOP: its port still accepts, nothing answers -- a hung node) mid-epoch; the others
    # run two more mini-epochs: what it owned comes from the slow tier, and each waited on it a deadline or two
    # (those asking when it stopped waited together; then one probe per window), not one per file
    backing, mnts, job, _ = group
    for me in range(NM):
        _mini_epoch(mnts, backing, (0, me))
    _mini_epoch(mnts, backing, (1, 0))
    rank3 = _processes_of_rank(job, 3)
    daemon = next(pid for pid in rank3 if parent(pid) in rank3)
    alive = mnts[:3]
    os.kill(daemon, signal.SIGSTOP)
    try:
        for at in [(1, 1), (1, 2)]:
            _mini_epoch(alive, backing, at)  # correct bytes, every read within its deadline
        statuses = [_at(m, (1, 3)) for m in alive]
    finally:
        os.kill(daemon, signal.SIGCONT)  # (before the cleanup stops it)
    timeout = 2  # (--peer-timeout)
    for st in statuses:
        stalled = next(p for p in st["peers"]["peers"] if p["rank"] == 3)
        assert stalled["misses"] > 0 and not stalled["alive"], stalled
        assert stalled["waited_s"] <= 2 * timeout * 2, stalled  # (two mini-epochs)
        assert stalled["connections"] <= stalled["probes"] + 16, stalled

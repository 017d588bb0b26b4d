"""An exception in, or the death of, one rank ends the whole job non-zero within 30 s, never a hang.

The 30-s bound is the deadline of the subprocess, not a timed assertion: a job that hangs is stopped by the
harness and the test fails on ``timed_out``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from dslide.mpirun import MpiJob

PROGRAM = Path(__file__).parent / "programs" / "failure.py"
BOUND = 30.0


def wait_for_pids(piddir: Path, size: int, job: MpiJob, timeout: float = 60) -> dict[int, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job.track()
        files = list(piddir.glob("rank-*.pid"))
        if len(files) == size and all(f.read_text() for f in files):
            return {int(f.stem.split("-")[1]): int(f.read_text()) for f in files}
        assert job.proc.poll() is None, "the job ended before every rank started"
        time.sleep(0.1)
    raise AssertionError("ranks did not start")


def all_gone(pids, grace: float = 10.0) -> bool:
    """Every rank has exited (Hydra may return a moment before the last rank is reaped)."""
    deadline = time.monotonic() + grace
    while not all(gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("mode", ["raise", "hook", "exit", "compute"])
def test_an_exception_on_one_rank_ends_the_job(tmp_path, mode, size):
    with MpiJob(size, [PROGRAM, mode, 1, tmp_path]) as job:
        pids = wait_for_pids(tmp_path, size, job)
        result = job.wait(BOUND)
    assert not result.timed_out, f"job hung after a {mode} failure: {result.stderr[-2000:]}"
    assert result.returncode == (3 if mode == "exit" else 1), result.stderr[-2000:]
    if mode in ("raise", "compute"):
        # one line a user can act on, from the rank that failed
        assert "failure: rank 1: RuntimeError: injected failure" in result.stderr
        assert "Traceback" not in result.stderr
    assert all_gone(pids.values())


@pytest.mark.parametrize("size", [2, 4])
def test_a_killed_rank_ends_the_job(tmp_path, size):
    victim = size - 1
    with MpiJob(size, [PROGRAM, "wait", victim, tmp_path]) as job:
        pids = wait_for_pids(tmp_path, size, job)
        time.sleep(0.5)  # let the job reach its collectives
        os.kill(pids[victim], signal.SIGKILL)
        result = job.wait(BOUND)
    assert not result.timed_out, f"job hung after rank {victim} was killed: {result.stderr[-2000:]}"
    assert result.returncode != 0
    assert all_gone(pids.values())


def test_ranks_die_with_their_process_manager(tmp_path):
    """If Hydra's proxy itself dies, PR_SET_PDEATHSIG ends the orphaned ranks (they would run on otherwise)."""
    with MpiJob(2, [PROGRAM, "wait", 1, tmp_path]) as job:
        pids = wait_for_pids(tmp_path, 2, job)
        proxy = int(Path(f"/proc/{pids[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert proxy != job.proc.pid and proxy in job.seen
        os.kill(proxy, signal.SIGKILL)
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline and not all(gone(pid) for pid in pids.values()):
            time.sleep(0.1)
        survivors = [pid for pid in pids.values() if not gone(pid)]
    assert not survivors, f"ranks {survivors} outlived their proxy"


def test_a_killed_rank_ends_a_real_training_job(tmp_path):
    from dslide.gen import write_dataset

    write_dataset(tmp_path / "xc", 2048, 500, 100, shards=2, test_points=64, seed=1)
    xc = tmp_path / "xc"
    argv = ["-m", "dslide", "train", "--train", xc / "train", "--test", xc / "test.txt", "--epochs", 10_000,
            "--hidden", 16, "--batch", 64, "--budget", 16, "--threads", 1, "--eval-points", 16]  # fmt: skip
    with MpiJob(2, argv) as job:
        deadline = time.monotonic() + 120
        while '"pass": 1,' not in job.stdout_so_far():  # training is under way
            assert job.proc.poll() is None and time.monotonic() < deadline, job.stdout_so_far()
            time.sleep(0.2)
        pids = job.rank_pids()
        assert sorted(pids) == [0, 1]
        os.kill(pids[1], signal.SIGKILL)
        result = job.wait(BOUND)
    assert not result.timed_out, "the job hung after a rank of dslide train was killed"
    assert result.returncode != 0
    assert all_gone(pids.values())

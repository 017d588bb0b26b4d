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


@pytest.fixture(scope="module")
def xc(tmp_path_factory) -> Path:
    from dslide.gen import write_dataset

    out = tmp_path_factory.mktemp("xc")
    write_dataset(out, 2048, 500, 100, shards=2, test_points=64, seed=1)
    return out


def train_argv(xc: Path, *extra: object) -> list[object]:
    return ["-m", "dslide", "train", "--train", xc / "train", "--test", xc / "test.txt", "--epochs", 10_000,
            "--hidden", 16, "--batch", 64, "--budget", 16, "--threads", 1, "--eval-points", 16, *extra]  # fmt: skip


def wait_for_training(job: MpiJob, size: int) -> dict[int, int]:
    """Wait until the job reported its first pass (training is under way); its ranks' pids."""
    deadline = time.monotonic() + 120
    while '"pass": 1,' not in job.stdout_so_far():
        assert job.proc.poll() is None and time.monotonic() < deadline, job.stdout_so_far()
        time.sleep(0.2)
    pids = job.rank_pids()
    assert sorted(pids) == list(range(size))
    return pids


@pytest.mark.parametrize("victim", [0, 2])
def test_a_killed_rank_of_four_ends_a_real_training_job(xc, victim):
    """SIGKILL to one rank of ``mpiexec -n 4 dslide train`` mid-training (rank 0 reads the data and reports):
    the job exits non-zero within 30 s and no rank is left."""
    with MpiJob(4, train_argv(xc)) as job:
        pids = wait_for_training(job, 4)
        os.kill(pids[victim], signal.SIGKILL)
        result = job.wait(BOUND)
    assert not result.timed_out, f"the job hung after rank {victim} of dslide train was killed"
    assert result.returncode != 0
    assert all_gone(pids.values())


def test_an_exception_on_one_rank_of_four_ends_a_real_training_job(xc, tmp_path):
    """Rank 3 alone is given a checkpoint directory that does not exist (as on a node where the shared
    directory is not mounted): its first save raises while the other ranks wait in the save's barrier.  The job
    exits 1 within 30 s with the failing rank's reason on stderr, and no rank is left.  No test hook: an MPMD
    launch gives rank 3 its own arguments."""
    ck, missing = tmp_path / "ck", tmp_path / "not-mounted"
    with MpiJob(4, train_argv(xc, "--checkpoint", ck), rank_argv={3: train_argv(xc, "--checkpoint", missing)}) as job:
        deadline = time.monotonic() + 120
        pids: dict[int, int] = {}
        while job.proc.poll() is None and not (3 in pids and gone(pids[3])):  # the bound counts from its end
            assert time.monotonic() < deadline, "rank 3 never failed"
            pids.update(job.rank_pids())  # a rank that has ended is no longer listed
            time.sleep(0.05)
        result = job.wait(BOUND)
    assert sorted(pids) == [0, 1, 2, 3]
    assert not result.timed_out, f"the job hung after rank 3 failed: {result.stderr[-2000:]}"
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"No such file or directory: '{missing}/ck-s" in result.stderr and "Traceback" not in result.stderr
    assert all_gone(pids.values())
    assert not list(ck.glob("*.json")), "no checkpoint may be committed without rank 3's shard"

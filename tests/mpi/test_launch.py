"""get_comm: MPI only when mpiexec started us with two or more ranks; mpi4py never imported otherwise."""

from __future__ import annotations

import subprocess
import sys

from dslide.mpirun import job_env, run_mpi

PROBE = (
    "import sys; from dslide.mpicomm import get_comm; c = get_comm(); "
    "sys.stdout.write(f\"{type(c).__name__} {c.rank} {c.size} {'mpi4py' in sys.modules}\\n\")"
)


def test_a_plain_process_is_serial_without_importing_mpi4py():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=job_env(), capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert out == ["SerialComm", "0", "1", "False"]


def test_one_rank_under_mpiexec_is_serial_without_importing_mpi4py():
    result = run_mpi(1, ["-c", PROBE], timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["SerialComm", "0", "1", "False"]


def test_four_ranks_get_mpicomm():
    result = run_mpi(4, ["-c", PROBE], timeout=90)
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.strip().splitlines())
    assert lines == [f"MpiComm {r} 4 True" for r in range(4)]


def test_threads_per_rank_share_the_cores():
    import os

    probe = "from dslide.mpicomm import threads_per_rank; print(threads_per_rank())"
    cores = len(os.sched_getaffinity(0))
    result = run_mpi(2, ["-c", probe], timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(max(1, cores // 2))] * 2
    alone = subprocess.run([sys.executable, "-c", probe], env=job_env(), capture_output=True, text=True, timeout=60)
    assert alone.stdout.split() == ["None"]

"""get_comm: MPI only when mpiexec started us with two or more ranks; mpi4py never imported otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

from dslide.mpirun import job_env, run_mpi

# Each process writes what it found into its own file (named by its rank, or "alone" outside a job): the
# ranks' stdout reaches us through mpiexec's forwarding, which may split or merge two ranks' lines ("11" was
# once read in CI for two ranks printing "1"), so a shared stdout cannot be parsed reliably.
WRITE = "open(os.path.join(sys.argv[1], os.environ.get('PMI_RANK', 'alone')), 'w').write"
PROBE = (
    "import os, sys; from dslide.mpicomm import get_comm; c = get_comm(); "
    f"{WRITE}(f\"{{type(c).__name__}} {{c.rank}} {{c.size}} {{'mpi4py' in sys.modules}}\")"
)
THREADS = f"import os, sys; from dslide.mpicomm import threads_per_rank; {WRITE}(str(threads_per_rank()))"


def written(directory) -> dict[str, str]:
    return {p.name: p.read_text() for p in directory.iterdir()}


def test_a_plain_process_is_serial_without_importing_mpi4py(tmp_path):
    subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], env=job_env(), timeout=60, check=True)
    assert written(tmp_path) == {"alone": "SerialComm 0 1 False"}


def test_one_rank_under_mpiexec_is_serial_without_importing_mpi4py(tmp_path):
    result = run_mpi(1, ["-c", PROBE, str(tmp_path)], timeout=60)
    assert result.returncode == 0, result.stderr
    assert written(tmp_path) == {"0": "SerialComm 0 1 False"}


def test_four_ranks_get_mpicomm(tmp_path):
    result = run_mpi(4, ["-c", PROBE, str(tmp_path)], timeout=90)
    assert result.returncode == 0, result.stderr
    assert written(tmp_path) == {str(r): f"MpiComm {r} 4 True" for r in range(4)}


def test_threads_per_rank_share_the_cores(tmp_path):
    cores = len(os.sched_getaffinity(0))
    (tmp_path / "job").mkdir()
    result = run_mpi(2, ["-c", THREADS, str(tmp_path / "job")], timeout=60)
    assert result.returncode == 0, result.stderr
    assert written(tmp_path / "job") == {"0": str(max(1, cores // 2)), "1": str(max(1, cores // 2))}
    subprocess.run([sys.executable, "-c", THREADS, str(tmp_path)], env=job_env(), timeout=60, check=True)
    assert (tmp_path / "alone").read_text() == "None"

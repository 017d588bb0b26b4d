"""Real ``mpiexec`` jobs.  Every job goes through :class:`dslide.mpirun.MpiJob`: a deadline, and no rank left."""

from __future__ import annotations

import os

import pytest

from dslide.mpirun import MPIEXEC


@pytest.hookimpl(tryfirst=True)  # (before pytest-xdist reads the xdist_group marks)
def pytest_collection_modifyitems(items):
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.mpi)
            # one job at a time (under pytest-xdist, on one worker): a job runs 2-4 ranks that poll on 2 cores
            item.add_marker(pytest.mark.xdist_group("mpi"))


@pytest.fixture(scope="session", autouse=True)
def _mpiexec_available():
    if MPIEXEC is None:
        pytest.fail("mpi tests need mpiexec (the project's `mpich` dependency installs one into the venv)")


@pytest.fixture(autouse=True)
def _one_job_at_a_time(request):
    """On a pytest-xdist worker under ``--dist loadgroup`` the group must have reached pytest-xdist, which adds
    ``@mpi`` to the tests' ids: on pytest 9.2 it silently does not (pytest-xdist#1386), and jobs would run side by
    side."""
    if getattr(request.config.option, "loadgroup", False) and not request.node.nodeid.endswith("@mpi"):
        pytest.fail("--dist loadgroup: pytest-xdist did not group this MPI test with the others (pytest-xdist#1386)")

"""Real ``mpiexec`` jobs.  Every job goes through :class:`dslide.mpirun.MpiJob`: a deadline, and no rank left."""

from __future__ import annotations

import os

import pytest

from dslide.mpirun import MPIEXEC


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

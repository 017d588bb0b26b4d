"""Shared fixtures.  Tier-specific fixtures live in each tier's conftest.

The tiers (``tests/<tier>``): ``unit`` (pure logic) and ``engine`` (the engine's operations called directly, no
mount) are the fast tier, what a plain ``pytest`` runs (pyproject.toml: ``testpaths``, less the tests marked
``slow``); ``dslide`` (the trainer trained, without MPI), ``mount`` (real FUSE mounts) and ``mpi`` (real
``mpiexec`` jobs) run with the rest in ``bash scripts/test.sh``, the whole suite (every tier, ``slow`` included,
on several workers: pytest-xdist, ``--dist loadgroup``).

Tests on several workers share the machine.  What two workers could collide on is kept apart: mountpoints, caches
and logs under each test's own tmp dir, ports ephemeral (0), names of namespaces and links with the worker's pid.
What cannot be shared runs apart: ``xdist_group`` runs a group's tests one after the other on one worker (the MPI
jobs, tests/mpi/conftest.py; a module's costly module-scoped fixture), and a test marked ``alone`` runs while no
other test runs (:func:`_alone`: tests that act on the whole machine, such as dropping the kernel's caches).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(autouse=True)
def _alone(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Under pytest-xdist, a test marked ``alone`` runs while no other worker runs a test: every test holds a
    shared lock on a file of the run's base temp dir (the workers' common parent) from its first function-scoped
    fixture to its last teardown, an ``alone`` test the exclusive lock.  A turnstile lock in front keeps new tests
    from starting while an ``alone`` test waits for the running ones to end.  Without xdist: nothing to do."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    base = tmp_path_factory.getbasetemp().parent
    alone = request.node.get_closest_marker("alone") is not None
    with open(base / "tests-alone.turnstile", "a") as turnstile, open(base / "tests-alone.lock", "a") as lock:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.fixture
def benchmark_module():
    """``benchmark_module("loop")``: ``benchmarks/loop.py`` imported as module ``loop`` (in ``sys.modules``:
    dataclasses look their module up)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    return load


@pytest.fixture
def numba_threads() -> Callable[[int], contextlib.AbstractContextManager[None]]:
    """``with numba_threads(n):`` runs numba's parallel kernels on ``n`` threads, and restores the count after
    (also when the body fails)."""
    import numba

    @contextlib.contextmanager
    def use(n: int) -> Iterator[None]:
        before = numba.get_num_threads()
        numba.set_num_threads(n)
        try:
            yield
        finally:
            numba.set_num_threads(before)

    return use

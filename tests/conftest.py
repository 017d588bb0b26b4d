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
other test runs (:class:`_Alone`: tests that act on the whole machine, such as dropping the kernel's caches).
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


#: On pytest-xdist's workers the tests are handed out in this order (after the groups, largest first): the slow
#: ones, then tier by tier, the longest tests first, so that the many short ones fill the end evenly.
_TIERS = ("mpi", "mount", "dslide", "engine", "unit")


def _schedule(item: pytest.Item) -> tuple[bool, int]:
    tier = Path(str(item.fspath)).relative_to(Path(__file__).parent).parts[0]
    return item.get_closest_marker("slow") is None, _TIERS.index(tier) if tier in _TIERS else len(_TIERS)


@pytest.hookimpl(tryfirst=True)  # (before pytest-xdist reads the xdist_group marks)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked ``alone`` in one ``xdist_group`` (but the MPI tier's, grouped as a tier): one after the
    other on one worker, which keeps the others out once for the lot (:class:`_Alone`).  On pytest-xdist's workers,
    the longest tests first (:data:`_TIERS`; a stable sort: a module's tests stay in their order)."""
    mpi = os.path.join(os.path.dirname(__file__), "mpi", "")
    for item in items:
        if item.get_closest_marker("alone") and not str(item.fspath).startswith(mpi):
            item.add_marker(pytest.mark.xdist_group("alone"))
    if "PYTEST_XDIST_WORKER" in os.environ:
        items.sort(key=_schedule)


class _Alone:
    """Under pytest-xdist, a test marked ``alone`` runs while no other worker runs a test: every test holds a shared
    lock on a file of the run's base temp dir (the workers' common parent) for the whole of its run -- its
    fixtures, module- and session-scoped ones included, set up and torn down --, an ``alone`` test the exclusive
    lock.  A turnstile lock in front keeps new tests from starting while an ``alone`` test waits for the running
    ones to end.  A worker keeps the exclusive lock from one ``alone`` test to the next if that is its next test
    (they are one group: the others wait once)."""

    def __init__(self, base: Path) -> None:
        self.turnstile = open(base / "tests-alone.turnstile", "a")  # noqa: SIM115 (the worker's life long)
        self.lock = open(base / "tests-alone.lock", "a")  # noqa: SIM115
        self.held = False  # the exclusive lock, kept for this worker's next test

    def enter(self, alone: bool) -> None:
        if alone and self.held:
            return
        fcntl.flock(self.turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self.lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        except BaseException:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
            raise
        if alone:
            self.held = True
        else:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)

    def leave(self, alone: bool, next_alone: bool) -> None:
        if alone and next_alone:
            return
        fcntl.flock(self.lock, fcntl.LOCK_UN)
        if alone:
            fcntl.flock(self.turnstile, fcntl.LOCK_UN)
            self.held = False


_ALONE = pytest.StashKey[_Alone]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Each test's whole run under :class:`_Alone`'s locks (on pytest-xdist's workers; without them, nothing)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return (yield)
    if _ALONE not in item.config.stash:  # (the worker's basetemp, set by pytest-xdist: BASE/popen-gwN)
        item.config.stash[_ALONE] = _Alone(Path(item.config.option.basetemp).parent)
    locks = item.config.stash[_ALONE]
    alone = item.get_closest_marker("alone") is not None
    locks.enter(alone)
    try:
        return (yield)
    finally:
        locks.leave(alone, nextitem is not None and nextitem.get_closest_marker("alone") is not None)


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

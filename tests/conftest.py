"""Shared fixtures.  Tier-specific fixtures live in each tier's conftest.

The tiers (``tests/<tier>``): ``unit`` (pure logic) and ``engine`` (the engine's operations called directly, no
mount) are the fast tier, what a plain ``pytest`` runs (pyproject.toml: ``testpaths``, less the tests marked
``slow``); ``dslide`` (the trainer trained, without MPI), ``mount`` (real FUSE mounts) and ``mpi`` (real
``mpiexec`` jobs) run with the rest in ``bash scripts/test.sh``, the whole suite (every tier, ``slow`` included,
on several workers: pytest-xdist).
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


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

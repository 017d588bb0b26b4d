"""Fixtures of the unit tests."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest


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

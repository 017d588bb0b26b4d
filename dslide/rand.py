"""Counter-based random numbers for kernels: a pure function of (seed, counters), never a shared state.

HOGWILD threads, MPI ranks and a resumed run all draw the same numbers for the same sample because a draw is
``splitmix64`` of a key built from what the draw is *for* (seed, step, sample, table, ...), not of how many
draws happened before it on some thread.  That is what makes the single-thread mode bit-for-bit
deterministic and resume exact, with no RNG state to checkpoint.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["key2", "key3", "mix64", "next_u64", "seed_key", "uniform_below"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


@njit(inline="always", cache=True)
def mix64(z):
    z = np.uint64(z)
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(inline="always", cache=True)
def key2(a, b):
    return mix64(mix64(np.uint64(a) + _GOLDEN) ^ np.uint64(b))


@njit(inline="always", cache=True)
def key3(a, b, c):
    return key2(key2(a, b), c)


@njit(inline="always", cache=True)
def next_u64(state):
    """Advance a stream: returns (new state, a random 64-bit value)."""
    state = np.uint64(state) + _GOLDEN
    return state, mix64(state)


@njit(inline="always", cache=True)
def uniform_below(r, n):
    """An integer in [0, n) from the random 64-bit ``r`` (n < 2**53)."""
    return np.int64((r >> _S11) % np.uint64(n))


def _mix64_py(z: int) -> int:
    m = 0xFFFFFFFFFFFFFFFF
    z &= m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def seed_key(*parts: int) -> np.uint64:
    """A 64-bit key from Python integers (seed, rank, generation, ...), for passing into kernels; the same
    mixing as :func:`key2`, in plain Python."""
    z = 0x243F6A8885A308D3
    for p in parts:
        z = _mix64_py(_mix64_py(z + 0x9E3779B97F4A7C15) ^ (p & 0xFFFFFFFFFFFFFFFF))
    return np.uint64(z)

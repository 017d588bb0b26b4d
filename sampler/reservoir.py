"""Reservoir sampling over sequential streams: Algorithm R, Algorithm L, OneAccess samples, streaming shuffle.

API
---
``algorithm_r(items, k, rng) -> list``
    Uniform sample of ``k`` items (without replacement) from an iterable of unknown length, one pass.
``algorithm_l(items, k, rng) -> list``
    The same distribution with Li's skip-based Algorithm L: ``O(k (1 + log(n/k)))`` random draws instead of ``n``.
``sample_indices(n, k, rng, *, method="L") -> np.ndarray``
    Reservoir sampling of an array's indices: Algorithm L jumps straight to the ``O(k log(n/k))`` replaced
    positions; ``method="R"`` runs Algorithm R vectorised (n draws, no Python loop).
``epoch_keys(n, *, seed, epoch) -> np.ndarray`` and ``iter_epoch_keys(*, seed, epoch, chunk)``
    The per-epoch uniform key of every stream position (storage order), all at once or in chunks; both give the
    same numbers, so an array planner and a streaming reader agree.
``oneaccess_samples(items, sample_size, *, seed, epoch) -> Iterator[list[tuple[int, object]]]``
    OneAccess mode: successive uniform samples of the stream, disjoint and together covering it (sampling without
    replacement within an epoch).  Yields ``[(position, item), ...]`` in stream order.  ``plan_epoch(...,
    composition="reservoir")`` computes the same samples vectorised.
``streaming_shuffle(items, buffer_size, rng) -> Iterator``
    Bounded-buffer shuffle: every item exactly once, one sequential pass, ``buffer_size`` items of memory.

``rng`` is a ``numpy.random.Generator`` or an int seed.  Bad arguments raise ``ValueError`` naming them.

Read cost per epoch (``n`` items, ``nm`` samples)
-------------------------------------------------
- Algorithm R / L over an iterable: one full sequential read per sample drawn.  On an array or a seekable stream
  Algorithm L only touches the ``O(k log(n/k))`` replaced positions.
- ``oneaccess_samples``: the sample is chosen from keys alone (keys are a function of (seed, epoch, position)), so
  each sample is one sequential sweep over the *positions* not yet taken, and the data of the chosen items is read
  once, in stream order.  If iterating ``items`` itself reads the data, the ``nm`` sweeps read about
  ``(nm + 1) / 2`` times the dataset per epoch; pass a cheap stream (names, offsets) and read the chosen items.
  Either way: sequential access only, every item served exactly once per epoch, each sample uniform.
- ``streaming_shuffle``: exactly one sequential read of the dataset per epoch; the price is weaker randomness
  (an item can only move about ``buffer_size`` places earlier than its stream position).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import numpy as np

__all__ = [
    "algorithm_l",
    "algorithm_r",
    "epoch_keys",
    "iter_epoch_keys",
    "oneaccess_samples",
    "sample_indices",
    "streaming_shuffle",
]

T = TypeVar("T")

_TAG_KEYS = 0x6B657973  # "keys"
_KEY_CHUNK = 1 << 16


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _generator(rng: np.random.Generator | int) -> np.random.Generator:
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool) and rng >= 0:
        return np.random.default_rng(int(rng))
    raise ValueError(f"rng must be a numpy Generator or an integer seed >= 0, got {rng!r}")


# -------------------------------------------------------------------------------------------- classic reservoirs


def algorithm_r(items: Iterable[T], k: int, rng: np.random.Generator | int) -> list[T]:
    """Vitter's Algorithm R: keep the first k, then item i (0-based) replaces a random slot with probability k/(i+1).

    One pass, one random draw per item after the first k.  Fewer than k items: returns them all.
    """
    k = _check_count("k", k, 0)
    gen = _generator(rng)
    reservoir: list[T] = []
    if k == 0:
        return reservoir
    for i, item in enumerate(items):
        if i < k:
            reservoir.append(item)
            continue
        j = int(gen.integers(0, i + 1))
        if j < k:
            reservoir[j] = item
    return reservoir


def _l_skips(k: int, gen: np.random.Generator) -> Iterator[int]:
    """Li's Algorithm L: the gaps between successive replacements, and the W update between them."""
    w = math.exp(math.log(1.0 - gen.random()) / k)
    while True:
        # the number of items skipped before the next replacement is geometric with success probability w
        u = 1.0 - gen.random()
        skip = math.floor(math.log(u) / math.log1p(-w)) if w < 1.0 else 0
        yield skip
        w *= math.exp(math.log(1.0 - gen.random()) / k)


def algorithm_l(items: Iterable[T], k: int, rng: np.random.Generator | int) -> list[T]:
    """Li's Algorithm L: same distribution as Algorithm R with ``O(k (1 + log(n/k)))`` random draws.

    Still reads the iterable to its end (an iterator cannot seek); see ``sample_indices`` for arrays.
    """
    k = _check_count("k", k, 0)
    gen = _generator(rng)
    it = iter(items)
    reservoir = list(itertools.islice(it, k))
    if k == 0 or len(reservoir) < k:
        return reservoir
    for skip in _l_skips(k, gen):
        nxt = next(itertools.islice(it, skip, None), _END)
        if nxt is _END:
            return reservoir
        reservoir[int(gen.integers(0, k))] = nxt  # type: ignore[assignment]
    raise AssertionError("unreachable")  # pragma: no cover


_END = object()


def sample_indices(n: int, k: int, rng: np.random.Generator | int, *, method: str = "L") -> np.ndarray:
    """k distinct uniform indices of ``range(n)`` (sorted): a reservoir sample of an array of length n.

    ``method="L"``: Algorithm L, jumping straight to the ``O(k log(n/k))`` replaced positions.
    ``method="R"``: Algorithm R vectorised: one draw ``j_i`` in ``[0, i]`` per position ``i >= k`` all at once;
    slot ``s`` ends up holding the last position that drew ``s`` (the same outcome as the sequential loop).
    """
    n = _check_count("n", n, 0)
    k = _check_count("k", k, 0)
    if k > n:
        raise ValueError(f"k must be <= n={n}, got {k}")
    if method not in ("L", "R"):
        raise ValueError(f"method must be 'L' or 'R', got {method!r}")
    gen = _generator(rng)
    reservoir = np.arange(k, dtype=np.int64)
    if k == 0:
        return reservoir
    if method == "R":
        positions = np.arange(k, n, dtype=np.int64)
        slots = gen.integers(0, positions + 1)
        hit = slots < k
        np.maximum.at(reservoir, slots[hit], positions[hit])
        return np.sort(reservoir)
    i = k - 1
    for skip in _l_skips(k, gen):
        i += skip + 1
        if i >= n:
            break
        reservoir[int(gen.integers(0, k))] = i
    return np.sort(reservoir)


# -------------------------------------------------------------------------------------------------- OneAccess


def _key_rng(seed: int, epoch: int) -> np.random.Generator:
    seed = _check_count("seed", seed, 0)
    epoch = _check_count("epoch", epoch, 0)
    return np.random.default_rng([seed, epoch, _TAG_KEYS])


def epoch_keys(n: int, *, seed: int, epoch: int) -> np.ndarray:
    """Uniform [0, 1) key of each of the first n stream positions for this (seed, epoch)."""
    n = _check_count("n", n, 0)
    return _key_rng(seed, epoch).random(n)


def iter_epoch_keys(*, seed: int, epoch: int, chunk: int = _KEY_CHUNK) -> Iterator[np.ndarray]:
    """The keys of ``epoch_keys`` as an endless stream of arrays of ``chunk`` keys (same numbers, same order)."""
    chunk = _check_count("chunk", chunk, 1)
    gen = _key_rng(seed, epoch)
    while True:
        yield gen.random(chunk)


def _keyed(items: Iterable[T], seed: int, epoch: int) -> Iterator[tuple[float, int, T]]:
    """(key, position, item) along the stream; keys drawn in growing chunks so short streams stay cheap."""
    gen = _key_rng(seed, epoch)
    block = gen.random(256)
    j = 0
    for t, item in enumerate(items):
        if j == block.shape[0]:
            block = gen.random(min(2 * block.shape[0], _KEY_CHUNK))  # same numbers whatever the chunking
            j = 0
        yield float(block[j]), t, item
        j += 1


def oneaccess_samples(
    items: Iterable[T], sample_size: int | Sequence[int], *, seed: int, epoch: int
) -> Iterator[list[tuple[int, T]]]:
    """Successive uniform samples, without replacement within the epoch, each from one sequential sweep.

    ``items`` must be re-iterable (a list, a range, a sequence of file records) in storage order.  Sample ``j`` is
    the bottom-``m_j`` set by key among the positions not yet taken (a bounded max-heap reservoir), so every
    sample is a uniform random subset of what remains, successive samples are disjoint and together they cover
    the stream.  ``sample_size`` is one count ``m`` (the last sample takes the remainder) or the list of counts
    (their sum must cover the stream).  Yields ``[(position, item), ...]`` sorted by position: read order.
    """
    seed = _check_count("seed", seed, 0)
    epoch = _check_count("epoch", epoch, 0)
    if isinstance(sample_size, (int, np.integer)):  # (a bool: refused there)
        m = _check_count("sample_size", sample_size, 1)
        counts: Iterator[int] = itertools.repeat(m)
        fixed = None
    else:
        fixed = [_check_count("sample_size[]", c, 0) for c in sample_size]
        counts = iter(fixed)
    taken: set[int] = set()
    seen_total: int | None = None
    for count in counts:
        if seen_total is not None and len(taken) >= seen_total:
            if fixed is None:
                return
            if count:
                raise ValueError(f"sample_size lists {sum(fixed)} items but the stream holds {seen_total}")
            yield []  # a listed empty sample stays in the list, as plan_epoch returns empty shares
            continue
        heap: list[tuple[float, int, T]] = []  # max-heap on key via negation: the m smallest keys so far
        seen = 0
        for key, t, item in _keyed(items, seed, epoch):
            seen += 1
            if t in taken or count == 0:
                continue
            if len(heap) < count:
                heapq.heappush(heap, (-key, t, item))
            elif -heap[0][0] > key:
                heapq.heapreplace(heap, (-key, t, item))
        seen_total = seen
        if seen == 0 and fixed is None:
            return
        sample = sorted(((t, item) for _, t, item in heap), key=lambda p: p[0])
        taken.update(t for t, _ in sample)
        yield sample
    if fixed is not None and seen_total is not None and len(taken) < seen_total:
        raise ValueError(f"sample_size lists {sum(fixed)} items but the stream holds {seen_total}")


# ------------------------------------------------------------------------------------------ streaming shuffle


def streaming_shuffle(items: Iterable[T], buffer_size: int, rng: np.random.Generator | int) -> Iterator[T]:
    """Shuffle a stream through a buffer of ``buffer_size`` items: each item exactly once, one sequential pass.

    Fill the buffer, then for every further item emit a uniformly chosen buffered item and put the new one in
    its slot; at the end emit the rest in random order.  ``buffer_size >= n`` gives a uniform permutation.
    """
    buffer_size = _check_count("buffer_size", buffer_size, 1)
    gen = _generator(rng)
    it = iter(items)
    buf = list(itertools.islice(it, buffer_size))
    for item in it:
        j = int(gen.integers(0, len(buf)))
        yield buf[j]
        buf[j] = item
    for j in gen.permutation(len(buf)):
        yield buf[int(j)]

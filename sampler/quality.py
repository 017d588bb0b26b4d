"""Shuffle-quality metrics that tell sampling modes apart.

API
---
``position_uniformity(streams, n, *, bins=10) -> ChiSquare``
    Is every item's position within an epoch uniform across epochs?  ``streams`` holds one served sequence per
    epoch (indices in ``[0, n)``, repeats allowed: an item's position is where it is first served, as a fraction of
    the epoch).  Pearson chi-square over the ``n x bins`` table of (item, position bin) counts against the uniform
    expectation; a full shuffle gives p ~ U(0, 1), a mode that ties items to parts of the epoch gives p ~ 0.  Items
    that move together (a block visited as a unit) are caught too: each one's position may be uniform, but the
    summed statistic assumes independent items and its variance grows with the block size.
``first_position_chisquare(firsts, n) -> ChiSquare``
    Which item comes first, over many epochs: chi-square of the counts against uniform (a plain bias test).
``neighbour_entropy(stream) -> float``
    Shannon entropy (bits) of the absolute differences between consecutive indices, the figure Mosaic Streaming
    reports for its shuffles: 0 for a sequential read, about ``log2(len(stream))`` or more for a full shuffle.
``distinct_fraction(stream, window) -> float``
    Mean share of distinct indices in consecutive windows of ``window`` served indices: 1 for a pass over fresh
    data, ``1 / rf`` for a window of a data set's size under MET (repetition the other metrics do not see).
``visit_spread(streams, n) -> VisitSpread``
    Per-file visit counts over the whole run: min, max, mean and coefficient of variation.  Fixed rf and
    sampling without replacement give equal counts; adaptive rf or sampling with replacement spread them.
``chi2_sf(x, dof) -> float``
    Upper tail of the chi-square distribution (regularised incomplete gamma), numpy + stdlib only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "ChiSquare",
    "VisitSpread",
    "chi2_sf",
    "distinct_fraction",
    "first_position_chisquare",
    "neighbour_entropy",
    "position_uniformity",
    "visit_spread",
]


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float


@dataclass(frozen=True)
class VisitSpread:
    min: int
    max: int
    mean: float
    cv: float  # standard deviation / mean


def _gamma_series(a: float, x: float) -> float:
    """Regularised lower incomplete gamma P(a, x) by its series (converges fast for x < a + 1)."""
    term = 1.0 / a
    total = term
    ap = a
    for _ in range(100_000):
        ap += 1
        term *= x / ap
        total += term
        if abs(term) < abs(total) * 1e-15:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _gamma_cf(a: float, x: float) -> float:
    """Regularised upper incomplete gamma Q(a, x) by Lentz's continued fraction (for x >= a + 1)."""
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 100_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return h * math.exp(-x + a * math.log(x) - math.lgamma(a))


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square with ``dof`` degrees of freedom."""
    if isinstance(dof, bool) or not isinstance(dof, (int, np.integer)) or dof < 1:
        raise ValueError(f"dof must be an integer >= 1, got {dof!r}")
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"x must be finite and >= 0, got {x!r}")
    if x == 0:
        return 1.0
    a, h = dof / 2.0, x / 2.0
    if h < a + 1:
        return max(0.0, 1.0 - _gamma_series(a, h))
    return min(1.0, _gamma_cf(a, h))


def _check_n(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    return int(n)


def _check_stream(name: str, stream: object, n: int) -> np.ndarray:
    arr = np.asarray(stream)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"{name} must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= n):
        raise ValueError(f"{name} must hold indices in [0, {n}), got values in [{arr.min()}, {arr.max()}]")
    return arr.astype(np.int64, copy=False)


def _pearson(counts: np.ndarray, expected: np.ndarray | float, dof: int) -> ChiSquare:
    stat = float(np.sum((counts - expected) ** 2 / expected))
    return ChiSquare(stat, dof, chi2_sf(stat, dof))


def position_uniformity(streams: Sequence[np.ndarray], n: int, *, bins: int = 10) -> ChiSquare:
    """Chi-square test that each item's (first) position in the epoch is uniform across epochs.

    Every item must be served in every epoch.  For a trustworthy p-value keep ``len(streams) / bins >= 5``.
    """
    n = _check_n(n)
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 2:
        raise ValueError(f"bins must be an integer >= 2, got {bins!r}")
    if len(streams) < 2:
        raise ValueError(f"streams must hold at least 2 epochs, got {len(streams)}")
    table = np.zeros((n, bins), dtype=np.int64)
    for e, stream in enumerate(streams):
        arr = _check_stream(f"streams[{e}]", stream, n)
        first = np.full(n, -1, dtype=np.int64)
        # reversed assignment leaves each item's first position
        first[arr[::-1]] = np.arange(arr.size - 1, -1, -1)
        if (first < 0).any():
            raise ValueError(f"streams[{e}] must serve every item, item {int(np.argmin(first))} is missing")
        b = np.minimum((first * bins) // arr.size, bins - 1)
        np.add.at(table, (np.arange(n), b), 1)
    expected = len(streams) / bins
    return _pearson(table, expected, n * (bins - 1))


def first_position_chisquare(firsts: Sequence[int] | np.ndarray, n: int) -> ChiSquare:
    """Chi-square of how often each item came first (one entry per epoch) against the uniform 1/n."""
    n = _check_n(n)
    arr = _check_stream("firsts", firsts, n)
    if arr.size == 0:
        raise ValueError("firsts must not be empty")
    counts = np.bincount(arr, minlength=n)
    return _pearson(counts, arr.size / n, n - 1)


def neighbour_entropy(stream: np.ndarray) -> float:
    """Entropy (bits) of ``|stream[t+1] - stream[t]|`` over the stream."""
    arr = np.asarray(stream)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"stream must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if arr.size < 2:
        return 0.0
    _, counts = np.unique(np.abs(np.diff(arr.astype(np.int64))), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def distinct_fraction(stream: np.ndarray, window: int) -> float:
    """Mean of (distinct indices / window) over the complete consecutive windows of ``stream``."""
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be an integer >= 1, got {window!r}")
    arr = np.asarray(stream)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"stream must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
    if arr.size < window:
        raise ValueError(f"stream must hold at least one window ({window}), got {arr.size} indices")
    rows = np.sort(arr[: arr.size // window * window].reshape(-1, window), axis=1)
    distinct = 1 + (np.diff(rows, axis=1) != 0).sum(axis=1)
    return float(distinct.mean() / window)


def visit_spread(streams: Sequence[np.ndarray], n: int) -> VisitSpread:
    """How evenly the run visited the files: counts of every index in ``[0, n)`` over all streams."""
    n = _check_n(n)
    counts = np.zeros(n, dtype=np.int64)
    for e, stream in enumerate(streams):
        counts += np.bincount(_check_stream(f"streams[{e}]", stream, n), minlength=n)
    mean = float(counts.mean())
    cv = float(counts.std() / mean) if mean else 0.0
    return VisitSpread(int(counts.min()), int(counts.max()), mean, cv)

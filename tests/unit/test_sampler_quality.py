"""sampler.quality: the metrics separate a full shuffle from biased orders; chi2_sf against known values."""

from __future__ import annotations

import numpy as np
import pytest

from sampler.quality import (
    chi2_sf,
    distinct_fraction,
    first_position_chisquare,
    neighbour_entropy,
    position_uniformity,
    visit_spread,
)


@pytest.mark.parametrize(
    ("x", "dof", "p"),
    [
        (3.841458820694124, 1, 0.05),
        (18.307038053275146, 10, 0.05),
        (0.0, 3, 1.0),
        (2.0, 2, np.exp(-1.0)),
        (1000.0, 900, 0.010994608942135844),
        (850.0, 900, 0.8820472207240427),
        (30.0, 5, 1.4748581038443073e-05),
    ],
)
def test_chi2_sf_known_values(x, dof, p):
    # reference values from scipy.stats.chi2.sf
    assert chi2_sf(x, dof) == pytest.approx(p, rel=2e-3)


def test_position_uniformity_passes_full_shuffle_and_rejects_fixed_blocks():
    n, epochs = 200, 100
    rng = np.random.default_rng(0)
    shuffled = [rng.permutation(n) for _ in range(epochs)]
    assert position_uniformity(shuffled, n).p_value > 1e-3
    # blocks of 50 visited in random order, each block shuffled inside: positions depend on the block only
    blocks = np.arange(n).reshape(4, 50)
    blocky = [np.concatenate([rng.permutation(blocks[b]) for b in rng.permutation(4)]) for _ in range(epochs)]
    # each item's position is marginally uniform, but items of a block move together: the summed statistic sees it
    assert position_uniformity(blocky, n).p_value < 1e-6
    sequential = [np.arange(n)] * epochs
    assert position_uniformity(sequential, n).p_value < 1e-12


def test_position_uniformity_counts_first_visits():
    stream = np.array([0, 1, 0, 1, 2, 2])
    result = position_uniformity([stream, stream[::-1].copy()], 3, bins=2)
    assert result.dof == 3


def test_first_position_chisquare():
    rng = np.random.default_rng(1)
    fair = [int(rng.permutation(10)[0]) for _ in range(2000)]
    assert first_position_chisquare(fair, 10).p_value > 1e-3
    biased = [0] * 300 + fair
    assert first_position_chisquare(biased, 10).p_value < 1e-9


def test_neighbour_entropy_orders_modes():
    rng = np.random.default_rng(2)
    n = 4096
    assert neighbour_entropy(np.arange(n)) == 0.0
    full = neighbour_entropy(rng.permutation(n))
    local = neighbour_entropy(np.concatenate([rng.permutation(64) + 64 * b for b in range(n // 64)]))
    assert full > local > 0
    assert full > 0.8 * np.log2(n)
    assert neighbour_entropy(np.array([3])) == 0.0


def test_distinct_fraction():
    assert distinct_fraction(np.arange(100), 10) == 1.0
    met = np.concatenate([np.random.default_rng(0).permutation(25) for _ in range(4)])  # rf = 4 over 25 files
    assert distinct_fraction(met, 100) == 0.25
    assert distinct_fraction(np.array([1, 1, 2, 3, 9]), 2) == 0.75  # the incomplete last window is left out


def test_visit_spread():
    even = visit_spread([np.arange(10), np.arange(10)[::-1].copy()], 10)
    assert (even.min, even.max, even.mean, even.cv) == (2, 2, 2.0, 0.0)
    uneven = visit_spread([np.array([0, 0, 0, 1])], 3)
    assert (uneven.min, uneven.max) == (0, 3)
    assert uneven.cv == pytest.approx(np.std([3, 1, 0]) / (4 / 3))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: chi2_sf(1.0, 0), "dof"),
        (lambda: chi2_sf(-1.0, 1), "x must"),
        (lambda: position_uniformity([np.arange(3)], 3), "at least 2 epochs"),
        (lambda: position_uniformity([np.arange(3)] * 2, 0), "n must"),
        (lambda: position_uniformity([np.arange(3)] * 2, 3, bins=1), "bins"),
        (lambda: position_uniformity([np.arange(3), np.array([0, 1])], 3), r"streams\[1\] must serve every item"),
        (lambda: position_uniformity([np.arange(3), np.array([0, 1, 5])], 3), r"streams\[1\] must hold indices"),
        (lambda: position_uniformity([np.arange(3), np.array([0.0, 1.0, 2.0])], 3), r"streams\[1\] must be"),
        (lambda: first_position_chisquare([], 3), "firsts must not be empty"),
        (lambda: neighbour_entropy(np.zeros((2, 2), int)), "stream must"),
        (lambda: visit_spread([np.array([-1])], 3), r"streams\[0\]"),
        (lambda: distinct_fraction(np.arange(3), 0), "window must"),
        (lambda: distinct_fraction(np.arange(3), 4), "at least one window"),
        (lambda: distinct_fraction(np.zeros((2, 2), int), 1), "stream must"),
    ],
)
def test_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()

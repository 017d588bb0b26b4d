"""sampler.reservoir: uniformity of R and L (fixed-seed chi-square), OneAccess samples, streaming shuffle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler.plan import plan_epoch
from sampler.quality import chi2_sf
from sampler.reservoir import (
    algorithm_l,
    algorithm_r,
    epoch_keys,
    iter_epoch_keys,
    oneaccess_samples,
    sample_indices,
    streaming_shuffle,
)


def _inclusion_p(samples: list, n: int) -> float:
    """p-value of 'every item is kept with probability k/n' over repeated samples of size k."""
    counts = np.bincount(np.concatenate([np.asarray(s) for s in samples]), minlength=n).astype(float)
    k = len(samples[0])
    expected = len(samples) * k / n
    stat = float(((counts - expected) ** 2 / expected).sum()) / (1 - k / n)
    return chi2_sf(stat, n - 1)


@pytest.mark.parametrize("algo", [algorithm_r, algorithm_l])
def test_every_item_equally_likely(algo):
    rng = np.random.default_rng(123)
    samples = [algo(range(50), 5, rng) for _ in range(3000)]
    assert all(len(set(s)) == 5 for s in samples)
    assert _inclusion_p(samples, 50) > 1e-3


@pytest.mark.parametrize("method", ["L", "R"])
def test_sample_indices_equally_likely_and_sorted(method):
    rng = np.random.default_rng(7)
    samples = [sample_indices(60, 6, rng, method=method) for _ in range(3000)]
    assert all(np.all(np.diff(s) > 0) for s in samples)
    assert _inclusion_p(samples, 60) > 1e-3


def test_late_items_are_not_favoured_by_algorithm_l():
    """A skip computed wrongly shows up as a bias towards the start or the end of the stream."""
    rng = np.random.default_rng(99)
    late = sum(sum(1 for x in algorithm_l(range(1000), 10, rng) if x >= 500) for _ in range(2000))
    expected = 2000 * 10 / 2
    assert abs(late - expected) < 4.5 * np.sqrt(expected / 2)


def test_biased_sampler_fails_the_inclusion_test():
    """The test has teeth: a sampler that keeps the first k is rejected."""
    samples = [list(range(5)) for _ in range(100)]
    assert _inclusion_p(samples, 50) < 1e-9


def test_short_streams_and_zero_k():
    assert algorithm_r(range(3), 5, 0) == [0, 1, 2]
    assert algorithm_l(range(3), 5, 0) == [0, 1, 2]
    assert algorithm_r(range(3), 0, 0) == []
    assert algorithm_l(range(3), 0, 0) == []
    assert sample_indices(5, 5, 0).tolist() == [0, 1, 2, 3, 4]
    assert sample_indices(5, 5, 0, method="R").tolist() == [0, 1, 2, 3, 4]
    assert sample_indices(5, 0, 0).size == 0


def test_keys_in_chunks_equal_keys_at_once():
    keys = epoch_keys(200_000, seed=3, epoch=1)
    it = iter_epoch_keys(seed=3, epoch=1, chunk=70_000)
    assert np.array_equal(keys, np.concatenate([next(it) for _ in range(3)])[:200_000])
    assert not np.array_equal(keys[:10], epoch_keys(10, seed=3, epoch=2))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 80), nm=st.integers(1, 9), seed=st.integers(0, 2**31), epoch=st.integers(0, 3))
def test_oneaccess_stream_matches_the_reservoir_plan(n, nm, seed, epoch):
    """The streaming OneAccess samples (one sequential sweep each) equal plan_epoch(composition="reservoir")."""
    plan = plan_epoch(np.ones(n, np.int64), seed=seed, epoch=epoch, nm=nm, composition="reservoir")
    items = [f"f{i}" for i in range(n)]
    samples = list(oneaccess_samples(items, [len(a) for a in plan], seed=seed, epoch=epoch))
    assert [[t for t, _ in s] for s in samples] == [a.tolist() for a in plan]
    assert all(item == f"f{t}" for s in samples for t, item in s)


def test_oneaccess_stream_matches_the_plan_across_key_chunks():
    n = 3000  # keys are drawn in chunks of 256, 512, 1024, ...: the boundaries must not shift them
    plan = plan_epoch(np.ones(n, np.int64), seed=8, epoch=2, nm=3, composition="reservoir")
    samples = list(oneaccess_samples(range(n), [len(a) for a in plan], seed=8, epoch=2))
    assert [[t for t, _ in s] for s in samples] == [a.tolist() for a in plan]


def test_oneaccess_samples_are_disjoint_covering_and_sized():
    samples = list(oneaccess_samples(range(103), 10, seed=1, epoch=0))
    assert [len(s) for s in samples] == [10] * 10 + [3]
    flat = [t for s in samples for t, _ in s]
    assert sorted(flat) == list(range(103))
    assert all([t for t, _ in s] == sorted(t for t, _ in s) for s in samples)  # read order = stream order


def test_oneaccess_first_sample_is_uniform():
    samples = [[t for t, _ in next(oneaccess_samples(range(40), 4, seed=5, epoch=e))] for e in range(1500)]
    assert _inclusion_p(samples, 40) > 1e-3


def test_oneaccess_empty_stream_and_bad_counts():
    assert list(oneaccess_samples([], 3, seed=0, epoch=0)) == []
    with pytest.raises(ValueError, match="sample_size lists 4 items but the stream holds 5"):
        list(oneaccess_samples(range(5), [2, 2], seed=0, epoch=0))
    with pytest.raises(ValueError, match="sample_size lists 7 items but the stream holds 5"):
        list(oneaccess_samples(range(5), [5, 2], seed=0, epoch=0))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 200), buffer_size=st.integers(1, 50), seed=st.integers(0, 2**31))
def test_streaming_shuffle_serves_each_item_once(n, buffer_size, seed):
    out = list(streaming_shuffle(iter(range(n)), buffer_size, seed))
    assert sorted(out) == list(range(n))


def test_streaming_shuffle_with_full_buffer_is_uniform():
    rng = np.random.default_rng(4)
    firsts = [next(streaming_shuffle(range(20), 20, rng)) for _ in range(4000)]
    counts = np.bincount(firsts, minlength=20)
    assert chi2_sf(float(((counts - 200) ** 2 / 200).sum()), 19) > 1e-3


def test_streaming_shuffle_small_buffer_stays_local():
    out = list(streaming_shuffle(range(1000), 10, 0))
    # an item can only be served after the stream has reached it, and at most buffer_size items early
    assert all(item <= pos + 10 for pos, item in enumerate(out))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: algorithm_r(range(3), -1, 0), "k must"),
        (lambda: algorithm_l(range(3), 1.5, 0), "k must"),
        (lambda: algorithm_r(range(3), 1, -1), "rng must"),
        (lambda: algorithm_l(range(3), 1, "x"), "rng must"),
        (lambda: sample_indices(-1, 0, 0), "n must"),
        (lambda: sample_indices(3, 4, 0), "k must be <= n=3"),
        (lambda: sample_indices(3, 1, 0, method="X"), "method must"),
        (lambda: epoch_keys(-1, seed=0, epoch=0), "n must"),
        (lambda: epoch_keys(3, seed=-1, epoch=0), "seed must"),
        (lambda: epoch_keys(3, seed=0, epoch=-1), "epoch must"),
        (lambda: next(iter_epoch_keys(seed=0, epoch=0, chunk=0)), "chunk must"),
        (lambda: list(oneaccess_samples(range(3), 0, seed=0, epoch=0)), "sample_size must"),
        (lambda: list(oneaccess_samples(range(3), [-1, 4], seed=0, epoch=0)), r"sample_size\[\] must"),
        (lambda: list(oneaccess_samples(range(3), 1, seed=-2, epoch=0)), "seed must"),
        (lambda: list(streaming_shuffle(range(3), 0, 0)), "buffer_size must"),
    ],
)
def test_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize(
    "draw",
    [
        lambda rng, e: algorithm_r(range(6), 2, rng),
        lambda rng, e: algorithm_l(range(6), 2, rng),
        lambda rng, e: sample_indices(6, 2, rng, method="L"),
        lambda rng, e: sample_indices(6, 2, rng, method="R"),
        lambda rng, e: [t for t, _ in next(oneaccess_samples(range(6), 2, seed=3, epoch=e))],
    ],
    ids=["R", "L", "indices-L", "indices-R", "oneaccess"],
)
def test_every_subset_equally_likely(draw):
    """OneAccess Theorem 2: each of the C(6, 2) = 15 subsets has probability 1/15 (marginals could hide a bias)."""
    rng = np.random.default_rng(21)
    counts: dict[tuple[int, ...], int] = {}
    trials = 4500
    for e in range(trials):
        key = tuple(sorted(int(x) for x in draw(rng, e)))
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 15
    observed = np.array(list(counts.values()), dtype=float)
    stat = float(((observed - trials / 15) ** 2 / (trials / 15)).sum())
    assert chi2_sf(stat, 14) > 1e-3


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 100), min_size=1, max_size=60),
    slack=st.integers(0, 300),
    seed=st.integers(0, 2**31),
)
def test_oneaccess_stream_reproduces_budget_limited_reservoir_plans(sizes, slack, seed):
    sizes_arr = np.array(sizes)
    plan = plan_epoch(sizes_arr, seed=seed, epoch=0, budget=max(sizes) + slack, composition="reservoir")
    samples = list(oneaccess_samples(range(len(sizes)), [len(a) for a in plan], seed=seed, epoch=0))
    assert [[t for t, _ in s] for s in samples] == [a.tolist() for a in plan]

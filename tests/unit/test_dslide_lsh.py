"""LSH tables: bucket invariants after builds and incremental rehashes, locality, the rehash schedule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dslide.lsh import LSHIndex, RehashSchedule


def check_invariants(ix: LSHIndex) -> None:
    """Every stored neuron sits in the bucket of its current code, once per table, within capacity."""
    for t in range(ix.n_tables):
        stored = []
        for b in range(ix.n_buckets):
            start, cap = ix.offsets[t, b], ix.offsets[t, b + 1] - ix.offsets[t, b]
            assert 0 <= ix.fill[t, b] <= min(cap, ix.bucket_cap)
            items = ix.items[start : start + ix.fill[t, b]]
            assert np.all(ix.codes[items, t] == b)
            stored.extend(items.tolist())
        assert len(stored) == len(set(stored))
        # a bucket that was never over capacity holds everything hashed to it
        full = ix.seen[t] <= (ix.offsets[t, 1:] - ix.offsets[t, :-1])
        for b in np.flatnonzero(full & (ix.fill[t] > 0)):
            assert ix.fill[t, b] == np.count_nonzero(ix.codes[:, t] == b)


@pytest.mark.parametrize("family", ["srp", "dwta"])
def test_build_and_incremental_rehash_keep_tables_consistent(family: str) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((500, 16)).astype(np.float32)
    ix = LSHIndex(family, 4 if family == "srp" else 2, 5, 16, 500, bucket_cap=24, seed=1)
    ix.rebuild(w)
    check_invariants(ix)
    np.testing.assert_array_equal(ix.codes, ix.hash(w))
    for _ in range(3):
        ids = rng.choice(500, 120, replace=False)
        w[ids] += rng.standard_normal((120, 16)).astype(np.float32)
        ix.rehash(w, ids)
        check_invariants(ix)
        np.testing.assert_array_equal(ix.codes, ix.hash(w))
    ix.rebuild(w, new_functions=True)
    assert ix.generation == 1
    check_invariants(ix)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 300), st.integers(1, 6), st.integers(1, 40), st.integers(0, 2**31))
def test_reservoir_caps_buckets(n: int, k: int, cap: int, seed: int) -> None:
    w = np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)
    ix = LSHIndex("srp", k, 3, 8, n, bucket_cap=cap, seed=seed)
    ix.rebuild(w)
    check_invariants(ix)
    assert ix.fill.sum(axis=1).max() <= n


def test_srp_finds_similar_vectors_more_often_than_random() -> None:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((2000, 32)).astype(np.float32)
    ix = LSHIndex("srp", 8, 12, 32, 2000, bucket_cap=64, seed=2)
    ix.rebuild(w)
    hits_near = hits_far = 0
    for j in range(0, 2000, 40):
        near = w[j] + 0.2 * rng.standard_normal(32).astype(np.float32)
        hits_near += j in ix.query(near)
        hits_far += j in ix.query(rng.standard_normal(32).astype(np.float32))
    assert hits_near >= 40 and hits_far <= 10


def test_dwta_hashes_sparse_vectors_by_densification() -> None:
    ix = LSHIndex("dwta", 3, 4, 64, 1, bucket_cap=8, seed=0)
    x = np.zeros((2, 64), np.float32)
    x[0, 5] = 1.0  # almost every bin is empty: codes come from the few non-empty ones
    x[1, 5] = 2.0
    codes = ix.hash(x)
    assert np.array_equal(codes[0], codes[1])  # scale invariant
    assert codes.max() < ix.n_buckets


def test_rehash_schedule_decays() -> None:
    s = RehashSchedule(first=10, growth=2.0, max_interval=100, fresh_every=3)
    assert [s.interval(i) for i in range(6)] == [10, 20, 40, 80, 100, 100]
    assert [s.is_fresh(i) for i in range(6)] == [False, False, True, False, False, True]


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="k=8 gives 24-bit codes for dwta"):
        LSHIndex("dwta", 8, 2, 16, 10, 8, 0)
    with pytest.raises(ValueError, match="hash family must be one of"):
        LSHIndex("minhash", 2, 2, 16, 10, 8, 0)


def test_centred_tables_spread_rows_that_share_a_direction() -> None:
    """Rows with a large common part all hash alike; centred per group they spread over the buckets, and the
    incremental rehash keeps the tables consistent with the centred codes."""
    rng = np.random.default_rng(3)
    n, dim = 600, 16
    w = (5.0 + 0.3 * rng.standard_normal((n, dim))).astype(np.float32)
    w[300:] -= 10.0  # the second group's common part points the other way
    groups = np.array([0, 300, n])
    plain = LSHIndex("srp", 6, 4, dim, n, bucket_cap=600, seed=1, groups=groups)
    centred = LSHIndex("srp", 6, 4, dim, n, bucket_cap=600, seed=1, groups=groups, center=True)
    plain.rebuild(w)
    centred.rebuild(w)
    check_invariants(centred)
    for t in range(4):
        assert len(np.unique(plain.codes[:300, t])) <= 2
        assert len(np.unique(centred.codes[:300, t])) >= 20
    mean = np.concatenate([np.repeat(w[:300].mean(0, keepdims=True), 300, 0),
                           np.repeat(w[300:].mean(0, keepdims=True), 300, 0)])  # fmt: skip
    np.testing.assert_array_equal(centred.codes - centred._base[:, None], centred.hash(w - mean))
    ids = rng.choice(n, 100, replace=False)
    w[ids] += rng.standard_normal((100, dim)).astype(np.float32)
    centred.rehash(w, ids)
    check_invariants(centred)

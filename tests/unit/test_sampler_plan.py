"""sampler.plan: invariants (hypothesis), statistics with fixed seeds, every validation error."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler.plan import COMPOSITIONS, groups_from_paths, min_mini_epochs, plan_epoch, serving_order
from sampler.quality import chi2_sf

# ------------------------------------------------------------------------------------------------ strategies


@st.composite
def file_tables(draw: st.DrawFn) -> dict:
    n = draw(st.integers(0, 60))
    sizes = np.array(draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)), dtype=np.int64)
    groups = np.array(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)), dtype=np.int64)
    order = draw(st.one_of(st.none(), st.permutations(list(range(n))).map(np.array)))
    return {"sizes": sizes, "groups": groups, "order": order}


def _all_ranks(table: dict, world_size: int, **kw) -> list[list[np.ndarray]]:
    return [
        plan_epoch(table["sizes"], groups=table["groups"], order=table["order"], rank=r, world_size=world_size, **kw)
        for r in range(world_size)
    ]


def _storage_pos(table: dict) -> np.ndarray:
    n = table["sizes"].shape[0]
    return np.arange(n) if table["order"] is None else table["order"]


# ------------------------------------------------------------------------------------------------ invariants


@settings(max_examples=60, deadline=None)
@given(
    table=file_tables(),
    composition=st.sampled_from(COMPOSITIONS),
    world_size=st.integers(1, 3),
    nm=st.integers(1, 6),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
)
def test_every_file_once_per_epoch_and_rank_shares_disjoint(table, composition, world_size, nm, seed, epoch):
    plans = _all_ranks(table, world_size, seed=seed, epoch=epoch, nm=nm, composition=composition)
    assert all(len(p) == nm for p in plans)
    flat = np.concatenate([a for p in plans for a in p] + [np.zeros(0, np.int64)])
    assert np.array_equal(np.sort(flat), np.arange(table["sizes"].shape[0]))
    pos = _storage_pos(table)
    for p in plans:
        for a in p:
            assert a.dtype == np.int64
            assert np.all(np.diff(pos[a]) > 0)  # staging order = storage order


@settings(max_examples=60, deadline=None)
@given(
    table=file_tables(),
    composition=st.sampled_from(COMPOSITIONS),
    world_size=st.integers(1, 3),
    slack=st.integers(0, 3000),
    with_nm=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_every_share_within_budget(table, composition, world_size, slack, with_nm, seed):
    sizes = table["sizes"]
    budget = max(1, int(sizes.max(initial=0))) + slack
    nm = None
    if with_nm:
        nm = min_mini_epochs(
            sizes,
            budget=budget,
            seed=seed,
            composition=composition,
            groups=table["groups"],
            order=table["order"],
            world_size=world_size,
        )
    plans = _all_ranks(table, world_size, seed=seed, epoch=0, nm=nm, budget=budget, composition=composition)
    flat = np.concatenate([a for p in plans for a in p] + [np.zeros(0, np.int64)])
    assert np.array_equal(np.sort(flat), np.arange(sizes.shape[0]))
    for p in plans:
        assert len(p) == len(plans[0])
        for a in p:
            assert int(sizes[a].sum()) <= budget


@settings(max_examples=60, deadline=None)
@given(table=file_tables(), world_size=st.integers(1, 3), nm=st.integers(1, 6), seed=st.integers(0, 2**32))
def test_stratified_keeps_every_group_within_one_file_of_proportional(table, world_size, nm, seed):
    plans = _all_ranks(table, world_size, seed=seed, epoch=1, nm=nm, composition="stratified")
    groups = table["groups"]
    for j in range(nm):
        me = np.concatenate([p[j] for p in plans])
        for g in np.unique(groups):
            n_g = int((groups == g).sum())
            count = int((groups[me] == g).sum())
            assert n_g // nm <= count <= -(-n_g // nm)
    counts = [sum(len(p[j]) for p in plans) for j in range(nm)]
    assert max(counts) - min(counts) <= 1


@settings(max_examples=30, deadline=None)
@given(table=file_tables(), composition=st.sampled_from(COMPOSITIONS), seed=st.integers(0, 2**32))
def test_deterministic_for_seed_and_epoch(table, composition, seed):
    kw = dict(groups=table["groups"], order=table["order"], seed=seed, nm=3, composition=composition)
    a = plan_epoch(table["sizes"], epoch=4, **kw)
    b = plan_epoch(table["sizes"].copy(), epoch=4, **kw)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_epochs_differ_and_seeds_differ():
    sizes = np.full(200, 10)
    base = plan_epoch(sizes, seed=1, epoch=0, nm=4)
    for other in (plan_epoch(sizes, seed=1, epoch=1, nm=4), plan_epoch(sizes, seed=2, epoch=0, nm=4)):
        assert not all(np.array_equal(x, y) for x, y in zip(base, other, strict=True))


def test_budget_alone_picks_the_smallest_nm_that_fits():
    sizes = np.full(100, 10)  # 1000 bytes
    assert len(plan_epoch(sizes, seed=0, epoch=0, budget=250)) == 4
    assert len(plan_epoch(sizes, seed=0, epoch=0, budget=1000)) == 1
    assert len(plan_epoch(sizes, seed=0, epoch=0, budget=999)) == 2
    # per rank: two ranks each hold at most 250 bytes of a mini-epoch
    assert len(plan_epoch(sizes, seed=0, epoch=0, budget=250, world_size=2)) == 2


def test_random_mini_epochs_are_byte_balanced():
    sizes = np.random.default_rng(0).integers(1, 1000, size=5000)
    me_bytes = [int(sizes[a].sum()) for a in plan_epoch(sizes, seed=3, epoch=0, nm=10)]
    assert max(me_bytes) - min(me_bytes) <= 2 * int(sizes.max())


def test_contiguous_is_the_storage_split_with_shuffled_visits():
    sizes = np.full(100, 1)
    order = np.arange(100)[::-1].copy()  # storage order is the reverse of the index
    plan = plan_epoch(sizes, seed=0, epoch=0, nm=4, composition="contiguous", order=order)
    blocks = sorted(tuple(a.tolist()) for a in plan)
    assert blocks == sorted(tuple(range(hi - 1, hi - 26, -1)) for hi in (25, 50, 75, 100))
    visits = {
        tuple(tuple(a.tolist()) for a in plan_epoch(sizes, seed=0, epoch=e, nm=4, composition="contiguous"))
        for e in range(10)
    }
    assert len(visits) > 1


def test_empty_table():
    assert [a.size for a in plan_epoch(np.zeros(0, np.int64), seed=0, epoch=0, nm=3)] == [0, 0, 0]
    assert len(plan_epoch(np.zeros(0, np.int64), seed=0, epoch=0, budget=10)) == 1


def test_more_ranks_than_files_gives_empty_shares():
    plans = [plan_epoch(np.ones(3, np.int64), seed=0, epoch=0, nm=2, rank=r, world_size=4) for r in range(4)]
    assert sorted(np.concatenate([a for p in plans for a in p]).tolist()) == [0, 1, 2]


# ------------------------------------------------------------------------------------------------ statistics


def _membership_p(counts: np.ndarray, epochs: int) -> float:
    """p-value of 'every file lands in each of the ``counts.shape[0]`` places with equal probability'.

    ``counts[j, i]``: epochs in which file i was in place j.  Each file's column is multinomial; the statistic sums
    the files' Pearson statistics.  Files of one epoch are not independent (a piece holding a large file holds
    fewer others), which fattens the tail a little, so the bar is 1e-4; a biased planner scores ~1e-15.
    """
    places = counts.shape[0]
    expected = epochs / places
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi2_sf(stat, counts.shape[1] * (places - 1))


# log-normal sizes: byte-balanced cuts once put large files in middle mini-epochs more often; this caught it
VARIED = np.maximum(np.random.default_rng(5).lognormal(np.log(100), 1.0, size=40), 1).astype(np.int64)


@pytest.mark.parametrize("composition", ["random", "reservoir", "stratified"])
def test_membership_of_every_mini_epoch_is_uniform(composition):
    """Over many epochs each file lands in each mini-epoch equally often, whatever its size."""
    n, nm, epochs = VARIED.size, 4, 2000
    groups = np.arange(n) % 5
    counts = np.zeros((nm, n))
    for e in range(epochs):
        for j, a in enumerate(plan_epoch(VARIED, seed=11, epoch=e, nm=nm, composition=composition, groups=groups)):
            counts[j, a] += 1
    assert _membership_p(counts, epochs) > 1e-4


@pytest.mark.parametrize("composition", ["random", "stratified", "contiguous"])
def test_rank_membership_is_uniform(composition):
    n, epochs = VARIED.size, 2000
    counts = np.zeros((2, n))
    for e in range(epochs):
        plan = plan_epoch(
            VARIED, seed=2, epoch=e, nm=3, composition=composition, groups=np.arange(n) % 5, rank=0, world_size=2
        )
        mine = np.concatenate(plan)
        counts[0, mine] += 1
    counts[1] = epochs - counts[0]
    if composition == "contiguous":  # whole sub-ranges move together: only the marginal is checked
        assert abs(counts[0].mean() / epochs - 0.5) < 0.02
    else:
        assert _membership_p(counts, epochs) > 1e-4


@pytest.mark.parametrize("composition", ["random", "reservoir", "contiguous"])
def test_neighbours_in_storage_share_a_mini_epoch_only_by_chance(composition):
    """Files 0 and 1 (storage neighbours) meet in a mini-epoch with probability (m-1)/(n-1) unless the plan is
    contiguous, where they always do: a membership chi-square cannot see that, this binomial check does."""
    n, nm, epochs = 40, 4, 1000
    together = 0
    for e in range(epochs):
        plan = plan_epoch(np.full(n, 7), seed=11, epoch=e, nm=nm, composition=composition)
        together += any(0 in a and 1 in a for a in plan)
    p = (n / nm - 1) / (n - 1)
    z = (together - epochs * p) / np.sqrt(epochs * p * (1 - p))
    if composition == "contiguous":
        assert together == epochs
    else:
        assert abs(z) < 4.5


def test_serving_order_first_position_uniform():
    idx = np.arange(30) * 3
    firsts = [int(serving_order(idx, seed=5, epoch=0, mini_epoch=1, pass_index=p)[0]) // 3 for p in range(3000)]
    counts = np.bincount(firsts, minlength=30)
    stat = float(((counts - 100) ** 2 / 100).sum())
    assert chi2_sf(stat, 29) > 1e-3


def test_serving_order_is_a_fresh_permutation_per_pass():
    idx = np.arange(50, 100)
    a = serving_order(idx, seed=1, epoch=2, mini_epoch=3, pass_index=0)
    assert sorted(a.tolist()) == idx.tolist()
    assert np.array_equal(a, serving_order(idx, seed=1, epoch=2, mini_epoch=3, pass_index=0))
    others = [
        serving_order(idx, seed=1, epoch=2, mini_epoch=3, pass_index=1),
        serving_order(idx, seed=1, epoch=2, mini_epoch=4, pass_index=0),
        serving_order(idx, seed=1, epoch=3, mini_epoch=3, pass_index=0),
        serving_order(idx, seed=2, epoch=2, mini_epoch=3, pass_index=0),
    ]
    assert all(not np.array_equal(a, o) for o in others)


def test_groups_from_paths():
    g = groups_from_paths(["b/x.jpg", "a/y.jpg", "b/z.jpg", "top.jpg"])
    assert g.tolist() == [2, 1, 2, 0]


# ------------------------------------------------------------------------------------------------ validation

SIZES = np.array([5, 6, 7, 8])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"sizes": np.array([[1, 2]])}, "sizes"),
        ({"sizes": np.array([1.5, 2.0])}, "sizes"),
        ({"sizes": np.array(["a"])}, "sizes"),
        ({"sizes": np.array([1, -2])}, "sizes"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"seed": True}, "seed"),
        ({"epoch": -1}, "epoch"),
        ({"nm": 0}, "nm"),
        ({"nm": None}, "nm or budget"),
        ({"budget": 0}, "budget"),
        ({"nm": None, "budget": 7}, "budget=7 is smaller than file 3"),
        ({"nm": 1, "budget": 10}, "budget=10 is too small for nm=1"),
        ({"nm": 1, "budget": 10, "composition": "stratified", "groups": np.zeros(4, int)}, "budget=10 is too small"),
        ({"composition": "sorted"}, "composition"),
        ({"composition": "stratified"}, "groups is required"),
        ({"composition": "stratified", "groups": np.zeros(3, int)}, "groups"),
        ({"groups": np.array(["a", "b", "c", "d"])}, "groups"),
        ({"order": np.arange(3)}, "order"),
        ({"order": np.array(["a", "b", "c", "d"])}, "order"),
        ({"order": np.array([0.0, np.nan, 1.0, 2.0])}, "order"),
        ({"rank": 2, "world_size": 2}, "rank"),
        ({"rank": -1}, "rank"),
        ({"world_size": 0}, "world_size"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    args = {"sizes": SIZES, "seed": 0, "epoch": 0, "nm": 2} | kwargs
    sizes = args.pop("sizes")
    with pytest.raises(ValueError, match=name):
        plan_epoch(sizes, **args)


def test_float_sizes_that_are_integers_are_accepted():
    plan = plan_epoch(np.array([1.0, 2.0]), seed=0, epoch=0, nm=1)
    assert plan[0].tolist() == [0, 1]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"seed": -1}, "seed"),
        ({"epoch": "1"}, "epoch"),
        ({"mini_epoch": -1}, "mini_epoch"),
        ({"pass_index": -3}, "pass_index"),
    ],
)
def test_serving_order_bad_arguments(kwargs, name):
    args = {"seed": 0, "epoch": 0, "mini_epoch": 0, "pass_index": 0} | kwargs
    with pytest.raises(ValueError, match=name):
        serving_order(np.arange(3), **args)


def test_serving_order_rejects_2d():
    with pytest.raises(ValueError, match="indices"):
        serving_order(np.zeros((2, 2), int), seed=0, epoch=0, mini_epoch=0, pass_index=0)


@settings(max_examples=40, deadline=None)
@given(
    table=file_tables(),
    composition=st.sampled_from(["random", "contiguous"]),
    world_size=st.integers(1, 3),
    slack=st.integers(0, 2000),
    seed=st.integers(0, 2**32),
)
def test_budget_alone_gives_the_fewest_mini_epochs(table, composition, world_size, slack, seed):
    sizes = table["sizes"]
    budget = max(1, int(sizes.max(initial=0))) + slack
    kw = dict(seed=seed, epoch=0, budget=budget, composition=composition, order=table["order"], world_size=world_size)
    nm = len(plan_epoch(sizes, **kw))
    if nm > 1:
        with pytest.raises(ValueError, match="too small"):
            plan_epoch(sizes, nm=nm - 1, **kw)


@pytest.mark.parametrize(
    ("sizes", "nm", "budget"),
    [
        ([10] * 10, 12, 10),  # more mini-epochs than files: one file each, then empty ones
        ([1, 1, 1, 1, 8, 8], 4, 9),  # byte quantiles overfill; greedy cuts then splits keep the budget
        ([9, 1, 1, 9, 5, 5, 5, 5], 8, 10),
        ([0, 0, 0, 0], 3, 1),
    ],
)
@pytest.mark.parametrize("composition", COMPOSITIONS)
def test_tight_budgets(sizes, nm, budget, composition):
    sizes = np.array(sizes)
    plan = plan_epoch(
        sizes, seed=0, epoch=0, nm=nm, budget=budget, composition=composition, groups=np.zeros(len(sizes), int)
    )
    assert len(plan) == nm
    assert sorted(np.concatenate(plan).tolist()) == list(range(len(sizes)))
    assert all(int(sizes[a].sum()) <= budget for a in plan)


def test_contiguous_tight_budget_uses_greedy_cuts():
    sizes = np.array([9, 1, 1, 9, 5, 5, 5, 5])  # byte quantiles give 11/14/15; only 11/14/15 -> 11/14/15 fits 15
    plan = plan_epoch(sizes, seed=0, epoch=0, nm=3, budget=15, composition="contiguous")
    assert sorted(int(sizes[a].sum()) for a in plan) == [11, 14, 15]
    with pytest.raises(ValueError, match="needs nm >= 4"):
        plan_epoch(sizes, seed=0, epoch=0, nm=3, budget=14, composition="contiguous")


def test_staging_order_follows_order_values_with_ties_by_index():
    order = np.array([3.5, 1.0, 3.5, 0.0, 2.0])  # storage offsets, say; files 0 and 2 tie
    (plan,) = plan_epoch(np.ones(5, np.int64), seed=0, epoch=0, nm=1, order=order)
    assert plan.tolist() == [3, 1, 4, 0, 2]


# ------------------------------------------------------------------------------ balance with a few large files


@settings(max_examples=60, deadline=None)
@given(
    table=file_tables(),
    composition=st.sampled_from(COMPOSITIONS),
    world_size=st.integers(1, 3),
    nm=st.integers(1, 6),
    budget_slack=st.one_of(st.none(), st.integers(0, 3000)),
    seed=st.integers(0, 2**32),
)
def test_no_empty_mini_epoch_while_there_are_files_for_each(table, composition, world_size, nm, budget_slack, seed):
    sizes = table["sizes"]
    budget = None if budget_slack is None else max(1, int(sizes.max(initial=0))) + budget_slack
    try:
        plans = _all_ranks(table, world_size, seed=seed, epoch=0, nm=nm, budget=budget, composition=composition)
    except ValueError as exc:
        assert "too small" in str(exc)  # a budget that cannot hold nm mini-epochs is refused, not half-met
        return
    counts = np.array([[a.size for a in p] for p in plans])  # ranks x mini-epochs
    assert counts.shape == (world_size, nm)  # numbered 0..nm-1
    if sizes.size >= nm * world_size:
        assert counts.min() >= 1
    else:
        assert counts.max() <= 1


@settings(max_examples=60, deadline=None)
@given(
    small=st.lists(st.integers(1, 1000), min_size=40, max_size=300),
    large=st.lists(st.integers(1, 1000), min_size=1, max_size=3),
    nm=st.integers(4, 12),
    seed=st.integers(0, 2**32),
)
def test_random_shares_the_small_files_evenly_around_large_ones(small, large, nm, seed):
    # files at least as big as all small ones together: none of them can share a byte-balanced mini-epoch
    sizes = np.array(small + [sum(small) * x for x in large])
    rng = np.random.default_rng(seed)
    sizes = sizes[rng.permutation(sizes.size)]
    is_large = sizes >= sum(small)
    plan = plan_epoch(sizes, seed=seed, epoch=0, nm=nm)
    small_bytes = [int(sizes[a][~is_large[a]].sum()) for a in plan]
    # every mini-epoch gets an even share of the files that can be shared, within two of them ...
    assert max(small_bytes) - min(small_bytes) <= 2 * max(small)
    # ... and no two large files land in one mini-epoch while there are mini-epochs without one
    assert max(int(is_large[a].sum()) for a in plan) == 1


@pytest.mark.parametrize("composition", COMPOSITIONS)
@pytest.mark.parametrize("nm", [4, 8])
def test_a_64mib_file_among_3000_small_ones(composition, nm):
    """The issue's case: 64 MiB among 3,000 files of up to 32 KiB used to give mini-epochs of 1 and 1,930 files."""
    rng = np.random.default_rng(7)
    sizes = np.insert(rng.integers(1 << 10, 32 << 10, 3000), 1234, 64 << 20)
    groups = np.arange(sizes.size) % 10
    for epoch in range(3):
        plan = plan_epoch(sizes, seed=1, epoch=epoch, nm=nm, composition=composition, groups=groups)
        counts = [a.size for a in plan]
        assert len(counts) == nm and sum(counts) == sizes.size
        small = [int(sizes[a][sizes[a] < (1 << 20)].sum()) for a in plan]
        if composition == "contiguous":
            # the storage split keeps its ranges: the big file counts as one range's worth, so its range is short
            # and the others share the small files about evenly (the big file's neighbours are cut to the nearest
            # file, which may leave up to half a share beside it)
            big = next(j for j, a in enumerate(plan) if 1234 in a)
            rest = [b for j, b in enumerate(small) if j != big]
            assert min(counts) >= 1
            assert max(rest) <= 1.3 * min(rest)
        else:
            # every mini-epoch holds about n/nm files and an even share of the small files' bytes
            assert min(counts) >= 0.85 * sizes.size / nm
            assert max(small) - min(small) <= 0.15 * sum(small) / nm

"""tierfs.daemon.schedule.schedule.check_fits: a sum and a max decide exactly what planning decides (issue 22: a control
write is validated without planning on the trio thread)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sampler.plan import COMPOSITIONS, plan_epoch
from tierfs.common.options import Settings
from tierfs.daemon.schedule.schedule import check_fits, make_plan


def _plans(sizes: np.ndarray, groups: np.ndarray, s: Settings, capacity: int) -> bool:
    """Whether the planner takes these settings: what the mount and a control write checked by planning an
    epoch before (the cut within half the cache, else, with nm, the balanced cut when a mini-epoch fits half the
    cache on average within one file)."""
    budget, nm = capacity // 2, s.nm
    if s.mini_epoch_size:
        budget, nm = min(budget, s.mini_epoch_size), None
    if nm is not None and nm > len(sizes):
        return False  # (the planner would make empty mini-epochs: the mount refuses more of them than files)
    args = dict(seed=s.seed, epoch=1, composition=s.composition, rank=s.rank, world_size=s.world_size,
                groups=groups if s.composition == "stratified" else None)
    try:
        plan = plan_epoch(sizes, nm=nm, budget=budget, **args)
    except ValueError:
        return nm is not None and int(sizes.sum()) <= (budget + int(sizes.max())) * nm * s.world_size
    assert all(int(sizes[p].sum()) <= budget for p in plan)
    return True


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=60),
    capacity=st.integers(2, 40000),
    nm=st.integers(1, 12),
    mini_epoch_size=st.one_of(st.none(), st.integers(1, 20000)),
    composition=st.sampled_from(COMPOSITIONS),
    world_size=st.integers(1, 3),
    seed=st.integers(0, 3),
)
def test_check_fits_passes_exactly_when_the_planner_takes_the_settings(sizes, capacity, nm, mini_epoch_size,
                                                                       composition, world_size, seed):
    sizes = np.asarray(sizes, np.int64)
    groups = np.arange(len(sizes)) % 3
    s = Settings(nm=nm, mini_epoch_size=mini_epoch_size, composition=composition, world_size=world_size,
                 rank=world_size - 1, seed=seed)
    try:
        check_fits(sizes, s, capacity)
        fits = True
    except ValueError:
        fits = False
    assert fits == _plans(sizes, groups, s, capacity)
    if fits:
        plan, note = make_plan(sizes, groups, s, capacity, epoch=1)
        assert note is None and (nm if not mini_epoch_size else len(plan)) == len(plan)


def test_the_refusal_names_an_nm_that_fits():
    sizes = np.full(100, 1000, np.int64)
    s = Settings(nm=2)
    with pytest.raises(ValueError, match=r"^nm=2 does not fit capacity=39.1K: .* use nm >= 5 or capacity >= 97.7K$"):
        check_fits(sizes, s, capacity=40_000)
    check_fits(sizes, Settings(nm=5), capacity=40_000)
    check_fits(sizes, s, capacity=100_000)

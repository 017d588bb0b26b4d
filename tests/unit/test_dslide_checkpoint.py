"""Re-sharding a checkpoint: P ranks' states cut into the states of P' ranks, exactly what P' ranks would hold."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from dslide.checkpoint import reshard
from dslide.model import ModelConfig, SlideModel


class _RankOf:
    """Just enough of a comm for a model's constructor: rank ``rank`` of ``size``."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.bytes_sent = rank, size, 0


def assert_states_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("family", ["srp", "dwta"])
def test_reshard_round_trips_and_matches_what_ranks_build(family: str) -> None:
    numba.set_num_threads(1)
    try:
        cfg = ModelConfig(300, 242, hidden=18, budget=24, tables=4, bucket_cap=8, blocks=4, hash=family)
        full = SlideModel(cfg)
        rng = np.random.default_rng(0)
        full.W2[...] += rng.standard_normal(full.W2.shape).astype(np.float32)
        full.index.rehash(full.W2, np.arange(0, 242, 3))  # buckets that moved, with reservoir draws
        full.dirty[::5] = 1
        full.opt["T2"][:] = rng.integers(0, 9, 242)
        whole = full.state()
        for size in (2, 4):
            parts = []
            for r in range(size):
                m = SlideModel(cfg, _RankOf(r, size))
                m.load_state(reshard([whole], cfg, size, r))
                parts.append(m.state())
            assert_states_equal(reshard(parts, cfg, 1, 0), whole)  # P ranks -> one process (dslide eval)
            other = 4 if size == 2 else 2
            assert_states_equal(reshard(parts, cfg, other, 1), reshard([whole], cfg, other, 1))  # P -> P'
        # the tables a rank builds over its own blocks are the slice of the one-process tables
        fresh = SlideModel(cfg)
        fresh.W2[...] = full.W2
        fresh.index.rebuild(fresh.W2)
        rank1 = SlideModel(cfg, _RankOf(1, 2))
        rank1.W2[...] = full.W2[rank1.l_lo :]
        rank1.index.rebuild(rank1.W2)
        cut = reshard([fresh.state()], cfg, 2, 1)
        for k, v in rank1.index.state().items():
            np.testing.assert_array_equal(v, cut[f"lsh_{k}"], err_msg=k)
    finally:
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)

"""The batch-shared active set (``ModelConfig.batch_budget``): selection, softmax statistics and gradients."""

from __future__ import annotations

import numpy as np
import pytest

from dslide import kernels
from dslide.gen import generate
from dslide.model import ModelConfig, SlideModel, block_bounds, block_shares


class _RankOf:
    """Just enough of a comm for a model's constructor and selection: rank ``rank`` of ``size``."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.bytes_sent = rank, size, 0


def labels_of(data, r: int) -> np.ndarray:
    return data.y_indices[data.y_indptr[r] : data.y_indptr[r + 1]]


def select(model: SlideModel, data, rows: np.ndarray):
    _, h = model._hidden(data, rows)
    return model._select_shared(data, rows, h)


def lsh_hits(model: SlideModel, h: np.ndarray) -> np.ndarray:
    """How many (sample, table) pairs hash to each own neuron (brute force over the tables' buckets)."""
    ix = model.index
    codes = np.zeros((len(h), ix.n_tables), np.int64)
    kernels.batch_codes(ix.family_id, ix.srp, ix.dwta, ix.k, h, codes)
    hits = np.zeros(model.l_hi - model.l_lo, np.int64)
    for g in range(len(model.shares)):
        for t in range(ix.n_tables):
            for i in range(len(h)):
                start = ix.offsets[t, g * ix.n_codes + codes[i, t]]
                np.add.at(hits, ix.items[start : start + ix.fill[t, g * ix.n_codes + codes[i, t]]], 1)
    return hits


@pytest.mark.parametrize(("threads", "fill_power", "tables"), [(1, 1.0, 4), (2, 1.0, 4), (2, 0.0, 4), (1, 1.0, 0)])
def test_shared_selection_is_exact_labels_first_and_deterministic(numba_threads, threads: int, fill_power: float,
                                                                  tables: int):
    with numba_threads(threads):
        data = generate(64, 300, 400, seed=2)
        cfg = ModelConfig(300, 400, hidden=16, tables=tables, bucket_cap=8, blocks=4, fill_power=fill_power,
                          batch_budget=200)  # fmt: skip
        model = SlideModel(cfg)
        rows = np.arange(0, 64, 2, dtype=np.int64)
        active, corr, lab_ptr, lab_pos = select(model, data, rows)
        again = select(model, data, rows)
        for a, b in zip((active, corr, lab_ptr, lab_pos), again, strict=True):
            np.testing.assert_array_equal(a, b)
        shares = block_shares(cfg, cfg.batch_budget)
        assert len(active) == shares.sum() == 200 and len(set(active.tolist())) == 200
        np.testing.assert_array_equal(np.histogram(active, block_bounds(400, 4))[0], shares)  # exactly each share
        batch_labels = np.unique(np.concatenate([labels_of(data, r) for r in rows]))
        assert set(batch_labels.tolist()) <= set(active.tolist())  # 32 points' labels fit: every one is active
        for i, r in enumerate(rows):  # each sample's labels, as positions in the shared set
            assert sorted(active[lab_pos[lab_ptr[i] : lab_ptr[i + 1]]].tolist()) == sorted(set(labels_of(data, r)))
        # each block's segment: its labels first (no correction), then LSH candidates and fill; corrections >= 0
        starts = np.concatenate([[0], np.cumsum(shares)])
        for g in range(4):
            seg = active[starts[g] : starts[g + 1]]
            n_lab = np.isin(seg, batch_labels).sum()
            assert np.isin(seg[:n_lab], batch_labels).all()
        assert np.all(corr[np.isin(active, batch_labels)] == 0) and np.all(corr >= 0)
        if fill_power == 0:  # uniform fill: log(rest / fill) > 0, so the fill is exactly the corrected entries
            assert (corr > 0).sum() > 0
        mark, pos, hits, _ = model._scratch
        assert not mark.any() and (pos == -1).all() and not hits.any()  # scratch left as found


def test_shared_lsh_candidates_are_the_most_hit_and_take_at_most_their_share(numba_threads) -> None:
    with numba_threads(1):
        data = generate(64, 300, 400, seed=3)
        cfg = ModelConfig(300, 400, hidden=16, tables=8, k=4, blocks=2, fill_power=0.0, lsh_frac=0.25,
                          batch_budget=160)  # fmt: skip
        model = SlideModel(cfg)
        rows = np.arange(24, dtype=np.int64)
        _, h = model._hidden(data, rows)
        active, corr, _, _ = model._select_shared(data, rows, h)
        batch_labels = np.unique(np.concatenate([labels_of(data, r) for r in rows]))
        hits = lsh_hits(model, h)
        bounds = block_bounds(400, 2)
        for g in range(2):
            seg_of = (active >= bounds[g]) & (active < bounds[g + 1])
            is_lsh = seg_of & (corr == 0) & ~np.isin(active, batch_labels)  # uniform fill is corrected
            chosen = active[is_lsh]
            assert len(chosen) == 20  # floor(0.25 * 80): 4-bit codes over 200 neurons find far more than that
            others = np.setdiff1d(np.arange(bounds[g], bounds[g + 1]), np.concatenate([chosen, batch_labels]))
            assert hits[chosen].min() >= hits[others].max() > 0  # the most-hit candidates, never a lesser one


def test_labels_beyond_a_block_share_are_not_active() -> None:
    """A block whose share is smaller than the batch's labels in it keeps the first in sample order; the rest
    are not active and are no sample's target in the step."""
    data = generate(64, 300, 40, seed=5)
    cfg = ModelConfig(300, 40, hidden=8, tables=2, blocks=2, batch_budget=8)
    model = SlideModel(cfg)
    rows = np.arange(64, dtype=np.int64)
    active, _, lab_ptr, lab_pos = select(model, data, rows)
    order = []
    for r in rows:
        for j in labels_of(data, r):
            if j not in order:
                order.append(int(j))
    for g, (lo, hi) in enumerate([(0, 20), (20, 40)]):
        want = [j for j in order if lo <= j < hi][:4]
        assert active[4 * g : 4 * g + 4].tolist() == want
    for i, r in enumerate(rows):
        got = active[lab_pos[lab_ptr[i] : lab_ptr[i + 1]]]
        assert set(got.tolist()) == set(labels_of(data, r).tolist()) & set(active.tolist())


@pytest.mark.parametrize("tables", [4, 0])
def test_ranks_select_the_shared_set_one_process_selects(numba_threads, tables: int) -> None:
    with numba_threads(1):
        data = generate(64, 300, 240, seed=4)
        cfg = ModelConfig(300, 240, hidden=16, tables=tables, bucket_cap=8, blocks=4, batch_budget=96)
        rows = np.arange(48, dtype=np.int64)
        serial = SlideModel(cfg)
        _, h = serial._hidden(data, rows)
        want, want_corr, _, _ = serial._select_shared(data, rows, h)
        for size in (2, 4):
            got, got_corr = [], []
            for r in range(size):
                m = SlideModel(cfg, _RankOf(r, size))
                a, c, _, _ = m._select_shared(data, rows, h)
                got.append(a + m.l_lo)
                got_corr.append(c)
            np.testing.assert_array_equal(np.concatenate(got), want, err_msg=f"P={size}")
            np.testing.assert_array_equal(np.concatenate(got_corr), want_corr, err_msg=f"P={size}")


def test_shared_softmax_and_gradient_match_a_float64_reference() -> None:
    """Statistics and dL/dz of the corrected softmax over a shared set, against numpy in float64."""
    rng = np.random.default_rng(0)
    B, n = 6, 11
    z = rng.standard_normal((B, n)).astype(np.float32)
    corr = np.where(rng.random(n) < 0.5, rng.random(n) * 2, 0).astype(np.float32)
    labs = [[0, 3], [5], [], [1, 2, 9], [10], [4]]
    corr[[j for lab in labs for j in lab]] = 0
    lab_ptr = np.concatenate([[0], np.cumsum([len(lab) for lab in labs])]).astype(np.int64)
    lab_pos = np.array([j for lab in labs for j in lab], np.int64)
    z[1, 5] = z[3, 2] = z.max() + 1  # their top logits are labels
    gmax = z.max(axis=1).astype(np.float32)
    gmax[1] += 0.5  # another rank's logit is higher: this rank's top is not the top
    expz = z.copy()
    stats = SlideModel(ModelConfig(10, 10))._shared_stats(expz, corr, lab_ptr, lab_pos, z.argmax(axis=1), gmax)
    kernels.shared_delta(expz, stats[:, 0], stats[:, 2], lab_ptr, lab_pos, 1.0 / B)
    zz = z.astype(np.float64) + corr
    for i, lab in enumerate(labs):
        e = np.exp(zz[i] - gmax[i])
        np.testing.assert_allclose(stats[i, :3], [e.sum(), z[i, lab].sum(), len(lab)], rtol=1e-5)
        assert stats[i, 3] == float(int(np.argmax(z[i])) in lab and i != 1)
        want = np.zeros(n)
        if lab:  # the gradient of log-sum-exp minus the mean label logit, scaled by 1 / B
            want = e / e.sum()
            want[lab] -= 1.0 / len(lab)
            want /= B
        np.testing.assert_allclose(expz[i], want, rtol=1e-5, atol=1e-7)
    assert stats[3, 3] == 1 and stats[1, 3] == 0


def test_batch_budget_is_checked_and_old_configs_have_none() -> None:
    with pytest.raises(ValueError, match="batch_budget must be >= 0"):
        ModelConfig(10, 10, batch_budget=-1)
    old = ModelConfig(10, 10).to_json()
    del old["batch_budget"]
    assert ModelConfig.from_json(old).batch_budget == 0

"""Kernels against dense numpy references: the sparse layers' gradients, lazy Adam, active-set selection."""

from __future__ import annotations

import numpy as np
import pytest

from dslide import kernels
from dslide.gen import generate
from dslide.model import ModelConfig, SlideModel, block_bounds, block_shares

F, L, H, B, b = 40, 15, 6, 5, 7


def make_problem(seed: int = 0):
    rng = np.random.default_rng(seed)
    data = generate(B, F, L, seed=seed)
    W1 = rng.standard_normal((F, H)).astype(np.float32)
    b1 = (0.1 * rng.standard_normal(H)).astype(np.float32)
    W2 = (rng.standard_normal((L, H)) / np.sqrt(H)).astype(np.float32)
    b2 = (0.1 * rng.standard_normal(L)).astype(np.float32)
    active = np.empty((B, b), np.int32)
    n_own = np.empty(B, np.int32)
    for i in range(B):
        labels = data.y_indices[data.y_indptr[i] : data.y_indptr[i + 1]][:b]
        rest = rng.permutation(np.setdiff1d(np.arange(L), labels))[: b - len(labels)]
        active[i] = np.concatenate([labels, rest])
        n_own[i] = len(labels)
    return data, W1, b1, W2, b2, active, n_own


def dense_x(data) -> np.ndarray:
    x = np.zeros((len(data), data.n_features))
    for i in range(len(data)):
        s = slice(data.x_indptr[i], data.x_indptr[i + 1])
        x[i, data.x_indices[s]] = data.x_values[s]
    return x


def reference_loss(x, W1, b1, W2, b2, active, n_own) -> float:
    """Mean over the batch of softmax cross-entropy on each sample's active set, target uniform on its labels."""
    h = np.maximum(x @ W1 + b1, 0)
    total = 0.0
    for i in range(len(x)):
        z = W2[active[i]] @ h[i] + b2[active[i]]
        logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
        if n_own[i]:
            total -= logp[: n_own[i]].mean()
    return total / len(x)


def reference_grads(x, W1, b1, W2, b2, active, n_own):
    pre = x @ W1 + b1
    h = np.maximum(pre, 0)
    gW2, gb2, dh = np.zeros_like(W2), np.zeros_like(b2), np.zeros_like(h)
    for i in range(len(x)):
        if not n_own[i]:
            continue
        a = active[i]
        z = W2[a] @ h[i] + b2[a]
        p = np.exp(z - z.max())
        p /= p.sum()
        p[: n_own[i]] -= 1.0 / n_own[i]
        p /= len(x)
        gW2[a] += np.outer(p, h[i])
        gb2[a] += p
        dh[i] = p @ W2[a]
    delta = dh * (pre > 0)
    return x.T @ delta, delta.sum(0), gW2, gb2, dh


def run_kernels(data, W1, b1, W2, b2, active, n_own):
    rows = np.arange(B, dtype=np.int64)
    h = np.empty((B, H), np.float32)
    kernels.hidden_forward(rows, data.x_indptr, data.x_indices, data.x_values, W1, b1, h)
    logits, rowmax = np.empty((B, b), np.float32), np.empty(B, np.float32)
    kernels.active_logits(h, active, W2, b2, logits, rowmax)
    stats = np.empty((B, 4))
    z = logits.copy()
    kernels.softmax_stats(logits, np.zeros_like(logits), n_own, rowmax, stats)
    # column 3: the top active logit is one of the sample's labels (train_err)
    np.testing.assert_array_equal(stats[:, 3], np.argmax(z, axis=1) < n_own)
    gW2, gb2, dh = output_gradients(h, logits, active, n_own, stats, W2, b2)
    touched = np.zeros(L, np.uint8)
    touched[np.flatnonzero(gW2.any(axis=1))] = 1
    delta = (dh * (h > 0)).astype(np.float32)
    gW1, touched_in = np.zeros_like(W1), np.zeros(F, np.uint8)
    kernels.hidden_backward(rows, data.x_indptr, data.x_indices, data.x_values, delta, gW1, touched_in)
    loss = np.log(stats[:, 0]) + rowmax - stats[:, 1] / np.maximum(stats[:, 2], 1)
    loss = np.where(stats[:, 2] > 0, loss, 0).sum() / B
    return loss, gW1, delta.sum(0), gW2, gb2, dh, touched, touched_in


def output_gradients(h, expz, active, n_own, stats, W2, b2, chunks: int = 1):
    """W2's and b2's gradients and dL/dh as :func:`kernels.output_rows_adam` computes them: on a copy of the
    layer with zero moments, from which the first Adam moment gives the gradient back (m = (1 - beta1) g)."""
    ptr, ent = np.empty(len(W2) + 1, np.int64), np.empty(active.size, np.int32)
    kernels.group_by_row(active, stats[:, 2] > 0, ptr, ent)
    rows = np.flatnonzero(np.diff(ptr))
    M2, V2, Mb2, Vb2 = np.zeros_like(W2), np.zeros_like(W2), np.zeros(len(b2)), np.zeros(len(b2))
    dh_parts = np.empty((chunks, *h.shape), np.float32)
    kernels.output_rows_adam(h, expz, n_own, stats[:, 0], stats[:, 2], 1.0 / len(h), ptr, ent, rows, W2.copy(),
                             b2.astype(np.float64), M2, V2, Mb2, Vb2, np.zeros(len(W2), np.int64), 1e-3, 0.5, 0.999,
                             1e-8, dh_parts)  # fmt: skip
    return M2 / 0.5, Mb2 / 0.5, dh_parts.sum(axis=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sparse_layer_gradients_match_dense_reference(numba_threads, seed: int) -> None:
    data, W1, b1, W2, b2, active, n_own = make_problem(seed)
    x = dense_x(data)
    args64 = [a.astype(np.float64) for a in (W1, b1, W2, b2)]
    # one thread: the accumulations are HOGWILD by design (threads may race on a row and lose an update), which
    # an exact comparison must not see; a busy machine made that happen here
    with numba_threads(1):
        loss, gW1, gb1, gW2, gb2, dh, touched, touched_in = run_kernels(data, W1, b1, W2, b2, active, n_own)
    ref = reference_grads(x, *args64, active, n_own)
    assert loss == pytest.approx(reference_loss(x, *args64, active, n_own), rel=1e-5)
    for got, want in zip((gW1, gb1, gW2, gb2, dh), ref, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert set(np.flatnonzero(touched)) == set(active[n_own > 0].ravel())
    assert set(np.flatnonzero(touched_in)) == set(data.x_indices)


def test_reference_gradient_agrees_with_finite_differences() -> None:
    data, W1, b1, W2, b2, active, n_own = make_problem(4)
    x = dense_x(data)
    params = [a.astype(np.float64) for a in (W1, b1, W2, b2)]
    grads = reference_grads(x, *params, active, n_own)[:4]
    rng = np.random.default_rng(0)
    for p, g in zip(params, grads, strict=True):
        for _ in range(6):
            idx = tuple(rng.integers(0, s) for s in p.shape)
            old = p[idx]
            p[idx] = old + 1e-6
            up = reference_loss(x, *params, active, n_own)
            p[idx] = old - 1e-6
            down = reference_loss(x, *params, active, n_own)
            p[idx] = old
            assert (up - down) / 2e-6 == pytest.approx(g[idx], rel=1e-4, abs=1e-8)


def test_lazy_adam_matches_per_row_reference() -> None:
    rng = np.random.default_rng(3)
    n, d = 9, 4
    W = rng.standard_normal((n, d)).astype(np.float32)
    bW = rng.standard_normal(n).astype(np.float32)
    M, V, G = np.zeros_like(W), np.zeros_like(W), np.zeros_like(W)
    bM, bV, bG = np.zeros_like(bW), np.zeros_like(bW), np.zeros_like(bW)
    T = np.zeros(n, np.int64)
    ref = {"W": W.astype(np.float64), "b": bW.astype(np.float64)}
    rm, rv = {k: np.zeros_like(v) for k, v in ref.items()}, {k: np.zeros_like(v) for k, v in ref.items()}
    rt = np.zeros(n, int)
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    for _ in range(5):
        rows = np.sort(rng.choice(n, 4, replace=False)).astype(np.int64)
        g, gb = rng.standard_normal((n, d)), rng.standard_normal(n)
        G[rows], bG[rows] = g[rows], gb[rows]
        kernels.adam_rows(W, M, V, G, bW, bM, bV, bG, T, rows, lr, b1, b2, eps)
        for j in rows:
            rt[j] += 1
            for k, gg in (("W", g[j]), ("b", gb[j])):
                rm[k][j] = b1 * rm[k][j] + (1 - b1) * gg
                rv[k][j] = b2 * rv[k][j] + (1 - b2) * gg * gg
                mhat, vhat = rm[k][j] / (1 - b1 ** rt[j]), rv[k][j] / (1 - b2 ** rt[j])
                ref[k][j] -= lr * mhat / (np.sqrt(vhat) + eps)
        np.testing.assert_allclose(W, ref["W"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(bW, ref["b"], rtol=1e-5, atol=1e-6)
        assert not G.any() and not bG.any()  # gradients of updated rows are cleared
    np.testing.assert_array_equal(T, rt)
    # a row's first update moves each weight by ~lr whatever the global step (per-row bias correction)
    first = int(np.flatnonzero(rt == 0)[0]) if (rt == 0).any() else None
    if first is not None:
        G[first] = 5.0
        before = W[first].copy()
        kernels.adam_rows(W, M, V, G, bW, bM, bV, bG, T, np.array([first]), lr, b1, b2, eps)
        np.testing.assert_allclose(before - W[first], lr, rtol=1e-4)


@pytest.mark.parametrize("chunks", [1, 3])
def test_output_rows_adam_is_lazy_adam_on_the_dense_gradient(chunks: int) -> None:
    """The fused output update over a few steps (rows' moments and step counts carried over, rows that a step
    does not touch left alone) against the float64 gradient and per-row Adam; dL/dh summed over any chunking."""
    data, W1, b1, W2, b2, active, n_own = make_problem(5)
    x = dense_x(data)
    rng = np.random.default_rng(5)
    M2, V2 = np.zeros_like(W2), np.zeros_like(W2)
    Mb2, Vb2, bias = np.zeros(L), np.zeros(L), b2.astype(np.float64)
    T2 = np.zeros(L, np.int64)
    ref = [W2.astype(np.float64), b2.astype(np.float64)]
    rm, rv, rt = [np.zeros_like(r) for r in ref], [np.zeros_like(r) for r in ref], np.zeros(L, int)
    lr, beta1, beta2, eps = 0.01, 0.9, 0.999, 1e-8
    h = np.maximum(x @ W1 + b1, 0).astype(np.float32)
    for _ in range(4):
        # each step: labels first, the rest from a few rows shared by the samples (others stay untouched)
        pool = rng.choice(L, 8, replace=False)
        act = np.empty((B, b), np.int32)
        for i in range(B):
            labels = active[i, : n_own[i]]
            rest = np.concatenate([rng.permutation(np.setdiff1d(pool, labels)), np.setdiff1d(np.arange(L), pool)])
            act[i] = np.concatenate([labels, np.setdiff1d(rest, labels, assume_unique=True)[: b - n_own[i]]])
        logits, rowmax = np.empty((B, b), np.float32), np.empty(B, np.float32)
        kernels.active_logits(h, act, W2, bias.astype(np.float32), logits, rowmax)
        stats = np.empty((B, 4))
        kernels.softmax_stats(logits, np.zeros_like(logits), n_own, rowmax, stats)
        ptr, ent = np.empty(L + 1, np.int64), np.empty(act.size, np.int32)
        kernels.group_by_row(act, stats[:, 2] > 0, ptr, ent)
        rows = np.flatnonzero(np.diff(ptr))
        dh_parts = np.empty((chunks, B, H), np.float32)
        _, _, gW2, gb2, dh_ref = reference_grads(x, W1, b1, ref[0], ref[1], act, n_own)
        kernels.output_rows_adam(h, logits, n_own, stats[:, 0], stats[:, 2], 1.0 / B, ptr, ent, rows, W2, bias, M2,
                                 V2, Mb2, Vb2, T2, lr, beta1, beta2, eps, dh_parts)  # fmt: skip
        np.testing.assert_allclose(dh_parts.sum(axis=0), dh_ref, rtol=1e-4, atol=1e-6)
        assert set(rows) == set(act[n_own > 0].ravel())
        for j in rows:
            rt[j] += 1
            for k, g in enumerate((gW2[j], gb2[j])):
                rm[k][j] = beta1 * rm[k][j] + (1 - beta1) * g
                rv[k][j] = beta2 * rv[k][j] + (1 - beta2) * g * g
                ref[k][j] -= lr * (rm[k][j] / (1 - beta1 ** rt[j])) / (np.sqrt(rv[k][j] / (1 - beta2 ** rt[j])) + eps)
        np.testing.assert_allclose(M2, rm[0], rtol=1e-4, atol=1e-7)
        np.testing.assert_allclose(W2, ref[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(bias, ref[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(T2, rt)
    assert (rt == 0).any() or (rt != rt.max()).any()  # some rows were skipped by some steps


@pytest.mark.parametrize("lr_decay", [0.0, 20.0])
def test_caught_up_lazy_adam_follows_dense_adam(lr_decay: float) -> None:
    """Rows touched now and then, caught up before each read and updated at the global step, are where dense
    Adam (every row every step, zero gradient when untouched) has them -- at every read and at the end."""
    rng = np.random.default_rng(11)
    n, d, steps = 12, 5, 240
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-8
    touch_p = np.array([1.0, 0.5, 0.2, 0.05, 0.02, 0.01, 0.3, 0.3, 0.1, 0.0, 0.7, 0.04])
    W = rng.standard_normal((n, d)).astype(np.float32)
    M, V, G, T = np.zeros_like(W), np.zeros_like(W), np.zeros_like(W), np.zeros(n, np.int64)
    none = np.zeros(0, np.float32)
    ref, rm, rv = W.astype(np.float64), np.zeros((n, d)), np.zeros((n, d))
    out = np.empty_like(W)
    for t in range(1, steps + 1):
        lr_t = lr / np.sqrt(1 + (t - 1) / lr_decay) if lr_decay else lr
        rows = np.flatnonzero(rng.random(n) < touch_p).astype(np.int64)
        kernels.catch_up_rows(W, M, V, T, rows, t, lr, lr_decay, b1, b2, eps, out[:0], True)
        np.testing.assert_allclose(W[rows], ref[rows], rtol=2e-4, atol=2e-5)  # what the forward pass reads
        g = np.zeros((n, d))
        g[rows] = rng.standard_normal((len(rows), d))
        G[rows] = g[rows]
        kernels.adam_rows(W, M, V, G, none, none, none, none, T, rows, lr_t, b1, b2, eps, t)
        rm, rv = b1 * rm + (1 - b1) * g, b2 * rv + (1 - b2) * g * g
        ref -= lr_t * (rm / (1 - b1**t)) / (np.sqrt(rv / (1 - b2**t)) + eps)
        np.testing.assert_allclose(W[rows], ref[rows], rtol=2e-4, atol=2e-5)
        assert (T[rows] == t).all()
    state = [a.copy() for a in (W, M, V, T)]
    everything = np.arange(n, dtype=np.int64)
    kernels.catch_up_rows(W, M, V, T, everything, steps + 1, lr, lr_decay, b1, b2, eps, out, False)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-5)  # what inference reads
    for a, b in zip((W, M, V, T), state, strict=True):
        np.testing.assert_array_equal(a, b)  # inference leaves the state alone
    assert T[9] == 0 and (out[9] == W[9]).all()  # a row never touched has not moved
    # rows last touched long ago really moved after their last update: momentum, not just the update
    assert np.abs(out - W).max() > 3 * lr  # one Adam step moves a weight by about lr at most


def test_inference_reads_caught_up_input_rows_and_leaves_training_alone(numba_threads) -> None:
    """Evaluating between steps changes nothing in training (bit for bit, one thread), and inference reads W1
    as dense Adam has it now: rows of features absent from the last steps have still moved."""
    with numba_threads(1):
        data = generate(400, 300, 200, seed=6)
        cfg = ModelConfig(300, 200, hidden=16, budget=32, tables=2, blocks=2)
        quiet, evaluated = SlideModel(cfg), SlideModel(cfg)
        for s in range(15):
            rows = np.arange(s * 24, s * 24 + 24, dtype=np.int64) % 400
            quiet.train_step(data, rows)
            evaluated.train_step(data, rows)
            if s % 4 == 1:
                evaluated.evaluate(data, 50)
        after = evaluated.state()
        for name, arr in quiet.state().items():
            np.testing.assert_array_equal(arr, after[name], err_msg=name)
        now = quiet._inference_W1()
        assert np.abs(now - quiet.W1).max() > 0.1 * cfg.lr  # momentum moved rows the last step did not touch
        quiet._catch_up(np.arange(300, dtype=np.int64))  # the same catch-up, committed
        np.testing.assert_allclose(now, quiet.W1, rtol=1e-6, atol=1e-7)
        assert quiet._inference_W1() is now  # computed once per step


@pytest.mark.parametrize(
    ("budget", "threads", "fill_power"), [(12, 1, 1.0), (12, 2, 1.0), (64, 1, 1.0), (200, 2, 1.0), (64, 2, 0.0)]
)
def test_selection_is_exact_distinct_labels_first_and_deterministic(numba_threads, budget: int, threads: int,
                                                                    fill_power: float):
    with numba_threads(threads):
        data = generate(64, 300, 200, seed=2)
        cfg = ModelConfig(300, 200, hidden=16, budget=budget, tables=4, bucket_cap=8, blocks=4, fill_power=fill_power)
        model = SlideModel(cfg)
        rows = np.arange(64, dtype=np.int64)
        _, h = model._hidden(data, rows)
        active, n_own, corr = model._select(data, rows, h, True, 7)
        again, _, again_corr = model._select(data, rows, h, True, 7)
        np.testing.assert_array_equal(corr, again_corr)
        np.testing.assert_array_equal(active, again)
        shares = block_shares(cfg)
        assert active.shape == (64, shares.sum()) and shares.sum() == min(budget // 4 * 4, 200)
        bounds = block_bounds(200, 4)
        for i in rows:
            assert len(set(active[i].tolist())) == active.shape[1]
            labels = data.y_indices[data.y_indptr[i] : data.y_indptr[i + 1]]
            # every block selects exactly its share; its labels count against it (the excess is not active)
            per_block = np.histogram(active[i], bounds)[0]
            np.testing.assert_array_equal(per_block, shares)
            labels_per_block = np.histogram(labels, bounds)[0]
            assert n_own[i] == np.minimum(labels_per_block, shares).sum()
            assert set(active[i, : n_own[i]].tolist()) <= set(labels.tolist())
            # the fill correction: none for labels, >= 0 for a block's fill (log(rest / fill) when uniform)
            assert np.all(corr[i, : n_own[i]] == 0) and np.all(corr[i] >= 0)
        assert active.min() >= 0 and active.max() < 200
        assert not model._marks.any()


class _RankOf:
    """Just enough of a comm for a model's constructor and selection: rank ``rank`` of ``size``."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.bytes_sent = rank, size, 0


@pytest.mark.parametrize("family", ["srp", "dwta"])
def test_ranks_select_what_one_process_selects(numba_threads, family: str) -> None:
    """The union of P ranks' active sets is the one-process active set, sample by sample, after a rehash too
    (tables, pools and streams are keyed by block, never by rank)."""
    with numba_threads(1):
        data = generate(64, 300, 240, seed=4)
        cfg = ModelConfig(300, 240, hidden=16, budget=24, tables=4, bucket_cap=8, blocks=4, hash=family)
        rows = np.arange(64, dtype=np.int64)
        serial = SlideModel(cfg)
        _, h = serial._hidden(data, rows)
        moved = serial.W2 + np.random.default_rng(1).standard_normal(serial.W2.shape).astype(np.float32)
        for rehash in (False, True):
            if rehash:
                serial.W2[...] = moved
                serial.index.rehash(serial.W2, np.arange(0, 240, 3))
            want, _, _ = serial._select(data, rows, h, True, 9)
            for size in (2, 4):
                parts = []
                for r in range(size):
                    m = SlideModel(cfg, _RankOf(r, size))
                    if rehash:
                        m.W2[...] = moved[m.l_lo : m.l_hi]
                        m.index.rehash(m.W2, np.flatnonzero(np.arange(m.l_lo, m.l_hi) % 3 == 0))
                    got, _, _ = m._select(data, rows, h, True, 9)
                    assert got.shape[1] * size == want.shape[1]
                    parts.append(got + m.l_lo)
                union = np.sort(np.concatenate(parts, axis=1), axis=1)
                np.testing.assert_array_equal(union, np.sort(want, axis=1), err_msg=f"P={size} rehash={rehash}")


def test_lsh_candidates_take_at_most_their_share_and_the_fill_is_corrected(numba_threads) -> None:
    """With lsh_frac f a block takes at most floor(f * share) LSH candidates; the rest of its share is fill,
    whose correction log(rest / fill) is positive (uniform fill): LSH candidates are exactly the
    uncorrected non-labels."""
    with numba_threads(1):
        data = generate(64, 300, 400, seed=3)
        cfg = ModelConfig(300, 400, hidden=16, budget=64, tables=8, k=3, blocks=2, fill_power=0.0, lsh_frac=0.25)
        model = SlideModel(cfg)
        rows = np.arange(64, dtype=np.int64)
        _, h = model._hidden(data, rows)
        active, n_own, corr = model._select(data, rows, h, True, 3)
        bounds = block_bounds(400, 2)
        n_lsh = []
        for i in rows:
            rest = active[i, n_own[i] :]
            lsh = rest[corr[i, n_own[i] :] == 0]
            per_block = np.histogram(lsh, bounds)[0]
            assert np.all(per_block <= 8)  # floor(0.25 * 32)
            n_lsh.append(len(lsh))
        assert max(n_lsh) == 16  # 3-bit codes over 200 neurons per block: the tables find plenty


@pytest.mark.parametrize("fill_power", [0.0, 1.0])
def test_a_budget_of_every_label_is_the_exact_softmax(fill_power: float) -> None:
    """With every output neuron active the fill stands for nothing else: no correction, every label once."""
    data = generate(40, 300, 90, seed=4)
    cfg = ModelConfig(300, 90, hidden=16, budget=96, tables=2, blocks=3, fill_power=fill_power)
    model = SlideModel(cfg)
    model.label_count[:10] = 50  # unequal fill weights, as after some training
    model._fill_weight[:] = (model.label_count + 1.0) ** max(fill_power, 0.0)
    rows = np.arange(40, dtype=np.int64)
    _, h = model._hidden(data, rows)
    active, _, corr = model._select(data, rows, h, True, 0)
    assert (np.sort(active, axis=1) == np.arange(90)).all()
    assert not corr.any()


@pytest.mark.parametrize("batch_budget", [0, 24])
def test_every_label_active_trains_exactly_the_dense_network(numba_threads, batch_budget: int) -> None:
    """With the whole output layer active, dslide's steps -- selection, the softmax, the gradients, lazy Adam
    on W2, the caught-up Adam on W1, the lr schedule -- are dense Adam on the dense network (float64 reference):
    per-sample active sets, or one shared by the batch (``batch_budget``) whose products are BLAS's."""
    with numba_threads(1):
        n_feat, n_lab = 400, 24
        data = generate(48, n_feat, n_lab, seed=8)
        cfg = ModelConfig(n_feat, n_lab, hidden=8, budget=24, tables=2, blocks=2, lr=1e-2, lr_decay=5.0,
                          batch_budget=batch_budget)  # fmt: skip
        model = SlideModel(cfg)
        x = np.zeros((len(data), n_feat))
        for r in range(len(data)):
            sl = slice(data.x_indptr[r], data.x_indptr[r + 1])
            x[r, data.x_indices[sl]] = data.x_values[sl]
        params = [p.astype(np.float64) for p in (model.W1, model.b1, model.W2, model.b2)]
        moments = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
        rng = np.random.default_rng(0)
        for t in range(1, 9):
            rows = np.sort(rng.choice(len(data), 12, replace=False)).astype(np.int64)
            model.train_step(data, rows)
            active = np.empty((12, n_lab), np.int64)
            n_own = np.empty(12, np.int64)
            for i, r in enumerate(rows):
                labels = data.y_indices[data.y_indptr[r] : data.y_indptr[r + 1]]
                active[i] = np.concatenate([labels, np.setdiff1d(np.arange(n_lab), labels)])
                n_own[i] = len(labels)
            grads = reference_grads(x[rows], *params, active, n_own)[:4]
            lr_t = cfg.lr / np.sqrt(1 + (t - 1) / cfg.lr_decay)
            for p, g, (m, v) in zip(params, grads, moments, strict=True):
                m[...] = cfg.beta1 * m + (1 - cfg.beta1) * g
                v[...] = cfg.beta2 * v + (1 - cfg.beta2) * g * g
                p -= lr_t * (m / (1 - cfg.beta1**t)) / (np.sqrt(v / (1 - cfg.beta2**t)) + cfg.eps)
        got = (model._inference_W1(), model.b1, model.W2, model.b2)
        for name, a, want in zip(("W1", "b1", "W2", "b2"), got, params, strict=True):
            np.testing.assert_allclose(a, want, rtol=1e-4, atol=2e-5, err_msg=name)
        assert np.abs(params[0] - model.W1).max() > 1e-3  # W1 rows idle in the last steps had moved meanwhile


def test_frequency_fill_counts_targets_and_draws_frequent_labels_more(numba_threads) -> None:
    with numba_threads(1):
        data = generate(256, 300, 400, seed=4)
        cfg = ModelConfig(300, 400, hidden=16, budget=32, tables=0, blocks=2, fill_power=1.0)
        model = SlideModel(cfg)
        rows = np.arange(256, dtype=np.int64)
        model.train_step(data, rows)
        np.testing.assert_array_equal(model.label_count, data.label_counts())
        np.testing.assert_allclose(model._fill_weight, data.label_counts() + 1.0)
        _, h = model._hidden(data, rows)
        active, _, corr = model._select(data, rows, h, False, 11)
        drawn = np.bincount(active.ravel(), minlength=400)
        counts = data.label_counts()
        frequent, never = counts >= np.sort(counts)[-20], counts == 0
        assert drawn[frequent].mean() > 3 * drawn[never].mean()
        # a frequent label stands for fewer of the rest than a never-seen one
        c_of = {}
        for i in range(len(rows)):
            for q in range(active.shape[1]):
                c_of[int(active[i, q])] = float(corr[i, q])
        f = [c_of[j] for j in np.flatnonzero(frequent) if j in c_of]
        z = [c_of[j] for j in np.flatnonzero(never) if j in c_of]
        assert f and z and max(f) < min(z)


def test_lr_decay_scales_the_adam_step() -> None:
    """A row's first Adam update moves each weight by the step's lr: lr / sqrt(1 + step / lr_decay)."""
    data = generate(64, 300, 200, seed=5)
    rows = np.arange(64, dtype=np.int64)
    for decay, step, want in ((0.0, 300, 1e-2), (100.0, 0, 1e-2), (100.0, 300, 5e-3)):
        model = SlideModel(ModelConfig(300, 200, hidden=16, budget=32, tables=2, blocks=2, lr=1e-2, lr_decay=decay))
        model.step, model.next_rehash = step, 10**9
        before = model.W2.copy()
        model.train_step(data, rows)
        assert abs(np.abs(model.W2 - before).max() - want) < 1e-3 * want


def test_configs_from_before_the_options_keep_what_they_trained_with() -> None:
    d = ModelConfig(300, 200).to_json()
    for name in ("lsh_center", "lsh_frac", "fill_power", "lr_decay", "dense_adam_in"):
        del d[name]
    old = ModelConfig.from_json(d)
    got = (old.lsh_center, old.lsh_frac, old.fill_power, old.lr_decay, old.dense_adam_in)
    assert got == (False, 1.0, 0.0, 0.0, False)


def test_weighted_pool_draws_by_weight() -> None:
    w = np.random.default_rng(1).zipf(1.5, 500).astype(np.float64)
    w[:3] = [1000.0, 0.5, 3.0]
    pool, log1m_q = np.empty(1_000_000, np.int32), np.empty(1_000_000, np.float32)
    kernels.weighted_pool(w, np.uint64(12345), pool, log1m_q)
    q = w / w.sum()
    freq = np.bincount(pool, minlength=500) / len(pool)
    assert 0.5 * np.abs(freq - q).sum() < 0.003  # total variation: sampling noise only
    np.testing.assert_allclose(log1m_q, np.log1p(-np.minimum(q[pool], 0.5)), rtol=1e-5)
    again = np.empty_like(pool)
    kernels.weighted_pool(w, np.uint64(12345), again, np.empty_like(log1m_q))
    np.testing.assert_array_equal(pool, again)


def test_top_k_rows_is_a_stable_descending_sort_cut_at_k():
    rng = np.random.default_rng(3)
    scores = rng.standard_normal((40, 300)).astype(np.float32)
    scores[0, 10:20] = 9.0  # ties: the lower index first, as a stable sort
    top_s, top_i = np.empty((40, 5), np.float32), np.empty((40, 5), np.int64)
    kernels.top_k_rows(scores, top_s, top_i)
    expect = np.argsort(-scores, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(top_i, expect)
    np.testing.assert_array_equal(top_s, np.take_along_axis(scores, expect, axis=1))
    short_s, short_i = np.empty((2, 4), np.float32), np.empty((2, 4), np.int64)
    kernels.top_k_rows(np.array([[1.0, 3.0], [2.0, 2.0]], np.float32), short_s, short_i)
    np.testing.assert_array_equal(short_i, [[1, 0, -1, -1], [0, 1, -1, -1]])


def test_validate_is_exact_inference_p_at_1_and_full_softmax_cross_entropy():
    data = generate(300, 60, 40, seed=2)
    model = SlideModel(ModelConfig(n_features=60, n_labels=40, hidden=8, budget=16, tables=2, seed=1))
    for start in range(0, 300, 50):
        model.train_step(data, np.arange(start, start + 50))
    got = model.validate(data, 120, batch=32)
    _, h = model._hidden(data, np.arange(120), model._inference_W1())
    scores = (h @ model.W2.T + model.b2).astype(np.float64)
    lse = np.log(np.exp(scores - scores.max(1, keepdims=True)).sum(1)) + scores.max(1)
    losses, hits = [], 0
    for r in range(120):
        labels = data.y_indices[data.y_indptr[r] : data.y_indptr[r + 1]]
        hits += int(np.argmax(scores[r]) in labels)
        if len(labels):
            losses.append(lse[r] - scores[r, labels].mean())
    assert got["eval_points"] == 120
    assert got["p_at_1"] == pytest.approx(hits / 120)
    assert got["p_at_1"] == pytest.approx(model.evaluate(data, 120)["p_at_1"])
    assert got["loss"] == pytest.approx(np.mean(losses), rel=1e-5)

"""The numba kernels of one training step: pure functions of arrays, no comm, no Python objects.

Each kernel is one phase between two collectives (see :mod:`dslide.model`).  Work is split per sample with
``prange``; the gradient accumulations into shared ``g*`` rows are HOGWILD (threads may race on a row, as in
SLIDE, which trades a few lost updates for no locks).  With one thread every loop runs in order, so a seed
gives the same bits every run.

Shapes: ``B`` samples in the batch, ``H`` the full hidden width, ``Hl`` this rank's hidden slice, ``b`` active
output neurons per sample on this rank; neuron ids inside kernels are local to the rank.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from dslide.lsh import table_code
from dslide.rand import key2, next_u64, uniform_below

_TWO_M53 = 1.0 / 9007199254740992.0

__all__ = [
    "active_logits",
    "adam_rows",
    "batch_codes",
    "catch_up_rows",
    "group_by_row",
    "hidden_backward",
    "hidden_forward",
    "mark_features",
    "output_rows_adam",
    "score_stats",
    "select_active",
    "select_shared",
    "shared_delta",
    "shared_label_stats",
    "softmax_stats",
    "step_lr",
    "top_k_rows",
    "weighted_pool",
    "weighted_pools",
]


@njit(parallel=True, fastmath=True, cache=True)
def hidden_forward(rows, x_indptr, x_indices, x_values, W1, b1, out):
    """``out[i] = relu(x[rows[i]] @ W1 + b1)`` for a sparse x; W1 is (F, Hl)."""
    Hl = W1.shape[1]
    for i in prange(rows.shape[0]):
        r = rows[i]
        acc = out[i]
        for d in range(Hl):
            acc[d] = b1[d]
        for p in range(x_indptr[r], x_indptr[r + 1]):
            v = x_values[p]
            w = W1[x_indices[p]]
            for d in range(Hl):
                acc[d] += v * w[d]
        for d in range(Hl):
            if acc[d] < 0:
                acc[d] = 0


@njit(parallel=True, fastmath=True, cache=True)
def select_active(
    h,
    rows,
    y_indptr,
    y_indices,
    use_labels,
    label_lo,
    blocks,
    share,
    family,
    srp,
    dwta,
    k,
    n_tables,
    n_codes,
    offsets,
    fill,
    items,
    pools,
    pool_ptr,
    pool_lw,
    keys,
    marks,
    code_scratch,
    count_scratch,
    lsh_cap,
    correct,
    active,
    n_own,
    corr,
):
    """Fill ``active[i]`` with exactly ``sum(share)`` distinct local neurons for sample i.

    The rank's neurons fall into selection blocks (local bounds ``blocks``); block ``g`` contributes exactly
    ``share[g]`` neurons, chosen as the same block would choose them on any other rank count: the sample's true
    labels in the block (at most ``share[g]``; the rest are not active), then LSH candidates from the block's
    buckets of ``h[i]`` in every table (at most ``lsh_cap[g]``: a reservoir sample when more are found), then a
    fill from the block's random ``pools[pool_ptr[g]:pool_ptr[g+1]]`` of the step (a window of it from a random
    start), and, if even that runs dry, consecutive neurons of the block from a random start.  Every draw comes
    from the stream ``(keys[g], i)``.  Row order: all own labels first (``n_own[i]`` of them), then block by
    block.  ``marks`` / ``*_scratch`` are per-chunk scratch (one row per chunk of samples); ``marks`` is all
    zero on entry and exit.

    ``corr[i, q]`` is what the softmax adds to the logit of ``active[i, q]``: 0 for labels and LSH candidates
    (taken as they are), and with ``correct`` the log of how many neurons of the rest a fill neuron stands for
    -- so the sum of the fill's exps estimates the rest's share of the full softmax normaliser (the
    sampled-softmax importance correction).  A uniform pool (``pool_lw`` empty): ``log(rest / n_fill)`` for
    the ``n_fill`` fill neurons of a block standing in for the ``rest`` of the block not already active.  A
    weighted pool (i.i.d. draws by q, ``pool_lw`` = log(1 - q_j) of each entry): ``-log(1 - (1 - q_j)^v)``, one
    over the chance that j is among the ``v`` draws the fill read (Horvitz-Thompson).
    """
    B, b = active.shape
    n_blocks = blocks.shape[0] - 1
    n_chunks = marks.shape[0]
    for c in prange(n_chunks):
        mark = marks[c]
        codes = code_scratch[c]
        in_block = count_scratch[c]
        for i in range(c, B, n_chunks):
            row = active[i]
            cnt = 0
            for g in range(n_blocks):
                in_block[g] = 0
            if use_labels:
                r = rows[i]
                for p in range(y_indptr[r], y_indptr[r + 1]):
                    j = y_indices[p] - label_lo
                    if j < 0 or j >= blocks[n_blocks] or mark[j] != 0:
                        continue
                    g = 0
                    while blocks[g + 1] <= j:
                        g += 1
                    if in_block[g] < share[g]:
                        mark[j] = 1
                        row[cnt] = j
                        cnt += 1
                        in_block[g] += 1
            n_own[i] = cnt
            x = h[i]
            for t in range(n_tables):
                codes[t] = table_code(family, srp, dwta, k, t, x)
            for q in range(b):
                corr[i, q] = 0
            for g in range(n_blocks):
                need = share[g] - in_block[g]
                goal = cnt + need
                state = key2(keys[g], i)
                lneed = min(need, lsh_cap[g])
                if lneed > 0 and n_tables > 0:
                    got = 0
                    seen = 0
                    for t in range(n_tables):
                        bucket = g * n_codes + codes[t]
                        start = offsets[t, bucket]
                        for q in range(start, start + fill[t, bucket]):
                            j = items[q]
                            if mark[j] != 0:
                                continue
                            seen += 1
                            if got < lneed:
                                mark[j] = 1
                                row[cnt + got] = j
                                got += 1
                            else:
                                state, rv = next_u64(state)
                                s = uniform_below(rv, seen)
                                if s < lneed:
                                    mark[row[cnt + s]] = 0
                                    mark[j] = 1
                                    row[cnt + s] = j
                    cnt += got
                rest = (blocks[g + 1] - blocks[g]) - in_block[g] - (cnt - (goal - need))
                state = _fill(row, corr[i], mark, cnt, goal, blocks[g], blocks[g + 1], pools, pool_ptr[g],
                              pool_ptr[g + 1], pool_lw, state, correct, rest)  # fmt: skip
                cnt = goal
            for q in range(b):
                mark[row[q]] = 0


@njit(cache=True, inline="always")
def _fill(row, corr, mark, cnt, goal, lo, hi, pools, p0, p1, pool_lw, state, correct, rest):
    """Fill ``row[cnt:goal]`` with unmarked neurons of the block ``[lo, hi)`` (marking them): a window of the
    pool ``pools[p0:p1]`` from a random start, then, if that runs dry, consecutive neurons from a random start;
    ``corr[cnt:goal]`` gets their fill correction (see :func:`select_active`), ``rest`` being the block's
    neurons that are neither labels nor LSH candidates.  Draws continue the stream ``state``; returns it."""
    fill_from = cnt
    npool = p1 - p0
    weighted = pool_lw.shape[0] > 0
    visited = 0  # pool entries (draws) read, repeats and already active neurons included
    if cnt < goal and npool > 0:
        state, rv = next_u64(state)
        start = uniform_below(rv, npool)
        for q in range(npool):
            if cnt >= goal:
                break
            visited += 1
            pq = p0 + (start + q) % npool
            j = pools[pq]
            if mark[j] == 0:
                mark[j] = 1
                row[cnt] = j
                corr[cnt] = 0
                if weighted:
                    corr[cnt] = pool_lw[pq]  # log(1 - q_j), turned into the correction below
                cnt += 1
    if cnt < goal:
        size = hi - lo
        state, rv = next_u64(state)
        start = uniform_below(rv, size)
        q = 0
        while cnt < goal:
            j = lo + (start + q) % size
            if mark[j] == 0:
                mark[j] = 1
                row[cnt] = j
                corr[cnt] = 0
                cnt += 1
            q += 1
    n_fill = goal - fill_from
    if weighted:
        # the pool is i.i.d. draws from q and the fill is what `visited` of them hold: neuron j of the rest is in
        # it with P_j = 1 - (1 - q_j)^visited and stands for 1 / P_j (Horvitz-Thompson); a fill that holds all of
        # the rest stands for itself
        for q in range(fill_from, goal):
            v = 0.0
            if correct and rest > n_fill and corr[q] < 0:
                v = -math.log(-math.expm1(visited * corr[q]))
            corr[q] = np.float32(v) if v > 0 else np.float32(0.0)
    elif correct and n_fill > 0 and rest > n_fill:
        c = np.float32(math.log(rest / n_fill))
        for q in range(fill_from, goal):
            corr[q] = c
    return state


@njit(parallel=True, fastmath=True, cache=True)
def batch_codes(family, srp, dwta, k, h, codes):
    """``codes[i, t]`` = the bucket of ``h[i]`` in table t, for every sample and table."""
    for i in prange(h.shape[0]):
        for t in range(codes.shape[1]):
            codes[i, t] = table_code(family, srp, dwta, k, t, h[i])


@njit(parallel=True, cache=True)
def select_shared(
    rows, y_indptr, y_indices, use_labels, label_lo, blocks, share, codes, n_codes, offsets, fill, items, pools,
    pool_ptr, pool_lw, keys, lsh_cap, correct, mark, pos, hits, cand, active, corr, lab_ptr, lab_pos,
):  # fmt: skip
    """One active set shared by the whole batch: ``active`` gets exactly ``sum(share)`` distinct local neurons,
    block ``g`` the ``share[g]`` of them from ``sum(share[:g])`` on, chosen as the block would choose them on
    any rank count.  Per block: the batch's labels in it (in sample order, at most ``share[g]``; the rest are not
    active), then at most ``lsh_cap[g]`` LSH candidates -- the neurons that most (sample, table) pairs of the
    batch hash to (``codes`` from :func:`batch_codes`; ties by first hit) -- then a fill from the block's pool
    as in :func:`select_active` (a window of ``pools[pool_ptr[g]:pool_ptr[g + 1]]`` from a random start drawn
    from ``keys[g]``; consecutive neurons if it runs dry).  ``corr[s]`` is the fill correction of entry s, as
    :func:`select_active` computes it (0 for labels and LSH candidates).  Sample i's labels among the active
    neurons are at ``active[lab_pos[lab_ptr[i]:lab_ptr[i + 1]]]``.  ``mark`` (0), ``pos`` (-1), ``hits`` (0) and
    ``cand`` are scratch over the rank's neurons (a block uses only its own range), all but ``cand`` left as found.
    """
    n_blocks = blocks.shape[0] - 1
    B = rows.shape[0]
    n_tables = codes.shape[1]
    for g in prange(n_blocks):
        base = 0
        for gg in range(g):
            base += share[gg]
        goal = base + share[g]
        lo, hi = blocks[g], blocks[g + 1]
        cnt = base
        if use_labels:
            for i in range(B):
                r = rows[i]
                for p in range(y_indptr[r], y_indptr[r + 1]):
                    j = y_indices[p] - label_lo
                    if cnt < goal and lo <= j < hi and mark[j] == 0:
                        mark[j] = 1
                        pos[j] = cnt
                        active[cnt] = j
                        corr[cnt] = 0
                        cnt += 1
        lneed = min(goal - cnt, lsh_cap[g])
        if lneed > 0 and n_tables > 0:
            # count the (sample, table) pairs of the batch that hash to each candidate, listed at its first hit
            n_cand = 0
            top = 0
            for t in range(n_tables):
                for i in range(B):
                    bucket = g * n_codes + codes[i, t]
                    start = offsets[t, bucket]
                    for q in range(start, start + fill[t, bucket]):
                        j = items[q]
                        if mark[j] != 0:
                            continue
                        if hits[j] == 0:
                            cand[lo + n_cand] = j
                            n_cand += 1
                        hits[j] += 1
                        top = max(top, hits[j])
            # keep the lneed most-hit (ties: first hit first): all above the threshold, then some at it
            hist = np.zeros(top + 1, np.int64)
            for s in range(n_cand):
                hist[hits[cand[lo + s]]] += 1
            thr = top
            above = hist[top]
            while thr > 1 and above < lneed:
                thr -= 1
                above += hist[thr]
            for tie in range(2):
                for s in range(n_cand):
                    j = cand[lo + s]
                    if (hits[j] > thr if tie == 0 else hits[j] == thr) and lneed > 0:
                        mark[j] = 1
                        active[cnt] = j
                        corr[cnt] = 0
                        cnt += 1
                        lneed -= 1
            for s in range(n_cand):
                hits[cand[lo + s]] = 0
        _fill(active, corr, mark, cnt, goal, lo, hi, pools, pool_ptr[g], pool_ptr[g + 1], pool_lw, key2(keys[g], 0),
              correct, (hi - lo) - (cnt - base))  # fmt: skip
    # every sample's labels among the active neurons
    lab_ptr[0] = 0
    n = 0
    for i in range(B):
        if use_labels:
            r = rows[i]
            for p in range(y_indptr[r], y_indptr[r + 1]):
                j = y_indices[p] - label_lo
                if 0 <= j < pos.shape[0] and pos[j] >= 0:
                    dup = False
                    for pp in range(lab_ptr[i], n):
                        dup = dup or lab_pos[pp] == pos[j]
                    if not dup:
                        lab_pos[n] = pos[j]
                        n += 1
        lab_ptr[i + 1] = n
    for s in range(active.shape[0]):
        mark[active[s]] = 0
        pos[active[s]] = -1


@njit(parallel=True, cache=True)
def shared_label_stats(logits, lab_ptr, lab_pos, top, gmax, stats):
    """The label columns of :func:`softmax_stats`'s ``stats`` for an active set shared by the batch (``logits``
    B x n over the same n neurons for every sample; sample i's labels at the columns ``lab_pos[lab_ptr[i]:
    lab_ptr[i + 1]]``, ``top[i]`` its best column): ``stats[i, 1:4]`` = (sum of its label logits, their number,
    1 if its top logit is a label and the global maximum ``gmax[i]``).  The sums of exps are numpy's."""
    for i in prange(logits.shape[0]):
        ls = 0.0
        is_top = False
        for p in range(lab_ptr[i], lab_ptr[i + 1]):
            ls += logits[i, lab_pos[p]]
            is_top = is_top or lab_pos[p] == top[i]
        stats[i, 1] = ls
        stats[i, 2] = lab_ptr[i + 1] - lab_ptr[i]
        stats[i, 3] = 1.0 if is_top and logits[i, top[i]] >= gmax[i] else 0.0


@njit(parallel=True, fastmath=True, cache=True)
def shared_delta(expz, norm, n_labels, lab_ptr, lab_pos, scale):
    """dL/dz of the softmax cross-entropy over a shared active set, in place of ``expz`` (the corrected exps):
    ``scale * (expz / norm - [label] / n_labels)``; 0 for unlabelled samples."""
    B, n = expz.shape
    for i in prange(B):
        f = np.float32(scale / norm[i]) if n_labels[i] > 0 else np.float32(0)
        for q in range(n):
            expz[i, q] *= f
        if n_labels[i] > 0:
            pull = np.float32(scale / n_labels[i])
            for p in range(lab_ptr[i], lab_ptr[i + 1]):
                expz[i, lab_pos[p]] -= pull


@njit(cache=True, inline="always")
def _alias_sort(j, p, small, large, ns, nl):
    """Push ``j`` on the alias method's under-full (p < 1) or over-full stack; the new stack heights."""
    if p[j] < 1.0:
        small[ns] = j
        return ns + 1, nl
    large[nl] = j
    return ns, nl + 1


@njit(cache=True)
def weighted_pool(weights, key, pool, log1m_q):
    """``pool[s]`` = i.i.d. draws of indices j with probability q_j = weights[j] / sum(weights), from the
    stream ``key`` (Vose's alias method: O(1) a draw); ``log1m_q[s] = log(1 - q_j)`` (q capped at 1/2)."""
    n = weights.shape[0]
    total = 0.0
    for j in range(n):
        total += weights[j]
    p = np.empty(n, np.float64)
    prob = np.ones(n, np.float64)
    alias = np.arange(n)
    small = np.empty(n, np.int64)
    large = np.empty(n, np.int64)
    ns = 0
    nl = 0
    for j in range(n):
        p[j] = weights[j] * n / total
        ns, nl = _alias_sort(j, p, small, large, ns, nl)
    while ns > 0 and nl > 0:
        ns -= 1
        nl -= 1
        a = small[ns]
        z = large[nl]
        prob[a] = p[a]
        alias[a] = z
        p[z] = (p[z] + p[a]) - 1.0
        ns, nl = _alias_sort(z, p, small, large, ns, nl)
    state = np.uint64(key)
    for s in range(pool.shape[0]):
        state, rv = next_u64(state)
        col = uniform_below(rv, n)
        state, rv = next_u64(state)
        j = col if np.float64(rv >> np.uint64(11)) * _TWO_M53 < prob[col] else alias[col]
        pool[s] = j
        log1m_q[s] = math.log1p(-min(weights[j] / total, 0.5))


@njit(parallel=True, cache=True)
def weighted_pools(weights, bounds, keys, ptr, pool, log1m_q):
    """:func:`weighted_pool` for every block at once (in parallel): block g draws ``pool[ptr[g]:ptr[g + 1]]``
    (indices local to the block) from ``weights[bounds[g]:bounds[g + 1]]`` with the stream ``keys[g]``."""
    for g in prange(bounds.shape[0] - 1):
        weighted_pool(
            weights[bounds[g] : bounds[g + 1]], keys[g], pool[ptr[g] : ptr[g + 1]], log1m_q[ptr[g] : ptr[g + 1]]
        )


@njit(parallel=True, fastmath=True, cache=True)
def active_logits(h, active, W2, b2, logits, rowmax):
    """Logits of the active neurons and each row's local maximum (for the global max across ranks)."""
    B, b = active.shape
    H = h.shape[1]
    for i in prange(B):
        x = h[i]
        m = -np.inf
        for q in range(b):
            j = active[i, q]
            w = W2[j]
            s = b2[j]
            for d in range(H):
                s += w[d] * x[d]
            logits[i, q] = s
            if s > m:
                m = s
        rowmax[i] = m


@njit(parallel=True, fastmath=True, cache=True)
def softmax_stats(logits, corr, n_own, gmax, stats):
    """Turn logits into ``exp(z + corr - gmax)`` in place (``corr``: :func:`select_active`'s fill correction);
    ``stats[i]`` = (sum of exps, sum of own label logits, number of own labels, 1 if this rank's top active
    logit -- uncorrected -- is an own label and the global maximum).  Summed over ranks, these give the
    softmax normaliser, the loss, and whether the top active neuron is a label (``train_err``)."""
    B, b = logits.shape
    for i in prange(B):
        s = 0.0
        ls = 0.0
        top = 0
        best = -np.inf
        for q in range(b):
            z = logits[i, q]
            if z > best:
                best = z
                top = q
            if q < n_own[i]:
                ls += z
            e = math.exp(z + corr[i, q] - gmax[i])
            logits[i, q] = e
            s += e
        stats[i, 0] = s
        stats[i, 1] = ls
        stats[i, 2] = n_own[i]
        stats[i, 3] = 1.0 if b > 0 and top < n_own[i] and best >= gmax[i] else 0.0


@njit(cache=True)
def group_by_row(active, live, ptr, ent):
    """The active entries of the ``live`` samples grouped by output row (a counting sort): row ``j``'s entries
    are ``ent[ptr[j]:ptr[j + 1]]``, each ``i * b + q`` for ``active[i, q] == j``, in sample order."""
    B, b = active.shape
    ptr[:] = 0
    for i in range(B):
        if live[i]:
            for q in range(b):
                ptr[active[i, q] + 1] += 1
    for j in range(ptr.shape[0] - 1):
        ptr[j + 1] += ptr[j]
    fill = ptr[:-1].copy()
    for i in range(B):
        if live[i]:
            for q in range(b):
                j = active[i, q]
                ent[fill[j]] = i * b + q
                fill[j] += 1


@njit(parallel=True, fastmath=True, cache=True)
def output_rows_adam(
    h, expz, n_own, norm, n_labels, scale, ptr, ent, rows, W2, b2, M2, V2, Mb2, Vb2, T2, lr, beta1, beta2, eps, dh_parts
):
    """The output layer's backward pass and its lazy Adam update, one touched row at a time.

    Softmax cross-entropy over the active set, target uniform over the sample's labels: the entry ``(i, q)``
    (row ``j``) has ``delta = scale * (expz[i, q] / norm[i] - [q < n_own[i]] / n_labels[i])``.  Row ``j``'s
    gradient ``sum delta * h[i]`` is summed in registers and goes straight into Adam (per-row step count in
    ``T2``), so each touched row of W2, M2, V2 is read and written once and no full-size gradient array
    exists; the row's old weights give this rank's share of dL/dh, summed per thread chunk into
    ``dh_parts[c]`` (the caller adds the chunks).  ``rows`` are the rows with entries (``ptr``/``ent`` from
    :func:`group_by_row`), each once.  With one chunk every sum runs in a fixed order.
    """
    C = dh_parts.shape[0]
    b = expz.shape[1]
    H = h.shape[1]
    n = rows.shape[0]
    for c in prange(C):
        dh = dh_parts[c]
        dh[:] = 0
        g = np.empty(H, np.float32)
        for r in range(n * c // C, n * (c + 1) // C):
            j = rows[r]
            w = W2[j]
            g[:] = 0
            gb = np.float32(0)
            for p in range(ptr[j], ptr[j + 1]):
                e = ent[p]
                i = e // b
                q = e - i * b
                delta = expz[i, q] / norm[i]
                if q < n_own[i]:
                    delta -= 1.0 / n_labels[i]
                df = np.float32(delta * scale)
                x = h[i]
                out = dh[i]
                for d in range(H):
                    out[d] += df * w[d]
                    g[d] += df * x[d]
                gb += df
            t = T2[j] + 1
            T2[j] = t
            _adam_row(w, M2[j], V2[j], g, t, lr, beta1, beta2, eps, False)
            _adam_bias(b2, Mb2, Vb2, j, gb, t, lr, beta1, beta2, eps)


@njit(cache=True)
def mark_features(rows, x_indptr, x_indices, touched):
    """``touched[f] = 1`` for every non-zero feature f of the samples ``rows``."""
    for i in range(rows.shape[0]):
        r = rows[i]
        for p in range(x_indptr[r], x_indptr[r + 1]):
            touched[x_indices[p]] = 1


@njit(parallel=True, fastmath=True, cache=True)
def hidden_backward(rows, x_indptr, x_indices, x_values, delta, gW1, touched):
    """``gW1[f] += x_f * delta[i]`` for every non-zero feature f of sample i (HOGWILD)."""
    Hl = gW1.shape[1]
    for i in prange(rows.shape[0]):
        r = rows[i]
        dl = delta[i]
        for p in range(x_indptr[r], x_indptr[r + 1]):
            f = x_indices[p]
            v = x_values[p]
            gw = gW1[f]
            for d in range(Hl):
                gw[d] += v * dl[d]
            touched[f] = 1


@njit(cache=True, inline="always")
def _adam_row(w, m, v, g, t, lr, beta1, beta2, eps, clear):
    """Adam step ``t`` (bias correction of step t) of one row; ``clear``: zero its gradient ``g`` after."""
    b1, b2 = np.float32(beta1), np.float32(beta2)
    a1, a2 = np.float32(1.0 - beta1), np.float32(1.0 - beta2)
    e = np.float32(eps)
    # lr * m_hat / (sqrt(v_hat) + eps) with the corrections folded into two per-row float32 scalars
    lr_c1 = np.float32(lr / (1.0 - beta1**t))
    inv_c2 = np.float32(1.0 / (1.0 - beta2**t))
    for d in range(w.shape[0]):
        gd = g[d]
        md = b1 * m[d] + a1 * gd
        vd = b2 * v[d] + a2 * gd * gd
        m[d] = md
        v[d] = vd
        w[d] -= lr_c1 * md / (np.sqrt(vd * inv_c2) + e)
        if clear:
            g[d] = 0


@njit(cache=True, inline="always")
def _adam_bias(bW, bM, bV, j, gd, t, lr, beta1, beta2, eps):
    """Adam step ``t`` of the bias entry ``j`` (in float64 arithmetic)."""
    md = beta1 * bM[j] + (1.0 - beta1) * gd
    vd = beta2 * bV[j] + (1.0 - beta2) * gd * gd
    bM[j] = md
    bV[j] = vd
    bW[j] -= lr * (md / (1.0 - beta1**t)) / (math.sqrt(vd / (1.0 - beta2**t)) + eps)


@njit(parallel=True, fastmath=True, cache=True)
def adam_rows(W, M, V, G, bW, bM, bV, bG, T, rows, lr, beta1, beta2, eps, step=0, gathered=False):
    """Adam on the rows ``rows`` only (lazy), then clear their gradients.

    ``step`` = 0: each row counts its own updates in ``T`` and its bias correction uses that count (a row's
    moments are averages over the steps it was touched).  ``step`` > 0: this is global Adam step ``step``,
    the bias correction is the dense one and ``T[j]`` records ``step`` -- with :func:`catch_up_rows` before
    the rows are read, the rows then follow dense Adam exactly.  ``bW``... are the matching bias entries
    (length 0: none).  ``gathered``: row ``rows[r]``'s gradient is ``G[r]`` (and ``bG[r]``), not ``G[rows[r]]``.
    The output layer's rows are updated by :func:`output_rows_adam` unless the active set is shared by the batch.
    """
    has_bias = bW.shape[0] > 0
    for r in prange(rows.shape[0]):
        j = rows[r]
        t = step if step > 0 else T[j] + 1
        T[j] = t
        gj = np.int64(r) if gathered else np.int64(j)
        _adam_row(W[j], M[j], V[j], G[gj], t, lr, beta1, beta2, eps, True)
        if has_bias:
            _adam_bias(bW, bM, bV, j, bG[gj], t, lr, beta1, beta2, eps)
            bG[gj] = 0


@njit(cache=True)
def step_lr(lr, lr_decay, done):
    """The Adam step size after ``done`` steps: ``lr / sqrt(1 + done / lr_decay)`` (``lr_decay`` 0: ``lr``)."""
    return lr / math.sqrt(1.0 + done / lr_decay) if lr_decay > 0 else lr


@njit(parallel=True, fastmath=True, cache=True)
def catch_up_rows(W, M, V, T, rows, step, lr, lr_decay, beta1, beta2, eps, out, commit):
    """Move the rows ``rows`` to where dense Adam has them before global step ``step``.

    Dense Adam moves every row every step: a step without a gradient still decays the moments and moves the
    row along ``m / sqrt(v)``.  Row j was last updated at step ``T[j]`` (0: never, nothing to do); its missed
    steps s = T[j] + 1 .. step - 1 moved it by ``a_s * m / (sqrt(v) + eps * e_s)``, ``a_s = lr_s sqrt(1 -
    beta2^s) / (1 - beta1^s) * r^n``, ``e_s = sqrt(1 - beta2^s) / beta2^(n/2)``, n = s - T[j], r = beta1 /
    sqrt(beta2), ``lr_s`` :func:`step_lr` of s - 1 -- summed as ``sum(a_s) * m / (sqrt(v) + eps * e)`` with e
    the a-weighted mean of e_s (exact for one missed step, and whenever eps is small against sqrt(v)): two
    scalars per row summed over the steps (to r^n < 1e-9), then one pass over the row.  With ``commit`` the
    rows are moved in place, their moments decayed and ``T[j] = step - 1`` (``out`` unused); without,
    ``out[q]`` gets row ``rows[q]`` moved and the state is left as it is (for inference).
    """
    H = W.shape[1]
    sqrt_b2 = math.sqrt(beta2)
    r_mom = beta1 / sqrt_b2
    for q in prange(rows.shape[0]):
        j = rows[q]
        t0 = T[j]
        w = W[j]
        missed = step - 1 - t0
        if t0 <= 0 or missed <= 0:
            if not commit:
                o = out[q]
                for d in range(H):
                    o[d] = w[d]
            continue
        coef = 0.0
        eps_w = 0.0
        rn = 1.0
        sq2 = 1.0
        p1 = beta1**t0
        p2 = beta2**t0
        for n in range(1, missed + 1):
            rn *= r_mom
            sq2 *= sqrt_b2
            p1 *= beta1
            p2 *= beta2
            a = step_lr(lr, lr_decay, t0 + n - 1) * math.sqrt(1.0 - p2) / (1.0 - p1) * rn
            coef += a
            eps_w += a * math.sqrt(1.0 - p2) / sq2
            if rn < 1e-9:
                break
        c = np.float32(coef)
        e = np.float32(eps * eps_w / coef)
        m = M[j]
        v = V[j]
        if commit:
            d1 = np.float32(beta1**missed)
            d2 = np.float32(beta2**missed)
            for d in range(H):
                w[d] -= c * m[d] / (np.sqrt(v[d]) + e)
                m[d] *= d1
                v[d] *= d2
            T[j] = step - 1
        else:
            o = out[q]
            for d in range(H):
                o[d] = w[d] - c * m[d] / (np.sqrt(v[d]) + e)


@njit(parallel=True, cache=True)
def top_k_rows(scores, top_s, top_i):
    """The ``k = top_s.shape[1]`` largest entries of every row of ``scores``, best first (ties: lower index
    first), into ``top_s``/``top_i``: one pass per row with a sorted k-buffer, ~20x faster than numpy's
    ``argpartition`` for k = 5 over 50,000 labels.  Rows shorter than k leave -inf / -1 in the rest."""
    n, m = scores.shape
    k = top_s.shape[1]
    for r in prange(n):
        for j in range(k):
            top_s[r, j] = -np.inf
            top_i[r, j] = -1
        for c in range(m):
            v = scores[r, c]
            if top_i[r, k - 1] >= 0 and v <= top_s[r, k - 1]:
                continue
            j = k - 1
            while j > 0 and (top_i[r, j - 1] < 0 or v > top_s[r, j - 1]):
                top_s[r, j] = top_s[r, j - 1]
                top_i[r, j] = top_i[r, j - 1]
                j -= 1
            top_s[r, j] = v
            top_i[r, j] = c


@njit(parallel=True, fastmath=True, cache=True)
def score_stats(scores, rows, y_indptr, y_indices, l_lo, rowmax, sumexp, label_sum, label_n, top_s, top_i):
    """Per row of ``scores`` (this rank's labels ``[l_lo, l_lo + n)`` for the points ``rows``): the maximum,
    sum(exp(score - maximum)), the sum and count of the scores of the point's own labels, and the top score and
    its (local) label -- what exact validation needs for P@1 and the full softmax's cross-entropy in one pass."""
    n_rows, n = scores.shape  # n >= 1: a rank owns at least one label
    for i in prange(n_rows):
        best, arg = scores[i, 0], 0  # float32 throughout: exp in single precision is ~2x faster
        for c in range(1, n):
            if scores[i, c] > best:
                best, arg = scores[i, c], c
        acc = 0.0
        for c in range(n):
            acc += np.exp(scores[i, c] - best)
        rowmax[i], sumexp[i], top_s[i], top_i[i] = best, acc, best, arg
        s, cnt = 0.0, 0
        r = rows[i]
        for p in range(y_indptr[r], y_indptr[r + 1]):
            j = y_indices[p] - l_lo
            if 0 <= j < n:
                s += scores[i, j]
                cnt += 1
        label_sum[i], label_n[i] = s, cnt

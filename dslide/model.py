"""The SLIDE network and its optimiser state, sharded over ``comm`` by construction.

Sparse input (F) -> dense hidden layer (H, ReLU) -> output layer (L labels) of which each sample computes
only an active set chosen by LSH.  Rank r of P owns a contiguous slice of the hidden neurons (the columns
``W1[:, h_lo:h_hi]``) and of the output neurons (the rows ``W2[l_lo:l_hi]``), its own LSH tables over its own
output rows, and the Adam state of exactly what it owns; weights never move between ranks.  A step is four
phases with collectives only between them:

1. hidden forward of the own slice -> ``allgather`` -> the full hidden layer (B x H);
2. per sample exactly ``budget // P`` active own neurons (own labels, LSH candidates, random fill, chosen
   block by block -- see below), their logits, ``allreduce_max`` of the row maxima and ``allreduce_sum`` of
   (sum of exps, label logits, label count, top is a label): the softmax over the union of all ranks' active
   sets;
3. output gradients of the own active rows + their lazy Adam update; this rank's share of dL/dh ->
   ``allreduce_sum``;
4. hidden backward of the own slice + lazy Adam on the touched rows of own W1 columns and own bias.

With :class:`~dslide.comm.SerialComm` (P = 1) this is plain SLIDE.  Initial weights are drawn per global
column / row block, so every P starts from the same network.  The kernels are in :mod:`dslide.kernels`.

*Selection blocks* make the random choices independent of P: the labels are cut into ``cfg.blocks`` fixed
contiguous blocks (P must divide ``blocks``; rank r owns a contiguous run of ``blocks / P`` of them, which is
exactly ``shard_bounds(L, P, r)``).  Each block has its own buckets in the LSH tables, its own random-fill
pool and streams keyed by (seed, block, step, sample), and a share of ``budget // blocks`` active neurons per
sample that its true labels count against; the hash width comes from the label count, never from P.  A block therefore
selects the same neurons on any rank count, and P = 1, 2, 4 follow the same trajectory up to the float
rounding of sums over ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numba
import numpy as np

from dslide import kernels
from dslide.comm import Comm, SerialComm
from dslide.data import XCData
from dslide.lsh import FAMILIES, LSHIndex, RehashSchedule, code_bits
from dslide.rand import seed_key

__all__ = ["ModelConfig", "SlideModel", "auto_k", "block_bounds", "block_shares", "initial_weights", "shard_bounds"]

_SHARED_POOL = 4  # with a shared active set, each block's fill pool holds 4 x its share of draws
_W2_INIT_BLOCK = 4096  # rows of W2 drawn from one seeded stream, so any slicing gives the same weights


def shard_bounds(n: int, size: int, rank: int) -> tuple[int, int]:
    """The contiguous slice ``[lo, hi)`` of ``n`` items that ``rank`` of ``size`` owns (sizes differ by <= 1)."""
    return n * rank // size, n * (rank + 1) // size


def auto_k(family: str, n_items: int) -> int:
    """Hash width giving ~16 neurons per bucket: specific enough to mean something, full enough to find some."""
    bits = max(4, min(18, round(math.log2(max(n_items, 16) / 16))))
    return bits if family == "srp" else max(1, round(bits / 3))


def block_bounds(n_labels: int, blocks: int) -> np.ndarray:
    """Global label boundaries of the selection blocks (``blocks + 1`` values, sizes differ by <= 1)."""
    return np.array([n_labels * g // blocks for g in range(blocks + 1)], np.int64)


def block_shares(cfg: ModelConfig, budget: int | None = None) -> np.ndarray:
    """Active neurons of every selection block: ``budget // blocks`` (at least 1), at most the block; the budget
    is ``cfg.budget`` (per sample) unless given (``cfg.batch_budget``: per batch)."""
    per_block = max(1, (cfg.budget if budget is None else budget) // cfg.blocks)
    return np.minimum(np.diff(block_bounds(cfg.n_labels, cfg.blocks)), per_block)


@dataclass(frozen=True)
class ModelConfig:
    n_features: int
    n_labels: int
    hidden: int = 128
    budget: int = 1024  # active output neurons per sample, all ranks together (budget // blocks per block)
    blocks: int = 8  # selection blocks of labels; the rank count must divide it
    hash: str = "srp"
    k: int = 0  # bits (srp) or winner-take-all hashes (dwta) per table; 0 = auto_k
    tables: int = 32
    bucket_cap: int = 128
    lr: float = 1e-2
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    seed: int = 0
    pool_factor: int = 64  # random fill comes from a per-step pool of pool_factor x budget neurons
    # std of W2 is out_init / sqrt(H): small, so the many labels a sparse update has not reached yet do not
    # outscore trained ones at exact inference with random logits (SRP hashing only sees directions)
    out_init: float = 0.1
    # softmax over the active set with the uniform fill's logits raised by log(rest / fill): an estimate of the
    # full softmax normaliser rather than of the active set's alone (sampled-softmax importance correction)
    fill_correction: bool = True
    # hash output rows minus their block's mean row: the same order by w.h for every h, without the direction
    # all trained rows share (uncentred they crowd into buckets no hidden vector reaches)
    lsh_center: bool = True
    # at most this share of a block's active neurons are LSH candidates (a random sample of them when more are
    # found); the rest is the corrected random fill, which keeps the softmax an estimate of the full one
    lsh_frac: float = 0.5
    # > 0: the random fill is drawn by label frequency, q_j ~ (times j was a training target so far + 1)^power
    # (a unigram proposal, as TF's sampled softmax), with the matching correction; 0: uniform
    fill_power: float = 1.0
    lr_decay: float = 100.0  # > 0: Adam step lr / sqrt(1 + step / lr_decay); 0: constant lr
    # input-layer rows (W1) follow dense Adam although only the batch's features are touched: a row's momentum
    # keeps moving it in the steps between its features' appearances (caught up in closed form before it is
    # next read) and its bias correction is the global step's.  False: plain lazy Adam, per-row bias correction
    dense_adam_in: bool = True
    # > 0: one active set of this many output neurons (all ranks together) shared by the whole batch instead of
    # ``budget`` per sample: the batch's labels, the LSH candidates most of its samples hash to, the fill.  A
    # batch then touches far fewer output rows, and its logits are a dense (B x batch_budget) product
    batch_budget: int = 0
    rehash: RehashSchedule = field(default_factory=RehashSchedule)

    def __post_init__(self) -> None:
        for name in ("n_features", "n_labels", "hidden", "budget", "blocks", "bucket_cap", "pool_factor"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hash not in FAMILIES:
            raise ValueError(f"hash must be one of {sorted(FAMILIES)}, got {self.hash!r}")
        if self.batch_budget < 0:
            raise ValueError(f"batch_budget must be >= 0, got {self.batch_budget}")
        if self.tables < 0 or self.k < 0:
            raise ValueError(f"tables and k must be >= 0, got {self.tables}, {self.k}")
        if not (0 < self.lsh_frac <= 1 and self.fill_power >= 0 and self.lr_decay >= 0):
            raise ValueError(f"need 0 < lsh_frac <= 1, fill_power >= 0, lr_decay >= 0; got {self.lsh_frac}, "
                             f"{self.fill_power}, {self.lr_decay}")  # fmt: skip
        if not (self.lr > 0 and 0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.eps > 0):
            raise ValueError(f"bad Adam settings lr={self.lr} beta1={self.beta1} beta2={self.beta2} eps={self.eps}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ModelConfig:
        d = dict(d)
        d["rehash"] = RehashSchedule(**d.get("rehash", {}))
        # configs written before these options: what those models were trained with
        for name, value in (
            ("lsh_center", False), ("lsh_frac", 1.0), ("fill_power", 0.0), ("lr_decay", 0.0), ("dense_adam_in", False),
        ):  # fmt: skip
            d.setdefault(name, value)
        return cls(**d)


def initial_weights(
    cfg: ModelConfig, hidden: tuple[int, int] | None = None, labels: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``W1[:, hidden]`` (F x Hl) and ``W2[labels]`` (Ll x H) as every rank count draws them: column by
    column and in fixed row blocks, each from its own seeded stream, so a shard never depends on P."""
    h_lo, h_hi = hidden or (0, cfg.hidden)
    l_lo, l_hi = labels or (0, cfg.n_labels)
    H = cfg.hidden
    # inputs are unit-norm tf-idf rows, so N(0, 1) columns give unit-scale pre-activations
    W1 = np.empty((cfg.n_features, h_hi - h_lo), np.float32)
    for c in range(h_lo, h_hi):
        W1[:, c - h_lo] = np.random.default_rng((cfg.seed, 1, c)).standard_normal(cfg.n_features)
    W2 = np.empty((l_hi - l_lo, H), np.float32)
    for blk in range(l_lo // _W2_INIT_BLOCK, (l_hi - 1) // _W2_INIT_BLOCK + 1):
        b0 = blk * _W2_INIT_BLOCK
        rows = min(_W2_INIT_BLOCK, cfg.n_labels - b0)
        block = np.random.default_rng((cfg.seed, 2, blk)).standard_normal((rows, H)) * (cfg.out_init / math.sqrt(H))
        lo, hi = max(l_lo, b0), min(l_hi, b0 + rows)
        W2[lo - l_lo : hi - l_lo] = block[lo - b0 : hi - b0]
    return W1, W2


@dataclass(frozen=True)
class StepResult:
    loss_sum: float  # summed over the batch's labelled samples
    n_labelled: int
    n_top_label: int = 0  # labelled samples whose top active logit is one of their labels (train_err's count)


class SlideModel:
    """One rank's shard of the network, its Adam state and its LSH tables."""

    def __init__(self, cfg: ModelConfig, comm: Comm | None = None) -> None:
        self.cfg = cfg
        self.comm: Comm = comm if comm is not None else SerialComm()
        P, r = self.comm.size, self.comm.rank
        if cfg.blocks % P:
            supported = [p for p in range(1, cfg.blocks + 1) if cfg.blocks % p == 0]
            raise ValueError(f"{P} ranks cannot share {cfg.blocks} selection blocks: blocks={cfg.blocks} supports "
                             f"{', '.join(map(str, supported))} ranks")  # fmt: skip
        if cfg.hidden < P or cfg.n_labels < P:
            raise ValueError(f"{P} ranks need hidden >= {P} and labels >= {P}, got {cfg.hidden}, {cfg.n_labels}")
        self.h_lo, self.h_hi = shard_bounds(cfg.hidden, P, r)
        self.l_lo, self.l_hi = shard_bounds(cfg.n_labels, P, r)
        n_local = self.l_hi - self.l_lo
        self.block_lo, self.block_hi = cfg.blocks * r // P, cfg.blocks * (r + 1) // P
        bounds = block_bounds(cfg.n_labels, cfg.blocks)[self.block_lo : self.block_hi + 1]
        assert bounds[0] == self.l_lo and bounds[-1] == self.l_hi
        self.blocks_local = bounds - self.l_lo
        self.shares = np.ascontiguousarray(block_shares(cfg)[self.block_lo : self.block_hi], np.int64)
        self.budget_local = int(self.shares.sum())
        self.k = cfg.k or auto_k(cfg.hash, cfg.n_labels)
        code_bits(cfg.hash, self.k)
        F, H, Hl = cfg.n_features, cfg.hidden, self.h_hi - self.h_lo

        self.W1, self.W2 = initial_weights(cfg, (self.h_lo, self.h_hi), (self.l_lo, self.l_hi))
        self.b1 = np.zeros(Hl, np.float32)
        self.b2 = np.zeros(n_local, np.float32)

        zeros = np.zeros_like
        self.opt = {
            "M1": zeros(self.W1),
            "V1": zeros(self.W1),
            "G1": zeros(self.W1),
            "T1": np.zeros(F, np.int64),
            "Mb1": zeros(self.b1)[None, :],
            "Vb1": zeros(self.b1)[None, :],
            "Gb1": zeros(self.b1)[None, :],
            "Tb1": np.zeros(1, np.int64),
            # no gradient arrays for W2 and b2: a row's gradient goes from registers into its Adam update
            "M2": zeros(self.W2),
            "V2": zeros(self.W2),
            "T2": np.zeros(n_local, np.int64),
            "Mb2": zeros(self.b2),
            "Vb2": zeros(self.b2),
        }
        self._row_ptr = np.zeros(n_local + 1, np.int64)
        self.touched_in = np.zeros(F, np.uint8)
        self.dirty = np.zeros(n_local, np.uint8)  # output rows updated since the last rehash
        self.label_count = np.zeros(n_local, np.int64)  # times each own label was a training target
        self._fill_weight = np.ones(n_local, np.float64)  # (label_count + 1) ** fill_power

        self.index = LSHIndex(
            cfg.hash, self.k, cfg.tables, H, n_local, cfg.bucket_cap, cfg.seed, self.blocks_local, self.l_lo,
            cfg.lsh_center,
        )  # fmt: skip
        self.lsh_caps = np.maximum(1, np.floor(cfg.lsh_frac * self.shares)).astype(np.int64)
        self.batch_shares = np.ascontiguousarray(
            block_shares(cfg, max(cfg.batch_budget, 1))[self.block_lo : self.block_hi], np.int64
        )
        self.batch_lsh_caps = np.floor(cfg.lsh_frac * self.batch_shares).astype(np.int64)
        self._scratch: tuple[np.ndarray, ...] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.index.rebuild(self.W2)
        self.step = 0
        self.rehash_count = 0
        self.next_rehash = cfg.rehash.interval(0)
        self._marks = np.zeros((0, n_local), np.uint8)
        self._w1_now: tuple[int, np.ndarray] | None = None

    # -- phases ---------------------------------------------------------------------------------------------

    def _hidden(self, data: XCData, rows: np.ndarray, W1: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        hl = np.empty((len(rows), self.h_hi - self.h_lo), np.float32)
        W1 = self.W1 if W1 is None else W1
        kernels.hidden_forward(rows, data.x_indptr, data.x_indices, data.x_values, W1, self.b1, hl)
        return hl, np.ascontiguousarray(self.comm.allgather(hl), dtype=np.float32)

    def _catch_up(self, rows: np.ndarray, out: np.ndarray | None = None) -> None:
        """Move W1's ``rows`` to where dense Adam has them now (in place, or into ``out``, state untouched)."""
        cfg, o = self.cfg, self.opt
        kernels.catch_up_rows(
            self.W1, o["M1"], o["V1"], o["T1"], rows, self.step + 1, cfg.lr, cfg.lr_decay, cfg.beta1, cfg.beta2,
            cfg.eps, self.W1[:0] if out is None else out, out is None,
        )  # fmt: skip

    def _inference_W1(self) -> np.ndarray:
        """W1 as dense Adam has it after the steps so far (what inference reads); computed once per step."""
        if not self.cfg.dense_adam_in:
            return self.W1
        if self._w1_now is None or self._w1_now[0] != self.step:
            out = np.empty_like(self.W1)
            self._catch_up(np.arange(len(self.W1), dtype=np.int64), out)
            self._w1_now = (self.step, out)
        return self._w1_now[1]

    def _pools(self, key: int, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each own block's random-fill pool of ``sizes[g]`` draws for step ``key`` and its stream key, from (seed,
        block, key): the same for every P.  Returns the pools (concatenated, local ids), their bounds, each
        entry's log(1 - q_j) (empty for a uniform pool) and the stream keys."""
        cfg = self.cfg
        g0 = self.block_lo
        keys = np.array([seed_key(cfg.seed, 3, g0 + g, key) for g in range(len(sizes))], np.uint64)
        pool_ptr = np.zeros(len(sizes) + 1, np.int64)
        pool_ptr[1:] = np.cumsum(sizes)
        if cfg.fill_power > 0:
            # i.i.d. draws by q_j ~ (times label j was a target so far + 1)^fill_power, each with log(1 - q_j)
            pools, pool_lw = np.empty(pool_ptr[-1], np.int32), np.empty(pool_ptr[-1], np.float32)
            pool_keys = np.array([seed_key(cfg.seed, 4, g0 + g, key) for g in range(len(sizes))], np.uint64)
            kernels.weighted_pools(self._fill_weight, self.blocks_local, pool_keys, pool_ptr, pools, pool_lw)
            pools += np.repeat(self.blocks_local[:-1], sizes).astype(np.int32)
            return pools, pool_ptr, pool_lw, keys
        parts = []
        for g, n in enumerate(sizes):
            lo, size = self.blocks_local[g], self.blocks_local[g + 1] - self.blocks_local[g]
            rng = np.random.default_rng((cfg.seed, 4, g0 + g, key))
            parts.append(rng.choice(size, min(size, int(n)), replace=False) + lo)
        pool_ptr[1:] = np.cumsum([len(p) for p in parts])
        return np.concatenate(parts).astype(np.int32), pool_ptr, np.zeros(0, np.float32), keys

    def _select(self, data: XCData, rows: np.ndarray, h: np.ndarray, use_labels: bool, key: int) -> tuple:
        cfg, ix = self.cfg, self.index
        n_local = self.l_hi - self.l_lo
        chunks = max(1, numba.get_num_threads())
        if self._marks.shape[0] != chunks:
            self._marks = np.zeros((chunks, n_local), np.uint8)
        pools, pool_ptr, pool_lw, keys = self._pools(key, cfg.pool_factor * self.shares)
        active = np.empty((len(rows), self.budget_local), np.int32)
        n_own = np.empty(len(rows), np.int32)
        corr = np.empty((len(rows), self.budget_local), np.float32)
        kernels.select_active(
            h, rows, data.y_indptr, data.y_indices, use_labels, self.l_lo, self.blocks_local, self.shares,
            ix.family_id, ix.srp, ix.dwta, ix.k, ix.n_tables, ix.n_codes, ix.offsets, ix.fill, ix.items,
            pools, pool_ptr, pool_lw, keys, self._marks,
            np.empty((chunks, max(ix.n_tables, 1)), np.int64), np.empty((chunks, len(self.shares)), np.int64),
            self.lsh_caps, cfg.fill_correction, active, n_own, corr,
        )  # fmt: skip
        return active, n_own, corr

    def _select_shared(self, data: XCData, rows: np.ndarray, h: np.ndarray) -> tuple:
        """The batch's shared active set (``batch_budget``): own neurons, their fill corrections, and every
        sample's labels as positions in it (CSR)."""
        cfg, ix = self.cfg, self.index
        if self._scratch is None:
            n_local = self.l_hi - self.l_lo
            self._scratch = (
                np.zeros(n_local, np.uint8), np.full(n_local, -1, np.int64), np.zeros(n_local, np.int64),
                np.empty(n_local, np.int32),
            )  # fmt: skip
        mark, pos, hits, cand = self._scratch
        pools, pool_ptr, pool_lw, keys = self._pools(self.step, _SHARED_POOL * self.batch_shares)
        codes = np.zeros((len(rows), ix.n_tables), np.int64)
        if ix.n_tables:
            kernels.batch_codes(ix.family_id, ix.srp, ix.dwta, ix.k, h, codes)
        n = int(self.batch_shares.sum())
        active, corr = np.empty(n, np.int32), np.empty(n, np.float32)
        lab_ptr = np.empty(len(rows) + 1, np.int64)
        lab_pos = np.empty(int((data.y_indptr[rows + 1] - data.y_indptr[rows]).sum()), np.int64)
        kernels.select_shared(
            rows, data.y_indptr, data.y_indices, True, self.l_lo, self.blocks_local, self.batch_shares, codes,
            ix.n_codes, ix.offsets, ix.fill, ix.items, pools, pool_ptr, pool_lw, keys, self.batch_lsh_caps,
            cfg.fill_correction, mark, pos, hits, cand, active, corr, lab_ptr, lab_pos,
        )  # fmt: skip
        return active, corr, lab_ptr, lab_pos

    def train_step(self, data: XCData, rows: np.ndarray) -> StepResult:
        """One step of SLIDE on the points ``rows`` of ``data`` (every rank passes the same rows)."""
        cfg, o = self.cfg, self.opt
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        # 1. hidden forward (the batch's W1 rows first moved as dense Adam has moved them since last touched)
        in_rows = None
        if cfg.dense_adam_in:
            kernels.mark_features(rows, data.x_indptr, data.x_indices, self.touched_in)
            in_rows = np.flatnonzero(self.touched_in)
            self._catch_up(in_rows)
        hl, h = self._hidden(data, rows)
        # 2.-3. active sets, logits, softmax normaliser over all ranks; the output layer's backward and Adam
        if cfg.batch_budget:
            dh, loss, top_is_label, n_labelled = self._output_shared(data, rows, h)
        else:
            dh, loss, top_is_label, n_labelled = self._output_per_sample(data, rows, h)
        # 4. hidden backward of the own slice
        lr = kernels.step_lr(cfg.lr, cfg.lr_decay, self.step)
        delta = np.ascontiguousarray(dh[:, self.h_lo : self.h_hi] * (hl > 0), dtype=np.float32)
        kernels.hidden_backward(rows, data.x_indptr, data.x_indices, data.x_values, delta, o["G1"], self.touched_in)
        if in_rows is None:
            in_rows = np.flatnonzero(self.touched_in)
        self.touched_in[in_rows] = 0
        no_bias = np.zeros(0, np.float32)
        kernels.adam_rows(
            self.W1, o["M1"], o["V1"], o["G1"], no_bias, no_bias, no_bias, no_bias, o["T1"], in_rows,
            lr, cfg.beta1, cfg.beta2, cfg.eps, self.step + 1 if cfg.dense_adam_in else 0,
        )  # fmt: skip
        o["Gb1"][0] = delta.sum(axis=0)
        kernels.adam_rows(
            self.b1[None, :], o["Mb1"], o["Vb1"], o["Gb1"], no_bias, no_bias, no_bias, no_bias, o["Tb1"],
            np.zeros(1, np.int64), lr, cfg.beta1, cfg.beta2, cfg.eps,
        )  # fmt: skip
        self.step += 1
        self._maybe_rehash()
        return StepResult(float(loss.sum()), n_labelled, top_is_label)

    def _softmax_loss(self, stats: np.ndarray, gmax: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
        """Sum the per-sample softmax statistics over ranks: the stats, the labelled samples' losses, how many
        have a label on top, the labelled mask."""
        stats = self.comm.allreduce_sum(stats)
        labelled = stats[:, 2] > 0
        loss = np.log(stats[labelled, 0]) + gmax[labelled] - stats[labelled, 1] / stats[labelled, 2]
        return stats, loss, int(np.count_nonzero(stats[labelled, 3] > 0)), labelled

    def _output_per_sample(self, data: XCData, rows: np.ndarray, h: np.ndarray) -> tuple:
        """The output layer with ``budget`` active neurons per sample: logits, softmax, the fused row-by-row
        backward and lazy Adam; dL/dh summed over ranks, the losses, the top-is-label and labelled counts."""
        cfg, comm, o = self.cfg, self.comm, self.opt
        B = len(rows)
        active, n_own, corr = self._select(data, rows, h, True, self.step)
        self._count_labels(data, rows)
        logits = np.empty(active.shape, np.float32)
        rowmax = np.empty(B, np.float32)
        kernels.active_logits(h, active, self.W2, self.b2, logits, rowmax)
        gmax = np.ascontiguousarray(comm.allreduce_max(rowmax), dtype=np.float32)
        stats = np.empty((B, 4), np.float64)
        kernels.softmax_stats(logits, corr, n_own, gmax, stats)
        stats, loss, top_is_label, labelled = self._softmax_loss(stats, gmax)
        # 3. output backward fused with the lazy Adam of the touched rows (row by row), dL/dh summed over ranks
        lr = kernels.step_lr(cfg.lr, cfg.lr_decay, self.step)
        entries = np.empty(active.size, np.int32)
        kernels.group_by_row(active, labelled, self._row_ptr, entries)
        out_rows = np.flatnonzero(np.diff(self._row_ptr))
        dh_parts = np.empty((max(1, numba.get_num_threads()), B, cfg.hidden), np.float32)
        kernels.output_rows_adam(
            h, logits, n_own, stats[:, 0], stats[:, 2], 1.0 / B, self._row_ptr, entries, out_rows,
            self.W2, self.b2, o["M2"], o["V2"], o["Mb2"], o["Vb2"], o["T2"], lr, cfg.beta1, cfg.beta2, cfg.eps,
            dh_parts,
        )  # fmt: skip
        dh = comm.allreduce_sum(dh_parts.sum(axis=0))
        self.dirty[out_rows] = 1
        return dh, loss, top_is_label, int(labelled.sum())

    def _output_shared(self, data: XCData, rows: np.ndarray, h: np.ndarray) -> tuple:
        """The output layer with one active set shared by the batch (``batch_budget``): its logits and both
        gradient products are dense BLAS products over the gathered rows; Adam on those rows only."""
        cfg, comm, o = self.cfg, self.comm, self.opt
        B = len(rows)
        active, corr, lab_ptr, lab_pos = self._select_shared(data, rows, h)
        self._count_labels(data, rows)
        # the products run on column chunks of the active set, one per thread (numpy's BLAS releases the GIL)
        n = len(active)
        C = max(1, min(numba.get_num_threads(), n // 256))
        cuts = [(n * c // C, n * (c + 1) // C) for c in range(C)]
        logits = np.empty((B, n), np.float32)
        Ws = np.empty((n, cfg.hidden), np.float32)

        def forward(lo: int, hi: int) -> None:
            np.take(self.W2, active[lo:hi], axis=0, out=Ws[lo:hi])
            np.matmul(h, Ws[lo:hi].T, out=logits[:, lo:hi])
            logits[:, lo:hi] += self.b2[active[lo:hi]]

        self._on_chunks(forward, cuts)
        top = logits.argmax(axis=1)
        gmax = np.ascontiguousarray(comm.allreduce_max(logits[np.arange(B), top]), dtype=np.float32)
        stats = self._shared_stats(logits, corr, lab_ptr, lab_pos, top, gmax)
        stats, loss, top_is_label, labelled = self._softmax_loss(stats, gmax)
        kernels.shared_delta(logits, stats[:, 0], stats[:, 2], lab_ptr, lab_pos, 1.0 / B)
        grad = np.empty((n, cfg.hidden), np.float32)
        dh_parts = np.empty((C, B, cfg.hidden), np.float32)

        def backward(lo: int, hi: int) -> None:
            np.matmul(logits[:, lo:hi].T, h, out=grad[lo:hi])
            np.matmul(logits[:, lo:hi], Ws[lo:hi], out=dh_parts[cuts.index((lo, hi))])

        self._on_chunks(backward, cuts)
        gb = logits.sum(axis=0)
        dh = comm.allreduce_sum(dh_parts.sum(axis=0))
        kernels.adam_rows(
            self.W2, o["M2"], o["V2"], grad, self.b2, o["Mb2"], o["Vb2"], gb, o["T2"], active.astype(np.int64),
            kernels.step_lr(cfg.lr, cfg.lr_decay, self.step), cfg.beta1, cfg.beta2, cfg.eps, 0, True,
        )  # fmt: skip
        self.dirty[active] = 1
        return dh, loss, top_is_label, int(labelled.sum())

    def _shared_stats(self, logits: np.ndarray, corr: np.ndarray, lab_ptr: np.ndarray, lab_pos: np.ndarray,
                      top: np.ndarray, gmax: np.ndarray) -> np.ndarray:
        """This rank's softmax statistics over a shared active set (:func:`kernels.softmax_stats`'s ``stats``),
        turning ``logits`` into ``exp(z + corr - gmax)`` in place: numpy's vectorised float32 exp on row chunks,
        one per thread (numba's exp is a scalar call per entry, ~3x slower here)."""
        stats = np.empty((len(logits), 4), np.float64)
        kernels.shared_label_stats(logits, lab_ptr, lab_pos, top, gmax, stats)

        def exps(lo: int, hi: int) -> None:
            z = logits[lo:hi]
            z += corr
            z -= gmax[lo:hi, None]
            np.exp(z, out=z)
            stats[lo:hi, 0] = z.sum(axis=1)

        B, C = len(logits), max(1, min(numba.get_num_threads(), len(logits) // 32))
        self._on_chunks(exps, [(B * c // C, B * (c + 1) // C) for c in range(C)])
        return stats

    def _on_chunks(self, fn: Callable[[int, int], None], cuts: list[tuple[int, int]]) -> None:
        """``fn(lo, hi)`` for every cut, on a pool of threads (inline when there is one cut)."""
        if len(cuts) == 1:
            fn(*cuts[0])
            return
        if self._pool is None or self._pool._max_workers < len(cuts):
            self._pool = ThreadPoolExecutor(len(cuts), thread_name_prefix="dslide-blas")
        for f in [self._pool.submit(fn, lo, hi) for lo, hi in cuts]:
            f.result()

    def _count_labels(self, data: XCData, rows: np.ndarray) -> None:
        """Count the batch's targets among the own labels (the frequency fill's weights)."""
        starts, ends = data.y_indptr[rows], data.y_indptr[rows + 1]
        lens = ends - starts
        pos = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
        own = data.y_indices[pos].astype(np.int64) - self.l_lo
        own = own[(own >= 0) & (own < len(self.label_count))]
        if len(own):
            np.add.at(self.label_count, own, 1)
            if self.cfg.fill_power > 0:
                seen = np.unique(own)
                self._fill_weight[seen] = (self.label_count[seen] + 1.0) ** self.cfg.fill_power

    def _maybe_rehash(self) -> None:
        if self.step < self.next_rehash:
            return
        sched = self.cfg.rehash
        if sched.is_fresh(self.rehash_count):
            self.index.rebuild(self.W2, new_functions=True)
        else:
            self.index.rehash(self.W2, np.flatnonzero(self.dirty))
        self.dirty[:] = 0
        self.rehash_count += 1
        self.next_rehash = self.step + sched.interval(self.rehash_count)

    # -- inference ------------------------------------------------------------------------------------------

    def predict_topk(self, data: XCData, rows: np.ndarray, k: int = 5, mode: str = "exact") -> np.ndarray:
        """Global label ids of the ``k`` best scores per point, best first (-1 pads when L < k).

        ``exact`` scores every label (dense inference); ``lsh`` only each rank's active set chosen as in
        training but without the true labels -- the fast, approximate option.
        """
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        _, h = self._hidden(data, rows, self._inference_W1())
        B = len(rows)
        top_s = np.empty((B, k), np.float32)
        top_i = np.empty((B, k), np.int64)
        if mode == "exact":
            self._exact_topk(h, k, top_s, top_i)
        elif mode == "lsh":
            active, _, _ = self._select(data, rows, h, False, (1 << 40) + self.step)
            logits = np.empty(active.shape, np.float32)
            kernels.active_logits(h, active, self.W2, self.b2, logits, np.empty(B, np.float32))
            kk = min(k, logits.shape[1])
            order = np.argsort(-logits, axis=1, kind="stable")[:, :kk]
            top_s.fill(-np.inf)
            top_i.fill(-1)
            top_s[:, :kk] = np.take_along_axis(logits, order, axis=1)
            top_i[:, :kk] = np.take_along_axis(active, order, axis=1)
        else:
            raise ValueError(f"mode must be 'exact' or 'lsh', got {mode!r}")
        top_i = np.where(top_i >= 0, top_i + self.l_lo, -1)
        if self.comm.size > 1:
            top_s = self.comm.allgather(top_s)
            top_i = self.comm.allgather(top_i)
        order = np.argsort(-top_s, axis=1, kind="stable")[:, :k]
        return np.take_along_axis(top_i, order, axis=1)

    def _exact_topk(self, h: np.ndarray, k: int, top_s: np.ndarray, top_i: np.ndarray) -> None:
        """Score every own label with BLAS, a few rows at a time (the score block stays under ~64 MB)."""
        n = self.W2.shape[0]
        kk = min(k, n)
        top_s.fill(-np.inf)
        top_i.fill(-1)
        step = max(1, (64 << 20) // (4 * n))
        for s in range(0, len(h), step):
            scores = h[s : s + step] @ self.W2.T
            scores += self.b2
            kernels.top_k_rows(scores, top_s[s : s + step, :kk], top_i[s : s + step, :kk])

    def evaluate(self, data: XCData, max_points: int | None = None, mode: str = "exact", batch: int = 256) -> dict:
        """P@1 and P@5 on the first ``max_points`` points of ``data`` (all ranks get the same figures)."""
        n = len(data) if max_points is None else min(len(data), max_points)
        hits1 = hits5 = 0.0
        for start in range(0, n, batch):
            rows = np.arange(start, min(n, start + batch), dtype=np.int64)
            top = self.predict_topk(data, rows, 5, mode)
            for i, r in enumerate(rows):
                labels = data.y_indices[data.y_indptr[r] : data.y_indptr[r + 1]]
                hit = np.isin(top[i], labels)
                hits1 += float(hit[0])
                hits5 += float(hit.sum()) / 5
        return {"p_at_1": hits1 / max(n, 1), "p_at_5": hits5 / max(n, 1), "eval_points": n}

    def validate(self, data: XCData, max_points: int | None = None, batch: int = 256) -> dict:
        """Exact inference on the first ``max_points`` points: P@1 and the mean cross-entropy of the full softmax
        against the point's labels (the target training uses, uniform on them; points without labels are left
        out of it).  The loss moves smoothly where P@1 moves in steps of one point, so it is the held-out score
        ARF steers by (:mod:`dslide.feedback`).  Every rank gets the same figures."""
        n = len(data) if max_points is None else min(len(data), max_points)
        W1 = self._inference_W1()
        n_own = self.W2.shape[0]
        step = max(1, (64 << 20) // (4 * max(n_own, 1)))
        hits = loss_sum = 0.0
        labelled = 0
        for start in range(0, n, batch):
            rows = np.arange(start, min(n, start + batch), dtype=np.int64)
            _, h = self._hidden(data, rows, W1)
            B = len(rows)
            st = np.empty((6, B), np.float64)  # max, sumexp, label sum, label count, top score, top label
            for s in range(0, B, step):
                e = min(B, s + step)
                scores = h[s:e] @ self.W2.T
                scores += self.b2
                top_i = np.empty(e - s, np.int64)
                kernels.score_stats(scores, rows[s:e], data.y_indptr, data.y_indices, self.l_lo, st[0, s:e],
                                    st[1, s:e], st[2, s:e], st[3, s:e], st[4, s:e], top_i)  # fmt: skip
                st[5, s:e] = np.where(top_i >= 0, top_i + self.l_lo, -1)
            gmax = self.comm.allreduce_max(st[0].copy())
            sums = self.comm.allreduce_sum(np.stack([st[1] * np.exp(st[0] - gmax), st[2], st[3]]))
            top = self.comm.allgather(st[4:6].T.copy())  # (B, 2 * P): each rank's best (score, label)
            best = top[:, 1::2][np.arange(B), np.argmax(top[:, 0::2], axis=1)].astype(np.int64)
            for i, r in enumerate(rows):
                hits += float(best[i] in data.y_indices[data.y_indptr[r] : data.y_indptr[r + 1]])
            has = sums[2] > 0
            loss_sum += float(np.sum((np.log(sums[0]) + gmax - sums[1] / np.maximum(sums[2], 1))[has]))
            labelled += int(has.sum())
        return {"p_at_1": hits / max(n, 1), "loss": loss_sum / labelled if labelled else None, "eval_points": n}

    # -- state ----------------------------------------------------------------------------------------------

    def state(self) -> dict[str, np.ndarray]:
        """Every array that defines this rank's shard (weights, Adam, LSH, counters): enough to resume exactly."""
        out = {"W1": self.W1, "b1": self.b1, "W2": self.W2, "b2": self.b2, "dirty": self.dirty}
        out["label_count"] = self.label_count
        out.update({f"opt_{k}": v for k, v in self.opt.items()})
        out.update({f"lsh_{k}": v for k, v in self.index.state().items()})
        out["counters"] = np.array([self.step, self.rehash_count, self.next_rehash], np.int64)
        return out

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        if "label_count" not in state:  # written before labels were counted
            state = {**state, "label_count": np.zeros_like(self.label_count)}
        for name in ("W1", "b1", "W2", "b2", "dirty", "label_count"):
            arr = getattr(self, name)
            if arr.shape != state[name].shape:
                raise ValueError(f"checkpoint {name} has shape {state[name].shape}, this model {arr.shape}")
            arr[...] = state[name]
        self._fill_weight[...] = (self.label_count + 1.0) ** max(self.cfg.fill_power, 0.0)
        for k in self.opt:
            self.opt[k][...] = state[f"opt_{k}"]
        self.index.load_state({k[4:]: v for k, v in state.items() if k.startswith("lsh_")})
        self.step, self.rehash_count, self.next_rehash = (int(v) for v in state["counters"])
        self._w1_now = None

"""LSH tables over one rank's output neurons: which neurons are worth computing for a hidden vector.

Two families, as in SLIDE:

* ``srp`` -- signed random projections (SimHash) with sparse ±1 projections (density 1/3); a table's code is
  ``k`` sign bits.
* ``dwta`` -- densified winner-take-all: each of a table's ``k`` hashes is the arg-max position among 8 fixed
  random coordinates (3 bits); a bin whose coordinates are all zero (ReLU output) borrows the next hash's bin,
  the densification that keeps sparse vectors hashable.  A code has ``3k`` bits.

A neuron's weight row and a hidden vector go through the same functions; a query reads the neurons in the
vector's bucket of every table.  Tables are arrays, not dicts: CSR buckets (``offsets``, ``items``) built by a
counting sort, each bucket holding at most ``bucket_cap`` neurons chosen by reservoir sampling, plus some slack
so that incremental rehashes (:meth:`LSHIndex.rehash`, only the neurons an update touched) can move neurons
between buckets without a rebuild.  :class:`RehashSchedule` makes rehashing frequent early and rare later
(weights move fast at first), with fresh hash functions every few rebuilds.

*Groups* make the tables independent of how neurons are sharded over ranks (issue 6): the neurons fall into
fixed selection blocks (:mod:`dslide.model`), and a table's buckets are per (block, code) -- a rank's index is
exactly the union of its blocks' tables.  Hash functions depend on (seed, generation) only, so every block and
every rank hashes a vector to the same code (computed once per sample), and every reservoir draw is keyed by
the neuron's *global* id; a block's buckets therefore hold the same neurons whatever P.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from dslide.rand import key3, seed_key, uniform_below

__all__ = [
    "DWTA_BIN", "FAMILIES", "LSHIndex", "RehashSchedule", "code_bits", "hash_rows", "reshard_tables", "table_code",
]  # fmt: skip

FAMILIES = {"srp": 0, "dwta": 1}
DWTA_BIN = 8  # coordinates per winner-take-all hash: 3 bits
_MAX_BITS = 20


def code_bits(family: str, k: int) -> int:
    return k if family == "srp" else 3 * k


@njit(inline="always", cache=True)
def table_code(family, srp, dwta, k, t, x):
    """The bucket of vector ``x`` in table ``t``."""
    code = 0
    if family == 0:
        dim = x.shape[0]
        for b in range(k):
            row = srp[t * k + b]
            s = np.float32(0.0)
            for d in range(dim):
                s += row[d] * x[d]
            code = (code << 1) | (1 if s > 0 else 0)
    else:
        m = dwta.shape[0]
        for b in range(k):
            h = t * k + b
            best = 0
            for attempt in range(m):
                hh = (h + attempt) % m
                idx = dwta[hh]
                bv = x[idx[0]]
                best = 0
                nonzero = bv != 0
                for q in range(1, idx.shape[0]):
                    v = x[idx[q]]
                    if v != 0:
                        nonzero = True
                    if v > bv:
                        bv = v
                        best = q
                if nonzero:
                    break
            code = (code << 3) | best
    return code


@njit(parallel=True, fastmath=True, cache=True)
def hash_rows(family, srp, dwta, k, n_tables, x, ids, out):
    """``out[i, t]`` = code of ``x[ids[i]]`` in table t."""
    for i in prange(ids.shape[0]):
        row = x[ids[i]]
        for t in range(n_tables):
            out[i, t] = table_code(family, srp, dwta, k, t, row)


@njit(parallel=True, fastmath=True, cache=True)
def hash_rows_centred(family, srp, dwta, k, n_tables, x, mean, group_of, ids, out):
    """``out[i, t]`` = code of ``x[ids[i]] - mean[g]`` in table t, g the row's group."""
    dim = x.shape[1]
    n = ids.shape[0]
    chunks = min(n, 64)
    for c in prange(chunks):
        v = np.empty(dim, np.float32)
        for i in range(c, n, chunks):
            j = ids[i]
            row = x[j]
            m = mean[group_of[j]]
            for d in range(dim):
                v[d] = row[d] - m[d]
            for t in range(n_tables):
                out[i, t] = table_code(family, srp, dwta, k, t, v)


@njit(parallel=True, cache=True)
def _bucket_counts(codes, n_buckets, counts):
    for t in prange(codes.shape[1]):
        for i in range(codes.shape[0]):
            counts[t, codes[i, t]] += 1


@njit(parallel=True, cache=True)
def _fill_buckets(codes, offsets, fill, seen, items, key, first_id):
    """Insert every neuron in id order; a full bucket keeps a uniform sample (reservoir, keyed by global id)."""
    for t in prange(codes.shape[1]):
        for i in range(codes.shape[0]):
            b = codes[i, t]
            start = offsets[t, b]
            capacity = offsets[t, b + 1] - start
            seen[t, b] += 1
            if fill[t, b] < capacity:
                items[start + fill[t, b]] = i
                fill[t, b] += 1
            else:
                j = uniform_below(key3(key, t, i + first_id), seen[t, b])
                if j < capacity:
                    items[start + j] = i


@njit(parallel=True, cache=True)
def _move_items(ids, new_codes, codes, offsets, fill, seen, items, key, first_id):
    """Move neurons ``ids`` to their new buckets, table by table (tables are independent: no races)."""
    for t in prange(codes.shape[1]):
        for r in range(ids.shape[0]):
            i = ids[r]
            old = codes[i, t]
            new = new_codes[r, t]
            if old == new:
                continue
            codes[i, t] = new
            start = offsets[t, old]
            for q in range(start, start + fill[t, old]):
                if items[q] == i:
                    last = start + fill[t, old] - 1
                    items[q] = items[last]
                    fill[t, old] -= 1
                    break
            start = offsets[t, new]
            capacity = offsets[t, new + 1] - start
            seen[t, new] += 1
            if fill[t, new] < capacity:
                items[start + fill[t, new]] = i
                fill[t, new] += 1
            elif capacity > 0:
                j = uniform_below(key3(key, t, i + first_id), seen[t, new])
                if j < capacity:
                    items[start + j] = i


def _slack(counts: np.ndarray) -> np.ndarray:
    """Room left in each bucket for neurons that move in by incremental rehash."""
    return np.maximum(counts // 4, 2)


class LSHIndex:
    """``n_tables`` tables of ``k``-hash codes over ``n_items`` vectors of ``dim`` (one rank's output neurons).

    ``groups`` (local boundaries ``[0, ..., n_items]``, default one group) splits every table into per-group
    buckets: bucket ``g * n_codes + code``.  ``first_id`` is the global id of local item 0 (reservoir keys).
    """

    def __init__(
        self,
        family: str,
        k: int,
        n_tables: int,
        dim: int,
        n_items: int,
        bucket_cap: int,
        seed: int,
        groups: np.ndarray | None = None,
        first_id: int = 0,
        center: bool = False,
    ) -> None:
        if family not in FAMILIES:
            raise ValueError(f"hash family must be one of {sorted(FAMILIES)}, got {family!r}")
        if k < 1 or code_bits(family, k) > _MAX_BITS:
            raise ValueError(f"k={k} gives {code_bits(family, k)}-bit codes for {family}; need 1 to {_MAX_BITS} bits")
        if n_tables < 0 or bucket_cap < 1:
            raise ValueError(f"need tables >= 0 and bucket_cap >= 1, got {n_tables}, {bucket_cap}")
        self.family, self.k, self.n_tables, self.dim = family, k, n_tables, dim
        # center: hash each row minus its group's mean row.  A query's order of the rows by w.x is unchanged
        # (the mean's part m.x is the same for every row), but the direction all rows share goes: trained
        # output rows all drift along -mean(h), and uncentred they crowd into a few buckets that no
        # (non-negative, ReLU) hidden vector reaches -- the tables then return almost nothing
        self.center = center
        self.n_items, self.bucket_cap, self.seed, self.first_id = n_items, bucket_cap, seed, first_id
        self.groups = np.array([0, n_items] if groups is None else groups, np.int64)
        if self.groups[0] != 0 or self.groups[-1] != n_items or np.any(np.diff(self.groups) < 0):
            raise ValueError(f"groups must rise from 0 to n_items={n_items}, got {self.groups.tolist()}")
        self.n_codes = 1 << code_bits(family, k)
        self.n_buckets = self.n_codes * (len(self.groups) - 1)  # buckets per table: (group, code)
        self._base = (np.repeat(np.arange(len(self.groups) - 1), np.diff(self.groups)) * self.n_codes).astype(np.int32)
        self.generation = 0
        self.moves = 0
        self._new_functions()
        self.codes = np.zeros((n_items, n_tables), np.int32)
        self.offsets = np.zeros((n_tables, self.n_buckets + 1), np.int64)
        self.fill = np.zeros((n_tables, self.n_buckets), np.int32)
        self.seen = np.zeros((n_tables, self.n_buckets), np.int64)
        self.items = np.zeros(0, np.int32)

    @property
    def family_id(self) -> int:
        return FAMILIES[self.family]

    def _new_functions(self) -> None:
        rng = np.random.default_rng((self.seed, 7, self.generation))
        m = max(self.n_tables * self.k, 1)
        if self.family == "srp":
            signs = rng.choice(np.array([-1.0, 1.0], np.float32), (m, self.dim))
            keep = rng.random((m, self.dim)) < 1 / 3
            keep[np.arange(m), rng.integers(0, self.dim, m)] = True  # never an all-zero projection
            self.srp = np.where(keep, signs, 0).astype(np.float32)
            self.dwta = np.zeros((1, DWTA_BIN), np.int32)
        else:
            if self.dim >= DWTA_BIN:
                idx = np.argsort(rng.random((m, self.dim)), axis=1)[:, :DWTA_BIN]
            else:
                idx = rng.integers(0, self.dim, (m, DWTA_BIN))
            self.dwta = idx.astype(np.int32)
            self.srp = np.zeros((1, 1), np.float32)

    def hash(self, x: np.ndarray, ids: np.ndarray | None = None) -> np.ndarray:
        """Codes (``< n_codes``, no group) of the rows ``ids`` of ``x`` (all rows by default), (len(ids), n_tables)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids = np.arange(len(x), dtype=np.int64) if ids is None else np.asarray(ids, np.int64)
        out = np.empty((len(ids), self.n_tables), np.int32)
        hash_rows(self.family_id, self.srp, self.dwta, self.k, self.n_tables, x, ids, out)
        return out

    def _row_codes(self, weights: np.ndarray, ids: np.ndarray | None) -> np.ndarray:
        """Codes (no group) of the rows ``ids`` (all by default) of ``weights``, centred per group if asked."""
        if not self.center:
            return self.hash(weights, ids)
        W = np.ascontiguousarray(weights, dtype=np.float32)
        g = self.groups
        mean = np.zeros((len(g) - 1, W.shape[1]), np.float32)
        for q in range(len(g) - 1):  # from all of the group's rows: the same on any rank count
            if g[q + 1] > g[q]:
                mean[q] = W[g[q] : g[q + 1]].mean(axis=0, dtype=np.float64)
        group_of = np.repeat(np.arange(len(g) - 1, dtype=np.int32), np.diff(g))
        ids = np.arange(len(W), dtype=np.int64) if ids is None else np.asarray(ids, np.int64)
        out = np.empty((len(ids), self.n_tables), np.int32)
        hash_rows_centred(self.family_id, self.srp, self.dwta, self.k, self.n_tables, W, mean, group_of, ids, out)
        return out

    def rebuild(self, weights: np.ndarray, new_functions: bool = False) -> None:
        """Hash every neuron again and rebuild the tables (optionally with fresh hash functions)."""
        if new_functions:
            self.generation += 1
            self._new_functions()
        self.codes = self._row_codes(weights, None) + self._base[:, None]
        counts = np.zeros((self.n_tables, self.n_buckets), np.int64)
        _bucket_counts(self.codes, self.n_buckets, counts)
        capacity = np.minimum(counts + _slack(counts), self.bucket_cap)
        self.offsets = np.zeros((self.n_tables, self.n_buckets + 1), np.int64)
        flat = np.cumsum(capacity.ravel())
        self.offsets[:, 1:] = flat.reshape(self.n_tables, self.n_buckets)
        self.offsets[1:, 0] = self.offsets[:-1, -1]
        self.fill = np.zeros((self.n_tables, self.n_buckets), np.int32)
        self.seen = np.zeros((self.n_tables, self.n_buckets), np.int64)
        self.items = np.full(int(flat[-1]) if len(flat) else 0, -1, np.int32)
        key = seed_key(self.seed, 11, self.generation)
        _fill_buckets(self.codes, self.offsets, self.fill, self.seen, self.items, key, self.first_id)

    def rehash(self, weights: np.ndarray, ids: np.ndarray) -> None:
        """Re-hash only the neurons ``ids`` (those an update touched) and move them between buckets."""
        ids = np.asarray(ids, np.int64)
        self.moves += 1  # counted even when this rank has nothing to move: the keys stay the same for every P
        if len(ids) == 0 or self.n_tables == 0:
            return
        new_codes = self._row_codes(weights, ids) + self._base[ids][:, None]
        key = seed_key(self.seed, 13, self.generation, self.moves)
        _move_items(ids, new_codes, self.codes, self.offsets, self.fill, self.seen, self.items, key, self.first_id)

    def query(self, x: np.ndarray) -> np.ndarray:
        """Distinct neurons in the buckets of ``x`` over all tables and groups (for tests and inspection)."""
        codes = self.hash(x[None, :])[0]
        found = [
            self.items[self.offsets[t, b] : self.offsets[t, b] + self.fill[t, b]]
            for t, c in enumerate(codes)
            for b in range(int(c), self.n_buckets, self.n_codes)
        ]
        return np.unique(np.concatenate(found)) if found else np.zeros(0, np.int32)

    def state(self) -> dict[str, np.ndarray]:
        return {
            "srp": self.srp,
            "dwta": self.dwta,
            "codes": self.codes,
            "offsets": self.offsets,
            "fill": self.fill,
            "seen": self.seen,
            "items": self.items,
            "counters": np.array([self.generation, self.moves], np.int64),
        }

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        for name in ("srp", "dwta", "codes", "offsets", "fill", "seen", "items"):
            setattr(self, name, np.array(state[name]))
        self.generation, self.moves = (int(v) for v in state["counters"])


def reshard_tables(
    states: Sequence[Mapping[str, np.ndarray]],
    blocks: int,
    old_bounds: Sequence[int],
    new_bounds: Sequence[int],
    rank: int,
    prefix: str = "",
) -> dict[str, np.ndarray]:
    """The tables rank ``rank`` of ``len(new_bounds) - 1`` owns, cut from the tables ``states`` (arrays of
    :meth:`LSHIndex.state`, names behind ``prefix``, read lazily) of ``len(states)`` ranks.  ``*_bounds`` are the
    label boundaries of the ranks, old and new; the ranks split the ``blocks`` selection blocks evenly.

    A rank's tables are CSR arrays whose buckets run table by table, then block by block, then code; a block's
    buckets (capacity, fill, seen, items) move as a whole, with item ids re-based to the new first label, and a
    label's stored code (its local block x codes + code) is re-based to the new rank's first block."""
    old, size = len(old_bounds) - 1, len(new_bounds) - 1
    per_old, per_new = blocks // old, blocks // size
    g0, g1 = rank * per_new, (rank + 1) * per_new
    lo, hi = new_bounds[rank], new_bounds[rank + 1]
    offsets0 = states[0][prefix + "offsets"]
    n_tables = offsets0.shape[0]
    n_codes = (offsets0.shape[1] - 1) // per_old
    caps, fills, seens = [], [], []
    items: list[list[np.ndarray]] = [[] for _ in range(n_tables)]
    for g in range(g0, g1):
        r, gl = divmod(g, per_old)
        z = states[r]
        offsets, fill, seen, its = (z[prefix + k] for k in ("offsets", "fill", "seen", "items"))
        b0, b1 = gl * n_codes, (gl + 1) * n_codes
        caps.append(np.diff(offsets, axis=1)[:, b0:b1])
        fills.append(fill[:, b0:b1])
        seens.append(seen[:, b0:b1])
        shift = old_bounds[r] - lo
        for t in range(n_tables):
            seg = its[offsets[t, b0] : offsets[t, b1]]
            items[t].append(np.where(seg >= 0, seg + shift, seg).astype(np.int32))
    cap = np.concatenate(caps, axis=1)
    flat = np.cumsum(cap.ravel())
    new_offsets = np.zeros((n_tables, cap.shape[1] + 1), np.int64)
    new_offsets[:, 1:] = flat.reshape(cap.shape)
    new_offsets[1:, 0] = new_offsets[:-1, -1]
    codes = []
    for r in range(old):
        a, b = max(lo, old_bounds[r]), min(hi, old_bounds[r + 1])
        if a < b:
            rows = states[r][prefix + "codes"][a - old_bounds[r] : b - old_bounds[r]]
            codes.append(rows + (r * per_old - g0) * n_codes)
    return {
        "offsets": new_offsets,
        "fill": np.concatenate(fills, axis=1),
        "seen": np.concatenate(seens, axis=1),
        "items": np.concatenate([np.zeros(0, np.int32)] + [seg for t in range(n_tables) for seg in items[t]]),
        "codes": np.concatenate(codes).astype(np.int32),
    }


@dataclass(frozen=True)
class RehashSchedule:
    """When to rehash: the i-th rehash comes ``min(max_interval, first * growth**i)`` steps after the previous
    one (weights move most early in training), and every ``fresh_every``-th one draws new hash functions and
    rebuilds; the others rehash only the neurons touched since the last rehash."""

    first: int = 50
    growth: float = 1.5
    max_interval: int = 1000
    fresh_every: int = 8

    def interval(self, i: int) -> int:
        return max(1, min(self.max_interval, int(self.first * self.growth ** min(i, 60))))

    def is_fresh(self, i: int) -> bool:
        return self.fresh_every > 0 and (i + 1) % self.fresh_every == 0

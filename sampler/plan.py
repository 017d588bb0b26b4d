"""Mini-epoch plans: which files make up each mini-epoch of an epoch, and in which order they are served.

API
---
``plan_epoch(sizes, *, seed, epoch, nm=None, budget=None, composition="random", groups=None, order=None,
rank=0, world_size=1) -> list[np.ndarray]``
    The mini-epochs of one epoch, as a list of ``nm`` int64 arrays of indices into the file table (``sizes[i]`` is
    file ``i``'s size in bytes).  Each array is *this rank's* share of that mini-epoch, sorted in staging order =
    storage order (ascending ``order`` value, ties by index; ``order`` defaults to the index itself).
    ``budget`` is **per rank**: every rank's share of every mini-epoch holds at most ``budget`` bytes, so a node
    that stages its share into a cache of ``2 * budget`` bytes can double-buffer.  Give ``nm``, ``budget`` or both;
    with ``budget`` alone ``nm`` is the smallest count that fits (exactly for random and contiguous; stratified
    and reservoir search upward from ``total / (budget * world_size)``; see ``min_mini_epochs``).  Every file is in
    exactly one mini-epoch of exactly one rank per epoch.  All ranks compute the same global plan from the same
    arguments and keep their share, so no communication is needed.  Shares may be empty when there are fewer
    files than ``nm * world_size``.
``serving_order(indices, *, seed, epoch, mini_epoch, pass_index) -> np.ndarray``
    A fresh permutation of ``indices`` for each (seed, epoch, mini-epoch, pass).
``groups_from_paths(paths) -> np.ndarray``
    Group ids (parent directory) for ``composition="stratified"``.
``COMPOSITIONS``
    The accepted ``composition`` names.

Every bad argument raises ``ValueError`` naming the argument and the value received (a file larger than the
budget included), before any work is done.

Compositions
------------
All of them work on the files in storage order and cut (or deal) a sequence of files into ``nm * world_size``
pieces, ``world_size`` per mini-epoch, one per rank.  No piece is empty while there are at least as many files
as pieces, so the mini-epochs of every epoch are numbered 0..nm-1 without gaps.  Byte cuts are made piece by
piece, each nearest to an even share of what is left, within bounds that keep the rest feasible (one file for
each piece still to cut, and no more than the remaining pieces can hold under the budget).

``random``
    A uniform random permutation, cut into pieces of near-equal *bytes* (the cache is what is scarce); the pieces
    are then dealt to mini-epochs and ranks in random order, because byte-balanced cuts alone put large files in
    middle pieces more often.  Every file once per epoch, in each mini-epoch (and on each rank) with equal
    probability.  A file of at least an even share (the water level: ``total / k`` once every such file is
    counted as a piece of its own) cannot be balanced; such files go one to a piece and the other files are
    shared evenly over *all* pieces, so a 64 MiB file among 3,000 small ones makes one mini-epoch 64 MiB heavier,
    not one mini-epoch of 1 file beside one of 1,930 (when the budget cannot hold that, the large file's piece
    takes fewer small files, down to none).
``stratified``
    Files are shuffled within their group, groups are laid end to end in random order and dealt round-robin to the
    mini-epochs (then, within a mini-epoch, round-robin to the ranks).  Every group's count in every mini-epoch is
    ``floor`` or ``ceil`` of ``n_group / nm``, i.e. within one file of proportional; mini-epoch counts differ by at
    most one.  With a budget alone, ``nm`` grows until every share fits; with a fixed ``nm`` and a budget, up to
    8 deals (all derived from seed and epoch) are tried before giving up.
``contiguous``
    The paper's split: storage order cut into byte-balanced ranges (the same ranges every epoch); only the order in
    which the mini-epochs are visited (and which rank takes which sub-range) is shuffled per epoch.  Cheapest to
    stage (sequential reads), least random.  A file of at least an even share counts as one range's worth.
``reservoir``
    OneAccess: every file gets a uniform key per (seed, epoch) drawn in storage order (``reservoir.epoch_keys``);
    mini-epoch ``j`` is the bottom-``m`` sample by key among the files not yet taken this epoch, which is exactly
    what a bounded reservoir computes over one sequential sweep of the remaining stream
    (``reservoir.oneaccess_samples`` does it that way and yields the same samples).  Samples have equal *counts*
    (``m`` = ``ceil(n / nm)`` or one less), as in OneAccess; with a budget, when equal counts do not fit, the
    samples are the longest key-order runs that fit (split further when ``nm`` asks for more).  Read cost:
    choosing a sample reads nothing (keys come from the seed), staging a sample reads its files in one sequential
    sweep in storage order, so an epoch reads every byte once.
"""

from __future__ import annotations

import heapq
import itertools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sampler.reservoir import epoch_keys

__all__ = [
    "COMPOSITIONS",
    "groups_from_paths",
    "min_mini_epochs",
    "plan_epoch",
    "serving_order",
]

COMPOSITIONS = ("random", "stratified", "contiguous", "reservoir")

# Domain tags keep the plan's and the serving order's random streams apart for equal (seed, epoch).
_TAG_PLAN = 0x706C616E  # "plan"
_TAG_SERVE = 0x73727665  # "srve"
_TAG_VISIT = 0x76697374  # "vist"
_STRATIFIED_DEALS = 8


# --------------------------------------------------------------------------------------------------- validation


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _as_int_array(name: str, value: object, n: int | None) -> np.ndarray:
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if np.issubdtype(arr.dtype, np.floating) and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if n is not None and arr.shape[0] != n:
        raise ValueError(f"{name} must have one entry per file ({n}), got {arr.shape[0]}")
    return arr.astype(np.int64, copy=False)


def _check_sizes(sizes: object) -> np.ndarray:
    arr = _as_int_array("sizes", sizes, None)
    if arr.size and arr.min() < 0:
        i = int(np.argmin(arr))
        raise ValueError(f"sizes must be >= 0, got sizes[{i}]={int(arr[i])}")
    return arr


# ----------------------------------------------------------------------------------------------------- cutting


def _count_bounds(n: int, k: int) -> np.ndarray:
    """Boundaries cutting n items into k pieces whose counts differ by at most one (larger pieces first)."""
    q, r = divmod(n, k)
    counts = np.full(k, q, dtype=np.int64)
    counts[:r] += 1
    return np.concatenate(([0], np.cumsum(counts)))


def _greedy_bounds(cum: np.ndarray, budget: int) -> list[int]:
    """Fewest pieces of at most ``budget`` bytes for this sequence (next fit is optimal for contiguous pieces)."""
    n = cum.shape[0]
    bounds = [0]
    base = 0
    while bounds[-1] < n:
        end = int(np.searchsorted(cum, base + budget, side="right"))
        bounds.append(end)
        base = int(cum[end - 1])
    return bounds


def _piece_bytes(cum: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    c = np.concatenate(([0], cum))
    return c[bounds[1:]] - c[bounds[:-1]]


def _pad_bounds(cum: np.ndarray, bounds: list[int], k: int) -> np.ndarray:
    """Split the largest pieces (at their byte midpoint) until there are k; splitting never breaks a budget."""
    c = np.concatenate(([0], cum))
    heap = [(-(b - a), a, b) for a, b in itertools.pairwise(bounds)]
    heapq.heapify(heap)
    while len(heap) < k:
        neg, a, b = heapq.heappop(heap)
        if -neg <= 1:  # every piece is a single file or empty: the rest are empty pieces
            heapq.heappush(heap, (neg, a, b))
            heap.extend((0, b, b) for _ in range(k - len(heap)))
            break
        mid = int(np.searchsorted(c, (c[a] + c[b]) / 2, side="left"))
        mid = min(max(mid, a + 1), b - 1)
        heapq.heappush(heap, (-(mid - a), a, mid))
        heapq.heappush(heap, (-(b - mid), mid, b))
    return np.array(sorted([a for _, a, _ in heap] + [cum.shape[0]]), dtype=np.int64)


def _water_level(sizes: np.ndarray, k: int) -> float:
    """The even share L of k pieces once every file larger than L has a piece to itself (water filling).

    A file of at least ``total / k`` bytes cannot share a byte-balanced piece; counting it as exactly one piece
    and sharing the rest evenly is what keeps a 64 MiB file among 3,000 small ones from emptying its neighbours.
    """
    total = float(sizes.sum())
    level = total / k
    if int(sizes.max(initial=0)) < level:  # the usual case: every file shares
        return level
    for _ in range(k):
        heavy = sizes >= level
        h = int(heavy.sum())
        if h >= k:
            break
        new = (total - float(sizes[heavy].sum())) / (k - h)
        if new >= level:
            break
        level = new
    return level


def _suffix_pieces(cum0: np.ndarray, cap: int) -> np.ndarray:
    """need[i] = fewest pieces of at most ``cap`` bytes covering items i..n-1 (``cum0`` has a leading 0).

    Next fit from the right is optimal for every suffix at once: the suffix from i is covered by the right-packed
    pieces that reach it, the leftmost one cut short.
    """
    n = cum0.shape[0] - 1
    need = np.zeros(n + 1, dtype=np.int64)
    end, count = n, 0
    while end > 0:
        start = int(np.searchsorted(cum0, cum0[end] - cap, side="left"))
        start = min(start, end - 1)  # every file fits the cap (checked by the caller)
        count += 1
        need[start:end] = count
        end = start
    return need


def _balanced_bounds(seq_sizes: np.ndarray, weights: np.ndarray, k: int, cap: int | None) -> np.ndarray | None:
    """Boundaries cutting the sequence into k non-empty pieces of even ``weights`` and at most ``cap`` bytes.

    Pieces are cut one after another, each nearest to an even share of the weight that is left, within the
    bounds that keep the rest feasible: at least one file for each piece still to cut (empty pieces only when
    there are fewer files than pieces) and no more than the remaining pieces can hold under ``cap``.  None when
    no k pieces fit ``cap``.
    """
    n = seq_sizes.shape[0]
    w0 = np.concatenate(([0.0], np.cumsum(weights, dtype=np.float64)))
    if cap is not None:
        cum0 = np.concatenate(([0], np.cumsum(seq_sizes, dtype=np.int64)))
        need = _suffix_pieces(cum0, cap)
        if need[0] > k:
            return None
        neg_need = -need  # non-decreasing, for searchsorted
    bounds = np.zeros(k + 1, dtype=np.int64)
    base = 0
    for j in range(k - 1):
        left = k - j  # pieces still to cut, this one included
        if n - base <= left:  # one file each, then empty pieces
            pos = min(base + 1, n)
        else:
            target = w0[base] + (w0[n] - w0[base]) / left
            pos = min(int(np.searchsorted(w0, target, side="left")), n)
            if pos > 0 and target - w0[pos - 1] <= w0[pos] - target:
                pos -= 1
            lo, hi = base + 1, n - (left - 1)
            if cap is not None:
                lo = max(lo, int(np.searchsorted(neg_need, -(left - 1), side="left")))
                hi = min(hi, int(np.searchsorted(cum0, cum0[base] + cap, side="right")) - 1)
            if lo > hi:
                return None
            pos = min(max(pos, lo), hi)
        bounds[j + 1] = pos
        base = pos
    bounds[k] = n
    if cap is not None and int(cum0[n] - cum0[base]) > cap:
        return None
    return bounds


def _spread_large_files(
    seq: np.ndarray, seq_sizes: np.ndarray, k: int, budget: int | None
) -> tuple[np.ndarray, np.ndarray] | None:
    """A random sequence with every file too big to share in a piece of its own, and its k pieces' boundaries.

    The other files are cut into k pieces of even bytes first; large file j then goes into the middle of piece
    p_j -- a piece left empty first, then spread over the others (with ranks, piece p is a share of mini-epoch
    p // world_size: large files go to different ones).  So each mini-epoch gets its share of the files that can
    be shared, and at most one large file on top.  None when there is nothing to spread, or the pieces would not
    fit ``budget``.
    """
    n = seq_sizes.shape[0]
    if not n or not int(seq_sizes.sum()):
        return None
    level = _water_level(seq_sizes, k)
    large = seq_sizes >= level
    h = int(large.sum())
    if h == 0 or h >= k or n <= k:
        return None
    small = ~large
    rest, rest_sizes = seq[small], seq_sizes[small]
    bounds = _balanced_bounds(rest_sizes, rest_sizes.astype(np.float64), k, None)
    assert bounds is not None  # (no cap)
    # pieces without a file of their own (fewer small files than pieces) take a large one first; the other large
    # files spread over the pieces that have files
    empty = np.flatnonzero(bounds[1:] == bounds[:-1])
    full = np.flatnonzero(bounds[1:] != bounds[:-1])
    extra = h - min(h, len(empty))
    piece = np.sort(np.concatenate([empty[:h], full[(np.arange(extra) * len(full)) // max(1, extra)]]))
    at = (bounds[piece] + bounds[piece + 1]) // 2
    out = np.insert(rest, at, seq[large])
    out_sizes = np.insert(rest_sizes, at, seq_sizes[large])
    # a boundary moves right by the large files put into the pieces before it
    moved = bounds + np.searchsorted(piece, np.arange(k + 1), side="left")
    if budget is not None:
        cum0 = np.concatenate(([0], np.cumsum(out_sizes, dtype=np.int64)))
        if int((cum0[moved[1:]] - cum0[moved[:-1]]).max()) > budget:
            return None
    return out, moved


def _byte_weights(seq_sizes: np.ndarray, k: int) -> np.ndarray:
    """Sizes capped at the water level (a file too big to share counts as one piece), or counts if no bytes."""
    if not seq_sizes.size or not int(seq_sizes.sum()):
        return np.ones(seq_sizes.shape[0])
    level = _water_level(seq_sizes, k)
    return seq_sizes if int(seq_sizes.max()) < level else np.minimum(seq_sizes, level).astype(np.float64)


def _cut(seq: np.ndarray, seq_sizes: np.ndarray, k: int, budget: int | None, *, by: str,
         spread: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """(sequence, boundaries) cutting it into exactly k pieces each within ``budget``; None if impossible.

    With ``spread`` (a random sequence, whose order carries no meaning) large files may be moved so that no two
    share a piece; whether k pieces fit the budget is still decided on the sequence as given, so the fewest
    pieces that fit stay the same whichever way it is cut.
    """
    if by == "bytes":
        bounds = _balanced_bounds(seq_sizes, _byte_weights(seq_sizes, k), k, budget)
        if bounds is None:
            return None
        spreaded = _spread_large_files(seq, seq_sizes, k, budget) if spread else None
        return spreaded if spreaded is not None else (seq, bounds)
    cum = np.cumsum(seq_sizes, dtype=np.int64)
    bounds = _count_bounds(seq_sizes.shape[0], k)
    if budget is None or _piece_bytes(cum, bounds).max(initial=0) <= budget:
        return seq, bounds
    greedy = _greedy_bounds(cum, budget)
    if len(greedy) - 1 > k:
        return None
    return seq, _pad_bounds(cum, greedy, k)


def _min_pieces(seq_sizes: np.ndarray, budget: int) -> int:
    return max(1, len(_greedy_bounds(np.cumsum(seq_sizes, dtype=np.int64), budget)) - 1)


# --------------------------------------------------------------------------------------------------- the plan


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch, _TAG_PLAN])


def _permutation(rng: np.random.Generator, n: int) -> np.ndarray:
    """A uniform permutation of range(n); int32 when it fits, which halves the memory traffic of the shuffle."""
    perm = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    rng.shuffle(perm)
    return perm


def _stable_group_sort(labels: np.ndarray, n_labels: int) -> np.ndarray:
    """``argsort(labels, kind="stable")``; with few labels as uint16, which numpy sorts by radix in O(n)."""
    if n_labels <= 1 << 16:
        labels = labels.astype(np.uint16)
    return np.argsort(labels, kind="stable")


def _dense_ids(values: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense ids 0..k-1 for integer group values, in the order of the values; O(n) for small non-negative ids."""
    if values.size == 0:
        return values.astype(np.int64), 0
    lo, hi = int(values.min()), int(values.max())
    if lo >= 0 and hi <= 4 * values.size + 1024:
        present = np.bincount(values, minlength=hi + 1) > 0
        dense = np.cumsum(present) - 1
        return dense[values], int(present.sum())
    _, inverse = np.unique(values, return_inverse=True)
    return inverse.reshape(-1), int(inverse.max()) + 1


def _reservoir_pieces(
    s_sizes: np.ndarray, k: int, budget: int | None, seed: int, epoch: int
) -> list[np.ndarray] | None:
    """Equal-count reservoir samples without a full sort: cut the keys at k-1 order statistics.

    Returns all k pieces (storage ranks, ascending) or None when equal counts break the budget or when tied keys
    sit on a cut (then the caller takes the sorting path, which breaks ties by storage position as the stream does).
    """
    n = s_sizes.shape[0]
    keys = epoch_keys(n, seed=seed, epoch=epoch)
    bounds = _count_bounds(n, k)
    starts = bounds[1:-1]
    inner = starts[starts < n]
    thresholds = np.full(starts.shape[0], np.inf)
    if inner.size:
        part = np.partition(keys, np.unique(inner))
        thresholds[: inner.size] = part[inner]
    labels = np.searchsorted(thresholds, keys, side="right")
    counts = np.bincount(labels, minlength=k)
    if not np.array_equal(counts, np.diff(bounds)):
        return None
    if budget is not None and n and np.bincount(labels, weights=s_sizes, minlength=k).max() > budget:
        return None
    grouped = _stable_group_sort(labels, k)
    return np.split(grouped, bounds[1:-1])


def _sequence(composition: str, s_sizes: np.ndarray, seed: int, epoch: int) -> tuple[np.ndarray, str]:
    """The sequence (of storage ranks) that gets cut, and whether pieces balance bytes or counts."""
    n = s_sizes.shape[0]
    if composition == "random":
        return _permutation(_rng(seed, epoch), n), "bytes"
    if composition == "contiguous":
        return np.arange(n, dtype=np.int64), "bytes"
    # reservoir: key order; bottom-m by key among the remaining = the next m of this sequence
    return np.argsort(epoch_keys(n, seed=seed, epoch=epoch), kind="stable"), "count"


def _stratified_pieces(
    s_groups: np.ndarray,
    s_sizes: np.ndarray,
    nm: int | None,
    budget: int | None,
    world_size: int,
    rank: int,
    seed: int,
    epoch: int,
) -> list[np.ndarray]:
    """This rank's stratified pieces (unsorted storage ranks), one per mini-epoch.

    Groups are laid end to end in random order with their files shuffled, and position p of that deal goes to
    slot ``p mod (nm * world_size)``: slot ``a + nm * s`` is a share of mini-epoch ``label[a]`` (``label`` a
    random permutation), taken by the rank ``owner[a, s]`` (a random permutation of the ranks per mini-epoch).
    A group's files form one run of the deal, so every slot, and every mini-epoch (nm consecutive deal positions
    hold one file of each mini-epoch), gets floor or ceil of its share.
    """
    n = s_groups.shape[0]
    rng = _rng(seed, epoch)
    inverse, n_groups = _dense_ids(s_groups)

    def new_deal() -> np.ndarray:
        group_rank = rng.permutation(n_groups)[inverse]
        shuffled = _permutation(rng, n)
        return shuffled[_stable_group_sort(group_rank[shuffled], n_groups)]

    deal = new_deal()
    if budget is not None and nm is not None:
        # a fixed nm can only be met by another deal; a few fresh ones (still a function of seed and epoch)
        for _ in range(_STRATIFIED_DEALS - 1):
            worst = _worst_slot(s_sizes[deal], nm * world_size)
            if worst <= budget:
                break
            deal = new_deal()
        else:
            worst = _worst_slot(s_sizes[deal], nm * world_size)
        if worst > budget:
            raise ValueError(
                f"budget={budget} is too small for nm={nm} with stratified composition "
                f"(a share needs {worst} bytes in {_STRATIFIED_DEALS} tries); raise budget or nm, or give budget alone"
            )
    elif budget is not None:
        deal_sizes = s_sizes[deal]
        k_nm = max(1, -(-int(s_sizes.sum()) // (budget * world_size)))
        while (worst := _worst_slot(deal_sizes, k_nm * world_size)) > budget:
            # bytes per slot shrink about in proportion to 1/nm; at nm >= n every slot holds one file, which fits
            k_nm = max(k_nm + 1, min(max(n, 1), -(-k_nm * worst // budget)))
        nm = k_nm
    assert nm is not None
    label = rng.permutation(nm)
    # the first slots of a deal get the extra files; random owners keep every file's rank exactly uniform
    owner = rng.permuted(np.tile(np.arange(world_size), (nm, 1)), axis=1)
    k = nm * world_size
    pieces: list[np.ndarray] = [np.zeros(0, np.int64)] * nm
    for a in range(nm):
        slot = int(np.flatnonzero(owner[a] == rank)[0])
        pieces[label[a]] = deal[a + nm * slot :: k]
    return pieces


def _worst_slot(deal_sizes: np.ndarray, k: int) -> int:
    """Largest byte total of the k round-robin slots of the deal."""
    if deal_sizes.size == 0:
        return 0
    padded = np.zeros(-(-deal_sizes.size // k) * k, dtype=np.int64)
    padded[: deal_sizes.size] = deal_sizes
    return int(padded.reshape(-1, k).sum(axis=0).max())


def _reservoir_fast(
    s_sizes: np.ndarray, nm: int | None, budget: int | None, world_size: int, seed: int, epoch: int
) -> tuple[int, list[np.ndarray]] | None:
    """(nm, pieces) from equal-count samples, or None to fall back to the sorting path."""
    if nm is not None:
        pieces = _reservoir_pieces(s_sizes, nm * world_size, budget, seed, epoch)
        return None if pieces is None else (nm, pieces)
    assert budget is not None
    # the smallest nm whose equal-count samples fit; a few tries from the lower bound, then the sorting path
    k_nm = max(1, -(-int(s_sizes.sum()) // (budget * world_size)))
    for _ in range(4):
        pieces = _reservoir_pieces(s_sizes, k_nm * world_size, budget, seed, epoch)
        if pieces is not None:
            return k_nm, pieces
        k_nm += 1
    return None


@dataclass(frozen=True)
class _Request:
    """One plan to make, in storage-rank space: what every composition function gets."""

    sizes: np.ndarray
    groups: np.ndarray | None
    nm: int | None
    budget: int | None
    world_size: int
    rank: int
    seed: int
    epoch: int
    composition: str


def _compose_stratified(r: _Request) -> tuple[list[np.ndarray], bool]:
    assert r.groups is not None
    return _stratified_pieces(r.groups, r.sizes, r.nm, r.budget, r.world_size, r.rank, r.seed, r.epoch), False


def _compose_reservoir(r: _Request) -> tuple[list[np.ndarray], bool]:
    fast = _reservoir_fast(r.sizes, r.nm, r.budget, r.world_size, r.seed, r.epoch)
    if not fast:
        return _compose_cut(r)
    nm, all_pieces = fast
    # a stable sort by sample label kept storage order inside each sample: presorted
    return [all_pieces[j * r.world_size + r.rank] for j in range(nm)], True


def _compose_cut(r: _Request) -> tuple[list[np.ndarray], bool]:
    """random, contiguous (and reservoir when its fast path cannot): cut a sequence into balanced pieces."""
    nm, budget, world_size = r.nm, r.budget, r.world_size
    seq, by = _sequence(r.composition, r.sizes, r.seed, r.epoch)
    seq_sizes = r.sizes[seq]
    spread = r.composition == "random"
    if nm is None:
        assert budget is not None
        k = _min_pieces(seq_sizes, budget)
        k = -(-k // world_size) * world_size
        cut = _cut(seq, seq_sizes, k, budget, by=by, spread=spread)
        while cut is None:  # rounding to a multiple of world_size can only help, but stay safe
            k += world_size
            cut = _cut(seq, seq_sizes, k, budget, by=by, spread=spread)
        nm = k // world_size
    else:
        cut = _cut(seq, seq_sizes, nm * world_size, budget, by=by, spread=spread)
        if cut is None:
            need = -(-_min_pieces(seq_sizes, budget) // world_size)  # type: ignore[arg-type]
            raise ValueError(
                f"budget={budget} is too small for nm={nm} with {r.composition} composition "
                f"(this epoch needs nm >= {need}); raise budget or nm, or give budget alone"
            )
    seq, bounds = cut
    visit = np.arange(nm)
    owner = np.tile(np.arange(world_size), (nm, 1))
    if r.composition != "reservoir":  # reservoir samples come in key order, as the stream makes them
        # Byte-balanced cuts are not symmetric in position: a large file tends to land in a middle piece.
        # Relabelling the pieces at random makes every file's mini-epoch (and rank) exactly uniform.
        vrng = np.random.default_rng([r.seed, r.epoch, _TAG_VISIT])
        visit = vrng.permutation(nm)
        owner = vrng.permuted(owner, axis=1)
    pieces = []
    for j in range(nm):
        piece = visit[j] * world_size + int(np.flatnonzero(owner[j] == r.rank)[0])
        pieces.append(seq[bounds[piece] : bounds[piece + 1]])
    return pieces, False


#: composition name -> the function that makes its pieces (as mosaicml/streaming looks up its shuffles)
_COMPOSE: dict[str, Callable[[_Request], tuple[list[np.ndarray], bool]]] = {
    "random": _compose_cut,
    "contiguous": _compose_cut,
    "reservoir": _compose_reservoir,
    "stratified": _compose_stratified,
}


def min_mini_epochs(
    sizes: np.ndarray,
    *,
    budget: int,
    seed: int = 0,
    epoch: int = 0,
    composition: str = "random",
    groups: np.ndarray | None = None,
    order: np.ndarray | None = None,
    world_size: int = 1,
) -> int:
    """The ``nm`` that ``plan_epoch`` picks when given only ``budget`` (it can differ by epoch for random orders)."""
    return len(
        plan_epoch(
            sizes,
            seed=seed,
            epoch=epoch,
            budget=budget,
            composition=composition,
            groups=groups,
            order=order,
            world_size=world_size,
        )
    )


def plan_epoch(
    sizes: np.ndarray,
    *,
    seed: int,
    epoch: int,
    nm: int | None = None,
    budget: int | None = None,
    composition: str = "random",
    groups: np.ndarray | None = None,
    order: np.ndarray | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> list[np.ndarray]:
    """The mini-epochs of one epoch: this rank's share of each, in storage order.  See the module docstring."""
    s = _check_sizes(sizes)
    n = s.shape[0]
    seed = _check_int("seed", seed, minimum=0)
    epoch = _check_int("epoch", epoch, minimum=0)
    world_size = _check_int("world_size", world_size, minimum=1)
    rank = _check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    if composition not in COMPOSITIONS:
        raise ValueError(f"composition must be one of {', '.join(COMPOSITIONS)}; got {composition!r}")
    if nm is None and budget is None:
        raise ValueError("give nm or budget (or both); got nm=None and budget=None")
    if nm is not None:
        nm = _check_int("nm", nm, minimum=1)
    if budget is not None:
        budget = _check_int("budget", budget, minimum=1)
        if n and int(s.max()) > budget:
            i = int(np.argmax(s))
            raise ValueError(f"budget={budget} is smaller than file {i} ({int(s[i])} bytes); every file must fit")
    g = None
    if composition == "stratified":
        if groups is None:
            raise ValueError("groups is required for composition='stratified', got None")
        g = _as_int_array("groups", groups, n)
    elif groups is not None:
        _as_int_array("groups", groups, n)
    if order is not None:
        o = np.asarray(order)
        if o.ndim != 1 or o.shape[0] != n:
            raise ValueError(f"order must be a 1-D array with one entry per file ({n}), got shape {o.shape}")
        if o.size and not (np.issubdtype(o.dtype, np.integer) or np.issubdtype(o.dtype, np.floating)):
            raise ValueError(f"order must be numeric, got dtype {o.dtype}")
        if np.issubdtype(o.dtype, np.floating) and not np.all(np.isfinite(o)):
            raise ValueError("order must be finite, got NaN or inf")
        storage = np.argsort(o, kind="stable").astype(np.int64)  # storage rank -> file index
    else:
        storage = None

    # Work in storage-rank space: item t is the t-th file in storage order.
    s_sizes = s if storage is None else s[storage]
    s_groups = None if g is None else (g if storage is None else g[storage])
    pieces, presorted = _COMPOSE[composition](
        _Request(s_sizes, s_groups, nm, budget, world_size, rank, seed, epoch, composition))

    out = []
    for piece in pieces:
        ranks_sorted = (piece if presorted else np.sort(piece)).astype(np.int64, copy=False)
        out.append(ranks_sorted if storage is None else storage[ranks_sorted])
    return out


def serving_order(indices: np.ndarray, *, seed: int, epoch: int, mini_epoch: int, pass_index: int) -> np.ndarray:
    """A fresh uniform permutation of ``indices`` for this (seed, epoch, mini-epoch, pass).

    Ranks serve disjoint shares, so the same call on each rank's share gives independent orders.
    """
    seed = _check_int("seed", seed, minimum=0)
    epoch = _check_int("epoch", epoch, minimum=0)
    mini_epoch = _check_int("mini_epoch", mini_epoch, minimum=0)
    pass_index = _check_int("pass_index", pass_index, minimum=0)
    arr = np.asarray(indices)
    if arr.ndim != 1:
        raise ValueError(f"indices must be a 1-D array, got shape {arr.shape}")
    rng = np.random.default_rng([seed, epoch, mini_epoch, pass_index, _TAG_SERVE])
    return arr[rng.permutation(arr.shape[0])]


def groups_from_paths(paths: Sequence[str]) -> np.ndarray:
    """Group id per file = index of its parent directory among the sorted distinct parents."""
    parents = [os.path.dirname(p) for p in paths]
    names = {d: i for i, d in enumerate(sorted(set(parents)))}
    return np.fromiter((names[d] for d in parents), dtype=np.int64, count=len(parents))

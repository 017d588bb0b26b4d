"""``dslide gen``: synthetic extreme-classification data with a structure a model can learn.

The plant, all drawn from ``seed``:

* labels have power-law popularity (a random label order, weight ``rank**-alpha``) and sit in clusters of
  ``cluster_size``; a point's labels are one primary label drawn by popularity plus co-labels from the same
  cluster (about ``labels_per_point`` in all, Poisson);
* every label owns ``features_per_label`` informative features and every cluster ``features_per_cluster``;
  a point's non-zeros (lognormal count, mean ``nnz_per_point``) are a share ``informative`` of features of its
  labels and its cluster, the rest noise from a power law over all features;
* values are lognormal, each point scaled to unit L2 norm (tf-idf-like).

So the labels are predictable from the features, frequent labels are easy, rare ones hard, and the most
frequent label alone gives a low P@1 -- the baseline a learning test must beat.  Everything is vectorised
numpy, so the Amazon-670K shape (the defaults) takes seconds, not minutes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from dslide.data import XCData, write_xc

__all__ = ["AMAZON_670K", "Plant", "generate", "write_dataset"]

#: (features, labels) of Amazon-670K, the defaults of ``dslide gen``.
AMAZON_670K = (135_909, 670_091)


@dataclass(frozen=True)
class Plant:
    labels_per_point: float = 5.0
    nnz_per_point: float = 64.0
    nnz_sigma: float = 0.6
    cluster_size: int = 16
    features_per_label: int = 24
    features_per_cluster: int = 48
    informative: float = 0.7
    alpha: float = 0.9  # label popularity ~ rank**-alpha


def generate(n_points: int, n_features: int, n_labels: int, seed: int = 0, plant: Plant | None = None) -> XCData:
    """``n_points`` points of the planted structure for ``seed`` (the structure depends on seed, F and L only,
    so a train and a test set are two disjoint slices of one call, or two calls with a different
    ``n_points`` -- the first points are the same)."""
    plant = plant or Plant()
    if n_points < 0 or n_features < 1 or n_labels < 1:
        raise ValueError(f"need points >= 0, features >= 1, labels >= 1, got {n_points}, {n_features}, {n_labels}")
    srng = np.random.default_rng((seed, 0))
    F, L, cs = n_features, n_labels, max(1, min(plant.cluster_size, n_labels))
    n_clusters = -(-L // cs)
    pop_order = srng.permutation(L)  # label pop_order[r] has popularity rank r
    weight = np.empty(L)
    weight[pop_order] = (np.arange(L) + 1.0) ** -plant.alpha
    members: np.ndarray = np.full(n_clusters * cs, -1, np.int64)  # (reshaped below: a row per cluster)
    members[:L] = srng.permutation(L)
    members = members.reshape(n_clusters, cs)
    cluster_of = np.empty(L, np.int64)
    cluster_of[members[members >= 0]] = np.nonzero(members >= 0)[0]
    label_feats = srng.integers(0, F, (L, plant.features_per_label))
    cluster_feats = srng.integers(0, F, (n_clusters, plant.features_per_cluster))
    noise_order = srng.permutation(F)

    rng = np.random.default_rng((seed, 1))
    n = n_points
    # labels: primary by popularity, co-labels by popularity inside the primary's cluster
    primary = np.searchsorted(np.cumsum(weight / weight.sum()), rng.random(n), side="right")
    primary = np.minimum(primary, L - 1)
    cl = cluster_of[primary]
    n_co = np.minimum(rng.poisson(max(plant.labels_per_point - 1.0, 0.0), n), cs - 1)
    # co-labels without replacement, weighted by popularity (Efraimidis-Spirakis keys log(u)/w, largest win)
    m = members[cl]
    keys = np.log(rng.random((n, cs))) / np.where(m >= 0, weight[np.maximum(m, 0)], 1.0)
    keys[(m < 0) | (m == primary[:, None])] = -np.inf
    order = np.argsort(-keys, axis=1, kind="stable")
    take = np.arange(cs)[None, :] < n_co[:, None]
    co_rows = np.nonzero(take)[0]
    co = np.take_along_axis(m, order, axis=1)[take]
    rows_y = np.concatenate([np.arange(n), co_rows])
    labs = np.concatenate([primary, co])
    keep = labs >= 0
    y_indptr, y_indices = _to_csr(rows_y[keep], labs[keep], n, L)

    # features
    # draws collide (a point's labels share a cluster; noise is power-law), so draw ~15 % more than the target
    mu = np.log(plant.nnz_per_point * 1.15) - plant.nnz_sigma**2 / 2
    nnz = np.clip(np.rint(rng.lognormal(mu, plant.nnz_sigma, n)), 1, F).astype(np.int64)
    n_inf = np.rint(nnz * plant.informative).astype(np.int64)
    n_lab_f = (n_inf + 1) // 2
    n_cl_f = n_inf - n_lab_f
    n_noise = nnz - n_inf
    # label-specific features: a random label of the point, a random one of its features
    r1 = np.repeat(np.arange(n), n_lab_f)
    ny = np.diff(y_indptr)
    pick = y_indptr[r1] + (rng.random(len(r1)) * ny[r1]).astype(np.int64)
    f1 = label_feats[y_indices[pick], rng.integers(0, plant.features_per_label, len(r1))]
    r2 = np.repeat(np.arange(n), n_cl_f)
    f2 = cluster_feats[cl[r2], rng.integers(0, plant.features_per_cluster, len(r2))]
    r3 = np.repeat(np.arange(n), n_noise)
    f3 = noise_order[np.minimum((rng.random(len(r3)) ** 2.5 * F).astype(np.int64), F - 1)]
    rows_x = np.concatenate([r1, r2, r3])
    feats = np.concatenate([f1, f2, f3])
    x_indptr, x_indices = _to_csr(rows_x, feats, n, F)
    vals = rng.lognormal(0.0, 0.5, len(x_indices))
    sq = np.add.reduceat(vals * vals, x_indptr[:-1]) if len(vals) else np.zeros(n)
    lengths = np.diff(x_indptr)
    sq = np.where(lengths > 0, sq, 1.0)
    vals /= np.repeat(np.sqrt(sq), lengths)
    return XCData(F, L, x_indptr, x_indices, vals.astype(np.float32), y_indptr, y_indices)


def _to_csr(rows: np.ndarray, cols: np.ndarray, n_rows: int, n_cols: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, de-duplicated CSR pattern of the (row, col) pairs."""
    key = np.sort(rows.astype(np.int64) * n_cols + cols.astype(np.int64))
    if len(key):
        key = key[np.concatenate(([True], key[1:] != key[:-1]))]
    indptr = np.zeros(n_rows + 1, np.int64)
    np.cumsum(np.bincount(key // n_cols, minlength=n_rows), out=indptr[1:])
    return indptr, (key % n_cols).astype(np.int32)


def write_dataset(
    out: str | os.PathLike[str],
    n_points: int,
    n_features: int,
    n_labels: int,
    *,
    shards: int = 1,
    test_points: int | None = None,
    seed: int = 0,
    plant: Plant | None = None,
) -> dict[str, object]:
    """Write ``OUT/train/part-NNNNN.txt`` (``shards`` files) and ``OUT/test.txt``; returns a summary."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if test_points is None:
        test_points = max(1, n_points // 10)
    data = generate(n_points + test_points, n_features, n_labels, seed, plant)
    train_dir = os.path.join(out, "train")
    os.makedirs(train_dir, exist_ok=True)
    bounds = np.linspace(0, n_points, shards + 1).astype(np.int64)
    files = []
    for s in range(shards):
        path = os.path.join(train_dir, f"part-{s:05d}.txt")
        write_xc(path, data.subset(np.arange(bounds[s], bounds[s + 1])))
        files.append(path)
    test_path = os.path.join(out, "test.txt")
    write_xc(test_path, data.subset(np.arange(n_points, n_points + test_points)))
    return {
        "train": train_dir,
        "test": test_path,
        "shards": shards,
        "points": n_points,
        "test_points": test_points,
        "features": n_features,
        "labels": n_labels,
        "nnz_per_point": float(np.diff(data.x_indptr).mean()) if len(data) else 0.0,
        "labels_per_point": float(np.diff(data.y_indptr).mean()) if len(data) else 0.0,
    }

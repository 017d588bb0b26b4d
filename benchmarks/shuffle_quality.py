"""Shuffle quality of the sampling modes: full shuffle vs mini-epochs (random, stratified, contiguous, reservoir).

A data set of ``--files`` files in storage order, grouped into ``--dirs`` directories of consecutive files (as a
class-per-folder image set is laid out).  Every mode serves ``--epochs`` epochs; the MET modes split each epoch
into ``--nm`` mini-epochs and serve each ``--rf`` times in a fresh order per pass (``serving_order``).  Metrics
(``sampler.quality``):

- position uniformity: chi-square over epochs of the bin (one of ``nm``) where each file is first served; the
  statistic over its degrees of freedom is ~1 for an unbiased mode, p-value alongside;
- neighbour entropy: entropy (bits) of |index difference| between consecutively served files over the first
  ``files`` served of each epoch (Mosaic Streaming's figure): low = storage neighbours served together;
- directory mix: mean number of distinct directories in each window of 64 consecutively served files;
- distinct share: distinct files among the first ``files`` served of each epoch (1 = no repeats; MET: 1/rf);
- visit spread: coefficient of variation of per-file visit counts over the whole run.

Extra rows: the bounded-buffer streaming shuffle (one sequential read, buffer = files / nm), and random
mini-epochs with an adaptive rf (uniform in 1..2*rf per mini-epoch, as ARF produces), which only the visit spread
tells apart.

    .venv/bin/python benchmarks/shuffle_quality.py [--files 10000] [--epochs 80] [--nm 16] [--rf 4]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

from sampler.plan import plan_epoch, serving_order
from sampler.quality import distinct_fraction, neighbour_entropy, position_uniformity, visit_spread
from sampler.reservoir import streaming_shuffle

WINDOW = 64


def met_stream(plan: list[np.ndarray], seed: int, epoch: int, rfs: list[int]) -> np.ndarray:
    parts = [
        serving_order(me, seed=seed, epoch=epoch, mini_epoch=j, pass_index=p)
        for j, me in enumerate(plan)
        for p in range(rfs[j])
    ]
    return np.concatenate(parts)


def directory_mix(stream: np.ndarray, dirs_of: np.ndarray) -> float:
    usable = stream[: stream.size // WINDOW * WINDOW].reshape(-1, WINDOW)
    d = np.sort(dirs_of[usable], axis=1)
    return float((1 + (np.diff(d, axis=1) != 0).sum(axis=1)).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--dirs", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--nm", type=int, default=16)
    parser.add_argument("--rf", type=int, default=4)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--png", default="bench-out/shuffle_quality.png",
                        help="docs/img/shuffle_quality.png: on purpose")
    args = parser.parse_args()
    n, nm, rf, seed = args.files, args.nm, args.rf, args.seed

    rng = np.random.default_rng(seed)
    sizes = np.maximum(rng.lognormal(np.log(110e3), 0.6, size=n), 1024).astype(np.int64)
    dirs_of = np.arange(n) * args.dirs // n  # consecutive files share a directory

    def plan_mode(composition: str, arf: bool = False):
        arf_rng = np.random.default_rng(seed + 1)

        def serve(epoch: int) -> np.ndarray:
            plan = plan_epoch(sizes, seed=seed, epoch=epoch, nm=nm, composition=composition, groups=dirs_of)
            rfs = [int(arf_rng.integers(1, 2 * rf + 1)) for _ in plan] if arf else [rf] * nm
            return met_stream(plan, seed, epoch, rfs)

        return serve

    def full_shuffle(epoch: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch]).permutation(n)

    def streaming(epoch: int) -> np.ndarray:
        return np.fromiter(
            streaming_shuffle(range(n), max(1, n // nm), np.random.default_rng([seed, epoch, 1])),
            dtype=np.int64,
            count=n,
        )

    modes = [
        ("full shuffle (1 pass/epoch)", full_shuffle),
        ("random mini-epochs", plan_mode("random")),
        ("stratified mini-epochs", plan_mode("stratified")),
        ("contiguous mini-epochs", plan_mode("contiguous")),
        ("reservoir (OneAccess)", plan_mode("reservoir")),
        (f"streaming shuffle, buffer n/{nm}", streaming),
        (f"random, adaptive rf 1..{2 * rf}", plan_mode("random", arf=True)),
    ]

    from tqdm import tqdm

    rows = []
    t0 = time.perf_counter()
    for name, serve in tqdm(modes, desc="modes", unit="mode"):
        streams = [serve(e) for e in range(args.epochs)]
        pos = position_uniformity(streams, n, bins=nm)
        rows.append(
            {
                "mode": name,
                "chi2_dof": pos.statistic / pos.dof,
                "p": pos.p_value,
                "entropy": float(np.mean([neighbour_entropy(s[:n]) for s in streams])),
                "dirs": float(np.mean([directory_mix(s[:n], dirs_of) for s in streams])),
                "cv": visit_spread(streams, n).cv,
                "distinct": float(np.mean([distinct_fraction(s[:n], n) for s in streams])),
                "served": int(np.mean([s.size for s in streams])),
            }
        )
    elapsed = time.perf_counter() - t0

    ideal_dirs = args.dirs * (1 - (1 - 1 / args.dirs) ** WINDOW)
    print(
        f"\n{n:,} files in {args.dirs} directories, {args.epochs} epochs, nm={nm}, rf={rf}, seed={seed}; "
        f"{os.cpu_count()} cores, Python {platform.python_version()}, {elapsed:.0f} s"
    )
    print(
        f"| {'mode':<32} | served/epoch | position chi2/dof | p-value  | neighbour entropy, bits | "
        f"dirs per {WINDOW} | distinct share | visit CV |"
    )
    print(
        f"|{'-' * 34}|--------------|-------------------|----------|-------------------------|-------------|"
        f"----------------|----------|"
    )
    for r in rows:
        print(
            f"| {r['mode']:<32} | {r['served']:>12,} | {r['chi2_dof']:>17.3f} | {r['p']:>8.2g} | "
            f"{r['entropy']:>23.2f} | {r['dirs']:>11.1f} | {r['distinct']:>14.3f} | {r['cv']:>8.3f} |"
        )
    print(
        f"(directories per window of {WINDOW} under independent sampling: {ideal_dirs:.1f}; the full shuffle row "
        f"is the reference for the entropy)"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["mode"] for r in rows]
    fig, axes = plt.subplots(1, 5, figsize=(19, 4.5), sharey=True)
    panels = [
        ("position chi2 / dof (1 = uniform)", [r["chi2_dof"] for r in rows], 1.0),
        ("neighbour entropy, bits", [r["entropy"] for r in rows], None),
        (f"distinct dirs per {WINDOW} served", [r["dirs"] for r in rows], ideal_dirs),
        (f"distinct share of first {n:,} served", [r["distinct"] for r in rows], 1.0),
        ("visit-count CV", [r["cv"] for r in rows], None),
    ]
    colors = ["tab:gray", "tab:blue", "tab:green", "tab:red", "tab:purple", "tab:orange", "tab:cyan"]
    for ax, (title, values, ref) in zip(axes, panels, strict=True):
        ax.barh(names, values, color=colors[: len(names)])
        if ref is not None:
            ax.axvline(ref, color="black", ls="--", lw=1)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=8)
    axes[0].set_xscale("log")
    axes[0].invert_yaxis()
    fig.suptitle(f"Shuffle quality: {n:,} files, {args.dirs} dirs, {args.epochs} epochs, nm={nm}, rf={rf}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()

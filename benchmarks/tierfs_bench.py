"""tierfs side by side: the same loader, the same data, the same throttled slow tier, with and without tierfs.

One command runs every configuration of issue 4 in one run, per workload:

=================  ==================================================================================
``backing``        the loader on the slow tier directly (what tierfs must beat)
``fast``           the loader on a full copy in the fast tier (what tierfs should come close to)
``lru``            tierfs ``policy=lru``, same capacity (the read-through cache baseline)
``met-rfR``        tierfs MET, ``rf`` 1, 2, 4, 8, ``composition=random``
``met-auto``       tierfs MET, ``rf=auto``
``reservoir-rf4``  tierfs MET, ``composition=reservoir``, ``rf=4``
``*-direct``       the same, the loader opening files with ``tierfs.direct.open_cached`` (cached copies read
                   directly, without the FUSE data path)
``*-plan``         the same, the loader reading each pass's batch plan (``tierfs.loaders.read_plan``) and the
                   copies it names (checked with ``fstat``), reporting them at the pass's end
``torch-*``        the same pass through ``torch.utils.data.DataLoader`` (when torch is importable)
=================  ==================================================================================

How it measures.  The slow tier is an ext4 loop device throttled by the block-IO cgroup controller
(:mod:`slowtier`); the consumer's compute time per sample is set so that it consumes ``--consume`` times the
throttle's bandwidth.  Every configuration starts cold (page cache, dentries and inodes dropped, an empty cache
dir) and runs until it has consumed ``--epochs`` epoch-equivalents of samples (one = the dataset's file count;
on a mount a pass covers only the current view, so an epoch-equivalent spans several passes).  Before every pass
the page cache is dropped (clean pages only, outside the timed region), so no configuration is served from RAM
across passes -- the slow tier stands for one larger than memory, the fast tier is the local disk.  With
``--page-cache keep-fast`` only the slow tier's pages are evicted (``POSIX_FADV_DONTNEED``), so the fast tier and
the mount may serve from RAM, as they do when a mini-epoch fits in memory.  Per
epoch-equivalent it reports wall time, stall seconds (consumer waiting for data), the loop device's real reads
(``/proc/diskstats``), tierfs's own ``backing_bytes_read``, hit ratio and samples/s; the first
epoch-equivalent (cold start, first mini-epoch staged) is shown apart from the steady state.

Writes ``OUT/tierfs_bench.md`` (the tables), ``OUT/tierfs_bench.json`` (every pass) and
``PLOTS/tierfs_bench_<workload>.png`` (``--plots``, default ``--out``); to update the docs, ``--out
benchmarks/results --plots docs/img``.  Needs root.  Quick check: ``--scale 0.05 --epochs 2``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loader import LoaderConfig, PassStats, ThreadLoader, TorchLoader
from slowtier import (
    MiB,
    SlowTier,
    Workload,
    drop_caches,
    install_sigterm,
    parse_size,
    require_root,
    slow_tier,
)

MAX_EXTRA_PASSES = 32  # after the sample target, passes allowed to reach the next mini-epoch switch
ALL_CONFIGS = [
    "backing",
    "fast",
    "lru",
    "met-rf1",
    "met-rf2",
    "met-rf4",
    "met-rf8",
    "met-auto",
    "reservoir-rf4",
    "met-rf4-direct",
    "met-rf8-direct",
    "met-auto-direct",
    "met-rf4-plan",
    "torch-backing",
    "torch-met-rf4",
    "torch-met-rf4-direct",
]


@dataclass(frozen=True)
class Config:
    """One column of the comparison: where the loader reads, with which loader, and the mount options."""

    name: str
    source: str  # "backing" | "fast" | "mount"
    loader: str = "threads"  # "threads" | "torch"
    options: tuple[tuple[str, object], ...] = ()
    direct: bool = False  # the loader opens files with tierfs.direct.open_cached
    plan: bool = False  # the loader reads batch plans (tierfs.loaders.read_plan)

    @property
    def rf(self) -> float | None:
        rf = dict(self.options).get("rf")
        return float(rf) if isinstance(rf, int) else None


def make_config(name: str, nm: int) -> Config:
    torch = name.startswith("torch-")
    base = name.removeprefix("torch-")
    if base.endswith("-direct") and base.startswith(("met-", "reservoir-")):
        return dataclasses.replace(make_config(name.removesuffix("-direct"), nm), name=name, direct=True)
    if base.endswith("-plan") and base.startswith(("met-", "reservoir-")) and not torch:
        return dataclasses.replace(make_config(name.removesuffix("-plan"), nm), name=name, plan=True)
    loader = "torch" if torch else "threads"
    if base in ("backing", "fast"):
        return Config(name, base, loader)
    if base == "lru":
        return Config(name, "mount", loader, (("policy", "lru"), ("view", "full")))
    kind, _, rf = base.replace("-auto", "-rfauto").partition("-rf")
    if kind not in ("met", "reservoir") or not rf:
        raise SystemExit(f"unknown configuration {name!r}; known: {', '.join(ALL_CONFIGS)}")
    rf_value: object = "auto" if rf == "auto" else int(rf)
    composition = "reservoir" if kind == "reservoir" else "random"
    return Config(
        name, "mount", loader, (("policy", "met"), ("nm", nm), ("rf", rf_value), ("composition", composition))
    )


@dataclass
class PassRecord:
    """A pass and the counters around it (device bytes and tierfs status, read just before the pass began)."""

    stats: PassStats
    device_bytes: int = 0
    backing_bytes: int | None = None
    hits: int | None = None
    misses: int | None = None
    cache_bytes: int | None = None


@dataclass
class Result:
    workload: str
    config: str
    passes: list[PassRecord] = field(default_factory=list)
    error: str | None = None
    rf_effective: list[int] | None = None
    cache_bytes_max: int = 0
    cache_bytes_end: int = 0  # staged but not yet consumed when the run stopped
    ended_on_switch: bool = False
    device_bytes_total: int = 0  # from the first pass's start to the end of the run
    backing_bytes_total: int = 0

    def amortised_backing(self, n_files: int) -> tuple[float, float]:
        """(device, tierfs) backing bytes per epoch-equivalent over the whole run, cold start included, less
        what is staged but unconsumed at the end (only exact when the run ended on a mini-epoch switch)."""
        epochs = sum(r.stats.samples for r in self.passes) / n_files
        dev = self.device_bytes_total - self.cache_bytes_end
        tfs = self.backing_bytes_total - self.cache_bytes_end
        return dev / epochs, tfs / epochs

    def epochs(self, n_files: int) -> list[dict[str, float]]:
        """Group passes into epoch-equivalents (a bucket closes once it holds ``n_files`` samples)."""
        out: list[dict[str, float]] = []
        bucket: list[PassRecord] = []
        for rec in self.passes:
            bucket.append(rec)
            if sum(r.stats.samples for r in bucket) >= n_files:
                out.append(_summarise(bucket))
                bucket = []
        if bucket and not out:
            out.append(_summarise(bucket))
        return out


def _summarise(bucket: list[PassRecord]) -> dict[str, float]:
    samples = sum(r.stats.samples for r in bucket)
    hits = sum(r.hits or 0 for r in bucket)
    misses = sum(r.misses or 0 for r in bucket)
    wall = sum(r.stats.wall_s for r in bucket)
    return {
        "passes": len(bucket),
        "samples": samples,
        "bytes": sum(r.stats.bytes for r in bucket),
        "wall_s": wall,
        "stall_s": sum(r.stats.stall_s for r in bucket),
        "device_bytes": sum(r.device_bytes for r in bucket),
        "backing_bytes": sum(r.backing_bytes or 0 for r in bucket) if bucket[0].backing_bytes is not None else math.nan,
        "hit_ratio": hits / (hits + misses) if hits + misses else math.nan,
        "samples_per_s": samples / wall if wall else math.nan,
    }


def _status_counters(status: dict[str, Any]) -> tuple[int, int, int, int]:
    reads = status.get("reads", {})
    return (
        int(status.get("backing_bytes_read", 0)),
        int(reads.get("hits", 0)),
        int(reads.get("misses", 0)),
        int(status.get("cache_bytes", 0)),
    )


def run_config(
    cfg: Config,
    tier: SlowTier,
    fast_root: Path,
    work: Path,
    workload: Workload,
    capacity: int,
    loader_cfg: LoaderConfig,
    epochs: float,
    time_limit: float,
    page_cache: str = "drop",
) -> Result:
    """Run one configuration from cold until ``epochs`` epoch-equivalents were consumed (or the time limit)."""
    from tqdm import tqdm

    result = Result(workload.name, cfg.name)
    target = math.ceil(epochs * workload.files)
    drop_caches(3)
    pos_before: tuple[int, int] | None = None
    with contextlib.ExitStack() as stack:
        status = None
        if cfg.source == "mount":
            from tierfs.testing.harness import mounted

            mnt, cache = work / "mnt", work / f"cache-{cfg.name}"
            shutil.rmtree(cache, ignore_errors=True)
            mnt.mkdir(parents=True, exist_ok=True)
            stack.callback(shutil.rmtree, cache, True)
            m = stack.enter_context(mounted(tier.root, mnt, cache, capacity, timeout=120, **dict(cfg.options)))
            root, status = mnt, m.status
        else:
            root = tier.root if cfg.source == "backing" else fast_root
        loader_cfg = dataclasses.replace(loader_cfg, direct=cfg.direct, plan=cfg.plan)
        loader = (TorchLoader if cfg.loader == "torch" else ThreadLoader)(root, loader_cfg)
        bar = stack.enter_context(tqdm(total=target, desc=f"{workload.name}/{cfg.name}", unit="smp", leave=False))

        def snapshot() -> tuple[int, tuple[int, int, int, int] | None]:
            return tier.read_bytes(), _status_counters(status()) if status else None

        def position() -> tuple[int, int] | None:
            if status is None or dict(cfg.options).get("policy") != "met":
                return None
            s = status()
            return int(s.get("epoch", 0)), int(s.get("mini_epoch", 0))

        t_end = time.monotonic() + time_limit
        done = extra = 0
        i = 0

        def between_passes() -> None:
            if page_cache == "drop":
                # clean pages only, no sync: the fast tier's freshly staged files may stay dirty
                Path("/proc/sys/vm/drop_caches").write_text("1\n")
            else:
                tier.evict_page_cache()

        between_passes()
        before = start = snapshot()
        while time.monotonic() < t_end:
            if done >= target:
                # MET runs end on a mini-epoch switch, so every staged mini-epoch was consumed rf times and
                # what is cached now (the next one, unconsumed) can be subtracted from the backing bytes
                if pos_before is None or extra >= MAX_EXTRA_PASSES:
                    break
                os.listdir(root)  # ends the pass, as the next pass's listing would
                if position() != pos_before:
                    result.ended_on_switch = True
                    break
                extra += 1
            pos_before = position()
            p = loader.run_pass(i)
            if p.samples == 0:
                raise RuntimeError(f"pass {i} listed no files under {root}")
            between_passes()
            after = snapshot()
            rec = PassRecord(p, after[0] - before[0])
            if after[1] is not None and before[1] is not None:
                rec.backing_bytes = after[1][0] - before[1][0]
                rec.hits = after[1][1] - before[1][1]
                rec.misses = after[1][2] - before[1][2]
                rec.cache_bytes = after[1][3]
                result.cache_bytes_max = max(result.cache_bytes_max, after[1][3])
            result.passes.append(rec)
            before = after
            done += p.samples
            bar.update(p.samples)
            i += 1
        dev_end, end = tier.read_bytes(), status() if status else None
        result.device_bytes_total = dev_end - start[0]
        if end is not None and start[1] is not None:
            result.rf_effective = list(end.get("rf_effective", []) or [])
            result.cache_bytes_end = int(end.get("cache_bytes", 0))
            result.backing_bytes_total = _status_counters(end)[0] - start[1][0]
    return result


# --------------------------------------------------------------------------------------------- reporting


def _fmt(x: float, spec: str = ".1f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def steady(eps: list[dict[str, float]]) -> dict[str, float]:
    """Mean over the epoch-equivalents after the first (the first alone if there is only one)."""
    rest = eps[1:] or eps
    return {k: sum(e[k] for e in rest) / len(rest) for k in rest[0]}


def table(results: list[Result], workload: Workload, capacity: int, consume: float) -> str:
    data = workload.total_bytes
    by = {r.config: r for r in results if r.passes}
    fast = steady(by["fast"].epochs(workload.files)) if "fast" in by else None
    back = steady(by["backing"].epochs(workload.files)) if "backing" in by else None
    lines = [
        f"**{workload.name}**: {workload.files} files, {data / 1e6:.0f} MB; cache {capacity / 1e6:.0f} MB "
        f"({capacity / data:.0%}); consumption {consume:g} x the slow tier",
        "",
        "| config | epoch-eq s (steady) | first epoch-eq s | stall s / epoch-eq | device MB / epoch-eq | "
        "tierfs backing MB / epoch-eq | bytes ÷ (data/rf) | rf_effective | hit ratio | samples/s | vs fast | "
        "speed-up vs backing |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if not r.passes:
            lines.append(f"| {r.config} | failed: {r.error} ||||||||||")
            continue
        eps = r.epochs(workload.files)
        s = steady(eps)
        cfg = make_config(r.config, 1)
        rf = cfg.rf
        done = [k for k in (r.rf_effective or [])[:-1] if k > 0]  # the last mini-epoch is not finished
        rf_eff = sum(done) / len(done) if done else math.nan
        if rf is None:
            rf = rf_eff if done else None
        met = dict(cfg.options).get("policy") == "met"
        dev, tfs = r.amortised_backing(workload.files) if met else (s["device_bytes"], s["backing_bytes"])
        norm = dev / (data / rf) if rf else math.nan
        if r.config.endswith("lru"):
            norm = dev / data
        lines.append(
            f"| {r.config}{' (partial)' if r.error else ''} | {s['wall_s']:.1f} | {eps[0]['wall_s']:.1f} | "
            f"{s['stall_s']:.1f} | {dev / 1e6:.0f}{'' if r.ended_on_switch or not met else '*'} | "
            f"{_fmt(tfs / 1e6, '.0f')} | "
            f"{_fmt(norm, '.2f')} | {_fmt(rf_eff, '.1f')} | {_fmt(s['hit_ratio'], '.2f')} | "
            f"{s['samples_per_s']:.{0 if s['samples_per_s'] >= 100 else 2}f} | "
            f"{_fmt(s['wall_s'] / fast['wall_s'] if fast else math.nan, '.2f')} | "
            f"{_fmt(back['wall_s'] / s['wall_s'] if back else math.nan, '.2f')} |"
        )
    lines += [
        "",
        "_device MB / epoch-eq_: the loop device's reads; for MET configurations over the whole run (cold start "
        "included, less what was staged but not yet consumed when the run stopped on a mini-epoch switch; * = "
        "the run did not end on a switch), else the steady epoch-equivalents. "
        "_bytes ÷ (data/rf)_: that over data/rf (target ≤ 1.02; rf = the setting, or mean rf_effective for auto); "
        "_rf_effective_: mean passes per finished mini-epoch (advance=ready repeats a mini-epoch until the next "
        "is staged, so it can exceed rf); for `lru` over the "
        f"data (a cache holding a fixed {capacity / data:.0%} would miss {1 - capacity / data:.2f}; LRU under a "
        f"fresh random order every pass keeps a file only if it recurs within the cache's reach, hit ratio ≈ "
        f"(cache/data)²/2, so ≈ {1 - (capacity / data) ** 2 / 2:.2f}). _vs fast_: epoch-equivalent time over the "
        "`fast` one (target ≤ 1.25 where rf ≥ consumption/bandwidth). _speed-up vs backing_: target ≥ "
        f"0.8 × min(rf, {consume:g}).",
    ]
    return "\n".join(lines)


def plot(results: list[Result], workload: Workload, out: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(results, workload)
    if fig is not None:
        fig.savefig(out, dpi=110)
        plt.close(fig)


def figure(results: list[Result], workload: Workload):
    """Time per epoch-equivalent, backing reads over the data, and the rate, per configuration (None: no run
    made a pass)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.passes]
    if not ok:
        return None
    names = [r.config for r in ok]
    st = [steady(r.epochs(workload.files)) for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    x = range(len(ok))
    compute = [s["wall_s"] - s["stall_s"] for s in st]
    axes[0].bar(x, compute, label="not waiting (compute, listing, CPU contention)")
    axes[0].bar(x, [s["stall_s"] for s in st], bottom=compute, label="stall", color="tab:red")
    axes[0].set_ylabel("seconds per epoch-equivalent (steady)")
    axes[0].legend()
    data = workload.total_bytes
    dev = [
        r.amortised_backing(workload.files)[0]
        if dict(make_config(r.config, 1).options).get("policy") == "met"
        else s["device_bytes"]
        for r, s in zip(ok, st, strict=True)
    ]
    axes[1].bar(x, [d / data for d in dev], color="tab:gray", label="device reads")
    for i, r in enumerate(ok):
        rf = make_config(r.config, 1).rf
        if rf:
            axes[1].plot([i - 0.4, i + 0.4], [1 / rf, 1 / rf], color="tab:green", lw=2)
    axes[1].plot([], [], color="tab:green", lw=2, label="data / rf")
    axes[1].set_ylabel("backing reads per epoch-eq ÷ data")
    axes[1].legend()
    axes[2].bar(x, [s["samples_per_s"] for s in st], color="tab:purple")
    # a sample is one file: an image of the images workload, a whole shard of the shards one
    axes[2].set_ylabel(f"{workload.name if workload.name in ('images', 'shards') else 'files'}/s (steady)")
    for ax in axes:
        ax.set_xticks(list(x), names, rotation=45, ha="right", fontsize=8)
    fig.suptitle(f"tierfs vs baselines, {workload.name}: {workload.files} files, {data / 1e6:.0f} MB")
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------------------------- main


def load_results(path: Path) -> tuple[dict[str, str], list[Result]]:
    """Read a ``tierfs_bench.json`` back (for ``--render``)."""
    raw = json.loads(path.read_text())
    out = []
    for d in raw["results"]:
        passes = [PassRecord(PassStats(**p.pop("stats")), **p) for p in d.pop("passes")]
        out.append(Result(passes=passes, **d))
    return raw["args"], out


def render(path: Path, out: Path, plots: Path) -> None:
    """Rewrite the tables (into ``out``) and plots (into ``plots``) from a previous run's JSON, running nothing."""
    args, results = load_results(path)
    scale, frac = float(args["scale"]), float(args["cache_fraction"])
    consume, bps = float(args["consume"]), float(args["bps"])
    text = [f"(rendered from {path}; scale {scale:g}, slow tier {bps / 1e6:.1f} MB/s)", ""]
    for wname in dict.fromkeys(r.workload for r in results):
        workload = {"images": Workload.images, "shards": Workload.shards}[wname](scale)
        sel = [r for r in results if r.workload == wname]
        text += [table(sel, workload, int(workload.total_bytes * frac), consume), ""]
        plot(sel, workload, plots / f"tierfs_bench_{wname}.png")
    (out / "tierfs_bench.md").write_text("\n".join(text))
    print("\n".join(text))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="images,shards", help="images,shards (default both)")
    ap.add_argument("--scale", type=float, default=1.0, help="dataset scale (1 = 20,000 x 110 KiB; 64 x 32 MiB)")
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS), help="comma list (default: all)")
    ap.add_argument("--bps", type=parse_size, default=parse_size("25M"), help="slow tier read throttle (25M)")
    ap.add_argument("--consume", type=float, default=4.0, help="consumption rate as a multiple of --bps (4)")
    ap.add_argument("--cache-fraction", type=float, default=0.25, help="cache capacity / data (0.25)")
    ap.add_argument("--nm", type=int, default=0, help="mini-epochs per epoch (0: ceil(2.2 / cache-fraction))")
    ap.add_argument("--epochs", type=float, default=3, help="epoch-equivalents of samples per configuration (3)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--page-cache",
        choices=("drop", "keep-fast"),
        default="drop",
        help="between passes drop the whole page cache (drop: nothing is served from RAM) or only the slow tier's "
        "pages (keep-fast: the fast tier and the mount may serve from RAM, as when a mini-epoch fits in memory)",
    )
    ap.add_argument("--time-limit", type=float, default=1800, help="seconds per configuration at most")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/tierfs-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench-out/tierfs_bench"),
                    help="the tables and every pass (benchmarks/results: on purpose)")
    ap.add_argument("--plots", type=Path, default=None, help="the plots (default: --out); docs/img: on purpose")
    ap.add_argument("--render", type=Path, default=None, help="only re-render tables/plots from this JSON")
    args = ap.parse_args(argv)
    args.plots = args.plots or args.out
    if args.render is not None:
        for folder in (args.out, args.plots):
            folder.mkdir(parents=True, exist_ok=True)
        render(args.render, args.out, args.plots)
        return
    require_root()
    install_sigterm()
    nm = args.nm or math.ceil(2.2 / args.cache_fraction)
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch not importable: skipping torch-* configurations", file=sys.stderr)
        names = [n for n in names if not n.startswith("torch-")]
    configs = [make_config(n, nm) for n in names]
    for folder in (args.out, args.plots):
        folder.mkdir(parents=True, exist_ok=True)
    report: list[str] = [
        f"Command: `python benchmarks/tierfs_bench.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
        f"Machine: {os.cpu_count()} cores, {_mem_gib():.0f} GiB; slow tier {args.bps / 1e6:.1f} MB/s "
        f"(blkio throttle on an ext4 loop device); nm = {nm}; {args.workers} loader workers, batch {args.batch}; "
        f"page cache between passes: {args.page_cache}",
        "",
    ]
    raw: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "results": []}
    for wname in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        workload = {"images": Workload.images, "shards": Workload.shards}[wname](args.scale)
        data = workload.total_bytes
        capacity = int(data * args.cache_fraction)
        mean = data / workload.files
        loader_cfg = LoaderConfig(
            workers=args.workers, batch=min(args.batch, workload.files), compute_s=mean / (args.consume * args.bps)
        )
        results: list[Result] = []
        work = args.workdir / f"run-{os.getpid()}"
        fast_root = work / "fast"
        try:
            with slow_tier(args.workdir, int(data * 1.1) + 256 * MiB, args.bps, workload.populate) as tier:
                with tier.unthrottled():
                    shutil.copytree(tier.root, fast_root, ignore=shutil.ignore_patterns("lost+found"))
                for cfg in configs:
                    try:
                        results.append(
                            run_config(
                                cfg,
                                tier,
                                fast_root,
                                work,
                                workload,
                                capacity,
                                loader_cfg,
                                args.epochs,
                                args.time_limit,
                                args.page_cache,
                            )
                        )
                    except Exception as exc:
                        traceback.print_exc()
                        last = [ln for ln in str(exc).splitlines() if ln.strip()][-1:] or [""]
                        results.append(Result(wname, cfg.name, error=f"{type(exc).__name__}: {last[0]}"[:200]))
                    print(table(results[-1:], workload, capacity, args.consume).split("\n")[4], flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        text = table(results, workload, capacity, args.consume)
        print("\n" + text + "\n")
        png = args.plots / f"tierfs_bench_{wname}.png"
        report += [text, "", f"![{wname}]({os.path.relpath(png, args.out)})", ""]
        plot(results, workload, png)
        raw["results"] += [asdict(r) for r in results]
        (args.out / "tierfs_bench.md").write_text("\n".join(report))
        (args.out / "tierfs_bench.json").write_text(json.dumps(raw, indent=1, default=str))
    print(f"wrote {args.out / 'tierfs_bench.md'}, {args.out / 'tierfs_bench.json'} and the PNGs")


def _mem_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / (1 << 20)
    return math.nan


if __name__ == "__main__":
    main()

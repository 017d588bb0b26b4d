"""What tiering costs your model: dslide trained through a tierfs mount, MET's accuracy study reproduced (issue 13).

    .venv/bin/python benchmarks/convergence.py [--out bench-out/convergence] [--grid reduced|full|loaders] [--seeds 3]

One planted extreme-classification data set (``dslide.gen``'s plant, 50,000 labels) is written as shard files whose
*storage order follows the labels*: the points are sorted by their most frequent label and cut into ``dirs``
directories (label ranges); inside a directory the points are shuffled over its files.  So a mini-epoch made of a
storage-order range (``contiguous``) sees a few label ranges only, a random set of files sees them unevenly, and a
directory-stratified one sees all of them in proportion -- what real data sets sharded by crawl, time or class
order look like.

Every configuration makes the same number of sample visits (``epochs`` x the training points) with the same
trainer settings and evaluates P@1 / P@5 on the same test points once per epoch's worth of visits:

* ``full``: full shuffle, ``dslide train`` over the plain backing directory (no tiering, every pass reads the
  data set from the slow tier: backing bytes = passes x data-set bytes);
* MET, fixed ``(nm, rf)``: ``dslide train --control MNT/.tierfs/control`` from a tierfs mount of the same
  directory (``--capacity`` about 2.5 mini-epochs), ``epochs x nm`` passes (each over one mini-epoch's view);
* the four compositions at one setting, and ARF ``score`` and ``bollinger`` with rf as the maximum;
* ``--grid loaders``: the trainer's file list built once over a ``listing=all`` mount (``built_once_train.py``),
  each pass the files ``tierfs.torch.MountSampler`` yields (``sampler``), or every name every pass on a
  ``substitute`` mount, beside the re-listing loader.

Every run holds out the same 5 % of the training points (``--val-fraction``): the trainer reports 1 - P@1 on them
as ``val_err`` (and ``score``) in its ``feedback`` line after every pass, which is what ARF steers by; the test
points are never seen by ARF.  Per run: P@1 and P@5 against sample visits, the best and the final values,
tierfs's ``backing_bytes_read``, ``stall_seconds``, ``rf_effective`` and the ARF history from its status, wall
time.  Prints a table (mean +- standard deviation over seeds, [min, max] for rf), writes ``OUT/results.json``
and PNG plots into ``OUT``; a run already in ``OUT/runs`` is reused (``--fresh`` reruns).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dslide.data import write_xc  # noqa: E402
from dslide.gen import generate  # noqa: E402
from tierfs.testing.harness import mounted  # noqa: E402


@dataclass(frozen=True)
class Shape:
    """The data set and the trainer settings every configuration shares."""

    points: int = 10_240
    test_points: int = 2_000
    features: int = 20_000
    labels: int = 50_000
    dirs: int = 8
    files_per_dir: int = 16
    data_seed: int = 0
    epochs: int = 8  # sample visits = epochs x training points, in every configuration
    val_fraction: float = 0.05
    eval_points: int = 2_000


SMOKE = Shape(points=1_200, test_points=200, features=400, labels=120, dirs=2, files_per_dir=4, epochs=2,
              eval_points=200)  # fmt: skip


@dataclass(frozen=True)
class Config:
    name: str
    nm: int = 0  # 0: full shuffle from the plain directory
    rf: int = 1
    composition: str = "random"
    arf: str = "off"
    knobs: dict = field(default_factory=dict)  # arf_wait, arf_window, arf_k
    # how the trainer finds its files: "relist" (dslide's own: each pass lists the directories, so it follows
    # the view), or built once over a listing=all mount (benchmarks/built_once_train.py): "sampler" (the
    # MountSampler's indices each pass), "substitute" (every name every pass, the mount's substitute option)
    loader: str = "relist"


def grid(kind: str) -> list[Config]:
    """The reduced grid (default, under 30 minutes on 2 cores with 3 seeds), the full one, or ``loaders``: a
    dataset built once (issue 23) beside the re-listing loader, at (nm 8, rf 4)."""
    nm = 8
    rmax = 8
    out = [Config("full")]
    if kind == "loaders":
        # substitution serves a name from its own directory's view files: the composition matters to it
        # (stratified: every directory in the view in proportion), and so does rf (see docs/benchmarks.md)
        for comp in ("random", "stratified"):
            out.append(Config(f"{comp} nm={nm} rf=4", nm, 4, comp))
        out.append(Config(f"sampler nm={nm} rf=4", nm, 4, loader="sampler"))
        out.append(Config(f"substitute nm={nm} rf=4", nm, 4, loader="substitute"))
        for rf in (4, 2):
            out.append(Config(f"substitute stratified nm={nm} rf={rf}", nm, rf, "stratified", loader="substitute"))
        return out
    rfs = (2, 4, 8) if kind == "reduced" else (1, 2, 4, 8)
    nms = (nm,) if kind == "reduced" else (4, 8, 16, 32)
    for n in nms:
        for rf in rfs:
            out.append(Config(f"random nm={n} rf={rf}", n, rf))
    for comp in ("stratified", "contiguous", "reservoir"):
        out.append(Config(f"{comp} nm={nm} rf={rmax}", nm, rmax, comp))
    out.append(Config(f"score nm={nm} rf<={rmax}", nm, rmax, arf="score"))
    out.append(Config(f"bollinger nm={nm} rf<={rmax}", nm, rmax, arf="bollinger"))
    if kind == "full":
        for wait in (1, 2):
            out.append(Config(f"score nm={nm} rf<={rmax} wait={wait}", nm, rmax, arf="score",
                              knobs={"arf_wait": wait}))  # fmt: skip
        for window, k in ((3, 2.0), (5, 1.0), (8, 2.0)):
            out.append(Config(f"bollinger nm={nm} rf<={rmax} window={window} k={k:g}", nm, rmax, arf="bollinger",
                              knobs={"arf_window": window, "arf_k": k}))  # fmt: skip
        out.append(Config(f"score nm=16 rf<={rmax}", 16, rmax, arf="score"))
    return out


# -- the data set ---------------------------------------------------------------------------------------------


def make_data(root: Path, shape: Shape) -> tuple[Path, Path, int]:
    """``root/train/dNN/part-NNNNN.txt`` in label order and ``root/test.txt``; returns (train dir, test, bytes)."""
    stamp = root / "shape.json"
    train_dir, test = root / "train", root / "test.txt"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(shape):
        return train_dir, test, _tree_bytes(train_dir)
    shutil.rmtree(root, ignore_errors=True)
    data = generate(shape.points + shape.test_points, shape.features, shape.labels, seed=shape.data_seed)
    train = data.subset(np.arange(shape.points))
    counts = train.label_counts()
    # each point's most frequent label (ties: the larger id) is its place in the storage order
    score = counts[train.y_indices].astype(np.int64) * shape.labels + train.y_indices
    top = np.maximum.reduceat(score, train.y_indptr[:-1]) % shape.labels
    order = np.argsort(top, kind="stable")
    rng = np.random.default_rng((shape.data_seed, 13))
    n_files = 0
    for d, chunk in enumerate(np.array_split(order, shape.dirs)):
        chunk = rng.permutation(chunk)  # within a directory (a label range) the files are random mixtures
        (train_dir / f"d{d:02d}").mkdir(parents=True)
        for part in np.array_split(chunk, shape.files_per_dir):
            write_xc(train_dir / f"d{d:02d}" / f"part-{n_files:05d}.txt", train.subset(part))
            n_files += 1
    write_xc(test, data.subset(np.arange(shape.points, shape.points + shape.test_points)))
    stamp.write_text(json.dumps(asdict(shape)))
    return train_dir, test, _tree_bytes(train_dir)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.txt"))


# -- one run --------------------------------------------------------------------------------------------------


def train_command(a: argparse.Namespace, shape: Shape, train_dirs: list[str], test: Path, passes: int,
                  eval_every: int, seed: int, control: str | None, loader: str = "relist") -> list[str]:  # fmt: skip
    py = [sys.executable, "-m", "dslide", "train"]
    if loader != "relist":
        mode = "sampler" if loader == "sampler" else "names"
        py = [sys.executable, str(ROOT / "benchmarks" / "built_once_train.py"), mode, "--"]
    if a.ranks > 1:
        py = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(a.ranks), *py]
    cmd = [*py, "--train", *train_dirs, "--test", str(test), "--epochs", str(passes),
           "--batch", str(a.batch), "--threads", str(a.threads), "--seed", str(seed),
           "--eval-points", str(shape.eval_points), "--eval-every", str(eval_every),
           "--val-fraction", str(shape.val_fraction)]  # fmt: skip
    if control:
        cmd += ["--control", control]
    return cmd


def run_one(a: argparse.Namespace, shape: Shape, cfg: Config, seed: int, train_dir: Path, test: Path,
            data_bytes: int) -> dict:  # fmt: skip
    dirs = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "NUMBA_NUM_THREADS": str(a.threads), "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    result: dict = {"config": cfg.name, "seed": seed, **asdict(cfg)}
    t0 = time.monotonic()
    if cfg.nm == 0:
        cmd = train_command(a, shape, [str(train_dir / d) for d in dirs], test, shape.epochs, 1, seed, None)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        result["backing_bytes_read"] = shape.epochs * data_bytes  # every pass reads the data set from the slow tier
        result["stall_seconds"] = None
    else:
        with tempfile.TemporaryDirectory(prefix="tierfs-conv-", dir=a.tmp) as tmp:
            mnt, cache = Path(tmp) / "mnt", Path(tmp) / "cache"
            mnt.mkdir()
            largest = max(p.stat().st_size for p in train_dir.rglob("*.txt"))
            capacity = int(2.5 * data_bytes / cfg.nm) + 4 * largest
            opts = {"nm": cfg.nm, "rf": cfg.rf, "composition": cfg.composition, "arf": cfg.arf, "seed": seed,
                    **cfg.knobs}  # fmt: skip
            if cfg.loader != "relist":
                opts["listing"] = "all"  # the dataset built once sees every file
            if cfg.loader == "substitute":
                opts["substitute"] = True
            # the same sample visits everywhere: a trainer's pass is one tierfs pass (a mini-epoch's view), but
            # under substitute it opens every name, a data set's worth of reads (nm tierfs passes' worth)
            passes, every = (shape.epochs, 1) if cfg.loader == "substitute" else (shape.epochs * cfg.nm, cfg.nm)
            with mounted(train_dir, mnt, cache, capacity, **opts) as m:
                control = str(mnt / ".tierfs" / "control")
                cmd = train_command(a, shape, [str(mnt / d) for d in dirs], test, passes, every, seed, control,
                                    cfg.loader)  # fmt: skip
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
                status = m.status()
            result["capacity"] = capacity
            for key in ("backing_bytes_read", "stall_seconds", "rf_effective", "reads", "epoch", "mini_epoch",
                        "passes_total", "substitution"):
                result[key] = status[key]
            result["loader_watch"] = status["loader"]  # ("loader" is the configuration's)
            result["arf_history"] = status["arf"]["history"]
            result["last_error"] = status["last_error"]
    result["wall_s"] = round(time.monotonic() - t0, 1)
    if proc.returncode != 0:
        raise RuntimeError(f"{cfg.name} seed {seed}: dslide exited {proc.returncode}: {proc.stderr[-2000:]}")
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    result["curve"] = [{k: r.get(k) for k in ("pass", "samples", "seconds", "p_at_1", "p_at_5", "val_err", "tierfs")}
                       for r in records if r.get("p_at_1") is not None]  # fmt: skip
    result["train_seconds"] = records[-1]["seconds"]
    result["visits"] = records[-1]["samples"]
    p1 = [c["p_at_1"] for c in result["curve"]]
    p5 = [c["p_at_5"] for c in result["curve"]]
    result.update(best_p1=max(p1), final_p1=p1[-1], best_p5=max(p5), final_p5=p5[-1])
    if cfg.nm:
        done = result["rf_effective"][:-1] or result["rf_effective"]  # the last mini-epoch is cut off by the end
        result["rf_mean"] = float(np.mean(done))
    return result


# -- summary --------------------------------------------------------------------------------------------------


def _ms(values: list[float], scale: float = 1.0, fmt: str = ".3f") -> str:
    v = [x * scale for x in values if x is not None]
    if not v:
        return "n/a"
    sd = statistics.stdev(v) if len(v) > 1 else 0.0
    return f"{statistics.fmean(v):{fmt}} ± {sd:{fmt}}"


def summarize(configs: list[Config], runs: dict[str, list[dict]]) -> list[dict]:
    full = runs.get("full", [])
    full_bytes = statistics.fmean(r["backing_bytes_read"] for r in full) if full else None
    rows = []
    for cfg in configs:
        rs = runs.get(cfg.name, [])
        if not rs:
            continue
        rfs = [x for r in rs for x in (r.get("rf_effective") or [])[:-1]]
        row = {
            "config": cfg.name,
            "seeds": len(rs),
            "best_p1": _ms([r["best_p1"] for r in rs]),
            "final_p1": _ms([r["final_p1"] for r in rs]),
            "best_p5": _ms([r["best_p5"] for r in rs]),
            "final_p5": _ms([r["final_p5"] for r in rs]),
            "backing_mb": _ms([r["backing_bytes_read"] for r in rs], 1e-6, ".1f"),
            "fewer_bytes": f"{full_bytes / statistics.fmean(r['backing_bytes_read'] for r in rs):.1f}x"
            if full_bytes else "n/a",
            "stall_s": _ms([r["stall_seconds"] for r in rs], 1.0, ".2f"),
            "wall_s": _ms([r["wall_s"] for r in rs], 1.0, ".0f"),
            "rf_used": f"{np.mean(rfs):.1f} [{min(rfs)}, {max(rfs)}]" if rfs and cfg.arf != "off" else
            (str(cfg.rf) if cfg.nm else "-"),
            "visits": int(statistics.fmean(r["visits"] for r in rs)),
        }
        if full:
            row["d_best_p1"] = _ms([r["best_p1"] - f["best_p1"] for r, f in zip(rs, full, strict=False)])
            row["d_final_p1"] = _ms([r["final_p1"] - f["final_p1"] for r, f in zip(rs, full, strict=False)])
        rows.append(row)
    return rows


COLUMNS = [("config", "configuration"), ("best_p1", "best P@1"), ("final_p1", "final P@1"),
           ("d_final_p1", "final P@1 − full (paired)"), ("best_p5", "best P@5"), ("final_p5", "final P@5"),
           ("backing_mb", "backing MB read"), ("fewer_bytes", "vs full"), ("stall_s", "stall s"),
           ("wall_s", "wall s"), ("rf_used", "rf used: mean [min, max]")]  # fmt: skip


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(k, "")) for k, _ in COLUMNS) + " |")
    return "\n".join(lines)


def plot(configs: list[Config], runs: dict[str, list[dict]], out: Path, data_points: int) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    full_bytes = statistics.fmean(r["backing_bytes_read"] for r in runs["full"]) if runs.get("full") else 1.0
    for i, cfg in enumerate(c for c in configs if runs.get(c.name)):
        rs = runs[cfg.name]
        style = {"color": f"C{i % 10}", "ls": "-" if cfg.arf == "off" else "--", "lw": 2.2 if cfg.nm == 0 else 1.3}
        for ax, key in zip(axes[:2], ("p_at_1", "p_at_5"), strict=True):
            n = min(len(r["curve"]) for r in rs)
            x = np.mean([[c["samples"] / data_points for c in r["curve"][:n]] for r in rs], axis=0)
            y = np.array([[c[key] for c in r["curve"][:n]] for r in rs])
            ax.plot(x, y.mean(0), label=cfg.name, **style)
            ax.fill_between(x, y.min(0), y.max(0), color=style["color"], alpha=0.12)
        bx = statistics.fmean(r["backing_bytes_read"] for r in rs) / full_bytes
        fy = [r["final_p1"] for r in rs]
        my = statistics.fmean(fy)
        axes[2].errorbar(bx, my, yerr=[[my - min(fy)], [max(fy) - my]], fmt="o" if cfg.arf == "off" else "s",
                         color=style["color"], label=cfg.name)  # fmt: skip
    for ax, what in zip(axes[:2], ("P@1", "P@5"), strict=True):
        ax.set_xlabel("sample visits / training points")
        ax.set_ylabel(f"test {what}")
        ax.grid(alpha=0.3)
    axes[0].set_title("test P@1 (mean over seeds, band: min-max)")
    axes[1].set_title("test P@5")
    axes[2].set_xscale("log")
    axes[2].set_xlabel("backing bytes read / full shuffle's")
    axes[2].set_ylabel("final test P@1")
    axes[2].set_title("what it costs: final P@1 against slow-tier reads")
    axes[2].grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "convergence.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    arf = [c for c in configs if c.arf != "off" and runs.get(c.name)]
    if arf:
        fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
        for i, cfg in enumerate(arf):
            rfs = [x for r in runs[cfg.name] for x in r["rf_effective"][:-1]]
            axes[0].hist(rfs, bins=np.arange(0.5, cfg.rf + 1.5), alpha=0.5, label=cfg.name, color=f"C{i}")
            r0 = runs[cfg.name][0]
            axes[1].plot(range(len(r0["rf_effective"]) - 1), r0["rf_effective"][:-1], marker=".",
                         color=f"C{i}", label=f"{cfg.name} (seed {r0['seed']})")  # fmt: skip
        axes[0].set_xlabel("rf used (passes) per mini-epoch")
        axes[0].set_ylabel("mini-epochs, all seeds")
        axes[0].set_title("rf used under ARF (cf. MET Fig. 11)")
        axes[1].set_xlabel("mini-epoch (in training order)")
        axes[1].set_ylabel("rf used")
        for ax in axes:
            ax.legend(fontsize=7)
            ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out / "convergence_arf.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "bench-out" / "convergence")
    p.add_argument("--grid", choices=("reduced", "full", "loaders"), default="reduced")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--only", help="comma-separated configuration names (default: the whole grid)")
    p.add_argument("--ranks", type=int, default=1, help="MPI ranks per run (1: a single process)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2, each one thread: on a shared "
                   "machine two single-thread runs lose less to stragglers than one two-thread run)")
    p.add_argument("--threads", type=int, default=1, help="numba threads per rank")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--tmp", default=None, help="where mountpoints and caches go (default: the system's temp dir)")
    p.add_argument("--fresh", action="store_true", help="rerun runs already in OUT/runs")
    p.add_argument("--smoke", action="store_true", help="tiny data, for the test of this program's machinery")
    a = p.parse_args(argv)
    shape = SMOKE if a.smoke else Shape()
    configs = grid(a.grid)
    if a.only:
        wanted = [w.strip() for w in a.only.split(",")]
        configs = [c for c in configs if c.name in wanted]
        if not configs:
            p.error(f"--only {a.only!r} names no configuration of the {a.grid} grid")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "runs").mkdir(exist_ok=True)
    train_dir, test, data_bytes = make_data(a.out / "data", shape)
    load0 = os.getloadavg()
    t_start = time.monotonic()

    def one(seed: int, cfg: Config) -> dict:
        path = a.out / "runs" / f"{cfg.name.replace(' ', '_').replace('<=', 'le')}-seed{seed}.json"
        if path.exists() and not a.fresh:
            return json.loads(path.read_text())
        res = run_one(a, shape, cfg, seed, train_dir, test, data_bytes)
        path.write_text(json.dumps(res))
        print(f"[{time.monotonic() - t_start:7.0f} s] {cfg.name} seed {seed}: best/final P@1 "
              f"{res['best_p1']:.3f}/{res['final_p1']:.3f}, backing {res['backing_bytes_read'] / 1e6:.1f} MB, "
              f"rf {res.get('rf_effective')}, wall {res['wall_s']} s", file=sys.stderr, flush=True)  # fmt: skip
        return res

    # seeds outermost, so that an interrupted grid has every configuration at the first seeds
    todo = [(seed, cfg) for seed in range(a.seeds) for cfg in configs]
    pool = ThreadPoolExecutor(a.jobs)
    try:
        results = list(pool.map(lambda job: one(*job), todo))
    finally:  # on Ctrl-C: the runs in flight end with their trainer (same signal) and unmount; none starts
        pool.shutdown(wait=True, cancel_futures=True)
    runs: dict[str, list[dict]] = {}
    for (_, cfg), res in zip(todo, results, strict=True):
        runs.setdefault(cfg.name, []).append(res)
    rows = summarize(configs, runs)
    machine = {"cpus": os.cpu_count(), "loadavg_before": load0, "loadavg_after": os.getloadavg(),
               "elapsed_s": round(time.monotonic() - t_start, 1), "ranks": a.ranks, "threads": a.threads,
               "jobs": a.jobs}  # fmt: skip
    print(table(rows))
    print(json.dumps(machine))
    plots = plot(configs, runs, a.out, int(shape.points * (1 - shape.val_fraction)))
    summary = {"shape": asdict(shape), "data_bytes": data_bytes, "machine": machine, "rows": rows, "runs": runs}
    (a.out / "results.json").write_text(json.dumps(summary, indent=1))
    print("wrote", a.out / "results.json", *plots)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

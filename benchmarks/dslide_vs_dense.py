"""dslide against PyTorch's dense full-softmax network of the same shape, side by side in one run.

(a) Throughput at Amazon-670K shape (135,909 features, 670,091 labels, H = 128, batch 256): training
    samples/s and peak memory of each side, every side in its own process (so the memory figures are its
    own), both on the same cores with the same thread count.
(b) P@1 against wall time on planted data with 100,000 labels, both trained for the same number of epochs
    from the same initial weights; evaluation time is not counted.  Dense runs twice: at a constant lr
    (``--lr``, 3e-3) and with exactly dslide's optimiser settings (its lr and lr schedule), so the comparison
    does not hinge on the schedule.  Reports P@1 per epoch and how much sooner dslide reaches each dense run's
    epoch-1 P@1.

    .venv/bin/python benchmarks/dslide_vs_dense.py            # full run (~11 min on 2 idle cores)
    .venv/bin/python benchmarks/dslide_vs_dense.py --quick    # smoke run

Prints a table, writes ``results.json`` and ``dslide_vs_dense.png`` into ``--out`` (``bench-out/dslide``); ``--plot
docs/img/NAME.png`` also writes the plot there (the docs' plots are updated on purpose, never by default).  The
dense side's Adam is torch's (dense), its input layer an ``EmbeddingBag`` (sum, per-sample weights): the standard
way to feed sparse rows to a dense model in PyTorch.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# -- the two sides ----------------------------------------------------------------------------------------------


def model_cfg(F: int, L: int, args: argparse.Namespace):
    from dslide.lsh import RehashSchedule
    from dslide.model import ModelConfig

    kw = {}  # dslide's own defaults unless an option names another value
    for name in ("lr", "lr_decay", "fill_power", "lsh_frac", "batch_budget"):
        if getattr(args, f"dslide_{name}") is not None:
            kw[name] = getattr(args, f"dslide_{name}")
    return ModelConfig(
        F, L, hidden=args.hidden, budget=args.budget, tables=args.tables, seed=args.seed,
        out_init=args.out_init, pool_factor=args.pool_factor, rehash=RehashSchedule(first=args.rehash_first),
        blocks=args.blocks, fill_correction=not args.no_fill_correction, lsh_center=not args.no_lsh_center, **kw,
    )  # fmt: skip


def make_side(side: str, F: int, L: int, args: argparse.Namespace):
    """dslide's model, or the dense torch net starting from exactly dslide's initial weights."""
    from dslide.model import SlideModel, initial_weights

    cfg = model_cfg(F, L, args)
    if side == "dslide":
        return SlideModel(cfg)
    if side == "dense-same":  # dslide's optimiser settings
        return DenseTorch(*initial_weights(cfg), cfg.lr, args.threads, cfg.lr_decay)
    return DenseTorch(*initial_weights(cfg), args.lr, args.threads, args.dense_lr_decay)


class DenseTorch:
    """The same network in PyTorch, dense: every output neuron computed and updated every step."""

    def __init__(self, W1: np.ndarray, W2: np.ndarray, lr: float, threads: int, lr_decay: float = 0.0) -> None:
        import torch

        torch.set_num_threads(threads)
        self.torch = torch
        F, H = W1.shape
        L = W2.shape[0]
        self.emb = torch.nn.EmbeddingBag(F, H, mode="sum")
        self.b1 = torch.nn.Parameter(torch.zeros(H))
        self.out = torch.nn.Linear(H, L)
        with torch.no_grad():  # the very weights dslide starts from
            self.emb.weight.copy_(torch.from_numpy(W1))
            self.out.weight.copy_(torch.from_numpy(W2))
            self.out.bias.zero_()
        params = [*self.emb.parameters(), self.b1, *self.out.parameters()]
        self.opt = torch.optim.Adam(params, lr=lr)
        self.lr, self.lr_decay, self.step = lr, lr_decay, 0  # lr_decay > 0: dslide's schedule, for a check
        self.times = {"forward": 0.0, "backward": 0.0, "adam": 0.0}

    def _inputs(self, data, rows):
        torch = self.torch
        s, e = data.x_indptr[rows], data.x_indptr[rows + 1]
        idx = np.concatenate([np.arange(a, b) for a, b in zip(s, e, strict=True)])
        offsets = np.concatenate([[0], np.cumsum(e - s)[:-1]])
        return (
            torch.from_numpy(data.x_indices[idx].astype(np.int64)),
            torch.from_numpy(offsets.astype(np.int64)),
            torch.from_numpy(data.x_values[idx]),
        )

    def hidden(self, data, rows):
        ind, off, w = self._inputs(data, rows)
        return self.torch.relu(self.emb(ind, off, per_sample_weights=w) + self.b1)

    def train_step(self, data, rows) -> None:
        torch = self.torch
        t0 = time.perf_counter()
        # cross-entropy against the uniform distribution on each point's labels, without a dense B x L target
        n_lab = data.y_indptr[rows + 1] - data.y_indptr[rows]
        width = max(1, int(n_lab.max()))
        idx = np.zeros((len(rows), width), np.int64)
        wts = np.zeros((len(rows), width), np.float32)
        for i, r in enumerate(rows):
            idx[i, : n_lab[i]] = data.y_indices[data.y_indptr[r] : data.y_indptr[r + 1]]
            wts[i, : n_lab[i]] = 1.0 / max(n_lab[i], 1)
        logits = self.out(self.hidden(data, rows))
        label_part = (logits.gather(1, torch.from_numpy(idx)) * torch.from_numpy(wts)).sum(1)
        has = torch.from_numpy((n_lab > 0).astype(np.float32))
        loss = (torch.logsumexp(logits, dim=1) * has - label_part).mean()
        t1 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        if self.lr_decay > 0:
            for group in self.opt.param_groups:
                group["lr"] = self.lr / (1.0 + self.step / self.lr_decay) ** 0.5
        self.opt.step()
        self.step += 1
        t3 = time.perf_counter()
        self.times["forward"] += t1 - t0
        self.times["backward"] += t2 - t1
        self.times["adam"] += t3 - t2

    def evaluate(self, data, n: int) -> float:
        torch = self.torch
        hits = 0
        with torch.no_grad():
            for s in range(0, n, 256):
                rows = np.arange(s, min(n, s + 256))
                top = self.out(self.hidden(data, rows)).argmax(1).numpy()
                for i, r in enumerate(rows):
                    hits += top[i] in data.y_indices[data.y_indptr[r] : data.y_indptr[r + 1]]
        return hits / n


# -- workers (one process per side and part) ---------------------------------------------------------------


def worker_throughput(side: str, args: argparse.Namespace) -> dict:
    import numba

    from dslide.gen import AMAZON_670K, generate

    F, L = AMAZON_670K
    data = generate(args.batch * (args.steps + args.warmup), F, L, seed=args.seed)
    numba.set_num_threads(args.threads)
    t0 = time.perf_counter()
    net = make_side(side, F, L, args)
    setup = time.perf_counter() - t0
    batches = [np.arange(i * args.batch, (i + 1) * args.batch) for i in range(args.steps + args.warmup)]
    for rows in batches[: args.warmup]:
        net.train_step(data, rows)
    if side == "dslide":  # load the rehash kernels now, not inside the measured window
        net.index.rehash(net.W2, np.arange(1))
    prof = cProfile.Profile() if side == "dslide" else None
    t0 = time.perf_counter()
    if prof:
        prof.enable()
    for rows in batches[args.warmup :]:
        net.train_step(data, rows)
    if prof:
        prof.disable()
    dt = time.perf_counter() - t0
    out = {
        "side": side,
        "steps": args.steps,
        "samples_per_s": args.steps * args.batch / dt,
        "step_ms": 1000 * dt / args.steps,
        "peak_rss_gib": peak_rss_gib(),
        "setup_s": setup,
    }
    if prof:
        stats = pstats.Stats(prof)
        where = {}
        for (_, _, fn), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
            if tottime > 0.002 * dt:
                where[fn] = where.get(fn, 0.0) + tottime
        out["where_s"] = dict(sorted(where.items(), key=lambda kv: -kv[1])[:10])
    else:
        out["where_s"] = net.times
    return out


def worker_convergence(side: str, args: argparse.Namespace) -> dict:
    import numba

    from dslide.gen import generate

    if args.data:  # an XC data set (e.g. benchmarks/xc_from_debian.py's): its train.txt, the test.txt's first points
        from dslide.data import load_xc

        train, test = load_xc(Path(args.data) / "train.txt"), load_xc(Path(args.data) / "test.txt")
        test = test.subset(np.arange(min(len(test), args.conv_test)))
        F, L = train.n_features, train.n_labels
    else:
        F, L = args.conv_features, args.conv_labels
        data = generate(args.conv_points + args.conv_test, F, L, seed=args.seed + 1)
        train = data.subset(np.arange(args.conv_points))
        test = data.subset(np.arange(args.conv_points, args.conv_points + args.conv_test))
    numba.set_num_threads(args.threads)
    net = make_side(side, F, L, args)
    steps_per_epoch = -(-len(train) // args.batch)
    evals_per_epoch = args.evals_per_epoch if side == "dslide" else 4
    eval_at = {round(steps_per_epoch * (q + 1) / evals_per_epoch) for q in range(evals_per_epoch)}

    def p_at_1() -> float:
        if side == "dslide":
            return net.evaluate(test, len(test))["p_at_1"]
        return net.evaluate(test, len(test))

    curve = [{"seconds": 0.0, "epoch": 0.0, "p_at_1": p_at_1()}]
    train_s = 0.0
    for epoch in range(args.epochs):
        perm = np.random.default_rng((args.seed, epoch)).permutation(len(train))
        for s in range(steps_per_epoch):
            t0 = time.perf_counter()
            net.train_step(train, perm[s * args.batch : (s + 1) * args.batch])
            train_s += time.perf_counter() - t0
            if s + 1 in eval_at:
                curve.append({"seconds": train_s, "epoch": epoch + (s + 1) / steps_per_epoch, "p_at_1": p_at_1()})
    return {"side": side, "curve": curve, "peak_rss_gib": peak_rss_gib(), "train_seconds": train_s}


# -- the driver ------------------------------------------------------------------------------------------------


def run_worker(part: str, side: str, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, *argv, "--worker", f"{part}:{side}"]
    env = dict(os.environ)
    if side == "dslide":
        # dslide trains in numba threads; numpy's BLAS (evaluation only, untimed) would otherwise leave its own
        # threads spinning on the 2 cores after each evaluation and slow the next steps by 15-20 %.  Torch
        # evaluates in the pool it trains in.
        env["OPENBLAS_NUM_THREADS"] = "1"
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if r.returncode != 0:
        raise SystemExit(f"worker {part}:{side} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def first_reach(curve: list[dict], target: float) -> float | None:
    for pt in curve:
        if pt["p_at_1"] >= target - 1e-12:
            return pt["seconds"]
    return None


def plot(results: dict, paths: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    lr = results["dslide_config_b"]
    names = {
        "dslide": "dslide",
        "dense": f"dense, lr {results['config']['lr']:g}",
        "dense-same": f"dense, dslide's lr {lr['lr']:g} / sqrt(1 + t/{lr['lr_decay']:g})",
    }
    for side, colour in (("dslide", "tab:blue"), ("dense", "tab:red"), ("dense-same", "tab:orange")):
        c = results["convergence"][side]["curve"]
        ax1.plot([p["seconds"] for p in c], [p["p_at_1"] for p in c], "o-", ms=3, color=colour, label=names[side])
    ax1.set_xscale("symlog", linthresh=1.0)
    ax1.set_xlabel("training wall time (s)")
    ax1.set_ylabel("test P@1")
    ax1.set_title(f"P@1 vs time, {results['config']['conv_labels']:,} labels")
    ax1.legend(loc="upper left", fontsize="small")
    if "throughput" in results:
        t = results["throughput"]
        ax2.bar(["dslide", "dense torch"], [t["dslide"]["samples_per_s"], t["dense"]["samples_per_s"]],
                color=["tab:blue", "tab:red"])  # fmt: skip
        ax2.set_yscale("log")
        ax2.set_ylabel("training samples/s")
        ax2.set_title("Amazon-670K shape, H=128, batch 256")
    else:
        per_epoch = results["summary"]["seconds_per_epoch"]
        ax2.bar(list(per_epoch), list(per_epoch.values()), color=["tab:blue", "tab:red", "tab:orange"])
        ax2.set_ylabel("training seconds per epoch")
        ax2.set_title(f"per epoch, {results['config']['conv_labels']:,} labels")
    fig.tight_layout()
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench-out" / "dslide"))
    ap.add_argument("--plot", default=None, help="also write the plot here (e.g. docs/img/dslide_vs_dense.png)")
    ap.add_argument("--quick", action="store_true", help="a small smoke run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--tables", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3, help="dense's Adam step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-factor", type=int, default=64, help="dslide: random-fill pool, x budget")
    ap.add_argument("--rehash-first", type=int, default=50, help="dslide: steps before the first rehash")
    ap.add_argument("--out-init", type=float, default=0.1, help="std of W2 times sqrt(H), both sides")
    ap.add_argument("--blocks", type=int, default=8, help="dslide: label selection blocks")
    ap.add_argument("--dslide-lr", type=float, default=None, help="dslide's Adam step (default: the engine's)")
    ap.add_argument("--dslide-lr-decay", type=float, default=None, help="dslide: lr / sqrt(1 + step / this)")
    ap.add_argument("--dslide-fill-power", type=float, default=None, help="dslide: fill ~ (target count + 1)^this")
    ap.add_argument("--dslide-lsh-frac", type=float, default=None, help="dslide: LSH share of the active set")
    ap.add_argument("--dslide-batch-budget", type=int, default=None,
                    help="dslide: one active set of N output neurons per batch (default: per sample)")  # fmt: skip
    ap.add_argument("--no-lsh-center", action="store_true", help="dslide: hash the rows uncentred")
    ap.add_argument("--no-fill-correction", action="store_true", help="dslide: plain softmax over the active set")
    ap.add_argument("--dense-lr-decay", type=float, default=0.0, help="dense: dslide's lr schedule (0: constant)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per side in (a)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dense-steps", type=int, default=None)
    ap.add_argument("--conv-labels", type=int, default=100_000)
    ap.add_argument("--conv-features", type=int, default=50_000)
    ap.add_argument("--conv-points", type=int, default=None)
    ap.add_argument("--conv-test", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--evals-per-epoch", type=int, default=20)
    ap.add_argument("--data", help="(b) on this XC data set (DIR/train.txt, DIR/test.txt) instead of planted data")
    ap.add_argument("--skip-throughput", action="store_true", help="leave out (a), the Amazon-670K-shape run")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.data:
        from dslide.data import read_header

        _, args.conv_features, args.conv_labels = read_header(Path(args.data) / "train.txt")
    if args.conv_points is None:
        args.conv_points = 6000 if args.quick else 25_000
    if args.worker:
        part, side = args.worker.split(":")
        if part == "a":
            if side == "dense":
                args.steps = args.dense_steps or (2 if args.quick else 8)
                args.warmup = 1
            else:
                args.steps = args.steps or (10 if args.quick else 100)
            res = worker_throughput(side, args)
        else:
            res = worker_convergence(side, args)
        print(json.dumps(res))
        return

    argv = [a for a in sys.argv[1:]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    results = {"config": {k: v for k, v in vars(args).items() if k != "worker"}, "machine": machine()}
    results["dslide_config_b"] = model_cfg(args.conv_features, args.conv_labels, args).to_json()
    if not args.skip_throughput:
        results["throughput"] = {side: run_worker("a", side, argv) for side in ("dslide", "dense")}
    results["convergence"] = {side: run_worker("b", side, argv) for side in ("dslide", "dense", "dense-same")}
    results["wall_s"] = time.time() - t_start
    summarise(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    name = "dslide_vs_dense" + (f"_{Path(args.data).name}" if args.data else "")
    plot(results, [out / f"{name}.png", *([Path(args.plot)] if args.plot else [])])


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "loadavg_at_start": os.getloadavg(),
    }


def summarise(results: dict) -> None:
    c = results["convergence"]
    slide_curve = c["dslide"]["curve"]
    epochs = results["config"]["epochs"]

    def at_epoch(curve: list[dict], e: int) -> dict:
        return min(curve, key=lambda p: abs(p["epoch"] - e))

    results["summary"] = {"seconds_per_epoch": {side: c[side]["curve"][-1]["seconds"] / epochs for side in c}}
    for dense in ("dense", "dense-same"):
        target = at_epoch(c[dense]["curve"], 1)
        t_slide = first_reach(slide_curve, target["p_at_1"])
        results["summary"][dense] = {
            "epoch1_p_at_1": target["p_at_1"],
            "epoch1_seconds": target["seconds"],
            "dslide_seconds_to_that": t_slide,
            "sooner_x": (target["seconds"] / t_slide) if t_slide else None,
            "dslide_minus_dense": [
                at_epoch(slide_curve, e)["p_at_1"] - at_epoch(c[dense]["curve"], e)["p_at_1"]
                for e in range(1, epochs + 1)
            ],
        }
    if "throughput" in results:
        sd, dd = results["throughput"]["dslide"], results["throughput"]["dense"]
        speedup = results["summary"]["speedup_a"] = sd["samples_per_s"] / dd["samples_per_s"]
        print("(a) Amazon-670K shape, H=128, batch 256, threads", results["config"]["threads"])
        print(f"{'':10} {'samples/s':>12} {'step ms':>10} {'peak GiB':>9}")
        for name, r in (("dslide", sd), ("dense", dd)):
            print(f"{name:10} {r['samples_per_s']:12.1f} {r['step_ms']:10.1f} {r['peak_rss_gib']:9.2f}")
        print(f"speed-up {speedup:.1f}x")
        print("  dslide time by function (s):", {k: round(v, 2) for k, v in sd["where_s"].items()})
        print("  dense time by phase (s):", {k: round(v, 2) for k, v in dd["where_s"].items()})
    what = results["config"]["data"] or "planted"
    print(f"(b) {what}, {results['config']['conv_labels']:,} labels, {epochs} epochs (dense-same: dslide's lr)")
    print(f"{'epoch':>6} {'dslide P@1':>11} {'s':>7} {'dense P@1':>10} {'s':>7} {'dense-same P@1':>15} {'s':>7}")
    for e in range(1, epochs + 1):
        row = [at_epoch(c[side]["curve"], e) for side in ("dslide", "dense", "dense-same")]
        cells = (f"{p['p_at_1']:{w}.4f} {p['seconds']:7.1f}" for p, w in zip(row, (11, 10, 15), strict=True))
        print(f"{e:6d} " + " ".join(cells))
    per = results["summary"]["seconds_per_epoch"]
    print("training seconds per epoch: " + ", ".join(f"{k} {v:.1f}" for k, v in per.items()) + "; dense / dslide: "
          + ", ".join(f"{k} {per[k] / per['dslide']:.1f}x" for k in ("dense", "dense-same")))  # fmt: skip
    for dense in ("dense", "dense-same"):
        r = results["summary"][dense]
        if r["dslide_seconds_to_that"]:
            print(f"{dense} epoch-1 P@1 {r['epoch1_p_at_1']:.4f} at {r['epoch1_seconds']:.1f}s; dslide reaches it at "
                  f"{r['dslide_seconds_to_that']:.1f}s: {r['sooner_x']:.1f}x sooner")  # fmt: skip
        else:
            print(f"dslide never reached {dense}'s epoch-1 P@1 {r['epoch1_p_at_1']:.4f}")


if __name__ == "__main__":
    main()

"""D-SLIDE over MPI at Amazon-670K shape: bytes per step against a data-parallel allreduce, and throughput.

    .venv/bin/python benchmarks/dslide_mpi.py [--steps 40] [--warmup 8] [--rounds 3] [--out bench-out/dslide_mpi.png]

Each measurement is a real ``mpiexec -n P`` job of this same file in ``--worker`` mode: every rank builds its
shard of the model (F = 135,909 features, L = 670,091 labels, H = 128, batch 256, budget 512 active labels per
sample), trains ``warmup`` steps, then times ``steps`` steps and counts the bytes each rank sends in them
(MpiComm's ring-model accounting, see :mod:`dslide.mpicomm`).  Printed and plotted:

1. bytes per step per rank at P = 2 and 4 beside the data-parallel figure, a ring allreduce of the whole model's
   gradient every step, ``2(P-1)/P x model bytes`` (float32 parameters);
2. samples/s of 2 ranks x 1 thread against 1 rank x 2 threads (and 1 x 1 for reference), the same total batch
   and steps, ``rounds`` alternating repeats, median reported;
3. the time a step would need on a 1 Gbit/s link (the paper's Table 4 setting): the bytes above over
   125 MB/s, beside the measured compute time per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

F, L, H, BATCH, BUDGET = 135_909, 670_091, 128, 256, 512
LINK_BYTES_PER_S = 1e9 / 8  # 1 Gbit/s


def model_bytes(n_features: int, n_labels: int, hidden: int) -> int:
    """float32 parameters of the whole network: W1, b1, W2, b2 (what a data-parallel step allreduces)."""
    return 4 * (n_features * hidden + hidden + n_labels * hidden + n_labels)


# -- worker: one rank of a measurement job ----------------------------------------------------------------


def worker(a: argparse.Namespace) -> None:
    import numba

    from dslide.gen import generate
    from dslide.model import ModelConfig, SlideModel
    from dslide.mpicomm import abort_on_failure, get_comm

    comm = get_comm()
    with abort_on_failure(comm):
        numba.set_num_threads(a.threads)
        t0 = time.perf_counter()
        data = generate((a.warmup + a.steps) * a.batch, a.features, a.labels, seed=0)
        cfg = ModelConfig(n_features=a.features, n_labels=a.labels, hidden=a.hidden, budget=a.budget, seed=0)
        model = SlideModel(cfg, comm)
        setup = time.perf_counter() - t0
        order = np.random.default_rng(1).permutation(len(data))

        def batch(i: int) -> np.ndarray:
            return order[i * a.batch : (i + 1) * a.batch]

        for i in range(a.warmup):
            model.train_step(data, batch(i))
        comm.barrier()
        by_op = dict(getattr(comm, "bytes_by_op", {}))
        sent0, comm_s0 = comm.bytes_sent, getattr(comm, "seconds", 0.0)
        t0 = time.perf_counter()
        for i in range(a.warmup, a.warmup + a.steps):
            model.train_step(data, batch(i))
        comm.barrier()
        elapsed = time.perf_counter() - t0
        step_bytes = (comm.bytes_sent - sent0) / a.steps
        split = {k: (v - by_op.get(k, 0)) / a.steps for k, v in getattr(comm, "bytes_by_op", {}).items()}
        comm_s = (getattr(comm, "seconds", 0.0) - comm_s0) / a.steps
        per_rank = comm.allgather(np.array([[step_bytes, elapsed, comm_s]]).T)  # 3 x P
        if comm.rank == 0:
            print(json.dumps({
                "ranks": comm.size, "threads": a.threads, "steps": a.steps, "batch": a.batch,
                "setup_s": round(setup, 2), "step_s": float(per_rank[1].max()) / a.steps,
                "samples_per_s": a.steps * a.batch / float(per_rank[1].max()),
                "bytes_per_step": [float(b) for b in per_rank[0]], "bytes_by_op_rank0": split,
                "in_collectives_s": [float(s) for s in per_rank[2]],
            }), flush=True)  # fmt: skip


# -- driver -----------------------------------------------------------------------------------------------


def run_job(ranks: int, threads: int, a: argparse.Namespace) -> dict:
    from dslide.mpirun import run_mpi

    argv = [__file__, "--worker", "--threads", threads, "--steps", a.steps, "--warmup", a.warmup,
            "--batch", a.batch, "--budget", a.budget, "--hidden", a.hidden, "--features", a.features,
            "--labels", a.labels]  # fmt: skip
    env = {"NUMBA_NUM_THREADS": str(threads), "OMP_NUM_THREADS": "1"}
    result = run_mpi(ranks, argv, timeout=a.timeout, env=env)
    if result.timed_out or result.returncode != 0:
        raise RuntimeError(f"{ranks} x {threads}: exit {result.returncode}, timed out {result.timed_out}: "
                           f"{result.stderr[-2000:]}")  # fmt: skip
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(
        f"  {ranks} rank(s) x {threads} thread(s): {report['samples_per_s']:8.0f} samples/s, "
        f"{max(report['bytes_per_step']) / 1e3:8.1f} kB/step/rank, setup {report['setup_s']} s",
        flush=True,
    )
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="alternating repeats of the throughput comparison")
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--budget", type=int, default=BUDGET)
    p.add_argument("--hidden", type=int, default=H)
    p.add_argument("--features", type=int, default=F)
    p.add_argument("--labels", type=int, default=L)
    p.add_argument("--timeout", type=float, default=600, help="seconds per mpiexec job")
    p.add_argument("--out", default=str(ROOT / "bench-out" / "dslide_mpi.png"), help="the plot (docs/img/: on purpose)")
    p.add_argument("--json", default=None, help="also write every measurement here")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return

    from dslide.mpicomm import dataparallel_allreduce_bytes

    mbytes = model_bytes(a.features, a.labels, a.hidden)
    load_before = os.getloadavg()
    print(f"model: F={a.features:,} L={a.labels:,} H={a.hidden} ({mbytes / 1e6:.1f} MB float32), batch {a.batch}, "
          f"budget {a.budget}, {a.steps} timed steps after {a.warmup}")  # fmt: skip

    print("bytes per step (P = 2, 4):")
    comm_runs = {ranks: run_job(ranks, 1, a) for ranks in (2, 4)}
    print("throughput (alternating rounds):")
    speed: dict[tuple[int, int], list[dict]] = {(1, 2): [], (2, 1): [], (1, 1): []}
    for _ in range(a.rounds):
        for ranks, threads in speed:
            speed[ranks, threads].append(run_job(ranks, threads, a))
    median = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in speed.items()}
    step_s = {k: statistics.median(r["step_s"] for r in v) for k, v in speed.items()}

    rows = []
    for ranks, rep in comm_runs.items():
        dslide = max(rep["bytes_per_step"])
        dp = dataparallel_allreduce_bytes(mbytes, ranks)
        compute = step_s[2, 1] if ranks == 2 else rep["step_s"]
        rows.append({
            "ranks": ranks, "dslide_bytes": dslide, "dataparallel_bytes": dp, "ratio": dp / dslide,
            "dslide_link_s": dslide / LINK_BYTES_PER_S, "dataparallel_link_s": dp / LINK_BYTES_PER_S,
            "measured_step_s": compute, "by_op": rep["bytes_by_op_rank0"],
        })  # fmt: skip

    print()
    print(
        "| P | D-SLIDE bytes/step/rank | data-parallel allreduce bytes/step/rank | ratio | D-SLIDE comm @1 Gbit/s "
        "| data-parallel comm @1 Gbit/s | D-SLIDE step @1 Gbit/s (measured compute + comm) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['dslide_bytes'] / 1e3:,.1f} kB | {r['dataparallel_bytes'] / 1e6:,.1f} MB "
              f"| {r['ratio']:,.0f}x | {r['dslide_link_s'] * 1e3:.2f} ms | {r['dataparallel_link_s']:.2f} s "
              f"| {(r['measured_step_s'] + r['dslide_link_s']) * 1e3:.0f} ms |")  # fmt: skip
    print()
    print("| ranks x threads | samples/s (median of rounds) | step | rounds |")
    print("|---|---|---|---|")
    for (ranks, threads), v in speed.items():
        each = ", ".join(f"{r['samples_per_s']:.0f}" for r in v)
        print(f"| {ranks} x {threads} | {median[ranks, threads]:,.0f} | {step_s[ranks, threads] * 1e3:.0f} ms "
              f"| {each} |")  # fmt: skip
    rel = median[2, 1] / median[1, 2]
    print(f"\n2 ranks x 1 thread / 1 rank x 2 threads = {rel:.2f} (target 0.8 .. 1.2)")
    load_after = os.getloadavg()
    print(f"load average (1 min) before/after: {load_before[0]:.1f} / {load_after[0]:.1f} on {os.cpu_count()} cores")

    results = {
        "model_bytes": mbytes,
        "comm": rows,
        "speed": {f"{r}x{t}": v for (r, t), v in speed.items()},
        "median_samples_per_s": {f"{r}x{t}": m for (r, t), m in median.items()},
        "ratio_2x1_over_1x2": rel,
        "loadavg": [load_before, load_after],
    }
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    plot(rows, median, a.out)
    print(f"plot: {a.out}")


def plot(rows: list[dict], median: dict[tuple[int, int], float], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(rows))
    ax1.bar(x - 0.2, [r["dslide_bytes"] for r in rows], 0.4, label="D-SLIDE (measured)")
    ax1.bar(x + 0.2, [r["dataparallel_bytes"] for r in rows], 0.4, label="data-parallel ring allreduce")
    for i, r in enumerate(rows):
        ax1.annotate(f"{r['ratio']:,.0f}x fewer", (i - 0.2, r["dslide_bytes"]), ha="center", va="bottom", fontsize=8)
    ax1.set_yscale("log")
    ax1.set_ylim(1e4, 1e10)
    ax1.set_xticks(x, [f"P = {r['ranks']}" for r in rows])
    ax1.set_ylabel("bytes sent per rank per step")
    ax1.set_title("Amazon-670K shape, H=128, batch 256")
    ax1.legend(fontsize=8, loc="upper left")
    labels = [f"{r} x {t}" for r, t in median]
    ax2.bar(labels, list(median.values()), color=["C2", "C0", "C7"])
    ax2.set_xlabel("ranks x threads per rank")
    ax2.set_ylabel("samples/s (median)")
    ax2.set_title("Throughput on the same 2 cores")
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()

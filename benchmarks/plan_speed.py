"""How fast is ``sampler.plan_epoch`` on a 10-million-file table, and how much memory does it take?

Each (composition, mode) runs in a fresh subprocess so that its peak RSS is its own: the child builds the file
table (sizes, 1,000 directories), records its RSS, plans one epoch ``--repeat`` times (wall time: best and median),
then once more under tracemalloc (peak bytes numpy allocated while planning).  Target (issue #2): < 3 s, < 1 GiB.

    .venv/bin/python benchmarks/plan_speed.py [--files 10000000] [--repeat 3] [--png bench-out/plan_speed.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import tracemalloc

CASES = [
    ("random", "nm"),
    ("random", "budget"),
    ("stratified", "nm"),
    ("stratified", "budget"),
    ("contiguous", "nm"),
    ("contiguous", "budget"),
    ("reservoir", "nm"),
    ("reservoir", "budget"),
]
NM = 100


def child(files: int, composition: str, mode: str, repeat: int) -> dict:
    import numpy as np

    from sampler.plan import plan_epoch

    rng = np.random.default_rng(0)
    # image-like sizes: log-normal around 110 KB, 1 KB minimum
    sizes = np.maximum(rng.lognormal(np.log(110e3), 0.6, size=files), 1024).astype(np.int64)
    groups = rng.integers(0, 1000, size=files)
    kwargs: dict = {"composition": composition, "groups": groups if composition == "stratified" else None}
    if mode == "nm":
        kwargs["nm"] = NM
    else:
        kwargs["budget"] = int(sizes.sum()) // NM + 1  # about NM mini-epochs, the planner picks the count
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times, cpu = [], []
    for epoch in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        plan = plan_epoch(sizes, seed=1, epoch=epoch, **kwargs)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        nm = len(plan)
        del plan
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    plan_epoch(sizes, seed=1, epoch=0, **kwargs)  # the peak includes the returned arrays
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {
        "composition": composition,
        "mode": mode,
        "nm": nm,
        "best_s": min(times),
        "median_s": statistics.median(times),
        "cpu_s": min(cpu),
        "rss_before": rss_before,
        "peak_rss": peak_rss,
        "traced_peak": traced_peak,
        "input_bytes": sizes.nbytes + groups.nbytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=10_000_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--png", default="bench-out/plan_speed.png", help="docs/img/plan_speed.png: on purpose")
    parser.add_argument("--child", nargs=2, metavar=("COMPOSITION", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.files, args.child[0], args.child[1], args.repeat)))
        return

    from tqdm import tqdm

    load_before = os.getloadavg()[0]
    rows = []
    for composition, mode in tqdm(CASES, desc="plan_epoch", unit="case"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--files",
                str(args.files),
                "--repeat",
                str(args.repeat),
                "--child",
                composition,
                mode,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))

    mib = 1024**2
    load_after = os.getloadavg()[0]
    print(
        f"\nplan_epoch on {args.files:,} files, {NM} mini-epochs; {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, best/median of {args.repeat}; load average {load_before:.1f} before, "
        f"{load_after:.1f} after (CPU s = least process time over the runs, ~ the wall time on an idle machine)"
    )
    header = (
        f"| {'composition':<11} | {'given':<6} | {'nm':>4} | {'best s':>6} | {'median s':>8} | {'CPU s':>5} | "
        f"{'peak RSS MiB':>12} | {'planning peak MiB':>17} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for r in rows:
        print(
            f"| {r['composition']:<11} | {r['mode']:<6} | {r['nm']:>4} | {r['best_s']:>6.2f} | "
            f"{r['median_s']:>8.2f} | {r['cpu_s']:>5.2f} | {r['peak_rss'] / mib:>12.0f} | "
            f"{r['traced_peak'] / mib:>17.0f} |"
        )
    print(
        f"(input arrays: {rows[0]['input_bytes'] / mib:.0f} MiB, RSS before planning: "
        f"{rows[0]['rss_before'] / mib:.0f} MiB)"
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['composition']}\n{r['mode']}" for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["best_s"] for r in rows], width=0.4, color="tab:blue", label="wall (best)")
    ax1.bar([i + 0.2 for i in x], [r["cpu_s"] for r in rows], width=0.4, color="tab:orange", label="CPU")
    ax1.set_xticks(list(x), labels)
    ax1.axhline(3.0, color="tab:red", ls="--", label="target 3 s")
    ax1.set_ylabel("seconds")
    ax1.legend()
    ax2.bar(labels, [r["peak_rss"] / mib for r in rows], color="tab:green")
    ax2.axhline(1024, color="tab:red", ls="--", label="target 1 GiB")
    ax2.set_ylabel("peak RSS, MiB")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"plan_epoch, {args.files:,} files, {os.cpu_count()} cores")
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()

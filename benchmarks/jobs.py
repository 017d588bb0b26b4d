"""Several jobs, one mount (issue 28): N training jobs over a throttled network slow tier, sharing one mount or
each with a mount of its own and 1/N of the cache.

The slow tier is sidebyside.py's: sshfs from a network namespace (benchmarks/netbacking.py: a relay that delays
each direction, ``tc tbf`` on the server's side of the veth).  A *job* is a separate process named by
``TIERFS_CONSUMER=jobK`` that reads as the README says: each pass it lists the root, lists each class folder and
reads every file listed (``--threads`` threads), for ``--epochs`` epochs' worth of whole passes (``epochs x nm x
rf``: the mount's ``nm`` from its status).  The jobs start together: each reads one file, then waits until all
have (so every one is live before a pass ends, as a sweep's jobs are after their start-up).

For 1, 2 and 4 jobs (``--jobs``), one after the other on the same link, the page cache dropped before each:

* ``shared``: one mount (``--capacity-fraction`` of the data's blocks, ``--nm``, ``--rf``, ``--advance``) read by
  all the jobs;
* ``per-job``: N mounts, one per job, each with capacity/N and nm x N (so its mini-epochs fit its cache), the
  same rf and advance, and a seed of its own (mount k: ``seed=k``).  With one job both are the same mount: it is
  run once, as ``1 job``.

Per layout: the bytes the server sent over the link (its qdisc's counter, less 66 bytes of headers per packet)
and the daemons' ``backing_bytes_read``, each as a multiple of one job's; each job's samples/s (files read over
its wall time), the seconds it waited in its root listings for the others (the consumers' bounded wait), the
daemons' ``stall_seconds`` (readers waiting on the slow tier: ``advance=strict`` switches to a mini-epoch before
it is staged when the link is behind), the files each job read and saw, out-of-view reads and consumer drops; the
JSON keeps each daemon's last ``status`` too.

Needs root, sshd and sshfs (``--setup``: ``apt-get install -y openssh-server sshfs``).  ``python
benchmarks/jobs.py --setup`` is the docs' run (a few minutes on a 2-core box); ``--quick`` a one-minute check.
Writes ``--out`` (JSON) and ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sidebyside import HEADERS, drop_caches, slow_tier  # noqa: E402
from tierfs.testing.harness import mounted  # noqa: E402

_READY_TIMEOUT = 120.0  # seconds for every job to read its first file


# ============================================================================================ one job


def _read(path: str, compute: float) -> int:
    with open(path, "rb") as f:
        n = len(f.read())
    time.sleep(compute)
    return n


def job_main(mnt: Path, passes: int, workers: int, processes: bool, compute: float, out: Path) -> None:
    """One job (its own process, ``TIERFS_CONSUMER`` in its environment): ``passes`` passes, each listing the root
    and every class folder and reading every file listed with ``workers`` threads (``processes``: worker
    processes, as a DataLoader's), ``compute`` seconds of (slept) work after each; writes its figures to ``out``
    (JSON).  After its first file it writes ``out.ready`` and waits for ``out.go``."""
    first = True
    files = nbytes = 0
    seen: set[str] = set()
    wait = 0.0
    t0 = time.monotonic()

    with (ProcessPoolExecutor if processes else ThreadPoolExecutor)(workers) as pool:
        for _ in range(passes):
            t = time.monotonic()
            folders = os.listdir(mnt)  # (a job ahead of the others waits here: issue 28's bounded wait)
            wait += time.monotonic() - t
            listed = [f"{d}/{n}" for d in folders for n in os.listdir(mnt / d)]
            if first:
                _read(str(mnt / listed[0]), 0.0)
                Path(f"{out}.ready").touch()
                while not Path(f"{out}.go").exists():
                    time.sleep(0.005)
                first, wait, t0 = False, 0.0, time.monotonic()  # (the clock starts with everyone)
            nbytes += sum(pool.map(_read, [str(mnt / rel) for rel in listed], itertools.repeat(compute)))
            files += len(listed)
            seen.update(listed)
    secs = time.monotonic() - t0
    out.write_text(json.dumps({"passes": passes, "files": files, "bytes": nbytes, "seen": len(seen),
                               "seconds": secs, "samples_per_s": files / secs, "wait_seconds": wait}))


# ============================================================================================ one layout


def _status(mnt: Path) -> dict:
    with open(mnt / ".tierfs" / "status") as f:
        return json.load(f)


def run_jobs(mounts: list[Path], compute: list[float], args: argparse.Namespace, work: Path, tag: str) -> list[dict]:
    """Job k reads ``mounts[k]`` for ``epochs`` epochs of whole passes, ``compute[k]`` seconds a file; every job's
    figures."""
    procs: list[subprocess.Popen[bytes]] = []
    outs = [work / f"{tag}-job{k}.json" for k in range(len(mounts))]
    try:
        for k, (mnt, out) in enumerate(zip(mounts, outs, strict=True)):
            passes = args.epochs * _status(mnt)["nm"] * args.rf
            env = {**os.environ, "TIERFS_CONSUMER": f"job{k}", "PYTHONPATH": str(ROOT)}
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "job", str(mnt), str(passes), str(args.threads), args.workers,
                 str(compute[k]), str(out)], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE))
        deadline = time.monotonic() + _READY_TIMEOUT
        while not all(Path(f"{o}.ready").exists() for o in outs):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                errs = [p.stderr.read().decode(errors="replace")[-500:] for p in procs
                        if p.poll() is not None and p.stderr]
                raise RuntimeError(f"a job did not start: {' | '.join(errs) or 'timed out'}")
            time.sleep(0.01)
        for o in outs:
            Path(f"{o}.go").touch()
        for p in procs:
            _, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                raise RuntimeError(f"a job failed: {err.decode(errors='replace')[-2000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    return [json.loads(o.read_text()) for o in outs]


def run_layout(layout: str, n_jobs: int, nb, work: Path, cap: int, args: argparse.Namespace) -> dict:
    """``n_jobs`` jobs over one ``shared`` mount or a mount each (``per-job``: capacity/N, nm x N)."""
    tag = f"{layout}-{n_jobs}"
    n_mounts = 1 if layout == "shared" else n_jobs
    share = 1 if layout == "shared" else n_jobs
    opts = dict(nm=args.nm * share, rf=args.rf, advance=args.advance, consumer_timeout=args.consumer_timeout)
    drop_caches()
    load0 = os.getloadavg()[0]
    wire0, pkts0 = nb.wire()
    with contextlib.ExitStack() as stack:
        ms = []
        for i in range(n_mounts):
            mnt, cache = work / f"mnt-{tag}-{i}", work / f"cache-{tag}-{i}"
            mnt.mkdir()
            # (this checkout's tierfs, whatever the environment's install points at)
            # (a mount each: each its own seed, as each job of the shared mount has its own order -- with one
            # seed the N mounts would stage the same files at the same moments, and the sshfs client's page
            # cache would serve some of them once for all)
            ms.append(stack.enter_context(mounted(nb.root, mnt, cache, str(cap // share), timeout=600,
                                                  env={"PYTHONPATH": str(ROOT)}, seed=i, **opts)))
        mounts = [Path(ms[0 if layout == "shared" else k].mountpoint) for k in range(n_jobs)]
        compute = [args.compute_ms[k % len(args.compute_ms)] / 1e3 for k in range(n_jobs)]
        jobs = run_jobs(mounts, compute, args, work, tag)
        sts, (wire, pkts) = [_status(Path(m.mountpoint)) for m in ms], nb.wire()  # (staging goes on: now)
    return {
        "layout": layout, "jobs": n_jobs, "mounts": n_mounts, "cap_per_mount": cap // share, "nm": opts["nm"],
        "wire_bytes": wire - wire0, "wire_payload": (wire - wire0) - HEADERS * (pkts - pkts0),
        "backing_bytes_read": sum(s["backing_bytes_read"] for s in sts),
        "stall_seconds": sum(s["stall_seconds"] for s in sts),
        "out_of_view": sum(s["reads"]["out_of_view"] for s in sts),
        "drops": sum(s["consumers"]["drops"] for s in sts),
        "rf_effective": [s["rf_effective"] for s in sts],
        "per_job": jobs, "status": sts, "load_before": load0, "load_after": os.getloadavg()[0],
    }


# ============================================================================================ report


def _label(r: dict) -> str:
    if r["jobs"] == 1:
        return "1 job"
    return f"{r['jobs']} jobs, " + ("one shared mount" if r["layout"] == "shared" else "a mount each")


def table(rows: list[dict]) -> str:
    one = next((r for r in rows if r["jobs"] == 1), rows[0])
    out = ["| jobs, mounts | slow-tier MiB (wire payload) | × one job's | `backing_bytes_read` MiB | samples/s per job "
           "| waited for the others, s per job | stall s | files read per job (seen) | out of view, drops | load |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        jobs = r["per_job"]
        rates = " ".join(f"{j['samples_per_s']:,.0f}" for j in jobs)
        waits = " ".join(f"{j['wait_seconds']:.1f}" for j in jobs)
        out.append(
            f"| {_label(r)} | {r['wire_payload'] / 2**20:,.0f} | {r['wire_payload'] / one['wire_payload']:.2f} | "
            f"{r['backing_bytes_read'] / 2**20:,.0f} | {rates} | "
            f"{waits} | {r['stall_seconds']:.1f} | "
            f"{jobs[0]['files']:,} ({jobs[0]['seen']:,}) | {r['out_of_view']}, {r['drops']} | "
            f"{r['load_before']:.1f}–{r['load_after']:.1f} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    one = next((r for r in rows if r["jobs"] == 1), rows[0])
    ns = sorted({r["jobs"] for r in rows})
    colour = {"shared": "#2a6", "per-job": "#c66"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for layout, name in (("shared", "one shared mount"), ("per-job", "a mount each, cache/N")):
        rs = sorted((r for r in rows if r["layout"] == layout or r["jobs"] == 1), key=lambda r: r["jobs"])
        if len(rs) < 2:
            continue
        x = [r["jobs"] for r in rs]
        axes[0].plot(x, [r["wire_payload"] / one["wire_payload"] for r in rs], "o-", color=colour[layout],
                     label=name)
        for r in rs:
            rates = [j["samples_per_s"] for j in r["per_job"]]
            axes[1].scatter([r["jobs"]] * len(rates), rates, color=colour[layout], s=14, alpha=0.7)
        axes[1].plot(x, [sum(j["samples_per_s"] for j in r["per_job"]) / r["jobs"] for r in rs], "-",
                     color=colour[layout], label=f"{name} (mean)")
        axes[2].plot(x, [r["stall_seconds"] for r in rs], "o-", color=colour[layout], label=name)
    axes[0].axhline(1.1, color="k", lw=0.8, ls="--", label="1.1 × one job")
    axes[0].set_ylabel("slow-tier bytes, × one job's")
    axes[1].set_ylabel("samples/s of each job")
    axes[2].set_ylabel("stall s (readers waiting on the slow tier)")
    for ax in axes:
        ax.set_xlabel("jobs")
        ax.set_xticks(ns)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("jobs over a throttled sshfs slow tier: one shared mount vs a mount each (benchmarks/jobs.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:
        mnt, passes, workers, kind, compute, out = argv[1:]
        job_main(Path(mnt), int(passes), int(workers), kind == "processes", float(compute), Path(out))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=600)
    ap.add_argument("--epochs", type=int, default=2, help="epochs of whole passes per job")
    ap.add_argument("--jobs", default="1,2,4", help="job counts to run")
    ap.add_argument("--layouts", default="shared,per-job")
    ap.add_argument("--threads", type=int, default=2, help="readers per job")
    ap.add_argument("--workers", choices=("threads", "processes"), default="threads",
                    help="the readers: threads, or worker processes as a DataLoader's (each a process of the job)")
    ap.add_argument("--compute-ms", type=lambda v: [float(x) for x in v.split(",")], default=[0.0],
                    help="each job's (slept) work per file, job k the k-th value (cycled): 0,0,0,8 makes the 4th "
                    "of 4 jobs slower")
    ap.add_argument("--nm", type=int, default=6, help="the shared mount's nm (a mount each: nm x N)")
    ap.add_argument("--rf", type=int, default=2)
    ap.add_argument("--advance", default="strict", help="strict: exactly rf passes, so equal work is equal epochs")
    ap.add_argument("--consumer-timeout", type=float, default=60)
    ap.add_argument("--rate", default="200mbit", help="the link's rate (tc tbf)")
    ap.add_argument("--delay-ms", type=float, default=0.25, help="each direction's delay (RTT = 2x)")
    ap.add_argument("--cap-fraction", type=float, default=1 / 3, help="the cache (all mounts together) as a "
                    "fraction of the data's blocks")
    ap.add_argument("--quick", action="store_true", help="200 files, one epoch: a one-minute check")
    ap.add_argument("--setup", action="store_true", help="apt-get install openssh-server sshfs first")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "jobs.json",
                    help="benchmarks/results/jobs.json: on purpose")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench-out" / "jobs.png", help="docs/img/jobs.png: on purpose")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        ap.error("needs root (network namespace, tc, drop_caches)")
    if args.quick:
        args.files, args.epochs = 200, 1
    if args.setup:
        subprocess.run(["apt-get", "install", "-y", "-q", "openssh-server", "sshfs"], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    counts = [int(n) for n in args.jobs.split(",")]
    runs = [(layout, n) for n in counts for layout in args.layouts.split(",") if n > 1 or layout == "shared"]
    with slow_tier(args.files, args.rate, args.delay_ms, args.cap_fraction, "jobs-") as (work, nb, total, cap):
        print(f"{args.files} files, {total / 2**20:.0f} MiB, cache {cap / 2**20:.0f} MiB in all, nm {args.nm}, "
              f"rf {args.rf}, advance={args.advance}, {args.epochs} epochs per job, {args.threads} threads a "
              f"job, link {args.rate}, RTT {nb.rtt() * 1e3:.2f} ms", flush=True)
        rows = []
        for layout, n in runs:
            row = run_layout(layout, n, nb, work, cap, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(table(rows))
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "plot", "setup")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**settings, "bytes": total, "cap": cap, "rows": rows}, indent=1) + "\n")
    plot(rows, args.plot)

if __name__ == "__main__":
    main()

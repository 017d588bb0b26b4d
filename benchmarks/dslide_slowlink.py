"""D-SLIDE against data-parallel training over a real, throttled link: two ranks in two network namespaces.

    sudo .venv/bin/python benchmarks/dslide_slowlink.py [--rates 1gbit,100mbit] [--steps 20]

Needs root (``ip netns``, ``tc``).  Two network namespaces joined by a veth pair, each end throttled with
``tc qdisc ... tbf`` to the rate (a 1 ms token bucket, so a burst cannot outrun the link); MPICH's Hydra starts
one rank in each namespace (its ``ssh`` launcher replaced by ``ip netns exec``), and the ranks talk TCP over the
veth (``-iface``; two hosts, so no shared memory between them).  Per rate, two real ``mpiexec -n 2`` jobs:

1. dslide at Amazon-670K shape (``benchmarks/dslide_mpi.py``'s worker: batch 256, budget 512, 1 thread per
   rank): seconds per training step, collectives included;
2. the data-parallel baseline's communication: ``MPI.Allreduce`` of the whole model's float32 gradient
   (W1, b1, W2, b2: 415 MB), what every data-parallel step must move.  Its compute is left out, so the ratio is
   a lower bound of dslide's advantage over a data-parallel step.

The kernel here has no ``netem``, so no latency is added beyond the veth's own (the paper's link has ~0.1 ms;
dslide's 6 collectives a step would add 6 round trips).  Everything the run creates (namespaces, the veth,
the jobs' processes) is removed when it exits, on an error or Ctrl-C too.  Only the namespaces' own addresses
are used.  Prints a table, writes ``results.json`` and ``dslide_slowlink.png`` into ``--out`` (``--plot PATH``:
the plot there instead, e.g. ``docs/img/dslide_slowlink.png`` on purpose).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dslide.mpirun import MPIEXEC, job_env  # noqa: E402
from dslide_mpi import BATCH, BUDGET, F, H, L, model_bytes  # noqa: E402

SUBNET = "10.77.0"
IFACE = "slink"  # the veth end's name inside either namespace
# The mpich wheel's default netmod (UCX) would reach the other namespace through shared memory (same host
# name, same /dev/shm): force "another node" and TCP over the veth only
LINK_ENV = {"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": IFACE}


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


class ThrottledLink:
    """Two namespaces ``<tag>a`` / ``<tag>b`` joined by a veth throttled with tbf; removed on exit."""

    def __init__(self, tag: str) -> None:
        self.ns = (f"{tag}a", f"{tag}b")
        self.addr = (f"{SUBNET}.1", f"{SUBNET}.2")
        self.veth = (f"{tag}va", f"{tag}vb")

    def __enter__(self) -> ThrottledLink:
        try:
            for ns in self.ns:
                sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
            for ns, veth, addr in zip(self.ns, self.veth, self.addr, strict=True):
                sh("ip", "link", "set", veth, "netns", ns)
                sh("ip", "-n", ns, "link", "set", veth, "name", IFACE)
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", IFACE)
                sh("ip", "-n", ns, "link", "set", IFACE, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def set_rate(self, rate: str) -> None:
        bits = parse_rate(rate)
        burst = max(16 * 1024, bits // 8 // 1000)  # 1 ms of the rate
        for ns in self.ns:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", IFACE, "root", "tbf", "rate", rate,
               "burst", str(burst), "latency", "100ms")  # fmt: skip

    def bytes_sent(self) -> int:
        """Bytes the tbf qdiscs of both ends have sent: proof that a job's traffic took the link."""
        total = 0
        for ns in self.ns:
            words = sh("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", IFACE).stdout.split()
            total += int(words[words.index("Sent") + 1])
        return total

    def kill_processes(self) -> None:
        for ns in self.ns:
            r = sh("ip", "netns", "pids", ns, check=False)
            for pid in r.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    def __exit__(self, *exc: object) -> None:
        self.kill_processes()
        for ns in self.ns:
            sh("ip", "netns", "del", ns, check=False)  # takes its veth end with it
        sh("ip", "link", "del", self.veth[0], check=False)  # if it never left the root namespace


def parse_rate(rate: str) -> int:
    units = {"gbit": 10**9, "mbit": 10**6, "kbit": 10**3}
    for u, m in units.items():
        if rate.endswith(u):
            return int(float(rate[: -len(u)]) * m)
    raise ValueError(f"rate must end in one of {list(units)}, got {rate!r}")


def launcher_script(link: ThrottledLink, path: Path) -> Path:
    """What Hydra runs instead of ssh (``[options] HOST COMMAND...``): COMMAND inside HOST's namespace."""
    cases = "\n".join(f"  {a}) ns={ns} ;;" for a, ns in zip(link.addr, link.ns, strict=True))
    path.write_text(f"""#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case $host in
{cases}
  *) echo "no namespace for $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" sh -c "$*"
""")  # fmt: skip
    path.chmod(0o755)
    return path


def run_job(link: ThrottledLink, launcher: Path, argv: list[str], timeout: float) -> dict:
    cmd = ["ip", "netns", "exec", link.ns[0], MPIEXEC, "-launcher", "ssh", "-launcher-exec", str(launcher),
           "-hosts", ",".join(link.addr), "-iface", IFACE, "-ppn", "1", "-n", "2", sys.executable, *argv]  # fmt: skip
    try:
        r = subprocess.run(cmd, env=job_env(LINK_ENV), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        link.kill_processes()
        raise RuntimeError(f"job timed out after {timeout} s: {argv}") from e
    finally:
        link.kill_processes()  # a rank a failed job left behind
    if r.returncode != 0:
        raise RuntimeError(f"job failed ({r.returncode}): {argv}\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def allreduce_worker(a: argparse.Namespace) -> None:
    """One rank of the baseline: time ``reps`` allreduces of the model's gradient."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    grad = np.ones(model_bytes(F, L, H) // 4, np.float32)
    out = np.empty_like(grad)
    comm.Allreduce(grad[: 1 << 20], out[: 1 << 20])  # connect before timing
    times = []
    for _ in range(a.reps):
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(grad, out)
        times.append(time.perf_counter() - t0)
    if comm.rank == 0:
        assert out[0] == comm.size
        print(json.dumps({"allreduce_s": times, "bytes": grad.nbytes}), flush=True)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["dslide_step_s"] for r in rows], 0.4, label="dslide step (2 ranks)")
    ax.bar([i + 0.2 for i in x], [r["allreduce_s"] for r in rows], 0.4, label="data-parallel allreduce alone")
    for i, r in enumerate(rows):
        ax.text(i, r["allreduce_s"], f"{r['ratio']:.0f}x", ha="center", va="bottom")
    ax.set_xticks(list(x), [r["rate"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("seconds per step")
    ax.set_title("Amazon-670K shape, two namespaces over a tbf-throttled veth")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="1gbit,100mbit")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=0, help="baseline allreduces per rate (0: 3 at >= 1gbit, else 1)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=str(ROOT / "bench-out" / "dslide_slowlink"))
    ap.add_argument("--plot", default=None, help="the plot's path (default OUT/dslide_slowlink.png)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        allreduce_worker(a)
        return
    if os.geteuid() != 0:
        raise SystemExit("needs root: it creates network namespaces, a veth pair and tc qdiscs")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind (and clean up) on SIGTERM as on Ctrl-C
    rows = []
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="slowlink-") as tmp, ThrottledLink(f"dsl{os.getpid()}") as link:
        launcher = launcher_script(link, Path(tmp) / "nsexec")
        for rate in a.rates.split(","):
            link.set_rate(rate)
            sent0 = link.bytes_sent()
            d = run_job(link, launcher, [str(ROOT / "benchmarks" / "dslide_mpi.py"), "--worker", "--threads", "1",
                        "--steps", str(a.steps), "--warmup", str(a.warmup)], a.timeout)  # fmt: skip
            sent1 = link.bytes_sent()
            reps = a.reps or (3 if parse_rate(rate) >= 10**9 else 1)
            b = run_job(link, launcher, [__file__, "--worker", "--reps", str(reps)], a.timeout)
            sent2 = link.bytes_sent()
            ar = sorted(b["allreduce_s"])[len(b["allreduce_s"]) // 2]
            row = {"rate": rate, "dslide_step_s": d["step_s"], "dslide_in_collectives_s": max(d["in_collectives_s"]),
                   "dslide_bytes_per_step": max(d["bytes_per_step"]), "allreduce_s": ar, "allreduce_all_s":
                   b["allreduce_s"], "allreduce_bytes": b["bytes"], "ratio": ar / d["step_s"],
                   "loadavg": os.getloadavg(), "link_bytes_dslide_job": sent1 - sent0,
                   "link_bytes_allreduce_job": sent2 - sent1}  # fmt: skip
            rows.append(row)
            print(f"{rate:>8}: dslide step {1000 * row['dslide_step_s']:7.1f} ms (in collectives "
                  f"{1000 * row['dslide_in_collectives_s']:.1f} ms, {row['dslide_bytes_per_step'] / 1e3:.0f} kB sent), "
                  f"allreduce of {b['bytes'] / 1e6:.0f} MB {ar:7.2f} s -> {row['ratio']:.1f}x; load "
                  f"{row['loadavg'][0]:.2f}; on the link: dslide job {(sent1 - sent0) / 1e6:.1f} MB, allreduce job "
                  f"{(sent2 - sent1) / 1e6:.1f} MB", flush=True)  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"rows": rows, "loadavg_at_start": load0, "batch": BATCH,
                                                  "budget": BUDGET, "steps": a.steps}, indent=1))  # fmt: skip
    plot(rows, Path(a.plot) if a.plot else out / "dslide_slowlink.png")


if __name__ == "__main__":
    main()

"""Peers (issue 27): four nodes on this machine, one shared slow tier, each node's cache a quarter of the data.

The nodes: four tierfs daemons under one ``mpiexec -n 4``, each in a network namespace of its own (``nsenter
--net=/run/netns/pbN-K`` before its ``python``: only the network is its own, so its FUSE mount is seen here).
Their links: a veth each into a bridge in this namespace, each throttled by ``tc tbf`` (``--peer-rate``, both
ways), and the peers' bytes go over them (``--peer-addr`` the node's address on the bridge).  The slow tier:
sidebyside.py's sshfs of a server in a namespace of its own behind one ``tbf``-throttled veth (``--slow-rate``,
shared by the four daemons; ``noforget``: netbacking.py says why).  Every cache is capped at a quarter of the
data set's blocks plus two mini-epochs of the node's share (``--slack`` more), so together they hold the data.

A reader per node (a thread each, the four at once) reads its node's view every pass: the names in
``.tierfs/order0``, each file whole, then ``--compute`` seconds of (slept) work; then it waits for the other
three (a barrier per pass: a data-parallel job's nodes move in step).  The mounts move on by their own rules
(``advance=ready``: after ``rf`` passes, once the next mini-epoch is staged, else the pass is repeated).  At
every barrier each node's ``status`` is recorded; the run ends once every node is in epoch ``--epochs``.

Modes (``--modes``), one after the other on the same links, the page cache dropped before each:

* ``sharded``: today's sharding (``--rank K --world-size 4``), no peers, ``rf`` ``--rf``;
* ``peers``: ``--peers mpi``, the same ``rf``;
* ``peers-auto``: ``--peers mpi`` with ``rf=auto`` (``composition=random``): rf 1 is a full shuffle, and the
  mount goes down to it once staging (from the peers after the first epoch) keeps up with the readers.

Per epoch (the cluster's: from the first barrier at which every node reached it to the next's): the slow tier's
bytes (the daemons' ``backing_bytes_read``), the peers' bytes, the seconds, the readers' stall seconds
(``stall_seconds``), passes repeated beyond rf because staging was behind, the rf each node ran.

``--stall``: the ``peers`` mode only, node 3 reading on its own (not in the others' step); once the other three
reach epoch ``--stall-at`` its daemon is stopped (SIGSTOP: its port accepts, nothing answers -- a hung node)
until the run ends.  Printed: the others' longest pass in the epochs before the stall (from epoch 1) and after
it, and the seconds each waited on node 3 (its ``peers.peers[].waited_s``), at ``--peer-timeout``.

Needs root, sshd, sshfs, iproute2 (``tc``), nsenter.  ``python benchmarks/peers.py`` is the docs' run (a few
minutes on a 2-core box); writes ``--out`` (JSON) and ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dslide.mpirun import MpiJob, parent  # noqa: E402
from sidebyside import drop_caches, slow_tier  # noqa: E402
from tierfs.testing.harness import end_mount_job, is_mounted, within  # noqa: E402

N = 4
MODES = ("sharded", "peers", "peers-auto")
_START_TIMEOUT = 180.0  # seconds for the four mounts to answer
_READ_TIMEOUT = 60.0  # seconds one read may take before the mount is taken for hung


def _run(*cmd: str, check: bool = True) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or f'exit {r.returncode}'}")


# ============================================================================================ the nodes' network


@contextlib.contextmanager
def peer_network(rate: str) -> Iterator[list[tuple[str, str]]]:
    """Four namespaces on a bridge, each link throttled to ``rate`` both ways; yields (namespace, address) per
    node.  Everything is deleted at exit."""
    tag = os.getpid()
    bridge = f"pbbr{tag}"[:15]
    nodes = [(f"pb{tag}-{k}", f"10.214.{tag % 250}.{k + 1}") for k in range(N)]
    made: list[str] = []
    veths: list[str] = []
    try:
        _run("ip", "link", "add", bridge, "type", "bridge")
        _run("ip", "link", "set", bridge, "up")
        for k, (ns, addr) in enumerate(nodes):
            host, inside = f"pbh{tag}{k}", f"pbn{tag}{k}"  # (a pid has at most 7 digits: 11 of 15 characters)
            _run("ip", "netns", "add", ns)
            made.append(ns)
            _run("ip", "link", "add", host, "type", "veth", "peer", "name", inside)
            veths.append(host)
            _run("ip", "link", "set", inside, "netns", ns)
            _run("ip", "link", "set", host, "master", bridge)
            _run("ip", "link", "set", host, "up")
            for cmd in (("ip", "addr", "add", f"{addr}/24", "dev", inside), ("ip", "link", "set", inside, "up"),
                        ("ip", "link", "set", "lo", "up")):
                _run("ip", "netns", "exec", ns, *cmd)
            # both directions: what the node sends (its end) and what it receives (the bridge's end)
            tbf = ("tbf", "rate", rate, "burst", "256kb", "latency", "50ms")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", inside, "root", *tbf)
            _run("tc", "qdisc", "replace", "dev", host, "root", *tbf)
        yield nodes
    finally:
        for ns in made:
            _run("ip", "netns", "del", ns, check=False)  # (its veth goes with it ...)
        for host in veths:
            _run("ip", "link", "del", host, check=False)  # (... unless it never got there)
        _run("ip", "link", "del", bridge, check=False)


# ============================================================================================ one mode


def _status(m: Path) -> dict:
    return json.loads(within(str(m), (m / ".tierfs" / "status").read_bytes, _READ_TIMEOUT))


def _snapshot(m: Path) -> dict:
    st = _status(m)
    peers = st.get("peers") or {}
    return {"epoch": st["epoch"], "mini_epoch": st["mini_epoch"], "rf": st["rf"], "rf_wanted": st["rf_wanted"],
            "backing_bytes_read": st["backing_bytes_read"], "peer_bytes": peers.get("fetched_bytes", 0),
            "stall_seconds": st["stall_seconds"], "repeats": st["slow_tier"]["repeats_beyond_rf"],
            "staging_bytes_per_s": st["staging"]["bytes_per_s"],
            "consumption_bytes_per_s": st["consumption_bytes_per_s"], "cache_bytes": st["cache_bytes"],
            "waited_on": {str(p["rank"]): p["waited_s"] for p in peers.get("peers", [])}}


def _reader(m: Path, compute: float, barrier: threading.Barrier | None, done: threading.Event,
            errors: list[BaseException]) -> None:
    """Read ``m``'s view every pass, ``compute`` seconds after each file; meet the others after each pass
    (without ``barrier``: on its own, and ``done`` ends it between two files)."""
    try:
        while not done.is_set():
            names = within(str(m), (m / ".tierfs" / "order0").read_bytes, _READ_TIMEOUT)
            assert isinstance(names, bytes), names
            for name in names.split(b"\0")[:-1]:
                if barrier is None and done.is_set():
                    return
                data = within(str(m), (m / os.fsdecode(name)).read_bytes, _READ_TIMEOUT)
                if isinstance(data, FileNotFoundError) and barrier is None:
                    continue  # (on its own its mount may move on mid-pass: only its pace matters)
                if isinstance(data, OSError):
                    raise RuntimeError(f"{m / os.fsdecode(name)}: {data!r}")
                time.sleep(compute)
            if barrier is not None:
                barrier.wait()
    except BaseException as exc:
        errors.append(exc)
        if barrier is not None:
            barrier.abort()


def _serving_daemon(job: MpiJob, rank: int) -> int:
    """Rank ``rank``'s serving daemon: its process whose parent is of the rank too (the one peers.py forks)."""
    of_rank = job.processes_of_rank(rank)
    return next(pid for pid in of_rank if parent(pid) in of_rank)


def _node_argv(mode: str, k: int, backing: Path, work: Path, cap: int, addr: str, args: argparse.Namespace
               ) -> list[str]:
    argv = ["-m", "tierfs", "mount", str(backing), str(work / f"mnt-{mode}-{k}"), "--cache",
            str(work / f"cache-{mode}-{k}"), "--capacity", str(cap), "--nm", str(args.nm), "--seed", "1",
            "--rf", "auto" if mode == "peers-auto" else str(args.rf), "--composition", "random"]
    if mode == "sharded":
        return [*argv, "--rank", str(k), "--world-size", str(N)]
    return [*argv, "--peers", "mpi", "--peer-addr", addr, "--peer-timeout", str(args.peer_timeout)]


def run_mode(mode: str, backing: Path, work: Path, cap: int, nodes: list[tuple[str, str]],
             args: argparse.Namespace) -> dict:
    """The four nodes in ``mode`` until every one is in epoch ``args.epochs``: a status snapshot of each at every
    barrier."""
    mnts = [work / f"mnt-{mode}-{k}" for k in range(N)]
    for m in mnts:
        m.mkdir()
    drop_caches()
    load0 = os.getloadavg()[0]
    job = MpiJob(N, [], rank_argv={k: _node_argv(mode, k, backing, work, cap, nodes[k][1], args) for k in range(N)},
                 rank_prefix={k: ["nsenter", f"--net=/run/netns/{nodes[k][0]}"] for k in range(N)},
                 launcher_args=["-disable-auto-cleanup"])
    records: list[dict] = []
    try:
        deadline = time.monotonic() + _START_TIMEOUT
        while not all(is_mounted(m) and (m / ".tierfs" / "status").exists() for m in mnts):
            job.track()
            if job.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: the mounts did not come up: {job.wait(1).stderr[-3000:]}")
            time.sleep(0.1)
        job.track()
        done = threading.Event()
        errors: list[BaseException] = []
        t0 = time.monotonic()
        # (--stall: node 3 reads on its own, apart from the others' step and records, until it is stopped)
        watched = mnts[:N - 1] if args.stall else mnts
        free_done = threading.Event()
        free = threading.Thread(target=_reader, args=(mnts[-1], args.compute, None, free_done, errors), daemon=True)
        stopped: list[int] = []

        def record() -> None:  # (the barrier's action: one thread, while the others wait)
            snaps = [_snapshot(m) for m in watched]
            records.append({"t": time.monotonic() - t0, "nodes": snaps, "stalled": bool(stopped)})
            if args.stall and not stopped and min(s["epoch"] for s in snaps) >= args.stall_at:
                free_done.set()
                free.join(_READ_TIMEOUT)
                stopped.append(_serving_daemon(job, N - 1))
                os.kill(stopped[0], signal.SIGSTOP)
                records[-1]["stall"] = True  # (the passes after this record ran with node 3 stopped)
            if min(s["epoch"] for s in snaps) >= args.epochs or time.monotonic() - t0 > args.mode_timeout:
                done.set()
                free_done.set()

        try:
            record()
            barrier = threading.Barrier(len(watched), action=record)
            threads = [threading.Thread(target=_reader, args=(m, args.compute, barrier, done, errors), daemon=True)
                       for m in watched]
            for th in threads:
                th.start()
            if args.stall:
                free.start()
            for th in threads:
                th.join()
        finally:
            free_done.set()  # (the watched readers ended, or failed: node 3's too)
            if free.is_alive():
                free.join(_READ_TIMEOUT)
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)  # (before the job's end stops it)
        if errors:
            raise RuntimeError(f"{mode}: a reader failed: {errors[0]!r}")
        job.track()
    finally:
        end_mount_job(job, mnts)
    out = {"mode": mode, "load_before": load0, "records": records, "epochs": per_epoch(records, args.epochs)}
    if args.stall:
        out["stall"] = stall_summary(records, args.peer_timeout)
    return out


def stall_summary(records: list[dict], peer_timeout: float) -> dict:
    """(--stall) The watched nodes' longest pass before the stall (from epoch 1: the first reads the slow tier)
    and after it, and the seconds each waited on node 3."""
    before, during = [], []
    stalled = False
    for prev, cur in itertools.pairwise(records):
        stalled = stalled or bool(prev.get("stall"))
        if stalled:
            during.append(cur["t"] - prev["t"])
        elif min(n["epoch"] for n in prev["nodes"]) >= 1:
            before.append(cur["t"] - prev["t"])
    return {"peer_timeout": peer_timeout, "passes_before": len(before), "passes_during": len(during),
            "longest_pass_before_s": max(before, default=None), "longest_pass_during_s": max(during, default=None),
            "waited_s": [n["waited_on"].get(str(N - 1), 0.0) for n in records[-1]["nodes"]]}


def per_epoch(records: list[dict], epochs: int) -> list[dict]:
    """Epoch ``e`` of the cluster runs from the first record at which every node was in epoch ``e`` or later to
    the first at which every node was in ``e + 1``: its seconds, slow-tier and peer bytes, stall seconds,
    passes repeated beyond rf, and the rf each node was running at its end."""
    def at(e: int) -> dict | None:
        return next((r for r in records if min(n["epoch"] for n in r["nodes"]) >= e), None)

    def total(r: dict, key: str) -> float:
        return sum(n[key] for n in r["nodes"])

    out = []
    for e in range(epochs):
        a, b = at(e), at(e + 1)
        if a is None or b is None:
            break
        out.append({"epoch": e, "seconds": b["t"] - a["t"],
                    "slow_tier_bytes": total(b, "backing_bytes_read") - total(a, "backing_bytes_read"),
                    "peer_bytes": total(b, "peer_bytes") - total(a, "peer_bytes"),
                    "stall_seconds": total(b, "stall_seconds") - total(a, "stall_seconds"),
                    "repeats_beyond_rf": total(b, "repeats") - total(a, "repeats"),
                    "rf": [n["rf"] for n in b["nodes"]],
                    "staging_mb_per_s": [round(n["staging_bytes_per_s"] / 1e6, 1) for n in b["nodes"]]})
    return out


# ============================================================================================ output


def summary(res: dict) -> list[dict]:
    """Per mode: the first epoch, and the mean of the later ones."""
    rows = []
    for m in res["modes"]:
        eps = m["epochs"]
        later = eps[1:] or eps
        rows.append({"mode": m["mode"],
                     "epoch0_slow_tier_mib": eps[0]["slow_tier_bytes"] / 2**20 if eps else None,
                     "epoch0_seconds": eps[0]["seconds"] if eps else None,
                     "later_slow_tier_mib": sum(e["slow_tier_bytes"] for e in later) / len(later) / 2**20,
                     "later_peer_mib": sum(e["peer_bytes"] for e in later) / len(later) / 2**20,
                     "later_seconds": sum(e["seconds"] for e in later) / len(later),
                     "later_stall_seconds": sum(e["stall_seconds"] for e in later) / len(later),
                     "later_repeats": sum(e["repeats_beyond_rf"] for e in later) / len(later),
                     "last_rf": eps[-1]["rf"] if eps else None})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| mode | epoch 0: slow tier MiB, s | later epochs: slow tier MiB | peers MiB | s | stall s | "
             "repeats | rf at the end |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['epoch0_slow_tier_mib']:.1f}, {r['epoch0_seconds']:.1f} | "
                     f"{r['later_slow_tier_mib']:.2f} | {r['later_peer_mib']:.1f} | {r['later_seconds']:.1f} | "
                     f"{r['later_stall_seconds']:.1f} | {r['later_repeats']:.1f} | {r['last_rf']} |")
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for m in res["modes"]:
        eps = m["epochs"]
        xs = [e["epoch"] for e in eps]
        ax1.plot(xs, [e["slow_tier_bytes"] / 2**20 for e in eps], marker="o", label=m["mode"])
        ax2.plot(xs, [e["seconds"] for e in eps], marker="o", label=m["mode"])
    ax1.set(xlabel="epoch", ylabel="slow-tier MiB read (4 nodes)", title="slow-tier bytes per epoch")
    ax2.set(xlabel="epoch", ylabel="seconds", title="epoch time (4 nodes in step)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{res['files']} files, {res['data_bytes'] / 2**20:.0f} MiB; slow tier {res['slow_rate']} shared, "
                 f"peers {res['peer_rate']} each; cache {res['capacity'] / 2**20:.0f} MiB per node")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=600, help="files of 64-256 KiB (default 600, ~94 MiB)")
    ap.add_argument("--nm", type=int, default=4)
    ap.add_argument("--rf", type=int, default=4, help="rf of sharded and peers (default 4)")
    ap.add_argument("--epochs", type=int, default=7, help="epochs per mode (default 7: the cold one and 6)")
    ap.add_argument("--compute", type=float, default=0.02, help="seconds of work per file (default 0.02)")
    ap.add_argument("--slow-rate", default="40mbit", help="the shared slow tier's link (default 40mbit)")
    ap.add_argument("--delay-ms", type=float, default=0.25, help="the slow tier's one-way delay (default 0.25)")
    ap.add_argument("--peer-rate", default="1gbit", help="each node's link (default 1gbit)")
    ap.add_argument("--slack", type=float, default=0.05, help="cache beyond share + 2 mini-epochs, as a fraction "
                    "of the data set (default 0.05)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--peer-timeout", type=float, default=5.0, help="the nodes' peer_timeout (default 5)")
    ap.add_argument("--stall", action="store_true", help="the peers mode only, node 3 stopped (SIGSTOP) once the "
                    "others reach epoch --stall-at")
    ap.add_argument("--stall-at", type=int, default=2, help="the epoch node 3 stops at under --stall (default 2)")
    ap.add_argument("--mode-timeout", type=float, default=300.0, help="seconds a mode may run (default 300)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "peers.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench-out" / "peers.png")
    args = ap.parse_args(argv)
    modes = ["peers"] if args.stall else args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(unknown)}: choose from {', '.join(MODES)}")
    if os.geteuid() != 0:
        ap.error("needs root (network namespaces, veth, tc, sshd)")
    fraction = 1 / N + 2 / (N * args.nm) + args.slack
    res: dict = {"files": args.files, "nm": args.nm, "rf": args.rf, "compute": args.compute,
                 "slow_rate": args.slow_rate, "peer_rate": args.peer_rate, "modes": []}
    with slow_tier(args.files, args.slow_rate, args.delay_ms, fraction, "tierfs-peers-") as (work, nb, total, cap), \
            peer_network(args.peer_rate) as nodes:
        res.update(data_bytes=total, capacity=cap)
        for mode in modes:
            r = run_mode(mode, nb.root, work, cap, nodes, args)
            res["modes"].append(r)
            print(f"{mode}: " + "; ".join(f"e{e['epoch']} {e['seconds']:.1f}s slow {e['slow_tier_bytes'] / 2**20:.1f}"
                                          f" MiB peers {e['peer_bytes'] / 2**20:.1f} MiB rf {e['rf']}"
                                          for e in r["epochs"]), flush=True)
    res["summary"] = summary(res)
    res["load_after"] = os.getloadavg()[0]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    plot(res, args.plot)
    print(table(res["summary"]))
    for m in res["modes"]:
        if "stall" in m:
            st = m["stall"]
            print(f"stall (peer_timeout {st['peer_timeout']:g} s): the others' longest pass "
                  f"{st['longest_pass_before_s']:.1f} s before ({st['passes_before']} passes), "
                  f"{st['longest_pass_during_s']:.1f} s with node 3 stopped ({st['passes_during']}); "
                  f"waited on it: {', '.join(f'{w:.1f}' for w in st['waited_s'])} s")
    print(f"load {res['load_after']:.1f}; wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

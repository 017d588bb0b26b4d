"""tierfs over a network backing with real per-request latency (issue 19), side by side in one run.

The network backing is :mod:`netbacking`: sshfs (``cache=no``, kernel attribute/entry caches off) over a veth
pair into a network namespace, through a user-space relay adding ``--delay-ms`` each way (0.25 = a 0.5 ms
link RTT, a same-rack NFS server).  The same source dir is also used directly as the *local* backing, so both
serve the very same files.  Rows (each a ratio against its baseline taken in the same run):

* ``cached``   open+read+close of every file of 2,000 x 110 KiB, all cached, 1 and 4 reader threads: tierfs over
  the network backing vs tierfs over the local backing vs the files read straight from the sshfs mount;
* ``uncached`` the same files, nothing cached (``policy=lru view=full``, a fresh cache per run), 1 vs 4 readers
  over the network backing;
* ``staging``  files/s from the mount answering until every file of the set is staged (``nm=1``, capacity holds
  all; also counted from starting the mount), over the network and the local backing, for each ``--streams``
  setting, vs a parallel Python copy of the same files with 1, 4, 16 and 64 threads;
* ``mount``    mount time of 20,000 x 1 KiB in 100 dirs over the network backing vs a 16-thread ``stat`` of it;
* ``remount``  a remount of a LOCAL tree of ``--remount-files`` x 512 B (on a private tmpfs, as the ``pass``
  row's tree) over an unchanged cache: time until ``status`` answers;
* ``pass``     a 1-reader pass over a mini-epoch of ``--pass-files`` x 512 B (local backing, ``nm=4``) while the
  next mini-epoch stages vs the same with staging idle.

Prints a table, writes ``OUT/netbench.json`` and ``OUT/netbench.png``.  Root is required; everything it starts
(namespace, sshd, relay, sshfs, tierfs mounts) is gone when it exits, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from datapath import read_files
from netbacking import net_backing
from slowtier import KiB, drop_caches, install_sigterm, require_root
from tierfs.testing.harness import Mounted, mounted

_BUF = 1 << 20


def load() -> float:
    return round(os.getloadavg()[0], 2)


def write_tree(root: Path, files: int, size: int, dirs: int) -> list[str]:
    """``files`` random files of ``size`` bytes in ``dirs`` dirs under ``root``; returns relative paths."""
    rels = [f"d{i % dirs:04d}/f{i:07d}.bin" for i in range(files)]
    for d in range(dirs):
        (root / f"d{d:04d}").mkdir(parents=True, exist_ok=True)
    blob = os.urandom(size + 4096)
    for i, rel in enumerate(rels):
        fd = os.open(root / rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, blob[i % 4096: i % 4096 + size])
        finally:
            os.close(fd)
    return rels


def read_all(paths: list[str], threads: int) -> float:
    """Open, read whole, close every path with ``threads`` threads (shared cursor); returns files/s."""
    return len(paths) / read_files(paths, threads)


def copy_all(src: Path, rels: list[str], dst: Path, threads: int) -> float:
    """Copy every file with ``threads`` threads (read whole, write, no fsync, as staging does before its
    commit); returns files/s."""
    shutil.rmtree(dst, ignore_errors=True)
    for d in {os.path.dirname(r) for r in rels}:
        (dst / d).mkdir(parents=True, exist_ok=True)

    def one(rel: str) -> None:
        with open(src / rel, "rb", buffering=0) as fi, open(dst / rel, "wb", buffering=0) as fo:
            while chunk := fi.read(_BUF):
                fo.write(chunk)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, rels))
    dt = time.perf_counter() - t0
    shutil.rmtree(dst, ignore_errors=True)
    return len(rels) / dt


def stat_all(root: Path, rels: list[str], threads: int) -> float:
    """Seconds to ``stat`` every file with ``threads`` threads."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda r: os.stat(root / r), rels))
    return time.perf_counter() - t0


def wait_status(m: Mounted, pred: Callable[[dict], bool], timeout: float, what: str, every: float = 0.02) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        s = m.status()
        if pred(s):
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout} s: {json.dumps(s)[:400]}")
        time.sleep(every)


def all_staged(s: dict) -> bool:
    p = s["prefetch"]
    return p["files_total"] > 0 and p["files_done"] >= p["files_total"] and s["staging"]["inflight"] == 0


@contextlib.contextmanager
def private_tmpfs(parent: Path, size: str) -> Iterator[Path]:
    """A tmpfs of its own for the rows with 10^5 small files: building and deleting them on this machine's disk
    (ext4 with discard) takes minutes, and unmounting a tmpfs frees them at once."""
    d = Path(tempfile.mkdtemp(prefix="tmpfs-", dir=parent))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(d)], check=True)
    try:
        yield d
    finally:
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
        d.rmdir()


@contextlib.contextmanager
def fresh(work: Path, name: str) -> Iterator[tuple[Path, Path]]:
    """A fresh (mountpoint, cache) pair under ``work``, removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    (base / "mnt").mkdir()
    try:
        yield base / "mnt", base / "cache"
    finally:
        shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------------------------- the rows


def bench_cached(work: Path, net: Path, local: Path, rels: list[str], reps: int) -> dict:
    """Network, local, local, network (the second mount of a pair ran ~10 % faster, whichever it was): the best
    of each backing's runs counts."""
    out: dict = {}
    order = [("tierfs over network", net), ("tierfs over local", local)]
    for label, backing in order + order[::-1]:
        with fresh(work, "cached") as (mnt, cache), mounted(backing, mnt, cache, "2G", nm=1, rf=100000,
                                                            timeout=120) as m:
            wait_status(m, all_staged, 300, "staging")
            paths = [str(mnt / r) for r in rels]
            read_all(paths, 4)  # warm: page cache, dentries, fingerprints confirmed
            best = {f"{t} readers": max(read_all(paths, t) for _ in range(reps)) for t in (1, 4)}
            if label in out:
                out[label].update({k: max(v, out[label][k]) for k, v in best.items()})
                continue
            out[label] = best
            s0 = m.status()
            time.sleep(10)  # idle: what the background revalidation costs the backing
            s1 = m.status()
            out[label]["backing_requests"] = s1["backing"]["requests"]
            out[label]["revalidate"] = s1["revalidate"]
            out[label]["idle_revalidations_per_s"] = (s1["revalidate"]["checked"] - s0["revalidate"]["checked"]) / 10
            out[label]["idle_backing_requests_per_s"] = (s1["backing"]["requests"] - s0["backing"]["requests"]) / 10
    paths = [str(net / r) for r in rels]
    read_all(paths, 4)
    out["sshfs, no tierfs"] = {f"{t} readers": max(read_all(paths, t) for _ in range(reps)) for t in (1, 4)}
    paths = [str(local / r) for r in rels]
    read_all(paths, 4)
    out["local files, no tierfs"] = {f"{t} readers": max(read_all(paths, t) for _ in range(reps)) for t in (1, 4)}
    return out


def bench_uncached(work: Path, net: Path, rels: list[str]) -> dict:
    out: dict = {}
    for t in (1, 4):
        with fresh(work, "uncached") as (mnt, cache), mounted(net, mnt, cache, "2G", policy="lru", view="full",
                                                              timeout=120) as m:
            drop_caches(3)
            out[f"{t} readers"] = read_all([str(mnt / r) for r in rels], t)
            out[f"{t} readers misses"] = m.status()["reads"]["misses"]
    return out


def bench_staging(work: Path, net: Path, local: Path, rels: list[str], streams: list[str]) -> dict:
    """Stage every file (``nm=1``, all fits) with each ``staging_streams`` setting, then copy the same files with
    1, 4, 16 and 64 threads.  ``files_per_s``: from the mount answering (the scan is the mount row's) until all
    are staged; ``with_start_files_per_s``: from starting ``tierfs mount``."""
    out: dict = {}
    copies = (1, 4, 16, 64)
    for label, backing in (("network", net), ("local", local)):
        for setting in streams:
            drop_caches(3)
            with fresh(work, "staging") as (mnt, cache):
                t0 = time.perf_counter()
                with mounted(backing, mnt, cache, "2G", nm=1, rf=100000, timeout=120,
                             staging_streams=setting) as m:
                    t_up = time.perf_counter()
                    s = wait_status(m, all_staged, 600, "staging", every=0.1)
                    t_end = time.perf_counter()
            out[f"tierfs {label} {setting}"] = {
                "files_per_s": len(rels) / (t_end - t_up), "with_start_files_per_s": len(rels) / (t_end - t0),
                "seconds": t_end - t_up, "start_seconds": t_up - t0,
                "status_files_per_s": s["staging"]["files_per_s"], "streams": s["staging"]["streams"]}
        for t in copies:
            drop_caches(3)
            out[f"copy {label} {t} threads"] = copy_all(backing, rels, work / "copy-dst", t)
    return out


def bench_staging_vs_old(work: Path, local: Path, n: int, old_src: Path, rounds: int = 3) -> dict:
    """Staging over the local backing, this tierfs vs the one whose source tree is ``old_src`` (run with
    ``PYTHONPATH``; it may predate ``staging_streams`` and today's status, so both are timed by the copies that
    appear in ``CACHE/data``), alternating, ``rounds`` each: files/s from the mount answering."""
    out: dict = {"old_src": str(old_src)}
    for _ in range(rounds):
        for label, env in (("old", {"PYTHONPATH": str(old_src)}), ("new", {})):
            drop_caches(3)
            with fresh(work, "staging-old") as (mnt, cache), mounted(local, mnt, cache, "2G", nm=1, rf=100000,
                                                                    env=env, timeout=120):
                t_up = time.perf_counter()
                data = cache / "data"
                while sum(1 for x in os.listdir(data) if not x.startswith(".tmp")) < n:
                    time.sleep(0.01)
                out.setdefault(label, []).append(n / (time.perf_counter() - t_up))
    return out


def bench_mount(work: Path, net: Path, local: Path, rels: list[str]) -> dict:
    out: dict = {}
    for label, backing in (("network", net), ("local", local)):
        drop_caches(3)
        with fresh(work, "mount") as (mnt, cache):
            t0 = time.perf_counter()
            with mounted(backing, mnt, cache, "64M", nm=16, timeout=600) as m:
                dt = time.perf_counter() - t0
                out[f"tierfs {label}"] = {"seconds": dt, "tree": m.status().get("tree")}
        drop_caches(3)
        out[f"stat16 {label}"] = stat_all(backing, rels, 16)
        drop_caches(3)
        t0 = time.perf_counter()
        sum(len(f) for _, _, f in os.walk(backing))
        out[f"list {label}"] = time.perf_counter() - t0
    return out


def bench_remount(work: Path, tree: Path, files: int) -> dict:
    out: dict = {"files": files}
    cap = (64 << 20) + files * 4096 * 5 // 32  # a mini-epoch (nm=16) well inside half the cache
    with fresh(work, "remount") as (mnt, cache):
        drop_caches(3)
        t0 = time.perf_counter()
        with mounted(tree, mnt, cache, cap, nm=16, timeout=900) as m:
            out["first mount seconds"] = time.perf_counter() - t0
            out["first tree"] = m.status().get("tree")
            # the scanned tree is saved in the background: a remount before that scans again
            t1 = time.perf_counter()
            while not (cache / "tree.bin").exists() and time.perf_counter() - t1 < 120:
                time.sleep(0.1)
            out["tree saved after s"] = time.perf_counter() - t1
            # an unchanged cache holding what a mount keeps: the current and the next mini-epoch, staged
            s = wait_status(m, lambda s: s["next_ready"] and s["staging"]["queued"] == 0
                            and s["staging"]["inflight"] == 0, 900, "staging", every=0.5)
            out["copies kept"] = s["cache_files"]
        drop_caches(3)
        t0 = time.perf_counter()
        with mounted(tree, mnt, cache, cap, nm=16, timeout=900) as m:
            out["remount seconds"] = time.perf_counter() - t0
            out["remount tree"] = m.status().get("tree")
    return out


def _pass(m: Mounted) -> dict:
    """List the view (the root listing starts a pass) and read every file once, 1 reader, while a monitor
    samples ``staging.files_staged`` every 0.2 s.  Returns the whole pass's files/s and the files/s over the
    part of it during which staging made progress (from the pass's start to the last sample that saw a file
    staged), with the files staged meanwhile."""
    samples: list[tuple[float, int]] = []
    done = threading.Event()

    def monitor() -> None:
        while not done.is_set():
            samples.append((time.perf_counter(), m.status()["staging"]["files_staged"]))
            done.wait(0.2)

    mon = threading.Thread(target=monitor)
    mon.start()
    t0 = time.perf_counter()
    paths = [os.path.join(d, f) for d, _, fs in os.walk(m.mountpoint) for f in fs]
    t_listed = time.perf_counter()
    ends = []
    buf = bytearray(_BUF)
    try:
        for p in paths:
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
            ends.append(time.perf_counter())
    finally:
        done.set()
        mon.join()
    t1 = time.perf_counter()
    staged = [t for (t, n), (_, n0) in zip(samples[1:], samples, strict=False) if n > n0 and t <= t1]
    out = {"files": len(paths), "files_per_s": len(paths) / (t1 - t0), "list_s": t_listed - t0,
           "read_files_per_s": len(paths) / (t1 - t_listed),
           "staged_during": samples[-1][1] - samples[0][1] if samples else 0}
    if staged and staged[-1] - t_listed > 1.0:  # reads (after the listing) overlapped staging for over 1 s
        t_end = staged[-1]
        out["staging_window_s"] = t_end - t0
        out["read_files_per_s_while_staging"] = sum(1 for e in ends if e <= t_end) / (t_end - t_listed)
    return out


def bench_pass(work: Path, tree: Path, files: int, rounds: int, nm: int) -> dict:
    """Idle passes (the next mini-epoch already staged) and passes right after ``advance`` (the next one
    staging), alternating, each a first read of its mini-epoch."""
    per_me = files // nm
    cap = int(per_me * 4096 * 2.3) + (16 << 20)  # two mini-epochs of 4 KiB blocks, a little room
    rows: list[dict] = []
    with fresh(work, "pass") as (mnt, cache), mounted(tree, mnt, cache, cap, nm=nm, rf=100000, timeout=300) as m:
        ready = lambda s: s["next_ready"] and s["staging"]["inflight"] == 0 and s["staging"]["queued"] == 0  # noqa: E731

        def where(s: dict) -> tuple[int, int]:
            return s["epoch"], s["mini_epoch"]

        def advance() -> None:
            me = where(m.status())
            m.control("advance\n")
            wait_status(m, lambda s: where(s) != me, 300, "advance")

        for r in range(rounds):
            wait_status(m, ready, 600, "next mini-epoch staged")
            rows.append({"kind": "idle", **_pass(m)})
            advance()  # the staged next one becomes current; the one after it starts staging
            rows.append({"kind": "staging", **_pass(m)})
            if r + 1 < rounds:  # the next idle pass must meet a new mini-epoch, first read, next one staged
                wait_status(m, ready, 600, "next mini-epoch staged")
                advance()
    return {"rows": rows, "capacity": cap, "nm": nm}


# --------------------------------------------------------------------------------------------- report


def table(res: dict) -> tuple[str, list[tuple[str, float, float, bool]]]:
    """Markdown table and the target rows (label, ratio, target, met)."""
    lines = ["| row | figure | baseline | ratio |", "|---|---:|---:|---:|"]
    targets: list[tuple[str, float, float, bool]] = []

    def row(label: str, v: float, base: float, unit: str, target: float | None = None,
            lower_better: bool = False) -> None:
        ratio = v / base if base else float("nan")
        if lower_better:
            ratio = base / v if v else float("nan")
        met = ""
        if target is not None:
            ok = ratio >= target
            targets.append((label, ratio, target, ok))
            met = f" (target ≥ {target:g}: {'met' if ok else 'NOT met'})"
        lines.append(f"| {label} | {v:,.1f} {unit} | {base:,.1f} {unit} | {ratio:.2f}×{met} |")

    if "cached" in res:
        c = res["cached"]
        for t in (1, 4):
            k = f"{t} readers"
            row(f"cached opens, {k}: tierfs/network vs tierfs/local", c["tierfs over network"][k],
                c["tierfs over local"][k], "files/s", 0.9)
            row(f"cached opens, {k}: tierfs/network vs sshfs direct", c["tierfs over network"][k],
                c["sshfs, no tierfs"][k], "files/s")
            row(f"cached opens, {k}: tierfs/local vs local files", c["tierfs over local"][k],
                c["local files, no tierfs"][k], "files/s")
    if "uncached" in res:
        u = res["uncached"]
        row("uncached opens over network: 4 vs 1 readers", u["4 readers"], u["1 readers"], "files/s", 3.0)
    if "staging" in res:
        s = res["staging"]
        threads = sorted(int(k.split()[2]) for k in s if k.startswith("copy network "))
        settings = [k.split()[2] for k in s if k.startswith("tierfs network ")]
        for label in ("network", "local"):
            best = max(s[f"copy {label} {t} threads"] for t in threads)
            for i, setting in enumerate(settings):
                r = s[f"tierfs {label} {setting}"]
                tgt = 0.9 if label == "network" and i == 0 else None
                row(f"staging over {label}, streams {setting} (settled at {r['streams']}) vs best parallel copy",
                    r["files_per_s"], best, "files/s", tgt)
                row("  … the same counted from starting the mount (start-up and scan included)",
                    r["with_start_files_per_s"], best, "files/s")
            for t in threads:
                lines.append(f"|   … copy with {t} threads | {s[f'copy {label} {t} threads']:,.1f} files/s | | |")
        if "vs old" in s:
            old_, new_ = sorted(s["vs old"]["old"]), sorted(s["vs old"]["new"])
            row(f"staging over local, this tierfs vs {s['vs old']['old_src']} (median of {len(new_)}, alternating)",
                new_[len(new_) // 2], old_[len(old_) // 2], "files/s", 1.0)
    if "mount" in res:
        mt = res["mount"]
        for label in ("network", "local"):
            # target: mount <= 1.2 x stat16, i.e. stat16/mount >= 1/1.2
            row(f"mount over {label} vs 16-thread stat (s, ratio = stat/mount)", mt[f"tierfs {label}"]["seconds"],
                mt[f"stat16 {label}"], "s", 1 / 1.2 if label == "network" else None, lower_better=True)
    if "remount" in res:
        rm = res["remount"]
        lines.append(f"| remount of {rm['files']:,} x 512 B local tree | {rm['remount seconds']:.2f} s | first mount "
                     f"{rm['first mount seconds']:.2f} s | target ≤ 2 s: "
                     f"{'met' if rm['remount seconds'] <= 2 else 'NOT met'} |")
        targets.append(("remount ≤ 2 s (2 s / remount)", 2 / rm["remount seconds"], 1.0, rm["remount seconds"] <= 2))
    if "pass" in res:
        rows = res["pass"]["rows"]
        idle = sorted(r["files_per_s"] for r in rows if r["kind"] == "idle")
        busy = sorted(r["files_per_s"] for r in rows if r["kind"] == "staging")
        row("small-file pass (listing + reads) right after advance (next staging) vs staging idle (median)",
            busy[len(busy) // 2], idle[len(idle) // 2], "files/s", 0.8)
        ls_idle = sorted(r["list_s"] for r in rows if r["kind"] == "idle")
        ls_busy = sorted(r["list_s"] for r in rows if r["kind"] == "staging")
        row("  … its listing of the view, staging vs idle (s, ratio = idle/staging)", ls_busy[len(ls_busy) // 2],
            ls_idle[len(ls_idle) // 2], "s", lower_better=True)
        rd_idle = sorted(r["read_files_per_s"] for r in rows if r["kind"] == "idle")
        rd_busy = sorted(r.get("read_files_per_s_while_staging", r["read_files_per_s"])
                         for r in rows if r["kind"] == "staging")
        row("  … its reads while staging ran vs idle", rd_busy[len(rd_busy) // 2], rd_idle[len(rd_idle) // 2],
            "files/s")
    return "\n".join(lines), targets


def plot(res: dict, targets: list[tuple[str, float, float, bool]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.6 * len(targets) + 1.8))
    labels = [textwrap.fill(t[0], 48) for t in targets]
    ax.barh(labels, [t[1] for t in targets], color=["tab:green" if t[3] else "tab:red" for t in targets])
    for i, t in enumerate(targets):
        ax.plot([t[2], t[2]], [i - 0.4, i + 0.4], color="black", lw=2)
        ax.text(t[1], i, f" {t[1]:.2f}×", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ratio against its baseline (black tick: issue 19 target; green met, red not)", fontsize=9)
    ax.set_xlim(0, max(t[1] for t in targets) * 1.15)
    ax.tick_params(axis="y", labelsize=8)
    ax.set_title(f"tierfs over a network backing (os.stat RTT {res['rtt']['p50_ms']:.2f} ms), "
                 f"load {res['load_start']}–{res['load_end']} on {res['cpus']} cores", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/netbench"))
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/tierfs-netbench"))
    ap.add_argument("--delay-ms", type=float, default=0.25, help="one-way delay of the link (0.25)")
    ap.add_argument("--files", type=int, default=2000, help="files of 110 KiB (2000)")
    ap.add_argument("--tree-files", type=int, default=20000, help="files of 1 KiB for the mount row (20000)")
    ap.add_argument("--remount-files", type=int, default=200000, help="files of 512 B for the remount row")
    ap.add_argument("--pass-files", type=int, default=50000, help="files of 512 B for the pass row (50000)")
    ap.add_argument("--pass-rounds", type=int, default=2)
    ap.add_argument("--pass-nm", type=int, default=4, help="mini-epochs of the pass row (4: with 2, current and "
                    "next are the whole set, so nothing is left to stage after the first epoch)")
    ap.add_argument("--reps", type=int, default=2, help="repeats of each cached-open figure (best kept)")
    ap.add_argument("--rows", default="cached,uncached,staging,mount,remount,pass")
    ap.add_argument("--old-src", type=Path, help="with the staging row: also stage over the local backing with the "
                    "tierfs package found in this source dir (e.g. a worktree of an older commit's src/), alternating")
    ap.add_argument("--streams", default="auto", help="staging_streams settings of the staging row, the first "
                    "one against the target (e.g. auto,16,64)")
    args = ap.parse_args(argv)
    require_root()
    install_sigterm()
    rows = set(args.rows.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))
    res: dict = {"command": " ".join(sys.argv), "load_start": load(), "cpus": os.cpu_count(),
                 "kernel": os.uname().release, "delay_ms_each_way": args.delay_ms}
    try:
        src = work / "src"
        t0 = time.perf_counter()
        images = write_tree(src / "images", args.files, 110 * KiB, 20)
        tree = write_tree(src / "tree", args.tree_files, KiB, 100) if "mount" in rows else []
        print(f"made {len(images)} + {len(tree)} files in {time.perf_counter() - t0:.1f} s, load {load()}")
        with net_backing(src, args.delay_ms / 1e3, workdir=work) as nb:
            res["rtt"] = nb.rtt_stats()
            print(f"network backing: sshfs at {nb.root}, os.stat RTT {res['rtt']}, load {load()}")
            if "cached" in rows:
                res["cached"] = bench_cached(work, nb.root / "images", src / "images", images, args.reps)
                print("cached", json.dumps(res["cached"]), "load", load())
            if "uncached" in rows:
                res["uncached"] = bench_uncached(work, nb.root / "images", images)
                print("uncached", json.dumps(res["uncached"]), "load", load())
            if "staging" in rows:
                res["staging"] = bench_staging(work, nb.root / "images", src / "images", images,
                                               args.streams.split(","))
                if args.old_src:
                    res["staging"]["vs old"] = bench_staging_vs_old(work, src / "images", len(images), args.old_src)
                print("staging", json.dumps(res["staging"]), "load", load())
            if "mount" in rows:
                res["mount"] = bench_mount(work, nb.root / "tree", src / "tree", tree)
                print("mount", json.dumps(res["mount"]), "load", load())
            res["rtt_end"] = nb.rtt_stats()
        if "pass" in rows:
            with private_tmpfs(work, "2G") as fs:
                t0 = time.perf_counter()
                write_tree(fs / "pass", args.pass_files, 512, 100)
                print(f"made {args.pass_files} files in {time.perf_counter() - t0:.1f} s (tmpfs)")
                res["pass"] = bench_pass(fs, fs / "pass", args.pass_files, args.pass_rounds, args.pass_nm)
                print("pass", json.dumps(res["pass"]), "load", load())
        if "remount" in rows:
            with private_tmpfs(work, f"{max(2, args.remount_files * 6 // 1_000_000 + 1)}G") as fs:
                t0 = time.perf_counter()
                write_tree(fs / "big", args.remount_files, 512, 1000)
                print(f"made {args.remount_files} files in {time.perf_counter() - t0:.1f} s (tmpfs), load {load()}")
                res["remount"] = bench_remount(fs, fs / "big", args.remount_files)
                print("remount", json.dumps(res["remount"]), "load", load())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["load_end"] = load()
    md, targets = table(res)
    res["targets"] = [{"row": t[0], "ratio": t[1], "target": t[2], "met": t[3]} for t in targets]
    print(f"\nmachine: {os.cpu_count()} cores, kernel {res['kernel']}, load {res['load_start']} -> {res['load_end']}; "
          f"link {args.delay_ms} ms each way, os.stat RTT p50 {res['rtt']['p50_ms']:.2f} ms\n")
    print(md)
    (args.out / "netbench.json").write_text(json.dumps(res, indent=1))
    (args.out / "netbench.md").write_text(md + "\n")
    if targets:
        plot(res, targets, args.out / "netbench.png")
    print(f"wrote {args.out}/netbench.json, netbench.md, netbench.png")


if __name__ == "__main__":
    main()

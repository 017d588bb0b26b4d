"""tierfs side by side with what a user would pick instead, over a throttled network slow tier (issue 26).

The slow tier is sshfs from a network namespace (benchmarks/netbacking.py: a relay that delays each direction,
``tc tbf`` on the server's side of the veth).  On it, at equal work (``--reads`` file reads by ``--threads``
reader threads, the loader listing the mount again every pass as the README says), one after the other:

* ``direct``: the readers read the sshfs mount itself;
* ``rclone``: ``rclone mount`` of the sshfs dir with ``--vfs-cache-mode full`` under the same cap
  (``--vfs-cache-max-size``, ``--vfs-cache-poll-interval 1s --vfs-fast-fingerprint`` so it honours it);
* ``tierfs lru``, ``tierfs default`` (``--nm 6 --rf 4``, ``advance=ready``, ``rf_max`` 4: exactly 4 passes),
  ``tierfs rf_max=8`` (the same up to 8 passes: faster, at the accuracy cost docs/tuning.md states) and
  ``tierfs rf=auto``, each with a fresh cache dir of the same cap.

Per configuration: samples/s, the bytes the server sent over the link (its qdisc's counter, and that less
66 bytes of Ethernet/IP/TCP headers per packet: the payload), tierfs's ``backing_bytes_read``, the files seen of
the data set, the passes made per mini-epoch (tierfs), stall seconds, and the cache's peak against its cap
(tierfs: its status; rclone: its cache dir's blocks, sampled every 0.2 s).  The page cache is dropped before each.

Needs root, sshd, sshfs and rclone: ``--setup`` runs ``apt-get install -y openssh-server sshfs rclone`` first
(Debian's packages; never a test dependency).  ``python benchmarks/sidebyside.py --setup --files 3000 --reads
24000`` is the issue's size; the defaults are a short run.  Writes ``--out`` (JSON) and ``--plot`` (PNG).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from netbacking import NetBacking, net_backing  # noqa: E402
from tierfs.testing.harness import force_unmount, is_mounted, mounted  # noqa: E402

HEADERS = 66  # Ethernet 14 + IPv4 20 + TCP 32 (timestamps): bytes per packet that are not the stream's

TIERFS = {
    "tierfs lru": dict(policy="lru"),
    "tierfs default": dict(nm=6, rf=4),  # (rf_max 4: exactly rf 4, the most the accuracy study measured free)
    "tierfs rf_max=8": dict(nm=6, rf=4, rf_max=8),  # the old default: up to 8 passes, -3.1 P@1 points there
    "tierfs rf=auto": dict(nm=6, rf="auto"),
}
CONFIGS = ["direct", "rclone", *TIERFS]


def make_data(root: Path, files: int, seed: int = 0) -> int:
    """``files`` files of 64-256 KiB in 10 class folders; their bytes."""
    rng = random.Random(seed)
    total = 0
    for i in range(files):
        d = root / f"class_{i % 10:02d}"
        d.mkdir(parents=True, exist_ok=True)
        size = rng.randint(64 << 10, 256 << 10)
        (d / f"img_{i:06d}.bin").write_bytes(rng.randbytes(size))
        total += size
    return total


def drop_caches() -> None:
    os.sync()
    with contextlib.suppress(OSError), open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def disk_bytes(path: Path) -> int:
    total = 0
    for d, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(d, n)).st_blocks * 512
    return total


@contextlib.contextmanager
def slow_tier(files: int, rate: str, delay_ms: float, cap_fraction: float,
              prefix: str) -> Iterator[tuple[Path, NetBacking, int, int]]:
    """``files`` files (:func:`make_data`) in a temp dir, served as the throttled network slow tier (``rate``, each
    direction delayed ``delay_ms``); yields (the temp dir, the backing, the data's bytes, the cache cap:
    ``cap_fraction`` of the data's blocks on the cache disk -- what a cap counts -- and 1 % over, so an ``nm`` of
    1/``cap_fraction`` fits).  At exit every mount left at ``mnt-*`` in the temp dir goes, then the dir."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        data = work / "data"
        total = make_data(data, files)
        cap = int(disk_bytes(data) * cap_fraction * 1.01)
        with net_backing(data, delay_ms / 1e3, rate=rate, workdir=work) as nb:
            yield work, nb, total, cap
    finally:
        for mnt in work.glob("mnt-*"):
            if is_mounted(str(mnt)):
                force_unmount(str(mnt))
        shutil.rmtree(work, ignore_errors=True)


def loader(root: Path, reads: int, threads: int) -> tuple[float, set[str]]:
    """Read ``reads`` files: list the mount, read every file listed in a shuffled order with ``threads``
    threads, list again; (seconds, the files seen)."""
    seen: set[str] = set()
    done = 0
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        passes = 0
        while done < reads:
            listed = sorted(os.path.relpath(os.path.join(d, n), root) for d, ds, ns in os.walk(root)
                            for n in ns if not d.startswith(str(root / ".tierfs")))
            random.Random(passes).shuffle(listed)
            batch = listed[: reads - done]
            for _ in pool.map(lambda rel: Path(root, rel).read_bytes(), batch):
                pass
            seen.update(batch)
            done += len(batch)
            passes += 1
    return time.monotonic() - t0, seen


@contextlib.contextmanager
def peak_sampler(measure: Callable[[], int]) -> Iterator[list[int]]:
    """The largest of ``measure()`` every 0.2 s while the block runs (``[peak]``)."""
    peak = [0]
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.2):
            with contextlib.suppress(Exception):
                peak[0] = max(peak[0], measure())

    th = threading.Thread(target=run, daemon=True)
    th.start()
    try:
        yield peak
    finally:
        stop.set()
        th.join()
        with contextlib.suppress(Exception):
            peak[0] = max(peak[0], measure())


@contextlib.contextmanager
def rclone_mount(source: Path, mnt: Path, cache: Path, cap: int) -> Iterator[None]:
    cmd = ["rclone", "mount", str(source), str(mnt), "--vfs-cache-mode", "full", "--vfs-cache-max-size",
           f"{cap}B", "--cache-dir", str(cache), "--vfs-cache-poll-interval", "1s", "--vfs-fast-fingerprint",
           "--config", "/dev/null"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not is_mounted(str(mnt)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rclone did not mount: {proc.stderr.read().decode() if proc.stderr else ''}")
            time.sleep(0.05)
        yield
    finally:
        if is_mounted(str(mnt)):
            force_unmount(str(mnt))
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def run_one(name: str, nb, work: Path, cap: int, reads: int, threads: int, n_files: int) -> dict:
    mnt, cache = work / f"mnt-{name.replace(' ', '_')}", work / f"cache-{name.replace(' ', '_')}"
    mnt.mkdir()
    drop_caches()
    wire0, pkts0 = nb.wire()
    row: dict = {"config": name}
    if name == "direct":
        secs, seen = loader(nb.root, reads, threads)
    elif name == "rclone":
        cache.mkdir()
        with rclone_mount(nb.root, mnt, cache, cap), peak_sampler(lambda: disk_bytes(cache / "vfs")) as peak:
            secs, seen = loader(mnt, reads, threads)
        row["cache_peak"] = peak[0]
    else:
        # (this checkout's tierfs, whatever the environment's install points at)
        with mounted(nb.root, mnt, cache, str(cap), timeout=600, env={"PYTHONPATH": str(ROOT)},
                     **TIERFS[name]) as m:
            def status() -> dict:
                with open(m.path(".tierfs", "status")) as f:
                    return json.load(f)

            with peak_sampler(lambda: status()["cache_bytes"]) as peak:
                secs, seen = loader(mnt, reads, threads)
            st, (wire, pkts) = status(), nb.wire()  # (together: staging goes on until the unmount)
        row.update(cache_peak=peak[0], backing_bytes_read=st["backing_bytes_read"],
                   rf_effective=st["rf_effective"], stall_seconds=st["stall_seconds"], rf=st["rf"],
                   rf_wanted=st.get("rf_wanted"), slow_tier=st.get("slow_tier", {}).get("state"))
    if name in ("direct", "rclone"):
        wire, pkts = nb.wire()
    row.update(seconds=secs, samples_per_s=reads / secs, files_seen=len(seen), files=n_files,
               wire_bytes=wire - wire0, wire_payload=(wire - wire0) - HEADERS * (pkts - pkts0), cap=cap)
    return row


def table(rows: list[dict]) -> str:
    out = ["| configuration | samples/s | slow-tier MiB (wire payload) | backing_bytes_read MiB | files seen | "
           "rf used per mini-epoch | stall s | cache peak / cap |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bbr = r.get("backing_bytes_read")
        rf = r.get("rf_effective")
        rf_text = "-" if not rf or r["config"] == "tierfs lru" else str(rf[:-1] or rf)
        peak = "-" if "cache_peak" not in r else f"{r['cache_peak'] / r['cap']:.2f}"
        out.append(
            f"| {r['config']} | {r['samples_per_s']:,.0f} | {r['wire_payload'] / 2**20:,.0f} | "
            f"{'-' if bbr is None else f'{bbr / 2**20:,.0f}'} | {r['files_seen']:,} of {r['files']:,} | {rf_text} | "
            f"{r.get('stall_seconds', 0):.1f} | "
            f"{peak} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, label in zip(axes, ("samples_per_s", "wire_payload", "files_seen"),
                              ("samples/s", "slow-tier MiB on the wire", "files seen"), strict=True):
        vals = [r[key] / (2**20 if key == "wire_payload" else 1) for r in rows]
        ax.barh(names, vals, color=["#888", "#c66", "#69c", "#2a6", "#da3", "#63a"][: len(rows)])
        ax.set_xlabel(label)
        ax.invert_yaxis()
    axes[2].axvline(rows[0]["files"], color="k", lw=0.8, ls="--")
    fig.suptitle("equal work over a throttled sshfs slow tier (benchmarks/sidebyside.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=600)
    ap.add_argument("--reads", type=int, default=None, help="file reads per configuration (default: 8 epochs)")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--rate", default="400mbit", help="the link's rate (tc tbf)")
    ap.add_argument("--delay-ms", type=float, default=0.25, help="each direction's delay (RTT = 2x)")
    ap.add_argument("--cap-fraction", type=float, default=1 / 3, help="cache cap as a fraction of the data")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--setup", action="store_true", help="apt-get install openssh-server sshfs rclone first")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "sidebyside.json",
                    help="benchmarks/results/sidebyside.json: on purpose")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench-out" / "sidebyside.png",
                    help="docs/img/sidebyside.png: on purpose")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        ap.error("needs root (network namespace, tc, drop_caches)")
    if args.setup:
        subprocess.run(["apt-get", "install", "-y", "-q", "openssh-server", "sshfs", "rclone"], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    configs = args.configs.split(",")
    if "rclone" in configs and shutil.which("rclone") is None:
        ap.error("rclone not found: run with --setup (apt-get install rclone)")
    reads = args.reads or 8 * args.files
    with slow_tier(args.files, args.rate, args.delay_ms, args.cap_fraction, "sidebyside-") as (work, nb, total, cap):
        print(f"{args.files} files, {total / 2**20:.0f} MiB, cap {cap / 2**20:.0f} MiB, {reads} reads, "
              f"{args.threads} threads, link {args.rate}, RTT {nb.rtt() * 1e3:.2f} ms", flush=True)
        rows = []
        for name in configs:
            row = run_one(name, nb, work, cap, reads, args.threads, args.files)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(table(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"files": args.files, "bytes": total, "cap": cap, "reads": reads,
                                    "threads": args.threads, "rate": args.rate, "delay_ms": args.delay_ms,
                                    "rows": rows}, indent=1) + "\n")
    plot(rows, args.plot)

if __name__ == "__main__":
    main()

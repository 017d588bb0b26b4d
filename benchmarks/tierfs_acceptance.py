"""The tierfs correctness run of issue 3: a loader-like reader over a mount with a cache of 1/4 of the data.

2,000 files in 20 class dirs, cache = 1/4 of the data, nm = 9, rf = 4. (Issue 3 asked for nm = 8; since the cap
counts the copies' disk blocks, 8 mini-epochs of these ~31 KiB files -- 6 % bigger on a 4 KiB-block disk -- no
longer fit in half of a quarter of the data, and the mount refuses nm = 8 with that reason.) The reader re-lists the
root and reads every listed file, rf x nm times (one epoch's worth of passes), and checks every file's xxh3 against
the backing copy. Meanwhile a sampler thread reads ``status`` every 50 ms and sums the bytes under ``CACHE/data``
(temp files included).  Printed and written to ``OUT/tierfs_acceptance.md`` (and ``.png``):

* bad reads (must be 0) and files read;
* backing bytes read, per epoch's worth of mini-epochs visited (the figure should be about one data set);
* the largest cache size seen, both as tierfs accounts it and as found on disk (must stay <= capacity).

Usage: ``python benchmarks/tierfs_acceptance.py [--out bench-out] [--files 2000] [--dirs 20]``.  Root or a user
allowed to mount FUSE; takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import xxhash

from tierfs.common.options import format_size
from tierfs.testing.harness import mounted


def make_data(root: Path, *, files: int, dirs: int, seed: int) -> dict[str, tuple[int, int]]:
    """``files`` files of 8..56 KiB spread over ``dirs`` dirs; returns {relpath: (size, xxh3)}."""
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(files):
        d = f"class_{i % dirs:02d}"
        (root / d).mkdir(parents=True, exist_ok=True)
        rel = f"{d}/sample_{i:05d}.bin"
        data = rng.integers(0, 256, int(rng.integers(8 << 10, 56 << 10)), dtype=np.uint8).tobytes()
        (root / rel).write_bytes(data)
        out[rel] = (len(data), xxhash.xxh3_64_intdigest(data))
    return out


def cache_disk_bytes(data_dir: str) -> int:
    total = 0
    try:
        names = os.listdir(data_dir)
    except FileNotFoundError:
        return 0
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            total += os.stat(os.path.join(data_dir, name)).st_size
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--dirs", type=int, default=20)
    ap.add_argument("--nm", type=int, default=9)
    ap.add_argument("--rf", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bandwidth", default="0", help="cap on backing reads, e.g. 5M (a slow tier)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="tierfs-acceptance-") as tmp:
        tmpd = Path(tmp)
        backing, mnt, cache = tmpd / "backing", tmpd / "mnt", tmpd / "cache"
        mnt.mkdir()
        truth = make_data(backing, files=args.files, dirs=args.dirs, seed=args.seed)
        dataset = sum(s for s, _ in truth.values())
        capacity = dataset // 4
        samples: list[tuple[float, int, int]] = []  # (t, status cache_bytes, backing bytes read)
        disk: list[tuple[float, int]] = []  # (t, bytes under CACHE/data)
        stop = threading.Event()
        bad: list[str] = []
        reads = 0
        t0 = time.monotonic()
        with mounted(backing, mnt, cache, capacity, nm=args.nm, rf=args.rf, seed=args.seed,
                     bandwidth=args.bandwidth) as m:

            def sample_status() -> None:
                # through the mount: waits behind the reader's requests when the daemon is busy
                while not stop.is_set():
                    st = m.status()
                    samples.append((time.monotonic() - t0, st["cache_bytes"], st["backing_bytes_read"]))
                    stop.wait(0.05)

            def sample_disk() -> None:
                # the cache dir itself, independent of the daemon
                while not stop.is_set():
                    disk.append((time.monotonic() - t0, cache_disk_bytes(str(cache / "data"))))
                    stop.wait(0.05)

            threads = [threading.Thread(target=f, daemon=True) for f in (sample_status, sample_disk)]
            for th in threads:
                th.start()
            last_listing: set[str] = set()
            try:
                for _ in range(args.rf * args.nm):
                    last_listing = set()
                    for d in sorted(os.listdir(mnt)):
                        for name in os.listdir(mnt / d):
                            rel = f"{d}/{name}"
                            last_listing.add(rel)
                            with open(mnt / rel, "rb") as f:
                                data = f.read()
                            reads += 1
                            if (len(data), xxhash.xxh3_64_intdigest(data)) != truth[rel]:
                                bad.append(rel)
            finally:
                stop.set()
                for th in threads:
                    th.join()
            # Freeze staging (a 1 byte/s cap stops new chunks) so the figures and the cache listing agree.
            m.control("bandwidth=1\n")
            time.sleep(0.5)
            final = m.status()
            # Copies staged for the next epoch that the last mini-epoch read did not use: read ahead, not this
            # epoch's reading.  Cache names start with the xxh3 of the path they copy.
            by_hash = {f"{xxhash.xxh3_64_intdigest(rel.encode()):016x}": rel for rel in truth}
            cached = {by_hash[n.split("-")[0]] for n in os.listdir(cache / "data") if n.split("-")[0] in by_hash}
            ahead = sum(truth[rel][0] for rel in cached - last_listing)
        elapsed = time.monotonic() - t0

    visited = len(final["rf_effective"]) - 1 + (final["pass"] > 0)  # mini-epochs entered (the last one counts
    epochs = visited / args.nm                                       # only once a pass of it was made)
    per_epoch = final["backing_bytes_read"] / max(epochs, 1e-9)
    max_status = max(s[1] for s in samples)
    max_disk = max(d[1] for d in disk)

    def gap(ts: list[float]) -> float:
        return max(b - a for a, b in itertools.pairwise(ts)) * 1000  # ms

    rows = [
        ("files / dirs / data set", f"{args.files} / {args.dirs} / {format_size(dataset)} ({dataset} B)"),
        ("capacity (1/4), nm, rf, bandwidth", f"{format_size(capacity)} ({capacity} B), {args.nm}, {args.rf}, "
                                              f"{args.bandwidth}"),
        ("passes made, files read", f"{args.rf * args.nm}, {reads}"),
        ("bad reads", f"{len(bad)}"),
        ("mini-epochs visited (rf_effective)", f"{visited} {final['rf_effective']}"),
        ("backing bytes read", f"{final['backing_bytes_read']} B = {final['backing_bytes_read'] / dataset:.3f} x data"),
        ("backing bytes per epoch of passes", f"{per_epoch / dataset:.3f} x data set"),
        ("cached for the next epoch at the end", f"{ahead} B = {ahead / dataset:.3f} x data (read ahead, or kept)"),
        ("max cache, status (every 50 ms)", f"{max_status} B = {max_status / capacity:.3f} x capacity"),
        ("max cache, on disk (every 50 ms)", f"{max_disk} B = {max_disk / capacity:.3f} x capacity"),
        ("samples: status / disk", f"{len(samples)} / {len(disk)} (largest gap {gap([x[0] for x in samples]):.0f}"
                                   f" / {gap([x[0] for x in disk]):.0f} ms)"),
        ("reads hits / misses / out of view",
         f"{final['reads']['hits']} / {final['reads']['misses']} / {final['reads']['out_of_view']}"),
        ("stall seconds", f"{final['stall_seconds']:.2f}"),
        ("elapsed", f"{elapsed:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"| {k:<{width}} | {v} |" for k, v in rows)
    header = f"| {'figure':<{width}} | value |\n|{'-' * (width + 2)}|-------|"
    machine = f"{platform.node()}: {os.cpu_count()} cores, Python {platform.python_version()}"
    command = " ".join(["python", f"benchmarks/{Path(__file__).name}", *sys.argv[1:]])
    text = f"{header}\n{table}\n\nCommand: `{command}`; machine: {machine}\n"
    print(text)
    (out / "tierfs_acceptance.md").write_text(text)
    (out / "tierfs_acceptance.json").write_text(json.dumps({"rows": rows, "status": samples, "disk": disk}))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ts = [s[0] for s in samples]
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot([d[0] for d in disk], [d[1] / 2**20 for d in disk], label="cache on disk (MiB)")
        ax.plot(ts, [s[1] / 2**20 for s in samples], label="cache, tierfs status (MiB)", alpha=0.7)
        ax.plot(ts, [s[2] / dataset for s in samples], label="backing read (x data set)")
        ax.axhline(capacity / 2**20, color="red", linestyle="--", label="capacity (MiB)")
        ax.set_xlabel("seconds")
        ax.set_title(f"tierfs acceptance: {args.files} files, cache 1/4, nm={args.nm}, rf={args.rf}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "tierfs_acceptance.png", dpi=100)
    except ImportError:
        print("(matplotlib not installed: no plot)", file=sys.stderr)
    ok = not bad and max_disk <= capacity and max_status <= capacity
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

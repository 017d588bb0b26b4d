"""Where a pass over small files spends its FUSE requests: every request that reaches the daemon, by kind, per file.

    python benchmarks/fuse_requests.py [--files 1000] [--size 110K] [-o KEY=VALUE ...]

The daemon runs with every ``TierOperations`` handler wrapped by a counter (this program is its wrapper:
``tierfs.testing.harness.mounted(wrapper=...)``); SIGUSR1 makes it write the counts.  Under ``policy=met`` (nm=2, the
first mini-epoch staged and pushed) a loader reads the order file and opens every file of the view with
``open()``, twice: the first pass (the copies staged, their pages pushed) and a repeated pass; then the same
pass through a batch plan.  Prints requests per file for each pass, and files/s beside it (one reader).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

HANDLERS = ("lookup", "getattr", "open", "read", "release", "flush", "opendir", "readdir", "releasedir",
            "getxattr", "access", "statfs", "forget", "readlink", "listxattr")


def _daemon(argv: list[str]) -> None:
    """Run ``python -m tierfs ...`` (argv after this program's name) with counted handlers."""
    import tierfs.daemon.fuse.operations as fs
    from tierfs.cli.commands import main

    counts: Counter[str] = Counter()
    out = os.environ["TIERFS_REQUEST_COUNTS"]

    def counted(name: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return await fn(*args, **kwargs)

        return wrapper

    for name in HANDLERS:
        fn = getattr(fs.TierOperations, name, None)
        if fn is not None:
            setattr(fs.TierOperations, name, counted(name, fn))

    def dump(*_: object) -> None:
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(counts), f)
        os.replace(tmp, out)

    signal.signal(signal.SIGUSR1, dump)
    assert argv[1:3] == ["-m", "tierfs"], argv  # (the interpreter, -m tierfs, then tierfs's arguments)
    sys.exit(main(argv[3:]))


def _counts(proc: subprocess.Popen[bytes], path: str) -> Counter[str]:
    before = os.path.getmtime(path) if os.path.exists(path) else 0.0
    os.kill(proc.pid, signal.SIGUSR1)
    from tierfs.testing.harness import wait_until

    wait_until(lambda: os.path.exists(path) and os.path.getmtime(path) != before, what="the counts")
    time.sleep(0.05)
    with open(path) as f:
        return Counter(json.load(f))


def main(argv: list[str] | None = None) -> None:
    from slowtier import KiB, Workload, parse_size
    from tierfs.client import Client
    from tierfs.testing.harness import mounted, wait_until

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--size", type=parse_size, default=110 * KiB)
    ap.add_argument("-o", "--option", action="append", default=[], help="extra mount option KEY=VALUE")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tierfs-requests-", dir="/var/tmp") as base:
        backing, mnt, cache = Path(base, "backing"), Path(base, "mnt"), Path(base, "cache")
        mnt.mkdir()
        w = Workload("small", args.files * 2, args.size, classes=50, jitter=0.2)
        w.populate(backing)
        counts_path = os.path.join(base, "counts.json")
        opts = {"nm": 2, "rf": 100, **dict(o.split("=", 1) for o in args.option)}
        with mounted(backing, mnt, cache, int(w.total_bytes * 1.3) + (64 << 20), timeout=120,
                     env={"TIERFS_REQUEST_COUNTS": counts_path},
                     wrapper=(sys.executable, os.path.abspath(__file__), "--daemon"), **opts) as m:
            wait_until(lambda: m.status()["next_ready"], timeout=300, what="staging")
            time.sleep(2)  # let the pusher finish
            client = Client(mnt)
            rows = []

            def by_open(name: str) -> None:
                c0 = _counts(m.process, counts_path)
                t0 = time.perf_counter()
                order = [os.fsdecode(p) for p in client.order(nul=True)]
                for rel in order:
                    with open(mnt / rel, "rb") as f:
                        f.read()
                dt = time.perf_counter() - t0
                rows.append((name, len(order), dt, _counts(m.process, counts_path) - c0))

            def by_plan(name: str) -> None:
                c0 = _counts(m.process, counts_path)
                t0 = time.perf_counter()
                plan = client.plan()
                done = []
                for i, f in enumerate(plan["files"]):
                    with open(f["copy"] or mnt / f["path"], "rb") as fh:
                        fh.read()
                    if f["copy"]:
                        done.append(i)
                client.consumed(plan["plan"], done)
                dt = time.perf_counter() - t0
                rows.append((name, len(plan["files"]), dt, _counts(m.process, counts_path) - c0))

            def control_files(name: str, n: int = 200) -> None:
                # what a plan loader adds: status reads and consumed reports (control writes), and probes of
                # names that do not exist (``tierfs.loaders.tierfs_mount`` looks for .tierfs/status upwards)
                c0 = _counts(m.process, counts_path)
                t0 = time.perf_counter()
                sub = next(p for p in mnt.iterdir() if p.is_dir())
                for _ in range(n):
                    client.status()
                    client.write("rf=100", check=False)
                    (sub / ".tierfs" / "status").exists()
                dt = time.perf_counter() - t0
                rows.append((name, n, dt, _counts(m.process, counts_path) - c0))

            by_open("first pass (staged, pushed), open()")
            by_open("repeated pass, open()")
            by_open("repeated pass again, open()")
            by_plan("repeated pass, batch plan")
            control_files("status read + control write + missing-name probe (per round)")
        print(f"{args.files * 2} files of ~{args.size // 1024} KiB, view {rows[0][1]} files; load "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; options {opts}")
        kinds = [k for k in HANDLERS if any(r[3][k] for r in rows)]
        print("| pass | files/s (rounds/s) | requests/file | " + " | ".join(kinds) + " |")
        print("|---|---:|---:|" + "---:|" * len(kinds))
        for name, n, dt, c in rows:
            per = " | ".join(f"{c[k] / n:.2f}" for k in kinds)
            print(f"| {name} | {n / dt:,.0f} | {sum(c.values()) / n:.2f} | {per} |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--daemon"]:
        _daemon(sys.argv[2:])
    else:
        main()

"""How long does the request that ends a pass hold the trio thread at an epoch boundary of a big tree?

An engine resumes over a saved synthetic tree of ``--files`` files (``tierfs.testing.harness.synthetic_tree``: 1,000
directories of 4 KiB files, no file behind them) with ``nm=2, rf=1, advance=strict``, so every ``next-pass``
switches.  It writes ``next-pass`` ``--passes`` times, ``--gap`` seconds apart (a reader's pass), each the way
the FUSE write handler does (``Engine.control_write``, on the trio thread), while a heartbeat task measures the
longest time the trio thread did not answer (what every other reader of the mount would have waited).  If the
engine has a planner (issue 22) it runs as ``Engine.run`` starts it, and so does the journal writer (a mounted
engine hands the position to it: no fsync in the request); the rest of ``run`` does not (its rescan would find
none of the synthetic files).  Per request: its time, and the planning done inside it; then the
largest of them (what a reader's FUSE request waited at most across the boundaries, the longest stall besides)
and how many of the passes' views were made ahead (issue 25) or inside the request.

    .venv/bin/python benchmarks/epoch_boundary.py [--files 2000000] [--passes 5] [--gap 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import threading
import time

import trio

import tierfs.daemon.schedule.schedule
from tierfs.common.options import MountConfig, Settings
from tierfs.daemon.coordinator.engine import Engine
from tierfs.daemon.tree.keeper import TREE_NAME
from tierfs.testing.harness import make_dataset, synthetic_tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2_000_000)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--gap", type=float, default=3.0, help="seconds between two next-pass writes")
    args = parser.parse_args()

    planning: list[tuple[int, float]] = []  # (thread, seconds) of every plan_epoch call
    real = tierfs.daemon.schedule.schedule.plan_epoch

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return real(*a, **kw)
        finally:
            planning.append((threading.get_ident(), time.perf_counter() - t0))

    tierfs.daemon.schedule.schedule.plan_epoch = timed

    with tempfile.TemporaryDirectory(prefix="epoch-boundary-") as tmp:
        backing, cache = os.path.join(tmp, "backing"), os.path.join(tmp, "cache")
        make_dataset(backing, dirs=1, files_per_dir=2, max_size=10)  # (nm=2: at least two files)
        per_file = 4096
        cfg = MountConfig(backing=backing, mountpoint=os.path.join(tmp, "mnt"), cache=cache,
                          capacity=2 * (args.files * per_file // 2) + (1 << 30),
                          settings=Settings(nm=2, rf=1, advance="strict"))
        first = Engine(cfg)
        first.open()
        first.close()  # a cache dir of tierfs's own, with a journal at (0, 0, 0)
        t0 = time.perf_counter()
        synthetic_tree(backing, dirs=1000, per_dir=args.files // 1000, size=per_file).save(
            os.path.join(cache, TREE_NAME))
        made = time.perf_counter() - t0
        e = Engine(cfg)
        t0 = time.perf_counter()
        e.open()
        opened = time.perf_counter() - t0
        load = os.getloadavg()[0]
        rows: list[tuple[str, str, float, float]] = []
        stall = [0.0]

        async def heartbeat() -> None:
            last = trio.current_time()
            while True:
                await trio.sleep(0.001)
                now = trio.current_time()
                stall[0] = max(stall[0], now - last)
                last = now

        async def run() -> None:
            trio_thread = threading.get_ident()
            async with trio.open_nursery() as n:
                n.start_soon(heartbeat)
                if hasattr(e, "planner"):
                    e.schedule.plan_ahead(True)  # as Engine.run does
                    n.start_soon(e.planner.run)
                n.start_soon(e.journal.run, e.cache_limiter)  # (as Engine.run: positions go to the writer)
                await trio.sleep(args.gap)
                for _ in range(args.passes):
                    before = e.passes.current_mini_epoch
                    planning.clear()
                    t0 = time.perf_counter()
                    e.control_write(b"next-pass\n")
                    took = time.perf_counter() - t0
                    inline = sum(s for th, s in planning if th == trio_thread)
                    rows.append((f"{before}", f"{e.passes.current_mini_epoch}", took, inline))
                    await trio.sleep(args.gap)
                n.cancel_scope.cancel()
            e.journal.flush()

        trio.run(run)
        e.close()

    print(f"\n{args.files:,} files (tree made in {made:.1f} s, engine opened in {opened:.1f} s), nm=2, rf=1, "
          f"strict; {os.cpu_count()} cores, Python {platform.python_version()}, load average {load:.1f}; "
          f"planner: {'yes' if hasattr(e, 'planner') else 'no (plans made in the request)'}")
    print("| from | to | request s | planning inside it s |")
    print("|---|---|---:|---:|")
    for a, b, took, inline in rows:
        print(f"| {a} | {b} | {took:.3f} | {inline:.3f} |")
    print(f"largest request: {max(took for _, _, took, _ in rows):.3f} s; "
          f"longest time the trio thread did not answer: {stall[0]:.3f} s")
    sch = e.schedule.statistics()
    if hasattr(sch, "views_ahead"):  # (older commits make every view inside the request)
        print(f"views made ahead: {sch.views_ahead}, inside the request: {sch.views_inline}")


if __name__ == "__main__":
    main()

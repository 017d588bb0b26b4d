"""What an open of a cached file costs the daemon: opens/s and the daemon's CPU per open, under each Python given.

    python benchmarks/opens.py [--files 6000] [--size 16K] [--nm 1,6] [--think 0,1] [--readers 4]
                               [--python .venv/bin/python --python OTHER/bin/python] [--rounds 2]

A loader's share of the mount at its smallest: ``--readers`` processes open, read and close the current pass's
files (``tierfs.loaders.PassIndices`` over a ``listing=all`` mount, ``rf`` 4: the files of each pass split
between them), ``--think`` ms of CPU between opens in each (0: opens back to back, requests queue up; 1: about a
light decode, so requests mostly arrive one at a time, as from a ``DataLoader``).  The first mini-epoch is read
once untimed (staged as it mounted), then ``--passes`` passes are timed; at ``nm`` 1 nothing is staged while they
run, at ``nm`` > 1 the next mini-epochs are (a copy every ``rf`` opens).  The daemon's CPU is read from
``/proc/PID/stat`` (user and system apart); an open here is one OPEN and one RELEASE request, and a READ where the
kernel's page cache lacks the file.

Each ``--python`` runs the same measurement under that interpreter (its own pyfuse3 and trio; this checkout's
tierfs): e.g. a venv with stock pyfuse3 beside ``.venv`` (scripts/pyfuse3's build).  Interpreters alternate within
each round; a cell is the median of the rounds, and the last column the ratio to the first ``--python``'s CPU per
open.  Put ``--tmp`` on the file system a cache would use: the cache dir and the data set go there.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierfs.common.options import parse_size  # noqa: E402


def _make(data: Path, files: int, size: int) -> None:
    stamp = data.with_name(f"{data.name}.made-{files}-{size}")  # (beside it: a file in it would be in the data set)
    if stamp.exists():
        return
    shutil.rmtree(data, ignore_errors=True)
    for old in data.parent.glob(f"{data.name}.made-*"):
        old.unlink()
    for i in range(files):
        d = data / f"c{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:07d}.bin").write_bytes(os.urandom(size))
    stamp.touch()


def _reader(paths: list[str], think_s: float, out: multiprocessing.SimpleQueue) -> None:
    for p in paths:
        with open(p, "rb") as f:
            f.read()
        if think_s:
            end = time.thread_time() + think_s
            while time.thread_time() < end:
                pass
    out.put(len(paths))


def _passes(indices, paths: list[str], passes: int, readers: int, think_s: float) -> tuple[int, float]:
    """Open every file of ``passes`` passes; (opens, seconds)."""
    out: multiprocessing.SimpleQueue = multiprocessing.SimpleQueue()
    opens, seconds = 0, 0.0
    for _ in range(passes):
        chosen = [paths[i] for i in indices.next_pass()]
        t0 = time.perf_counter()
        procs = [multiprocessing.Process(target=_reader, args=(chosen[k::readers], think_s, out))
                 for k in range(readers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        seconds += time.perf_counter() - t0
        opens += sum(out.get() for _ in procs)
    return opens, seconds


def measure_one(args: argparse.Namespace) -> dict:
    """One mount under this interpreter: the figures of ``args.nm[0]``, ``args.think[0]``."""
    from importlib.metadata import version

    from tierfs.loaders import PassIndices
    from tierfs.testing.harness import mounted, process_cpu

    nm, think = args.nm[0], args.think[0]
    data = args.tmp / "data"
    work = Path(tempfile.mkdtemp(prefix="opens-", dir=args.tmp))
    try:
        (work / "mnt").mkdir()
        cap = args.files * args.size * (3 if nm == 1 else 1)  # (nm 1: the data set in half the cache)
        with mounted(data, work / "mnt", work / "cache", cap, timeout=120, nm=nm, rf=4, listing="all") as m:
            mnt = str(work / "mnt")
            paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(mnt) if ".tierfs" not in d for f in fs)
            indices = PassIndices(paths, rank=0, world_size=1)
            _passes(indices, paths, nm, args.readers, think / 1e3)  # the first mini-epoch, untimed
            u0, s0 = process_cpu(m.process.pid)
            opens, seconds = _passes(indices, paths, args.passes, args.readers, think / 1e3)
            u1, s1 = process_cpu(m.process.pid)
        return {"python": sys.executable, "pyfuse3": version("pyfuse3"), "nm": nm, "think_ms": think,
                "opens": opens, "opens_per_s": opens / seconds, "user_ms": 1e3 * (u1 - u0) / opens,
                "sys_ms": 1e3 * (s1 - s0) / opens}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(python: str, args: argparse.Namespace, nm: int, think: float) -> dict:
    cmd = [python, __file__, "--one", "--files", str(args.files), "--size", str(args.size), "--nm", str(nm),
           "--think", str(think), "--readers", str(args.readers), "--passes", str(args.passes), "--tmp", str(args.tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"{python}: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict], pythons: list[str]) -> str:
    lines = ["| pyfuse3 | python | nm | think ms | opens/s | daemon CPU ms/open (user / sys) | CPU ÷ first |",
             "|---|---|---:|---:|---:|---|---:|"]
    base: dict[tuple[int, float], float] = {}
    for py in pythons:
        for (nm, think) in sorted({(r["nm"], r["think_ms"]) for r in rows}):
            cell = [r for r in rows if r["python"] == py and r["nm"] == nm and r["think_ms"] == think]
            if not cell:
                continue
            rate = statistics.median(r["opens_per_s"] for r in cell)
            user = statistics.median(r["user_ms"] for r in cell)
            sys_ = statistics.median(r["sys_ms"] for r in cell)
            base.setdefault((nm, think), user + sys_)
            lines.append(f"| {cell[0]['pyfuse3']} | `{py}` | {nm} | {think:g} | {rate:,.0f} | "
                         f"**{user + sys_:.3f}** ({user:.3f} / {sys_:.3f}) | {(user + sys_) / base[(nm, think)]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=6000)
    ap.add_argument("--size", type=parse_size, default=16 << 10)
    ap.add_argument("--nm", type=lambda s: [int(x) for x in s.split(",")], default=[1, 6])
    ap.add_argument("--think", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 1.0],
                    help="ms of CPU between opens, comma-separated")
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--passes", type=int, default=16, help="timed passes")
    ap.add_argument("--python", action="append", default=None, help="an interpreter to run under (repeatable)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tmp", type=Path, default=Path("/var/tmp/tierfs-opens"))
    ap.add_argument("--out", type=Path, default=Path("bench-out/opens.json"))
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.tmp.mkdir(parents=True, exist_ok=True)
    if args.one:
        print(json.dumps(measure_one(args)))
        return 0
    pythons = args.python or [sys.executable]
    _make(args.tmp / "data", args.files, args.size)
    rows = []
    for rnd in range(args.rounds):
        for nm in args.nm:
            for think in args.think:
                for py in pythons:
                    row = _run(py, args, nm, think)
                    row["round"], row["load"] = rnd, os.getloadavg()[0]
                    rows.append(row)
                    print(f"round {rnd} nm {nm:2d} think {think:g} ms {row['pyfuse3']:>16}: "
                          f"{row['opens_per_s']:7.0f} opens/s, daemon {row['user_ms']:.3f} + {row['sys_ms']:.3f} ms "
                          f"CPU/open, load {row['load']:.1f}", flush=True)
    print(table(rows, pythons))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kernel passthrough for cached copies (issue 49), side by side in one run: native reads, the daemon's read path
(``passthrough=off``) and passthrough (``passthrough=auto``: files of 1 MiB or more; ``all``: every file), over
the same files.

The backing dir and the cache dirs sit on one local disk; each mount is MET with ``nm=1`` and a capacity above
the data, so every file is cached (staged) before anything is timed: this measures serving cached files.  For each
side, the page cache dropped before each "first" row:

* ``big first`` / ``big re-read``: one file of ``--big-size`` read with Python ``readinto`` of 1 MiB, then again
  at once; ``dd`` rows: the same with ``dd bs=1M``;
* ``small first`` / ``small warm``: ``--small-files`` files of ~110 KiB, each opened and read whole, after the
  drop and then at once again;
* every row is the best of ``--repeat`` runs (3), the page cache dropped before each "first" run, the same read
  made just before each warm one;
* ``CPU s/GiB``: the reader's user + system CPU (``dd``'s too; the kernel's work on a read is charged to the
  reader) plus the daemon's (``/proc/PID/stat``), per GiB read;
* ``page cache``: what ``Cached`` in ``/proc/meminfo`` grew by from the drop to after one read of every file,
  against the bytes read (1.0: one copy of each file; ~2: the copy's pages and the mount's own).

Native reads read the backing files (the same disk).  Ratios are the side's rate over native's in the same run.
Root only (FUSE, passthrough's CAP_SYS_ADMIN, drop_caches).  Prints a markdown table (also written to ``--out``).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from slowtier import GiB, KiB, MiB, drop_caches, parse_size, require_root
from tierfs.testing.harness import mounted, wait_until

CHUNK = MiB


def _cpu_self() -> float:
    """This process's CPU seconds and its children's (``dd``) so far."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def _cpu_pid(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cached_kb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Cached:"))


def read_whole(path: str) -> int:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while got := f.readinto(view):
            n += got
    return n


def timed(fn, daemon: int | None) -> tuple[float, float, int]:
    """(seconds, CPU seconds of this process and the daemon, bytes) of ``fn()``, which returns the bytes."""
    c0, d0, t0 = _cpu_self(), _cpu_pid(daemon), time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, _cpu_self() - c0 + _cpu_pid(daemon) - d0, n


def dd(path: str) -> int:
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=1M", "status=none"], check=True)
    return os.path.getsize(path)


def side(root: Path, big: str, small: list[str], repeat: int, daemon: int | None) -> dict[str, float]:
    """Every row for one side: each the best of ``repeat`` runs (the page cache dropped before each "first")."""
    out: dict[str, float] = {}

    def rate(name: str, fn, *, cold: bool, files: int = 0) -> None:
        best: tuple[float, float] | None = None
        for _ in range(repeat):
            if cold:
                drop_caches()
            else:
                fn()  # (warm: the same read just before)
            s, cpu, n = timed(fn, daemon)
            r = (files / s) if files else n / s / GiB
            if best is None or r > best[0]:
                best = (r, cpu / (n / GiB))
        assert best is not None
        out[name], out[name + " cpu"] = best

    rate("big first", lambda: read_whole(str(root / big)), cold=True)
    rate("big re-read", lambda: read_whole(str(root / big)), cold=False)
    rate("big first, dd", lambda: dd(str(root / big)), cold=True)
    rate("big re-read, dd", lambda: dd(str(root / big)), cold=False)
    rate("small first", lambda: sum(read_whole(str(root / p)) for p in small), cold=True, files=len(small))
    rate("small warm", lambda: sum(read_whole(str(root / p)) for p in small), cold=False, files=len(small))
    drop_caches()
    before = _cached_kb()
    read = sum(read_whole(str(root / p)) for p in [big, *small])  # (every file once)
    out["page cache"] = (_cached_kb() - before) * KiB / read
    return out


def make_data(backing: Path, big_size: int, n_small: int) -> tuple[str, list[str]]:
    backing.mkdir(parents=True, exist_ok=True)
    big = "big/big.bin"
    (backing / "big").mkdir(exist_ok=True)
    if not (backing / big).exists() or (backing / big).stat().st_size != big_size:
        block = os.urandom(MiB)
        with open(backing / big, "wb") as f:
            for _ in range(big_size // MiB):
                f.write(block)
    small = []
    for i in range(n_small):
        rel = f"small/d{i % 50:02d}/f{i:05d}.bin"
        small.append(rel)
        p = backing / rel
        if not p.exists():
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(os.urandom(110 * KiB + (i % 7) * 1000))
    return big, small


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big-size", type=parse_size, default=GiB)
    ap.add_argument("--small-files", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each row on each side (the best is shown)")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/tierfs-passthrough"))
    ap.add_argument("--out", type=Path, default=Path("bench-out/passthrough.md"))
    args = ap.parse_args(argv)
    require_root()
    backing = args.workdir / "backing"
    big, small = make_data(backing, args.big_size, args.small_files)
    total = sum(os.path.getsize(backing / p) for p in [big, *small])
    results = {"native": side(backing, big, small, args.repeat, None)}
    for mode in ("off", "auto", "all"):
        mnt, cache = args.workdir / "mnt", args.workdir / f"cache-{mode}"
        shutil.rmtree(cache, ignore_errors=True)
        mnt.mkdir(exist_ok=True)
        with mounted(backing, mnt, cache, 2 * total + GiB, nm=1, rf=1000, passthrough=mode, timeout=120) as m:
            wait_until(lambda: m.status()["next_ready"], timeout=1800, what="everything staged")
            results[f"passthrough={mode}"] = side(mnt, big, small, args.repeat, m.process.pid)
            state = m.status()["passthrough"]
        print(f"passthrough={mode}: status {state}", file=sys.stderr)
    rows = ["big first", "big re-read", "big first, dd", "big re-read, dd", "small first", "small warm"]
    lines = ["| | native | daemon (`passthrough=off`) | `passthrough=auto` | `passthrough=all` | auto / native | "
             "all / native |", "|---|---|---|---|---|---|---|"]
    native, sides = results["native"], [results[f"passthrough={m}"] for m in ("off", "auto", "all")]
    for r in rows:
        unit = "files/s" if r.startswith("small") else "GiB/s"
        cells = " | ".join(f"{x[r]:,.2f} ({x[r + ' cpu']:.2f})" for x in [native, *sides])
        lines.append(f"| {r} ({unit}; CPU s/GiB) | {cells} | **{sides[1][r] / native[r]:.2f}** | "
                     f"{sides[2][r] / native[r]:.2f} |")
    cells = " | ".join(f"{x['page cache']:.2f}" for x in [native, *sides])
    lines.append(f"| page cache after one read of every file, x bytes read | {cells} | | |")
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

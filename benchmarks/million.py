"""A million files in the time and memory promised (issue 22, 7): mount time, daemon memory, ``find``.

Builds (once, kept for later runs) ``--dirs`` x ``--files-per-dir`` files of ``--size`` bytes under ``--root``
(local disk), mounts it with ``view=full`` over a fresh cache, and measures:

* ``mount_s``     from starting the daemon until ``/.tierfs/status`` answers (the scan of a first mount);
* ``rss_mount``   the daemon's VmRSS then, in bytes per file (``/proc/PID/status``);
* ``find_ratio``  ``find MOUNT | wc -l`` against ``find BACKING | wc -l``, each run once to warm (the backing's
  dentries, the mount's kernel entries and, with pyfuse3 built by scripts/pyfuse3, its cached listings) and then
  timed: both warm, best of ``--repeat``, the mount's once the daemon is idle (both mini-epochs staged, the
  pushes the first ``find`` started done: the ``find`` against the backing's, not against staging for two
  cores); ``find_mount_first_s`` the warming one of the mount (every listing from the daemon, beside staging),
  ``listings`` status's (the READDIRs the daemon answered), ``daemon_cpu_finds_s`` the daemon's CPU seconds
  from the mount's first ``find`` to its last (staging and pushes included);
* ``rss_find``    VmRSS after those finds, bytes per file (``VmHWM``: the peak, scan included);
* ``tree_bin``    bytes per file of the saved tree in the cache dir (written after the scan);
* ``scan_peak``   the scan alone, in a fresh interpreter that imports what the daemon does (issue 48, 7: the scan
  sets the memory a node needs): ``scan_peak_B_per_file`` its own peak (VmHWM less VmRSS before it, per file),
  ``scan_process_peak_B_per_file`` the whole process's (the interpreter and its libraries included: what a cgroup
  is charged), ``scan_tree_B_per_file`` what stays once the scan's heap is trimmed, ``scan_base_MB`` the process
  before the scan.

Prints one JSON object (also written to ``--out``).  Root is required (FUSE); the mount is gone when it exits.
``--scan-only`` measures the scan alone (no root, no mount): ``--dirs 300`` is the 300,000-file run.

``--profile DIR`` runs the daemon through this program (``--daemon``: the product code untouched) and writes,
after the mount and after the finds, where its memory is: ``/proc/PID/smaps_rollup`` (anonymous against
file-backed), glibc's ``mallinfo2`` (bytes in use against bytes the heap holds: fragmentation), Python objects
by type, and with ``--tracemalloc`` the largest allocations by line (numpy arrays included; tracing costs
memory of its own, so the RSS figures of a traced run are not the benchmark's).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierfs.testing.harness import mounted, process_cpu, scan_memory, wait_until


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _memory_report() -> dict:
    """Where this process's memory is (see the module docstring)."""
    import tracemalloc
    from collections import Counter

    out: dict = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                out[key] = int(value.split()[0]) * 1024
    # resident bytes by mapping: the heap, file-backed (libraries), and anonymous mappings by size
    maps: Counter[str] = Counter()
    with open("/proc/self/smaps") as f:
        label = ""
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                path = head[5] if len(head) > 5 else ""
                label = path if path.startswith("[") else "file" if path else f"anon {(hi - lo) >> 20} MiB"
            elif head[0] == "Rss:":
                maps[label] += int(head[1]) * 1024
    out["mappings"] = maps.most_common(15)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    mi = libc.mallinfo2()
    out["malloc"] = {"heap": mi.arena, "mmapped": mi.hblkhd, "in_use": mi.uordblks, "free_in_heap": mi.fordblks}
    out["objects"] = Counter(type(o).__name__ for o in gc.get_objects()).most_common(12)
    out["arrays"] = _big_arrays()
    if tracemalloc.is_tracing():
        snap = tracemalloc.take_snapshot()
        out["traced"] = tracemalloc.get_traced_memory()
        out["top"] = [(str(s.traceback), s.size, s.count) for s in snap.statistics("lineno")[:40]]
    return out


def _big_arrays(least: int = 1 << 18) -> list[tuple[str, str, int]]:
    """(name, dtype, bytes) of each numpy array of ``least`` bytes or more held by an attribute, a dict, a list
    or a tuple (numpy arrays are not tracked by ``gc`` themselves: found through what holds them), once each."""
    import numpy as np

    seen: dict[int, tuple[str, str, int]] = {}
    for holder in gc.get_objects():
        if isinstance(holder, dict):
            items = [(str(k), v) for k, v in holder.items() if isinstance(v, np.ndarray)]
        elif isinstance(holder, (list, tuple)):
            items = [(f"[{i}] of a {type(holder).__name__}", v) for i, v in enumerate(holder)
                     if isinstance(v, np.ndarray)]
        else:  # (an instance's attributes: Python 3.11 keeps them outside any dict object until asked)
            kind = type(holder).__name__
            attrs = getattr(holder, "__dict__", None)
            pairs = list(attrs.items()) if isinstance(attrs, dict) else \
                [(k, getattr(holder, k, None)) for k in getattr(type(holder), "__slots__", ())]
            items = [(f"{kind}.{k}", v) for k, v in pairs if isinstance(v, np.ndarray)]
        for name, a in items:
            base = a
            while isinstance(base.base, np.ndarray):
                base = base.base
            if base.nbytes >= least and id(base) not in seen:
                seen[id(base)] = (name, str(a.dtype), base.nbytes)
    return sorted(seen.values(), key=lambda x: -x[2])


def _daemon(argv: list[str]) -> None:
    """Run ``python -m tierfs ...`` (argv after this program's name); SIGUSR2 writes a memory report to
    ``$TIERFS_MEMORY_REPORT.N.json`` (N counts the reports)."""
    if os.environ.get("TIERFS_TRACEMALLOC"):
        import tracemalloc

        tracemalloc.start()
    from tierfs.cli.commands import main as tierfs_main

    reports = [0]

    def dump(*_: object) -> None:
        reports[0] += 1
        path = f"{os.environ['TIERFS_MEMORY_REPORT']}.{reports[0]}.json"
        with open(path + ".tmp", "w") as f:
            json.dump(_memory_report(), f, indent=1)
        os.replace(path + ".tmp", path)

    signal.signal(signal.SIGUSR2, dump)
    assert argv[1:3] == ["-m", "tierfs"], argv  # (the interpreter, -m tierfs, then tierfs's arguments)
    sys.exit(tierfs_main(argv[3:]))


def _report(pid: int, base: str, n: int) -> dict:
    """Ask the daemon for report ``n`` and read it."""
    os.kill(pid, signal.SIGUSR2)
    path = f"{base}.{n}.json"
    wait_until(lambda: os.path.exists(path), timeout=300, what="the memory report")
    with open(path) as f:
        return json.load(f)


def build(root: Path, dirs: int, per_dir: int, size: int) -> None:
    """The tree, unless a complete one is there (a marker written last)."""
    done = root / f".built-{dirs}x{per_dir}x{size}"
    if done.exists():
        return
    data = os.urandom(size)
    for d in range(dirs):
        path = root / "data" / f"d{d:04d}"
        path.mkdir(parents=True, exist_ok=True)
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for i in range(per_dir):
                fd = os.open(f"f{i:05d}.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dfd)
                os.write(fd, data)
                os.close(fd)
        finally:
            os.close(dfd)
    done.touch()


def scan_peak(backing: Path) -> dict:
    """The scan's memory, alone (see the module docstring)."""
    m = scan_memory(backing)
    n = m["files"]
    return {"scan_files": n, "scan_peak_B_per_file": round((m["peak"] - m["before"]) / n),
            "scan_process_peak_B_per_file": round(m["peak"] / n),
            "scan_tree_B_per_file": round((m["after"] - m["before"]) / n), "scan_base_MB": round(m["before"] / 2**20)}


def rss(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def settled(m) -> None:
    """Wait until the daemon has nothing left to do but answer: both mini-epochs staged, no push queued (a
    ``find`` that makes the kernel learn the staged files' inodes starts their pushes)."""
    def idle() -> bool:
        st = m.status()
        return all(st[k]["files_done"] == st[k]["files_total"] for k in ("prefetch", "current_staging")) \
            and st["push"]["queued"] == 0

    wait_until(idle, timeout=900, what="staging and pushes done")
    time.sleep(2)  # (the last push's reply, the journal write)


def timed_find(path: str, repeat: int, settle=lambda: None) -> tuple[float, float, int]:
    """(the first ``find``'s seconds, the best of ``repeat`` more after ``settle()``, the count)."""
    t0 = time.perf_counter()
    subprocess.run(f"find {path} | wc -l", shell=True, check=True, capture_output=True)  # warm
    first = time.perf_counter() - t0
    settle()
    best, count = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = subprocess.run(f"find {path} | wc -l", shell=True, check=True, capture_output=True, text=True)
        best = min(best, time.perf_counter() - t0)
        count = int(out.stdout)
    return first, best, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="/tmp/tierfs-million")
    ap.add_argument("--dirs", type=int, default=1000)
    ap.add_argument("--files-per-dir", type=int, default=1000)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--capacity", default="256M")
    ap.add_argument("--nm", type=int, default=32, help="mini-epochs (the copies of one fit half the capacity)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="bench-out/million.json")
    ap.add_argument("--profile", metavar="DIR", help="write memory reports of the daemon here (see above)")
    ap.add_argument("--tracemalloc", action="store_true", help="with --profile: trace Python allocations too")
    ap.add_argument("--scan-only", action="store_true", help="measure the scan's memory alone (no mount)")
    args = ap.parse_args()
    root = Path(args.root)
    build(root, args.dirs, args.files_per_dir, args.size)
    backing = (root / "data").resolve()
    n = args.dirs * args.files_per_dir
    scan = scan_peak(backing)
    if args.scan_only:
        result = {**scan, "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
        print(json.dumps(result, indent=1))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return
    with tempfile.TemporaryDirectory(prefix="million-") as tmp:
        mnt, cache = Path(tmp, "mnt"), Path(tmp, "cache")
        mnt.mkdir()
        profile: dict = {}
        if args.profile:
            os.makedirs(args.profile, exist_ok=True)
            base = os.path.join(os.path.abspath(args.profile), "memory")
            profile = {"env": {"TIERFS_MEMORY_REPORT": base, **({"TIERFS_TRACEMALLOC": "1"} if args.tracemalloc
                                                                   else {})},
                       "wrapper": (sys.executable, os.path.abspath(__file__), "--daemon")}
        t0 = time.monotonic()
        with mounted(backing, mnt, cache, args.capacity, timeout=600, view="full", nm=args.nm, **profile) as m:
            mount_s = time.monotonic() - t0
            pid = m.process.pid
            after_mount = rss(pid)
            tree_bin = cache / "tree.bin"
            wait_until(tree_bin.exists, timeout=300, what="tree.bin")
            if args.profile:
                _report(pid, base, 1)
            _, t_backing, c_backing = timed_find(str(backing), args.repeat)
            cpu0 = sum(process_cpu(pid))
            first_mount, t_mount, c_mount = timed_find(str(mnt), args.repeat, settle=lambda: settled(m))
            daemon_cpu = sum(process_cpu(pid)) - cpu0
            after_find = rss(pid)
            listings = m.status().get("listings")  # (None from a tierfs before the kernel's readdir cache)
            if args.profile:
                _report(pid, base, 2)
            result = {
                "files": n, "mount_s": round(mount_s, 2),
                "rss_mount_B_per_file": round(after_mount["VmRSS"] / n),
                "rss_find_B_per_file": round(after_find["VmRSS"] / n),
                "peak_B_per_file": round(after_find["VmHWM"] / n),
                "find_backing_s": round(t_backing, 3), "find_mount_s": round(t_mount, 3),
                "find_ratio": round(t_mount / t_backing, 2), "find_counts": [c_backing, c_mount],
                "find_mount_first_s": round(first_mount, 3), "listings": listings,
                "daemon_cpu_finds_s": round(daemon_cpu, 2),
                "tree_bin_B_per_file": round(tree_bin.stat().st_size / n),
                "peak_mount_B_per_file": round(after_mount["VmHWM"] / n),  # (the daemon's, its first scan's peak)
                **scan,
                "load": [round(x, 2) for x in os.getloadavg()],
                "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
            }
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--daemon"]:
        _daemon(sys.argv[2:])
    else:
        main()

"""A million files in the time and memory promised (issue 22, 7): mount time, daemon memory, ``find``.

Builds (once, kept for later runs) ``--dirs`` x ``--files-per-dir`` files of ``--size`` bytes under ``--root``
(local disk), mounts it with ``view=full`` over a fresh cache, and measures:

* ``mount_s``     from starting the daemon until ``/.tierfs/status`` answers (the scan of a first mount);
* ``rss_mount``   the daemon's VmRSS then, in bytes per file (``/proc/PID/status``);
* ``find_ratio``  ``find MOUNT | wc -l`` against ``find BACKING | wc -l``, each run once to warm (the backing's
  dentries, the mount's kernel entries) and then timed: both warm, best of ``--repeat``;
* ``rss_find``    VmRSS after those finds, bytes per file (``VmHWM``: the peak, scan included);
* ``tree_bin``    bytes per file of the saved tree in the cache dir (written after the scan).

Prints one JSON object (also written to ``--out``).  Root is required (FUSE); the mount is gone when it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tierfs.testing import mounted, wait_until


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


def rss(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def timed_find(path: str, repeat: int) -> tuple[float, int]:
    subprocess.run(f"find {path} | wc -l", shell=True, check=True, capture_output=True)  # warm
    best, count = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = subprocess.run(f"find {path} | wc -l", shell=True, check=True, capture_output=True, text=True)
        best = min(best, time.perf_counter() - t0)
        count = int(out.stdout)
    return best, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default="/tmp/tierfs-million")
    ap.add_argument("--dirs", type=int, default=1000)
    ap.add_argument("--files-per-dir", type=int, default=1000)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--capacity", default="256M")
    ap.add_argument("--nm", type=int, default=32, help="mini-epochs (the copies of one fit half the capacity)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="million.json")
    args = ap.parse_args()
    root = Path(args.root)
    build(root, args.dirs, args.files_per_dir, args.size)
    backing = (root / "data").resolve()
    n = args.dirs * args.files_per_dir
    with tempfile.TemporaryDirectory(prefix="million-") as tmp:
        mnt, cache = Path(tmp, "mnt"), Path(tmp, "cache")
        mnt.mkdir()
        t0 = time.monotonic()
        with mounted(backing, mnt, cache, args.capacity, timeout=600, view="full", nm=args.nm) as m:
            mount_s = time.monotonic() - t0
            pid = m.process.pid
            after_mount = rss(pid)
            tree_bin = cache / "tree.bin"
            wait_until(tree_bin.exists, timeout=300, what="tree.bin")
            t_backing, c_backing = timed_find(str(backing), args.repeat)
            t_mount, c_mount = timed_find(str(mnt), args.repeat)
            after_find = rss(pid)
            result = {
                "files": n, "mount_s": round(mount_s, 2),
                "rss_mount_B_per_file": round(after_mount["VmRSS"] / n),
                "rss_find_B_per_file": round(after_find["VmRSS"] / n),
                "peak_B_per_file": round(after_find["VmHWM"] / n),
                "find_backing_s": round(t_backing, 3), "find_mount_s": round(t_mount, 3),
                "find_ratio": round(t_mount / t_backing, 2), "find_counts": [c_backing, c_mount],
                "tree_bin_B_per_file": round(tree_bin.stat().st_size / n),
                "load": [round(x, 2) for x in os.getloadavg()],
                "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
            }
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

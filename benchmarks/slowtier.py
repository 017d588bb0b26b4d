"""A real slow tier for benchmarks: an ext4 image on a loop device whose reads are throttled by the kernel.

Why not ``time.sleep`` in the loader, or a throttle inside tierfs: the point of the benchmarks is to show what a
user would see on a slow shared tier, so the slowness must sit where it sits in real life, below the
filesystem, for every reader alike -- the loader on the backing dir, tierfs's staging tasks and its read-through
misses.  The harness therefore

* builds a sparse ext4 image, attaches it to a loop device with ``--direct-io=on`` (so the image file's own
  page cache on the host disk does not hide the throttle), fills it with a workload while unthrottled,
* throttles reads of that one device with the block-IO controller: cgroup v1 ``blkio.throttle.read_bps_device``
  on the root group (applies to every process), or, on a cgroup-v2-only host, ``io.max`` of a child cgroup
  that this process and its children are moved into,
* counts the device's real reads from ``/proc/diskstats`` (sectors read x 512),
* drops the page cache on request, so no configuration is served from RAM across passes,
* and tears everything down in ``finally`` -- also on Ctrl-C and SIGTERM (see :func:`install_sigterm`).

Root is required (loop devices, mount, cgroups, drop_caches); without it :func:`require_root` says so and exits.

Run ``python benchmarks/slowtier.py`` to verify the throttle on this machine: it prints cold/warm read rates
with and without the throttle, buffered and ``O_DIRECT``, and writes ``bench-out/slowtier_verify.png`` (``--plot``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "SlowTier",
    "Workload",
    "drop_caches",
    "install_sigterm",
    "parse_size",
    "require_root",
    "slow_tier",
]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_SIZE_UNITS = {"": 1, "K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}
CGROUP_V1_BLKIO = Path("/sys/fs/cgroup/blkio")


def parse_size(text: str) -> int:
    """``"25M"`` -> 26214400 (binary units, like tierfs's own ``--capacity``)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _SIZE_UNITS and not t[-1:].isdigit() else ""
    try:
        return int(float(t[: len(t) - len(unit)]) * _SIZE_UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 25M, 1.5G)") from None


def require_root() -> None:
    """Exit with a one-line reason unless we are root: every part of the harness needs it."""
    if os.geteuid() != 0:
        sys.exit(
            "benchmarks need root: they build a loop device, mount ext4 on it, throttle it with the "
            "block-IO cgroup controller and drop the page cache (run with sudo)"
        )


def install_sigterm() -> None:
    """SIGTERM, SIGHUP and SIGINT (even if inherited as ignored) raise KeyboardInterrupt: ``finally`` tears down."""

    def _raise(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGHUP, _raise)
    # a shell starts background jobs with SIGINT ignored; Ctrl-C / kill -INT must still tear down
    signal.signal(signal.SIGINT, signal.default_int_handler)


def drop_caches(level: int = 1) -> float:
    """``sync`` and drop the page cache (1) or also dentries and inodes (3); returns the seconds it took."""
    t0 = time.perf_counter()
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text(f"{level}\n")
    return time.perf_counter() - t0


def _run(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or f'exit {r.returncode}'}")
    return r.stdout.strip()


# --------------------------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class Workload:
    """A synthetic dataset: ``files`` files spread over ``classes`` directories (0 = all in the root).

    Sizes are uniform in ``size * (1 +- jitter)``; contents are random (incompressible) bytes.
    """

    name: str
    files: int
    size: int
    classes: int = 0
    jitter: float = 0.0

    @classmethod
    def images(cls, scale: float = 1.0) -> Workload:
        """Image-like: 20,000 files of ~110 KiB in 100 class dirs (scaled: fewer files, as many classes)."""
        n = max(100, round(20_000 * scale))
        return cls("images", n, 110 * KiB, classes=min(100, n), jitter=0.2)

    @classmethod
    def shards(cls, scale: float = 1.0) -> Workload:
        """Shards: 64 files of 32 MiB (scaled: smaller shards, so the mini-epoch structure stays the same)."""
        return cls("shards", 64, max(MiB, round(32 * MiB * scale / 4096) * 4096))

    def sizes(self, seed: int = 0) -> np.ndarray:
        rng = np.random.default_rng((seed, 7))
        lo, hi = self.size * (1 - self.jitter), self.size * (1 + self.jitter)
        return rng.integers(int(lo), int(hi) + 1, self.files) if self.jitter else np.full(self.files, self.size)

    def paths(self) -> list[str]:
        if not self.classes:
            return [f"shard-{i:05d}.bin" for i in range(self.files)]
        return [f"class{i % self.classes:03d}/img{i:06d}.bin" for i in range(self.files)]

    @property
    def total_bytes(self) -> int:
        return int(self.sizes().sum())

    def populate(self, root: Path, seed: int = 0, progress: bool = True) -> int:
        """Write the dataset under ``root``; returns its byte count."""
        from tqdm import tqdm

        rng = np.random.default_rng((seed, 11))
        sizes = self.sizes(seed)
        total = 0
        with tqdm(
            total=int(sizes.sum()), unit="B", unit_scale=True, desc=f"make {self.name}", disable=not progress
        ) as bar:
            for rel, size in zip(self.paths(), sizes, strict=True):
                p = root / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                with open(p, "wb") as f:
                    for off in range(0, int(size), 8 * MiB):
                        f.write(rng.bytes(min(8 * MiB, int(size) - off)))
                total += int(size)
                bar.update(int(size))
        return total


# --------------------------------------------------------------------------------------------- throttling


class _Throttle:
    """Read throttle of one block device: cgroup v1 root blkio, else a cgroup v2 child with io.max."""

    def __init__(self, devno: str) -> None:
        self.devno = devno
        self._v2_root: Path | None = None  # None: cgroup v1
        self._v2_dir: Path | None = None
        self._v2_home: Path | None = None
        if (CGROUP_V1_BLKIO / "blkio.throttle.read_bps_device").exists():
            self.kind = "cgroup-v1 blkio.throttle.read_bps_device (root group: every process)"
        else:
            v2 = _cgroup2_root()
            if v2 is None or "io" not in (v2 / "cgroup.controllers").read_text().split():
                raise RuntimeError(
                    "no block-IO throttle: neither cgroup v1 blkio (/sys/fs/cgroup/blkio) nor a cgroup v2 "
                    "hierarchy with the io controller is mounted; mount one, e.g. "
                    "`mkdir -p /sys/fs/cgroup/blkio && mount -t cgroup -o blkio none /sys/fs/cgroup/blkio`"
                )
            self.kind = "cgroup-v2 io.max (this process and its children)"
            self._v2_root = v2

    def set(self, bps: int) -> None:
        if self._v2_root is None:
            (CGROUP_V1_BLKIO / "blkio.throttle.read_bps_device").write_text(f"{self.devno} {bps}\n")
            return
        if self._v2_dir is None:
            self._enter_v2_group()
        assert self._v2_dir is not None
        (self._v2_dir / "io.max").write_text(f"{self.devno} rbps={bps if bps else 'max'}\n")

    def _enter_v2_group(self) -> None:
        root = self._v2_root
        assert root is not None
        with contextlib.suppress(OSError):
            (root / "cgroup.subtree_control").write_text("+io\n")
        rel = Path("/proc/self/cgroup").read_text().strip().splitlines()[-1].split(":", 2)[2]
        self._v2_home = root / rel.lstrip("/")
        self._v2_dir = root / f"tierfs-bench-{os.getpid()}"
        self._v2_dir.mkdir(exist_ok=True)
        (self._v2_dir / "cgroup.procs").write_text(f"{os.getpid()}\n")

    def clear(self) -> None:
        """Remove the limit, and on v2 move every process back and remove the group."""
        if self._v2_root is None:
            with contextlib.suppress(OSError):
                (CGROUP_V1_BLKIO / "blkio.throttle.read_bps_device").write_text(f"{self.devno} 0\n")
            return
        if self._v2_dir is None:
            return
        home = self._v2_home if self._v2_home and self._v2_home.exists() else self._v2_root
        with contextlib.suppress(OSError):
            for pid in (self._v2_dir / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (home / "cgroup.procs").write_text(f"{pid}\n")
        with contextlib.suppress(OSError):
            self._v2_dir.rmdir()
        self._v2_dir = None


def _cgroup2_root() -> Path | None:
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if parts[2] == "cgroup2":
            return Path(parts[1])
    return None


# --------------------------------------------------------------------------------------------- the tier


@dataclass
class SlowTier:
    """A mounted, throttled ext4 loop device.  ``root`` is the backing dir a benchmark reads."""

    root: Path
    device: str
    devno: str
    read_bps: int
    throttle_kind: str
    _throttle: _Throttle = dataclasses.field(repr=False)

    def read_bytes(self) -> int:
        """Bytes actually read from the device so far (``/proc/diskstats``, sectors read x 512)."""
        name = Path(self.device).name
        for line in Path("/proc/diskstats").read_text().splitlines():
            f = line.split()
            if f[2] == name:
                return int(f[5]) * 512
        raise RuntimeError(f"{name} is not in /proc/diskstats")

    def evict_page_cache(self) -> float:
        """Drop this tier's file pages from the page cache (``POSIX_FADV_DONTNEED`` on every file), leaving
        every other filesystem's cache alone; returns the seconds it took."""
        t0 = time.perf_counter()
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                try:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return time.perf_counter() - t0

    def throttle(self, bps: int) -> None:
        """Set (``bps > 0``) or lift (0) the read throttle."""
        self._throttle.set(bps)
        self.read_bps = bps

    @contextlib.contextmanager
    def unthrottled(self) -> Iterator[None]:
        saved = self.read_bps
        self.throttle(0)
        try:
            yield
        finally:
            self.throttle(saved)


@contextlib.contextmanager
def slow_tier(
    workdir: Path,
    size: int,
    read_bps: int,
    populate: Callable[[Path], object] | None = None,
) -> Iterator[SlowTier]:
    """Build the tier under ``workdir``, fill it with ``populate(root)`` unthrottled, throttle, yield, tear down.

    Teardown runs whatever happened (exception, Ctrl-C): lift the throttle, unmount (lazily if still busy),
    detach the loop device, delete the image.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="slowtier-", dir=workdir))
    image, root = base / "ext4.img", base / "backing"
    root.mkdir()
    device: str | None = None
    mounted = False
    throttle: _Throttle | None = None
    try:
        with open(image, "wb") as f:
            f.truncate(size)
        device = _run("losetup", "--find", "--show", "--direct-io=on", str(image))
        _run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", device)
        _run("mount", "-o", "noatime", device, str(root))
        mounted = True
        st = os.stat(device)
        devno = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        throttle = _Throttle(devno)
        tier = SlowTier(root, device, devno, 0, throttle.kind, throttle)
        if populate is not None:
            populate(root)
        drop_caches(3)
        tier.throttle(read_bps)
        yield tier
    finally:
        if throttle is not None:
            throttle.clear()
        if mounted and subprocess.run(["umount", str(root)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(root)], capture_output=True)
        if device is not None:
            # a lazily unmounted fs may hold the device a moment longer; losetup -d then auto-clears on release
            for _ in range(50):
                if subprocess.run(["losetup", "-d", device], capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)
        shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------------------------- verification


def _read_file(path: Path, direct: bool = False, block: int = 1 * MiB) -> tuple[int, float]:
    """Read a whole file; returns (bytes, seconds)."""
    import mmap

    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags)
    buf = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
    n = 0
    t0 = time.perf_counter()
    try:
        while True:
            k = os.readv(fd, [buf])
            if k <= 0:
                break
            n += k
    finally:
        os.close(fd)
        buf.close()
    return n, time.perf_counter() - t0


def verify(args: argparse.Namespace) -> list[tuple[str, float, float, int]]:
    """Measure read rates of one file under each condition; returns rows (label, MB/s, seconds, device bytes)."""
    size = args.file_size
    rows: list[tuple[str, float, float, int]] = []

    def fill(root: Path) -> None:
        Workload("verify", 1, size).populate(root, progress=False)

    with slow_tier(args.workdir, size * 2 + 256 * MiB, args.bps, fill) as tier:
        path = tier.root / Workload("verify", 1, size).paths()[0]
        print(f"device {tier.device} ({tier.devno}), throttle: {tier.throttle_kind}")

        def measure(label: str, direct: bool, cold: bool, bps: int) -> None:
            tier.throttle(bps)
            if cold:
                drop_caches(1)
            before = tier.read_bytes()
            n, s = _read_file(path, direct=direct)
            rows.append((label, n / s / 1e6, s, tier.read_bytes() - before))

        measure("unthrottled, cold, buffered", False, True, 0)
        measure("unthrottled, cold, O_DIRECT", True, True, 0)
        measure(f"throttled {args.bps / 1e6:.1f} MB/s, cold, buffered", False, True, args.bps)
        measure(f"throttled {args.bps / 1e6:.1f} MB/s, warm page cache", False, False, args.bps)
        measure(f"throttled {args.bps / 1e6:.1f} MB/s, cold, O_DIRECT", True, True, args.bps)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--bps", type=parse_size, default=parse_size("25M"), help="read throttle, bytes/s (25M)")
    ap.add_argument("--file-size", type=parse_size, default=parse_size("128M"), help="test file size (128M)")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/tierfs-bench"), help="where the image lives")
    ap.add_argument("--plot", type=Path, default=Path("bench-out/slowtier_verify.png"),
                    help="PNG output (docs/img/slowtier_verify.png: on purpose)")
    args = ap.parse_args(argv)
    require_root()
    install_sigterm()
    rows = verify(args)
    print("\n| condition | MB/s | seconds | device MB read |\n|---|---:|---:|---:|")
    for label, mbs, s, dev in rows:
        print(f"| {label} | {mbs:.1f} | {s:.2f} | {dev / 1e6:.1f} |")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color="tab:blue")
    ax.axvline(args.bps / 1e6, color="tab:red", ls="--", label=f"throttle {args.bps / 1e6:.1f} MB/s")
    ax.set_xscale("log")
    ax.set_xlabel("read rate, MB/s (log)")
    ax.invert_yaxis()
    ax.legend(loc="lower right")
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()

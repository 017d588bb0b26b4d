"""``tierfs plan``: the settings of a mount, chosen from the data set before mounting (docs/tuning.md).

It counts the data set as the cache will: the scan the mount makes (``Tree.scan``), each file in the cache
disk's blocks (``cache.disk_estimates``: small files cost a whole block, so ``du -sb`` undercounts them), and picks
the fewest mini-epochs the mount accepts (``tierfs.schedule.check_fits``) at the capacity -- the nm the
mount will take, not a formula's.  It reads a sample of the backing files for a few seconds (their page-cache
pages dropped first, so the figure is the tier's) and writes a scratch file on the cache disk, and from those
and the loader's rate, when given, derives rf, the slow-tier bytes per epoch and the time of a pass.
"""

from __future__ import annotations

import math
import os
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sampler.iomodel import stall_free_rf
from tierfs.cache import cache_block, disk_estimates
from tierfs.options import Settings, format_size, format_size_at_least, parse_size
from tierfs.schedule import check_fits
from tierfs.tree import ScanCount, Tree

__all__ = ["Sizing", "measure_read", "measure_write", "size_mount"]

_READ_THREADS = 4  # as many reads at once as staging starts with: a network tier answers several at once
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Sizing:
    """What ``tierfs plan`` found and chose (bytes are the cache disk's unless named ``logical``)."""

    files: int
    logical_bytes: int  # what du -sb counts
    disk_bytes: int  # what the cache will count: allocated blocks
    block: int
    largest: int
    capacity: int
    world_size: int
    nm: int
    mini_epoch_bytes: int  # of a node's share, on the cache disk
    backing_bytes_per_s: float | None
    cache_bytes_per_s: float | None
    consumption_bytes_per_s: float | None
    rf: int | None  # None: give consumption, or mount with rf=auto
    epochs: int

    @property
    def staging_bytes_per_s(self) -> float | None:
        rates = [r for r in (self.backing_bytes_per_s, self.cache_bytes_per_s) if r]
        return min(rates) if rates else None

    @property
    def backing_bytes_per_epoch(self) -> int:
        """Each file is staged once per epoch: a node reads its share of the data set (logical bytes)."""
        return -(-self.logical_bytes // self.world_size)

    @property
    def pass_seconds(self) -> float | None:
        """A pass over one mini-epoch at the IO model's rate, ``min(EB1, rf * B2)`` (``training_throughput``)."""
        b2, eb1 = self.staging_bytes_per_s, self.consumption_bytes_per_s
        if not eb1 or not b2 or not self.rf:
            return None
        logical_me = self.logical_bytes / (self.nm * self.world_size)
        return logical_me / min(eb1, self.rf * b2)

    def as_dict(self) -> dict[str, Any]:
        """``tierfs plan --json``: the figures, in bytes and seconds."""
        return {**asdict(self), "staging_bytes_per_s": self.staging_bytes_per_s,
                "backing_bytes_per_epoch": self.backing_bytes_per_epoch, "pass_seconds": self.pass_seconds}

    def summary(self, backing: str) -> str:
        """``tierfs plan``'s summary: the figures, the settings, the accuracy note, the mount command."""
        share = f" per node ({self.world_size} nodes)" if self.world_size > 1 else ""
        staging = self.staging_bytes_per_s
        lines = [
            f"data set     {self.files:,} files, {format_size(self.logical_bytes)}; on the cache disk "
            f"{format_size(self.disk_bytes)} ({format_size(self.block)} blocks: what the capacity counts)",
            f"nm           {self.nm}: mini-epochs of {format_size(self.mini_epoch_bytes)}{share}, two of them in "
            f"capacity {format_size(self.capacity)}",
            f"tiers        backing read {_rate(self.backing_bytes_per_s)}, cache disk write "
            f"{_rate(self.cache_bytes_per_s)}; staging a mini-epoch takes "
            + (f"{self.logical_bytes / (self.nm * self.world_size) / staging:.3g} s" if staging else "?"),
        ]
        if self.rf:
            lines.append(f"rf           {self.rf}: the fewest passes that hide staging at "
                         f"{_rate(self.consumption_bytes_per_s)} (rf >= EB1 / B2); a pass over a mini-epoch takes "
                         f"{self.pass_seconds:.3g} s")
        else:
            lines.append("rf           auto (tierfs measures both rates and picks rf >= EB1 / B2); give --consumption "
                         "for a number and the time of a pass")
        per_epoch = self.backing_bytes_per_epoch
        lines += [
            f"backing      {format_size(per_epoch)} read per epoch{share} (each file staged once), "
            f"{format_size(per_epoch * self.epochs)} for {self.epochs} epoch{'s' if self.epochs > 1 else ''}",
            "accuracy     in our convergence study (docs/tuning.md) rf 2-4 at nm 8 kept P@1 (+0.8, +1.9 points), rf 8 "
            "cost 3.1 points (contiguous: 9.3); arf=score kept it with 5.2x fewer slow-tier bytes: for rf above 4 "
            "use arf=score",
        ]
        lines = [textwrap.fill(ln, 100, subsequent_indent=" " * 13) for ln in lines]  # (the command stays whole)
        lines += [
            f"mount with   tierfs mount {backing} MOUNTPOINT --cache DIR --capacity {_size_arg(self.capacity)} "
            f"--nm {self.nm} --rf {self.rf or 'auto'}"
            + (f" --world-size {self.world_size} --rank R" if self.world_size > 1 else ""),
        ]
        return "\n".join(lines)


def _rate(v: float | None) -> str:
    return f"{format_size(v)}/s" if v else "not measured"


def _size_arg(n: int) -> str:
    """``n`` as a size argument that means exactly ``n``."""
    text = format_size(n)
    return text if parse_size(text) == n else str(n)


def size_mount(backing: str, capacity: int, *, cache_disk: str | None = None, world_size: int = 1,
               consumption: float | None = None, epochs: int = 1, measure_seconds: float = 2.0, seed: int = 0,
               scan_progress: Callable[[ScanCount], None] = lambda count: None) -> Sizing:
    """Scan ``backing``, choose nm (``ValueError`` naming the fix when no nm fits), measure the tiers."""
    fd = os.open(backing, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        tree = Tree.scan(fd, os.path.realpath(backing), scan_progress)
    finally:
        os.close(fd)
    if tree.n_files == 0:
        raise ValueError(f"{backing} holds no files")
    block = cache_block(cache_disk) if cache_disk else 4096
    disk = disk_estimates(tree.sizes, tree.blocks, block)
    largest = int(disk.max())
    if 2 * largest > capacity:
        raise ValueError(f"capacity {format_size(capacity)} cannot hold two copies of the largest file "
                         f"({format_size(largest)} on the cache disk): use at least "
                         f"{format_size_at_least(2 * largest)}")
    nm = _fewest_mini_epochs(tree, disk, capacity, world_size, seed)
    rf = None
    backing_rate = measure_read(backing, tree, measure_seconds, seed) if measure_seconds > 0 else None
    cache_rate = measure_write(cache_disk, measure_seconds) if cache_disk and measure_seconds > 0 else None
    staging = min(r for r in (backing_rate, cache_rate) if r) if (backing_rate or cache_rate) else None
    if consumption and staging:
        rf = stall_free_rf(consumption, staging)
    total = int(disk.sum())
    return Sizing(files=tree.n_files, logical_bytes=int(tree.sizes.sum()), disk_bytes=total, block=block,
                  largest=largest, capacity=capacity, world_size=world_size, nm=nm,
                  mini_epoch_bytes=-(-total // (nm * world_size)), backing_bytes_per_s=backing_rate,
                  cache_bytes_per_s=cache_rate, consumption_bytes_per_s=consumption, rf=rf, epochs=epochs)


def _fewest_mini_epochs(tree: Tree, disk: np.ndarray, capacity: int, world_size: int, seed: int) -> int:
    """The smallest nm the mount accepts (:func:`tierfs.schedule.check_fits`, what a mount and a control write
    check)."""
    lo = max(1, math.ceil(2 * int(disk.sum()) / (world_size * capacity)))
    for nm in range(lo, tree.n_files + 1):
        try:
            check_fits(disk, Settings(nm=nm, seed=seed, world_size=world_size), capacity)
            return nm
        except ValueError:
            continue
    raise ValueError(f"no nm fits capacity {format_size(capacity)}: each file would need a mini-epoch of its own; "
                     f"use a larger capacity")


def measure_read(backing: str, tree: Tree, seconds: float, seed: int = 0) -> float | None:
    """Bytes/s read from a random sample of the backing files for about ``seconds``, each file's cached pages
    dropped first (``POSIX_FADV_DONTNEED``), so the figure is the tier's rather than the page cache's."""
    order = np.random.default_rng((seed, 24)).permutation(tree.n_files)
    deadline = time.monotonic() + seconds
    cursor = iter(order.tolist())
    start = time.monotonic()

    def reader() -> int:
        done = 0
        buf = bytearray(_CHUNK)
        for fidx in cursor:  # (next() on a list iterator is atomic: each file goes to one thread)
            if time.monotonic() > deadline:
                break
            try:
                fd = os.open(os.path.join(backing, os.fsdecode(tree.file_path(fidx))), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                while (n := os.readv(fd, [buf])) > 0:
                    done += n
                    if time.monotonic() > deadline:
                        break
            except OSError:
                pass
            finally:
                os.close(fd)
        return done

    with ThreadPoolExecutor(_READ_THREADS) as pool:
        total = sum(pool.map(lambda _: reader(), range(_READ_THREADS)))
    elapsed = time.monotonic() - start
    return total / elapsed if total and elapsed > 0 else None


def measure_write(directory: str, seconds: float) -> float | None:
    """Bytes/s written and fsynced to a scratch file in ``directory`` (removed after) for about ``seconds``, at
    most 256 MiB."""
    path = os.path.join(directory, f".tierfs-plan-{os.getpid()}")
    data = os.urandom(_CHUNK)
    done = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        start = time.monotonic()
        while time.monotonic() - start < seconds and done < 256 * _CHUNK:
            done += os.write(fd, data)
            if done % (16 * _CHUNK) == 0:
                os.fsync(fd)
        os.fsync(fd)
        elapsed = time.monotonic() - start
    finally:
        os.close(fd)
        os.unlink(path)
    return done / elapsed if elapsed > 0 else None

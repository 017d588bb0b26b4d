"""``tierfs plan``: the settings of a mount, chosen from the data set before mounting (docs/tuning.md).

It counts the data set as the cache will: the scan the mount makes (``Tree.scan``), each file in the cache
disk's blocks (``cache.disk_estimates``: small files cost a whole block, so ``du -sb`` undercounts them), and picks
the fewest mini-epochs the mount accepts (``tierfs.daemon.schedule.schedule.check_fits``) at the capacity -- the nm the
mount will take, not a formula's.  It reads a sample of the backing files for a few seconds (their page-cache
pages dropped first, so the figure is the tier's) and writes a scratch file on the cache disk, each test timed in
slices whose spread says how steady the tier was, and from those and the loader's rate, when given, derives rf,
the slow-tier bytes per epoch and the time of a pass.  It ends with the mount command to run as printed: the
listing the user's loader needs, the cache dir on the cache disk, absolute paths, ``--daemon``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sampler.iomodel import stall_free_rf
from tierfs.common.options import Settings, format_size, format_size_at_least, parse_size
from tierfs.daemon.cache.store import cache_block, disk_estimates
from tierfs.daemon.schedule.schedule import fewest_mini_epochs
from tierfs.daemon.tree.tree import ScanCount, Tree

__all__ = ["LOADERS", "Rate", "Sizing", "measure_read", "measure_write", "mount_command", "size_mount"]

_READ_THREADS = 4  # as many reads at once as staging starts with: a network tier answers several at once
_CHUNK = 1 << 20
_SLICES = 4  # each bandwidth test is timed in this many slices: their spread says how steady the tier was
_NOISY = 1.5  # fastest / slowest slice above this: the summary advises a longer test

#: ``tierfs plan --loader``: the mount options each way of reading needs (docs/pytorch.md), and what to say of it
LOADERS: dict[str, tuple[tuple[str, ...], str]] = {
    "sampler": (("--listing", "all"), "a dataset built once with tierfs.torch.MountSampler (the README's recipe): "
                "the mount lists every file"),
    "relist": ((), "a dataset re-created each pass from the folder: the mount lists the current view"),
    "shards": (("--listing", "all"), "a shard list with tierfs.torch.MountShards (WebDataset, Parquet): the mount "
               "lists every file"),
}
CACHE_DIR_NAME = "tierfs-cache"  # the cache dir the command names on --cache-disk (the README's)


@dataclass(frozen=True)
class Rate:
    """A measured bandwidth: bytes/s over the whole test, and its slowest and fastest slice."""

    bytes_per_s: float
    low: float
    high: float

    def __str__(self) -> str:
        spread = f"{format_size(self.low)}-{format_size(self.high)}/s"
        noisy = "; noisy: a longer --measure steadies it" if self.high > _NOISY * max(self.low, 1.0) else ""
        return f"{format_size(self.bytes_per_s)}/s (slices {spread}{noisy})"


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
    backing_spread: tuple[float, float] | None = None  # (slowest, fastest) slice of the read test, bytes/s
    cache_spread: tuple[float, float] | None = None  # of the write test

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

    def summary(self, command: Sequence[str], loader: str, *, make_mountpoint: bool = False) -> str:
        """``tierfs plan``'s summary: the figures, the settings, the accuracy note, the mount command
        (:func:`mount_command`) for ``loader`` (a key of :data:`LOADERS`); ``make_mountpoint``: the command's
        mountpoint does not exist yet (a ``mkdir`` line comes first)."""
        share = f" per node ({self.world_size} nodes)" if self.world_size > 1 else ""
        staging = self.staging_bytes_per_s
        lines = [
            f"data set     {self.files:,} files, {format_size(self.logical_bytes)}; on the cache disk "
            f"{format_size(self.disk_bytes)} ({format_size(self.block)} blocks: what the capacity counts)",
            f"nm           {self.nm}: mini-epochs of {format_size(self.mini_epoch_bytes)}{share}, two of them in "
            f"capacity {format_size(self.capacity)}"
            + (" (each file a mini-epoch of its own: the most this data set has)" if self.nm == self.files else ""),
            f"tiers        backing read {_rate(self.backing_bytes_per_s, self.backing_spread)}, cache disk write "
            f"{_rate(self.cache_bytes_per_s, self.cache_spread)}; staging a mini-epoch takes "
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
            f"accuracy     {_accuracy(self.rf)}",
            f"loader       {loader}: {LOADERS[loader][1]}"
            + ("; give --cache-disk for the cache dir" if command[command.index("--cache") + 1] == "DIR" else ""),
        ]
        lines = [textwrap.fill(ln, 100, subsequent_indent=" " * 13) for ln in lines]  # (the command stays whole)
        if make_mountpoint:
            lines.append(f"first        {shlex.join(['mkdir', '-p', command[3]])}")
        lines.append(f"mount with   {shlex.join(command)}")
        return "\n".join(lines)


#: the convergence study of docs/tuning.md ("What tiering costs your model"), as the plan quotes it
_STUDY = ("in our convergence study (docs/tuning.md) rf 2-4 at nm 8 kept P@1 (+0.8, +1.9 points), rf 8 cost 3.1 "
          "points (contiguous: 9.3); arf=score kept it with 5.2x fewer slow-tier bytes")


def _accuracy(rf: int | None) -> str:
    """The accuracy note for the rf the plan gives: what the study says of that rf, never of another."""
    if rf is None:
        return f"{_STUDY}: for rf above 4 use arf=score"
    if rf == 1:
        return ("rf 1 repeats nothing: every file is read once per epoch, as without tierfs, so the mini-epochs "
                "cost no accuracy by repetition (rf 2-4 kept P@1 too in our convergence study: docs/tuning.md)")
    if rf <= 4:
        return (f"rf {rf} is within the rf 2-4 that kept P@1 in our convergence study (docs/tuning.md: +0.8, +1.9 "
                "points at nm 8; rf 8 cost 3.1)")
    return (f"rf {rf} is above the rf 2-4 that kept P@1 in our convergence study (docs/tuning.md: rf 8 cost 3.1 "
            "points, contiguous 9.3): mount with --arf score (it kept P@1 with 5.2x fewer slow-tier bytes), or "
            "stage from a faster tier")


def mount_command(sizing: Sizing, backing: str, mountpoint: str, cache_disk: str | None,
                  loader: str) -> list[str]:
    """The ``tierfs mount`` command line of ``sizing``, to run as it is: absolute paths, the cache dir
    ``CACHE_DISK/tierfs-cache`` (a placeholder ``DIR`` without a cache disk), the listing ``loader`` needs
    (:data:`LOADERS`), ``--daemon`` (``--rank R``, a placeholder, on several nodes)."""
    cache = os.path.join(os.path.abspath(cache_disk), CACHE_DIR_NAME) if cache_disk else "DIR"
    cmd = [_tierfs(), "mount", os.path.abspath(backing), os.path.abspath(mountpoint), "--cache", cache,
           "--capacity", _size_arg(sizing.capacity), "--nm", str(sizing.nm), "--rf", str(sizing.rf or "auto"),
           *LOADERS[loader][0]]
    if sizing.world_size > 1:
        cmd += ["--world-size", str(sizing.world_size), "--rank", "R"]
    return [*cmd, "--daemon"]


def _tierfs() -> str:
    """How the user runs tierfs here: ``tierfs`` where it is on PATH, else this environment's own script by its
    path (a fresh clone's ``.venv/bin/tierfs``: a new user copies the command before activating anything)."""
    if shutil.which("tierfs"):
        return "tierfs"
    own = os.path.join(os.path.dirname(sys.executable), "tierfs")
    return own if os.access(own, os.X_OK) else "tierfs"


def _rate(v: float | None, spread: tuple[float, float] | None = None) -> str:
    if not v:
        return "not measured"
    return str(Rate(v, *spread)) if spread else f"{format_size(v)}/s"


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
    nm = fewest_mini_epochs(disk, Settings(seed=seed, world_size=world_size), capacity)
    rf = None
    backing_rate = measure_read(backing, tree, measure_seconds, seed) if measure_seconds > 0 else None
    cache_rate = measure_write(cache_disk, measure_seconds) if cache_disk and measure_seconds > 0 else None
    rates = [r.bytes_per_s for r in (backing_rate, cache_rate) if r]
    if consumption and rates:
        rf = stall_free_rf(consumption, min(rates))
    total = int(disk.sum())
    return Sizing(files=tree.n_files, logical_bytes=int(tree.sizes.sum()), disk_bytes=total, block=block,
                  largest=largest, capacity=capacity, world_size=world_size, nm=nm,
                  mini_epoch_bytes=-(-total // (nm * world_size)),
                  backing_bytes_per_s=backing_rate.bytes_per_s if backing_rate else None,
                  cache_bytes_per_s=cache_rate.bytes_per_s if cache_rate else None,
                  consumption_bytes_per_s=consumption, rf=rf, epochs=epochs,
                  backing_spread=(backing_rate.low, backing_rate.high) if backing_rate else None,
                  cache_spread=(cache_rate.low, cache_rate.high) if cache_rate else None)


def _timed_rate(events: list[tuple[float, int]], start: float, end: float) -> Rate | None:
    """The rate of ``events`` (time, bytes done then) over ``[start, end]``, and of each of :data:`_SLICES` equal
    slices of it; the bytes between two events are spread evenly over the time between them (a write test
    counts only at each ``fsync``)."""
    total = sum(n for _, n in events)
    if not total or end <= start:
        return None
    events.sort()
    times = np.array([start] + [t for t, _ in events])
    done = np.cumsum([0] + [n for _, n in events], dtype=np.float64)
    edges = np.linspace(start, end, _SLICES + 1)
    per_slice = np.diff(np.interp(edges, times, done)) / np.diff(edges)
    return Rate(total / (end - start), float(per_slice.min()), float(per_slice.max()))


def measure_read(backing: str, tree: Tree, seconds: float, seed: int = 0) -> Rate | None:
    """Bytes/s read from a random sample of the backing files for about ``seconds``, each file's cached pages
    dropped first (``POSIX_FADV_DONTNEED``), so the figure is the tier's rather than the page cache's."""
    order = np.random.default_rng((seed, 24)).permutation(tree.n_files)
    deadline = time.monotonic() + seconds
    cursor = iter(order.tolist())
    start = time.monotonic()

    def reader() -> list[tuple[float, int]]:
        done: list[tuple[float, int]] = []
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
                    done.append((time.monotonic(), n))
                    if done[-1][0] > deadline:
                        break
            except OSError:
                pass
            finally:
                os.close(fd)
        return done

    with ThreadPoolExecutor(_READ_THREADS) as pool:
        events = [e for done in pool.map(lambda _: reader(), range(_READ_THREADS)) for e in done]
    return _timed_rate(events, start, time.monotonic())


def measure_write(directory: str, seconds: float) -> Rate | None:
    """Bytes/s written and fsynced to a scratch file in ``directory`` (removed after) for about ``seconds``, at
    most 256 MiB."""
    path = os.path.join(directory, f".tierfs-plan-{os.getpid()}")
    data = os.urandom(_CHUNK)
    done = synced = 0
    events: list[tuple[float, int]] = []  # (time of an fsync, bytes it made durable)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        start = time.monotonic()
        while time.monotonic() - start < seconds and done < 256 * _CHUNK:
            done += os.write(fd, data)
            if done % (16 * _CHUNK) == 0:
                os.fsync(fd)
                events.append((time.monotonic(), done - synced))
                synced = done
        os.fsync(fd)
        end = time.monotonic()
        events.append((end, done - synced))
    finally:
        os.close(fd)
        os.unlink(path)
    return _timed_rate(events, start, end)

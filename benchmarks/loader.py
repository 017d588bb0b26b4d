"""A real loader client for the benchmarks: PyTorch-style workers, a consumer with a set compute time, stall time.

The loader is what a training job does to a dataset directory, nothing more: at the start of every pass it
lists the root afresh (``ImageFolder``-style: class dirs sorted, files sorted, or flat files for shards),
shuffles that list with its own seed, and ``workers`` threads read whole files into a bounded queue
(``prefetch`` batches deep) while the consumer takes ``batch`` samples at a time and "computes" for
``compute_s`` seconds per sample (a sleep, as a GPU step costs the host no CPU).  Stall seconds are the time the
consumer waited for data -- the number tierfs exists to drive to zero.  Re-listing every pass is what lets a
tierfs mount move the loader to the next mini-epoch without the loader knowing.

:class:`TorchLoader` does the same through ``torch.utils.data.DataLoader`` (worker processes) when torch is
importable.  With ``direct`` both open files through :func:`tierfs.direct.open_cached`, the one-line change
that lets a loader read a tierfs mount's cached copies without the FUSE data path.

Run ``python benchmarks/loader.py DIR --compute-ms 1 --passes 3`` for a per-pass table of one directory
(``--drop-caches`` between passes needs root).
"""

from __future__ import annotations

import argparse
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tierfs.direct import open_cached
from tierfs.loaders import Sample, read_plan, read_sample

__all__ = ["LoaderConfig", "PassStats", "RunStats", "ThreadLoader", "TorchLoader", "list_dataset"]

_READ_BLOCK = 1 << 20


def list_dataset(root: Path) -> list[str]:
    """Files under ``root`` as ``ImageFolder`` sees them: sorted class dirs, sorted files; dot-entries skipped.

    One level of class directories plus any files in the root itself (shards), which covers both workloads.
    """
    out: list[str] = []
    with os.scandir(root) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if e.name.startswith("."):
            continue
        if e.is_dir(follow_symlinks=False):
            with os.scandir(e.path) as sub:
                names = sorted(s.name for s in sub if not s.name.startswith(".") and s.is_file(follow_symlinks=False))
            out.extend(f"{e.name}/{n}" for n in names)
        elif e.is_file(follow_symlinks=False):
            out.append(e.name)
    return out


def read_planned(sample: Sample, copied: list[int]) -> int:
    """Read a batch plan's file whole (its copy, checked, or through the mount: ``tierfs.loaders.read_sample``);
    its length.  The position of a file read from its copy is added to ``copied``."""
    data, from_copy = read_sample(sample)
    if from_copy:
        copied.append(sample.index)
    return len(data)


def read_whole(path: str, buf: bytearray, *, direct: bool = False) -> int:
    """Read a file to its end through ``buf`` (unbuffered, 1 MiB reads); returns its length.

    ``direct``: open it with :func:`tierfs.direct.open_cached` (the cached copy itself when the mount lends it).
    """
    n = 0
    view = memoryview(buf)
    with (open_cached(path, "rb", buffering=0) if direct else open(path, "rb", buffering=0)) as f:
        while True:
            k = f.readinto(view)
            if not k:
                return n
            n += k


@dataclass(frozen=True)
class LoaderConfig:
    workers: int = 4
    batch: int = 32
    prefetch: int = 2  # batches per worker in flight, as DataLoader's prefetch_factor
    compute_s: float = 0.0  # per sample
    shuffle: bool = True
    seed: int = 0
    direct: bool = False  # open files with tierfs.direct.open_cached
    plan: bool = False  # read each pass's batch plan (tierfs.loaders.read_plan) and the copies it names


@dataclass(frozen=True)
class PassStats:
    """One pass: what was listed and read, and how long the consumer waited."""

    index: int
    samples: int
    bytes: int
    wall_s: float
    stall_s: float
    list_s: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class RunStats:
    passes: list[PassStats] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(p.samples for p in self.passes)

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.passes)

    @property
    def wall_s(self) -> float:
        return sum(p.wall_s for p in self.passes)

    @property
    def stall_s(self) -> float:
        return sum(p.stall_s for p in self.passes)


class ThreadLoader:
    """Worker threads read files into a bounded queue; the consumer takes batches and computes."""

    name = "threads"

    def __init__(self, root: Path, config: LoaderConfig) -> None:
        self.root = Path(root)
        self.config = config

    def run_pass(self, index: int) -> PassStats:
        cfg = self.config
        t_start = time.perf_counter()
        planned = read_plan(self.root) if cfg.plan else None
        files = list_dataset(self.root) if planned is None else list(range(len(planned.samples)))
        list_s = time.perf_counter() - t_start
        if cfg.shuffle:
            np.random.default_rng((cfg.seed, index)).shuffle(files)
        paths = [os.path.join(self.root, f) for f in files] if planned is None else files
        copied: list[int] = []  # plan positions read from their copies (reported at the pass's end)
        q: queue.Queue[int | BaseException] = queue.Queue(maxsize=max(1, cfg.workers * cfg.prefetch * cfg.batch))
        cursor = iter(range(len(paths)))
        lock = threading.Lock()
        stop = threading.Event()

        def work() -> None:
            buf = bytearray(_READ_BLOCK)
            while not stop.is_set():
                with lock:
                    i = next(cursor, None)
                if i is None:
                    return
                try:
                    if planned is None:
                        item: int | BaseException = read_whole(paths[i], buf, direct=cfg.direct)
                    else:
                        item = read_planned(planned.samples[paths[i]], copied)
                except OSError as exc:
                    item = exc
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.2)
                        break
                    except queue.Full:
                        continue

        threads = [threading.Thread(target=work, daemon=True) for _ in range(cfg.workers)]
        for t in threads:
            t.start()
        stall = 0.0
        nbytes = 0
        try:
            for lo in range(0, len(paths), cfg.batch):
                size = min(cfg.batch, len(paths) - lo)
                t0 = time.perf_counter()
                for _ in range(size):
                    item = q.get()
                    if isinstance(item, BaseException):
                        raise item
                    nbytes += item
                stall += time.perf_counter() - t0
                if cfg.compute_s:
                    time.sleep(cfg.compute_s * size)
        finally:
            stop.set()
            for t in threads:
                t.join()
        if planned is not None:
            planned.report(copied)
        return PassStats(index, len(paths), nbytes, time.perf_counter() - t_start, stall, list_s)


class _TorchFiles:
    """A map-style dataset over the listing (defined at module level so worker processes can unpickle it)."""

    def __init__(self, paths: list[str], direct: bool = False) -> None:
        self.paths = paths
        self.direct = direct

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        with (open_cached if self.direct else open)(self.paths[i], "rb", buffering=0) as f:
            return len(f.read())


def _sum_collate(batch: list[int]) -> tuple[int, int]:
    return len(batch), sum(batch)


class TorchLoader:
    """The same pass through ``torch.utils.data.DataLoader`` with worker processes (``shuffle=True``)."""

    name = "torch DataLoader"

    def __init__(self, root: Path, config: LoaderConfig) -> None:
        import torch  # noqa: F401  -- fail at construction, not mid-run

        self.root = Path(root)
        self.config = config

    def run_pass(self, index: int) -> PassStats:
        import torch
        from torch.utils.data import DataLoader

        # torch warns when workers exceed the cores; the benchmark sets the count on purpose
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        cfg = self.config
        t_start = time.perf_counter()
        files = list_dataset(self.root)
        list_s = time.perf_counter() - t_start
        ds = _TorchFiles([os.path.join(self.root, f) for f in files], cfg.direct)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + index)
        dl = DataLoader(
            ds,
            batch_size=cfg.batch,
            shuffle=cfg.shuffle,
            generator=gen,
            num_workers=cfg.workers,
            prefetch_factor=cfg.prefetch if cfg.workers else None,
            collate_fn=_sum_collate,
        )
        stall = 0.0
        samples = nbytes = 0
        it = iter(dl)
        while True:
            t0 = time.perf_counter()
            try:
                n, b = next(it)
            except StopIteration:
                break
            stall += time.perf_counter() - t0
            samples += n
            nbytes += b
            if cfg.compute_s:
                time.sleep(cfg.compute_s * n)
        del it
        return PassStats(index, samples, nbytes, time.perf_counter() - t_start, stall, list_s)


def run_samples(
    loader: ThreadLoader | TorchLoader,
    samples: int,
    *,
    before_pass: Callable[[int], object] | None = None,
    after_pass: Callable[[PassStats], object] | None = None,
    max_passes: int = 10_000,
) -> RunStats:
    """Run passes until at least ``samples`` samples were consumed (an epoch-equivalent is the dataset's count).

    ``before_pass(i)`` runs outside the timed region (dropping caches, reading counters).
    """
    stats = RunStats()
    i = 0
    while stats.samples < samples and i < max_passes:
        if before_pass is not None:
            before_pass(i)
        p = loader.run_pass(i)
        if p.samples == 0:
            raise RuntimeError(f"pass {i} over {loader.root} listed no files")
        stats.passes.append(p)
        if after_pass is not None:
            after_pass(p)
        i += 1
    return stats


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Run the benchmark loader over one directory and print each pass.")
    ap.add_argument("root", type=Path)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--compute-ms", type=float, default=0.0, help="compute time per sample, ms")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--torch", action="store_true", help="use torch's DataLoader (worker processes)")
    ap.add_argument("--direct", action="store_true", help="open files with tierfs.direct.open_cached")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before every pass (root)")
    args = ap.parse_args(argv)
    cfg = LoaderConfig(workers=args.workers, batch=args.batch, compute_s=args.compute_ms / 1000, direct=args.direct)
    loader: ThreadLoader | TorchLoader = (TorchLoader if args.torch else ThreadLoader)(args.root, cfg)

    def before(_i: int) -> None:
        if args.drop_caches:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")

    print("| pass | samples | MB | wall s | stall s | samples/s | MB/s |\n|---:|---:|---:|---:|---:|---:|---:|")
    for i in range(args.passes):
        before(i)
        p = loader.run_pass(i)
        print(
            f"| {i} | {p.samples} | {p.bytes / 1e6:.1f} | {p.wall_s:.2f} | {p.stall_s:.2f} | "
            f"{p.samples_per_s:.0f} | {p.bytes / 1e6 / p.wall_s:.1f} |"
        )


if __name__ == "__main__":
    main()

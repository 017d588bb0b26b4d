"""tierfs data-path micro-benchmarks, each against native reads of the same files in the same run.

No slow tier here: this measures what the FUSE layer itself costs.  The backing dir and the cache dir sit on the
same local disk; tierfs is mounted with ``policy=lru, view=full`` and a capacity above the data, so a first read
is a read-through miss that fills the cache and every later read is a hit served from the cache dir.

For 1 and 4 reader threads, on a fresh mount each time:

* ``big first``     a 1 GiB file, page cache dropped, first read through the mount (native: the backing file,
  page cache dropped);
* ``big re-read``   the same file again at once (native: read once more, then timed -- both may be served from RAM);
* ``big cold hit``  page cache dropped, read again through the mount, now a cache hit (native: the cached copy
  in the cache dir, page cache dropped; the backing file if the cache layout cannot be matched);
* ``small first``   N files of ~110 KiB in 50 dirs, page cache, dentries and inodes dropped, listed and read
  once (native: the backing files);
* ``small repeat``  the same files again at once (native: again at once);
* ``small cold hit`` caches dropped, again (native: the cached copies, caches dropped);
* ``... staged``    a first read as a mini-epoch's first pass meets it under MET: the cached copies in RAM (just
  staged), the mount's page cache empty (native: the cached copies, from RAM);
* ``..., direct``   the same with the reader opening files through ``tierfs.direct.open_cached`` (one
  ``getxattr`` through the mount, then the cached copy itself), for every test where the file is cached.
* ``..., plan``     the same through a batch plan (issue 15), as ``tierfs.loaders`` reads it: one read of
  ``/.tierfs/plan`` (the first of a pass: ``next-pass`` before it, untimed), each copy opened and checked with
  ``fstat`` by the reading thread, one ``consumed`` report at the end -- all inside the timed span for the
  small files (the big file's rows leave out the plan's read: one per pass of the whole view, printed on its
  own).  Plan and dataset rows are the best of 5 alternating runs of each side (native, then tierfs), for a
  loaded shared machine.
* ``..., MiniEpochDataset``  one epoch of ``tierfs.torch.MiniEpochDataset`` through a ``DataLoader`` (workers =
  readers) over the mount against the same dataset over a plain directory of the same files; ``(sizes)``: with
  a reader that returns only each file's length (no tensor handed from a worker to the main process).

Native reads of cached files read the cached copies themselves (their paths asked of the mount).

Targets (issue 4): big first >= 1 GiB/s, big re-read >= 0.8 x native; small files >= 3,000 files/s on a first
pass and >= 5,000 files/s repeated.  Issue 15: the batch plan >= 0.9 x native files/s for the small files on
repeated and first (staged) passes with 4 readers, >= 0.95 x native for the big re-read.

``--py-spy FILE`` records the daemon with py-spy while it runs (a speedscope JSON or an SVG flame graph by the
suffix).  Writes ``OUT/datapath.md`` and ``PLOTS/datapath.png`` (``--plots``, default ``--out``); to update the
docs, ``--out benchmarks/results --plots docs/img``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loader import read_whole
from slowtier import GiB, KiB, MiB, Workload, drop_caches, install_sigterm, parse_size, require_root
from tierfs.client import Client
from tierfs.direct import cached_path
from tierfs.loaders import Sample, copy_intact, read_plan, read_sample

_BLOCK = 1 * MiB


@dataclass(frozen=True)
class Row:
    test: str
    threads: int
    tierfs: float  # rate (GiB/s or files/s)
    native: float
    unit: str
    daemon_mib: float = 0.0  # bytes the daemon served during the tierfs measurement (0: all from page cache)

    @property
    def ratio(self) -> float:
        return self.tierfs / self.native if self.native else float("nan")


def read_files(paths: list[str], threads: int, direct: bool = False, samples: list[Sample] | None = None,
               copied: list[int] | None = None) -> float:
    """Read every file whole with ``threads`` threads pulling from a shared cursor; returns seconds.

    ``direct``: open each with ``tierfs.direct.open_cached`` (the cached copy when the mount lends it).
    ``samples``: a plan's files (``paths`` unused): each read as ``tierfs.loaders.read_sample`` reads it, the
    copy checked with ``fstat`` by the reading thread, the path through the mount if it fails; the positions
    read from copies are added to ``copied`` (for the report).
    """
    n = len(paths) if samples is None else len(samples)
    cursor = iter(range(n))
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        buf = bytearray(_BLOCK)
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                return
            try:
                if samples is None:
                    read_whole(paths[i], buf, direct=direct)
                else:
                    _, from_copy = read_sample(samples[i])
                    if from_copy and copied is not None:
                        copied.append(i)
            except OSError as exc:
                errors.append(exc)
                return

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def read_big(path: str, threads: int, direct: bool = False) -> float:
    """Read one file with ``threads`` threads, each ``pread``-ing its contiguous share in 1 MiB blocks.

    ``direct``: each thread opens the cached copy when the mount lends it (``tierfs.direct.cached_path``).
    """
    size = os.stat(path).st_size
    share = -(-size // threads)

    def work(lo: int) -> None:
        fd = os.open((cached_path(path) or path) if direct else path, os.O_RDONLY)
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        try:
            off, hi = lo, min(lo + share, size)
            while off < hi:
                k = os.preadv(fd, [view[: min(_BLOCK, hi - off)]], off)
                if k <= 0:
                    raise OSError(f"short read at {off} of {path}")
                off += k
        finally:
            os.close(fd)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(t * share,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def plan_pass(mnt: Path, prefix: str, threads: int, big: bool = False) -> tuple[float, float]:
    """One pass through a batch plan: read the plan, read the copies of the files under ``prefix`` (through
    the mount where there is none), report them consumed.  Returns the seconds of it all and of the plan's
    read and parse alone (the plan covers the whole view, whatever ``prefix`` selects)."""
    Client(mnt).write("next-pass")  # (untimed) a pass of its own: the plan is the first of its pass, as in training
    t0 = time.perf_counter()
    p = read_plan(mnt, prefix)
    t_plan = time.perf_counter() - t0
    copied: list[int] = []
    if big:
        if copy_intact(p.samples[0]):
            copied.append(0)
        read_big(p.samples[0].copy if copied else p.samples[0].path, threads)
    else:
        read_files([], threads, samples=p.samples, copied=copied)
    p.report(copied)
    return time.perf_counter() - t0, t_plan


def best_of(rounds: int, native: Callable[[], float], tierfs: Callable[[], float]) -> tuple[float, float]:
    """The best rate of each side over ``rounds`` alternating runs (native, then tierfs): on a shared, loaded
    machine a single sample says more about the neighbours than about the data path."""
    n = t = 0.0
    for _ in range(rounds):
        n = max(n, native())
        t = max(t, tierfs())
    return t, n


PLAN_ROUNDS = 5


def _torch_epoch(root: Path, workers: int, sizes_only: bool = False) -> float:
    """Files/s of one epoch of ``tierfs.torch.MiniEpochDataset`` over ``root`` (a mount or a plain dir) through
    a ``DataLoader`` with ``workers`` workers, ``set_epoch`` (the plan's read) and the last report included.

    The default reader returns each file's bytes as a tensor (what a loader hands on; from a worker it crosses
    to the main process through shared memory); ``sizes_only`` reads the file whole and returns its length
    (a reader of paths: the copy checked with ``lstat``), leaving the data path alone in the figure."""
    from torch.utils.data import DataLoader

    from tierfs.torch import MiniEpochDataset

    t0 = time.perf_counter()
    ds = MiniEpochDataset(root, reader=_length if sizes_only else None)
    ds.set_epoch(0)
    n = sum(len(b) for b in DataLoader(ds, batch_size=64, num_workers=workers, collate_fn=lambda b: b))
    ds.close()
    return n / (time.perf_counter() - t0)


def _length(path: str) -> int:
    with open(path, "rb", buffering=0) as f:
        return len(f.readall())


def _torch_or_none() -> Callable[[Path, int], float] | None:
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    return _torch_epoch


torch_epoch = _torch_or_none()


def listing(root: Path) -> list[str]:
    """List like a loader does (so the mount sees the opendir/readdir/lookup traffic too)."""
    from loader import list_dataset

    return [os.path.join(root, f) for f in list_dataset(root)]


def find_cached_copies(mnt: Path, rels: list[str]) -> dict[str, str]:
    """Map dataset-relative paths to their cached copies in the cache dir (asked of the mount); missing: absent."""
    found: dict[str, str] = {}
    for rel in rels:
        copy = cached_path(mnt / rel)
        if copy is not None:
            found[rel] = copy
    return found


@contextlib.contextmanager
def py_spy(pid: int, out: Path | None) -> Iterator[None]:
    """Record ``pid`` with py-spy for the duration, if asked and available."""
    if out is None:
        yield
        return
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not os.path.exists(exe):
        print("py-spy not found (pip install py-spy): not profiling", file=sys.stderr)
        yield
        return
    fmt = "speedscope" if out.suffix == ".json" else "flamegraph"
    proc = subprocess.Popen(
        [exe, "record", "-p", str(pid), "-o", str(out), "-f", fmt, "--threads", "-r", "200"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(args: argparse.Namespace) -> list[Row]:
    from tqdm import tqdm

    from tierfs.testing.harness import mounted

    base = args.workdir / f"datapath-{os.getpid()}"
    backing, mnt = base / "backing", base / "mnt"
    rows: list[Row] = []
    try:
        backing.mkdir(parents=True)
        mnt.mkdir()
        small = Workload("small", args.small_files, 110 * KiB, classes=50, jitter=0.2)
        small.populate(backing / "small")
        Workload("big", 1, args.big_size).populate(backing / "big")
        data = small.total_bytes + args.big_size
        big_rel = "big/" + Workload("big", 1, args.big_size).paths()[0]
        for threads in tqdm(args.threads, desc="thread counts"):
            cache = base / f"cache-{threads}"
            mount_opts = {"policy": "lru", "view": "full", **dict(o.split("=", 1) for o in args.option)}
            with mounted(backing, mnt, cache, int(data * 2.5) + 4 * GiB, timeout=120, **mount_opts) as m:
                spy_out = None
                if args.py_spy is not None:
                    spy_out = args.py_spy.with_name(f"{args.py_spy.stem}-t{threads}{args.py_spy.suffix}")
                with py_spy(m.process.pid, spy_out):
                    served = lambda: int(m.status().get("served_bytes", 0))  # noqa: E731
                    rows += _small(mnt, backing, threads, served)
                    rows += _big(mnt, backing, big_rel, threads, args.big_size, served)
                status = m.status()
                plan_s = min(plan_pass(mnt, "none/", threads)[1] for _ in range(PLAN_ROUNDS))
            print(f"threads={threads}: reading and parsing a plan of {status.get('view_files')} files: "
                  f"{plan_s * 1e3:.1f} ms (best of {PLAN_ROUNDS})")
            print(
                f"threads={threads}: hits {status.get('reads', {}).get('hits')}, misses "
                f"{status.get('reads', {}).get('misses')}, backing_bytes_read {status.get('backing_bytes_read')}"
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return rows


def _small(mnt: Path, backing: Path, threads: int, served: Callable[[], int]) -> list[Row]:
    def again(root: Path, cold: bool, direct: bool = False) -> float:
        if cold:
            drop_caches(3)
        t0 = time.perf_counter()
        paths = listing(root / "small")
        return len(paths) / (time.perf_counter() - t0 + read_files(paths, threads, direct))

    def on_mount(cold: bool, direct: bool = False) -> tuple[float, float]:
        s0 = served()
        rate = again(mnt, cold, direct)
        return rate, (served() - s0) / MiB

    def planned(native: Callable[[], float]) -> tuple[float, float, float]:
        s0 = served()
        n_files = len(listing(backing / "small"))
        t, n = best_of(PLAN_ROUNDS, native, lambda: n_files / plan_pass(mnt, "small/", threads)[0])
        return t, n, (served() - s0) / MiB

    # order matters: every cold measurement drops the caches of both sides, so each repeat follows its own
    # first pass directly (native first, then the mount's first and repeat, then native warmed and repeated)
    rows = []
    n = again(backing, True)
    (t, mib) = on_mount(True)
    rows.append(Row("small first", threads, t, n, "files/s", mib))
    (t, mib) = on_mount(False)
    again(backing, False)
    n = again(backing, False)
    rows.append(Row("small repeat", threads, t, n, "files/s", mib))
    (t, mib) = on_mount(False, direct=True)
    rows.append(Row("small repeat, direct", threads, t, n, "files/s", mib))
    t, nat, mib = planned(lambda: again(backing, False))
    rows.append(Row("small repeat, plan", threads, t, nat, "files/s", mib))
    rels = [os.path.relpath(p, backing) for p in listing(backing / "small")]
    copies = find_cached_copies(mnt, rels)
    assert len(copies) == len(rels), "every file was read through, so every one should be cached"
    own = [copies[r] for r in rels]
    drop_caches(3)
    nat = len(rels) / read_files(own, threads)
    t, mib = on_mount(True)
    rows.append(Row("small cold hit", threads, t, nat, "files/s", mib))
    t, mib = on_mount(True, direct=True)
    rows.append(Row("small cold hit, direct", threads, t, nat, "files/s", mib))
    # as a mini-epoch's first pass finds it under MET: the copies just staged (in RAM), the mount's cache empty
    for direct in (False, True):
        drop_caches(3)
        read_files(own, threads)
        nat = len(rels) / read_files(own, threads)
        t, mib = on_mount(False, direct)
        rows.append(Row("small first, staged" + (", direct" if direct else ""), threads, t, nat, "files/s", mib))

    def staged_native() -> float:
        drop_caches(3)  # (the mount's pages go too: each plan round meets the copies as staging leaves them)
        read_files(own, threads)
        return len(rels) / read_files(own, threads)

    t, nat, mib = planned(staged_native)
    rows.append(Row("small first, staged, plan", threads, t, nat, "files/s", mib))
    if torch_epoch is not None:
        # the PyTorch dataset over the mount (a plan per epoch) against the same dataset over a plain directory
        # of the same files (the backing dir, warm); DataLoader workers = reader threads
        for sizes_only in (False, True):
            t, nat = best_of(PLAN_ROUNDS, lambda s=sizes_only: torch_epoch(backing / "small", threads, s),
                             lambda s=sizes_only: torch_epoch(mnt / "small", threads, s))
            rows.append(Row("small repeat, MiniEpochDataset" + (" (sizes)" if sizes_only else ""), threads, t, nat,
                            "files/s"))
    return rows


def _big(
    mnt: Path, backing: Path, rel: str, threads: int, size: int, served: Callable[[], int]
) -> list[Row]:
    gib = size / GiB

    def rate(path: Path | str, cold: bool, direct: bool = False) -> float:
        if cold:
            drop_caches(1)
        return gib / read_big(str(path), threads, direct)

    def on_mount(cold: bool, direct: bool = False) -> tuple[float, float]:
        s0 = served()
        r = rate(mnt / rel, cold, direct)
        return r, (served() - s0) / MiB

    def planned(native: Callable[[], float]) -> tuple[float, float, float]:
        # (the plan's own read is left out here: it is one per pass of the whole view, 2,001 files, not this
        # file's cost; the small-file rows carry it, and the run prints it)
        s0 = served()

        def one() -> float:
            total, t_plan = plan_pass(mnt, rel, threads, big=True)
            return gib / (total - t_plan)

        t, n = best_of(PLAN_ROUNDS, native, one)
        return t, n, (served() - s0) / MiB

    n = rate(backing / rel, True)
    (t, mib) = on_mount(True)
    rows = [Row("big first", threads, t, n, "GiB/s", mib)]
    from tierfs.testing.harness import wait_until

    # (an LRU miss over 1 MiB is served from the backing while its copy is made: the re-reads want the copy)
    wait_until(lambda: cached_path(mnt / rel) is not None, timeout=600, what="the big file's copy")
    (t, mib) = on_mount(False)
    (td, mibd) = on_mount(False, direct=True)
    rate(backing / rel, False)
    n = rate(backing / rel, False)
    rows.append(Row("big re-read", threads, t, n, "GiB/s", mib))
    rows.append(Row("big re-read, direct", threads, td, n, "GiB/s", mibd))
    tp, np_, mibp = planned(lambda: rate(backing / rel, False))
    rows.append(Row("big re-read, plan", threads, tp, np_, "GiB/s", mibp))
    copy = find_cached_copies(mnt, [rel])[rel]
    n = rate(copy, True)
    (t, mib) = on_mount(True)
    rows.append(Row("big cold hit", threads, t, n, "GiB/s", mib))
    (t, mib) = on_mount(True, direct=True)
    rows.append(Row("big cold hit, direct", threads, t, n, "GiB/s", mib))
    # a first read as under MET: the copy just staged (in RAM), the mount's page cache empty
    for direct in (False, True):
        drop_caches(1)
        rate(copy, False)
        n = rate(copy, False)
        (t, mib) = on_mount(False, direct)
        rows.append(Row("big first, staged" + (", direct" if direct else ""), threads, t, n, "GiB/s", mib))

    def staged_native() -> float:
        drop_caches(1)
        rate(copy, False)
        return rate(copy, False)

    t, n, mib = planned(staged_native)
    rows.append(Row("big first, staged, plan", threads, t, n, "GiB/s", mib))
    return rows


def report(rows: list[Row], args: argparse.Namespace) -> str:
    lines = [
        f"Command: `python benchmarks/datapath.py {' '.join(sys.argv[1:])}`  ",
        f"Machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at the end; {args.small_files} small files "
        f"of ~110 KiB, a {args.big_size / GiB:g} GiB file; backing and cache on the same local disk",
        "",
        "| test | threads | tierfs | native | tierfs ÷ native | MiB via daemon | target |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    targets = {
        "big first": lambda r: f"≥ 1 GiB/s: {'met' if r.tierfs >= 1 else 'not met'}",
        "big re-read": lambda r: f"≥ 0.8 × native: {'met' if r.ratio >= 0.8 else 'not met'}",
        "small first": lambda r: f"≥ 3,000 files/s: {'met' if r.tierfs >= 3000 else 'not met'}",
        "small repeat": lambda r: f"≥ 5,000 files/s: {'met' if r.tierfs >= 5000 else 'not met'}",
    }
    plan_targets = {"small repeat": 0.9, "small first": 0.9, "big re-read": 0.95}
    for r in rows:
        spec = ".2f" if r.unit == "GiB/s" else ",.0f"
        kind = r.test.split(",")[0]
        tgt = targets[kind](r) if kind in targets else ""
        if "MiniEpochDataset" in r.test:
            tgt = f"within 10 % of a plain dir: {'met' if r.ratio >= 0.9 else 'not met'}"
        elif r.test.endswith(", plan") and kind in plan_targets:
            want = plan_targets[kind]
            tgt = f"≥ {want} × native{' (4 readers)' if kind.startswith('small') else ''}: " + (
                "met" if r.ratio >= want else "not met") if (r.threads == 4 or kind == "big re-read") else ""
        lines.append(
            f"| {r.test} | {r.threads} | {format(r.tierfs, spec)} {r.unit} | {format(r.native, spec)} {r.unit} | "
            f"{r.ratio:.2f} | {r.daemon_mib:.0f} | {tgt} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], out: Path) -> None:
    import matplotlib.pyplot as plt

    fig = figure(rows)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def figure(rows: list[Row]):
    """Horizontal bars, one pair per test: the tests' names are long, so they go on the y axis, one per line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = ("GiB/s", "files/s")
    counts = [sum(r.unit == u for r in rows) for u in units]
    fig, axes = plt.subplots(2, 1, figsize=(11.5, 1.2 + 0.3 * sum(counts)), height_ratios=[max(1, c) for c in counts])
    for ax, unit in zip(axes, units, strict=True):
        sel = [r for r in rows if r.unit == unit]
        y = [len(sel) - 1 - i for i in range(len(sel))]  # the table's order, top down
        ax.barh([i + 0.2 for i in y], [r.tierfs for r in sel], 0.4, label="tierfs")
        ax.barh([i - 0.2 for i in y], [r.native for r in sel], 0.4, label="native", color="tab:gray")
        ax.set_yticks(y, [f"{r.test}, {r.threads} thr" for r in sel], fontsize=8)
        ax.set_xlabel(unit)
        if unit == "GiB/s":
            ax.axvline(1, color="tab:red", ls="--", lw=1, label="1 GiB/s target")
        else:
            ax.axvline(3000, color="tab:red", ls="--", lw=1, label="3,000 files/s")
            ax.axvline(5000, color="tab:orange", ls="--", lw=1, label="5,000 files/s")
        ax.set_xscale("log")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle("tierfs data path vs native reads of the same files")
    fig.tight_layout()
    return fig


def rows_of_table(text: str) -> list[Row]:
    """The rows of a ``datapath.md`` this program wrote (``--replot``: draw a plot again without measuring)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 6 or not cells[1].isdigit():
            continue
        (tierfs, unit), (native, _) = (c.replace(",", "").split(" ", 1) for c in cells[2:4])
        rows.append(Row(cells[0], int(cells[1]), float(tierfs), float(native), unit, float(cells[5] or 0)))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small-files", type=int, default=5000, help="number of ~110 KiB files (5000)")
    ap.add_argument("--big-size", type=parse_size, default=GiB, help="size of the big file (1G)")
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4], help="1,4")
    ap.add_argument("-o", "--option", action="append", default=[], help="extra mount option KEY=VALUE")
    ap.add_argument("--py-spy", type=Path, default=None, help="profile the daemon into this file (.svg/.json)")
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/tierfs-bench"))
    ap.add_argument("--out", type=Path, default=Path("bench-out/datapath"),
                    help="the table (benchmarks/results: on purpose)")
    ap.add_argument("--plots", type=Path, default=None, help="the plot (default: --out); docs/img: on purpose")
    ap.add_argument("--replot", type=Path, default=None, metavar="TABLE.md",
                    help="draw PLOTS/datapath.png again from a table this program wrote, measuring nothing")
    args = ap.parse_args(argv)
    args.plots = args.plots or args.out
    if args.replot:
        args.plots.mkdir(parents=True, exist_ok=True)
        plot(rows_of_table(args.replot.read_text()), args.plots / "datapath.png")
        return
    require_root()
    install_sigterm()
    rows = run(args)
    text = report(rows, args)
    print("\n" + text)
    for folder in (args.out, args.plots):
        folder.mkdir(parents=True, exist_ok=True)
    (args.out / "datapath.md").write_text(text + "\n")
    plot(rows, args.plots / "datapath.png")
    print(f"wrote {args.out / 'datapath.md'} and {args.plots / 'datapath.png'}")


if __name__ == "__main__":
    main()

"""The training loop as people write it, over a tierfs mount and over a plain directory holding the same files.

A ``torch.utils.data.DataLoader`` (``--workers``, batch ``--batch``) decodes small JPEGs (PIL) into
``3 x 128 x 128`` ``uint8`` tensors (a random crop and flip of a 160 x 160 image) in class folders; the consumer
takes the batches (no model: the loader's speed is the point; ``--step-ms`` adds a sleep per batch for one).
Each way of writing the loop runs over a fresh mount (``--nm`` each, ``rf`` 4, the cache capped at
``--cap-fraction`` of the data, at least the two mini-epochs the mount requires: twice the data at ``nm`` 1) and, right
before, the same loop over the plain directory the mount shows (its backing dir), so the two see the same load;
``--rounds`` repeats everything, and each figure is the median (and spread) of the rounds' mount / plain ratios.
The ways (issue 23):

* ``relist``: the README's way -- the dataset built again every pass and a new ``DataLoader`` over it (its
  workers start again every pass; ``persistent_workers`` cannot be used).  On the plain dir: the same loop,
  one pass = the whole data set.
* ``minepoch``: ``tierfs.torch.MiniEpochDataset`` (``set_epoch`` every pass, cached copies read directly, new
  workers every pass).  On the plain dir: the same class (every file every pass).
* ``sampler``: the dataset built once over a ``listing=all`` mount, ``tierfs.torch.MountSampler``,
  ``persistent_workers=True``: a ``DataLoader`` epoch is a tierfs pass.  On the plain dir: the dataset built
  once, ``shuffle=True``, ``persistent_workers=True`` (the loop the sampler is one line away from).
* ``substitute``: the dataset built once, ``shuffle=True``, ``persistent_workers=True``, no sampler, on a
  ``listing=all,substitute`` mount.  On the plain dir: the same loop.

Each pair runs the plain dir's loop and the mount's alternately, ``--chunks`` times each, a chunk being a data
set's worth of samples in whole DataLoader epochs (one epoch of the plain dir, ``nm`` passes of the mount), so a
change of the box's load hits both alike.  The clock runs over the chunks only: not over the plain side's first
batch (its workers' first start) nor the mount's first pass (the first mini-epoch, staged as it mounted).  The
load average is recorded with every chunk: the box is shared, so only the paired ratios mean much.  Each row keeps
every chunk's clock time and the ratio of each mount chunk to the plain chunk just before it (``pair_ratios``:
the table's "chunk pairs" spread), and the share of the loop's CPUs that sat idle in each chunk (``/proc/stat``):
on a CPU-bound loop the plain dir leaves none, and what the mount leaves is its workers waiting on the daemon --
a cost the host's speed, which moves both sides' samples/s by ±10 % between chunks, does not blur.

What the mount costs, taken apart: the mount's daemon CPU per sample (beside the CPU of the whole loop); the
**epoch-boundary stall** of each side (from the start of each DataLoader epoch to its first batch, summed, as a
share of the loop: with as many workers as batches in a pass it is most of the pass, as the workers deliver
together); and for the sampler at ``nm`` > 1 a third side, the **plain dir in passes** (the same loop over the
plain dir, each DataLoader epoch a random ``nm``-th of it, :class:`PassSized`): its ratio to the plain dir is what
the pipeline draining at every pass boundary costs by itself, the mount's ratio to it what the mount costs beyond
that.  ``--pin on`` models a node with a core to spare for the daemon, applied alike to both sides: the loop (this
process and its workers) on every CPU but the first, the daemon (``taskset``) on the first, ahead of the box's
other processes there (``nice`` ``DAEMON_NICE``: as near a core of its own as a shared box gets); ``--pin both``
runs each pair both ways.  ``--files`` sets the data set's size (a pass is ``files / nm`` samples; 20,480 files make
20 batches of 64 a pass at ``nm`` 16); ``--data DIR`` keeps the data set for the next run.

``python benchmarks/loop.py`` is the full run (writes bench-out/loop.json and loop.png; on purpose, ``--out`` into
benchmarks/results and ``--plot`` into docs/img); docs/benchmarks.md's headline is ``--transform imagenet --files
6144 --nm 6,16 --ways sampler,substitute --workers 4,8 --rounds 1 --chunks 6 --pin on`` (~50 min on a 2-core box);
``--quick`` is a short one (fewer files, one worker count, one round: a look, not a figure).  Needs torch and PIL.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dslide.mpirun import descendants  # noqa: E402
from tierfs.testing.harness import mounted, process_cpu  # noqa: E402

WAYS = ("relist", "minepoch", "sampler", "substitute")
#: mount options of each way (besides nm and rf)
MOUNT_OPTIONS: dict[str, dict[str, object]] = {
    "relist": {},
    "minepoch": {},
    "sampler": {"listing": "all"},
    "substitute": {"listing": "all", "substitute": True},
}
SIZE, CROP = 160, 128
#: ``--transform imagenet``: photos of ImageNet's typical size, and its training transform (a random-resized crop
#: to 224, a flip, float and normalised): a decode that costs what a real vision loader's does
IMAGENET_SIZE, IMAGENET_CROP = (500, 375), 224
TRANSFORM = "small"
#: ``--open``: how a worker opens a file (see :func:`read_bytes`)
OPEN = "python"


def make_data(root: Path, files: int, classes: int = 10, seed: int = 0) -> int:
    """``files`` JPEGs (``SIZE`` x ``SIZE``, a gradient and noise: 20-30 KB each; ImageNet-sized under
    ``--transform imagenet``: 100-150 KB) in ``classes`` folders."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = IMAGENET_SIZE if TRANSFORM == "imagenet" else (SIZE, SIZE)
    y, x = np.mgrid[0:h, 0:w]
    total = 0
    for i in range(files):
        d = root / f"class_{i % classes:02d}"
        d.mkdir(parents=True, exist_ok=True)
        a, b, c = rng.integers(1, 4, 3)
        img = np.stack([x * a, y * b, (x + y) * c], -1) + rng.integers(0, 64, (h, w, 3))
        path = d / f"img_{i:06d}.jpg"
        Image.fromarray((img % 256).astype(np.uint8)).save(path, "JPEG", quality=90)
        total += path.stat().st_size
    return total


def decode(data: Any) -> Any:
    """JPEG bytes (a ``uint8`` tensor or ``bytes``) -> a ``3 x CROP x CROP`` ``uint8`` tensor, cropped and
    flipped at random (as a training transform would)."""
    import torch
    from PIL import Image

    raw = data.numpy().tobytes() if isinstance(data, torch.Tensor) else data
    if TRANSFORM == "imagenet":
        return _imagenet_transform(Image.open(io.BytesIO(raw)).convert("RGB"))
    img = np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"))
    top, left = np.random.randint(0, SIZE - CROP + 1, 2)
    img = img[top:top + CROP, left:left + CROP]
    if np.random.rand() < 0.5:
        img = img[:, ::-1]
    return torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)


def _imagenet_transform(img: Any) -> Any:
    """torchvision's ImageNet training transform, written out (torchvision does not import beside this torch):
    RandomResizedCrop(224) (8-100 % of the area, aspect 3/4-4/3), a flip, float in [0, 1], normalised."""
    import math

    import torch
    from PIL import Image

    w, h = img.size
    for _ in range(10):
        area = w * h * np.random.uniform(0.08, 1.0)
        aspect = math.exp(np.random.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            left, top = np.random.randint(0, w - cw + 1), np.random.randint(0, h - ch + 1)
            break
    else:
        cw = ch = min(w, h)
        left, top = (w - cw) // 2, (h - ch) // 2
    img = img.resize((IMAGENET_CROP, IMAGENET_CROP), Image.BILINEAR, box=(left, top, left + cw, top + ch))
    if np.random.rand() < 0.5:
        img = img.transpose(Image.FLIP_LEFT_RIGHT)
    t = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    return (t - mean) / std


def read_bytes(path: str) -> bytes:
    # --open python: as the running Python opens a file, which up to 3.13 asks it whether it is a terminal (an
    # ioctl that FUSE hands to the daemon: one request more a file); no-isatty: as 3.14 opens a regular file
    with open(path, "rb", buffering=-1 if OPEN == "python" else io.DEFAULT_BUFFER_SIZE) as f:
        return f.read()


class Images:
    """An ImageFolder of JPEGs (sorted class folders, sorted files, ``(path, class)`` in ``.samples``, a file read
    by ``self.loader(path)`` as torchvision's reads it), built when constructed: what a training script builds
    once before its epoch loop."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        root = os.fspath(root)
        self.loader = read_bytes
        self.classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        self.samples = [(os.path.join(root, c, n), i) for i, c in enumerate(self.classes)
                        for n in sorted(os.listdir(os.path.join(root, c)))]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        path, label = self.samples[i]
        return decode(self.loader(path)), label


def _loader(ds: Any, args: argparse.Namespace, workers: int, **kw: Any) -> Any:
    from torch.utils.data import DataLoader

    return DataLoader(ds, batch_size=args.batch, num_workers=workers, **kw)


class PassSized:
    """A sampler over a plain dir's dataset whose every ``iter()`` is one ``nm``-th of the data set (the next
    slice of a shuffle drawn every ``nm`` epochs): the sampler's loop with the mount's pass-sized DataLoader
    epochs and no mount -- what the pipeline draining at every epoch boundary costs by itself."""

    def __init__(self, n: int, nm: int, seed: int) -> None:
        self.n, self.nm, self.seed, self.epoch = n, nm, seed, 0

    def __iter__(self) -> Iterator[int]:
        order = np.random.default_rng((self.seed, self.epoch // self.nm)).permutation(self.n)
        part = np.array_split(order, self.nm)[self.epoch % self.nm]
        self.epoch += 1
        return iter(part.tolist())

    def __len__(self) -> int:
        return len(np.array_split(np.arange(self.n), self.nm)[self.epoch % self.nm])


def _epochs(way: str, root: Path, mounted_: bool, args: argparse.Namespace, workers: int,
            pass_sized: int = 0) -> Iterator[Any]:
    """The loop of ``way``: yields one iterable of batches per DataLoader epoch (a pass on the mount);
    ``pass_sized``: the sampler's loop on the plain dir in epochs of a ``pass_sized``-th of the data
    (:class:`PassSized`)."""
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    if way == "relist":
        while True:
            yield _loader(Images(root), args, workers, shuffle=True, generator=gen)
    elif way == "minepoch":
        from tierfs.torch import MiniEpochDataset

        ds = MiniEpochDataset(root, transform=decode)
        try:
            for e in range(1 << 30):
                ds.set_epoch(e)
                yield _loader(ds, args, workers, shuffle=True, generator=gen)
        finally:
            ds.close()
    else:
        ds = Images(root)
        if way == "sampler" and mounted_:
            from tierfs.torch import MountSampler

            loader = _loader(ds, args, workers, sampler=MountSampler(ds), persistent_workers=True)
        elif pass_sized:
            loader = _loader(ds, args, workers, sampler=PassSized(len(ds), pass_sized, args.seed),
                             persistent_workers=True)
        else:  # the plain dir's loop for both, and substitution's on the mount: no change to the script
            loader = _loader(ds, args, workers, shuffle=True, generator=gen, persistent_workers=True)
        while True:
            yield loader


class _Side:
    """One side of a pair (the plain dir or the mount): its loop, and the samples and seconds timed so far.

    ``stall_s``: the seconds from the start of each timed DataLoader epoch (right after the last batch of the one
    before, or the start of a chunk) to its first batch -- the pipeline refilling at every epoch boundary, a
    tierfs pass on the mount, a whole data set on the plain dir; of it, ``iter_ms`` (median) is ``iter(loader)``
    itself, the sampler's ``iter()`` among it (on the mount: the next pass read, unless read ahead)."""

    def __init__(self, way: str, root: Path, mounted_: bool, args: argparse.Namespace, workers: int, *,
                 daemon: int | None = None, pass_sized: int = 0) -> None:
        self.epochs = _epochs(way, root, mounted_, args, workers, pass_sized)
        self.daemon = daemon
        self.samples = self.passes = 0
        self.seconds = self.cpu_s = self.stall_s = self.daemon_cpu_s = 0.0
        self.chunk_rates: list[float] = []  # (samples/s of each chunk: paired with the other sides' in the JSON)
        self.chunk_times: list[tuple[float, float]] = []  # (each chunk's clock time, start and end: seconds UTC)
        self.chunk_idle: list[float] = []  # (the share of the loop's CPUs idle in each chunk)
        self.idle_ticks = self.all_ticks = 0
        self.loads: list[float] = []
        self.iter_s: list[float] = []  # seconds iter(loader) took, each timed DataLoader epoch
        self.step_s = args.step_ms / 1e3
        self.started = False

    def chunk(self, budget: int) -> None:
        """Whole DataLoader epochs until ``budget`` samples; timed from the start of the chunk, except the very
        first chunk: from its first batch (the workers' first start is not counted)."""
        self.loads.append(os.getloadavg()[0])
        cpu0, daemon0, t0, samples = _cpu(), _proc_cpu(self.daemon), time.perf_counter(), 0
        cpus = os.sched_getaffinity(0)
        idle0, all0 = cpu_ticks(cpus)
        while samples < budget:
            asked, first = time.perf_counter(), True
            batches = iter(next(self.epochs))  # (starts the DataLoader epoch: the sampler's iter() included)
            if self.started:
                self.iter_s.append(time.perf_counter() - asked)
            for x, _y in batches:
                if not self.started:
                    self.started, t0 = True, time.perf_counter()
                    first = False
                else:
                    samples += len(x)
                if first:
                    self.stall_s += time.perf_counter() - asked
                    first = False
                if self.step_s:
                    time.sleep(self.step_s)  # (the model's step on an accelerator: the loader works meanwhile)
            self.passes += 1
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        self.chunk_rates.append(samples / seconds)
        self.chunk_times.append((time.time() - seconds, time.time()))
        idle1, all1 = cpu_ticks(cpus)
        self.chunk_idle.append((idle1 - idle0) / max(1, all1 - all0))
        self.idle_ticks += idle1 - idle0
        self.all_ticks += all1 - all0
        self.cpu_s += _cpu() - cpu0
        self.daemon_cpu_s += _proc_cpu(self.daemon) - daemon0
        self.samples += samples

    def result(self) -> dict:
        self.epochs.close()  # (a loop's loader and its persistent workers go with it)
        return {"samples": self.samples, "passes": self.passes, "seconds": self.seconds,
                "samples_per_s": self.samples / self.seconds, "cpu_s": self.cpu_s,
                "stall_s": self.stall_s, "stall_share": self.stall_s / self.seconds,
                "iter_ms": 1e3 * statistics.median(self.iter_s) if self.iter_s else None,
                "daemon_cpu_ms_per_sample": 1e3 * self.daemon_cpu_s / self.samples, "chunk_rates": self.chunk_rates,
                "cpu_ms_per_sample": 1e3 * self.cpu_s / self.samples, "loads": self.loads,
                "chunk_times": self.chunk_times, "chunk_idle": self.chunk_idle,
                "idle_share": self.idle_ticks / max(1, self.all_ticks)}




def cpu_ticks(cpus: set[int]) -> tuple[int, int]:
    """Clock ticks of ``cpus`` since boot (/proc/stat): (idle, all).  Over a chunk, the idle share of the loop's
    CPUs is the time every one of its processes waited (on the plain dir: next to none; on the mount: its
    requests to the daemon), whatever speed the box's host gave the CPUs meanwhile."""
    idle = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
                idle += ticks[3] + ticks[4]
                total += sum(ticks)
    return idle, total


def _proc_cpu(pid: int | None) -> float:
    """CPU seconds of process ``pid`` (all its threads; 0 for None)."""
    return 0.0 if pid is None else sum(process_cpu(pid))


def _cpu() -> float:
    """CPU seconds of this process, its reaped children, and every live descendant (the DataLoader's workers,
    the mount's daemon): all the CPU the loop and the mount cost, whatever else the box runs."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    for pid in descendants(os.getpid()):  # (walked down from this process: no other process is read)
        with suppress(OSError):  # (one that exited meanwhile)
            total += sum(process_cpu(pid))
    return total


def run_pair(way: str, data: Path, m: Any, args: argparse.Namespace, workers: int, n_files: int, nm: int) -> dict[
        str, dict]:
    """The loop of ``way`` over the plain dir and over the mount ``m``, ``args.chunks`` times each, alternating
    (plain, mount, plain, ...), each chunk a data set's worth of samples in whole DataLoader epochs; the mount's
    first pass (the first mini-epoch staged at the start) is not timed.  The sampler's at ``nm`` > 1 has a third
    side between them, ``passes``: the plain dir in the mount's pass-sized epochs (:class:`PassSized`)."""
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # more workers than cores: on purpose
    sides = {"plain": _Side(way, data, False, args, workers)}
    if way == "sampler" and nm > 1:
        sides["passes"] = _Side(way, data, False, args, workers, pass_sized=nm)
    sides["mount"] = _Side(way, Path(m.mountpoint), True, args, workers, daemon=m.process.pid)
    for _batch in next(sides["mount"].epochs):  # the first pass (staged as the mount started; the workers start)
        pass
    sides["mount"].started = True
    for _ in range(args.chunks):
        for side in sides.values():
            side.chunk(n_files)
    return {name: side.result() for name, side in sides.items()}


def cpu_sets() -> tuple[set[int], set[int]]:
    """``--pin``'s CPU sets: (the loop's -- this process, its DataLoader workers --, the daemon's): the daemon
    one CPU of its own, the loop the others (on a 2-core box {1} and {0})."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        raise SystemExit(f"--pin needs 2 CPUs or more, this process may run on {len(allowed)}")
    daemon = {min(allowed)}
    return allowed - daemon, daemon


#: ``--pin``: the daemon's nice value on its CPU.  On a shared box other processes run on that CPU too, and the
#: daemon, waiting its turn among them, would serve each request late; ahead of them it has the CPU whenever a
#: request comes, as a core of its own would give it.  The loop keeps its priority on both sides.
DAEMON_NICE = -10


@contextmanager
def _pinned(pin: bool, everything: set[int]) -> Iterator[tuple[str, ...]]:
    """Run the loop (this process and the workers it forks) on the loop's CPUs under ``pin``, else on every
    CPU; yields the daemon's ``mounted(wrapper=...)``: under ``pin`` ``taskset`` onto the daemon's CPU, at
    ``DAEMON_NICE``."""
    loop_cpus, daemon_cpus = cpu_sets() if pin else (everything, everything)
    os.sched_setaffinity(0, loop_cpus)
    try:
        yield (("taskset", "-c", ",".join(map(str, sorted(daemon_cpus))), "nice", "-n", str(DAEMON_NICE))
               if pin else ())
    finally:
        os.sched_setaffinity(0, everything)


@contextmanager
def _mount(data: Path, work: Path, way: str, nm: int, cap: int, wrapper: tuple[str, ...]) -> Iterator[Any]:
    mnt, cache = work / "mnt", work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    mnt.mkdir(exist_ok=True)
    cache.mkdir()
    with mounted(data, mnt, cache, str(cap), timeout=120, env={"PYTHONPATH": str(ROOT)}, wrapper=wrapper, nm=nm,
                 rf=4, **MOUNT_OPTIONS[way]) as m:
        yield m


def _status(m: Any) -> dict:
    with open(m.path(".tierfs", "status"), "rb") as f:
        return json.loads(f.read())


def measure(args: argparse.Namespace, data: Path, work: Path, n_files: int, disk: int) -> Iterator[dict]:
    """Each pair's row as it is measured."""
    everything = os.sched_getaffinity(0)
    for rnd in range(args.rounds):
        for nm in args.nm:
            # (a mini-epoch must fit in half the cache: at nm 1 the cache holds twice the data; copies of small
            # files take whole blocks, 15 % over their backing's blocks here)
            cap = int(disk * max(args.cap_fraction, 2 / nm) * 1.15)
            for way in args.ways:
                for workers in args.workers:
                    for pin in args.pin:
                        with _pinned(pin, everything) as wrapper, _mount(data, work, way, nm, cap, wrapper) as m:
                            cpus = {"loop": sorted(os.sched_getaffinity(0)),
                                    "daemon": sorted(os.sched_getaffinity(m.process.pid)),
                                    "daemon_nice": os.getpriority(os.PRIO_PROCESS, m.process.pid)}
                            sides = run_pair(way, data, m, args, workers, n_files, nm)
                            st = _status(m)
                        plain, mount = sides["plain"], sides["mount"]
                        row = {"round": rnd, "nm": nm, "way": way, "workers": workers, "pinned": pin, "cpus": cpus,
                               **sides,
                               "ratio": mount["samples_per_s"] / plain["samples_per_s"],
                               "cpu_ratio": plain["cpu_ms_per_sample"] / mount["cpu_ms_per_sample"],
                               # each chunk of the mount against the plain dir's chunk just before it
                               "pair_ratios": [m_ / p_ for p_, m_ in zip(plain["chunk_rates"], mount["chunk_rates"],
                                                                          strict=True)],
                               "status": {k: st.get(k) for k in ("epoch", "mini_epoch", "pass", "passes_total",
                                                                  "hits", "misses", "backing_bytes_read")}}
                        if "passes" in sides:  # (the drain alone; the mount against the same epochs)
                            row["drain_ratio"] = sides["passes"]["samples_per_s"] / plain["samples_per_s"]
                            row["ratio_to_passes"] = mount["samples_per_s"] / sides["passes"]["samples_per_s"]
                        loads = plain["loads"] + mount["loads"]
                        print(f"round {rnd} nm {nm:2d} {way:10s} w{workers} {_PIN[pin]:8s}: plain "
                              f"{plain['samples_per_s']:7.0f}  mount {mount['samples_per_s']:7.0f}  ratio "
                              f"{row['ratio']:.3f}  CPU ms/sample {plain['cpu_ms_per_sample']:.2f} / "
                              f"{mount['cpu_ms_per_sample']:.2f}  stall {100 * plain['stall_share']:.1f} % / "
                              f"{100 * mount['stall_share']:.1f} %  daemon "
                              f"{mount['daemon_cpu_ms_per_sample']:.2f} ms/sample"
                              + (f"  plain in passes {sides['passes']['samples_per_s']:.0f} (drain "
                                 f"{row['drain_ratio']:.3f}, mount / it {row['ratio_to_passes']:.3f})"
                                 if "passes" in sides else "")
                              + f"  iter() {plain['iter_ms'] or 0:.1f} / {mount['iter_ms'] or 0:.1f} ms"
                              + f"  pairs {min(row['pair_ratios']):.2f}-{max(row['pair_ratios']):.2f}"
                              + f"  loop CPUs idle {100 * plain['idle_share']:.1f} / {100 * mount['idle_share']:.1f} %"
                              + f"  load {min(loads):.1f}-{max(loads):.1f}", flush=True)
                        yield row


_PIN = {False: "unpinned", True: "pinned"}


def _key(r: dict) -> tuple[str, int, bool, int]:
    return r["way"], r["workers"], r.get("pinned", False), r["nm"]  # (rows of runs before --pin: unpinned)


def _loop_cpu_ratio(row: dict) -> float | None:
    """Plain / mount CPU per sample, the mount's without its daemon's (None for rows from before it was kept)."""
    daemon = row["mount"].get("daemon_cpu_ms_per_sample")
    return None if daemon is None else row["plain"]["cpu_ms_per_sample"] / (row["mount"]["cpu_ms_per_sample"] - daemon)


def _median(xs: Iterator[float | None]) -> float:
    """The median of the figures a row has (nan if none: a way or a run without them)."""
    have = [x for x in xs if x is not None]
    return statistics.median(have) if have else float("nan")


def summary(rows: list[dict]) -> list[dict]:
    """Median and spread of each (way, workers, pinned, nm) over the rounds."""
    out = []
    keys = sorted({_key(r) for r in rows}, key=lambda k: (WAYS.index(k[0]), *k[1:]))
    for way, workers, pinned, nm in keys:
        rs = [r for r in rows if _key(r) == (way, workers, pinned, nm)]
        ratios = [r["ratio"] for r in rs]
        loads = [x for r in rs for x in r["plain"]["loads"] + r["mount"]["loads"]]
        out.append({"way": way, "workers": workers, "pinned": pinned, "nm": nm, "rounds": len(rs),
                    "plain": statistics.median(r["plain"]["samples_per_s"] for r in rs),
                    "mount": statistics.median(r["mount"]["samples_per_s"] for r in rs),
                    "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                    "pairs": sum(len(r.get("pair_ratios", ())) for r in rs),
                    "pairs_min": min((x for r in rs for x in r.get("pair_ratios", ())), default=np.nan),
                    "pairs_max": max((x for r in rs for x in r.get("pair_ratios", ())), default=np.nan),
                    "plain_idle": _median(r["plain"].get("idle_share") for r in rs),
                    "mount_idle": _median(r["mount"].get("idle_share") for r in rs),
                    "plain_cpu_ms": statistics.median(r["plain"]["cpu_ms_per_sample"] for r in rs),
                    "mount_cpu_ms": statistics.median(r["mount"]["cpu_ms_per_sample"] for r in rs),
                    "cpu_ratio": statistics.median(r["cpu_ratio"] for r in rs),
                    "cpu_ratio_min": min(r["cpu_ratio"] for r in rs), "cpu_ratio_max": max(r["cpu_ratio"] for r in rs),
                    "drain": _median(r.get("drain_ratio") for r in rs),
                    "to_passes": _median(r.get("ratio_to_passes") for r in rs),
                    "daemon_cpu_ms": _median(r["mount"].get("daemon_cpu_ms_per_sample") for r in rs),
                    # what a CPU-bound loop whose daemon has a core of its own would see: the loop's CPU alone
                    "loop_cpu_ratio": _median(_loop_cpu_ratio(r) for r in rs),
                    "plain_stall": statistics.median(r["plain"].get("stall_share", np.nan) for r in rs),
                    "mount_stall": statistics.median(r["mount"].get("stall_share", np.nan) for r in rs),
                    "plain_iter_ms": _median(r["plain"].get("iter_ms") for r in rs),
                    "mount_iter_ms": _median(r["mount"].get("iter_ms") for r in rs),
                    "load_min": min(loads), "load_max": max(loads)})
    return out


def _fmt(x: float) -> str:
    return "" if np.isnan(x) else f"{x:.2f}"


def _pct(x: float) -> str:
    return "" if np.isnan(x) else f"{100 * x:.1f} %"


def table(summ: list[dict]) -> str:
    out = ["| way | workers | CPUs | nm | plain dir samples/s | mount samples/s | mount / plain (median) | "
           "spread over rounds | chunk pairs: spread (pairs) | loop's CPUs idle, plain / mount | "
           "CPU ms per sample, plain / mount (daemon) | plain / mount CPU (daemon apart) | "
           "epoch-boundary stall, plain / mount | plain in passes / plain | mount / plain in passes | load |",
           "|---|---:|---|---:|---:|---:|---:|---|---|---|---|---:|---|---:|---:|---|"]
    for s in summ:
        out.append(f"| {s['way']} | {s['workers']} | {_PIN[s['pinned']]} | {s['nm']} | {s['plain']:,.0f} | "
                   f"{s['mount']:,.0f} | **{s['ratio']:.2f}** | {s['ratio_min']:.2f}–{s['ratio_max']:.2f} | "
                   + (f"{s['pairs_min']:.2f}–{s['pairs_max']:.2f} ({s['pairs']}) | " if s.get("pairs") else "| ")
                   + f"{_pct(s.get('plain_idle', np.nan))} / {_pct(s.get('mount_idle', np.nan))} | "
                   f"{s['plain_cpu_ms']:.2f} / {s['mount_cpu_ms']:.2f} ({_fmt(s['daemon_cpu_ms'])}) | "
                   f"{s['cpu_ratio']:.2f} ({_fmt(s['loop_cpu_ratio'])}) | "
                   f"{100 * s['plain_stall']:.1f} % / {100 * s['mount_stall']:.1f} % | "
                   f"{_fmt(s['drain'])} | {_fmt(s['to_passes'])} | "
                   f"{s['load_min']:.1f}–{s['load_max']:.1f} |")
    return "\n".join(out)


def plot(summ: list[dict], path: Path, title: str) -> None:
    """Top: samples/s, mount / plain dir; bottom: CPU per sample, plain dir / mount (what samples/s would say
    where the loader is CPU-bound); one column per worker count; medians, bars from the lowest to the highest
    round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = sorted({(s["workers"], s["pinned"]) for s in summ})
    nms = sorted({s["nm"] for s in summ})
    fig, axes = plt.subplots(2, len(columns), figsize=(5.5 * len(columns), 7.5), sharex=True, squeeze=False)
    colors = {"relist": "#c66", "minepoch": "#da3", "sampler": "#2a6", "substitute": "#69c"}
    rows = (("ratio", "samples/s, mount / plain dir"),
            ("cpu_ratio", "CPU per sample, plain dir / mount\n(dashed: the daemon's left out)"))
    for (key, label), line in zip(rows, axes, strict=True):
        for ax, (w, pinned) in zip(line, columns, strict=True):
            for way in WAYS:
                ss = [s for s in summ if s["way"] == way and (s["workers"], s["pinned"]) == (w, pinned)]
                if not ss:
                    continue
                med = np.array([s[key] for s in ss])
                err = np.array([med - [s[f"{key}_min"] for s in ss], [s[f"{key}_max"] for s in ss] - med])
                ax.errorbar([s["nm"] for s in ss], med, yerr=err, marker="o", capsize=3, label=way,
                            color=colors[way])
                if key == "cpu_ratio":  # (what a CPU-bound loop whose daemon has a core of its own would see)
                    ax.plot([s["nm"] for s in ss], [s["loop_cpu_ratio"] for s in ss], ls="--", marker=".",
                            color=colors[way])
            ax.axhline(1.0, color="k", lw=0.8)
            ax.axhline(0.95, color="k", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_xticks(nms, [str(n) for n in nms])
            ax.set_ylabel(label)
            ax.set_title(f"{w} workers, batch 64, " + ("daemon on a CPU of its own" if pinned else "CPUs shared"))
            ax.grid(alpha=0.3)
        line[-1].legend(loc="upper right", fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("nm (mini-epochs per epoch)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _title(files: int, transform: str) -> str:
    # (two lines: a plot of one column is narrower than the title on one)
    kind = "ImageNet-like" if transform == "imagenet" else "small"
    return f"DataLoader over a tierfs mount against the plain dir\n({files:,} {kind} JPEGs, benchmarks/loop.py)"


def _data(folder: Path, args: argparse.Namespace) -> Path:
    """``folder``/data: the data set, made unless ``folder``/made.json says it holds these files already."""
    made, want = folder / "made.json", {"files": args.files, "transform": args.transform, "seed": args.seed}
    if made.exists() and json.loads(made.read_text()) == want:
        return folder / "data"
    shutil.rmtree(folder / "data", ignore_errors=True)
    make_data(folder / "data", args.files, seed=args.seed)
    made.write_text(json.dumps(want) + "\n")
    return folder / "data"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=3072, help="the data set's size; a pass is files / nm samples "
                    "(20480: 20 batches of 64 a pass at nm 16, a real data set's thousands drain far less often)")
    ap.add_argument("--nm", default="1,6,16", help="comma-separated")
    ap.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of " + ", ".join(WAYS))
    ap.add_argument("--workers", default="4,8", help="comma-separated DataLoader worker counts")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=2, help="chunks of a data set's worth of samples per side, "
                    "alternating plain dir and mount")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cap-fraction", type=float, default=1 / 3, help="cache cap as a fraction of the data "
                    "(at least 2/nm: a mini-epoch must fit in half the cache)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transform", choices=["small", "imagenet"], default="small", help="small: 160 px JPEGs, "
                    "a random 128 px crop and flip (0.8-1 ms of CPU a sample); imagenet: 500 x 375 JPEGs, "
                    "ImageNet's training transform (random-resized crop to 224, flip, normalise)")
    ap.add_argument("--open", choices=["python", "no-isatty"], default="python", help="python: open(path, 'rb'), "
                    "which before Python 3.14 also asks whether the file is a terminal (on a FUSE mount a request to "
                    "the daemon, every file); no-isatty: with an explicit buffer size, which skips that question, "
                    "as 3.14's open() does for a regular file")
    ap.add_argument("--step-ms", type=float, default=0.0, help="a sleep after each batch in the consumer, for the "
                    "model's step on an accelerator (0: none, the loader's speed alone; with a step the loader runs "
                    "ahead within an epoch, and what is left is each epoch boundary)")
    ap.add_argument("--quick", action="store_true", help="1,536 files, 4 workers, 1 round (a few minutes)")
    ap.add_argument("--pin", choices=["off", "on", "both"], default="both", help="on: the loop (this process, its "
                    "workers) on every CPU but one, the daemon on that one -- a node whose daemon has a core of its "
                    "own; off: all share every CPU; both: each pair run both ways, side by side")
    ap.add_argument("--tmp", type=Path, default=None, help="where the data and the mount go")
    ap.add_argument("--data", type=Path, default=None, help="keep the data set in this folder and use it again "
                    "when its files, transform and seed match (made there if not); else made in --tmp and removed")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-out" / "loop.json",
                    help="benchmarks/results/NAME.json: on purpose")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench-out" / "loop.png", help="docs/img/NAME.png: on purpose")
    ap.add_argument("--replot", action="store_true", help="draw --plot and print the table from --out's rows")
    args = ap.parse_args(argv)
    if args.replot:
        saved = json.loads(args.out.read_text())
        summ = summary(saved["rows"])
        print(table(summ))
        plot(summ, args.plot, _title(saved["args"]["files"], saved["args"].get("transform", "small")))
        return 0
    global TRANSFORM, OPEN
    TRANSFORM, OPEN = args.transform, args.open  # (set before any DataLoader forks its workers)
    if args.quick:
        args.files, args.workers, args.rounds = 1536, "4", 1
    args.nm = [int(x) for x in args.nm.split(",")]
    args.workers = [int(x) for x in args.workers.split(",")]
    args.ways = args.ways.split(",")
    args.pin = {"off": [False], "on": [True], "both": [False, True]}[args.pin]
    if True in args.pin:
        cpu_sets()  # (2 CPUs at least: say so now, not after making the data)
    if bad := set(args.ways) - set(WAYS):
        ap.error(f"--ways: unknown {', '.join(sorted(bad))} (of {', '.join(WAYS)})")
    work = Path(tempfile.mkdtemp(prefix="loop-", dir=args.tmp))
    try:
        data = _data(args.data or work, args)
        total = sum(p.stat().st_size for p in data.rglob("*") if p.is_file())
        disk = sum(p.stat().st_blocks * 512 for p in data.rglob("*") if p.is_file())
        per_pass = ", ".join(f"{args.files / nm / args.batch:.1f} at nm {nm}" for nm in args.nm)
        head = (f"{args.files} JPEGs ({total / 2**20:.0f} MiB, transform {args.transform}) in 10 class folders, "
                f"batch {args.batch} (batches a pass: {per_pass}), "
                f"workers {args.workers}, nm {args.nm}, rf 4, cap {args.cap_fraction:.2f} of the data, "
                f"{args.chunks} alternating chunks of a data set's samples per side, {args.rounds} rounds, "
                f"{os.cpu_count()} CPUs, pinned {args.pin}, open {args.open}")
        print(head, flush=True)
        t0, rows = time.time(), []
        args.out.parent.mkdir(parents=True, exist_ok=True)
        for row in measure(args, data, work, args.files, disk):
            rows.append(row)  # (written after every pair: a run cut short keeps what it measured; --replot)
            args.out.write_text(json.dumps({
                "setup": head, "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
                "minutes": (time.time() - t0) / 60, "uptime_load": os.getloadavg(),
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "summary": summary(rows), "rows": rows}, indent=1) + "\n")
        summ = summary(rows)
        print(table(summ))
        plot(summ, args.plot, _title(args.files, args.transform))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

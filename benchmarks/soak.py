"""Soak tierfs against real mounts: the reader rows of issue 11 and the stall row of issue 19, with figures.

Rows (``--rows i,ii,iii,iv``; i and ii run at the same time, each on its own mount, for ``--minutes``; iii after
them for ``--stall-minutes``, iv after that for ``--fault-minutes``):

* **i**  8 reader threads (2 of them through batch plans, as ``tierfs.loaders`` reads: the copies checked and
  read directly, the rest through the mount, the reads reported) read files of the whole dataset (in view or
  not) and check every byte by hash while
  mini-epochs turn over (``next-pass``/``advance`` written to the control file, >= 20 switches) and a writer
  replaces (``os.replace`` of a new version), grows, shrinks and deletes backing files, ``revalidate=open``.
  The writer registers each version's hash *before* it replaces the file, and a reader notes the version
  current *before* its open: the bytes must be that version or a later one (never older: stale; never a mix:
  mismatch; never shorter: short read); ENOENT only if one of those versions is a deletion.
* **ii** 64 reader threads, each re-listing the root every pass and reading every file listed; 16 of them hold
  3 files open across switches and read them again before closing; ``next-pass`` written every 0.3 s.
  No hang, no ENOENT on real files, daemon alive; p50/p99 open latency.
* **iii** 8 readers over the network backing of :mod:`netbacking`, everything cached, while the backing stalls
  (the relay SIGSTOPped) for 20 s every minute: 0 wrong bytes, 0 daemon deaths, ``status`` sampled every
  0.5 s and always answering within 1 s.
* **iv** (issue 22) 8 readers of a dataset whose backing is a FUSE mount (:mod:`tierfs.testing.mirrorfs`, as sshfs or
  rclone would be) while its daemon is SIGKILLed every ``--kill-every`` seconds (the mount answers ENOTCONN),
  left dead for ``--kill-for`` seconds, unmounted and started again at the same path; a file of a later
  mini-epoch is replaced by a FIFO; ``advance``/``next-pass`` every 1.5 s.  0 wrong bytes, 0 hangs, 0 daemon
  deaths, the schedule advancing; ENOENT only on the FIFO, EIO only on uncached files while the backing is away
  (or until tierfs has taken it back: ``--recover-grace`` seconds).

Every read has a deadline (``--deadline``, 30 s): a watchdog aborts the mount's FUSE connection when an
operation exceeds it, counts a hang, and the row remounts (a daemon restart).  A daemon that dies is counted
and remounted too.  Root is required (FUSE connection aborts, and row iii's namespace).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netbacking import net_backing
from slowtier import install_sigterm, require_root
from tierfs.loaders import read_plan, read_sample
from tierfs.testing.harness import Mounted, abort_connection, mounted, passthrough

KiB = 1 << 10
PLAN_READERS = 2  # row i: readers 0 and 1 read through batch plans


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


# --------------------------------------------------------------------------------------------- tallies


@dataclass
class Tally:
    """What one row counts; every field a reader or the monitor adds to under ``lock``."""

    row: str
    readers: int
    minutes: float = 0.0
    switches: int = 0
    reads: int = 0
    plan_reads: int = 0  # of ``reads``: read through a batch plan (row i's plan readers), from the copy or not
    plan_copy_reads: int = 0  # of those: from the copy the plan named (checked), not through the mount
    bytes_verified: int = 0
    mismatches: int = 0
    stale: int = 0
    short_reads: int = 0
    eio: int = 0
    enoent_real: int = 0
    enoent_deleted: int = 0
    other_errors: int = 0
    hangs: int = 0
    daemon_deaths: int = 0
    daemon_restarts: int = 0
    writer_ops: int = 0
    open_p50_ms: float = 0.0
    open_p99_ms: float = 0.0
    open_max_ms: float = 0.0
    status_samples: int = 0
    status_over_1s: int = 0
    status_max_ms: float = 0.0
    stalls: int = 0
    backing_states_in_stall: list[str] = field(default_factory=list)
    backing_deaths: int = 0  # row iv: the FUSE backing's daemon SIGKILLed
    eio_backing_away: int = 0  # row iv: EIO while the backing was away (or being taken back): expected
    fifo_reads: int = 0  # row iv: reads of the FIFO's name (ENOENT at once: expected)
    recoveries: int = 0  # row iv: times tierfs took the backing back (status backing.recoveries)
    examples: list[str] = field(default_factory=list)
    open_lat: list[float] = field(default_factory=list, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def note(self, text: str) -> None:
        with self.lock:
            if len(self.examples) < 20:
                self.examples.append(f"{time.strftime('%H:%M:%S')} {text}")

    def finish(self) -> dict:
        lat = sorted(self.open_lat)
        if lat:
            self.open_p50_ms = lat[len(lat) // 2] * 1e3
            self.open_p99_ms = lat[int(len(lat) * 0.99)] * 1e3
            self.open_max_ms = lat[-1] * 1e3
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("open_lat", "lock")}


class Watchdog:
    """Deadlines for every operation on a mount: ``with wd.op(what):`` around each; a watchdog thread aborts the
    FUSE connection when one runs past ``deadline`` (so the stuck threads get an error and return)."""

    def __init__(self, mnt: str, deadline: float, tally: Tally) -> None:
        self.mnt, self.deadline, self.tally = mnt, deadline, tally
        self.inflight: dict[int, tuple[float, str]] = {}
        self.lock = threading.Lock()
        self.failed = threading.Event()  # a hang or a dead daemon: stop counting errors, remount
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def op(self, what: str) -> Iterator[None]:
        tid = threading.get_ident()
        with self.lock:
            self.inflight[tid] = (time.monotonic(), what)
        try:
            yield
        finally:
            with self.lock:
                self.inflight.pop(tid, None)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self.lock:
                late = [(now - t0, what) for t0, what in self.inflight.values() if now - t0 > self.deadline]
            if late and not self.failed.is_set():
                self.failed.set()
                self.tally.add(hangs=1)
                self.tally.note(f"HANG: {len(late)} ops past {self.deadline:g} s, e.g. {late[0][1]} "
                                f"({late[0][0]:.1f} s); aborting the FUSE connection")
                abort_connection(self.mnt)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def timed_status(m: Mounted, timeout: float) -> tuple[dict | None, float]:
    """Read status in a daemon thread; (status or None, seconds; ``timeout`` if it did not answer)."""
    box: list[dict] = []
    t0 = time.monotonic()

    def get() -> None:
        with contextlib.suppress(Exception):
            box.append(m.status())

    t = threading.Thread(target=get, daemon=True)
    t.start()
    t.join(timeout)
    return (box[0] if box else None), (time.monotonic() - t0 if box else timeout)


def read_whole(path: str, wd: Watchdog) -> tuple[bytes, float]:
    """(content, open seconds)."""
    with wd.op(f"read {path}"):
        t0 = time.monotonic()
        fd = os.open(path, os.O_RDONLY)
        t_open = time.monotonic() - t0
        try:
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(fd)
    return b"".join(chunks), t_open


def classify_error(e: OSError, tally: Tally, what: str, *, deleted_ok: bool = False) -> None:
    import errno

    if e.errno == errno.ENOENT:
        if deleted_ok:
            tally.add(enoent_deleted=1)
        else:
            tally.add(enoent_real=1)
            tally.note(f"ENOENT on a real file: {what}")
    elif e.errno == errno.EIO:
        tally.add(eio=1)
        tally.note(f"EIO: {what}")
    else:
        tally.add(other_errors=1)
        tally.note(f"{e!r}: {what}")


# --------------------------------------------------------------------------------------------- the row loop


def run_row(tally: Tally, backing: Path, work: Path, duration: float, deadline: float,
            start: Callable[[Mounted, Watchdog, threading.Event], list[threading.Thread]],
            monitor: Callable[[Mounted, Watchdog], None] | None = None,
            ready: Callable[[Mounted], None] | None = None, **options: object) -> None:
    """Mount, start the row's threads, watch the daemon and the switches until ``duration`` has passed;
    after a hang or a daemon death, count it and remount (with a fresh cache)."""
    t_start = time.monotonic()
    end = t_start + duration
    while time.monotonic() < end:
        base = Path(tempfile.mkdtemp(prefix=f"soak-{tally.row.split(':')[0]}-", dir=work))
        (base / "mnt").mkdir()
        try:
            with mounted(backing, base / "mnt", base / "cache", timeout=120, **options) as m:  # type: ignore[arg-type]
                if ready is not None:
                    ready(m)
                wd = Watchdog(m.mountpoint, deadline, tally)
                stop = threading.Event()
                threads = start(m, wd, stop)
                last = None
                while time.monotonic() < end and not wd.failed.is_set():
                    time.sleep(0.5)
                    if m.process.poll() is not None:
                        wd.failed.set()
                        tally.add(daemon_deaths=1)
                        tally.note(f"DAEMON DIED rc={m.process.returncode}: {m.stderr()[-1500:]}")
                        break
                    if monitor is not None:
                        monitor(m, wd)
                    s, _ = timed_status(m, 5)
                    if s is not None:
                        here = (s["epoch"], s["mini_epoch"])
                        if last is not None and here != last:
                            tally.add(switches=1)
                        last = here
                stop.set()
                if wd.failed.is_set():
                    abort_connection(m.mountpoint)
                for t in threads:
                    t.join(deadline + 10)
                wd.stop()
                if wd.failed.is_set():
                    tally.add(daemon_restarts=1)
                log = m.stderr()
                if "Traceback" in log:
                    tally.note(f"daemon log has a traceback: {log[log.index('Traceback'):][:1500]}")
        finally:
            shutil.rmtree(base, ignore_errors=True)
    tally.minutes = (time.monotonic() - t_start) / 60


# --------------------------------------------------------------------------------------------- row i


class Versions:
    """The writer's record: every version of every file (hash and size, ``None`` for a deletion) in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.versions: dict[str, list[tuple[bytes, int] | None]] = {}
        self.current: dict[str, int] = {}

    def register(self, rel: str, v: tuple[bytes, int] | None) -> None:
        with self.lock:
            self.versions.setdefault(rel, []).append(v)

    def commit(self, rel: str) -> None:
        with self.lock:
            self.current[rel] = len(self.versions[rel]) - 1

    def since(self, rel: str, i: int) -> list[tuple[bytes, int] | None]:
        with self.lock:
            return list(self.versions[rel][i:])

    def older(self, rel: str, i: int) -> list[tuple[bytes, int] | None]:
        with self.lock:
            return list(self.versions[rel][:i])


def make_row_i_data(root: Path, files: int, rng: random.Random) -> tuple[list[str], Versions]:
    vs = Versions()
    rels = [f"c{i % 8}/f{i:05d}.bin" for i in range(files)]
    for rel in rels:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randint(1 * KiB, 512 * KiB))
        (root / rel).write_bytes(data)
        vs.register(rel, (digest(data), len(data)))
        vs.commit(rel)
    return rels, vs


def row_i(tally: Tally, work: Path, duration: float, deadline: float, files: int, seed: int,
          deletes: float = 0.04) -> None:
    rng = random.Random(seed)
    backing, tmpdir = work / "row-i-data", work / "row-i-tmp"
    tmpdir.mkdir(parents=True)
    rels, vs = make_row_i_data(backing, files, rng)
    deleted: set[str] = set()
    period = min(12.0, max(2.0, duration / 50))  # an advance every period: >= 20 switches when staging keeps up

    def writer(stop: threading.Event) -> None:
        wrng = random.Random(seed + 1)
        while not stop.wait(0.15):
            rel = wrng.choice(rels)
            if rel in deleted:
                continue
            op = wrng.random()
            if op < deletes:
                vs.register(rel, None)
                os.unlink(backing / rel)
                deleted.add(rel)
            else:
                cur = vs.since(rel, vs.current[rel])[0]
                size = cur[1] if cur else 4096
                size = {0: size, 1: min(1 << 20, size * 2 + 1), 2: size // 2}[int(op * 3) % 3]
                data = wrng.randbytes(size)
                vs.register(rel, (digest(data), len(data)))
                tmp = tmpdir / f"{wrng.getrandbits(64):x}"
                tmp.write_bytes(data)
                os.replace(tmp, backing / rel)
            vs.commit(rel)
            tally.add(writer_ops=1)

    def verify(rel: str, before: int, data: bytes, **counts: int) -> None:
        """``data`` must be the version current at ``before`` or a later one: else stale, short or mismatch."""
        ok = [v for v in vs.since(rel, before) if v is not None]
        h = digest(data)
        if any(v[0] == h for v in ok):
            tally.add(reads=1, bytes_verified=len(data), **counts)
        elif any(v is not None and v[0] == h for v in vs.older(rel, before)):
            tally.add(stale=1)
            tally.note(f"STALE: {rel} served an older version ({len(data)} bytes)")
        elif ok and all(len(data) < v[1] for v in ok):
            tally.add(short_reads=1)
            tally.note(f"SHORT: {rel} {len(data)} bytes, expected one of {[v[1] for v in ok]}")
        else:
            tally.add(mismatches=1)
            tally.note(f"MISMATCH: {rel} {len(data)} bytes, expected one of {[v[1] for v in ok]}")

    def reader(m: Mounted, wd: Watchdog, stop: threading.Event, k: int) -> None:
        if k < PLAN_READERS:
            return plan_reader(m, wd, stop, k)
        rrng = random.Random(seed * 100 + k)
        listing: list[str] = []
        n = 0
        while not stop.is_set():
            if n % 100 == 0:
                with contextlib.suppress(OSError), wd.op("list"):
                    listing = [os.path.relpath(os.path.join(d, f), m.mountpoint)
                               for d, _, fs in os.walk(m.mountpoint) for f in fs]
            n += 1
            rel = rrng.choice(listing) if listing and rrng.random() < 0.5 else rrng.choice(rels)
            if rel not in vs.current:
                continue
            before = vs.current[rel]
            try:
                data, t_open = read_whole(m.path(rel), wd)
            except OSError as e:
                if not wd.failed.is_set():
                    classify_error(e, tally, rel, deleted_ok=None in vs.since(rel, before))
                continue
            with tally.lock:
                tally.open_lat.append(t_open)
            verify(rel, before, data)

    def plan_reader(m: Mounted, wd: Watchdog, stop: threading.Event, k: int) -> None:
        """A loader on batch plans (``tierfs.loaders``): a plan, up to 64 of its files read as ``read_sample``
        reads them (the copy checked, else through the mount), the copies reported; again.  A plan read after a
        change never names the old copy (``revalidate=open``), so the same rule holds: the version current
        before the plan was read, or a later one."""
        rrng = random.Random(seed * 100 + k)
        while not stop.is_set():
            with vs.lock:
                before = dict(vs.current)
            try:
                with wd.op("plan"):
                    p = read_plan(m.mountpoint)
            except OSError as e:
                if not wd.failed.is_set():
                    classify_error(e, tally, "plan")
                continue
            picked = rrng.sample(range(len(p.samples)), min(64, len(p.samples)))
            copied = []
            for i in picked:
                s = p.samples[i]
                rel = os.path.relpath(s.path, m.mountpoint)
                try:
                    with wd.op(f"plan read {rel}"):
                        data, from_copy = read_sample(s)
                except OSError as e:
                    if not wd.failed.is_set():
                        classify_error(e, tally, rel, deleted_ok=None in vs.since(rel, before[rel]))
                    continue
                if from_copy:
                    copied.append(i)
                verify(rel, before[rel], data, plan_reads=1, plan_copy_reads=int(from_copy))
            with contextlib.suppress(OSError), wd.op("report"):
                p.report(copied)

    def control(m: Mounted, wd: Watchdog, stop: threading.Event) -> None:
        i = 0
        while not stop.wait(period / 2):
            i += 1
            with contextlib.suppress(OSError), wd.op("control"):
                m.control("advance\n" if i % 2 else "next-pass\n")

    stop_writer = threading.Event()
    wthread = threading.Thread(target=writer, args=(stop_writer,))

    def start(m: Mounted, wd: Watchdog, stop: threading.Event) -> list[threading.Thread]:
        ts = [threading.Thread(target=reader, args=(m, wd, stop, k)) for k in range(tally.readers)]
        ts.append(threading.Thread(target=control, args=(m, wd, stop)))
        for t in ts:
            t.start()
        if not wthread.is_alive() and not stop_writer.is_set():
            wthread.start()
        return ts

    try:
        run_row(tally, backing, work, duration, deadline, start, capacity="96M", nm=4, rf=2,
                revalidate="open")
    finally:
        stop_writer.set()
        if wthread.is_alive():
            wthread.join()


# --------------------------------------------------------------------------------------------- row ii


def make_static_data(root: Path, files: int, lo: int, hi: int, dirs: int, seed: int) -> dict[str, bytes]:
    rng = random.Random(seed)
    out = {}
    for i in range(files):
        rel = f"k{i % dirs:02d}/s{i:05d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randint(lo, hi))
        (root / rel).write_bytes(data)
        out[rel] = digest(data)
    return out


def row_ii(tally: Tally, work: Path, duration: float, deadline: float, seed: int) -> None:
    backing = work / "row-ii-data"
    expect = make_static_data(backing, 2000, 1 * KiB, 64 * KiB, 16, seed)

    def check(rel: str, data: bytes) -> None:
        if digest(data) == expect[rel]:
            tally.add(reads=1, bytes_verified=len(data))
        else:
            tally.add(mismatches=1)
            tally.note(f"MISMATCH: {rel} {len(data)} bytes")

    def reader(m: Mounted, wd: Watchdog, stop: threading.Event, k: int) -> None:
        holder = k < 16
        held: list[tuple[int, str, int]] = []  # (fd, rel, passes held)
        rrng = random.Random(seed * 1000 + k)
        while not stop.is_set():
            try:
                with wd.op("list root"):
                    listing = [os.path.relpath(os.path.join(d, f), m.mountpoint)
                               for d, _, fs in os.walk(m.mountpoint) for f in fs]
            except OSError as e:
                if not wd.failed.is_set():
                    classify_error(e, tally, "listing")
                continue
            rrng.shuffle(listing)
            for rel in listing[:200]:
                if stop.is_set():
                    break
                try:
                    data, t_open = read_whole(m.path(rel), wd)
                except OSError as e:
                    if not wd.failed.is_set():
                        classify_error(e, tally, rel)
                    continue
                with tally.lock:
                    tally.open_lat.append(t_open)
                check(rel, data)
            if holder:
                still = []
                for fd, rel, n in held:
                    if n < 2 and not stop.is_set():
                        still.append((fd, rel, n + 1))
                        continue
                    try:
                        with wd.op(f"held read {rel}"):
                            size = os.fstat(fd).st_size
                            data = os.pread(fd, size + 1, 0)
                        check(rel, data)
                    except OSError as e:
                        if not wd.failed.is_set():
                            classify_error(e, tally, f"held {rel}")
                    finally:
                        os.close(fd)
                held = still
                while len(held) < 3 and listing and not stop.is_set():
                    rel = rrng.choice(listing)
                    try:
                        with wd.op(f"open {rel}"):
                            held.append((os.open(m.path(rel), os.O_RDONLY), rel, 0))
                    except OSError as e:
                        if not wd.failed.is_set():
                            classify_error(e, tally, f"hold {rel}")
                        break
        for fd, _, _ in held:
            with contextlib.suppress(OSError):
                os.close(fd)

    def control(m: Mounted, wd: Watchdog, stop: threading.Event) -> None:
        while not stop.wait(0.3):
            with contextlib.suppress(OSError), wd.op("control"):
                m.control("next-pass\n")

    def start(m: Mounted, wd: Watchdog, stop: threading.Event) -> list[threading.Thread]:
        ts = [threading.Thread(target=reader, args=(m, wd, stop, k)) for k in range(tally.readers)]
        ts.append(threading.Thread(target=control, args=(m, wd, stop)))
        for t in ts:
            t.start()
        return ts

    run_row(tally, backing, work, duration, deadline, start, capacity="20M", nm=8, rf=1)


# --------------------------------------------------------------------------------------------- row iii


def row_iii(tally: Tally, work: Path, duration: float, deadline: float, seed: int, delay: float,
            stall_every: float, stall_for: float) -> None:
    src = work / "row-iii-src"
    expect = make_static_data(src, 1000, 16 * KiB, 128 * KiB, 10, seed)
    rels = sorted(expect)
    stall_lat: list[float] = []
    with net_backing(work / "row-iii-src", delay, workdir=work) as nb:
        tally.note(f"network backing os.stat RTT {nb.rtt_stats()}")
        stalled = threading.Event()

        def reader(m: Mounted, wd: Watchdog, stop: threading.Event, k: int) -> None:
            rrng = random.Random(seed * 7 + k)
            while not stop.is_set():
                rel = rrng.choice(rels)
                try:
                    data, t_open = read_whole(m.path(rel), wd)
                except OSError as e:
                    if not wd.failed.is_set():
                        classify_error(e, tally, f"{rel} (stalled: {stalled.is_set()})")
                    continue
                with tally.lock:
                    tally.open_lat.append(t_open)
                    if stalled.is_set():
                        stall_lat.append(t_open)
                if digest(data) == expect[rel]:
                    tally.add(reads=1, bytes_verified=len(data))
                else:
                    tally.add(mismatches=1)
                    tally.note(f"MISMATCH: {rel} {len(data)} bytes")

        def staller(stop: threading.Event) -> None:
            while not stop.wait(stall_every - stall_for):
                tally.add(stalls=1)
                stalled.set()
                with nb.stalled():
                    stop.wait(stall_for)
                stalled.clear()

        def sampler(m: Mounted, stop: threading.Event) -> None:
            while not stop.wait(0.5):
                s, dt = timed_status(m, 5)
                tally.add(status_samples=1)
                with tally.lock:
                    tally.status_max_ms = max(tally.status_max_ms, dt * 1e3)
                if dt > 1:
                    tally.add(status_over_1s=1)
                    tally.note(f"status took {dt:.2f} s (stalled: {stalled.is_set()})")
                if s is not None and stalled.is_set():
                    state = s["backing"]["state"]
                    with tally.lock:
                        if state not in tally.backing_states_in_stall:
                            tally.backing_states_in_stall.append(state)

        def ready(m: Mounted) -> None:
            deadline_t = time.monotonic() + 300
            while time.monotonic() < deadline_t:
                p = m.status()["prefetch"]
                if p["files_done"] >= p["files_total"] > 0:
                    return
                time.sleep(0.1)
            raise TimeoutError("row iii: staging did not finish")

        def start(m: Mounted, wd: Watchdog, stop: threading.Event) -> list[threading.Thread]:
            ts = [threading.Thread(target=reader, args=(m, wd, stop, k)) for k in range(tally.readers)]
            ts += [threading.Thread(target=staller, args=(stop,)), threading.Thread(target=sampler, args=(m, stop))]
            for t in ts:
                t.start()
            return ts

        run_row(tally, nb.root, work, duration, deadline, start, ready=ready, capacity="256M", nm=1, rf=100000,
                backing_timeout=5)
    if stall_lat:
        s = sorted(stall_lat)
        tally.note(f"opens during stalls: {len(s)}, p50 {s[len(s) // 2] * 1e3:.2f} ms, "
                   f"p99 {s[int(len(s) * 0.99)] * 1e3:.2f} ms, max {s[-1] * 1e3:.1f} ms")


# --------------------------------------------------------------------------------------------- row iv


def row_iv(tally: Tally, work: Path, duration: float, deadline: float, seed: int, kill_every: float,
           kill_for: float, grace: float) -> None:
    import errno

    data, inner = work / "row-iv-data", work / "row-iv-inner"
    expect = make_static_data(data, 400, 4 * KiB, 64 * KiB, 8, seed)
    rels = sorted(expect)
    inner.mkdir()
    away = threading.Event()  # the backing's daemon is dead, or was started again less than ``grace`` s ago
    fifo: list[str] = []

    with passthrough(data, inner) as pt:

        def ready(m: Mounted) -> None:
            deadline_t = time.monotonic() + 120
            while not m.status()["next_ready"]:
                if time.monotonic() > deadline_t:
                    raise TimeoutError("row iv: the next mini-epoch was not staged")
                time.sleep(0.1)
            if not fifo:  # a file of a later mini-epoch (neither the view nor, likely, the next) becomes a FIFO
                view = set(Path(m.path(".tierfs", "order")).read_text().split())
                fifo.append(sorted(set(rels) - view)[-1])
                os.unlink(data / fifo[0])
                os.mkfifo(data / fifo[0])

        def reader(m: Mounted, wd: Watchdog, stop: threading.Event, k: int) -> None:
            rrng = random.Random(seed * 11 + k)
            while not stop.is_set():
                rel = rrng.choice(rels)
                try:
                    data_, t_open = read_whole(m.path(rel), wd)
                except OSError as e:
                    if wd.failed.is_set():
                        continue
                    if fifo and rel == fifo[0] and e.errno == errno.ENOENT:
                        tally.add(fifo_reads=1)
                    elif e.errno == errno.EIO and away.is_set():
                        tally.add(eio_backing_away=1)
                    else:
                        classify_error(e, tally, f"{rel} (backing away: {away.is_set()})")
                    continue
                with tally.lock:
                    tally.open_lat.append(t_open)
                if digest(data_) == expect[rel]:
                    tally.add(reads=1, bytes_verified=len(data_))
                else:
                    tally.add(mismatches=1)
                    tally.note(f"MISMATCH: {rel} {len(data_)} bytes")

        def killer(m: Mounted, stop: threading.Event) -> None:
            while not stop.wait(kill_every - kill_for):
                away.set()
                pt.kill()
                tally.add(backing_deaths=1)
                stop.wait(kill_for)
                s, _ = timed_status(m, 5)
                if s is not None:
                    with tally.lock:
                        if s["backing"]["state"] not in tally.backing_states_in_stall:
                            tally.backing_states_in_stall.append(s["backing"]["state"])
                pt.unmount()
                pt.start()
                stop.wait(grace)
                away.clear()
            if pt.process is None or pt.process.poll() is not None:
                pt.unmount()
                pt.start()  # (the next mount of the row needs it)

        def control(m: Mounted, wd: Watchdog, stop: threading.Event) -> None:
            i = 0
            while not stop.wait(1.5):
                i += 1
                with contextlib.suppress(OSError), wd.op("control"):
                    m.control("advance\n" if i % 2 else "next-pass\n")
                s, _ = timed_status(m, 5)
                if s is not None:
                    with tally.lock:
                        tally.recoveries = max(tally.recoveries, s["backing"]["recoveries"])

        def start(m: Mounted, wd: Watchdog, stop: threading.Event) -> list[threading.Thread]:
            ts = [threading.Thread(target=reader, args=(m, wd, stop, k)) for k in range(tally.readers)]
            ts += [threading.Thread(target=killer, args=(m, stop)),
                   threading.Thread(target=control, args=(m, wd, stop))]
            for t in ts:
                t.start()
            return ts

        try:
            run_row(tally, inner, work, duration, deadline, start, ready=ready, capacity="64M", nm=4, rf=2,
                    revalidate=2, backing_timeout=5)
        finally:
            if fifo:
                with contextlib.suppress(OSError):
                    os.close(os.open(data / fifo[0], os.O_WRONLY | os.O_NONBLOCK))


# --------------------------------------------------------------------------------------------- main


COLUMNS = ["readers", "minutes", "switches", "reads", "plan_reads", "plan_copy_reads", "bytes_verified",
           "mismatches", "stale", "short_reads", "eio", "enoent_real", "enoent_deleted", "other_errors", "hangs",
           "daemon_deaths", "daemon_restarts", "writer_ops", "open_p50_ms", "open_p99_ms", "open_max_ms", "stalls",
           "status_samples", "status_over_1s", "status_max_ms", "backing_deaths", "recoveries", "eio_backing_away",
           "fifo_reads"]


def render(rows: list[dict]) -> str:
    lines = ["| | " + " | ".join(r["row"] for r in rows) + " |", "|---|" + "---:|" * len(rows)]
    for c in COLUMNS:
        vals = []
        for r in rows:
            v = r[c]
            vals.append(f"{v:,.2f}" if isinstance(v, float) else f"{v:,}")
        lines.append(f"| {c} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="duration of rows i and ii (together)")
    ap.add_argument("--stall-minutes", type=float, help="duration of row iii (default: --minutes, at most 3)")
    ap.add_argument("--rows", default="i,ii,iii,iv")
    ap.add_argument("--fault-minutes", type=float, help="duration of row iv (default: --minutes, at most 3)")
    ap.add_argument("--kill-every", type=float, default=40.0, help="row iv: seconds between backing deaths")
    ap.add_argument("--kill-for", type=float, default=15.0, help="row iv: seconds the backing stays dead")
    ap.add_argument("--recover-grace", type=float, default=10.0,
                    help="row iv: seconds after a restart that EIO on uncached files still counts as expected")
    ap.add_argument("--deadline", type=float, default=30.0, help="seconds an operation may take before a hang")
    ap.add_argument("--files", type=int, default=600, help="row i: files (1 KiB - 512 KiB)")
    ap.add_argument("--deletes", type=float, default=0.04, help="row i: share of writer operations that delete")
    ap.add_argument("--delay-ms", type=float, default=0.25, help="row iii: one-way delay of the link")
    ap.add_argument("--stall-every", type=float, default=60.0)
    ap.add_argument("--stall-for", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/tierfs-soak"))
    ap.add_argument("--out", type=Path, default=Path("bench-out/soak"))
    args = ap.parse_args(argv)
    require_root()
    install_sigterm()
    rows = args.rows.split(",")
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=args.workdir))
    tallies: list[Tally] = []
    load0 = os.getloadavg()[0]
    t0 = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    try:
        threads = []
        if "i" in rows:
            t1 = Tally("i: 8 readers, writer, switches", 8)
            tallies.append(t1)
            threads.append(threading.Thread(target=row_i, args=(t1, work, args.minutes * 60, args.deadline,
                                                                args.files, args.seed, args.deletes)))
        if "ii" in rows:
            t2 = Tally("ii: 64 readers, held files", 64)
            tallies.append(t2)
            threads.append(threading.Thread(target=row_ii, args=(t2, work, args.minutes * 60, args.deadline,
                                                                 args.seed)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        load1 = os.getloadavg()[0]
        if "iii" in rows:
            t3 = Tally("iii: 8 readers, backing stalls", 8)
            tallies.append(t3)
            minutes = args.stall_minutes if args.stall_minutes is not None else min(args.minutes, 3.0)
            row_iii(t3, work, minutes * 60, max(args.deadline, 60.0), args.seed, args.delay_ms / 1e3,
                    args.stall_every, args.stall_for)
        if "iv" in rows:
            t4 = Tally("iv: 8 readers, FIFO, dying FUSE backing", 8)
            tallies.append(t4)
            minutes = args.fault_minutes if args.fault_minutes is not None else min(args.minutes, 3.0)
            row_iv(t4, work, minutes * 60, args.deadline, args.seed, args.kill_every, args.kill_for,
                   args.recover_grace)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = [t.finish() for t in tallies]
    load2 = os.getloadavg()[0]
    head = (f"soak started {t0}: {' '.join(sys.argv)}\nmachine: {os.cpu_count()} cores, kernel {os.uname().release}, "
            f"load average {load0:.2f} at start, {load1:.2f} after rows i+ii, {load2:.2f} at the end")
    md = render(results)
    print("\n" + head + "\n\n" + md)
    for r in results:
        if r["stalls"] or r["backing_deaths"]:
            print(f"  [{r['row'][:3].strip(':')}] backing.state seen during stalls or deaths: "
                  f"{r['backing_states_in_stall']}")
        for e in r["examples"]:
            print(f"  [{r['row'][:3].strip(':')}] {e}")
    (args.out / "soak.json").write_text(json.dumps({"head": head, "rows": results}, indent=1))
    (args.out / "soak.md").write_text(head + "\n\n" + md + "\n")
    print(f"wrote {args.out}/soak.json and soak.md")
    bad = sum(r["mismatches"] + r["stale"] + r["short_reads"] + r["hangs"] + r["daemon_deaths"] + r["enoent_real"]
              + (r["eio"] if r["backing_deaths"] else 0) for r in results)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

"""Loaders that build their file list once, before the epoch loop, against real mounts: told when they do not
follow the view; one sampler line to follow it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tierfs.cli.status_text import format_status
from tierfs.client import Client
from tierfs.testing.harness import abort_connection

_DEADLINE = 120  # seconds for one epoch's reads (a hung mount fails the test; mounted() aborts it after)
ROOT = Path(__file__).resolve().parents[2]
_RANK = Path(__file__).parent / "programs" / "sampler_rank.py"


def _read_all(paths: list[str]) -> list[bytes]:
    """Read each path whole, in order, in a thread with a deadline."""
    def work() -> list[bytes]:
        return [Path(p).read_bytes() for p in paths]

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(work).result(timeout=_DEADLINE)


def _listing(root: str) -> list[str]:
    """What a loader built once holds: every file its one listing found, sorted (ImageFolder's order)."""
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs)


def test_a_file_list_built_once_is_told_with_the_fix(tierfs_mount, dataset):
    backing, files = dataset
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=1, advance="strict") as m:
        paths = _listing(m.mountpoint)  # listed once: the first mini-epoch
        assert 0 < len(paths) < len(files)
        for _ in range(4):  # the loop a training script runs over its one file list
            for p, data in zip(paths, _read_all(paths), strict=True):
                assert data == (backing / os.path.relpath(p, m.mountpoint)).read_bytes()
        st = m.status()
        assert st["reads"]["out_of_view"] >= 2 * len(paths)
        assert st["loader"]["follows_view"] is False and st["loader"]["warnings"] >= 1
        assert "MountSampler" in st["loader"]["warning"]
        assert "tierfs_loader_off_view 1" in Client(m.mountpoint).metrics()
        assert "does not follow the view" in format_status(st)
        log = m.stderr()
        assert log.count("does not follow the view") == 1 and "listing=all" in log


def test_a_loader_that_relists_each_pass_is_not_warned(tierfs_mount, dataset):
    _, files = dataset
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=1, advance="strict") as m:
        for _ in range(6):
            _read_all(_listing(m.mountpoint))
        st = m.status()
        assert st["passes_total"] >= 5 and st["loader"] == {"follows_view": True, "warning": None, "warnings": 0}
        assert "does not follow" not in m.stderr()


def test_listing_all_lists_every_file_while_the_view_stays_the_mini_epoch(tierfs_mount, dataset):
    _, files = dataset
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=2, listing="all") as m:
        listed = {os.path.relpath(p, m.mountpoint) for p in _listing(m.mountpoint)}
        assert listed == set(files)
        st = m.status()
        order = Client(m.mountpoint).order()
        assert st["view_files"] == len(order) < len(files)
        _read_all([m.path(p.decode()) for p in order])  # a pass of the view ends as it always did
        assert m.status()["passes_total"] == st["passes_total"] + 1


@contextlib.contextmanager
def _rank_processes(m, out: Path):
    """``start(rank, args)`` runs ``programs/sampler_rank.py ARGS`` as its own process, stdout and stderr to
    ``out/rankN.out``/``.err``; at the end what is left of each is killed (its DataLoader workers too: its own
    session) and, should one not die (stuck in the mount), the mount's FUSE connection aborted first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    procs: list[subprocess.Popen] = []

    def start(rank: int, args: list[str]) -> subprocess.Popen:
        with open(out / f"rank{rank}.out", "w") as o, open(out / f"rank{rank}.err", "w") as e:
            procs.append(subprocess.Popen([sys.executable, str(_RANK), *args], stdout=o, stderr=e, env=env,
                                          stdin=subprocess.DEVNULL, start_new_session=True))  # fmt: skip
        return procs[-1]

    try:
        yield start
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        try:
            for p in procs:
                p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            abort_connection(m.mountpoint, m.connection)
            for p in procs:
                p.wait(timeout=20)


def _wait_for_lines(p: subprocess.Popen, out: Path, n: int, deadline: float) -> None:
    """Until the process has printed ``n`` lines (it must not exit first)."""
    while len(out.read_text().splitlines()) < n:
        assert p.poll() is None, f"exited {p.returncode}: {out.with_suffix('.err').read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{out}: fewer than {n} lines in time"
        time.sleep(0.1)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_a_dataset_built_once_with_the_sampler_reads_each_pass_once_across_two_rank_processes(mount_dirs, tmp_path):
    """The issue's done-when: a DataLoader over an ImageFolder-equivalent dataset built once, with MountSampler
    and persistent_workers=True, 4 workers, 2 ranks, each its own process (programs/sampler_rank.py), reading
    through one mount.  Rank 1 starts late (builds its dataset, listing the root, once rank 0 has read its
    share of the first pass), as a slow rank of a job does."""
    pytest.importorskip("torch")
    from tierfs.testing.harness import make_dataset, mounted

    backing = tmp_path / "backing64"
    files = make_dataset(backing, dirs=4, files_per_dir=16, max_size=16 << 10, seed=5)
    classes = sorted(p.name for p in backing.iterdir())
    sha = {rel: hashlib.sha256((backing / rel).read_bytes()).hexdigest() for rel in files}
    total = sum(files.values())
    mnt, cache = mount_dirs
    nm, rf, epochs = 4, 2, 8
    with mounted(backing, mnt, cache, total, nm=nm, rf=rf, listing="all") as m:
        st0 = m.status()
        opens0 = st0["reads"]["hits"] + st0["reads"]["misses"]
        # (the last argument: how long a rank waits for the other's reads to end a pass -- rank 0 ends a pass
        # left unread after it -- long on a loaded test machine; the deadline is the whole run's)
        # rank 0 reads cached copies directly (reported), rank 1 every file through the mount (opens)
        args = [[m.mountpoint, str(r), "2", str(epochs), str(2 * _DEADLINE), str(1 - r)] for r in range(2)]
        deadline = time.monotonic() + 4 * _DEADLINE
        with _rank_processes(m, tmp_path) as start:
            first = start(0, args[0])
            _wait_for_lines(first, tmp_path / "rank0.out", 2, deadline)  # its dataset and its share of pass 1
            procs = [first, start(1, args[1])]
            for r, p in enumerate(procs):
                rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                assert rc == 0, (tmp_path / f"rank{r}.err").read_text()[-3000:]
        ranks = [[json.loads(x) for x in (tmp_path / f"rank{r}.out").read_text().splitlines()] for r in range(2)]
        assert all(r[0] == {"files": len(files)} and len(r) == 1 + epochs for r in ranks)  # built once: every file
        samples = [f"{c}/{f}" for c in classes for f in sorted(os.listdir(backing / c))]  # the dataset's indices
        positions, read = [], 0
        for e in range(epochs):
            r0, r1 = ranks[0][1 + e], ranks[1][1 + e]
            # each epoch is the mount's next pass, the same on both ranks
            assert r0["pass"] == r1["pass"] == st0["passes_total"] + e, (e, r0["pass"], r1["pass"])
            n = r0["pass_files"]
            assert r1["pass_files"] == n and 0 < n < len(files)
            assert len(r0["items"]) == len(r1["items"]) == -(-n // 2)  # the same count on each rank
            # every file of the pass read once across the ranks: rank r took order[r::2], the odd pass padded
            # with its first file
            order = [x for pair in zip(r0["items"], r1["items"], strict=True) for x in pair]
            assert len({i for i, _, _ in order[:n]}) == n and order[n:] == order[:len(order) - n]
            for i, label, digest in order:
                rel = samples[i]
                assert label == classes.index(rel.split("/")[0]) and digest == sha[rel]
            positions.append(tuple(r0["position"]))
            read += len(order)
        st = m.status()
        assert st["passes_total"] - st0["passes_total"] == epochs  # each pass ended once all its files were read
        assert st["reads"]["hits"] + st["reads"]["misses"] - opens0 == read  # and no file read twice
        assert 0 < st["reads"]["plan"] - st0["reads"]["plan"] < read  # both kinds of read counted alike
        assert st["loader"]["follows_view"] and st["reads"]["out_of_view"] == 0
        assert len(set(positions)) >= epochs // rf - 1  # mini-epochs advance (advance=ready may repeat one)
        # The slow tier: each mini-epoch is staged once while the previous one is read rf times, so nm*rf passes
        # (one epoch, data/rf per data-worth of samples) read the data once, plus the mini-epoch staged ahead.
        biggest = max(st["view_bytes"], st["prefetch"]["bytes_total"])
        assert st["backing_bytes_read"] <= total * epochs / (nm * rf) + 2 * biggest
        assert st["backing_bytes_read"] <= total * 1.5


def test_a_pass_left_unread_is_ended_by_rank_0_and_a_plain_directory_gives_every_index(tierfs_mount, dataset):
    from tierfs.loaders import PassIndices

    backing, files = dataset
    plain = PassIndices(_listing(str(backing)), rank=2, world_size=3)  # 32 files: 11 each, rank 2 padded
    assert plain.next_pass() == plain.next_pass() == [*range(2, 32, 3), 0]
    with tierfs_mount(capacity=sum(files.values()), nm=4, rf=4, listing="all") as m:
        paths = _listing(m.mountpoint)
        idx = PassIndices(paths, wait=0.5)
        first = idx.next_pass()
        _read_all([paths[i] for i in first[: len(first) // 2]])  # a break half way through the epoch
        passes = m.status()["passes_total"]
        second = idx.next_pass()  # waits 0.5 s, then ends the pass left unread
        assert idx.last_pass == passes + 1 == m.status()["passes_total"]
        assert sorted(second) == sorted(first) and second != first  # the same mini-epoch, a new order


def _classes64(backing: Path) -> dict[str, int]:
    """The built-once tests' data set: 4 class folders of 16 files, every file's bytes distinct."""
    from tierfs.testing.harness import make_dataset

    files = make_dataset(backing, dirs=4, files_per_dir=16, max_size=16 << 10, seed=7)
    assert len({(backing / r).read_bytes() for r in files}) == len(files)
    return files


def test_substitute_gives_a_loader_built_once_mini_epochs_with_no_change(mount_dirs):
    """The dataset built once, no sampler, substitute on: every read is a whole view file of the name's class
    folder (fstat agrees), each view file is served once per pass (a folder's view files all served before one
    is served again), the passes and mini-epochs advance with the reads, the slow tier is read about data/rf
    per data-worth of reads."""
    from tierfs.testing.harness import mounted

    mnt, cache = mount_dirs
    backing = Path(mnt).parent / "backing_s"
    files = _classes64(backing)
    by_bytes = {(backing / r).read_bytes(): r for r in files}
    total, nm, rf, epochs = sum(files.values()), 4, 2, 4
    with mounted(backing, mnt, cache, total, nm=nm, rf=rf, listing="all", substitute=True,
                 composition="stratified") as m:
        names = _listing(m.mountpoint)  # built once: every file
        assert len(names) == len(files)
        client = Client(m.mountpoint)
        views: dict[int, set[str]] = {}  # each pass's view, read before its first read (one reader: no race)

        def epoch(seed: int) -> list[tuple[str, str, int, int]]:
            """(name, file served, its fstat size, the pass it was read in) of every name, in a shuffled order (as
            DataLoader(shuffle=True) reads), one at a time."""
            out = []
            for p in random.Random(seed).sample(names, len(names)):
                passes = client.status()["passes_total"]
                if passes not in views:
                    views[passes] = {x.decode() for x in client.order()}
                with open(p, "rb") as f:
                    data = f.read()
                    size = os.fstat(f.fileno()).st_size
                out.append((os.path.relpath(p, m.mountpoint), by_bytes[data], size, passes))
            return out

        positions, reads = set(), []
        with ThreadPoolExecutor(1) as pool:
            for e in range(epochs):
                positions.add((m.status()["epoch"], m.status()["mini_epoch"]))
                reads += pool.submit(epoch, e).result(timeout=_DEADLINE)
        for name, got, size, _ in reads:
            assert got.split("/")[0] == name.split("/")[0]  # the name's class folder: its label holds
            assert size == files[got]  # whole, and stat agrees
        ended = sorted(views)[:-1]  # every pass the reads ended (the last one is cut off by the end)
        assert ended and ended == list(range(ended[0], ended[0] + len(ended)))
        for n in ended:
            in_pass: dict[str, str] = {}  # name -> served (a name read again in its pass gets the same file)
            for name, got, _, passes in reads:
                if passes == n:
                    assert in_pass.setdefault(name, got) == got
            # the pass ended once every view file was served, and nothing else was
            assert set(in_pass.values()) == views[n]
            # drawn without replacement: in each folder, every view file once before any again
            for folder in {v.split("/")[0] for v in views[n]}:
                k = sum(v.split("/")[0] == folder for v in views[n])
                served = [g for g in in_pass.values() if g.split("/")[0] == folder]
                assert all(len(set(served[i:i + k])) == len(served[i:i + k]) for i in range(0, len(served), k))
        st = m.status()
        assert st["reads"]["out_of_view"] == 0 and st["substitution"]["substituted"] > 0
        assert st["loader"]["follows_view"]
        # the passes and mini-epochs advance with the reads: a pass ends once every view file was served, which
        # takes a pass-worth of reads (the view's size) and more where one folder's reads came first (its files
        # are then served again: a name resolves within its folder only); at most twice that here
        assert st["passes_total"] >= epochs * len(files) // (2 * st["view_files"])
        assert len(positions) >= 2 and len({g for _, g, _, _ in reads}) > len(files) // nm
        biggest = max(st["view_bytes"], st["prefetch"]["bytes_total"])
        assert st["backing_bytes_read"] <= total * epochs / rf + 2 * biggest


@pytest.mark.alone  # (it counts the kernel's LOOKUPs: under others' load an entry dropped late, or forgotten, is two)
def test_under_substitute_an_open_is_one_lookup_from_the_first_epoch(mount_dirs, benchmark_module):
    """The data set built once listed every name, so the kernel got an entry of each, at its own file; an open of a
    name now served as another file would be two LOOKUPs and a FORGET (the kernel asks about its entry, gets this
    pass's substitute, drops that and looks the name up again).  The entries of names whose file is out of the view
    are dropped when the listing closes, those of names served in earlier passes before their next open (status
    ``entries_dropped``): an open is one LOOKUP from the first epoch on, every read still a whole file of the
    name's class folder.  Counted by the daemon itself (``benchmarks/fuse_requests.py`` wraps its handlers)."""
    from tierfs.testing.harness import mounted

    requests = benchmark_module("fuse_requests")
    mnt, cache = mount_dirs
    backing = Path(mnt).parent / "backing_s"
    files = _classes64(backing)
    by_bytes = {(backing / r).read_bytes(): r for r in files}
    counts = str(Path(mnt).parent / "requests.json")
    with mounted(backing, mnt, cache, sum(files.values()), nm=4, rf=2, listing="all", substitute=True,
                 composition="stratified", env={"TIERFS_REQUEST_COUNTS": counts, "PYTHONPATH": str(ROOT)},
                 wrapper=(sys.executable, requests.__file__, "--daemon")) as m:
        names = _listing(m.mountpoint)  # built once: the kernel got an entry of every name
        per_open = []
        for epoch in range(4):
            order = random.Random(epoch).sample(names, len(names))
            before = requests._counts(m.process, counts)
            data = _read_all(order)
            per_open.append({k: v / len(order) for k, v in (requests._counts(m.process, counts) - before).items()})
            for name, got in zip(order, data, strict=True):
                assert by_bytes[got].split("/")[0] == os.path.relpath(name, m.mountpoint).split("/")[0]
        st = m.status()
    # (measured: 1.05-1.23 an open; before the listing's entries were dropped: 1.84 in the first epoch)
    assert max(p["lookup"] for p in per_open) < 1.4, per_open  # (a drop that lands after the name's next open: two)
    assert st["substitution"]["entries_dropped"] > len(names), st["substitution"]


def test_without_substitute_a_dataset_built_once_is_told_within_one_pass(mount_dirs):
    """The same dataset built once and read the same way on a mount without ``substitute``: its reads fall out of
    view, and the mount says so (status, log) once a pass-worth of them was read."""
    from tierfs.testing.harness import mounted

    mnt, cache = mount_dirs
    backing = Path(mnt).parent / "backing_s"
    files = _classes64(backing)
    with mounted(backing, mnt, cache, sum(files.values()), nm=4, rf=2, listing="all",
                 composition="stratified") as m:
        names = _listing(m.mountpoint)
        st0 = m.status()
        assert st0["loader"]["follows_view"] and len(names) == len(files)
        _read_all(random.Random(0).sample(names, st0["view_files"]))  # one pass-worth of a shuffled epoch
        st = m.status()
        assert st["passes_total"] == st0["passes_total"]  # (the pass did not end: most reads were out of view)
        assert st["loader"]["follows_view"] is False and "MountSampler" in st["loader"]["warning"]
        assert st["substitution"] == {"enabled": False, "substituted": 0, "rounds": 0, "entries_dropped": 0}
        assert m.stderr().count("does not follow the view") == 1

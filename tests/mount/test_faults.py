"""Faults and concurrency through real mounts (issues 11 and 19): never a hang, a crash or a wrong byte.

Every read that could hang runs in a thread with a deadline; a test that misses one aborts the FUSE connection
(``abort_connection``) so the stuck readers let go, and fails.  The ``mounted()`` helper aborts and unmounts
whatever is left, so no test leaves a mount or a process behind.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import pytest

from tierfs.testing.harness import abort_connection, make_dataset, mounted, wait_until


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _run_with_deadline(mnt: str, workers: list[Callable[[], None]], deadline_s: float) -> list[BaseException]:
    """Run ``workers`` in threads; a thread still running after the deadline is a hang: abort the connection
    (so it lets go), then fail.  Returns the exceptions the workers raised."""
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(w), daemon=True) for w in workers]
    for th in threads:
        th.start()
    end = time.monotonic() + deadline_s
    for th in threads:
        th.join(max(0.0, end - time.monotonic()))
    if any(th.is_alive() for th in threads):
        abort_connection(mnt)
        for th in threads:
            th.join(10)
        pytest.fail(f"a reader of {mnt} hung for more than {deadline_s} s (connection aborted)")
    return errors


def _disk_bytes(path: str) -> int:
    """The blocks a cache file holds, 0 once gone (a temp file renamed or a copy evicted between listdir and stat)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _status(m) -> dict:
    """status with a deadline: a status that hangs is a hung mount."""
    out: list[dict] = []
    _run_with_deadline(m.mountpoint, [lambda: out.append(m.status())], 10)
    return out[0]


# ------------------------------------------------------------------------------------------------ issue 11 A


def test_replacing_a_file_while_it_is_read_never_hangs_and_serves_whole_versions(tmp_path):
    """Issue 11 A: four readers of a 4 MiB file while it is replaced (other size) every 10 ms.  On the old code
    the daemon invalidated the inode on the trio thread and deadlocked on a page lock held by a READ."""
    backing, mnt = tmp_path / "b", tmp_path / "m"
    (backing / "a").mkdir(parents=True)
    mnt.mkdir()
    target = backing / "a" / "f.bin"
    rng = random.Random(0)
    versions = set()

    def write_version(i: int) -> None:
        data = os.urandom((4 << 20) + rng.randrange(-4096, 4096))
        versions.add(_sha(data))
        tmp = backing / "a" / f".new{i}"
        tmp.write_bytes(data)
        os.replace(tmp, target)

    write_version(0)
    stop = time.monotonic() + 4.0
    with mounted(backing, mnt, tmp_path / "c", "64M", nm=1, rf=1, view="full", revalidate="open") as m:
        path = m.path("a", "f.bin")
        seen: list[str] = []

        def reader() -> None:
            while time.monotonic() < stop:
                # (between a version's unlink and the next one's rename a clean ENOENT is fine)
                with contextlib.suppress(FileNotFoundError):
                    seen.append(_sha(_read(path)))

        def writer() -> None:
            i = 1
            while time.monotonic() < stop:
                write_version(i)
                i += 1
                time.sleep(0.01)

        errors = _run_with_deadline(str(mnt), [reader] * 4 + [writer], 60)
        assert not errors, errors
        assert seen
        assert set(seen) <= versions, "a read returned bytes of no version (mixed or short)"
        assert m.process.poll() is None
        assert _status(m)["view_files"] == 1


def _read_fd(fd: int) -> bytes:
    out = bytearray()
    while chunk := os.read(fd, 1 << 16):
        out += chunk
    return bytes(out)


@pytest.mark.parametrize(("old_size", "new_size"), [(24915, 4096), (5000, 40000)], ids=["smaller", "bigger"])
def test_a_reader_of_the_old_version_reads_it_whole_while_a_reader_of_the_new_one_asks_its_size(
        tmp_path, old_size, new_size):
    """A handle opened before a change reads the old version through the page cache; an open after the change
    finds it and reads the new version (direct_io), and its fstat after a read makes the kernel ask for the
    attributes again.  On the old code the answer was the new size, and the kernel cut the old reader's
    page-cache reads at a smaller one: test_abuse's readers got a truncated version under load.  Now the
    kernel keeps the old size until the old reader closes, and the new reader's direct reads are not cut by
    it (``bigger``: a new version larger than the size the kernel holds is still read whole).  The daemon's
    read path (passthrough=off): under passthrough the kernel takes no other file for an inode while an open
    reads its copy, so a new open gets the old copy until the old reader closes (test_passthrough.py)."""
    backing, mnt = tmp_path / "b", tmp_path / "m"
    backing.mkdir()
    mnt.mkdir()
    old, new = os.urandom(old_size), os.urandom(new_size)
    (backing / "f.bin").write_bytes(old)
    with mounted(backing, mnt, tmp_path / "c", "4M", nm=1, rf=1, revalidate="open", passthrough="off") as m:
        path = m.path("f.bin")
        got: dict[str, bytes | int] = {}

        def readers() -> None:
            fd_old = os.open(path, os.O_RDONLY)  # never changed yet: reads through the page cache
            try:
                (backing / "f.tmp").write_bytes(new)
                os.replace(backing / "f.tmp", backing / "f.bin")
                fd_new = os.open(path, os.O_RDONLY)  # finds the change (revalidate=open)
                try:
                    got["new"] = _read_fd(fd_new)
                    os.fstat(fd_new)  # (after a read the kernel asks for the attributes again)
                finally:
                    os.close(fd_new)
                got["old"] = _read_fd(fd_old)
            finally:
                os.close(fd_old)
            # the old reader closed: its pages and size go, and the kernel learns the new size
            wait_until(lambda: os.stat(path).st_size == new_size, what="the new size")
            got["again"] = _read(path)

        assert not _run_with_deadline(str(mnt), [readers], 60)
        assert got["new"] == new
        assert got["old"] == old, f"the old version's reader got {len(got['old'])} of its {old_size} bytes"
        assert got["again"] == new


# ------------------------------------------------------------------------------------------------ issue 11 B


def test_files_held_across_switches_never_lose_their_copies(tmp_path):
    """Issue 11 B: a copy evicted while open kept its name; the same file staged again reused it, and the old
    handle's release unlinked the new copy: ENOENT for real files, then the pusher died."""
    backing, mnt = tmp_path / "b", tmp_path / "m"
    files = make_dataset(backing, dirs=8, files_per_dir=40, min_size=1, max_size=16 << 10, seed=5)
    mnt.mkdir()
    with mounted(backing, mnt, tmp_path / "c", "6M", nm=8, rf=1) as m:
        held = []
        for _ in range(24):
            listed = [f"{d}/{n}" for d in sorted(os.listdir(mnt)) for n in os.listdir(mnt / d)]
            for rel in listed[:3]:
                held.append(open(m.path(rel), "rb"))  # noqa: SIM115 - held across switches on purpose
            m.control("next-pass\n")
        for f in held:
            f.read()
            f.close()

        def read_all() -> None:
            for rel, size in files.items():
                assert len(_read(m.path(rel))) == size, rel

        assert not _run_with_deadline(str(mnt), [read_all], 120)
        # 64 readers re-listing the root every pass while others hold files across switches
        stop = time.monotonic() + 4.0

        def lister() -> None:
            while time.monotonic() < stop:
                for d in os.listdir(mnt):
                    for n in os.listdir(mnt / d):
                        rel = f"{d}/{n}"
                        assert len(_read(m.path(rel))) == files[rel]

        def switcher() -> None:
            while time.monotonic() < stop:
                with open(m.path(next(iter(files))), "rb"):
                    m.control("next-pass\n")
                time.sleep(0.05)

        errors = _run_with_deadline(str(mnt), [lister] * 63 + [switcher], 120)
        assert not errors, errors[:3]
        assert m.process.poll() is None
        st = _status(m)
        assert st["passes_total"] >= 24 and st["last_error"] is None


# ------------------------------------------------------------------------------------------------ issue 11 C


@pytest.mark.alone  # (it drops the kernel's caches, every mount's: others count their requests, page-cache hits)
@pytest.mark.parametrize("verify", ["xxhash", "size-mtime"])
def test_a_damaged_copy_is_never_served_or_lent_and_is_staged_again(tmp_path, verify):
    from tierfs.direct import cached_path

    backing, mnt = tmp_path / "b", tmp_path / "m"
    files = make_dataset(backing, dirs=2, files_per_dir=4, min_size=8192, max_size=16384, seed=2)
    mnt.mkdir()
    with mounted(backing, mnt, tmp_path / "c", "4M", nm=1, rf=1000, verify=verify) as m:
        wait_until(lambda: _status(m)["next_ready"])
        rel = sorted(files)[0]
        copy = cached_path(m.path(rel))
        assert copy is not None or verify == "xxhash"  # xxhash: not lent before its first check
        if copy is None:
            data = os.path.join(m.cache, "data")
            copy = next(os.path.join(data, n) for n in os.listdir(data)
                        if _read(os.path.join(data, n)) == _read(backing / rel))
        with open(copy, "r+b") as f:  # flip one byte in the cache dir
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0xFF]))
        subprocess.run(["sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches"], check=False)
        lent = cached_path(m.path(rel))
        assert lent != copy  # never lent (None, or a fresh copy staged since)
        if lent is not None:
            assert _read(lent) == _read(backing / rel)
        assert _read(m.path(rel)) == _read(backing / rel)  # never served
        st = _status(m)
        assert st["cache_repairs"] >= 1
        wait_until(lambda: cached_path(m.path(rel)) is not None or verify == "xxhash")  # staged again
        for r in files:
            assert _read(m.path(r)) == _read(backing / r)
        assert m.process.poll() is None




# ------------------------------------------------------------------------------------------------ issue 11 D


def test_a_bind_mount_inside_the_backing_dir_is_not_listed(tmp_path):
    backing, mnt, secret = tmp_path / "b", tmp_path / "m", tmp_path / "secret"
    make_dataset(backing, dirs=1, files_per_dir=2, seed=1)
    secret.mkdir()
    (secret / "shadow").write_bytes(b"root:hash\n")
    (backing / "inner").mkdir()
    (backing / "class_000" / "file.bind").write_bytes(b"")
    mnt.mkdir()
    binds = [backing / "inner", backing / "class_000" / "file.bind"]
    subprocess.run(["mount", "--bind", str(secret), str(binds[0])], check=True)
    subprocess.run(["mount", "--bind", str(secret / "shadow"), str(binds[1])], check=True)
    try:
        with mounted(backing, mnt, tmp_path / "c", "4M", nm=1, view="full") as m:
            assert "inner" not in os.listdir(mnt)
            assert "file.bind" not in os.listdir(mnt / "class_000")
            for p in ("inner/shadow", "inner", "class_000/file.bind"):
                with pytest.raises(FileNotFoundError):
                    os.stat(m.path(p))
            assert all(b"root:hash" not in _read(m.path("class_000", n)) for n in os.listdir(mnt / "class_000"))
    finally:
        for b in binds:
            subprocess.run(["umount", "-l", str(b)], check=False)


# ------------------------------------------------------------------------------------------------ issue 19 A


def test_cached_opens_make_no_backing_call(tmp_path):
    backing, mnt = tmp_path / "b", tmp_path / "m"
    make_dataset(backing, dirs=4, files_per_dir=8, seed=3)
    mnt.mkdir()
    for revalidate, calls in (("60", lambda n: n == 0), ("open", lambda n: n > 0)):
        with mounted(backing, mnt, tmp_path / f"c{revalidate}", "16M", nm=1, rf=100,
                     revalidate=revalidate) as m:
            wait_until(lambda: _status(m)["next_ready"] and _status(m)["staging"]["inflight"] == 0)
            before = _status(m)
            listed = [f"{d}/{n}" for d in sorted(os.listdir(mnt)) for n in os.listdir(mnt / d)]
            for _ in range(3):
                for rel in listed:
                    assert _read(m.path(rel)) == _read(backing / rel)
            after = _status(m)
            assert after["reads"]["hits"] - before["reads"]["hits"] == 3 * len(listed)
            assert calls(after["backing"]["requests"] - before["backing"]["requests"]), (revalidate, after["backing"])


# ------------------------------------------------------------------------------------------------ issue 19 B


@pytest.mark.alone  # (timed: a status read under a stall answers within 1 s)
def test_a_stalled_backing_leaves_cached_files_served_and_status_answering(tmp_path):
    """The backing is itself a FUSE mount whose daemon is SIGSTOPped (an NFS server that stops answering)."""
    data, inner, outer = tmp_path / "data", tmp_path / "inner", tmp_path / "outer"
    files = make_dataset(data, dirs=4, files_per_dir=8, seed=4)
    inner.mkdir()
    outer.mkdir()
    with mounted(data, inner, tmp_path / "ci", "64M", policy="lru") as back:
        try:
            with mounted(inner, outer, tmp_path / "co", "64M", nm=4, rf=1000, backing_timeout=2) as m:
                wait_until(lambda: _status(m)["next_ready"] and _status(m)["staging"]["inflight"] == 0)
                cached = [f"{d}/{n}" for d in sorted(os.listdir(outer)) for n in os.listdir(outer / d)]
                want = set(files)
                os.kill(back.process.pid, signal.SIGSTOP)
                try:
                    t0 = time.monotonic()

                    def read_cached() -> None:
                        for rel in cached:
                            assert _read(m.path(rel)) == _read(data / rel)

                    assert not _run_with_deadline(str(outer), [read_cached], 20)
                    uncached = sorted(want - set(cached))[0]
                    result: list[BaseException | bytes] = []

                    def read_uncached() -> None:
                        try:
                            result.append(_read(m.path(uncached)))
                        except OSError as exc:
                            result.append(exc)

                    th = threading.Thread(target=read_uncached, daemon=True)
                    th.start()
                    time.sleep(1.5)
                    t1 = time.monotonic()
                    st = _status(m)
                    assert time.monotonic() - t1 < 1.0, "status took a second or more during a stall"
                    assert st["backing"]["state"] == "stalled" and st["backing"]["waiting"] >= 1
                    th.join(10)
                    assert not th.is_alive()
                    assert isinstance(result[0], OSError) and result[0].errno == errno.EIO  # after backing_timeout
                    assert time.monotonic() - t0 < 15
                finally:
                    os.kill(back.process.pid, signal.SIGCONT)
                wait_until(lambda: _status(m)["backing"]["state"] == "ok")
                assert _read(m.path(uncached)) == _read(data / uncached)  # recovered
                assert m.process.poll() is None
        finally:
            os.kill(back.process.pid, signal.SIGCONT)


# ------------------------------------------------------------------------------------------------ issue 19 C


def test_a_cache_dir_that_others_damage_is_a_cache_miss(tmp_path):
    backing, mnt = tmp_path / "b", tmp_path / "m"
    files = make_dataset(backing, dirs=4, files_per_dir=10, min_size=4096, max_size=32768, seed=6)
    mnt.mkdir()
    with mounted(backing, mnt, tmp_path / "c", "8M", nm=1, rf=1000) as m:
        wait_until(lambda: _status(m)["next_ready"] and _status(m)["staging"]["inflight"] == 0)
        data = os.path.join(m.cache, "data")
        names = sorted(os.listdir(data))
        for n in names[:5]:
            os.unlink(os.path.join(data, n))
        for n in names[5:10]:
            os.truncate(os.path.join(data, n), 100)

        def read_all() -> None:
            for rel in files:
                assert _read(m.path(rel)) == _read(backing / rel), rel

        assert not _run_with_deadline(str(mnt), [read_all], 60)
        assert _status(m)["cache_repairs"] >= 10
        # (the repaired copies staged again first: an rm -rf racing the stager's writes ends "Directory not empty")
        wait_until(lambda: _status(m)["next_ready"] and _status(m)["staging"]["inflight"] == 0)
        subprocess.run(["rm", "-rf", data], check=True)  # a cleaner takes the whole data dir
        assert not _run_with_deadline(str(mnt), [read_all], 60)
        # recreated, everything staged again
        wait_until(lambda: os.path.isdir(data) and _status(m)["cache_files"] == len(files), timeout=90)
        assert not _run_with_deadline(str(mnt), [read_all], 60)
        assert m.process.poll() is None


# ------------------------------------------------------------------------------------------------ issue 19 G


def test_the_fd_limit_is_raised_and_running_out_is_that_callers_error(tmp_path):
    backing, mnt = tmp_path / "b", tmp_path / "m"
    files = make_dataset(backing, dirs=2, files_per_dir=60, min_size=1, max_size=1024, seed=7)
    mnt.mkdir()
    with mounted(backing, mnt, tmp_path / "c", "4M", nm=1, rf=1000, wrapper=("prlimit", "--nofile=64:4096")) as m:
        assert _status(m)["fd_limit"] == 4096  # raised from 64 at start
    with mounted(backing, mnt, tmp_path / "c2", "4M", nm=1, rf=1000, wrapper=("prlimit", "--nofile=48:48")) as m:
        held, refused = [], 0

        def hold() -> None:
            nonlocal refused
            for rel in sorted(files):
                try:
                    held.append(open(m.path(rel), "rb"))  # noqa: SIM115
                except OSError as exc:
                    assert exc.errno in (errno.EMFILE, errno.ENFILE), exc
                    refused += 1

        assert not _run_with_deadline(str(mnt), [hold], 60)
        assert refused > 0 and held
        for f in held:
            f.close()
        assert m.process.poll() is None
        for rel in files:
            assert _read(m.path(rel)) == _read(backing / rel)
        st = _status(m)
        assert st["fd_limit"] == 48 and st["handles"] == 0


# -------------------------------------------------------------------------------------------- the cap on disk


def test_the_cap_counts_disk_blocks_and_sparse_copies_stay_sparse(tmp_path):
    backing, mnt = tmp_path / "b", tmp_path / "m"
    (backing / "small").mkdir(parents=True)
    for i in range(300):
        (backing / "small" / f"{i:03d}.bin").write_bytes(os.urandom(512))
    (backing / "big").mkdir()
    sparse = backing / "big" / "sparse.bin"
    with open(sparse, "wb") as f:
        f.truncate(256 << 20)
        f.seek(128 << 20)
        f.write(b"x" * 4096)
    mnt.mkdir()
    capacity = 600 * 4096
    with mounted(backing, mnt, tmp_path / "c", capacity, nm=2, rf=1000) as m:
        data = os.path.join(m.cache, "data")
        peak = 0
        end = time.monotonic() + 30
        while time.monotonic() < end:
            used = sum(_disk_bytes(os.path.join(data, n)) for n in os.listdir(data))
            peak = max(peak, used)
            st = _status(m)
            if st["next_ready"] and st["staging"]["inflight"] == 0:
                break
            time.sleep(0.01)
        assert peak <= capacity
        st = _status(m)
        assert st["cache_bytes"] <= capacity and st["cache_bytes"] > st["cache_logical_bytes"] - (256 << 20)
        big = [n for n in os.listdir(data) if os.stat(os.path.join(data, n)).st_size == 256 << 20]
        if big:  # staged in one of the first two mini-epochs: its copy keeps the holes
            assert os.stat(os.path.join(data, big[0])).st_blocks * 512 < 1 << 20
        with open(m.path("big", "sparse.bin"), "rb") as f:
            f.seek(128 << 20)
            assert f.read(4096) == b"x" * 4096
        assert json.loads(json.dumps(st))["cache_capacity"] == capacity

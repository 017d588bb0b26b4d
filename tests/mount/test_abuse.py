"""The rest of issue 11's fault table through real mounts: kills during staging, other users, many opens,
readers during switches while the backing changes."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from sampler.atomic import TEMP_PREFIX
from tierfs.testing.harness import abort_connection, make_dataset, mounted


def _read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()




def test_kill_9_during_staging_never_serves_a_partial_copy_and_resumes(tmp_path):
    backing, mnt, cache = tmp_path / "b", tmp_path / "m", tmp_path / "c"
    files = make_dataset(backing, dirs=4, files_per_dir=10, min_size=64 << 10, max_size=256 << 10, seed=9)
    mnt.mkdir()
    rng = random.Random(3)
    where: tuple[int, int, int] | None = None
    for round_ in range(5):
        with mounted(backing, mnt, cache, "8M", nm=4, rf=2, bandwidth="4M") as m:
            for rel in sorted(files)[round_::7]:
                assert _read(m.path(rel)) == _read(backing / rel)  # whatever was left, never a partial copy
            data = cache / "data"
            assert not any(n.startswith(TEMP_PREFIX) for n in os.listdir(data))  # temps purged at mount
            st = m.status()
            if where is not None:
                assert (st["epoch"], st["mini_epoch"], st["pass"]) == where  # the position journalled before
            m.control("next-pass\n")
            time.sleep(0.5)  # the journal is written off the serving thread: let it land
            st = m.status()
            where = (st["epoch"], st["mini_epoch"], st["pass"])
            time.sleep(rng.uniform(0.0, 0.4))  # into the staging of the next mini-epoch (paced by bandwidth)
            os.kill(m.process.pid, signal.SIGKILL)
            m.process.wait(10)
            abort_connection(mnt)


def _as_nobody(*argv: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *argv],
                          capture_output=True, timeout=30)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user")
def test_other_users_get_eacces_or_the_backing_modes(tmp_path):
    backing = tmp_path / "b"
    (backing / "d").mkdir(parents=True)
    (backing / "d" / "public").write_bytes(b"everyone")
    (backing / "d" / "private").write_bytes(b"root only")
    os.chmod(backing / "d" / "private", 0o600)
    outer = tempfile.mkdtemp(prefix="tierfs-users-", dir="/tmp")  # pytest's tmp dirs are 0700: out of reach
    os.chmod(outer, 0o755)
    mnt = Path(outer) / "m"
    mnt.mkdir()
    try:
        _check_other_users(backing, mnt, tmp_path)
    finally:
        shutil.rmtree(outer, ignore_errors=True)


def _check_other_users(backing: Path, mnt: Path, tmp_path: Path) -> None:
    with mounted(backing, mnt, tmp_path / "c", "4M", nm=1, view="full"):
        res = _as_nobody("cat", str(mnt / "d" / "public"))
        assert res.returncode != 0 and b"Permission denied" in res.stderr  # no allow_other: nobody else
    with mounted(backing, mnt, tmp_path / "c2", "4M", nm=1, view="full", allow_other=True) as m:
        assert _as_nobody("cat", str(mnt / "d" / "public")).stdout == b"everyone"
        res = _as_nobody("cat", str(mnt / "d" / "private"))
        assert res.returncode != 0 and b"Permission denied" in res.stderr  # the backing file's mode holds
        res = _as_nobody("sh", "-c", f"echo rf=9 > '{mnt}/.tierfs/control'")
        assert res.returncode != 0 and b"Permission denied" in res.stderr
        assert m.status()["rf"] != 9
        res = _as_nobody("cat", str(mnt / ".tierfs" / "status"))  # it names files: the owner's (test_users.py)
        assert res.returncode != 0 and b"Permission denied" in res.stderr
        assert b"tierfs_view_files 2.0\n" in _as_nobody("cat", str(mnt / ".tierfs" / "metrics")).stdout


def test_many_open_close_cycles_do_not_grow_memory_or_descriptors(tmp_path):
    backing, mnt = tmp_path / "b", tmp_path / "m"
    files = make_dataset(backing, dirs=2, files_per_dir=20, max_size=4096, seed=4)
    mnt.mkdir()
    paths = [str(mnt / rel) for rel in files]

    def rss_and_fds(pid: int) -> tuple[int, int]:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))

    with mounted(backing, mnt, tmp_path / "c", "4M", nm=1, rf=10**6) as m:
        for p in paths * 25:  # warm up: everything staged, every code path taken
            _read(p)
        rss0, fds0 = rss_and_fds(m.process.pid)
        for p in paths * 150:  # 6,000 cycles (the soak runs 100k)
            fd = os.open(p, os.O_RDONLY)
            os.read(fd, 64)
            os.close(fd)
        rss1, fds1 = rss_and_fds(m.process.pid)
        assert rss1 < rss0 * 1.10, (rss0, rss1)
        assert fds1 <= fds0 + 2, (fds0, fds1)


def test_readers_during_switches_and_backing_changes_get_whole_versions(tmp_path):
    """Files replaced, grown, shrunk, deleted and turned into directories while 8 readers read them and the
    mini-epochs turn over: every read is one whole version (or ENOENT for a file deleted), never a mix."""
    backing, mnt = tmp_path / "b", tmp_path / "m"
    files = make_dataset(backing, dirs=4, files_per_dir=12, max_size=32 << 10, seed=8)
    versions: dict[str, set[str]] = {rel: {hashlib.sha256(_read(backing / rel)).hexdigest()} for rel in files}
    lock = threading.Lock()
    mnt.mkdir()
    problems: list[str] = []
    with mounted(backing, mnt, tmp_path / "c", "4M", nm=4, rf=1, revalidate="open") as m:
        stop = time.monotonic() + 5.0  # (from the mount on: a slow mount must not eat the readers' time)

        def reader(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop:
                rel = rng.choice(sorted(files))
                try:
                    data = _read(m.path(rel))
                except FileNotFoundError:
                    continue
                except IsADirectoryError:
                    continue
                got = hashlib.sha256(data).hexdigest()
                with lock:
                    if got not in versions[rel]:
                        problems.append(f"{rel}: {len(data)} bytes, {data[:8].hex()}")

        def writer() -> None:
            rng = random.Random(1)
            victims = sorted(files)[:12]
            while time.monotonic() < stop:
                rel = rng.choice(victims)
                path = backing / rel
                op = rng.randrange(4)
                with lock:
                    if path.is_dir():
                        os.rmdir(path)
                    if op == 3:
                        os.unlink(path) if path.exists() else None
                        os.mkdir(path)  # a file turned into a directory
                        continue
                    data = os.urandom(rng.choice([10, 4096, 40000]))
                    versions[rel].add(hashlib.sha256(data).hexdigest())
                tmp = path.with_suffix(".tmp")
                tmp.write_bytes(data)
                os.replace(tmp, path)
                time.sleep(0.005)

        def switcher() -> None:
            while time.monotonic() < stop:
                m.control("advance\n" if random.random() < 0.5 else "next-pass\n")
                time.sleep(0.1)

        threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(8)]
        threads += [threading.Thread(target=writer, daemon=True), threading.Thread(target=switcher, daemon=True)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(max(0.0, stop + 60 - time.monotonic()))
        if any(th.is_alive() for th in threads):
            abort_connection(mnt)
            pytest.fail("a reader hung")
        assert not problems, problems[:5]
        assert m.process.poll() is None
        assert m.status()["passes_total"] > 0

"""Timestamps at the edges, through real mounts (issue 48, items 1 and 2): never the old bytes.

* an mtime past 2262-04-11 (above 2**63 ns, which ext4, xfs bigtime and btrfs store) on a file rewritten during
  the mount: the old code's revalidator died on it every second and its copy was served for the mount's life;
* two rewrites within one second on a backing with 1-second timestamps (ext4 made with ``-I 128``, loop-mounted:
  the fingerprint cannot tell them apart): the old code committed the first rewrite's copy and served it to every
  later open, even under ``revalidate=open``.

Every read through the mount runs with a deadline (:func:`~tierfs.testing.harness.within`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time

import pytest

from tierfs.testing.harness import mounted, wait_until, within

YEAR_2300_NS = 10_413_792_000 * 10**9  # 2300-01-01T00:00:00Z: above 2**63 ns


def _read(mnt: str, path: str) -> bytes:
    def read() -> bytes:
        with open(path, "rb") as f:
            return f.read()

    out = within(mnt, read)
    if isinstance(out, OSError):
        raise out
    assert isinstance(out, bytes)
    return out


def _copies(cache) -> set[str]:
    """The committed copies in the cache's ``data/`` (temp files left out)."""
    with contextlib.suppress(FileNotFoundError):
        return {n for n in os.listdir(os.path.join(cache, "data")) if not n.startswith(".tmp-")}
    return set()


@pytest.mark.parametrize("revalidate", ["open", "1"])
def test_a_rewrite_dated_2300_is_served_new(tmp_path, revalidate):
    """A cached file rewritten (same size, other bytes) and dated 2300-01-01 (``touch -d``): the next reads get
    the new bytes, and nothing failed on the way (no traceback in the log, no ``last_error``)."""
    backing, mnt = tmp_path / "b", tmp_path / "m"
    (backing / "a").mkdir(parents=True)
    mnt.mkdir()
    target = backing / "a" / "f.bin"
    old = os.urandom(50_000)
    target.write_bytes(old)
    probe = backing / "probe"
    probe.touch()
    os.utime(probe, ns=(YEAR_2300_NS, YEAR_2300_NS))
    if os.stat(probe).st_mtime_ns != YEAR_2300_NS:
        pytest.skip("the filesystem under tmp_path does not store a 2300 mtime")
    probe.unlink()
    with mounted(backing, mnt, tmp_path / "c", "4M", nm=1, rf=100, revalidate=revalidate) as m:
        path = m.path("a", "f.bin")
        assert _read(m.mountpoint, path) == old
        wait_until(lambda: _copies(m.cache), timeout=20, what="the copy to land")
        new = bytes(b ^ 0x5A for b in old)
        with open(target, "r+b") as f:
            f.write(new)
        os.utime(target, ns=(YEAR_2300_NS, YEAR_2300_NS))
        wait_until(lambda: _read(m.mountpoint, path) == new, timeout=20, what="the new bytes through the mount")
        time.sleep(1.5)  # (what the revalidator and staging do with it meanwhile: the new bytes still)
        assert _read(m.mountpoint, path) == new
        assert os.stat(path).st_size == len(new)
        status = m.status()
        assert not status["last_error"], status["last_error"]
        assert "Traceback" not in m.stderr()
        assert "OverflowError" not in m.stderr()


@contextlib.contextmanager
def _one_second_ext4(tmp_path):
    """A 32 MiB ext4 with 128-byte inodes (1-second timestamps), loop-mounted at ``tmp_path/ext4``."""
    if os.geteuid() != 0 or shutil.which("mkfs.ext4") is None:
        pytest.skip("needs root and mkfs.ext4 to loop-mount an ext4 with 1-second timestamps")
    image, where = tmp_path / "ext4.img", tmp_path / "ext4"
    where.mkdir()
    with open(image, "wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-I", "128", str(image)], check=True, capture_output=True,
                   timeout=60)
    made = subprocess.run(["mount", "-o", "loop", str(image), str(where)], capture_output=True, text=True,
                          timeout=60)
    if made.returncode != 0:
        pytest.skip(f"cannot loop-mount here: {made.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=60)


def _start_of_a_second() -> None:
    """Sleep until just after a wall-clock second begins (what the backing's 1-second timestamps count)."""
    time.sleep(1.02 - time.time() % 1.0)


def test_same_second_rewrites_on_a_1_second_backing_are_never_served_stale(tmp_path):
    """On a backing with 1-second timestamps, under ``revalidate=open``: rewrite a file in place, open it through
    the mount (the change is found and a copy starts at once), rewrite it again within the same second.  Both
    rewrites have the same fingerprint (size, mtime, inode, ctime), so a copy made of the first must never be
    committed: every later open reads the second, at once and a few seconds on."""
    with _one_second_ext4(tmp_path) as backing:
        (backing / "a").mkdir()
        size = 40_000
        target = backing / "a" / "f.bin"
        target.write_bytes(os.urandom(size))
        mnt = tmp_path / "m"
        mnt.mkdir()
        with mounted(backing, mnt, tmp_path / "c", "4M", nm=1, rf=100, revalidate="open") as m:
            path = m.path("a", "f.bin")
            assert _read(m.mountpoint, path) == target.read_bytes()
            wait_until(lambda: _copies(m.cache), timeout=20, what="the first copy to land")
            assert os.stat(target).st_ctime_ns % 10**9 == 0  # (the backing really has 1-second timestamps)
            tried = 0
            for _ in range(4):
                _start_of_a_second()
                first, second = os.urandom(size), os.urandom(size)
                with open(target, "r+b") as f:
                    f.write(first)
                before = _copies(m.cache)
                assert _read(m.mountpoint, path) == first  # finds the change: a copy of it starts now
                # (on the old code it lands within milliseconds: waited for, up to a third of the second)
                with contextlib.suppress(AssertionError):
                    wait_until(lambda before=before: _copies(m.cache) - before, timeout=0.3, what="a copy")
                stamp = os.stat(target).st_ctime_ns
                with open(target, "r+b") as f:
                    f.write(second)
                if os.stat(target).st_ctime_ns != stamp:
                    continue  # (the second ended in between: not the race; try again)
                tried += 1
                assert _read(m.mountpoint, path) == second, "the first rewrite's bytes were served"
                time.sleep(1.2)  # (the tick is over: whatever staging committed by now)
                assert _read(m.mountpoint, path) == second, "the first rewrite's bytes were served a second on"
            assert tried >= 3, "too few rewrites fell within one second to test anything"
            assert not m.status()["last_error"]

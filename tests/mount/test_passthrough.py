"""Kernel passthrough for cached copies (issue 49): the kernel reads a cached file from its copy itself -- the bytes
are the backing file's, no READ reaches the daemon, one copy sits in the page cache -- and its rule (one backing
file per inode while any passthrough open of it lives, no passthrough open beside a plain one) never costs a
reader an EIO: a file that changes, a copy evicted under an open file, an open served from the backing while its
copy lands.  Where passthrough cannot work, the mount serves as before and ``status.passthrough`` says why."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tierfs.testing.harness import make_dataset, mounted, read_bytes, wait_until, within

try:
    import pyfuse3

    PATCHED = hasattr(pyfuse3, "backing_open")
except ImportError:  # pragma: no cover
    PATCHED = False

ROOT = os.getuid() == 0
pytestmark = pytest.mark.skipif(not (ROOT and PATCHED), reason="needs root and the pyfuse3 of scripts/pyfuse3")


def _cached_mount(tmp_path, **options):
    backing = tmp_path / "b"
    files = make_dataset(backing, dirs=2, files_per_dir=4, max_size=256 << 10, seed=4)
    (tmp_path / "m").mkdir()
    options = {"nm": 1, "rf": 100, "passthrough": "all", **options}  # (all: these files are under 1 MiB)
    return backing, files, mounted(backing, tmp_path / "m", tmp_path / "c", 3 * sum(files.values()) + (1 << 20),
                                   **options)


def _page_cache_kb() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Cached:"))


def test_cached_opens_are_served_by_the_kernel_from_the_copies(tmp_path):
    backing, files, mount = _cached_mount(tmp_path)
    with mount as m:
        wait_until(lambda: m.status()["next_ready"], what="the mini-epoch staged")
        served = m.status()["push"]["pushed_bytes"]
        for f in files:
            assert within(m.mountpoint, lambda f=f: read_bytes(m.path(f))) == read_bytes(str(backing / f)), f
        st = m.status()
        assert st["passthrough"]["state"] == "on", st["passthrough"]
        assert st["passthrough"]["opens"] == len(files) and st["passthrough"]["registered"] == len(files)
        assert st["push"]["pushed_bytes"] == served  # (nothing pushed into the mount's page cache: no use)
        # mmap reads the copy too
        import mmap

        f0 = sorted(files)[0]
        with open(m.path(f0), "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            assert mm[:] == read_bytes(str(backing / f0))
        # a second pass reuses each copy's registration
        for f in files:
            within(m.mountpoint, lambda f=f: read_bytes(m.path(f)))
        assert m.status()["passthrough"]["registrations"] == len(files)


def test_a_file_changed_under_a_passthrough_open_never_costs_an_eio(tmp_path):
    """A new open while the old copy's passthrough open lives gets that copy (the kernel would EIO any other
    file); once the last of them is released, the next open gets the new version."""
    backing, files, mount = _cached_mount(tmp_path, revalidate="open")
    with mount as m:
        wait_until(lambda: m.status()["next_ready"], what="the mini-epoch staged")
        f = sorted(files)[0]
        old = read_bytes(str(backing / f))
        fd = within(m.mountpoint, lambda: os.open(m.path(f), os.O_RDONLY))
        try:
            assert within(m.mountpoint, lambda: os.pread(fd, len(old) + 10, 0)) == old
            new = b"the new version " * 999
            (backing / f).write_bytes(new)
            time.sleep(0.05)
            assert within(m.mountpoint, lambda: read_bytes(m.path(f))) == old  # (no EIO; a whole version)
            assert within(m.mountpoint, lambda: os.pread(fd, len(old) + 10, 0)) == old
        finally:
            os.close(fd)
        wait_until(lambda: within(m.mountpoint, lambda: read_bytes(m.path(f))) == new,
                   what="the new version once the old copy's opens were released")


def test_a_copy_evicted_under_an_open_file_stays_whole_and_its_registration_goes(tmp_path):
    backing = tmp_path / "b"
    files = make_dataset(backing, dirs=4, files_per_dir=6, max_size=64 << 10, seed=6)
    (tmp_path / "m").mkdir()
    total = sum(files.values())
    with mounted(backing, tmp_path / "m", tmp_path / "c", total // 2 + (1 << 20), nm=4, rf=1,
                 advance="strict", passthrough="all") as m:
        from tierfs.client import Client

        wait_until(lambda: m.status()["next_ready"], what="the mini-epoch staged")
        order = [p.decode() for p in within(m.mountpoint, lambda: Client(m.mountpoint).order())]
        held = order[0]
        fd = within(m.mountpoint, lambda: os.open(m.path(held), os.O_RDONLY))
        try:
            passes = m.status()["passes_total"]
            for _ in range(6):  # (more mini-epochs than the cache holds: the held file's copy is evicted)
                for rel in [p.decode() for p in within(m.mountpoint, lambda: Client(m.mountpoint).order())]:
                    got = within(m.mountpoint, lambda rel=rel: read_bytes(m.path(rel)))
                    assert got == read_bytes(str(backing / rel)), rel
                wait_until(lambda: m.status()["passes_total"] > passes, what="the pass to end")  # noqa: B023
                passes = m.status()["passes_total"]
            assert within(m.mountpoint, lambda: os.pread(fd, 1 << 20, 0)) == read_bytes(str(backing / held))
        finally:
            os.close(fd)
        st = m.status()
        assert st["passthrough"]["opens"] > 0 and st["passthrough"]["state"] == "on"
        # no registration outlives its copy: at most one per copy kept, far fewer than were made
        wait_until(lambda: m.status()["passthrough"]["registered"] <= m.status()["cache_files"],
                   what="the evicted copies' registrations dropped")
        assert m.status()["passthrough"]["registrations"] > m.status()["passthrough"]["registered"]
        assert m.status()["cache_bytes"] <= m.status()["cache_capacity"]


def test_an_open_served_from_the_backing_keeps_later_opens_plain_until_it_is_released(tmp_path):
    """policy=lru serves a big file's first open from the backing while its copy is made beside it: a second
    open after the copy landed, while the first lives, must be served by the daemon too (the kernel refuses a
    passthrough open beside a plain one); once both are released, the copy is opened in passthrough."""
    backing = tmp_path / "b"
    backing.mkdir()
    data = os.urandom(6 << 20)
    (backing / "big.bin").write_bytes(data)
    (tmp_path / "m").mkdir()
    with mounted(backing, tmp_path / "m", tmp_path / "c", 64 << 20, policy="lru") as m:
        fd = within(m.mountpoint, lambda: os.open(m.path("big.bin"), os.O_RDONLY))
        try:
            wait_until(lambda: m.status()["cache_files"] == 1, what="the copy made beside the reader")
            assert within(m.mountpoint, lambda: read_bytes(m.path("big.bin"))) == data  # (no EIO)
            assert m.status()["passthrough"]["opens"] == 0
            assert within(m.mountpoint, lambda: os.pread(fd, len(data), 0)) == data
        finally:
            os.close(fd)
        wait_until(lambda: within(m.mountpoint, lambda: read_bytes(m.path("big.bin"))) == data
                   and m.status()["passthrough"]["opens"] == 1, what="a passthrough open once the others went")


@pytest.mark.alone  # (it measures the machine's page cache: other tests' files move it)
def test_one_copy_of_a_cached_file_in_the_page_cache(tmp_path):
    """Reading a cached file through the mount adds at most its copy's pages to the page cache, never a second
    copy (the mount's own pages, as a daemon-served open does)."""
    backing = tmp_path / "b"
    backing.mkdir()
    size = 256 << 20
    with open(backing / "big.bin", "wb") as f:
        f.write(os.urandom(1 << 20) * (size >> 20))
    (tmp_path / "m").mkdir()
    ratios = {}
    for mode in ("off", "auto"):
        with mounted(backing, tmp_path / "m", tmp_path / f"c-{mode}", 3 * size, nm=1, passthrough=mode) as m:
            wait_until(lambda: m.status()["next_ready"], timeout=120, what="the copy staged")
            before = _page_cache_kb()
            within(m.mountpoint, lambda: subprocess.run(["cat", m.path("big.bin")], stdout=subprocess.DEVNULL,
                                                        check=True), seconds=120)
            ratios[mode] = (_page_cache_kb() - before) * 1024 / size
    # The copy's own pages are there or not as staging left them, the same both times; a daemon-served open adds
    # the mount's own copy on top.  (The page cache moves with everything else on the machine: bands.)
    assert ratios["auto"] <= 1.2 and ratios["off"] - ratios["auto"] >= 0.7, ratios


def test_passthrough_off_says_so_and_serves(tmp_path):
    """(A daemon without CAP_SYS_ADMIN cannot be run here: /dev/fuse is root's alone and a setuid fusermount3
    needs the capability in the bounding set; tests/unit/test_backing_ids.py gives its EPERM to the part.)"""
    backing, files, mount = _cached_mount(tmp_path, passthrough="off")
    with mount as m:
        wait_until(lambda: m.status()["next_ready"], what="staged")
        for f in files:
            assert within(m.mountpoint, lambda f=f: read_bytes(m.path(f))) == read_bytes(str(backing / f))
        st = m.status()
        assert st["passthrough"]["state"] == "off (passthrough=off)" and st["passthrough"]["opens"] == 0
        assert st["passthrough"]["plain_opens"] == len(files)


def test_a_cache_on_a_stacked_filesystem_says_so_and_serves(tmp_path):
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (lower, upper, work, merged):
        d.mkdir()
    try:
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={lower},upperdir={upper},workdir={work}", str(merged)], check=True,
                       capture_output=True, timeout=30)
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"no overlayfs here: {exc}")
    try:
        backing = tmp_path / "b"
        files = make_dataset(backing, dirs=1, files_per_dir=3, max_size=32 << 10, seed=8)
        (tmp_path / "m").mkdir()
        with mounted(backing, tmp_path / "m", merged / "cache", 3 * sum(files.values()) + (1 << 20), nm=1,
                     passthrough="all") as m:
            wait_until(lambda: m.status()["next_ready"], what="staged")
            for f in files:
                assert within(m.mountpoint, lambda f=f: read_bytes(m.path(f))) == read_bytes(str(backing / f))
            state = m.status()["passthrough"]["state"]
            assert state.startswith("off (ELOOP") and "stacked" in state, state
    finally:
        subprocess.run(["umount", "-l", str(merged)], check=False, timeout=30)


def test_auto_leaves_files_under_1_mib_to_the_daemon_and_its_pushes(tmp_path):
    backing = tmp_path / "b"
    files = make_dataset(backing, dirs=1, files_per_dir=4, max_size=64 << 10, seed=9)
    (backing / "big.bin").write_bytes(os.urandom(2 << 20))
    (tmp_path / "m").mkdir()
    with mounted(backing, tmp_path / "m", tmp_path / "c", 16 << 20, nm=1, rf=100, passthrough="auto") as m:
        wait_until(lambda: m.status()["next_ready"], what="staged")
        for f in [*files, "big.bin"]:
            assert within(m.mountpoint, lambda f=f: read_bytes(m.path(f))) == read_bytes(str(backing / f)), f
        st = m.status()["passthrough"]
        assert (st["state"], st["opens"], st["plain_opens"], st["registered"]) == ("on", 1, len(files), 1), st
